"""Multi-model swap traces: one seeded trace replayed against corral once per eviction policy.

Synthetic chat models of several sizes and a small embedding model; a memory limit
(CORRAL_MEMORY_LIMIT) that holds about half of them; a trace from corral.bench.trace
compressed to a short replay. Requests are sent open-loop at their (compressed) times through
the OpenAI routes (streamed chat with a few tokens, embeddings), so llama.cpp's router mode can
take the very same requests. Loads and evictions come from corral's log; bytes loaded are what
each loaded model really holds (measured first, in a calibration run without a limit); queue
wait is time to first token less the runner's own prompt time. Beside each policy: the
offline optimum (Belady) for the same trace, limit and sizes, from corral.bench.trace.simulate.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import re
import subprocess
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from corral.bench.common import (
    MIB,
    Say,
    Scale,
    Section,
    Table,
    mib,
    ms,
    safe_div,
    sse_objects,
    summary,
    wait_until,
)
from corral.bench.trace import CHAT, EMBED, OFFLINE, TraceEvent, generate_trace, simulate
from corral.testing import synth
from corral.testing.server import free_port, start_corral

SEED = 20250101
EMBED_NAME = "embed"
MAX_TOKENS = 4
ENV = {
    "CORRAL_CONTEXT_LENGTH": "512", "CORRAL_NUM_PARALLEL": "1", "CORRAL_KEEP_ALIVE": "1h",
    "CORRAL_BUILTIN_MODELS": "0", "CORRAL_MEMORY_MARGIN": "0", "CORRAL_QUEUE_TIMEOUT": "10m",
}  # fmt: skip
_TOKEN = re.compile(rb'"content":"(?:[^"\\]|\\.)')
_LOAD = re.compile(r"loading model '([^']+)' \(runner \d+\)")
_EVICT = re.compile(r"unloading model '([^']+)' \(runner \d+\): evicted")


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


def estimated_sizes(models_dir: Path, names: list[str]) -> dict[str, int]:
    """What corral books for each model when a request arrives (its estimate)."""
    from corral.bench.cold import runner_spec
    from corral.core.estimate import estimate
    from corral.core.gguf import read_model_info

    out = {}
    for name in names:
        spec = runner_spec(models_dir, name, ENV)
        out[name] = estimate(read_model_info(spec.path), spec.n_ctx, spec.num_parallel).total
    return out


def calibrate(models_dir: Path, names: list[str], work: Path, say: Say) -> dict[str, Any]:
    """Load every model once without a memory limit: what each really holds (corral's books
    once loaded) and how long its load took."""
    server = start_corral(models_dir, work / "swap-calibrate.log", ENV)
    sizes, seconds = {}, {}
    try:
        # One discarded load and unload first: the first runner start pays for cold caches.
        server.client.post("/api/generate", json={"model": names[0]}).raise_for_status()
        server.client.post("/api/generate", json={"model": names[0], "keep_alive": 0})
        wait_until(lambda: not server.ps(), 60, "the first model to unload")
        for name in names:
            say(f"swap: calibrating {name}")
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


def _stem(name: str) -> str:
    return name.removesuffix(":latest")


def _summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in results if r["ok"]]
    waits = [r["wait"] for r in ok if "wait" in r]
    lat = [r["latency"] for r in ok]
    errors = [r.get("error", "") for r in results if not r["ok"]]
    return {
        "requests": len(results), "ok": len(ok), "errors": len(errors),
        "first_errors": errors[:3], "wait": summary(waits), "latency": summary(lat),
        "chat_latency": summary([r["latency"] for r in ok if r["kind"] == CHAT]),
        "embed_latency": summary([r["latency"] for r in ok if r["kind"] == EMBED]),
    }  # fmt: skip


def replay_corral(
    models_dir: Path, policy: str, budget: int, trace: list[TraceEvent], factor: float,
    real: dict[str, int], work: Path,
) -> dict[str, Any]:  # fmt: skip
    env = {**ENV, "CORRAL_EVICTION_POLICY": policy, "CORRAL_MEMORY_LIMIT": str(budget)}
    server = start_corral(models_dir, work / f"swap-{policy}.log", env)
    try:
        results = asyncio.run(replay(server.url, trace, factor))
    finally:
        server.stop()
    log = server.log()
    loads = [_stem(m) for m in _LOAD.findall(log)]
    out = _summarize(results)
    out |= {
        "loads": len(loads),
        "evictions": len(_EVICT.findall(log)),
        "bytes_loaded": sum(real.get(m, 0) for m in loads),
        "loads_per_model": {m: loads.count(m) for m in sorted(set(loads))},
    }
    return out


def replay_router(
    binary: str, models_dir: Path, models_max: int, trace: list[TraceEvent], factor: float,
    real: dict[str, int], work: Path,
) -> dict[str, Any]:  # fmt: skip
    """The same trace against llama.cpp's router mode (`llama-server --models-dir`); loads are
    counted by polling GET /models for models turning `loaded`."""
    import httpx

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # The embedding model needs --embeddings in its instance only: a models preset says so.
    preset = work / "swap-router-presets.ini"
    preset.write_text(f"version = 1\n\n[{EMBED_NAME}]\nembeddings = true\n")
    cmd = [
        binary, "--models-dir", str(models_dir), "--models-max", str(models_max),
        "--models-preset", str(preset), "--host", "127.0.0.1", "--port", str(port),
        "-c", ENV["CORRAL_CONTEXT_LENGTH"], "-np", "1",
    ]  # fmt: skip
    with open(work / "swap-router.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    loads: list[str] = []
    try:

        def healthy() -> bool:
            if proc.poll() is not None:
                raise RuntimeError(f"llama-server exited ({proc.returncode}); see swap-router.log")
            with contextlib.suppress(httpx.HTTPError):
                return httpx.get(url + "/models", timeout=2).status_code == 200
            return False

        wait_until(healthy, 60, "llama-server (router mode) to start")
        listed = [str(m["id"]) for m in httpx.get(url + "/models", timeout=5).json()["data"]]
        ids: dict[str, str] = {}
        for name in {e.model for e in trace}:
            match = [i for i in listed if i in (name, f"{name}.gguf")]
            match = match or [i for i in listed if Path(i).stem.startswith(name)]
            if not match:
                raise RuntimeError(f"llama-server does not list {name}: {listed}")
            ids[name] = match[0]
        back = {v: k for k, v in ids.items()}

        async def run() -> list[dict[str, Any]]:
            state: dict[str, str] = {}
            done = False

            async def poll() -> None:
                async with httpx.AsyncClient(base_url=url, timeout=5) as c:
                    while not done:
                        with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
                            for m in (await c.get("/models")).json()["data"]:
                                status = m.get("status", {})
                                value = status.get("value") if isinstance(status, dict) else status
                                if value == "loaded" and state.get(m["id"]) != "loaded":
                                    loads.append(str(m["id"]))
                                state[m["id"]] = str(value)
                        await asyncio.sleep(0.05)

            poller = asyncio.create_task(poll())
            try:
                return await replay(url, trace, factor, ids)
            finally:
                done = True
                await poller

        results = asyncio.run(run())
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    out = _summarize(results)
    stems = [back.get(m, m) for m in loads]
    out |= {
        "loads": len(stems),
        "evictions": math.nan,
        "bytes_loaded": sum(real.get(m, 0) for m in stems),
        "loads_per_model": {m: stems.count(m) for m in sorted(set(stems))},
    }
    return out


def run(scale: Scale, work: Path, say: Say) -> Section:
    sec = Section("swap", "Multi-model swap traces")
    models_dir = work / "swap-models"
    chat = write_models(models_dir, scale.swap_sizes_mb, say)
    names = [*chat, EMBED_NAME]
    est = estimated_sizes(models_dir, names)
    cal = calibrate(models_dir, names, work, say)
    real: dict[str, int] = cal["sizes"]
    # About half of the models fit; always the biggest (as estimated) beside the embedder.
    budget = max(sum(real.values()) // 2, max(est.values()) + real[EMBED_NAME])
    long_model = chat[-2] if len(chat) > 1 else chat[0]  # a big model in a long session
    trace = generate_trace(
        SEED, scale.swap_requests, chat, embed_model=EMBED_NAME, long_session_model=long_model
    )
    factor = scale.swap_seconds / max(trace[-1].t, 1e-9)
    seq = [e.model for e in trace]
    times = [e.t * factor for e in trace]
    sims = {
        p: simulate(
            seq,
            est,
            budget,
            p,
            loaded_sizes=real,
            times=times,
            load_seconds=lambda m: cal["load_seconds"][m],
        )
        for p in (*scale.swap_policies, OFFLINE)
    }
    best = sims[OFFLINE]
    models_table = Table(
        "Models and trace", ["model", "file", "booked when loaded", "estimate", "load time",
                             "requests in trace"],
    )  # fmt: skip
    for name in names:
        size = (models_dir / f"{name}.gguf").stat().st_size
        models_table.add(name, mib(size), mib(real[name]), mib(est[name]),
                         f"{cal['load_seconds'][name]:.2f} s", seq.count(name))  # fmt: skip
    sec.tables.append(models_table)
    sec.notes.append(
        f"trace: seed {SEED}, {len(trace)} requests over {scale.swap_seconds:g} s (compressed "
        f"{1 / factor:.1f}x), long session on {long_model}, memory limit {mib(budget)} "
        f"(all models: {mib(sum(real.values()))}); chat requests stream {MAX_TOKENS} tokens"
    )
    replays: dict[str, dict[str, Any]] = {}
    for p in scale.swap_policies:
        say(f"swap: replaying {len(trace)} requests with policy {p}")
        replays[p] = replay_corral(models_dir, p, budget, trace, factor, real, work)
    binary = os.environ.get("CORRAL_BENCH_LLAMA_SERVER")
    models_max = max(1, len(names) // 2)
    if binary:
        say(f"swap: replaying against llama.cpp's router mode ({binary})")
        try:
            replays["llama.cpp router"] = replay_router(
                binary, models_dir, models_max, trace, factor, real, work
            )
        except (OSError, RuntimeError, TimeoutError) as e:
            sec.notes.append(f"llama.cpp router mode failed: {e}")
    else:
        sec.notes.append(
            "llama.cpp router mode: skipped (set CORRAL_BENCH_LLAMA_SERVER to a llama-server "
            "binary to replay the same trace against `llama-server --models-dir DIR "
            f"--models-max {models_max}`)"
        )
    table = Table(
        "Replay per eviction policy (offline optimum in parentheses)",
        ["policy", "ok/requests", "loads", "evictions", "loaded", "wait p50", "wait p95",
         "latency p50", "p95", "p99"],
    )  # fmt: skip
    for p, r in replays.items():
        ev = "n/a" if isinstance(r["evictions"], float) else str(r["evictions"])
        table.add(
            p, f"{r['ok']}/{r['requests']}", f"{r['loads']} ({best.loads})", ev,
            f"{mib(r['bytes_loaded'])} ({mib(best.bytes_loaded)})", ms(r["wait"]["p50"], 1),
            ms(r["wait"]["p95"], 1), ms(r["latency"]["p50"], 1), ms(r["latency"]["p95"], 1),
            ms(r["latency"]["p99"], 1),
        )  # fmt: skip
        if r["errors"]:
            sec.notes.append(f"{p}: {r['errors']} failed requests, e.g. {r['first_errors'][:1]}")
    sec.tables.append(table)
    for p, r in replays.items():
        extra = safe_div(r["loads"] - best.loads, best.loads) * 100
        sec.summary.append(
            f"{p}: {r['loads']} loads ({mib(r['bytes_loaded'])}) replaying the trace, against "
            f"{best.loads} ({mib(best.bytes_loaded)}) for the offline optimum ({extra:+.0f}%); "
            f"request latency p50 {ms(r['latency']['p50'], 0)}, p99 {ms(r['latency']['p99'], 0)}"
        )
    sim_table = Table(
        "Offline simulation of the same trace, one request at a time (corral's scheduler core)",
        ["policy", "loads", "evictions", "loaded"],
    )
    for p, s in sims.items():
        label = "belady (offline optimum)" if p == OFFLINE else p
        sim_table.add(label, s.loads, s.evictions, mib(s.bytes_loaded))
    sec.tables.append(sim_table)
    per_model = Table("Loads per model", ["policy", *names])
    for p, r in replays.items():
        per_model.add(p, *(r["loads_per_model"].get(n, 0) for n in names))
    sec.tables.append(per_model)
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
    sec.data = {
        "seed": SEED, "budget": budget, "estimates": est, "calibration": cal,
        "trace": [[round(e.t * factor, 4), e.model, e.kind, e.session, e.turn] for e in trace],
        "replays": replays, "simulations": {p: asdict(s) for p, s in sims.items()},
        "p99_note": "p99 of a few hundred requests is near the maximum",
    }  # fmt: skip
    return sec
