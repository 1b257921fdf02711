"""The scheduler's pure core: books of runners and queued requests, driven by events.

No I/O and no clock: every event method takes `now` and appends Actions for the shell
(corral.runtime.scheduler) to carry out. That makes every decision testable with thousands of random
event sequences, and keeps all state in one place that is changed only synchronously, so the
asyncio shell needs no locks.

Rules, in order of importance:
- memory is never over-committed on any device (`budgets`): loading, ready and unloading
  runners all count until the process has exited and its memory is back;
- a runner with requests in flight is never stopped (except when it dies);
- requests for a ready runner are granted at once, whatever else is loading or waiting;
- loads are started first-come, first-served; a load that does not fit evicts idle runners in
  the policy's order, or waits for requests to finish;
- a request whose runner-shaping options differ from the loaded runner drains it (no new
  grants) and reloads it once idle, so it cannot be starved by a stream of other requests;
- a runner whose last answer ended in a tool call is held for the agent's next turn
  (`RunnerBook.held_until`): other loads take other idle victims first, and wait for it no
  longer than its reload would take (see `_hold_end`).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from corral.core.devices import CPU
from corral.core.policy import Candidate, Policy, Snapshot, lru
from corral.core.requests import Action, Fail, Fit, Grant, Load, QueueFull, Request, Stop, StopKind
from corral.core.spec import RunnerSpec

State = Literal["loading", "ready", "unloading"]


@dataclass
class RunnerBook:
    id: int
    model: str
    spec: RunnerSpec
    devices: dict[str, int]  # bytes booked per device
    layout: Any = None
    state: State = "loading"
    inflight: int = 0
    keep_alive: float = 300.0
    expires_at: float = math.inf  # only meaningful while idle and ready
    last_used: float = 0.0
    uses: int = 0
    load_started: float = 0.0
    load_cost: float = 0.0
    draining: bool = False  # a queued request needs it reloaded: grant nothing new
    pinned: bool = False
    priority: int = 0
    process: int = 0  # its process's own memory, booked beside llama.cpp's allocation once loaded
    # Its last answer ended in a tool call: the agent is likely back within seconds with the
    # result, so until then other loads take other idle victims first (Core._hold_end). Ends
    # early on the model's next request or an unload; its keep-alive still runs.
    held_until: float = -math.inf

    @property
    def size(self) -> int:
        return sum(self.devices.values())


QUEUE_FULL_MESSAGE = "server busy, please try again.  maximum pending requests exceeded"
SERVICE_EWMA = 0.2  # weight of the newest request in a model's mean service time


def compatible(spec: RunnerSpec, req: Request) -> bool:
    """Whether a runner with `spec` may serve `req`: the fields the request set must match;
    a request that set no context needs at least the least of its runners' (an automatic
    context's floor), so that it is never served by a runner another client shrank (a larger
    one serves it without a reload)."""
    if "n_ctx" not in req.explicit and spec.n_ctx < req.least.spec.n_ctx:
        return False
    return all(getattr(spec, f) == getattr(req.spec, f) for f in req.explicit)


@dataclass
class Core:
    budgets: dict[str, int]  # device id -> bytes corral's runners may hold there
    # Device id -> the most corral's runners may hold there in all given what other programs
    # use right now (devices.live_headroom, refreshed by the shell). Loads fit under the
    # smaller of this and the budget; a device missing here has only its budget.
    headroom: dict[str, int] = field(default_factory=dict)
    # Device id -> bytes held for every runner at once, not for one: the runners' shared code
    # (mapped by each, resident once). Always booked, so that the first load pays for it too.
    reserved: dict[str, int] = field(default_factory=dict)
    max_loaded: int = 0  # 0: memory decides
    max_queue: int = 512
    default_keep_alive: float = 300.0
    policy: Policy = lru
    runners: dict[int, RunnerBook] = field(default_factory=dict)
    queue: deque[Request] = field(default_factory=deque)
    granted: dict[int, int] = field(default_factory=dict)  # request id -> runner id
    actions: list[Action] = field(default_factory=list)
    evictions: int = 0
    loads: int = 0
    starve_after: float = 5.0  # seconds a load may wait before later grants queue behind it
    heat_decay: float = 0.97  # per request: a model's heat halves after ~23 other requests
    _heat: dict[str, tuple[float, int]] = field(default_factory=dict)  # model -> (heat, at)
    _service: dict[str, float] = field(default_factory=dict)  # model -> mean seconds granted
    _load_cost: dict[str, float] = field(default_factory=dict)  # model -> its last load time
    _granted_at: dict[int, float] = field(default_factory=dict)  # request id -> when
    # Models whose runner was stopped to reload with new options: their load goes before other
    # waiting loads, so the memory it gave up is not taken by another model in the meantime.
    _reloading: set[str] = field(default_factory=set)
    _arrivals: int = 0
    _next_runner: int = 1
    # When the hold that keeps the first waiting load from its victims ends (Core._hold_end):
    # set by the last _pump, so that the timer wakes for it.
    _hold_wake: float = math.inf

    # ---- queries ---------------------------------------------------------------------------
    def used(self) -> dict[str, int]:
        out = {d: self.reserved.get(d, 0) for d in self.budgets}
        for r in self.runners.values():
            for dev, n in r.devices.items():
                out[dev] = out.get(dev, 0) + n
        return out

    def free(self, freed: Mapping[str, int] | None = None, live: bool = False) -> dict[str, int]:
        """Bytes left per device under the budgets (`live`: under the smaller of budget and
        headroom, what a new load may take), counting `freed` bytes as free."""
        used = self.used()
        extra = freed or {}
        caps = self.budgets
        if live:
            caps = {d: min(b, self.headroom.get(d, b)) for d, b in caps.items()}
        return {d: b - used.get(d, 0) + extra.get(d, 0) for d, b in caps.items()}

    def short_of_headroom(self, q: Request) -> bool:
        """Whether q's load fits under the budgets but not under what other programs leave:
        the case the shell tells the operator about."""
        least = q.least
        return self.fit(least) is None and least.fit(self.free()) is not None

    def expected_wait(self, req: Request, now: float) -> float | None:
        """Seconds req would likely wait for a slot, from the models' measured service times
        and load time, the memory other models' requests hold included; None where there is
        nothing to go by (no measure yet)."""
        s = self._service.get(req.model)
        if s is None:
            return None
        r = self.current(req.model)
        load = 0.0
        if r is None or r.draining or not compatible(r.spec, req):
            if req.model not in self._load_cost:
                return None
            room = self._memory_wait(req, now)
            if room is None:
                return None
            load = room + self._load_cost[req.model]
            parallel = req.spec.num_parallel
        else:
            parallel = r.spec.num_parallel
            if r.state == "loading":
                load = max(0.0, r.load_started + self._load_cost.get(req.model, 0.0) - now)
        ahead = sum(1 for q in self.queue if q.model == req.model)
        if r is not None and r.state == "ready" and not r.draining:
            ahead += r.inflight - parallel + 1  # it waits for one of the busy slots too
        return load + max(0, ahead) * s / max(1, parallel)

    def _memory_wait(self, req: Request, now: float) -> float | None:
        """Seconds until req's load has room: 0 if it fits now or once idle runners are
        evicted; else when enough busy runners will have served what they hold and what waits
        for them (from their models' service times), and held runners' holds have yielded.
        None where that cannot be told (a busy model not measured yet, or room that only
        loading or pinned runners hold). Loads queued ahead of req are not counted: a low
        estimate, so that refusals stay sure (and its smallest runner is the one counted)."""
        req = req.least
        free = [r for r in self.runners.values() if r.state == "unloading" or (
            r.state == "ready" and r.inflight == 0 and not r.pinned and r.held_until <= now
        )]  # fmt: skip
        if self.fit(req, _sum_devices(free), len(free)) is not None:
            return 0.0
        busy: list[tuple[float, RunnerBook]] = []
        for r in self.runners.values():
            if r.state != "ready" or r.pinned:
                continue
            if r.inflight == 0:
                if r.held_until > now:  # held for an agent's turn: free once the hold yields
                    busy.append((max(0.0, self._hold_end(r, now) - now), r))
                continue
            s = self._service.get(r.model)
            if s is None:
                return None
            started = [self._granted_at.get(q, now) for q, rid in self.granted.items()
                       if rid == r.id]  # fmt: skip
            left = max((max(0.0, s - (now - at)) for at in started), default=0.0)
            waiting = sum(1 for q in self.queue if q.model == r.model)
            busy.append((left + math.ceil(waiting / max(1, r.spec.num_parallel)) * s, r))
        for t, r in sorted(busy, key=lambda x: x[0]):
            free.append(r)
            if self.fit(req, _sum_devices(free), len(free)) is not None:
                return t
        return None

    def current(self, model: str) -> RunnerBook | None:
        """The model's runner that is loading or ready (not one on its way out)."""
        for r in self.runners.values():
            if r.model == model and r.state != "unloading":
                return r
        return None

    def next_wake(self) -> float:
        """When tick() next has something to do."""
        t = min((q.deadline for q in self.queue if not self._loading_for(q)), default=math.inf)
        for r in self.runners.values():
            if r.state == "ready" and r.inflight == 0:
                t = min(t, r.expires_at)
        return min(t, self._hold_wake)

    def _hold_end(self, r: RunnerBook, arrived: float) -> float:
        """Until when idle held runner `r` is kept from a load whose request arrived at
        `arrived`: the hold's end, but no later than the runner's reload time after the load
        began to wait for it (ski rental: waiting for the agent's turn costs the load at most
        what evicting the runner would cost that turn), nor than starve_after after the
        request came (a model whose agent keeps coming back cannot starve other loads)."""
        waits_from = max(arrived, r.last_used)  # when it went idle: its last release
        return min(r.held_until, waits_from + r.load_cost, arrived + self.starve_after)

    def heat(self, model: str) -> float:
        """Recency-weighted request frequency: +1 per request, decaying per later request.
        Counting requests, not seconds, keeps it independent of how fast traffic arrives."""
        h, at = self._heat.get(model, (0.0, self._arrivals))
        return h * self.heat_decay ** (self._arrivals - at)

    def drain(self) -> list[Action]:
        out, self.actions = self.actions, []
        return out

    # ---- events ----------------------------------------------------------------------------
    def request(self, req: Request, now: float) -> None:
        """A request arrived. Raises QueueFull if it would have to wait and the queue is full."""
        self._heat[req.model] = (self.heat(req.model) + 1.0, self._arrivals)
        self._arrivals += 1
        r = self.current(req.model)
        if r is not None:
            r.held_until = -math.inf  # the turn it was held for has come back
        ready = r is not None and r.state == "ready" and not r.draining and compatible(r.spec, req)
        if not (ready and r is not None and r.inflight < r.spec.num_parallel):
            wait = self.expected_wait(req, now)
            if len(self.queue) >= self.max_queue:
                raise QueueFull(QUEUE_FULL_MESSAGE, self._retry_after(req.model))
            if wait is not None and wait > req.deadline - now:
                # Refused now rather than failed at its deadline: the client can go elsewhere
                # or come back when the queue has drained.
                raise QueueFull(
                    f"server busy, please try again.  model '{req.model}' has "
                    f"{self.queued(req.model)} requests waiting; the expected wait of "
                    f"{wait:.0f}s is longer than the queue timeout",
                    max(1.0, wait - (req.deadline - now)),
                )
        self.queue.append(req)
        self._pump(now)

    def load_order(self) -> list[Request]:
        """The queue in the order loads are tried: first come, first served, but a model
        reloading with new options first (stable: each model's requests keep their order)."""
        return sorted(self.queue, key=lambda q: q.model not in self._reloading)

    def queued(self, model: str) -> int:
        return sum(1 for q in self.queue if q.model == model)

    def _retry_after(self, model: str) -> float:
        """When a slot of the model's runner is likely to free up: a mean service time over
        its slots (1 s when nothing is measured yet)."""
        r = self.current(model)
        s = self._service.get(model)
        if s is None:
            return 1.0
        return max(1.0, s / (r.spec.num_parallel if r is not None else 1))

    def release(self, request_id: int, now: float, hold: float = 0.0) -> None:
        """A granted request finished (or its client went away). `hold`: its answer ended in
        a tool call; hold the runner that long for the agent's next turn."""
        rid = self.granted.pop(request_id, None)
        r = self.runners.get(rid) if rid is not None else None
        at = self._granted_at.pop(request_id, None)
        if r is not None and at is not None:
            prev = self._service.get(r.model)
            took = now - at
            self._service[r.model] = took if prev is None else prev + SERVICE_EWMA * (took - prev)
        if r is not None:
            r.inflight -= 1
            r.last_used = now
            if hold > 0:
                r.held_until = max(r.held_until, now + hold)
            if r.inflight == 0:
                r.expires_at = now + r.keep_alive
                if r.state == "ready" and r.keep_alive <= 0:
                    self._stop(r, "keep_alive 0", "keep_alive")
        self._pump(now)  # also stops it if a queued request needs it reloaded

    def cancel(self, request_id: int, now: float) -> None:
        """The client of a request went away, queued or granted."""
        if request_id in self.granted:
            self.release(request_id, now)
            return
        self.queue = deque(q for q in self.queue if q.id != request_id)
        self._pump(now)

    def loaded(self, runner_id: int, now: float, devices: Mapping[str, int] | None = None) -> None:
        r = self.runners.get(runner_id)
        if r is None or r.state != "loading":
            return
        r.state = "ready"
        r.load_cost = now - r.load_started
        self._load_cost[r.model] = r.load_cost
        r.last_used = now
        r.expires_at = now + r.keep_alive
        if devices is not None:  # what the runner really allocated replaces the estimate
            r.devices = dict(devices)
        self._pump(now)

    def load_failed(
        self,
        runner_id: int,
        message: str,
        now: float,
        *,
        status: int = 500,
        retry_after: float | None = None,
        again: float | None = None,
    ) -> None:
        """The runner's load failed: the requests waiting for it fail with `status`, or with
        `again` (a load that ran out of memory, the first time) they stay queued, each needing
        `again` times the bytes it asked for, and are placed anew."""
        r = self.runners.pop(runner_id, None)
        if r is None:
            return
        failed = []
        for i, q in enumerate(self.queue):
            if q.model == r.model and compatible(r.spec, q):
                if again is not None:
                    self.queue[i] = q.scaled(again)
                else:
                    failed.append(q)
        for q in failed:
            self.queue.remove(q)
            self.actions.append(Fail(q.id, status, message, retry_after))
        self._pump(now)

    def exited(self, runner_id: int, now: float) -> None:
        """The runner process is gone: stopped by us, or died. Its memory is free again."""
        r = self.runners.pop(runner_id, None)
        if r is None:
            return
        for req, rid in list(self.granted.items()):
            if rid == runner_id:  # their streams fail on their own; free the books now
                del self.granted[req]
                self._granted_at.pop(req, None)
        self._pump(now)

    def dying(self, runner_id: int, now: float) -> None:
        """The shell is killing the runner (it stopped responding, or watching it failed):
        grant it nothing more, load a new one for whoever asks; its memory stays booked until
        `exited`."""
        r = self.runners.get(runner_id)
        if r is not None and r.state != "unloading":
            r.state = "unloading"
        self._pump(now)

    def observed(self, runner_id: int, now: float, devices: Mapping[str, int]) -> None:
        """What a ready runner was measured to hold (its proportional set size, its GPU memory
        as the driver reports it). A booking below the measure grows to it, so the books follow
        the machine; if that puts a device over its budget, idle runners are stopped in the
        policy's order until it fits again, never one that is serving. Loading runners keep
        their estimate: their use is still growing."""
        r = self.runners.get(runner_id)
        if r is None or r.state != "ready":
            return
        for dev, n in devices.items():
            r.devices[dev] = max(n, r.devices.get(dev, 0))
        self._pump(now)

    def reserve(self, device: str, n: int, now: float) -> None:
        """Hold `n` bytes on `device` for all runners at once (their shared code, measured):
        if that puts it over its budget, idle runners make room as for a grown booking."""
        self.reserved[device] = n
        self._pump(now)

    def reload_cost(self, runner_id: int, seconds: float) -> None:
        """What reloading this runner's model would cost now (the shell predicts it from how
        much of the file is in the page cache): the cost-aware policy weighs it."""
        r = self.runners.get(runner_id)
        if r is not None:
            r.load_cost = seconds

    def set_headroom(self, headroom: Mapping[str, int], now: float) -> None:
        """What other programs leave free for corral's runners changed (the shell measures
        it): a load waiting for room may start, or one that no longer fits waits. Runners
        already loaded stay; only the budgets decide evictions."""
        self.headroom = dict(headroom)
        self._pump(now)

    def over_budget(self) -> dict[str, int]:
        """Bytes booked beyond each device's budget (only after measures grew bookings)."""
        return {d: -f for d, f in self.free().items() if f < 0}

    def _shed(self, now: float) -> None:
        over = self.over_budget()
        if not over:
            return
        stopping = [r for r in self.runners.values() if r.state == "unloading"]
        idle = {
            r.id: r
            for r in self.runners.values()
            if r.state == "ready" and r.inflight == 0 and not r.pinned
        }
        snap = Snapshot(now=now, need=sum(over.values()),
                        waiting_models=frozenset(q.model for q in self.queue))  # fmt: skip
        cands = [_candidate(r, self.heat(r.model)) for r in idle.values()]
        victims: list[RunnerBook] = []
        for rid in self.policy(cands, snap):
            freed = _sum_devices(stopping + victims)
            if all(freed.get(d, 0) >= n for d, n in over.items()):
                break
            if rid in idle and any(idle[rid].devices.get(d, 0) for d in over):
                victims.append(idle[rid])
        for v in victims:
            self.evictions += 1
            self._stop(v, "evicted: measured memory is over the budget", "memory")

    def unload(self, model: str, now: float) -> bool:
        """Unload a model as soon as it is idle (keep_alive 0, `corral stop`, router unload)."""
        found = False
        for r in self.runners.values():
            if r.model == model and r.state != "unloading":
                found = True
                r.keep_alive = 0.0
                r.expires_at = now
                r.held_until = -math.inf
                if r.inflight == 0 and r.state == "ready":
                    self._stop(r, "unload requested")
        self._pump(now)
        return found

    def restart(self, runner_id: int, reason: str, now: float) -> bool:
        """Stop a runner whose options changed behind it (auto's drafting) once it is idle and
        no request waits for its model: the next request loads it anew. False: not now."""
        r = self.runners.get(runner_id)
        if r is None or r.state != "ready" or r.inflight or self.queued(r.model):
            return False
        self._stop(r, reason, "options_change")
        self._pump(now)
        return True

    def tick(self, now: float) -> None:
        """Timers: keep-alive expiry and request deadlines."""
        for r in list(self.runners.values()):
            if r.state == "ready" and r.inflight == 0 and r.expires_at <= now:
                self._stop(r, "keep-alive expired", "keep_alive")
        for q in [q for q in self.queue if q.deadline <= now and not self._loading_for(q)]:
            self.queue.remove(q)
            self.actions.append(
                Fail(q.id, 503, f"timed out waiting for model '{q.model}' to become available",
                     self._retry_after(q.model))
            )  # fmt: skip
        self._pump(now)

    def _loading_for(self, q: Request) -> bool:
        """Whether q's runner is loading: q then waits for the load (bounded by the load
        timeout) past its deadline, rather than leave a runner loaded for nobody."""
        r = self.current(q.model)
        return r is not None and r.state == "loading" and not r.draining and compatible(r.spec, q)

    # ---- decisions -------------------------------------------------------------------------
    def _stop(
        self, r: RunnerBook, reason: str, kind: StopKind = "requested", room_for: str | None = None
    ) -> None:
        r.state = "unloading"
        self.actions.append(Stop(r.id, reason, kind, room_for))

    def _grant(self, q: Request, r: RunnerBook, now: float) -> None:
        self.queue.remove(q)
        r.inflight += 1
        r.uses += 1
        r.last_used = now
        r.expires_at = math.inf
        if q.keep_alive is not None:
            r.keep_alive = q.keep_alive
        if q.pinned:
            r.pinned = True
        self.granted[q.id] = r.id
        self._granted_at[q.id] = now
        self.actions.append(Grant(q.id, r.id))

    def fit(
        self, q: Request, freed: Mapping[str, int] | None = None, leaving: int = 0
    ) -> Fit | None:
        """Where q's runner would go if `freed` bytes (of `leaving` runners) were free."""
        if self.max_loaded and len(self.runners) - leaving >= self.max_loaded:
            return None
        return q.fit(self.free(freed, live=True))

    def _pump(self, now: float) -> None:
        # Grants first: a request waiting for a loaded model takes its slot before any load
        # looks for idle runners to evict, so a model is not evicted (and reloaded) while a
        # request for it waits behind a request for another model. So that a steady stream of
        # such requests cannot keep a load waiting for ever, once the first waiting load has
        # waited longer than starve_after, the runners it needs to evict take no request that
        # arrived after it; every other runner keeps serving.
        held: set[int] = set()
        cutoff = math.inf
        self._hold_wake = math.inf
        for q in self.queue:
            if self.current(q.model) is None:
                if now - q.arrived > self.starve_after:
                    ready = [r for r in self.runners.values() if r.state == "ready"]
                    held = {v.id for v in self._victims(q.least, ready, now) or []}
                    cutoff = q.arrived
                break
        self._reloading &= {q.model for q in self.queue}
        self._pass(now, loads=False, cutoff=cutoff, held=held)
        self._pass(now, loads=True, cutoff=cutoff, held=held)
        self._shed(now)  # after the grants: a runner someone waits for is not shed

    def _pass(self, now: float, loads: bool, cutoff: float, held: set[int]) -> None:
        load_blocked = not loads
        waiting_for_current: set[str] = set()  # models with a compatible request ahead
        for b in self.runners.values():
            # Draining follows the queue: if the request that wanted new options leaves, the
            # runner serves again instead of being stopped for nothing.
            b.draining = False
        order = self.load_order() if loads else list(self.queue)
        for q in order:
            r = self.current(q.model)
            if r is not None and not compatible(r.spec, q):
                if q.model in waiting_for_current:
                    continue  # requests ahead of q get the runner they asked for first
                r.draining = True  # later requests wait for the reloaded runner
            if r is not None and r.draining:
                if r.state == "ready" and r.inflight == 0:
                    self._stop(r, "reloading with new options", "options_change")
                    # Its reload goes first, unless a load has starved for this memory: then
                    # that one does (else a reload that serves no held-back request loops).
                    if cutoff == math.inf:
                        self._reloading.add(r.model)
                continue
            if r is not None:
                if r.state == "ready" and r.inflight < r.spec.num_parallel:
                    if q.arrived <= cutoff or r.id not in held:
                        self._grant(q, r, now)
                else:  # loading, or all its slots busy
                    waiting_for_current.add(q.model)
                continue
            if load_blocked:
                continue  # first come, first served among loads
            if any(b.model == q.model for b in self.runners.values()):
                load_blocked = True  # its old runner is still exiting
                continue
            chosen = self._make_room(q, now)
            if chosen is None:
                load_blocked = True
                continue
            self._start_load(*chosen, now)
            waiting_for_current.add(q.model)  # q waits for this runner: later misfits wait too

    def _start_load(self, q: Request, fit: Fit, now: float) -> None:
        self._reloading.discard(q.model)
        rid = self._next_runner
        self._next_runner += 1
        self.runners[rid] = RunnerBook(
            id=rid,
            model=q.model,
            spec=q.spec,
            devices=dict(fit.devices),
            layout=fit.layout,
            keep_alive=self.default_keep_alive if q.keep_alive is None else q.keep_alive,
            load_started=now,
            last_used=now,
            pinned=q.pinned,
            priority=q.priority,
            process=q.process,
        )
        self.loads += 1
        self.actions.append(Load(rid, q.model, q.spec, fit))

    def _make_room(self, q: Request, now: float) -> tuple[Request, Fit] | None:
        """Which of q's runners loads now and where, if one fits: the first of `q.choices`
        that fits in free memory, or else, evicting idle runners, the first that fits then
        (its load starts once they have exited). Fail q if even its smallest can never fit,
        or leave it waiting for requests to finish; all three return None."""
        gpu_loading = self.gpu_loading(q)
        for c in q.choices:
            fit = self.fit(c)
            if fit is not None and not gpu_loading:
                return c, fit
        least = q.least
        if gpu_loading:
            return None  # placed once that load's real figure is in the books
        room = {d: b - self.reserved.get(d, 0) for d, b in self.budgets.items()}
        if least.fit(room) is None:
            caps = [
                f"{_size(b)} on {d}" + (f" ({_size(n)} of it for the runners' code)" if n else "")
                for d, b in self.budgets.items()
                for n in [self.reserved.get(d, 0)]
            ]
            msg = f"model '{q.model}' needs {_size(least.size)} but corral may use at most " + (
                ", ".join(caps)
            )
            for other in [o for o in self.queue if o.model == q.model and o.spec == q.spec]:
                self.queue.remove(other)
                self.actions.append(Fail(other.id, 507, msg))
            return None
        stopping = [r for r in self.runners.values() if r.state == "unloading"]
        idle = [r for r in self.runners.values() if r.state == "ready" and r.inflight == 0]
        # Runners held for an agent's next turn are no victims while the hold lasts for q:
        # other idle runners (or fewer slots) first, else q waits for the hold to yield.
        ends = [e for r in idle if not r.pinned and (e := self._hold_end(r, q.arrived)) > now]
        if ends:
            idle = [r for r in idle if self._hold_end(r, q.arrived) <= now]
        for c in q.choices:
            if self.fit(c, _sum_devices(stopping), len(stopping)) is not None:
                return None  # enough is already on its way out
            victims = self._victims(c, idle, now)
            if victims is None:
                continue  # even every idle runner is not enough: try fewer slots
            for v in victims:
                self.evictions += 1
                self._stop(v, f"evicted to make room for '{q.model}'", "memory", q.model)
            return None  # the load starts once the victims have exited
        if ends:  # perhaps a held runner is what it waits for: look again when a hold yields
            self._hold_wake = min(self._hold_wake, *ends)
        return None  # busy (or held) runners hold the room: wait for them

    def gpu_loading(self, q: Request) -> bool:
        """Whether q would use a GPU (as placed on an empty machine) onto which another runner
        is loading: loads onto one GPU go one at a time, each placed with the real figures of
        those before it (a GPU has no swap: a second load booked on an estimate that proves
        short crashes them both)."""
        loading = {d for r in self.runners.values() if r.state == "loading"
                   for d, n in r.devices.items() if d != CPU and n}  # fmt: skip
        if not loading:
            return False
        room = {d: b - self.reserved.get(d, 0) for d, b in self.budgets.items()}
        fit = q.fit(room) or q.least.fit(room)
        return fit is not None and any(fit.devices.get(d) for d in loading)

    def _victims(self, q: Request, pool: list[RunnerBook], now: float) -> list[RunnerBook] | None:
        """Unpinned runners from `pool` whose eviction makes room for q, in the policy's order
        and without any it turns out not to need; None if the whole pool is not enough."""
        stopping = [r for r in self.runners.values() if r.state == "unloading"]
        pool_by_id = {r.id: r for r in pool if not r.pinned}
        snap = Snapshot(
            now=now,
            need=max(0, q.size - sum(self.free(_sum_devices(stopping), live=True).values())),
            waiting_models=frozenset(o.model for o in self.queue),
        )
        victims: list[RunnerBook] = []
        cands = [_candidate(r, self.heat(r.model)) for r in pool_by_id.values()]
        for rid in self.policy(cands, snap):
            if rid in pool_by_id:
                victims.append(pool_by_id[rid])
                if self.fit(q, _sum_devices(stopping + victims), len(stopping) + len(victims)):
                    break
        else:
            return None  # even the whole pool would not make room: wait
        # Spare any victim the load turns out not to need (e.g. a small one offered first).
        for v in list(victims):
            rest = [x for x in victims if x is not v]
            if self.fit(q, _sum_devices(stopping + rest), len(stopping) + len(rest)):
                victims = rest
        return victims


def _sum_devices(runners: list[RunnerBook]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in runners:
        for d, n in r.devices.items():
            out[d] = out.get(d, 0) + n
    return out


def _candidate(r: RunnerBook, heat: float) -> Candidate:
    return Candidate(
        id=r.id,
        model=r.model,
        size=r.size,
        last_used=r.last_used,
        uses=r.uses,
        load_cost=r.load_cost,
        expires_at=r.expires_at,
        priority=r.priority,
        heat=heat,
        held_until=r.held_until,
    )


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"
