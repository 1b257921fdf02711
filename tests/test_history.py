"""The dashboard's history (api/history.py) with a fake clock and hand-made views: the ring keeps
an hour of samples and no more, each sample reads memory, tokens/s and requests from the view,
journal events become marks, and the sampler stops once the server is closing."""

from __future__ import annotations

import asyncio
import math
from dataclasses import replace
from typing import Any

from corral.api.history import History
from corral.core.devices import Device
from corral.runtime.journal import Event, Journal
from corral.runtime.view import RunnerView, SchedulerView

GiB = 2**30


def runner(model: str, inflight: int) -> RunnerView:
    return RunnerView(
        id=1, model=model, state="ready", draining=False, pid=1, devices={"cpu": GiB},
        size=GiB, slots=2, context_length=1024, speculative="off", inflight=inflight,
        waiting_for_room=0,
        keep_alive=300.0,
        expires_in=math.inf, pinned=False, priority=0, uses=1, load_cost=1.0, progress=None,
        loading_for=None, load_seconds=1.0, measured=GiB // 2, measured_devices={},
        page_cache=None, page_cache_at_load=None, tokens_per_second=0.0,
        slot_tokens_per_second=(0.0, 0.0), held_for=0.0,
    )  # fmt: skip


def view(**kw: Any) -> SchedulerView:
    base = SchedulerView(
        runners=(), queued={}, budgets={"cpu": 8 * GiB}, booked={"cpu": 0},
        reserved={"cpu": 0}, headroom={}, measured={"cpu": 0},
        devices=(Device("cpu", "cpu", -1, "CPU", 16 * GiB, 10 * GiB),), code=0, tokens={},
        drafts={},
        relayed={}, tokens_per_second={}, raised={}, disk_seconds_per_byte=0.0, events=(),
        closing=False,
    )  # fmt: skip
    return replace(base, **kw)


class Clock:
    def __init__(self) -> None:
        self.t = 1_000_000.0

    def __call__(self) -> float:
        return self.t


def test_a_sample_reads_the_view() -> None:
    clock = Clock()
    current = view(
        runners=(runner("a:latest", 2),), queued={"b:latest": 3}, booked={"cpu": 2 * GiB},
        measured={"cpu": GiB}, tokens_per_second={"a:latest": 41.234, "b:latest": 0.0},
    )  # fmt: skip
    h = History(lambda: current, interval=5, clock=clock)
    h.take()
    doc = h.document()
    assert doc["time"] == [clock.t] and doc["interval"] == 5 and doc["window"] == 3600
    cpu = doc["devices"]["cpu"]
    assert (cpu["booked"], cpu["measured"], cpu["in_use"]) == ([2 * GiB], [GiB], [6 * GiB])
    assert cpu["budget"] == 8 * GiB and cpu["total"] == 16 * GiB and cpu["name"] == "CPU"
    assert doc["tokens_per_second"] == {"a:latest": [41.23]}  # idle models are left out
    assert doc["in_flight"] == [2] and doc["queued"] == [3]


def test_the_ring_keeps_the_window_and_no_more() -> None:
    clock = Clock()
    h = History(view, interval=5, window=3600, clock=clock)
    assert h.samples.maxlen == 720
    for _ in range(1000):
        h.take()
        clock.t += 5
    assert len(h.samples) == 720
    doc = h.document()
    assert len(doc["time"]) == 720 and doc["time"][-1] == clock.t - 5
    assert all(b - a == 5 for a, b in zip(doc["time"], doc["time"][1:], strict=False))
    # A model that generated once shows zeros around its burst, aligned with the time axis.
    busy = view(tokens_per_second={"m": 10.0})
    h.read = lambda: busy
    h.take()
    doc = h.document()
    assert len(doc["tokens_per_second"]["m"]) == len(doc["time"]) == 720
    assert doc["tokens_per_second"]["m"][-2:] == [0.0, 10.0]
    # since: only what came after
    assert h.document(since=clock.t - 6)["time"] == [clock.t - 5, clock.t]


def test_journal_events_become_marks() -> None:
    clock = Clock()
    h = History(view, interval=5, clock=clock)
    j = Journal()
    j.listen(h.on_event)
    j.record("load", "a:latest", runner=1, devices={"cpu": GiB})
    j.record("ready", "a:latest", runner=1, seconds=1.5)
    j.record("refused", "a:latest", message="queue full")  # a request's, not the machine's
    j.record("unload", "a:latest", runner=1, reason="memory", message="...", room_for="b:latest")
    clock.t = max(m["at"] for m in h.marks) + 1
    marks = h.document()["marks"]
    assert [m["kind"] for m in marks] == ["load", "ready", "unload"]
    assert marks[1]["seconds"] == 1.5 and marks[2]["reason"] == "memory"
    assert marks[2]["room_for"] == "b:latest" and "devices" not in marks[0]
    # Marks older than the window are not shown.
    clock.t += 3601
    assert h.document()["marks"] == []
    h.on_event(Event("crash", "a:latest", clock.t, {"runner": 1}))
    assert [m["kind"] for m in h.document()["marks"]] == ["crash"]


def test_the_sampler_runs_on_the_loop_and_stops() -> None:
    closing = False
    reads: list[asyncio.Event] = []

    def read() -> SchedulerView:
        for e in reads:
            e.set()
        return view(closing=closing)

    async def main() -> None:
        nonlocal closing
        h = History(read, interval=0.05)
        h.start()
        h.start()  # idempotent
        assert len(h.samples) == 0 and h.running  # not inside the caller: soon after it
        for _ in range(3):  # the timer takes the samples by itself
            reads[:] = [asyncio.Event()]
            await reads[0].wait()
        h.stop()
        n = len(h.samples)
        assert n >= 3 and not h.running
        await asyncio.sleep(0.15)
        assert len(h.samples) == n  # stopped: nothing more
        # A sampler stops by itself once the server is closing.
        reads.clear()
        h2 = History(read, interval=0.05)
        closing = True
        reads[:] = [asyncio.Event()]
        h2.start()
        await reads[0].wait()  # (the tick that read the view has run to its end)
        reads.clear()
        assert not h2.running
        h2.start()  # and does not start again
        assert not h2.running and len(h2.samples) == 1

    asyncio.run(main())
