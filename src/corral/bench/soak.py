"""Soak: many clients over every API family against a real corral whose memory limit holds
about half of its models, with chaos; the runners' real memory sampled every 200 ms.

Black box: a real `corral serve` (corral.testing.server.start_corral) over synthetic llama
models of several sizes (corral.testing.synth), `CORRAL_MEMORY_LIMIT` set to about half of what
the models book in all (corral's own estimate plus the runner process, as the scheduler books a
load), a short `CORRAL_RUNNER_STALL_TIMEOUT`. N closed-loop clients send, for D seconds, a
random mix over every family: Ollama /api/chat and /api/generate, OpenAI /v1/chat/completions
and /v1/completions, Anthropic /v1/messages, OpenAI Responses /v1/responses, streamed or not,
with a few tokens each and a random model; some clients leave mid-stream; a few Ollama
requests flip `options.num_ctx` between two values, which reloads the model under load (each
is timed). Chaos: a busy runner is frozen with SIGSTOP (and left so: corral's watchdog must
kill it and its clients get an error), twice, and one is SIGKILLed mid-stream.

Every response is classified: complete (the family's own end: Ollama `done: true`, OpenAI
`[DONE]` or a finished object, Anthropic `message_stop`, Responses `response.completed` /
`response.incomplete`), an explicit error (a status >= 400 whose body has the family's error
shape and a message, or a mid-stream error in the family's shape), a client that left on
purpose, or BAD (200 then a stream that closes without the family's end or error, a
connection error, no answer in time, an error without a message). Goal: no BAD.

A sampler thread sums the proportional set size (PSS; RSS beside it) of the server's runner
processes every 200 ms; another polls /api/ps for the books (`bench/soakwatch.py`). The
requests and their classification are `bench/soakwire.py`. `run_soak` returns plain JSON
data; `format_report` prints it; `run` is the `corral bench soak` section.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import random
import re
import signal
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil

from corral.bench.common import (
    EVICT_LINE,
    MIB,
    Goal,
    Say,
    Scale,
    Section,
    Table,
    logged_loads,
    percentile,
    secs,
)
from corral.bench.soakwatch import MemoryWatch, alive
from corral.bench.soakwire import FAMILIES, Outcome, build_request, send
from corral.core.estimate import RUNNER_CODE_BYTES
from corral.testing import synth
from corral.testing.server import CorralServer, all_runner_pids, runner_pids, start_corral

PROMPTS = (
    "Tell me a short story about a fox.",
    "What is the capital of France?",
    "Write one line about the sea.",
    "List three colours.",
    "Explain recursion in a sentence.",
    "once upon a time",
)
STALL_LINE = "did not answer for"  # the watchdog's log line when it kills a runner


@dataclass(frozen=True)
class SoakConfig:
    duration: float = 60.0  # seconds during which clients start requests
    clients: int = 32
    sizes_mb: tuple[int, ...] = (4, 8, 12, 20, 30)  # one synthetic llama model each
    limit_share: float = 0.5  # CORRAL_MEMORY_LIMIT = this share of all models' bookings
    chaos: bool = True  # SIGSTOP a busy runner twice, SIGKILL one once
    stall_timeout: float = 5.0  # CORRAL_RUNNER_STALL_TIMEOUT, seconds
    queue_timeout: float = 10.0  # CORRAL_QUEUE_TIMEOUT, seconds
    num_parallel: int = 2
    context_length: int = 1024
    flip_ctx: tuple[int, int] = (512, 2048)  # options.num_ctx values the flipping requests use
    flip_share: float = 0.03  # share of requests that flip num_ctx (Ollama routes)
    disconnect_share: float = 0.1  # share of streamed requests whose client leaves mid-stream
    stream_share: float = 0.6
    zipf: float = 1.0  # model popularity ~ 1 / rank**zipf (0: uniform), ranks shuffled by seed
    max_tokens: tuple[int, int] = (4, 32)
    sample_every: float = 0.2  # seconds between PSS samples
    ps_every: float = 0.5  # seconds between /api/ps polls
    request_timeout: float = 60.0  # a request without an answer by then is BAD
    seed: int = 20251123


# Sizes of a `corral bench soak` run (the test runs the issue's: 60 s, 32 clients, 5 models).
CONFIGS = {
    "smoke": SoakConfig(duration=4.0, clients=4, sizes_mb=(4, 6), chaos=False),
    "quick": SoakConfig(duration=30.0, clients=16),
    "full": SoakConfig(),
}


# --------------------------------------------------------------------------- setup


def write_models(models_dir: Path, sizes_mb: tuple[int, ...], say: Say) -> list[str]:
    """Synthetic llama models `soak-<N>m` of about N MiB each; their names."""
    models_dir.mkdir(parents=True, exist_ok=True)
    names = []
    for i, mb in enumerate(sizes_mb):
        name = f"soak-{mb}m"
        path = models_dir / f"{name}.gguf"
        if not path.exists():
            say(f"soak: writing {path.name}")
            synth.write_llama_model(
                path, target_bytes=mb * MIB, context_length=2048, seed=100 + i, name=name
            )
        names.append(name)
    return names


def server_env(cfg: SoakConfig, limit: int | None) -> dict[str, str]:
    env = {
        "CORRAL_BUILTIN_MODELS": "0",
        "CORRAL_CONTEXT_LENGTH": str(cfg.context_length),
        "CORRAL_NUM_PARALLEL": str(cfg.num_parallel),
        "CORRAL_RUNNER_STALL_TIMEOUT": f"{cfg.stall_timeout:g}s",
        "CORRAL_QUEUE_TIMEOUT": f"{cfg.queue_timeout:g}s",
        "CORRAL_KEEP_ALIVE": "10m",
    }
    if limit is not None:
        env["CORRAL_MEMORY_LIMIT"] = str(limit)
    return env


def bookings(models_dir: Path, names: list[str], cfg: SoakConfig) -> dict[str, int]:
    """What corral books for each model at the default context when a request arrives: its
    estimate plus the runner process, computed by corral's own code."""
    from corral.bench.cold import runner_spec
    from corral.core import estimate as est
    from corral.core.gguf import read_model_info

    out = {}
    for name in names:
        spec = runner_spec(models_dir, name, server_env(cfg, None))
        info = read_model_info(spec.path)
        e = est.estimate(info, spec.n_ctx, spec.num_parallel, spec.kv_cache_type)
        out[name] = int(e.total + e.process)
    return out


