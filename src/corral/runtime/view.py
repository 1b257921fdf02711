"""What the scheduler shows the rest of corral: one plain snapshot, `Scheduler.view()`.

The dashboard, `/metrics`, `/api/ps` (and through it a cluster's agent), the model lists and
`server.py` read the scheduler only through it, so none of them depends on how the shell keeps
its books. Frozen dataclasses of plain values, built in one place (`snapshot`), copied out of
the books: a view never changes after it is taken.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from corral.core.books import Core
from corral.core.devices import CPU, Device
from corral.core.drafting import Choice
from corral.core.waits import Why, waits
from corral.runtime.journal import Event
from corral.runtime.measure import Measure, Record
from corral.runtime.meter import Readings


@dataclass(frozen=True)
class RunnerView:
    id: int
    model: str
    state: str  # "loading", "ready" or "unloading"
    draining: bool  # a queued request needs it reloaded: it is granted nothing new
    pid: int | None
    devices: Mapping[str, int]  # bytes booked per device
    size: int  # bytes booked in all
    slots: int
    context_length: int
    speculative: str  # its drafter (llama.cpp's --spec-type), or "off"
    inflight: int  # requests it serves (those waiting for room among them)
    waiting_for_room: int  # granted requests waiting for room in its shared KV cache
    keep_alive: float  # seconds; inf: forever
    expires_in: float  # seconds until its keep-alive ends (meaningful while idle and ready)
    # seconds it is still held for an agent's next turn (its last answer was a tool call); 0: not
    held_for: float
    pinned: bool
    priority: int
    uses: int
    load_cost: float  # seconds a reload would take now, as the cost-aware policy predicts it
    progress: float | None  # share of its load done, while loading
    loading_for: float | None  # seconds since its process started, while loading
    load_seconds: float | None  # how long its load took, once it serves
    measured: int | None  # its own memory at the last measure (resident less the shared code)
    measured_devices: Mapping[str, int]  # ... per device (GPU memory as NVML reports it)
    page_cache: float | None  # share of its model's file in the page cache, last looked at
    page_cache_at_load: float | None  # ... when its load started
    # Generated tokens per second relayed to its clients over the last few seconds (0 idle),
    # in all and per slot (corral's numbering of the streams it serves at once, `slots` long)
    tokens_per_second: float
    slot_tokens_per_second: tuple[float, ...]


@dataclass(frozen=True)
class Waiting:
    """A request waiting for its turn: queued for a slot (core/waits says why), or granted one
    and waiting for room in its runner's shared KV cache (`why` "room")."""

    request: int | None  # its id in the books
    model: str
    place: int  # 1: next; among its model's queued requests (for room: its runner's wait list)
    of: int  # how many wait there in all
    position: int | None  # its place in the one queue across models (None: waiting for room)
    waited: float  # seconds since it arrived (for room: since it began to wait for room)
    why: Why
    runner: int | None  # the runner it waits on, where its model has one


@dataclass(frozen=True)
class SchedulerView:
    runners: tuple[RunnerView, ...]  # every runner in the books, in the order they were booked
    queued: Mapping[str, int]  # model -> requests waiting for it (`waiting` lists them)
    budgets: Mapping[str, int]  # device -> bytes corral's runners may book there
    booked: Mapping[str, int]  # device -> bytes booked (the reserved bytes included)
    reserved: Mapping[str, int]  # device -> bytes held for all runners at once (shared code)
    headroom: Mapping[str, int]  # device -> what other programs leave corral's runners now
    measured: Mapping[str, int]  # device (of the budgets) -> what the runners really hold there
    devices: tuple[Device, ...]  # as last measured (totals and free figures the OS reports)
    code: int  # the runners' shared code as last measured (resident once for all of them)
    tokens: Mapping[str, tuple[int, int]]  # model -> tokens its runners processed (prompt, out)
    # model -> speculative decoding's drafted tokens and those accepted (models that drafted)
    drafts: Mapping[str, tuple[int, int]]
    # model -> generated tokens relayed to clients, counted as they passed, all along ...
    relayed: Mapping[str, int]
    tokens_per_second: Mapping[str, float]  # ... and per second over the last few seconds
    raised: Mapping[str, float]  # model -> its booking's factor after running out of memory
    disk_seconds_per_byte: float  # what a byte read from disk costs beyond the page cache
    events: tuple[Event, ...]  # the journal's recent decisions, oldest first
    closing: bool  # the server is shutting down
    # each request waiting: the queue in its order, then those waiting for room, per runner
    waiting: tuple[Waiting, ...] = ()
    # model -> what `speculative = "auto"` chose for its drafting and why (models judged)
    drafting: Mapping[str, Choice] = field(default_factory=dict)


