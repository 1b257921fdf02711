"""How much corral's own path sustains, so we know corral is never the bottleneck: the API +
scheduler path's requests per second against an instant fake runner (corral.bench.fake_runner)
beside the fake runner alone, and the pure scheduler core's request -> grant -> release cycles
per second. Parts of the proxy section (`bench/proxy.py`)."""

from __future__ import annotations

import asyncio
import random
import stat
import sys
import time
from pathlib import Path
from typing import Any

import orjson
import psutil

from corral.bench.common import (
    PROMPT_SHORT,
    SEED,
    Say,
    Scale,
    Section,
    Table,
    median,
    ms,
    runner_url,
    safe_div,
    summary,
)
from corral.testing import synth
from corral.testing.server import start_corral

__all__ = ["capacity", "core_bench", "hammer"]


async def hammer(
    url: str, path: str, body: bytes, clients: int, seconds: float, warmup: float,
    cpu_pid: int | None = None,
) -> dict[str, Any]:  # fmt: skip
    """`clients` closed-loop clients POSTing `body` for `seconds` (after `warmup` seconds):
    requests per second, latency, and the CPU seconds process `cpu_pid` used meanwhile."""
    import aiohttp

    lat: list[float] = []
    errors = 0
    recording = stop = False
    headers = {"Content-Type": "application/json"}

    def cpu() -> float:
        if cpu_pid is None:
            return 0.0
        t = psutil.Process(cpu_pid).cpu_times()
        return float(t.user + t.system)

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:

        async def worker() -> None:
            nonlocal errors
            while not stop:
                t0 = time.perf_counter()
                async with s.post(url + path, data=body, headers=headers) as r:
                    await r.read()
                    ok = r.status == 200
                if recording:
                    lat.append(time.perf_counter() - t0)
                    errors += not ok

        tasks = [asyncio.create_task(worker()) for _ in range(clients)]
        await asyncio.sleep(warmup)
        recording = True
        t0, c0 = time.perf_counter(), cpu()
        await asyncio.sleep(seconds)
        recording = False
        t1, c1 = time.perf_counter(), cpu()
        stop = True
        await asyncio.gather(*tasks)
    n = len(lat)
    return {
        "requests": n, "seconds": t1 - t0, "rps": safe_div(n, t1 - t0), "errors": errors,
        "latency": summary(lat), "cpu_seconds": c1 - c0,
        "cpu_us_per_request": safe_div((c1 - c0) * 1e6, n),
    }  # fmt: skip