# --------------------------------------------------------------------------- load


@dataclass
class Chaos:
    signal: str
    at: float  # seconds from the start of the soak
    pid: int
    model: str  # the model's name as the client sends it
    died_after: float | None = None  # seconds from the signal until the process was gone
    client_error_after: float | None = None  # seconds from the signal to a client's error
    client_error: str = ""
    found: bool = True  # False: no runner was busy in time, nothing was signalled


async def chaos_task(
    cfg: SoakConfig,
    server: CorralServer,
    client: httpx.AsyncClient,
    t0: float,
    watch: MemoryWatch,
    events: list[Chaos],
    rng: random.Random,
) -> None:
    """SIGSTOP a busy runner at 25% and 65% of the run (left stopped), SIGKILL one at 45%."""
    plan = [(0.25, signal.SIGSTOP), (0.45, signal.SIGKILL), (0.65, signal.SIGSTOP)]
    for share, sig in plan:
        await asyncio.sleep(max(0.0, t0 + share * cfg.duration - time.monotonic()))
        give_up = time.monotonic() + min(10.0, cfg.duration / 5)
        while time.monotonic() < give_up:
            try:
                models = (await client.get("/api/ps", timeout=5.0)).json()["models"]
            except (httpx.HTTPError, ValueError, KeyError):
                models = []
            ours = runner_pids(server.proc.pid)
            done = {e.pid for e in events}
            busy = [
                m for m in models
                if m.get("state") == "ready" and (m.get("requests_in_flight") or 0) > 0
                and m.get("pid") in ours and m.get("pid") not in done
            ]  # fmt: skip
            if busy:
                m = rng.choice(busy)
                os.kill(m["pid"], sig)
                name = str(m["model"]).removesuffix(":latest")
                events.append(Chaos(sig.name, time.monotonic() - t0, m["pid"], name))
                watch.watch_death(m["pid"])
                break
            await asyncio.sleep(0.05)
        else:
            events.append(Chaos(sig.name, time.monotonic() - t0, 0, "", found=False))


