"""Multi-model swap traces: one seeded trace replayed against corral once per eviction policy.

Synthetic chat models of several sizes and a small embedding model; a memory limit
(CORRAL_MEMORY_LIMIT) that holds about half of them; a trace from corral.bench.trace
compressed to a short replay. Requests are sent open-loop at their (compressed) times through
the OpenAI routes (streamed chat with a few tokens, embeddings), so llama.cpp's router mode can
take the very same requests. Loads and evictions come from corral's log; bytes loaded are what
each loaded model really holds (measured first, in a calibration run without a limit); queue
wait is time to first token less the runner's own prompt time. Beside each policy: the
offline optimum (Belady) for the same trace, limit and sizes, from corral.bench.trace.simulate.

Side by side: llama.cpp's router mode (`llama-server --models-dir`, corral.bench.llama_build
finds or builds one) replays the same trace at every `--models-max` from 1 to the number of
models, since it caps only the number of loaded models. For every replay a thread sums the
proportional set size (PSS, /proc/PID/smaps_rollup) of the server's child processes (corral's
runners; the router's model instances) every 100 ms (`bench/pss.py`): a row that holds more
than corral's memory limit is marked, as a lower latency bought with memory is not a win.

Three variants: quick loads (small models read from the page cache, as written), realistic
loads (models twice as big, read cold from disk: every file is dropped from the page cache
before the replay and again whenever no process maps it any more, as on a machine whose RAM
cannot cache the models it evicted), both with one slot per model on each side, and the quick
loads again with slots automatic on both sides (corral with no CORRAL_NUM_PARALLEL, the router
with no -np: 4 slots on a unified cache), as each serves with no settings.
"""

from __future__ import annotations

import asyncio
import math
import os
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from corral.bench.common import (
    EVICT_LINE,
    MIB,
    Goal,
    Say,
    Scale,
    Section,
    Table,
    logged_loads,
    mib,
    ms,
    safe_div,
    sse_objects,
    summary,
    wait_until,
)
from corral.bench.llama_build import HOW_TO_GET, serving
from corral.bench.pss import SAMPLE_EVERY, MemorySampler, drop_files
from corral.bench.trace import CHAT, EMBED, OFFLINE, TraceEvent, generate_trace, simulate
from corral.core.estimate import RUNNER_CODE_BYTES, Estimate
from corral.core.policy import DEFAULT_POLICY
from corral.testing import synth
from corral.testing.server import start_corral

SEED = 20250101
EMBED_NAME = "embed"
MAX_TOKENS = 4
ENV = {
    "CORRAL_CONTEXT_LENGTH": "512", "CORRAL_NUM_PARALLEL": "1", "CORRAL_KEEP_ALIVE": "1h",
    "CORRAL_BUILTIN_MODELS": "0", "CORRAL_MEMORY_MARGIN": "0", "CORRAL_QUEUE_TIMEOUT": "10m",
}  # fmt: skip
_TOKEN = re.compile(rb'"content":"(?:[^"\\]|\\.)')
_ROUTER_LOAD = re.compile(r"spawning server instance with name=(\S+) on port")
_ROUTER_EVICT = re.compile(r"(?:removing|evicting idle) LRU name=(\S+)")
OVER = "over the limit: not a win"


def write_models(models_dir: Path, sizes_mb: tuple[int, ...], say: Say) -> list[str]:
    """Chat models `chat-<N>m` of about N MiB each, and the embedding model; their names."""
    names = []
    for i, mb in enumerate(sizes_mb):
        name = f"chat-{mb}m"
        path = models_dir / f"{name}.gguf"
        if not path.exists():
            say(f"swap: writing {path.name}")
            synth.write_llama_model(path, target_bytes=mb * MIB, context_length=2048, seed=i)
        names.append(name)
    synth.write_bert_model(models_dir / f"{EMBED_NAME}.gguf")
    return names


def variant_env(slots: str) -> dict[str, str]:
    """corral's settings for a variant: ENV with its slots ("1", or "auto": corral's own)."""
    return {**ENV, "CORRAL_NUM_PARALLEL": slots}


def estimated_sizes(
    models_dir: Path, names: list[str], env: Mapping[str, str] = ENV
) -> dict[str, Estimate]:
    """What corral estimates for each model's runner when a request arrives."""
    from corral.bench.cold import runner_spec
    from corral.core.estimate import estimate
    from corral.core.gguf import read_model_info

    out = {}
    for name in names:
        spec = runner_spec(models_dir, name, dict(env))
        out[name] = estimate(read_model_info(spec.path), spec.n_ctx, spec.num_parallel)
    return out


