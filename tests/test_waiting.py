"""Who waits and why: core/waits reads each queued request's place and reason off the core's
books; the scheduler's view lists them, and the requests waiting for room in a runner's shared
KV cache, with the seconds each has waited (the scheduler's clock)."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping
from pathlib import Path

from corral.core.books import Core
from corral.core.estimate import RUNNER_CODE_BYTES
from corral.core.memreport import Allocation
from corral.core.requests import Fit, Placer, Request
from corral.core.spec import RunnerSpec
from corral.core.waits import WHY, waits
from corral.runtime.runner import Runner
from corral.runtime.scheduler import Scheduler, SchedulerConfig

GiB = 2**30
SIZES = {"a": 300, "b": 500, "c": 800}  # budget 1000: a beside b, never c beside either


def spec(model: str, ctx: int = 1024) -> RunnerSpec:
    return RunnerSpec(path=f"/m/{model}.gguf", n_ctx=ctx, num_parallel=1)


def req(i: int, model: str, now: float, ctx: int | None = None) -> Request:
    explicit = frozenset({"n_ctx"}) if ctx else frozenset()
    return Request(i, model, spec(model, ctx or 1024), explicit, SIZES[model], None, now)


def listed(core: Core) -> list[tuple[int, str, int, int, int, str]]:
    """(request, model, place, of, position, why) for each waiting request."""
    return [(w.request.id, w.request.model, w.place, w.of, w.position, w.why)
            for w in waits(core)]  # fmt: skip


def runner_of(core: Core, model: str) -> int:
    return next(r.id for r in core.runners.values() if r.model == model)


def test_each_waiting_request_has_its_place_among_its_models_and_why() -> None:
    core = Core(budgets={"cpu": 1000})
    core.request(req(1, "a", 0.0), 0.0)
    core.request(req(2, "a", 0.0), 0.0)
    assert listed(core) == [(1, "a", 1, 2, 1, "loading"), (2, "a", 2, 2, 2, "loading")]
    a = runner_of(core, "a")
    core.loaded(a, 1.0)  # 1 granted; 2 waits for a's only slot
    assert listed(core) == [(2, "a", 1, 1, 1, "busy")]
    (w,) = waits(core)
    assert w.runner == a
    # c fits only once a goes, and a is busy: c waits for memory. b would fit beside a, yet
    # loads go first come, first served: b waits behind c's.
    core.request(req(3, "c", 2.0), 2.0)
    core.request(req(4, "b", 2.0), 2.0)
    assert listed(core) == [
        (2, "a", 1, 1, 1, "busy"), (3, "c", 1, 1, 2, "memory"), (4, "b", 1, 1, 3, "behind_load"),
    ]  # fmt: skip
    core.release(1, 3.0)  # 2 granted
    core.release(2, 4.0)  # a is idle: c's load evicts it
    assert core.runners[a].state == "unloading"
    core.request(req(5, "a", 4.0), 4.0)  # a's next load waits for its old runner to go
    assert listed(core) == [
        (3, "c", 1, 1, 1, "evicting"), (4, "b", 1, 1, 2, "behind_load"),
        (5, "a", 1, 1, 3, "exiting"),
    ]  # fmt: skip
    core.exited(a, 5.0)  # c loads; b's load is first now, and waits for memory c holds
    assert listed(core) == [
        (3, "c", 1, 1, 1, "loading"), (4, "b", 1, 1, 2, "memory"),
        (5, "a", 1, 1, 3, "behind_load"),
    ]  # fmt: skip
    core.loaded(runner_of(core, "c"), 6.0)  # 3 granted
    core.request(req(6, "c", 6.0, ctx=2048), 6.0)  # other options: c must reload for it
    assert listed(core)[-1] == (6, "c", 1, 1, 3, "reload")
    assert set(WHY) >= {why for *_, why in listed(core)}


def test_a_load_waits_for_another_on_its_gpu() -> None:
    def on_gpu(n: int) -> Placer:
        def place(free: Mapping[str, int]) -> Fit | None:
            return Fit({"cuda:0": n}) if free.get("cuda:0", 0) >= n else None

        return place

    core = Core(budgets={"cpu": 10**9, "cuda:0": 1000})
    for i, model in ((1, "a"), (2, "b")):
        q = req(i, model, 0.0)
        core.request(Request(i, model, q.spec, q.explicit, 300, None, 0.0, place=on_gpu(300)), 0.0)
    assert listed(core) == [(1, "a", 1, 1, 1, "loading"), (2, "b", 1, 1, 2, "gpu")]


# ---- the scheduler's view ------------------------------------------------------------------------


class BookedRunner(Runner):
    """A real runner whose books keep the estimate: its real allocation, far smaller, would
    make room for the second model."""

    @property
    def allocation(self) -> Allocation | None:
        return None


async def test_the_view_lists_who_waits_in_order_and_for_how_long(models_dir: Path) -> None:
    """Real runners of one slot, room for one of them: requests queued behind a busy runner,
    one whose load waits for memory, one waiting for room in a runner's cache; each leaves
    the list as it is served."""
    now = [100.0]
    sched = Scheduler(
        {"cpu": GiB + GiB // 2 + RUNNER_CODE_BYTES}, SchedulerConfig(measure_interval=math.inf),
        runners=BookedRunner, clock=lambda: now[0],
    )  # fmt: skip
    tiny = RunnerSpec(path=str(models_dir / "tiny.gguf"), n_ctx=512, num_parallel=1)
    tiny2 = RunnerSpec(path=str(models_dir / "tiny2.gguf"), n_ctx=512, num_parallel=1)

    def waiting() -> list[tuple[int | None, str, int, int, int | None, float, str]]:
        return [(w.request, w.model, w.place, w.of, w.position, w.waited, w.why)
                for w in sched.view().waiting]  # fmt: skip

    try:
        first = await asyncio.wait_for(sched.acquire("tiny", tiny, size=GiB), 60)
        assert waiting() == []
        t2 = sched.submit("tiny", tiny, size=GiB)
        now[0] += 1
        t3 = sched.submit("tiny", tiny, size=GiB)
        t4 = sched.submit("tiny2", tiny2, size=GiB)
        now[0] += 2
        assert waiting() == [
            (t2.id, "tiny", 1, 2, 1, 3.0, "busy"), (t3.id, "tiny", 2, 2, 2, 2.0, "busy"),
            (t4.id, "tiny2", 1, 1, 3, 2.0, "memory"),
        ]  # fmt: skip
        (rid,) = [r.id for r in sched.view().runners]
        assert [w.runner for w in sched.view().waiting] == [rid, rid, None]

        # A granted request waiting for room in its runner's shared cache (runtime/hop)
        turn = asyncio.ensure_future(first.hop.turn(first, lambda waiting: False))
        await asyncio.sleep(0)
        now[0] += 1.5
        room = [w for w in sched.view().waiting if w.why == "room"]
        assert [(w.request, w.model, w.place, w.of, w.position, w.waited, w.runner)
                for w in room] == [(first.request_id, "tiny", 1, 1, None, 1.5, rid)]  # fmt: skip
        turn.cancel()
        await asyncio.gather(turn, return_exceptions=True)
        assert [w.why for w in sched.view().waiting] == ["busy", "busy", "memory"]

        first.release()
        second = await asyncio.wait_for(sched.wait(t2), 10)
        assert [(w.request, w.place, w.of, w.position) for w in sched.view().waiting] == [
            (t3.id, 1, 1, 1), (t4.id, 1, 1, 2)
        ]  # fmt: skip
        second.release()
        third = await asyncio.wait_for(sched.wait(t3), 10)
        third.release()  # tiny is idle: tiny2's load evicts it
        assert waiting() == [(t4.id, "tiny2", 1, 1, 1, 3.5, "evicting")]
        last = await asyncio.wait_for(sched.wait(t4), 60)
        assert waiting() == []
        last.release()
    finally:
        await sched.shutdown()