def capacity(scale: Scale, work: Path, say: Say, sec: Section) -> None:
    from corral.bench.fake_runner import SCRIPT

    models_dir = work / "fake-models"
    synth.write_llama_model(models_dir / "fake.gguf", n_layer=1)
    script = work / "fake-llama-server"
    script.write_text(SCRIPT.format(python=sys.executable))
    script.chmod(script.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    slots = max(64, scale.load_clients)
    server = start_corral(
        models_dir, work / "fake-corral.log",
        {"CORRAL_LLAMA_SERVER": str(script), "CORRAL_NUM_PARALLEL": str(slots),
         "CORRAL_CONTEXT_LENGTH": "256", "CORRAL_BUILTIN_MODELS": "0",
         "CORRAL_KEEP_ALIVE": "-1"},
    )  # fmt: skip
    body = orjson.dumps({
        "model": "fake", "messages": [{"role": "user", "content": PROMPT_SHORT}], "max_tokens": 1,
    })  # fmt: skip
    table = Table(
        f"API + scheduler capacity against an instant fake runner ({scale.load_clients} "
        "concurrent clients, non-streamed /v1/chat/completions)",
        ["target", "req/s", "p50", "p99", "errors", "corral CPU per request",
         "req/s per corral core"],
    )  # fmt: skip
    runs: dict[str, list[dict[str, Any]]] = {"direct": [], "corral": []}
    try:
        r = server.client.post("/v1/chat/completions", content=body, timeout=60)
        r.raise_for_status()
        url = runner_url(next(m["pid"] for m in server.ps()))
        rounds = 1 if scale.name == "smoke" else 2
        warm = min(1.0, scale.load_seconds / 3)
        for i in range(rounds):
            for target in ("direct", "corral") if i % 2 == 0 else ("corral", "direct"):
                say(f"proxy: capacity, {target}, {scale.load_seconds:g}s")
                runs[target].append(asyncio.run(hammer(
                    url if target == "direct" else server.url, "/v1/chat/completions", body,
                    scale.load_clients, scale.load_seconds, warm,
                    cpu_pid=server.proc.pid if target == "corral" else None,
                )))  # fmt: skip
    finally:
        server.stop()
    for target, label in (("direct", "fake runner, direct"), ("corral", "corral -> fake runner")):
        rs = runs[target]
        n = sum(x["requests"] for x in rs)
        rps = safe_div(n, sum(x["seconds"] for x in rs))
        p50 = median([x["latency"]["p50"] for x in rs])
        p99 = max(x["latency"]["p99"] for x in rs)
        errors = sum(x["errors"] for x in rs)
        if target == "corral":
            cpu_us = safe_div(sum(x["cpu_seconds"] for x in rs) * 1e6, n)
            table.add(label, f"{rps:.0f}", ms(p50), ms(p99), errors, f"{cpu_us:.0f} us",
                      f"{safe_div(1e6, cpu_us):.0f}")  # fmt: skip
        else:
            table.add(label, f"{rps:.0f}", ms(p50), ms(p99), errors, "-", "-")
    sec.tables.append(table)
    sec.data["capacity"] = runs
    sec.notes.append(
        "capacity: the client, corral and the fake runner share the machine's cores; "
        "'req/s per corral core' = 1 / corral's CPU time per request, what one fully used core "
        "would sustain"
    )


# --------------------------------------------------------------------------- the pure core


def core_bench(cycles: int) -> tuple[Table, dict[str, Any]]:
    """Request -> grant -> release cycles per second of corral.core.books.Core (no I/O)."""
    from corral.core.books import Core
    from corral.core.policy import POLICIES
    from corral.core.requests import Fail, Grant, Load, Request, Stop
    from corral.core.spec import RunnerSpec

    rng = random.Random(SEED)
    table = Table(
        "Scheduler core (corral.core.books.Core), one thread, no I/O",
        ["scenario", "cycles/s", "us per cycle"],
    )
    data: dict[str, Any] = {}
    size = 100 * 2**20

    def run(name: str, n_models: int, room: int, policy: str, order: str) -> None:
        core = Core(budgets={"cpu": room * size}, policy=POLICIES[policy], max_queue=10**6)
        specs = {f"m{i}": RunnerSpec(path=f"/m/m{i}.gguf", n_ctx=1024, num_parallel=1)
                 for i in range(n_models)}  # fmt: skip
        names = list(specs)
        ids = iter(range(1, 10**9))
        now = 0.0

        def cycle(model: str) -> None:
            nonlocal now
            now += 0.001
            rid = next(ids)
            core.request(Request(id=rid, model=model, spec=specs[model], explicit=frozenset(),
                                 size=size, keep_alive=None, arrived=now), now)  # fmt: skip
            pending = core.drain()
            granted = False
            while pending:
                a = pending.pop(0)
                if isinstance(a, Stop):
                    core.exited(a.runner, now)
                elif isinstance(a, Load):
                    core.loaded(a.runner, now)
                elif isinstance(a, Grant):
                    granted = True
                elif isinstance(a, Fail):
                    raise RuntimeError(a.message)
                pending += core.drain()
            assert granted
            core.release(rid, now)
            core.drain()

        for m in names:  # warm up: everything that fits is loaded
            cycle(m)
        seq = (
            [names[i % n_models] for i in range(cycles)]
            if order == "round-robin"
            else [rng.choice(names) for _ in range(cycles)]
        )
        t0 = time.perf_counter()
        for m in seq:
            cycle(m)
        dt = time.perf_counter() - t0
        table.add(name, f"{cycles / dt:,.0f}", f"{dt / cycles * 1e6:.1f}")
        data[name] = {"cycles": cycles, "seconds": dt, "cycles_per_s": cycles / dt}

    run("1 model loaded: request, grant, release", 1, 1, "lru", "random")
    run("8 models loaded, random model: request, grant, release", 8, 8, "lru", "random")
    for p in ("lru", "ollama", "cost"):
        run(f"8 models, room for 4, round-robin ({p}): evict, load, grant, release", 8, 4, p,
            "round-robin")  # fmt: skip
    return table, data