# The workload's memory limit is half of what its models need with this much per runner
# process: fixed apart from corral's own bookkeeping, so that runs compare across versions.
LIMIT_PROCESS_BYTES = 32 * MIB


def calibrate(
    models_dir: Path, names: list[str], work: Path, say: Say, cold: bool = False,
    env: Mapping[str, str] = ENV, tag: str = "",
) -> dict[str, Any]:
    """Load every model once without a memory limit: what each really holds (corral's books
    once loaded) and how long its load took (`cold`: its file dropped from the page cache
    first)."""
    server = start_corral(models_dir, work / f"swap-calibrate{tag}.log", dict(env))
    sizes, seconds = {}, {}
    try:
        # One discarded load and unload first: the first runner start pays for cold caches.
        server.client.post("/api/generate", json={"model": names[0]}).raise_for_status()
        server.client.post("/api/generate", json={"model": names[0], "keep_alive": 0})
        wait_until(lambda: not server.ps(), 60, "the first model to unload")
        for name in names:
            say(f"swap: calibrating {name}")
            if cold:
                drop_files([models_dir / f"{name}.gguf"])
            t0 = time.perf_counter()
            if name == EMBED_NAME:
                r = server.client.post("/api/embed", json={"model": name, "input": []})
            else:
                r = server.client.post("/api/generate", json={"model": name})
            r.raise_for_status()
            seconds[name] = time.perf_counter() - t0
            sizes[name] = next(m["size"] for m in server.ps() if m["name"].startswith(name + ":"))
    finally:
        server.stop()
    return {"sizes": sizes, "load_seconds": seconds}


def _messages(e: TraceEvent) -> list[dict[str, str]]:
    """A session's conversation so far (its last three turns), deterministic per event."""
    out: list[dict[str, str]] = []
    for turn in range(max(0, e.turn - 2), e.turn + 1):
        topic = (e.session * 7 + turn) % 13
        question = f"Session {e.session}, question {turn}: tell me about topic {topic}."
        out.append({"role": "user", "content": question})
        if turn < e.turn:
            out.append({"role": "assistant", "content": "Here is a short answer."})
    return out


async def replay(
    url: str, trace: list[TraceEvent], factor: float, ids: dict[str, str] | None = None
) -> list[dict[str, Any]]:
    """Send every event at `t * factor` seconds from now (open loop); one result each. `ids`
    maps a trace's model name to the name the server knows it by (default: the same)."""
    import aiohttp

    ids = ids or {}

    loop = asyncio.get_running_loop()
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as s:
        t0 = loop.time() + 0.2

        async def one(e: TraceEvent) -> dict[str, Any]:
            at = e.t * factor
            await asyncio.sleep(max(0.0, t0 + at - loop.time()))
            res: dict[str, Any] = {"model": e.model, "kind": e.kind, "at": at, "ok": False}
            start = time.perf_counter()
            first = math.nan
            try:
                if e.kind == EMBED:
                    text = f"document {e.session} {e.turn} {at:.3f}"
                    payload = {"model": ids.get(e.model, e.model), "input": text}
                    async with s.post(url + "/v1/embeddings", json=payload) as r:
                        data = await r.read()
                        res["status"] = r.status
                else:
                    body: dict[str, Any] = {
                        "model": ids.get(e.model, e.model), "messages": _messages(e),
                        "max_tokens": MAX_TOKENS,
                        "temperature": 0, "seed": 1, "stream": True,
                        "stream_options": {"include_usage": True},
                    }  # fmt: skip
                    chunks: list[bytes] = []
                    async with s.post(url + "/v1/chat/completions", json=body) as r:
                        res["status"] = r.status
                        async for chunk in r.content.iter_any():
                            if math.isnan(first) and _TOKEN.search(b"".join(chunks[-1:]) + chunk):
                                first = time.perf_counter()
                            chunks.append(chunk)
                    data = b"".join(chunks)
                end = time.perf_counter()
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as ex:
                res["error"] = f"{type(ex).__name__}: {ex}"
                return res
            res["latency"] = end - start
            if res["status"] != 200:
                res["error"] = data[:200].decode(errors="replace")
                return res
            res["ok"] = True
            if e.kind == CHAT:
                res["ttft"] = (first if not math.isnan(first) else end) - start
                prompt_ms = 0.0
                for o in sse_objects(data):
                    timings = o.get("timings")
                    if isinstance(timings, dict):
                        prompt_ms = float(timings.get("prompt_ms", 0.0))
                res["wait"] = max(0.0, res["ttft"] - prompt_ms / 1e3)
            return res

        return list(await asyncio.gather(*(one(e) for e in trace)))


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in results if r["ok"]]
    waits = [r["wait"] for r in ok if "wait" in r]
    lat = [r["latency"] for r in ok]
    errors = [r.get("error", "") for r in results if not r["ok"]]
    return {
        "requests": len(results), "ok": len(ok), "errors": len(errors),
        "first_errors": errors[:3], "wait": summary(waits), "latency": summary(lat),
        "chat_latency": summary([r["latency"] for r in ok if r["kind"] == CHAT]),
        "embed_latency": summary([r["latency"] for r in ok if r["kind"] == EMBED]),
        # Request by request (in --json only), to see what a tail waited for: [sent at, model,
        # latency, wait (chat: time to first token less the runner's prompt time), ok].
        "per_request": [
            [round(r["at"], 3), r["model"], _r3(r.get("latency")), _r3(r.get("wait")), r["ok"]]
            for r in results
        ],
    }  # fmt: skip


