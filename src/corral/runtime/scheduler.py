"""The scheduler's shell: carries out the core's decisions with real runner processes.

Every state change goes through corral.core.books.Core, called synchronously on the event loop
(no await between reading and changing the books), so there are no locks and no lock-order
deadlocks. Slow work (spawning, loading, stopping runners) runs in tasks that report back
with another synchronous event.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import math
import os
import re
import signal
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import psutil

from corral.core.books import (
    Core,
    Fail,
    Grant,
    Load,
    Placer,
    QueueFull,
    Request,
    RunnerBook,
    Stop,
    cpu_placer,
    scaled_placer,
)
from corral.core.devices import CPU, GPU_CONTEXT_BYTES, Device, live_headroom
from corral.core.estimate import RUNNER_CODE_BYTES
from corral.core.gguf import split_parts
from corral.core.policy import (
    DEFAULT_DISK_SECONDS_PER_BYTE,
    DEFAULT_POLICY,
    POLICIES,
    disk_seconds_per_byte,
    reload_seconds,
)
from corral.core.spec import Layout, RunnerSpec
from corral.runtime.devices import gpu_process_memory
from corral.runtime.journal import Journal
from corral.runtime.memwatch import Usage, code_rss, oom_kills, process_usage
from corral.runtime.pagecache import prefetch, resident
from corral.runtime.runner import Runner, RunnerError

log = logging.getLogger(__name__)

SHUTDOWN_GRACE = 0.5  # seconds a serving runner gets to exit on SIGTERM when the server stops
SHUTDOWN_RETRY_AFTER = 5.0  # a restarting server is usually back within seconds
OOM_RAISE = 1.25  # a model that ran out of memory is booked this much higher next time ...
OOM_RAISE_MAX = 4.0  # ... up to this factor in all
RESIDENCY_EVERY = 5  # measures between two reads of every loaded model's page-cache residency
# What llama.cpp (ggml, CUDA, Vulkan) says when an allocation fails during a load.
_ALLOC_FAILED = re.compile(
    r"out of memory|failed to allocate|unable to allocate|cudaMalloc|bad_alloc"
    r"|ErrorOutOfDeviceMemory|SIGKILL",
    re.I,
)


class SchedulerError(Exception):
    def __init__(self, status: int, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.retry_after = retry_after  # seconds; set on 503s a retry can cure


@dataclass
class Ticket:
    id: int
    arrived: float
    fut: asyncio.Future[Runner]


@dataclass
class Lease:
    """A granted request's hold on one runner slot. Release exactly once (idempotent)."""

    scheduler: Scheduler
    request_id: int
    runner: Runner
    waited: float  # seconds from arrival to grant (queueing + loading)
    loaded: bool  # this request waited for its runner to load
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.scheduler._release(self.request_id)

    # `async with await service.lease(...) as lease:` returns it however the block ends.
    async def __aenter__(self) -> Lease:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release()