def snapshot(
    core: Core,
    records: Mapping[int, Record],
    measure: Measure,
    meter: Readings,
    events: tuple[Event, ...],
    *,
    closing: bool,
    now: float,
) -> SchedulerView:
    """The view of the books, the runner records, the measures and the relayed tokens' meter
    as they are `now` (the scheduler's clock)."""
    runners = []
    for rid, b in core.runners.items():
        rec = records.get(rid)
        runner = rec.runner if rec is not None else None
        progress: float | None = None
        loading_for: float | None = None
        load_seconds: float | None = None
        if runner is not None:
            if b.state == "loading":
                progress = runner.progress
                if runner.started_at > 0:
                    loading_for = now - runner.started_at
            if runner.load_duration > 0:
                load_seconds = runner.load_duration
        slots = meter.slot_rates.get(runner, ())
        slots = (*slots, *(0.0,) * (b.spec.num_parallel - len(slots)))
        runners.append(RunnerView(
            id=b.id, model=b.model, state=b.state, draining=b.draining,
            pid=runner.pid if runner else None, devices=dict(b.devices), size=b.size,
            slots=b.spec.num_parallel, context_length=b.spec.n_ctx, inflight=b.inflight,
            speculative=b.spec.speculative,
            waiting_for_room=len(rec.hop.waiting) if rec and rec.hop else 0,
            keep_alive=b.keep_alive,
            expires_in=b.expires_at - now if math.isfinite(b.expires_at) else math.inf,
            held_for=max(0.0, b.held_until - now) if b.inflight == 0 else 0.0,
            pinned=b.pinned, priority=b.priority, uses=b.uses, load_cost=b.load_cost,
            progress=progress, loading_for=loading_for, load_seconds=load_seconds,
            measured=rec.own if rec else None,
            measured_devices=dict(rec.devices) if rec else {},
            page_cache=rec.cached if rec else None,
            page_cache_at_load=rec.cached_at_load if rec else None,
            tokens_per_second=meter.runner_rates.get(runner, 0.0), slot_tokens_per_second=slots,
        ))  # fmt: skip
    queued: dict[str, int] = {}
    for q in core.queue:
        queued[q.model] = queued.get(q.model, 0) + 1
    waiting = [
        Waiting(w.request.id, w.request.model, w.place, w.of, w.position,
                max(0.0, now - w.request.arrived), w.why, w.runner)
        for w in waits(core)
    ]  # fmt: skip
    for rid, b in core.runners.items():
        rec = records.get(rid)
        room = rec.hop.waiters() if rec is not None and rec.hop is not None else []
        waiting += [
            Waiting(req, b.model, i + 1, len(room), None, max(0.0, now - since), "room", rid)
            for i, (req, since) in enumerate(room)
        ]  # fmt: skip
    measured: dict[str, int] = {}
    for dev in core.budgets:
        n = 0
        for r in runners:
            if dev in r.measured_devices:
                n += r.measured_devices[dev]
            elif dev == CPU and r.measured is not None:
                n += r.measured
        if dev == CPU and n:  # the runners' code, in memory once for all of them
            n += measure.code_last
        measured[dev] = n
    return SchedulerView(
        runners=tuple(runners),
        queued=queued,
        waiting=tuple(waiting),
        budgets=dict(core.budgets),
        booked=core.used(),
        reserved=dict(core.reserved),
        headroom=dict(core.headroom),
        measured=measured,
        devices=tuple(measure.last_devices),
        code=measure.code_last,
        tokens={m: (c[0], c[1]) for m, c in measure.tokens.items()},
        drafts={m: (c[2], c[3]) for m, c in measure.tokens.items() if c[2]},
        relayed=meter.relayed,
        tokens_per_second=meter.rates,
        raised=dict(measure.raised),
        disk_seconds_per_byte=measure.disk_spb,
        events=events,
        closing=closing,
        drafting=dict(measure.drafting),
    )
