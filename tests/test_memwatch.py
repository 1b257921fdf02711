"""Measuring what a process really holds."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from corral.core.spec import RunnerSpec
from corral.runtime import scheduler
from corral.runtime.memwatch import process_memory
from corral.runtime.scheduler import Scheduler


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


async def test_the_books_follow_what_a_runner_really_holds(
    models_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With no allowance for the runner process itself, llama.cpp's own account is below what
    the process holds: the booking is the measure from the moment the runner is ready, and
    keeps following it."""
    monkeypatch.setattr(scheduler, "RUNNER_PROCESS_BYTES", 0)
    sched = Scheduler({"cpu": 8 * 2**30}, measure_interval=0.2)
    spec = RunnerSpec(path=str(models_dir / "tiny.gguf"), n_ctx=512, num_parallel=1)
    lease = await sched.acquire("tiny", spec, size=2**20)
    try:
        (book,) = sched.core.runners.values()
        alloc = lease.runner.allocation
        assert alloc is not None
        allocated = sum(alloc.booked(["cpu"]).values())
        real = sched.measured[book.id]  # measured when it became ready, not seconds later
        assert real > allocated  # the interpreter, xllamacpp and its threads are not in it
        assert book.devices["cpu"] >= real
        for _ in range(50):  # and again by the measuring task
            await asyncio.sleep(0.1)
            if sched.measured[book.id] != real:
                break
        assert book.devices["cpu"] >= sched.measured[book.id]
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
