"""`corral bench prefetch`: a load that waits for an evicted runner to exit, with its file read
ahead into the page cache meanwhile (posix_fadvise WILLNEED) and without.

The model to load is a 256 MB synthetic file dropped from the page cache before each trial
(POSIX_FADV_DONTNEED: no root needed); the victim is a small model that one slot
(max_loaded 1) forces out. Two victims: one that exits at once, and one whose stop takes 2 s
first (as a KV-cache save or a GPU's memory-recovery wait would). Time = from the request
to its grant; trials of both variants interleaved.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from corral.bench.common import Goal, Say, Scale, Section, Table, median, secs
from corral.core.spec import RunnerSpec
from corral.runtime import pagecache
from corral.runtime.scheduler import Hooks, Scheduler, SchedulerConfig
from corral.testing import synth

TARGET_BYTES = 256 * 10**6
SLOW_STOP = 2.0


async def _trial(
    models: Path, prefetch: bool, slow_stop: bool, say: Say
) -> tuple[float, float | None]:
    async def hold(*_: Any) -> None:
        await asyncio.sleep(SLOW_STOP)

    sched = Scheduler(
        {"cpu": 16 * 2**30},
        SchedulerConfig(max_loaded=1, measure_interval=3600, prefetch=prefetch),
        hooks=Hooks(before_stop=hold if slow_stop else None),
    )
    small = RunnerSpec(path=str(models / "victim.gguf"), n_ctx=512, num_parallel=1)
    big = RunnerSpec(path=str(models / "target.gguf"), n_ctx=512, num_parallel=1)
    try:
        lease = await sched.acquire("victim", small, size=2**20)
        lease.release()
        pagecache.drop(big.path)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        lease = await sched.acquire("target", big, size=2**20)
        took = loop.time() - t0
        resident = next(
            (r.page_cache_at_load for r in sched.view().runners if r.model == "target"), None
        )
        lease.release()
        return took, resident
    finally:
        await sched.shutdown()


def run(scale: Scale, work: Path, say: Say) -> Section:
    models = work / "prefetch-models"
    models.mkdir(parents=True, exist_ok=True)
    synth.write_llama_model(models / "victim.gguf", n_layer=2, seed=31)
    target = models / "target.gguf"
    if not target.exists() or target.stat().st_size < TARGET_BYTES * 0.9:
        synth.write_llama_model(target, target_bytes=TARGET_BYTES, seed=32)
    reps = 1 if scale.name == "smoke" else 3
    sec = Section("prefetch", "Prefetch while a load waits for an eviction")
    table = Table(
        "Load of an uncached 256 MB model that waits for a victim (median of "
        f"{reps}; interleaved)",
        ["victim's stop", "without prefetch", "with prefetch", "gain",
         "file cached at load start (without / with)"],
    )  # fmt: skip
    data: dict[str, Any] = {}
    for slow in (False, True):
        runs: dict[bool, list[tuple[float, float | None]]] = {False: [], True: []}
        for _ in range(reps):
            for pf in (False, True):
                runs[pf].append(asyncio.run(_trial(models, pf, slow, say)))
        without = median([t for t, _ in runs[False]])
        with_ = median([t for t, _ in runs[True]])
        res_off = median([r or 0.0 for _, r in runs[False]])
        res_on = median([r or 0.0 for _, r in runs[True]])
        label = f"takes {SLOW_STOP:g} s" if slow else "at once"
        table.add(label, secs(without), secs(with_), f"{without - with_:+.2f} s",
                  f"{res_off:.0%} / {res_on:.0%}")  # fmt: skip
        data[label] = {"without": without, "with": with_, "resident": [res_off, res_on]}
        say(f"prefetch, victim {label}: {without:.2f} s without, {with_:.2f} s with")
    sec.tables.append(table)
    sec.data = data
    slow_row = data[f"takes {SLOW_STOP:g} s"]
    sec.goals.append(Goal(
        "a load that waits for a slow victim finishes sooner with prefetch",
        f"{slow_row['without']:.2f} s -> {slow_row['with']:.2f} s",
        slow_row["with"] < slow_row["without"],
    ))  # fmt: skip
    sec.notes.append(
        "The gain is bounded by the time the victim takes to go: the read of the file overlaps "
        "it. A victim that exits in a fraction of a second leaves little to overlap; one that "
        "saves its KV cache or waits for a GPU to report its memory free leaves seconds."
    )
    return sec