async def load(
    cfg: SoakConfig, server: CorralServer, names: list[str], watch: MemoryWatch
) -> tuple[list[Outcome], list[Chaos], float]:
    """The clients (and chaos); every request's outcome, the chaos events, the wall time."""
    rng = random.Random(cfg.seed)
    ranked = rng.sample(names, len(names))
    weights = [1 / (i + 1) ** cfg.zipf for i in range(len(ranked))]
    outcomes: list[Outcome] = []
    events: list[Chaos] = []
    flips = Counter[str]()
    limits = httpx.Limits(max_connections=cfg.clients + 8, max_keepalive_connections=cfg.clients)
    timeout = httpx.Timeout(cfg.request_timeout, connect=10.0)
    async with httpx.AsyncClient(base_url=server.url, limits=limits, timeout=timeout) as client:
        t0 = time.monotonic()
        watch.t0 = t0
        stop_at = t0 + cfg.duration

        async def one_client(i: int) -> None:
            crng = random.Random(cfg.seed * 1000 + i)
            await asyncio.sleep(crng.uniform(0, 0.5))  # do not all start in the same instant
            while time.monotonic() < stop_at:
                family = crng.choice(FAMILIES)
                model = crng.choices(ranked, weights)[0]
                stream = crng.random() < cfg.stream_share
                num_ctx = None
                if family.startswith("ollama") and crng.random() < cfg.flip_share * 3:
                    # (a third of the requests are Ollama's, so flip_share of all requests)
                    num_ctx = cfg.flip_ctx[flips[model] % 2]
                    flips[model] += 1
                n = crng.randint(*cfg.max_tokens)
                leave = stream and crng.random() < cfg.disconnect_share
                body = build_request(family, model, stream, n, crng.choice(PROMPTS), num_ctx)
                out = Outcome(family, stream, model, time.monotonic() - t0, num_ctx=num_ctx)
                out.sent_at = _clock()
                outcomes.append(out)
                try:
                    await asyncio.wait_for(
                        send(client, out, body, leave, t0), cfg.request_timeout + 5
                    )
                except asyncio.TimeoutError:
                    out.outcome = "bad"
                    out.reason = f"no answer within {cfg.request_timeout + 5:g}s"
                    out.latency = time.monotonic() - t0 - out.start
                await asyncio.sleep(crng.uniform(0, 0.05))

        tasks = [asyncio.create_task(one_client(i)) for i in range(cfg.clients)]
        if cfg.chaos:
            tasks.append(asyncio.create_task(
                chaos_task(cfg, server, client, t0, watch, events, rng)
            ))  # fmt: skip
        await asyncio.gather(*tasks)
        wall = time.monotonic() - t0
    for ev in events:
        if not ev.found:
            continue
        died = watch.watched.get(ev.pid)
        if died is not None:
            ev.died_after = round(died - (t0 + ev.at), 3)
        kind = "stopped responding" if ev.signal == "SIGSTOP" else "killed by signal 9"
        errs = [
            o for o in outcomes
            if o.outcome == "error" and o.model == ev.model and kind in o.message
            and o.start + o.latency >= ev.at
        ]  # fmt: skip
        if errs:
            first = min(errs, key=lambda o: o.start + o.latency)
            ev.client_error_after = round(first.start + first.latency - ev.at, 3)
            ev.client_error = first.message[:200]
    return outcomes, events, wall


# --------------------------------------------------------------------------- the run