def _r3(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def replay_corral(
    models_dir: Path, policy: str, budget: int, trace: list[TraceEvent], factor: float,
    real: dict[str, int], work: Path, cold: bool = False, tag: str = "", slots: str = "1",
) -> dict[str, Any]:  # fmt: skip
    """The trace against corral with `policy` and a memory limit of `budget` bytes; the
    runners' PSS sampled throughout (`cold`: model files read from disk, see MemorySampler)."""
    env = {**variant_env(slots), "CORRAL_EVICTION_POLICY": policy,
           "CORRAL_MEMORY_LIMIT": str(budget)}  # fmt: skip
    if cold:
        drop_files(sorted(models_dir.glob("*.gguf")))
    load_avg = os.getloadavg()[0]
    server = start_corral(models_dir, work / f"swap-{policy}{tag}.log", env)
    sampler = MemorySampler(server.proc.pid, budget, drop_unmapped=cold).start()
    try:
        results = asyncio.run(replay(server.url, trace, factor))
    finally:
        memory = sampler.stop()
        server.stop()
    log = server.log()
    loads = logged_loads(log)
    out = summarize(results)
    out |= {
        "memory": memory,
        "load_average": round(load_avg, 2),
        "loads": len(loads),
        "evictions": len(EVICT_LINE.findall(log)),
        "bytes_loaded": sum(real.get(m, 0) for m in loads),
        "loads_per_model": {m: loads.count(m) for m in sorted(set(loads))},
    }
    return out


def replay_router(
    binary: str, models_dir: Path, models_max: int, trace: list[TraceEvent], factor: float,
    real: dict[str, int], work: Path, limit: int = 0, cold: bool = False, tag: str = "",
    slots: str = "1",
) -> dict[str, Any]:  # fmt: skip
    """The same trace against llama.cpp's router mode (`llama-server --models-dir`); loads and
    evictions are counted from its log (a model instance spawned, an LRU one removed), the PSS
    of its model instances is sampled against `limit` (corral's memory limit)."""
    import httpx

    # The embedding model needs --embeddings in its instance only: a models preset says so.
    preset = work / "swap-router-presets.ini"
    preset.write_text(f"version = 1\n\n[{EMBED_NAME}]\nembeddings = true\n")
    args = [
        "--models-dir", str(models_dir), "--models-max", str(models_max),
        "--models-preset", str(preset), "-c", ENV["CORRAL_CONTEXT_LENGTH"],
    ]  # fmt: skip
    if slots != "auto":  # without -np: llama-server's own -1, 4 slots on a unified cache
        args += ["-np", slots]
    if cold:
        drop_files(sorted(models_dir.glob("*.gguf")))
    load_avg = os.getloadavg()[0]
    log_path = work / f"swap-router-{models_max}{tag}.log"
    ready = "llama-server (router mode) to start"
    with serving(binary, args, log_path, "/models", 60, ready) as (proc, url):
        listed = [str(m["id"]) for m in httpx.get(url + "/models", timeout=5).json()["data"]]
        ids = router_ids(listed, {e.model for e in trace})
        sampler = MemorySampler(proc.pid, limit, drop_unmapped=cold)
        sampler.start()
        try:
            results = asyncio.run(replay(url, trace, factor, ids))
        finally:
            memory = sampler.stop()
    text = log_path.read_text(errors="replace")
    back = {v: k for k, v in ids.items()}
    stems = [back.get(m, m) for m in _ROUTER_LOAD.findall(text)]
    out = summarize(results)
    out |= {
        "memory": memory,
        "load_average": round(load_avg, 2),
        "models_max": models_max,
        "loads": len(stems),
        "evictions": len(_ROUTER_EVICT.findall(text)),
        "bytes_loaded": sum(real.get(m, 0) for m in stems),
        "loads_per_model": {m: stems.count(m) for m in sorted(set(stems))},
    }
    return out


def router_ids(listed: Sequence[str], names: set[str]) -> dict[str, str]:
    """The id llama-server's /models gives each of the trace's models."""
    ids: dict[str, str] = {}
    for name in sorted(names):
        match = [i for i in listed if i in (name, f"{name}.gguf")]
        match = match or [i for i in listed if Path(i).stem.startswith(name)]
        if not match:
            raise RuntimeError(f"llama-server does not list {name}: {list(listed)}")
        ids[name] = match[0]
    return ids


# --------------------------------------------------------------------------- report


def peak_cell(memory: Mapping[str, Any] | None) -> str:
    """`peak PSS (ratio to the limit)`, marked when the peak is over the limit."""
    if not memory or not memory.get("samples"):
        return "n/a"
    peak, limit = int(memory["peak_pss"]), int(memory["limit"])
    cell = f"{mib(peak)} ({safe_div(peak, limit):.2f}x)"
    return f"{cell} **{OVER}**" if peak > limit else cell


def within_limit(r: Mapping[str, Any]) -> bool:
    mem = r.get("memory") or {}
    return bool(mem.get("samples")) and int(mem["peak_pss"]) <= int(mem["limit"])


def replay_table(
    title: str, replays: Mapping[str, Mapping[str, Any]], best_loads: int, best_bytes: int
) -> Table:
    """One row per replay (corral's policies, the router at each --models-max): loads, bytes
    loaded (offline optimum in parentheses), waits, latency, peak memory against the limit."""
    table = Table(
        title,
        ["replay", "ok/requests", "loads", "evictions", "loaded", "wait p50", "wait p95",
         "latency p50", "p95", "p99", "peak memory (PSS) / limit", "load avg"],
    )  # fmt: skip
    for label, r in replays.items():
        ev = r["evictions"]
        table.add(
            label, f"{r['ok']}/{r['requests']}", f"{r['loads']} ({best_loads})",
            "n/a" if isinstance(ev, float) else str(ev),
            f"{mib(r['bytes_loaded'])} ({mib(best_bytes)})", ms(r["wait"]["p50"], 1),
            ms(r["wait"]["p95"], 1), ms(r["latency"]["p50"], 1), ms(r["latency"]["p95"], 1),
            ms(r["latency"]["p99"], 1), peak_cell(r.get("memory")),
            r.get("load_average", "n/a"),
        )  # fmt: skip
    return table


def side_by_side_goals(
    variant: str, corral_label: str, corral: Mapping[str, Any],
    routers: Mapping[int, Mapping[str, Any]], best_bytes: int,
) -> tuple[list[Goal], list[str]]:  # fmt: skip
    """The issue's goals for one variant: fewer loads and lower p95 and p99 than the router at
    every --models-max whose peak memory stays within the limit, and bytes loaded within 1.2x
    of the offline optimum; and a line per router replay that held more than the limit."""
    goals: list[Goal] = []
    lines: list[str] = []
    c_lat = corral["latency"]
    c_mem = corral.get("memory") or {}
    if c_mem.get("samples") and not within_limit(corral):
        lines.append(f"{variant}: {corral_label} itself peaked at {peak_cell(c_mem)} of the limit")
    for k, r in sorted(routers.items()):
        if not within_limit(r):
            lines.append(
                f"{variant}: llama.cpp router --models-max {k} peaked at "
                f"{peak_cell(r.get('memory'))} ({r['loads']} loads, p95 "
                f"{ms(r['latency']['p95'], 0)}, p99 {ms(r['latency']['p99'], 0)}): not comparable"
            )
            continue
        r_lat = r["latency"]
        checks = [
            ("loads", corral["loads"] < r["loads"], f"{corral['loads']} vs {r['loads']}"),
            ("p95", c_lat["p95"] < r_lat["p95"],
             f"{ms(c_lat['p95'], 0)} vs {ms(r_lat['p95'], 0)}"),
            ("p99", c_lat["p99"] < r_lat["p99"],
             f"{ms(c_lat['p99'], 0)} vs {ms(r_lat['p99'], 0)}"),
        ]  # fmt: skip
        measured = ", ".join(f"{name} {text}" for name, _, text in checks)
        missed = [name for name, ok, _ in checks if not ok]
        if r["loads"] < corral["loads"] and r_lat["p99"] > c_lat["p99"]:
            lines.append(
                f"{variant}: llama.cpp router --models-max {k} made fewer loads than "
                f"{corral_label} ({r['loads']} vs {corral['loads']}) while requests for other "
                f"models waited (it evicts only idle models): p99 "
                f"{ms(r_lat['p99'], 0)} vs {ms(c_lat['p99'], 0)}, slowest request "
                f"{ms(r_lat.get('max', math.nan), 0)} vs {ms(c_lat.get('max', math.nan), 0)}"
            )
        goals.append(Goal(
            f"{variant}: {corral_label} makes fewer loads and has lower p95 and p99 latency than "
            f"llama.cpp's router at --models-max {k} (peak {peak_cell(r.get('memory'))}, within "
            "the limit)",
            measured, not missed, f"not lower: {', '.join(missed)}" if missed else "",
        ))  # fmt: skip
    ratio = safe_div(corral["bytes_loaded"], best_bytes)
    goal = f"{variant}: {corral_label} loads <= 1.2x the bytes of the offline optimum"
    text = f"{ratio:.2f}x ({mib(corral['bytes_loaded'])} vs {mib(best_bytes)})"
    if math.isnan(ratio):
        goals.append(Goal(goal, "n/a", None))
    else:
        goals.append(Goal(goal, text, ratio <= 1.2, f"missed by {ratio - 1.2:.2f}x"))
    return goals, lines


def verdicts(title: str, d: Mapping[str, Any]) -> tuple[list[Goal], list[str]]:
    """Goals and summary lines of one variant from its data (what a run stores in JSON), so a
    report can be derived again from a --json file."""
    replays: Mapping[str, Mapping[str, Any]] = d["replays"]
    best = d["simulations"][OFFLINE]
    mains = [k for k in replays if k.startswith("corral ")]
    main = f"corral {DEFAULT_POLICY}" if f"corral {DEFAULT_POLICY}" in replays else mains[0]
    routers = {int(r["models_max"]): r for r in replays.values() if "models_max" in r}
    label = f"corral ({main.removeprefix('corral ')})"
    goals, lines = side_by_side_goals(title, label, replays[main], routers, best["bytes_loaded"])
    summary = []
    for name, r in replays.items():
        extra = safe_div(r["loads"] - best["loads"], best["loads"]) * 100
        summary.append(
            f"{title}, {name}: {r['loads']} loads ({mib(r['bytes_loaded'])}) against "
            f"{best['loads']} ({mib(best['bytes_loaded'])}) for the offline optimum "
            f"({extra:+.0f}%); latency p50 {ms(r['latency']['p50'], 0)}, p95 "
            f"{ms(r['latency']['p95'], 0)}, p99 {ms(r['latency']['p99'], 0)}; peak "
            f"{peak_cell(r.get('memory'))}"
        )
    return goals, summary + lines


def refresh(sec: Section) -> Section:
    """`sec` (the swap section, e.g. read back from --json) with its goals and summary derived
    again from its data by this code."""
    sec.goals, sec.summary = [], []
    for key in VARIANTS:
        d = sec.data.get(key)
        if isinstance(d, dict) and "replays" in d:
            goals, summary = verdicts(str(d.get("title", key)), d)
            sec.goals += goals
            sec.summary += summary
    return sec


# --------------------------------------------------------------------------- the section


@dataclass(frozen=True)
class Variant:
    key: str  # one of VARIANTS
    title: str
    sizes_mb: tuple[int, ...]
    cold: bool
    policies: tuple[str, ...]
    slots: str = "1"  # each side's slots per model: "1", or "auto" (each server's own default)


VARIANTS = ("quick", "realistic", "auto")


def variants(scale: Scale) -> list[Variant]:
    """Quick loads (the scale's models, warm page cache, every policy); realistic loads (models
    twice as big, read cold from disk, corral's default policy); the quick loads with slots
    automatic on both sides (corral's default policy). Smoke runs only the first.
    CORRAL_BENCH_SWAP (a comma list of VARIANTS) picks some."""
    default = DEFAULT_POLICY if DEFAULT_POLICY in scale.swap_policies else None
    policy = (default,) if default else scale.swap_policies[:1]
    out = [Variant("quick", "quick loads (page cache)", scale.swap_sizes_mb, False,
                   scale.swap_policies)]  # fmt: skip
    if scale.name != "smoke":
        out.append(Variant(
            "realistic", "realistic loads (2x bigger, cold from disk)",
            tuple(2 * s for s in scale.swap_sizes_mb), True, policy,
        ))  # fmt: skip
        out.append(Variant(
            "auto", "quick loads, slots automatic", scale.swap_sizes_mb, False, policy, "auto"
        ))  # fmt: skip
    chosen = {k.strip() for k in os.environ.get("CORRAL_BENCH_SWAP", "").split(",") if k.strip()}
    if chosen - set(VARIANTS):
        raise ValueError(f"CORRAL_BENCH_SWAP: unknown {sorted(chosen - set(VARIANTS))}; "
                         f"variants: {', '.join(VARIANTS)}")  # fmt: skip
    return [v for v in out if v.key in chosen] if chosen else out


def run(scale: Scale, work: Path, say: Say) -> Section:
    from corral.bench.llama_build import llama_server

    sec = Section("swap", "Multi-model swap traces")
    binary: Path | None = None
    if scale.name == "smoke":
        origin = "not run in smoke runs"
    else:
        binary, origin = llama_server(say)
    sec.data = {"seed": SEED, "llama_server": {"binary": str(binary or ""), "origin": origin}}
    sec.data["p99_note"] = "p99 of a few hundred requests is near the maximum"
    for v in variants(scale):
        run_variant(v, scale, work, say, sec, binary)
    if binary is not None:
        sec.notes.append(f"llama.cpp router mode: {binary} ({origin})")
    else:
        sec.notes.append(
            f"llama.cpp router mode: skipped ({origin}; {HOW_TO_GET})"
        )
    sec.notes.append(
        f"peak memory: the summed PSS of the server's child processes (corral's runners; the "
        f"router's model instances, not the router itself), sampled every "
        f"{SAMPLE_EVERY * 1e3:.0f} ms, against corral's memory limit; a row marked "
        f'"{OVER}" held more than corral may, so whatever it gains there is bought with memory'
    )
    sec.notes.append(
        "ollama evicts the runner whose keep-alive runs out first; with one keep-alive for all "
        "models (as here) that is the least recently used, so lru and ollama make the same "
        "choices and any difference between their rows is run-to-run noise"
    )
    sec.notes.append(
        "Belady (evict the model used again farthest in the future) is the exact optimum when "
        "all models have one size; with different sizes it is the classic offline reference, "
        "not a proven bound, so an online policy can occasionally beat it. The replay runs "
        "requests concurrently (a model can be needed while another loads), the simulation "
        "one at a time, so their load counts differ."
    )
    return sec


def run_variant(
    v: Variant, scale: Scale, work: Path, say: Say, sec: Section, binary: Path | None
) -> None:
    """One variant's replays, tables, goals and data, added to `sec`."""
    models_dir = work / ("swap-models" if not v.cold else "swap-models-big")
    chat = write_models(models_dir, v.sizes_mb, say)
    names = [*chat, EMBED_NAME]
    env = variant_env(v.slots)
    tag = "-cold" if v.cold else "-auto" if v.slots == "auto" else ""
    estimates = estimated_sizes(models_dir, names, env)
    est = {n: e.total + e.process for n, e in estimates.items()}  # booked when requested
    cal = calibrate(models_dir, names, work, say, cold=v.cold, env=env, tag=tag)
    real: dict[str, int] = cal["sizes"]
    # About half of the models fit; always the biggest (as estimated) beside the embedder.
    half = sum(e.total + LIMIT_PROCESS_BYTES for e in estimates.values()) // 2
    budget = max(half, max(est.values()) + real[EMBED_NAME] + RUNNER_CODE_BYTES)
    long_model = chat[-2] if len(chat) > 1 else chat[0]  # a big model in a long session
    trace = generate_trace(
        SEED, scale.swap_requests, chat, embed_model=EMBED_NAME, long_session_model=long_model
    )
    factor = scale.swap_seconds / max(trace[-1].t, 1e-9)
    seq = [e.model for e in trace]
    times = [e.t * factor for e in trace]
    sims = {
        p: simulate(seq, est, budget - RUNNER_CODE_BYTES, p, loaded_sizes=real, times=times,
                    load_seconds=lambda m: cal["load_seconds"][m])
        for p in (*v.policies, OFFLINE)
    }  # fmt: skip
    best = sims[OFFLINE]
    models_table = Table(
        f"Models and trace, {v.title}",
        ["model", "file", "booked when loaded", "estimate", "load time", "requests in trace"],
    )
    for name in names:
        size = (models_dir / f"{name}.gguf").stat().st_size
        models_table.add(name, mib(size), mib(real[name]), mib(estimates[name].total),
                         f"{cal['load_seconds'][name]:.2f} s", seq.count(name))  # fmt: skip
    sec.tables.append(models_table)
    sec.notes.append(
        f"{v.title}: trace seed {SEED}, {len(trace)} requests over {scale.swap_seconds:g} s "
        f"(compressed {1 / factor:.1f}x), long session on {long_model}, memory limit "
        f"{mib(budget)} (all models: {mib(sum(real.values()))}); chat requests stream "
        f"{MAX_TOKENS} tokens"
        + ("; model files dropped from the page cache before each replay and whenever no "
           "process maps them" if v.cold else "")
    )  # fmt: skip
    replays: dict[str, dict[str, Any]] = {}
    for p in v.policies:
        say(f"swap ({v.key}): replaying {len(trace)} requests with corral, policy {p}")
        replays[f"corral {p}"] = replay_corral(
            models_dir, p, budget, trace, factor, real, work, cold=v.cold, tag=tag,
            slots=v.slots,
        )
    routers: dict[int, dict[str, Any]] = {}
    if binary is not None:
        for k in range(1, len(names) + 1):
            say(f"swap ({v.key}): replaying against llama.cpp's router, --models-max {k}")
            try:
                routers[k] = replay_router(
                    str(binary), models_dir, k, trace, factor, real, work, budget, v.cold, tag,
                    v.slots,
                )
            except (OSError, RuntimeError, TimeoutError) as e:
                sec.notes.append(f"{v.title}: llama.cpp router --models-max {k} failed: {e}")
                continue
            replays[f"llama.cpp router --models-max {k}"] = routers[k]
    sec.tables.append(replay_table(
        f"Replay, {v.title} (offline optimum in parentheses)", replays, best.loads,
        best.bytes_loaded,
    ))  # fmt: skip
    for label, r in replays.items():
        if r["errors"]:
            sec.notes.append(
                f"{v.title}, {label}: {r['errors']} failed requests, e.g. {r['first_errors'][:1]}"
            )
    sec.data[v.key] = {"title": v.title, "replays": replays, "simulations": {
        p: asdict(s) for p, s in sims.items()}}  # fmt: skip
    goals, lines = verdicts(v.title, sec.data[v.key])
    sec.goals += goals
    sec.summary += lines
    sim_table = Table(
        f"Offline simulation, {v.title}, one request at a time (corral's scheduler core)",
        ["policy", "loads", "evictions", "loaded"],
    )
    for p, s in sims.items():
        label = "belady (offline optimum)" if p == OFFLINE else p
        sim_table.add(label, s.loads, s.evictions, mib(s.bytes_loaded))
    sec.tables.append(sim_table)
    per_model = Table(f"Loads per model, {v.title}", ["replay", *names])
    for label, r in replays.items():
        per_model.add(label, *(r["loads_per_model"].get(n, 0) for n in names))
    sec.tables.append(per_model)
    sec.data[v.key] = {
        "budget": budget, "estimates": est, "calibration": cal, "sizes_mb": list(v.sizes_mb),
        "cold": v.cold,
        "trace": [[round(e.t * factor, 4), e.model, e.kind, e.session, e.turn] for e in trace],
        "replays": replays, "simulations": {p: asdict(s) for p, s in sims.items()},
        "title": v.title,
    }  # fmt: skip
