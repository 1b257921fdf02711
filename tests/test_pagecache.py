"""Page-cache residency of model files, reading ahead, and reload costs that follow them."""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

import pytest

from corral.core.estimate import RUNNER_CODE_BYTES
from corral.core.policy import disk_seconds_per_byte, reload_seconds
from corral.core.spec import RunnerSpec
from corral.runtime import measure, pagecache
from corral.runtime.scheduler import Scheduler, SchedulerConfig

MiB = 2**20


def cold_file(path: Path, size: int = 32 * MiB) -> Path:
    with open(path, "wb") as f:
        f.write(os.urandom(size))
        f.flush()
        os.fsync(f.fileno())  # clean pages: the kernel may drop them
    assert pagecache.drop(str(path))
    return path


def test_residency_follows_reads_and_drops(tmp_path: Path) -> None:
    f = cold_file(tmp_path / "m.gguf")
    assert pagecache.resident(str(f)) == pytest.approx(0.0, abs=0.05)
    with open(f, "rb", buffering=0) as fh:
        os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_RANDOM)  # no readahead past it
        fh.read(16 * MiB)  # the first half
    assert pagecache.resident(str(f)) == pytest.approx(0.5, abs=0.05)
    f.read_bytes()
    assert pagecache.resident(str(f)) == pytest.approx(1.0, abs=0.01)
    assert pagecache.drop(str(f))
    assert pagecache.resident(str(f)) == pytest.approx(0.0, abs=0.05)
    assert pagecache.resident(str(tmp_path / "missing.gguf")) is None


def test_prefetch_reads_a_cold_file_into_the_cache(tmp_path: Path) -> None:
    f = cold_file(tmp_path / "m.gguf", 96 * MiB)
    assert pagecache.prefetch(str(f), limit=8 * MiB) == 8 * MiB
    r = pagecache.resident(str(f)) or 0
    # The 8 MiB asked for, not the rest (the kernel's readahead ran up to 16 MiB past the
    # last read here: a 32 MiB file was found 75% cached).
    assert 8 / 96 - 0.01 <= r <= 0.5
    assert pagecache.prefetch(str(f)) == 96 * MiB
    assert pagecache.resident(str(f)) == pytest.approx(1.0, abs=0.01)
    pagecache.drop(str(f))
    assert pagecache.prefetch(str(f), keep_going=lambda: False) == 0  # the load started


def test_reload_cost_follows_the_page_cache() -> None:
    gib = 2**30
    warm = reload_seconds(1.0, 1.0, 1.0, gib, 1e-9)
    cold = reload_seconds(1.0, 1.0, 0.0, gib, 1e-9)
    assert warm == 1.0 and cold == pytest.approx(1.0 + 1.07, abs=0.01)  # +1 GiB at 1 GB/s
    assert reload_seconds(10.0, 0.0, 1.0, gib, 1e-8) == 2.0  # never below a fifth
    # two loads of a 1 GiB file: 11 s cold, 1 s cached -> 10 s per GiB from disk
    spb = disk_seconds_per_byte((11.0, 0.0), (1.0, 1.0), gib)
    assert spb is not None and spb * gib == pytest.approx(10.0)
    assert disk_seconds_per_byte((1.0, 0.9), (1.1, 1.0), gib) is None  # too alike to tell


async def test_an_idle_runner_whose_file_left_the_cache_costs_more_to_reload(
    models_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sched = Scheduler({"cpu": 8 * 2**30}, SchedulerConfig(measure_interval=0.1))
    spec = RunnerSpec(path=str(models_dir / "tiny.gguf"), n_ctx=512, num_parallel=1)
    lease = await sched.acquire("tiny", spec, size=MiB)
    try:
        lease.release()
        (book,) = sched.view().runners
        took = lease.runner.load_duration
        assert book.load_cost == pytest.approx(took, abs=0.5)
        # As on a GPU runner whose file pages the OS dropped (llama.cpp unmaps what it
        # uploaded): nothing of the file is cached any more.
        monkeypatch.setattr(measure, "resident", lambda path: 0.0)
        for _ in range(50):
            await asyncio.sleep(0.1)
            (book,) = sched.view().runners
            if book.page_cache == 0.0:
                break
        size = os.stat(spec.path).st_size
        start = book.page_cache_at_load
        assert book.load_cost == pytest.approx(
            reload_seconds(took, start, 0.0, size, sched.view().disk_seconds_per_byte)
        )
        assert book.load_cost > took or start == 0.0
    finally:
        await sched.shutdown()


async def test_a_load_waiting_for_an_eviction_reads_its_file_ahead(
    models_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "corral.runtime.measure")
    # room for one of the two 50 MiB bookings beside the runners' shared code, not for both
    # (40 MiB of each is its process, booked beside llama.cpp's allocation once loaded)
    sched = Scheduler({"cpu": 60 * MiB + RUNNER_CODE_BYTES}, SchedulerConfig(measure_interval=3600))
    a = RunnerSpec(path=str(models_dir / "tiny.gguf"), n_ctx=512, num_parallel=1)
    b = RunnerSpec(path=str(models_dir / "tiny2.gguf"), n_ctx=512, num_parallel=1)
    try:
        lease = await sched.acquire("tiny", a, size=50 * MiB, process=40 * MiB)
        lease.release()
        lease = await sched.acquire("tiny2", b, size=50 * MiB, process=40 * MiB)  # evicts tiny
        lease.release()
        assert any("reading model 'tiny2' ahead" in r.message for r in caplog.records)
    finally:
        await sched.shutdown()


def test_ps_verbose_and_the_dashboard_show_what_a_reload_would_cost(
    start_server, tmp_path: Path
) -> None:
    """`/api/ps?verbose=true` and the dashboard's state show the share of each loaded model's
    file in the page cache and the reload seconds the eviction policy predicts from it."""
    from corral.testing import synth

    synth.write_llama_model(tmp_path / "base.gguf", target_bytes=24 * MiB)
    # read into the runner's own buffers: the file's cached pages are the kernel's to drop
    (tmp_path / "models.toml").write_text('[models.cold]\nfile = "base.gguf"\nuse_mmap = false\n')
    s = start_server(tmp_path)
    r = s.client.post("/api/generate", json={"model": "cold"})
    assert r.status_code == 200, r.text
    assert "page_cache" not in s.ps()[0]  # only when asked for

    def verbose() -> dict:
        (m,) = s.client.get("/api/ps", params={"verbose": "true"}).json()["models"]
        return m["page_cache"]

    s.wait_for(lambda: verbose()["resident"] is not None, timeout=10, what="a residency measure")
    pc = verbose()
    assert pc["file_bytes"] == (tmp_path / "base.gguf").stat().st_size
    assert pc["resident"] == pytest.approx(1.0, abs=0.05)  # just read by the load
    assert pc["load_seconds"] > 0 and pc["reload_seconds"] == pytest.approx(
        pc["load_seconds"], rel=0.05
    )
    assert pagecache.drop(str(tmp_path / "base.gguf"))
    # every loaded model's residency is read every RESIDENCY_EVERY measures (2 s each)
    s.wait_for(lambda: verbose()["resident"] < 0.1, timeout=30, what="the drop seen")
    cold = verbose()
    assert cold["reload_seconds"] > pc["reload_seconds"]  # its bytes come from disk now
    doc = s.client.get("/api/corral/state").json()
    (runner,) = [m["runner"] for m in doc["models"] if m["name"] == "cold:latest"]
    assert runner["page_cache"] < 0.1 and runner["reload_seconds"] == cold["reload_seconds"]
