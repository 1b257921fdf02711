"""The scheduler against the machine: other programs' memory (live headroom) and runners that
run out of memory (their booking is raised for the next load). Real runners, fake devices."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from corral.core.devices import Device
from corral.core.spec import RunnerSpec
from corral.runtime import measure
from corral.runtime.measure import OOM_RAISE
from corral.runtime.memwatch import oom_kills
from corral.runtime.runner_errors import OUT_OF_MEMORY
from corral.runtime.scheduler import Scheduler, SchedulerConfig

GiB = 2**30


def tiny(models_dir: Path) -> RunnerSpec:
    return RunnerSpec(path=str(models_dir / "tiny.gguf"), n_ctx=512, num_parallel=1)


async def test_a_load_waits_for_memory_another_program_took(
    models_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The budget allows the load, but the machine's free memory (as refresh reports it) does
    not: the load waits, says why, and starts once the memory is back."""
    free = {"now": 10 * 2**20}  # another program left 10 MiB
    cpu = Device("cpu", "cpu", -1, "Fake CPU", 8 * GiB, free["now"])

    def refresh(devices: list[Device]) -> list[Device]:
        return [replace(d, free=free["now"]) for d in devices]

    sched = Scheduler(
        {"cpu": 4 * GiB}, SchedulerConfig(measure_interval=0.05, margin=0), devices=[cpu],
        refresh=refresh,
    )
    caplog.set_level(logging.WARNING, "corral.runtime.measure")
    try:
        ticket = sched.submit("tiny", tiny(models_dir), size=64 * 2**20)

        def waits() -> bool:
            return any("loading model 'tiny' waits" in r.message for r in caplog.records)

        for _ in range(600):  # until the scheduler says the load waits (at most 30 s)
            if waits():
                break
            await asyncio.sleep(0.05)
        assert not ticket.fut.done() and not sched.view().runners  # nothing started
        assert sched.view().headroom == {"cpu": 10 * 2**20}
        assert waits()
        free["now"] = 6 * GiB  # it exited
        lease = await asyncio.wait_for(sched.wait(ticket), 60)
        lease.release()
    finally:
        await sched.shutdown()


async def test_a_runner_killed_for_memory_is_booked_higher_next_time(
    models_dir: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A SIGKILL while the kernel's OOM kill count moved is the OOM killer's: the next load of
    that model books its allocation OOM_RAISE times higher."""
    kills = [7]
    monkeypatch.setattr(measure, "oom_kills", lambda: kills[0])
    sched = Scheduler({"cpu": 8 * GiB}, SchedulerConfig(measure_interval=3600))
    caplog.set_level(logging.WARNING, "corral.runtime.measure")
    try:
        lease = await sched.acquire("tiny", tiny(models_dir), size=64 * 2**20)
        alloc = lease.runner.allocation
        assert alloc is not None
        real = sum(alloc.booked(["cpu"]).values())
        lease.release()
        assert lease.runner.pid is not None
        kills[0] += 1  # as the kernel counts its kill
        os.kill(lease.runner.pid, signal.SIGKILL)
        for _ in range(100):
            await asyncio.sleep(0.05)
            if not sched.view().runners:
                break
        assert not sched.view().runners
        assert sched.view().raised == {"tiny": OOM_RAISE}
        assert any("'tiny' ran out of memory" in r.message for r in caplog.records)
        lease = await sched.acquire("tiny", tiny(models_dir), size=64 * 2**20)
        (book,) = sched.view().runners
        assert book.devices["cpu"] >= int(real * OOM_RAISE) - 1
        lease.release()
    finally:
        await sched.shutdown()


@pytest.mark.parametrize(
    ("message", "oom"),
    [
        (
            "ggml_backend_cpu_buffer_type_alloc_buffer: failed to allocate buffer of size "
            "8589934592",
            True,
        ),
        (
            "ggml_backend_cuda_buffer_type_alloc_buffer: allocating 4096.00 MiB on device 0: "
            "cudaMalloc failed: out of memory",
            True,
        ),
        (
            "llama_init_from_model: failed to initialize the context: failed to allocate compute "
            "pp buffers",
            True,
        ),
        ("runner for model 'm' was killed by signal 9 (SIGKILL: out of memory?)", True),
        (
            "llama_model_load: error loading model: tensor 'blk.0.attn_q.weight' data is not "
            "within the file bounds",
            False,
        ),
        ("runner for model 'm' exited with code 1", False),
    ],
)
def test_which_load_failures_count_as_running_out_of_memory(message: str, oom: bool) -> None:
    assert bool(OUT_OF_MEMORY.search(message)) is oom


async def test_a_runner_killed_by_someone_else_is_not_taken_for_out_of_memory(
    models_dir: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`kill -9` by hand (the kernel's OOM kill count stays): the runner's end is a crash, and
    the model's booking stays as it was."""
    monkeypatch.setattr(measure, "oom_kills", lambda: 7)
    sched = Scheduler({"cpu": 8 * GiB}, SchedulerConfig(measure_interval=3600))
    caplog.set_level(logging.WARNING, "corral.runtime.scheduler")
    try:
        lease = await sched.acquire("tiny", tiny(models_dir), size=64 * 2**20)
        lease.release()
        assert lease.runner.pid is not None
        os.kill(lease.runner.pid, signal.SIGKILL)
        for _ in range(100):
            await asyncio.sleep(0.05)
            if not sched.view().runners:
                break
        assert not sched.view().runners and sched.view().raised == {}
        assert any("killed by someone, not for memory" in r.message for r in caplog.records)
    finally:
        await sched.shutdown()


def test_the_kernels_oom_kill_count_is_read(tmp_path: Path) -> None:
    vmstat = tmp_path / "vmstat"
    vmstat.write_text("nr_free_pages 1\noom_kill 3\nnr_zone 2\n")
    assert oom_kills(str(vmstat)) == 3
    assert oom_kills(str(tmp_path / "missing")) is None
    if sys.platform.startswith("linux"):  # the real one (Linux 4.13+)
        assert isinstance(oom_kills(), int)