class Scheduler:
    def __init__(
        self,
        budgets: dict[str, int],
        *,
        max_loaded: int = 0,
        max_queue: int = 512,
        default_keep_alive: float = 300.0,
        load_timeout: float = 300.0,
        queue_timeout: float = math.inf,
        policy: str = DEFAULT_POLICY,
        llama_server: str | None = None,
        devices: list[Device] | None = None,
        refresh: Callable[[list[Device]], list[Device]] | None = None,
        recovery_timeout: float = 5.0,
        stall_timeout: float = math.inf,
        measure_interval: float = 2.0,
        margin: int = 0,
    ) -> None:
        self.core = Core(
            budgets=budgets,
            max_loaded=max_loaded,
            max_queue=max_queue,
            default_keep_alive=default_keep_alive,
            policy=POLICIES[policy],
            # The runners' shared code, resident once for all of them (raised if measured more)
            reserved={CPU: RUNNER_CODE_BYTES} if CPU in budgets else {},
        )
        # Each runner's resident code (memwatch.code_rss, measured once when it is ready): what
        # its measure holds beyond its own memory, which its booking is compared with; and the
        # last one measured, for a runner whose own is not yet in.
        self._code: dict[int, int] = {}
        self.code_last = 0
        self._measures = 0
        self.load_timeout = load_timeout
        self.queue_timeout = queue_timeout
        self.llama_server = llama_server
        self.devices = devices or []
        self.refresh = refresh
        self.recovery_timeout = recovery_timeout
        self.stall_timeout = stall_timeout  # inf: no watchdog
        self.measure_interval = measure_interval  # seconds between measures of real memory
        self._measurer: asyncio.Task[None] | None = None
        self.measured: dict[int, int] = {}  # runner id -> its last measured PSS, bytes
        self.measured_devices: dict[int, dict[str, int]] = {}  # ... and per device (NVML)
        self.margin = margin  # bytes to keep free per device (headroom is checked against it)
        self.raised: dict[str, float] = {}  # model -> booking factor after running out of memory
        self._warned_headroom: set[int] = set()  # requests whose wait for room was logged
        self.journal = Journal()  # every decision, for metrics and the dashboard
        self.last_devices: list[Device] = list(self.devices)  # as last measured
        # Tokens each model's runners processed (prompt, generated), summed over the runners'
        # own counters (llama.cpp's /metrics), read with every measure.
        self.tokens: dict[str, list[int]] = {}
        self._runner_tokens: dict[int, tuple[int, int]] = {}
        self.on_wait: Callable[[str, float], None] | None = None  # (model, seconds) per grant
        # What a reload costs: the fraction of each runner's file in the page cache when its
        # load started and now, the last loads of each file (seconds, that fraction), and
        # what a byte read from disk costs beyond one in the cache (learned from them).
        self._load_resident: dict[int, float] = {}
        self.residency: dict[int, float] = {}
        self._file_loads: dict[str, tuple[float, float]] = {}
        self.disk_spb = DEFAULT_DISK_SECONDS_PER_BYTE
        self._prefetched: set[str] = set()  # files read ahead for a load waiting for room
        # Called with an idle runner about to be stopped (and whether a load waits for its
        # memory), e.g. to save its slots' KV cache; bounded by `before_stop_timeout`.
        self.before_stop: Callable[[Runner, Stop, bool], Awaitable[None]] | None = None
        self.before_stop_timeout = 10.0
        # The kernel's OOM kill count at the last two measures (the older one is compared).
        self._oom_seen: collections.deque[int | None] = collections.deque([oom_kills()], maxlen=2)
        # Where runners started from now on let llama.cpp save and restore slots (the KV
        # cache directory; None: no slot saving).
        self.slot_save_path: str | None = None
        self._set_headroom(self.devices, [], {})  # as discovered; then every measure_interval
        self._free_before: dict[int, dict[str, int]] = {}  # runner id -> GPU free at stop
        self.runners: dict[int, Runner] = {}
        self._waiters: dict[int, asyncio.Future[Runner]] = {}
        self._ids = itertools.count(1)
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closing = False

    # ---- the API's side ----------------------------------------------------------------------
    def submit(
        self,
        model: str,
        spec: RunnerSpec,
        *,
        explicit: frozenset[str] = frozenset(),
        size: int,
        keep_alive: float | None = None,
        pinned: bool = False,
        priority: int = 0,
        place: Placer | None = None,
        process: int = 0,
    ) -> Ticket:
        """Ask for a runner slot for `model` (`size`: its runner's bytes in all, `process` of
        them the runner process's own). Synchronous: when the model's runner has a free slot
        the ticket is granted on return. SchedulerError if refused."""
        if self._closing:
            raise SchedulerError(503, "server is shutting down", SHUTDOWN_RETRY_AFTER)
        k = self.raised.get(model)
        if k is not None:  # it ran out of memory before: ask for more room this time
            place = scaled_placer(place or cpu_placer(size), k)
            size = int(size * k)
        if self._measurer is None and math.isfinite(self.measure_interval):
            self._measurer = asyncio.ensure_future(self._measure_forever())
        now = time.monotonic()
        rid = next(self._ids)
        fut: asyncio.Future[Runner] = asyncio.get_running_loop().create_future()
        self._waiters[rid] = fut
        req = Request(
            id=rid, model=model, spec=spec, explicit=explicit, size=size, keep_alive=keep_alive,
            arrived=now, deadline=now + self.queue_timeout, pinned=pinned, priority=priority,
            place=place, process=process,
        )  # fmt: skip
        try:
            self.core.request(req, now)
        except QueueFull as e:
            del self._waiters[rid]
            self.journal.record("refused", model, message=str(e))
            raise SchedulerError(503, str(e), e.retry_after) from None
        self._apply()
        return Ticket(rid, now, fut)

    async def wait(self, ticket: Ticket) -> Lease:
        """The lease for a submitted ticket; SchedulerError if its load failed or it timed out.
        Cancelling the wait (the client went away) leaves nothing behind in the books."""
        try:
            runner = await ticket.fut
        except asyncio.CancelledError:
            self._waiters.pop(ticket.id, None)
            self.core.cancel(ticket.id, time.monotonic())
            self._apply()
            raise
        waited = time.monotonic() - ticket.arrived
        if self.on_wait is not None:
            self.on_wait(runner.name, waited)
        return Lease(self, ticket.id, runner, waited, runner.started_at >= ticket.arrived)

    async def acquire(self, model: str, spec: RunnerSpec, **kw: Any) -> Lease:
        return await self.wait(self.submit(model, spec, **kw))

    def _release(self, request_id: int) -> None:
        self.core.release(request_id, time.monotonic())
        self._apply()

    def unload(self, model: str) -> bool:
        found = self.core.unload(model, time.monotonic())
        self._apply()
        return found

    def snapshot(self) -> list[tuple[RunnerBook, Runner]]:
        return [
            (b, self.runners[rid]) for rid, b in self.core.runners.items() if rid in self.runners
        ]

    def queued(self, model: str) -> int:
        return self.core.queued(model)

    # ---- carrying out decisions --------------------------------------------------------------
    def _apply(self) -> None:
        for a in self.core.drain():
            if isinstance(a, Grant):
                fut = self._waiters.pop(a.request, None)
                if fut is None or fut.done():  # cancelled between decision and delivery
                    self.core.release(a.request, time.monotonic())
                    continue
                fut.set_result(self.runners[a.runner])
            elif isinstance(a, Fail):
                fut = self._waiters.pop(a.request, None)
                if fut is not None and not fut.done():
                    fut.set_exception(SchedulerError(a.status, a.message, a.retry_after))
            elif isinstance(a, Load):
                layout = a.fit.layout if isinstance(a.fit.layout, Layout) else None
                runner = Runner(
                    a.model, a.spec, self.llama_server, layout, slot_save_path=self.slot_save_path
                )
                runner.short_spin = runner.layout.n_gpu_layers == 0 and self._computing_on_cpu()
                self.runners[a.runner] = runner
                log.info(
                    "loading model '%s' (runner %d): booked %s", a.model, a.runner,
                    ", ".join(f"{n / 2**20:.1f} MiB on {d}" for d, n in a.fit.devices.items() if n),
                )  # fmt: skip
                self.journal.record("load", a.model, runner=a.runner, devices=dict(a.fit.devices))
                self._spawn(self._load(a.runner, runner))
            elif isinstance(a, Stop):
                self._note_free_before(a.runner)
                if a.room_for is not None:
                    self._prefetch_for(a.room_for)
                self.journal.record(
                    "unload", self.runners[a.runner].name, runner=a.runner, reason=a.kind,
                    message=a.reason, room_for=a.room_for,
                )  # fmt: skip
                log.info(
                    "unloading model '%s' (runner %d): %s",
                    self.runners[a.runner].name,
                    a.runner,
                    a.reason,
                )
                self._spawn(self._stop_runner(a, self.runners[a.runner]))
        self._arm_timer()

    def _computing_on_cpu(self) -> bool:
        """Whether a runner that stays (loading or ready, not on its way out) computes on the
        CPU: then a CPU runner started now gets the short spin (runner.GOMP_SPINCOUNT)."""
        return any(
            book.state != "unloading" and rid in self.runners
            and self.runners[rid].layout.n_gpu_layers == 0
            for rid, book in self.core.runners.items()
        )  # fmt: skip

    async def _stop_runner(self, stop: Stop, runner: Runner) -> None:
        if runner.load_duration > 0 and runner.stalled is None and not self._closing:
            # what it processed since the last measure (2 s) would be lost with it
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._count_runner_tokens(stop.runner, runner), 1.0)
        if self.before_stop is not None and not self._closing:
            waiting = stop.room_for is not None or stop.kind == "options_change"
            try:
                await asyncio.wait_for(
                    self.before_stop(runner, stop, waiting), self.before_stop_timeout
                )
            except asyncio.TimeoutError:
                log.warning(
                    "saving state of '%s' took over %.0fs; stopping it anyway",
                    runner.name, self.before_stop_timeout,
                )  # fmt: skip
            except Exception:  # saving is an optimisation: never a reason not to stop
                log.exception("before stopping the runner for '%s'", runner.name)
        await runner.stop()

    def _spawn(self, coro: Any) -> None:
        t = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def _load(self, rid: int, runner: Runner) -> None:
        if self._closing:  # a load decided while the server stops: nobody will use it
            self.runners.pop(rid, None)
            return
        # How much of the file is cached as the load starts (read beside the spawn: the child
        # takes far longer to reach the file than mincore takes to answer).
        res = asyncio.ensure_future(asyncio.to_thread(resident, runner.spec.path))
        self._prefetched.discard(runner.spec.path)
        try:
            await runner.start(self.load_timeout)
            if (fraction := await res) is not None:
                self._load_resident[rid] = fraction
        except RunnerError as e:
            if runner.shutting_down:
                log.info("loading '%s' stopped: the server is shutting down", runner.name)
            else:
                log.error("loading '%s' failed: %s", runner.name, e)
                self.journal.record("load_failed", runner.name, runner=rid, message=str(e))
                found = _ALLOC_FAILED.search(str(e))
                if found and (found.group(0).upper() != "SIGKILL" or self._oom_killed()):
                    self._ran_out_of_memory(runner.name)
            self.runners.pop(rid, None)
            self.core.load_failed(rid, str(e), time.monotonic())
            self._apply()
            return
        except Exception as e:  # spawn failures (OSError, ...): same contract, clear message
            log.exception("loading '%s' failed", runner.name)
            self.runners.pop(rid, None)
            self.core.load_failed(
                rid, f"could not start a runner for '{runner.name}': {e}", time.monotonic()
            )
            self._apply()
            return
        # From here the process runs: whatever happens next, it is watched (and so its exit
        # frees the books).
        self._spawn(self._watch(rid, runner))
        try:
            self._loaded(rid, runner)
        except Exception:
            log.exception("booking the runner for '%s' failed; killing it", runner.name)
            self.core.dying(rid, time.monotonic())
            runner.kill_now()
        self._apply()

    def _loaded(self, rid: int, runner: Runner) -> None:
        log.info(
            "model '%s' ready in %.2fs at %s (pid %s)",
            runner.name,
            runner.load_duration,
            runner.base_url,
            runner.pid,
        )
        alloc = runner.allocation
        real = alloc.booked(self.core.budgets.keys()) if alloc and alloc.total else None
        book = self.core.runners.get(rid)
        if real is not None and book is not None:
            log.info(
                "model '%s' allocated %.1f MiB (estimated %.1f MiB)",
                runner.name,
                sum(real.values()) / 2**20,
                book.size / 2**20,
            )
        if real is not None:  # llama.cpp's buffers, the process that holds them, its contexts
            real[CPU] = real.get(CPU, 0) + (book.process if book is not None else 0)
            for dev, n in list(real.items()):
                if dev != CPU and n:
                    real[dev] = n + GPU_CONTEXT_BYTES
            k = self.raised.get(runner.name, 1.0)
            real = {d: int(n * k) for d, n in real.items()}
        self._learn_disk_speed(rid, runner)
        now = time.monotonic()
        self.core.loaded(rid, now, real)  # the real allocation replaces the estimate
        if book is not None:
            self.journal.record(
                "ready", runner.name, runner=rid, seconds=round(runner.load_duration, 3),
                devices=dict(book.devices),
            )  # fmt: skip
        if runner.pid is not None and math.isfinite(self.measure_interval):
            # Measured at once too: the books must hold what it holds from the start, not
            # from the next measure (/proc/PID/status: ~50 us). Its code is measured once, off
            # the event loop (a walk of every page it maps), and it is measured again then.
            usage = process_usage(runner.pid)
            if usage is not None:
                self._observe(rid, now, usage, {})
            self._spawn(self._measure_code(rid, runner.pid))

    async def _measure_forever(self) -> None:
        """Every few seconds: what each runner really holds goes to the books (Core.observed:
        a booking below the measure grows to it, and idle runners make room if that is over
        the budget), and what other programs leave free becomes the headroom loads must fit
        under (Core.headroom)."""
        while not self._closing:
            try:
                await self._measure_once()
            except Exception:  # a measure must never end the measuring
                log.exception("measuring the runners' memory failed")
            await asyncio.sleep(self.measure_interval)

    async def _measure_once(self) -> None:
        self._oom_seen.append(oom_kills())
        pids = {rid: r.pid for rid, r in self.runners.items() if r.pid}
        # Device refreshes and NVML calls take ~0.1-1 ms each: off the event loop.
        devices, usages, gpu = await asyncio.to_thread(self._read_machine, list(pids.values()))
        self.last_devices = devices
        now = time.monotonic()
        for (rid, _), usage in zip(pids.items(), usages, strict=True):
            book = self.core.runners.get(rid)
            if usage is not None and book is not None:
                self._observe(rid, now, usage, gpu)
        self._set_headroom(devices, usages, gpu)
        self._apply()
        self._warn_short_of_headroom()
        await self._count_tokens()
        # mincore over each model file (~35 ms per GB): every few measures, and at once for a
        # runner that has no residency yet
        self._measures += 1
        await self._predict_reloads(every=self._measures % RESIDENCY_EVERY == 0)

    async def _count_tokens(self) -> None:
        """Add what each ready runner processed since the last read to its model's count."""
        books = self.core.runners
        ready = [(rid, r) for rid, r in self.runners.items()
                 if rid in books and books[rid].state == "ready"]  # fmt: skip
        await asyncio.gather(*(self._count_runner_tokens(rid, r) for rid, r in ready))

    async def _count_runner_tokens(self, rid: int, runner: Runner) -> None:
        c = await runner.token_counts()
        if c is None:
            return
        before = self._runner_tokens.get(rid, (0, 0))
        total = self.tokens.setdefault(runner.name, [0, 0])
        total[0] += max(0, c[0] - before[0])
        total[1] += max(0, c[1] - before[1])
        self._runner_tokens[rid] = c

    def _read_machine(
        self, pids: list[int]
    ) -> tuple[list[Device], list[Usage | None], dict[int, dict[str, int]]]:
        devices = self.refresh(self.devices) if self.refresh is not None else self.devices
        gpus = [d for d in devices if d.library != "cpu"]
        return devices, [process_usage(p) for p in pids], gpu_process_memory(gpus) if gpus else {}

    async def _measure_code(self, rid: int, pid: int) -> None:
        """A new runner's resident code, once: then its measure is its own memory, and the
        reservation for all runners' code is raised if one of them holds more (never lowered:
        the code is the same for every runner, in memory once)."""
        code = await asyncio.to_thread(code_rss, pid)
        if code is None or rid not in self.runners:
            return
        self._code[rid] = self.code_last = code
        now = time.monotonic()
        reserved = self.core.reserved.get(CPU)
        if reserved is not None and code > reserved:
            log.warning(
                "the runners' shared code holds %.1f MiB, more than the %.1f MiB reserved for "
                "it: reserving that", code / 2**20, reserved / 2**20,
            )  # fmt: skip
            self.core.reserve(CPU, code, now)
        usage = process_usage(pid)
        if usage is not None:
            self._observe(rid, now, usage, {})
        self._apply()

    def _observe(
        self, rid: int, now: float, usage: Usage, gpu: Mapping[int, Mapping[str, int]]
    ) -> None:
        book = self.core.runners.get(rid)
        if book is None or book.state != "ready":
            return
        # its own memory: the code is reserved for all runners (until a runner's code is
        # measured, the last one measured or, before any, what is reserved for it)
        code = self._code.get(rid) or self.code_last or self.core.reserved.get(CPU, 0)
        own = max(0, usage.rss - code)
        seen = {CPU: own}
        for pid in usage.pids:
            for dev, n in gpu.get(pid, {}).items():
                seen[dev] = seen.get(dev, 0) + n
        self.measured[rid] = own
        self.measured_devices[rid] = seen
        for dev, n in seen.items():
            if n > book.devices.get(dev, 0):
                log.warning(
                    "model '%s' holds %.1f MiB on %s, %.1f MiB more than booked",
                    book.model, n / 2**20, dev, (n - book.devices.get(dev, 0)) / 2**20,
                )  # fmt: skip
        self.core.observed(rid, now, seen)

    def _set_headroom(
        self,
        devices: list[Device],
        usages: list[Usage | None],
        gpu: Mapping[int, Mapping[str, int]],
    ) -> None:
        """What other programs leave for corral's runners on each device, right now."""
        booked = self.core.used()
        ours = {p for u in usages if u is not None for p in u.pids}
        in_use: dict[str, int] = {CPU: sum(u.anon for u in usages if u is not None)}
        for pid, by_dev in gpu.items():
            if pid in ours:
                for dev, n in by_dev.items():
                    in_use[dev] = in_use.get(dev, 0) + n
        headroom = {}
        for d in devices:
            if d.id in self.core.budgets:
                headroom[d.id] = live_headroom(
                    d, booked.get(d.id, 0), in_use_by_us=in_use.get(d.id), margin=self.margin
                )
        self.core.set_headroom(headroom, time.monotonic())

    def _warn_short_of_headroom(self) -> None:
        for q in self.core.queue:
            if self.core.current(q.model) is not None or q.id in self._warned_headroom:
                continue
            if self.core.short_of_headroom(q):
                self._warned_headroom.add(q.id)
                room = ", ".join(
                    f"{n / 2**20:.0f} MiB on {d}" for d, n in self.core.headroom.items()
                )
                log.warning(
                    "loading model '%s' waits: other programs leave corral's runners only %s",
                    q.model, room,
                )  # fmt: skip
            break  # loads start first come, first served: only the first one waits for room
        if len(self._warned_headroom) > 4096:
            self._warned_headroom.clear()

    def _learn_disk_speed(self, rid: int, runner: Runner) -> None:
        """Two loads of one file with different page-cache residency tell what reading a byte
        from disk costs here (beyond reading it from the cache)."""
        res = self._load_resident.get(rid)
        if res is None:
            return
        path, now = runner.spec.path, (runner.load_duration, res)
        size = _file_size(path)
        before = self._file_loads.get(path)
        if before is not None and size:
            spb = disk_seconds_per_byte(before, now, size)
            if spb is not None:
                self.disk_spb = spb if self.disk_spb == DEFAULT_DISK_SECONDS_PER_BYTE else (
                    0.5 * self.disk_spb + 0.5 * spb
                )  # fmt: skip
                log.info("disk reads cost %.2f s/GB more than the page cache", spb * 1e9)
        self._file_loads[path] = now

    async def _predict_reloads(self, every: bool = True) -> None:
        """The cost-aware policy weighs what reloading each loaded model would cost now: less
        if its file is still in the page cache, more once the cache lost it (what /api/ps
        verbose and the dashboard show too). `every`: each ready runner's, else only those
        not predicted yet."""
        ready = [
            (rid, r.spec.path, r.load_duration)
            for rid, r in self.runners.items()
            if (b := self.core.runners.get(rid)) is not None
            and b.state == "ready" and rid in self._load_resident
            and (every or rid not in self.residency)
        ]  # fmt: skip
        if not ready:
            return
        fractions = await asyncio.to_thread(lambda: [resident(p) for _, p, _ in ready])
        for (rid, path, took), now_res in zip(ready, fractions, strict=True):
            if now_res is None:
                continue
            self.residency[rid] = now_res
            cost = reload_seconds(
                took, self._load_resident[rid], now_res, _file_size(path), self.disk_spb
            )
            self.core.reload_cost(rid, cost)

    def _prefetch_for(self, model: str) -> None:
        """A load waits for evicted runners to exit: start reading its file into the page
        cache meanwhile, within the memory the kernel reports available less a margin (so
        what it pushes out is the coldest cache, not pages in use)."""
        q = next((q for q in self.core.queue if q.model == model), None)
        if q is None or q.spec.path in self._prefetched:
            return
        self._prefetched.add(q.spec.path)
        try:
            spare = int(psutil.virtual_memory().available) - max(self.margin, 2**30)
        except Exception:  # no figure, no prefetch
            return
        if spare > 0:
            path = q.spec.path  # read until its load starts (which takes it off the set)
            self._spawn(asyncio.to_thread(prefetch, path, spare, lambda: path in self._prefetched))
            log.info("reading model '%s' ahead while room is made for it", model)

    def _oom_killed(self) -> bool:
        """Whether the kernel's OOM killer killed a process lately (since the reading before
        the last measure, 2-4 s ago): nothing of corral's sends SIGKILL to a serving runner.
        Where the count cannot be read, a SIGKILL is taken for the OOM killer's."""
        now, before = oom_kills(), self._oom_seen[0]
        return now is None or before is None or now > before

    def _ran_out_of_memory(self, model: str) -> None:
        k = min(OOM_RAISE_MAX, self.raised.get(model, 1.0) * OOM_RAISE)
        self.raised[model] = k
        self.journal.record("oom", model, factor=k)
        log.warning(
            "model '%s' ran out of memory: booking it %.0f%% above its estimate from now on",
            model, (k - 1) * 100,
        )  # fmt: skip

    async def _watch(self, rid: int, runner: Runner) -> None:
        """Wait for the runner's process to end, then free its books. Never dies silently: if
        watching fails, the runner is killed, and its books are freed once it is gone."""
        dog = asyncio.ensure_future(self._watchdog(rid, runner))
        try:
            try:
                await self._wait_exit(rid, runner)
            except Exception:
                log.exception("watching the runner for '%s' failed; killing it", runner.name)
                self.core.dying(rid, time.monotonic())
                self._apply()
                runner.kill_now()
                await runner.wait_gone()
                if runner.session is not None:
                    await runner.session.close()
        finally:
            dog.cancel()
            self.runners.pop(rid, None)
            self.measured.pop(rid, None)
            self.measured_devices.pop(rid, None)
            self._code.pop(rid, None)
            self._runner_tokens.pop(rid, None)
            self._load_resident.pop(rid, None)
            self.residency.pop(rid, None)
            self.core.exited(rid, time.monotonic())
            self._apply()

    async def _wait_exit(self, rid: int, runner: Runner) -> None:
        assert runner.proc is not None
        await runner.proc.wait()
        self.core.dying(rid, time.monotonic())  # grant nothing while its last words are read
        self._apply()
        code = await runner.wait_exit()
        if runner.stalled is not None or runner.stopping or runner.shutting_down:
            log.info("runner for '%s' exited (code %s)", runner.name, code)
        else:
            log.error("%s", runner.failure_message())
            self.journal.record("crash", runner.name, runner=rid, message=runner.failure_message())
            if code == -signal.SIGKILL and self._oom_killed():
                self._ran_out_of_memory(runner.name)
            elif code == -signal.SIGKILL:
                log.warning(
                    "runner for '%s' was killed by someone, not for memory: the kernel's OOM "
                    "kill count did not change", runner.name,
                )  # fmt: skip
        if runner.session is not None:
            await runner.session.close()
        before = self._free_before.pop(rid, None)
        book = self.core.runners.get(rid)
        if before and book is not None and self.refresh is not None:
            # Keep the bytes booked until the driver reports them free again, so the next
            # placement does not trust a free figure that still counts the dead runner.
            ok = await wait_for_recovery(
                self.refresh, self.devices, before, book.devices, self.recovery_timeout
            )
            if not ok:
                log.warning(
                    "GPU memory of '%s' did not show as free within %.0fs",
                    runner.name,
                    self.recovery_timeout,
                )

    async def _watchdog(self, rid: int, runner: Runner) -> None:
        """Kill a runner that stops answering while it has requests in flight (frozen, swapped
        out, wedged): its clients get an error naming the stall instead of waiting forever.
        It probes /health, not output progress, so a long prompt being processed is fine."""
        timeout = self.stall_timeout
        if not math.isfinite(timeout) or timeout <= 0:
            return
        interval = min(5.0, timeout / 4)
        failing_since: float | None = None  # when the first unanswered probe went out
        try:
            while not (runner.stopping or runner.shutting_down):
                await asyncio.sleep(interval)
                book = self.core.runners.get(rid)
                if book is None or book.state != "ready":
                    return  # on its way out: Runner.stop has a deadline of its own
                if book.inflight == 0:
                    failing_since = None
                    continue
                sent = time.monotonic()
                since = sent if failing_since is None else failing_since
                if await runner.responds(max(timeout - (sent - since), 0.1)):
                    failing_since = None
                elif time.monotonic() - since >= timeout:
                    await self._stalled(rid, runner)
                    return
                else:
                    failing_since = since  # refused at once (no HTTP server?): try again
        except Exception:
            log.exception("the watchdog of the runner for '%s' failed; killing it", runner.name)
            self.core.dying(rid, time.monotonic())
            self._apply()
            runner.kill_now()

    async def _stalled(self, rid: int, runner: Runner) -> None:
        runner.stalled = self.stall_timeout
        self.journal.record("stall", runner.name, runner=rid, seconds=self.stall_timeout)
        log.error(
            "runner for model '%s' (pid %s) did not answer for %gs with requests in flight; "
            "killing it",
            runner.name,
            runner.pid,
            self.stall_timeout,
        )
        self.core.dying(rid, time.monotonic())  # no new grants; memory booked until it is gone
        self._apply()
        runner.kill_now()
        assert runner.proc is not None
        try:
            await asyncio.wait_for(asyncio.shield(runner.proc.wait()), 1.0)
        except asyncio.TimeoutError:
            # Still there (a process in uninterruptible sleep dies only when it leaves it):
            # break the in-flight streams now rather than when it finally goes.
            runner.break_connections()

    def _note_free_before(self, rid: int) -> None:
        book = self.core.runners.get(rid)
        gpus = {d.id for d in self.devices if d.library != "cpu" and d.free_reliable}
        if (
            self.refresh is None
            or book is None
            or not gpus & {d for d, n in book.devices.items() if n}
        ):
            return
        self._free_before[rid] = {d.id: d.free for d in self.refresh(self.devices)}

    def _arm_timer(self) -> None:
        wake = self.core.next_wake()
        if self._timer is not None:
            if self._timer_at == wake:
                return
            self._timer.cancel()
            self._timer = None
        if math.isfinite(wake) and not self._closing:
            # A delay, not loop.call_at: uvloop's clock need not be time.monotonic().
            delay = max(0.0, wake - time.monotonic())
            self._timer = asyncio.get_running_loop().call_later(delay, self._on_timer)
            self._timer_at = wake

    def _on_timer(self) -> None:
        self._timer = None
        self.core.tick(time.monotonic())
        self._apply()

    def begin_shutdown(self) -> None:
        """The server is exiting (called as soon as the signal arrives): waiting requests get
        503, loading runners are killed at once (they never served), serving runners are
        stopped, and their streams end with "server is shutting down"."""
        if self._closing:
            return
        self._closing = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._measurer is not None:
            self._measurer.cancel()
        for fut in self._waiters.values():
            if not fut.done():  # one exception each: a shared one would gather tracebacks
                fut.set_exception(
                    SchedulerError(503, "server is shutting down", SHUTDOWN_RETRY_AFTER)
                )
        self._waiters.clear()
        for rid, runner in list(self.runners.items()):
            runner.shutting_down = True
            book = self.core.runners.get(rid)
            if book is None or book.state == "loading":
                runner.kill_now()
            else:
                self._spawn(runner.stop(grace=SHUTDOWN_GRACE))

    async def shutdown(self) -> None:
        """Stop every runner; used on server exit."""
        self.begin_shutdown()
        runners = list(self.runners.values())
        await asyncio.gather(
            *(r.stop(grace=SHUTDOWN_GRACE) for r in runners), return_exceptions=True
        )
        for t in list(self._tasks):
            t.cancel()
        with contextlib.suppress(Exception):
            await asyncio.gather(*self._tasks, return_exceptions=True)

    def kill_all(self) -> None:
        for r in self.runners.values():
            r.kill_now()


async def wait_for_recovery(
    refresh: Callable[[list[Device]], list[Device]],
    devices: list[Device],
    before: Mapping[str, int],
    booked: Mapping[str, int],
    timeout: float,
    interval: float = 0.1,
) -> bool:
    """Wait until every GPU a stopped runner used reports most of its bytes free again
    (drivers release memory a little after the process exits). False on timeout."""
    want = {
        d: before[d] + int(0.8 * n) for d, n in booked.items() if n and d in before and d != "cpu"
    }
    deadline = time.monotonic() + timeout
    while True:
        free = {d.id: d.free for d in refresh(devices)}
        if all(free.get(d, 0) >= w for d, w in want.items()):
            return True
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(interval)


def _file_size(path: str) -> int:
    """The model's bytes on disk (all the parts of a split model)."""
    try:
        return sum(os.stat(p).st_size for p in split_parts(path))
    except OSError:
        return 0
