"""Measuring what a process really holds."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import aiohttp

from corral.core.estimate import estimate
from corral.core.gguf import read_model_info
from corral.core.spec import RunnerSpec
from corral.runtime.memwatch import code_rss, process_usage
from corral.runtime.scheduler import Scheduler, SchedulerConfig


def process_memory(pid: int) -> int | None:
    """Resident memory of a process and its children, in bytes; None if it is gone."""
    u = process_usage(pid)
    return None if u is None else u.rss


def test_a_process_that_allocates_measures_more() -> None:
    code = (
        "import time; b = bytearray(64 << 20); b[::4096] = b'x' * len(b[::4096]); "
        "print('ok', flush=True); time.sleep(30)"
    )
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == b"ok"
        big = process_memory(p.pid)
        me = process_memory(os.getpid())
        assert big is not None and me is not None
        assert big >= 64 << 20  # the touched 64 MiB are counted
    finally:
        p.kill()
        p.wait()
    assert process_memory(p.pid) is None  # gone


async def test_the_books_follow_what_a_runner_really_holds(models_dir: Path) -> None:
    """With no allowance for the runner process itself (none submitted), llama.cpp's own
    account is below what the process holds: the booking is the measure from the moment the
    runner is ready, and keeps following it."""
    sched = Scheduler({"cpu": 8 * 2**30}, SchedulerConfig(measure_interval=0.2))
    spec = RunnerSpec(path=str(models_dir / "tiny.gguf"), n_ctx=512, num_parallel=1)
    lease = await sched.acquire("tiny", spec, size=2**20)
    try:
        (book,) = sched.view().runners
        alloc = lease.runner.allocation
        assert alloc is not None
        allocated = sum(alloc.booked(["cpu"]).values())
        real = book.measured  # measured when it became ready, not seconds later
        assert real > allocated  # the interpreter, xllamacpp and its threads are not in it
        assert book.devices["cpu"] >= real
        for _ in range(50):  # and again by the measuring task
            await asyncio.sleep(0.1)
            (book,) = sched.view().runners
            if book.measured != real:
                break
        assert book.devices["cpu"] >= book.measured
    finally:
        lease.release()
        await sched.shutdown()


def test_ps_shows_booked_and_measured_bytes(server) -> None:
    r = server.client.post(
        "/api/generate", json={"model": "tiny", "prompt": "hi", "stream": False,
                               "options": {"num_predict": 1}},
    )  # fmt: skip
    assert r.status_code == 200

    def measured() -> bool:
        return any(m["name"] == "tiny:latest" and m["measured_bytes"] for m in server.ps())

    server.wait_for(measured, timeout=10, what="a memory measure of the runner")
    (m,) = [m for m in server.ps() if m["name"] == "tiny:latest"]
    booked = sum(d["bytes"] for d in m["devices"])
    assert booked >= m["measured_bytes"] > 0  # the books hold at least what it really holds
    assert m["measured"] == [{"id": "cpu", "bytes": m["measured_bytes"]}]  # no GPU here


def test_code_rss_is_the_code_not_the_heap() -> None:
    """Two interpreters map the same code: each one's resident code is part of its RSS, about
    the same for both, and the 64 MiB one of them touches is not in it."""
    code = (
        "import sys, time; b = bytearray(int(sys.argv[1]) << 20); "
        "b[::4096] = b'x' * len(b[::4096]); print('ok', flush=True); time.sleep(30)"
    )
    procs = [subprocess.Popen([sys.executable, "-c", code, n], stdout=subprocess.PIPE)
             for n in ("0", "64")]  # fmt: skip
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().strip() == b"ok"
        codes = [code_rss(p.pid) for p in procs]
        usages = [process_usage(p.pid) for p in procs]
        for c, usage in zip(codes, usages, strict=True):
            assert c is not None and usage is not None
            assert 0 < c < usage.rss
        assert codes[0] is not None and codes[1] is not None
        assert abs(codes[1] - codes[0]) < 8 << 20  # not the 64 MiB
        assert usages[1] is not None and usages[1].rss - codes[1] >= 64 << 20
        assert usages[1].anon >= 64 << 20  # the heap is anonymous memory
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert code_rss(procs[0].pid) is None  # gone


async def test_a_busy_real_runner_holds_no_more_than_its_booking(real_model: Path) -> None:
    """The runner process's own memory (its RSS less the code every runner maps) stays
    within what corral books for it (llama.cpp's buffers and `Estimate.process`) while two
    requests with long prompts generate, on each real model (Gemma 3 270M: a sliding-window
    cache beside the full one): the booking never had to grow to a measure."""
    path = real_model
    spec = RunnerSpec(path=str(path), n_ctx=2048, num_parallel=2)
    est = estimate(read_model_info(path), spec.n_ctx, spec.num_parallel)
    sched = Scheduler({"cpu": 8 * 2**30}, SchedulerConfig(measure_interval=0.1))
    lease = await sched.acquire(path.stem, spec, size=est.total + est.process, process=est.process)
    try:
        (book,) = sched.view().runners
        booked = book.devices["cpu"]
        alloc = lease.runner.allocation
        assert alloc is not None
        assert booked == sum(alloc.booked(["cpu"]).values()) + est.process
        prompt = "Tell me a long story about " + " ".join(["dragons and castles"] * 150)
        body = {"prompt": prompt, "n_predict": 48, "temperature": 0}
        async with aiohttp.ClientSession(lease.runner.base_url) as http:

            async def one() -> None:
                async with http.post("/completion", json=body) as r:
                    assert r.status == 200, await r.text()
                    await r.read()

            peak = 0
            work = asyncio.gather(one(), one())
            while not work.done():
                await asyncio.sleep(0.05)
                peak = max(peak, sched.view().runners[0].measured or 0)
            await work
        print(f"own memory at peak {peak / 2**20:.1f} MiB, booked {booked / 2**20:.1f} MiB, "
              f"of which the process {est.process / 2**20:.1f} MiB; "
              f"code {sched.view().code / 2**20:.1f} MiB")  # fmt: skip
        assert sched.view().code > 0
        assert 0 < peak <= booked, (peak / 2**20, booked / 2**20)
        assert sched.view().runners[0].devices["cpu"] == booked  # never grown to a measure
    finally:
        lease.release()
        await sched.shutdown()