def run_soak(work: Path, cfg: SoakConfig | None = None, say: Say | None = None) -> dict[str, Any]:
    """One soak run in `work` (models are written once and reused); its figures as JSON data.
    The server is stopped at the end; `leaked_runners` lists runners that outlived it."""
    cfg = cfg or SoakConfig()
    say = say or (lambda _msg: None)
    names = write_models(work / "soak-models", cfg.sizes_mb, say)
    booked = bookings(work / "soak-models", names, cfg)
    # (and the runners' shared code, which corral reserves once)
    limit = int(sum(booked.values()) * cfg.limit_share) + RUNNER_CODE_BYTES
    limit = max(limit, max(booked.values()) * 5 // 4 + RUNNER_CODE_BYTES)  # the biggest fits
    say(f"soak: {len(names)} models booking {sum(booked.values()) / MIB:.0f} MiB in all, "
        f"limit {limit / MIB:.0f} MiB; {cfg.clients} clients for {cfg.duration:g}s")  # fmt: skip
    log_path = work / "soak-corral.log"
    server = start_corral(work / "soak-models", log_path, server_env(cfg, limit))
    watch = MemoryWatch(server.proc.pid, server.url, limit, cfg.sample_every, cfg.ps_every)
    leaked: list[int] = []
    stopped_alive: list[int] = []
    try:
        watch.start()
        outcomes, events, wall = asyncio.run(load(cfg, server, names, watch))
        # The frozen runners the watchdog did not kill (they would hang their clients).
        stopped_alive = [e.pid for e in events if e.signal == "SIGSTOP" and alive(e.pid)]
    finally:
        watch.stop()
        pids = server.runners()
        server.stop()
        for pid in pids:
            with contextlib.suppress(psutil.Error):
                psutil.Process(pid).wait(10)
        leaked = sorted(pids & all_runner_pids())
        for pid in leaked:  # clean up after a failure: these are the soak server's runners
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
    log = log_path.read_text(errors="replace")
    result = summarize(cfg, names, booked, limit, outcomes, events, watch, log, wall)
    result["leaked_runners"] = leaked
    result["frozen_runners_not_killed"] = stopped_alive
    result["log"] = str(log_path)
    return result


def _pct(xs: list[float], p: float) -> float | None:
    v = percentile(xs, p)
    return None if math.isnan(v) else round(v, 4)


def summarize(
    cfg: SoakConfig,
    names: list[str],
    booked: dict[str, int],
    limit: int,
    outcomes: list[Outcome],
    events: list[Chaos],
    watch: MemoryWatch,
    log: str,
    wall: float,
) -> dict[str, Any]:
    by = Counter(o.outcome for o in outcomes)
    families = {}
    for fam in FAMILIES:
        mine = [o for o in outcomes if o.family == fam]
        c = Counter(o.outcome for o in mine)
        families[fam] = {
            "requests": len(mine), "complete": c["complete"], "errors": c["error"],
            "left": c["left"], "bad": c["bad"],
            "streamed": sum(o.stream for o in mine),
            "streamed_complete": sum(o.stream and o.outcome == "complete" for o in mine),
        }  # fmt: skip
    errors = [o for o in outcomes if o.outcome == "error"]
    errors_by_status = Counter(
        "200 mid-stream" if o.reason == "mid-stream" else str(o.status) for o in errors
    )
    messages = Counter(_gist(o.message) for o in errors)
    bad = [o for o in outcomes if o.outcome == "bad"]
    complete = [o.latency for o in outcomes if o.outcome == "complete"]
    s503 = [o for o in outcomes if o.status == 503]
    shed = [o for o in s503 if o.retry_after is not None]
    flips = [o for o in outcomes if o.num_ctx is not None]
    flips_done = [o.latency for o in flips if o.outcome == "complete"]
    stall_lines = [line for line in log.splitlines() if STALL_LINE in line]
    stops = [e for e in events if e.signal == "SIGSTOP" and e.found]
    return {
        "config": asdict(cfg),
        "models": names,
        "bookings": booked,
        "limit_bytes": limit,
        "bookings_total": sum(booked.values()),
        "wall_seconds": round(wall, 2),
        "requests": len(outcomes),
        "complete": by["complete"],
        "errors": by["error"],
        "left": by["left"],
        "bad": by["bad"],
        "errors_by_status": dict(errors_by_status.most_common()),
        "error_messages": dict(messages.most_common(12)),
        "bad_reasons": dict(Counter(_gist(o.reason) for o in bad).most_common()),
        "bad_examples": [asdict(o) for o in bad[:10]],
        "families": families,
        "latency_p50": _pct(complete, 50),
        "latency_p95": _pct(complete, 95),
        "latency_max": _pct(complete, 100),
        "status_503": {
            "count": len(s503),
            "with_retry_after": len(shed),
            "latency_p50": _pct([o.latency for o in s503], 50),
            "latency_max": _pct([o.latency for o in s503], 100),
            "with_retry_after_p50": _pct([o.latency for o in shed], 50),
            "with_retry_after_max": _pct([o.latency for o in shed], 100),
            "retry_after_values": dict(Counter(o.retry_after for o in shed).most_common(8)),
        },
        "reloads": {
            "requests": len(flips),
            "complete": len(flips_done),
            "failed": dict(
                Counter(
                    _gist(o.reason)
                    if o.outcome != "error"
                    else f"error {o.status}: {_gist(o.message)}"
                    for o in flips
                    if o.outcome != "complete"
                )
            ),
            "latency_p50": _pct(flips_done, 50),
            "worst": _pct(flips_done, 100),
            "each": [
                {
                    k: getattr(o, k)
                    for k in (
                        "model",
                        "num_ctx",
                        "sent_at",
                        "latency",
                        "status",
                        "outcome",
                        "message",
                    )
                }
                for o in flips
            ],
        },
        "memory": {
            "samples": watch.samples,
            "max_gap": round(watch.max_gap, 3),
            "peak_runners": watch.peak_runners,
            "peak_pss": watch.peak_pss,
            "peak_rss": watch.peak_rss,
            "peak_pss_ratio": round(watch.peak_pss / limit, 3),
            "peak_rss_ratio": round(watch.peak_rss / limit, 3),
            "pss_over_limit_samples": watch.pss_over_count,
            "rss_over_limit_samples": watch.rss_over_count,
            "pss_over_limit": watch.pss_over,
            "peak_pss_sample": watch.peak_pss_sample,
            "ps_polls": watch.ps_polls,
            "ps_failures": watch.ps_failures,
            "peak_booked": watch.peak_booked,
            "peak_booked_ratio": round(watch.peak_booked / limit, 3),
            "booked_over_limit": watch.booked_over,
            "peak_measured": watch.peak_measured,
        },
        "chaos": [asdict(e) for e in events],
        "chaos_missed": [f"{e.signal} at {e.at:.1f}s" for e in events if not e.found],
        "stalls_induced": len(stops),
        "stalls_in_log": len(stall_lines),
        "stall_log_lines": [line[-300:] for line in stall_lines[:10]],
        "stall_detection": [e.client_error_after for e in stops],
        "loads": len(logged_loads(log)),
        "evictions": len(EVICT_LINE.findall(log)),
        "tracebacks": log.count("Traceback (most recent call last)"),
    }


def _clock() -> str:
    """The wall clock as the server's log prints it (local time, milliseconds)."""
    now = time.time()
    return time.strftime("%H:%M:%S", time.localtime(now)) + f",{int(now % 1 * 1000):03d}"


def _gist(text: str) -> str:
    """A message's first line with its numbers and quoted names replaced (and a runner's log
    tail left out), so alike messages count as one."""
    text = text.split("\n", 1)[0].split("; last log lines:", 1)[0]
    text = re.sub(r"'[^']*'", "'…'", text)
    text = re.sub(r"\d+(\.\d+)?", "N", text)
    return text[:140]


# --------------------------------------------------------------------------- reporting


def _mib(n: float) -> str:
    return f"{n / MIB:.1f} MiB"


def _s(x: float | None) -> str:
    return "n/a" if x is None else secs(x)


def figures_table(r: dict[str, Any]) -> Table:
    mem, limit = r["memory"], r["limit_bytes"]
    t = Table("Soak figures", ["figure", "value"])
    cfg = r["config"]
    chaos = "on" if cfg["chaos"] else "off"
    t.add("run", f"{cfg['clients']} clients, {r['wall_seconds']:.0f} s, {len(r['models'])} "
          f"models ({', '.join(r['models'])}), chaos {chaos}")  # fmt: skip
    t.add("memory limit", f"{_mib(limit)} (models book {_mib(r['bookings_total'])} in all)")
    t.add("requests", r["requests"])
    t.add("complete", r["complete"])
    by_status = ", ".join(f"{k}: {v}" for k, v in r["errors_by_status"].items()) or "none"
    t.add("explicit errors", f"{r['errors']} ({by_status})")
    t.add("clients that left mid-stream", r["left"])
    t.add("BAD (goal 0)", r["bad"])
    t.add("peak PSS / limit", f"{_mib(mem['peak_pss'])} / {_mib(limit)} = "
          f"{mem['peak_pss_ratio']:.3f}x ({mem['pss_over_limit_samples']} of {mem['samples']} "
          "samples over)")  # fmt: skip
    t.add("peak RSS / limit", f"{_mib(mem['peak_rss'])} / {_mib(limit)} = "
          f"{mem['peak_rss_ratio']:.3f}x ({mem['rss_over_limit_samples']} over)")  # fmt: skip
    t.add("peak booked / limit", f"{_mib(mem['peak_booked'])} / {_mib(limit)} = "
          f"{mem['peak_booked_ratio']:.3f}x ({len(mem['booked_over_limit'])} of "
          f"{mem['ps_polls']} polls over)")  # fmt: skip
    t.add("peak runners at once", mem["peak_runners"])
    det = [x for x in r["stall_detection"] if x is not None]
    t.add("stalls induced / in the log", f"{r['stalls_induced']} / {r['stalls_in_log']}")
    died = [e["died_after"] for e in r["chaos"] if e["signal"] == "SIGSTOP" and e["found"]]
    t.add("stall detection (SIGSTOP to client error)",
          (", ".join(secs(x) for x in det) if det else "n/a")
          + f" (stall timeout {cfg['stall_timeout']:g} s; runner gone after "
          + (", ".join(_s(x) for x in died) or "n/a") + ")")  # fmt: skip
    if r["chaos_missed"]:
        t.add("chaos not done (no busy runner)", ", ".join(r["chaos_missed"]))
    kills = [e for e in r["chaos"] if e["signal"] == "SIGKILL" and e["found"]]
    t.add("SIGKILL mid-stream: client error after",
          ", ".join(_s(e["client_error_after"]) for e in kills) or "n/a")  # fmt: skip
    rl = r["reloads"]
    failed = "; ".join(f"{n}x {k}" for k, n in rl["failed"].items())
    t.add("options reloads (num_ctx flips)", f"{rl['complete']}/{rl['requests']} complete; "
          f"worst {_s(rl['worst'])}, p50 {_s(rl['latency_p50'])}"
          + (f"; not served: {failed}" if failed else ""))  # fmt: skip
    t.add("latency of complete requests", f"p50 {_s(r['latency_p50'])}, p95 "
          f"{_s(r['latency_p95'])}, max {_s(r['latency_max'])}")  # fmt: skip
    s5 = r["status_503"]
    t.add("503s", f"{s5['count']}; latency p50 {_s(s5['latency_p50'])}, max "
          f"{_s(s5['latency_max'])}")  # fmt: skip
    t.add("503s with Retry-After", f"{s5['with_retry_after']}; latency p50 "
          f"{_s(s5['with_retry_after_p50'])}, max {_s(s5['with_retry_after_max'])}")  # fmt: skip
    t.add("loads / evictions (server log)", f"{r['loads']} / {r['evictions']}")
    t.add("tracebacks in the server log", r["tracebacks"])
    t.add("runners left after the server stopped", len(r.get("leaked_runners", [])))
    return t


def families_table(r: dict[str, Any]) -> Table:
    t = Table("Per API family", ["family", "requests", "complete", "errors", "left", "BAD",
                                 "streamed (complete)"])  # fmt: skip
    for fam, f in r["families"].items():
        t.add(fam, f["requests"], f["complete"], f["errors"], f["left"], f["bad"],
              f"{f['streamed']} ({f['streamed_complete']})")  # fmt: skip
    return t


def format_report(r: dict[str, Any]) -> str:
    out = [figures_table(r).text(), "", families_table(r).text()]
    if r["error_messages"]:
        out += ["", "Errors by message:"]
        out += [f"  {n:5d}  {m}" for m, n in r["error_messages"].items()]
    if r["bad_reasons"]:
        out += ["", "BAD by reason:"]
        out += [f"  {n:5d}  {m}" for m, n in r["bad_reasons"].items()]
    return "\n".join(out)


def goals(r: dict[str, Any]) -> list[Goal]:
    mem = r["memory"]
    stops = r["stalls_induced"]
    det = [x for x in r["stall_detection"] if x is not None]
    bound = r["config"]["stall_timeout"] + 3
    out = [
        Goal("runners' summed PSS <= limit on every 200 ms sample",
             f"peak {mem['peak_pss_ratio']:.3f}x, {mem['pss_over_limit_samples']} of "
             f"{mem['samples']} samples over", mem["pss_over_limit_samples"] == 0,
             "" if not mem["pss_over_limit_samples"] else
             f"peak {_mib(mem['peak_pss'])} against {_mib(r['limit_bytes'])}"),
        Goal("every response complete or an explicit error (BAD = 0)",
             f"{r['bad']} BAD of {r['requests']}", r["bad"] == 0,
             "" if not r["bad"] else ", ".join(f"{v}x {k}" for k, v in r["bad_reasons"].items())),
        Goal("books within the limit on every /api/ps poll",
             f"peak {mem['peak_booked_ratio']:.3f}x over {mem['ps_polls']} polls",
             not mem["booked_over_limit"]),
    ]  # fmt: skip
    if stops:
        ok = len(det) == stops and max(det) <= bound
        out.append(Goal(
            f"a frozen runner's client gets an error within the stall timeout + 3 s ({bound:g} s)",
            ", ".join(secs(x) for x in det) or "no client error", ok,
            "" if ok else f"{stops - len(det)} of {stops} without a client error"
            if len(det) < stops else f"worst {secs(max(det))}",
        ))  # fmt: skip
    rl = r["reloads"]
    if rl["requests"]:
        out.append(Goal(
            "every options change (num_ctx flip) is served under load",
            f"{rl['complete']}/{rl['requests']}, worst {_s(rl['worst'])}",
            rl["complete"] == rl["requests"],
            "" if rl["complete"] == rl["requests"] else
            "; ".join(f"{n}x {k}" for k, n in rl["failed"].items()),
        ))  # fmt: skip
    out.append(Goal("no runner outlives the server", f"{len(r.get('leaked_runners', []))} left",
                    not r.get("leaked_runners")))  # fmt: skip
    return out


def run(scale: Scale, work: Path, say: Say) -> Section:
    """The `corral bench soak` section."""
    cfg = CONFIGS[scale.name]
    r = run_soak(work, cfg, say)
    sec = Section("soak", "Soak under a memory limit, with chaos")
    sec.tables += [figures_table(r), families_table(r)]
    if r["error_messages"]:
        sec.blocks.append(("Errors by message", "\n".join(
            f"{n:5d}  {m}" for m, n in r["error_messages"].items())))  # fmt: skip
    if r["bad_reasons"]:
        sec.blocks.append(("BAD by reason", "\n".join(
            f"{n:5d}  {m}" for m, n in r["bad_reasons"].items())))  # fmt: skip
    sec.goals += goals(r)
    rl = r["reloads"]
    sec.summary.append(
        f"{r['requests']} requests, {r['complete']} complete, {r['errors']} explicit errors, "
        f"{r['bad']} BAD; worst reload for an options change under load {_s(rl['worst'])}"
    )
    sec.notes.append(
        f"models book {', '.join(f'{n} {_mib(b)}' for n, b in r['bookings'].items())} "
        "(corral's estimate plus the runner process, at the default context)"
    )
    sec.data = _jsonable(r)
    return sec


def _jsonable(x: Any) -> Any:
    return json.loads(json.dumps(x, default=str))


def main(argv: list[str] | None = None) -> int:
    """`python -m corral.bench.soak [seconds] [clients]`: one soak, figures printed."""
    import sys
    import tempfile

    args = sys.argv[1:] if argv is None else argv
    cfg = SoakConfig(
        duration=float(args[0]) if args else 60.0, clients=int(args[1]) if len(args) > 1 else 32
    )
    say: Callable[[str], None] = lambda m: print(f"[soak] {m}", file=sys.stderr, flush=True)  # noqa: E731
    with tempfile.TemporaryDirectory(prefix="corral-soak-") as tmp:
        r = run_soak(Path(tmp), cfg, say)
        print(format_report(r))
    return 0 if r["bad"] == 0 and r["memory"]["pss_over_limit_samples"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
