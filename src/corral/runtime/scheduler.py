"""The scheduler's shell: carries out the core's decisions with real runner processes.

Every state change goes through corral.core.books.Core, called synchronously on the event loop
(no await between reading and changing the books), so there are no locks and no lock-order
deadlocks. Slow work (spawning, loading, stopping runners) runs in tasks that report back
with another synchronous event.

Its whole face: `submit`, `wait` (and `acquire`, both at once) and `unload` change the books;
`view()` (a plain snapshot, runtime/view.py) and `listen` (the journal's events) read them;
`begin_drain` (SIGTERM's grace), `begin_shutdown`, `shutdown` and `kill_all` end it. What it
works with (how a runner is made, the clock, the hooks the rest of corral plugs in) is given at
construction; what it measures lives in runtime/measure.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import signal
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from corral.config import Settings
from corral.core.books import Core
from corral.core.devices import CPU, GPU_HOST_BYTES, Device
from corral.core.drafting import DRAFTER
from corral.core.estimate import RUNNER_CODE_BYTES
from corral.core.policy import DEFAULT_POLICY, POLICIES
from corral.core.requests import (
    Fail,
    Grant,
    Load,
    Placer,
    QueueFull,
    Request,
    Sizing,
    Stop,
)
from corral.core.spec import Layout, RunnerSpec
from corral.runtime.hop import Hop, Lease, Ticket
from corral.runtime.journal import Journal, Listener
from corral.runtime.measure import Measure, Record, Refresh, wait_for_recovery
from corral.runtime.meter import Meter
from corral.runtime.pagecache import resident
from corral.runtime.runner import Runner, RunnerError
from corral.runtime.store import STORE_DIR
from corral.runtime.view import SchedulerView, snapshot

log = logging.getLogger(__name__)

SHUTDOWN_GRACE = 0.5  # seconds a serving runner gets to exit on SIGTERM when the server stops
OOM_RETRY_AFTER = 30.0  # a model that ran out of memory twice: room may come as others leave
SHUTDOWN_RETRY_AFTER = 5.0  # a restarting server is usually back within seconds
BEFORE_STOP_TIMEOUT = 10.0  # seconds `Hooks.before_stop` may hold a runner's stop


class SchedulerError(Exception):
    def __init__(self, status: int, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.retry_after = retry_after  # seconds; set on 503s a retry can cure


class RunnerFactory(Protocol):
    """How a runner process is made (`Runner`, with the server's engine and slot directory)."""

    def __call__(self, name: str, spec: RunnerSpec, *, layout: Layout | None) -> Runner: ...


@dataclass(frozen=True)
class Hooks:
    """What the rest of corral plugs into the scheduler, at its construction."""

    # Called with an idle runner about to be stopped and whether a load waits for its memory
    # (the KV cache saves its slots); within BEFORE_STOP_TIMEOUT.
    before_stop: Callable[[Hop, bool], Awaitable[None]] | None = None
    on_wait: Callable[[str, float], None] | None = None  # (model, seconds waited) per grant


@dataclass(frozen=True)
class SchedulerConfig:
    """How the scheduler decides and how long it waits: the server's settings (`of`), or a
    test's. `measure_interval`: seconds between measures of the runners and devices;
    `prefetch`: read a waiting load's file ahead while its victims exit; `tool_hold`: seconds a
    runner whose answer ended in a tool call is held for the agent's turn."""

    max_loaded: int = 0  # 0: memory decides
    max_queue: int = 512
    default_keep_alive: float = 300.0
    load_timeout: float = 300.0
    queue_timeout: float = math.inf
    policy: str = DEFAULT_POLICY
    tool_hold: float = 0.0
    recovery_timeout: float = 5.0
    stall_timeout: float = math.inf  # inf: no watchdog
    measure_interval: float = 2.0
    margin: int = 0
    prefetch: bool = True
    # What corral learned (runtime/measure) is kept here across restarts
    state_dir: Path | None = None

    @classmethod
    def of(cls, settings: Settings) -> SchedulerConfig:
        return cls(
            max_loaded=settings.max_loaded_models, max_queue=settings.max_queue,
            default_keep_alive=settings.keep_alive, load_timeout=settings.load_timeout,
            queue_timeout=settings.queue_timeout, policy=settings.eviction_policy,
            tool_hold=settings.tool_hold, stall_timeout=settings.runner_stall_timeout,
            margin=settings.memory_margin,
            state_dir=settings.models_dir / STORE_DIR,
        )  # fmt: skip


class Scheduler:
    def __init__(
        self,
        budgets: dict[str, int],
        config: SchedulerConfig = SchedulerConfig(),
        *,
        devices: list[Device] | None = None,
        refresh: Refresh | None = None,
        runners: RunnerFactory = Runner,
        hooks: Hooks | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`runners` makes a runner process; `clock` is the time of the books and of every
        deadline the shell keeps (a runner stamps its start with time.monotonic, the default);
        `refresh` re-reads the devices (runtime/devices)."""
        c = config
        self._core = Core(
            budgets=budgets, max_loaded=c.max_loaded, max_queue=c.max_queue,
            default_keep_alive=c.default_keep_alive, policy=POLICIES[c.policy],
            # The runners' shared code, resident once for all of them (raised if measured more)
            reserved={CPU: RUNNER_CODE_BYTES} if CPU in budgets else {},
        )  # fmt: skip
        self._tool_hold, self._load_timeout, self._queue_timeout = (
            c.tool_hold, c.load_timeout, c.queue_timeout)  # fmt: skip
        self._devices = devices or []
        self._refresh = refresh
        self._recovery_timeout = c.recovery_timeout
        self._stall_timeout = c.stall_timeout
        self._new_runner = runners
        self._hooks = hooks or Hooks()
        self._clock = clock
        self._journal = Journal()  # every decision, for metrics and the dashboard
        self._runners: dict[int, Record] = {}  # runner id -> its process and measures
        self._measure = Measure(
            self._core, self._runners, self._journal, devices=self._devices, refresh=refresh,
            margin=c.margin, interval=c.measure_interval, read_ahead=c.prefetch, clock=clock,
            apply=self._apply, spawn=self._spawn, state_dir=c.state_dir,
        )  # fmt: skip
        self._meter = Meter(clock)  # generated tokens as they are relayed
        self._waiters: dict[int, asyncio.Future[Hop]] = {}
        self._ids = itertools.count(1)
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf
        self._tasks: set[asyncio.Task[Any]] = set()
        self._draining = False  # no new work: granted requests finish, nothing else starts
        self._closing = False
        # Models whose last load ran out of memory and whose requests were placed again
        self._oom_retried: set[str] = set()

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
        smaller: Sequence[Sizing] = (),
    ) -> Ticket:
        """Ask for a runner slot for `model` (`size`: its runner's bytes in all, `process` of
        them the runner process's own; `smaller`: runners with fewer slots that serve it too,
        loaded where `spec`'s does not fit). Synchronous: when the model's runner has a free
        slot the ticket is granted on return. SchedulerError if refused."""
        if self._closing or self._draining:
            raise SchedulerError(503, "server is shutting down", SHUTDOWN_RETRY_AFTER)
        now = self._clock()
        if self._core.current(model) is None:  # a load: placed on what the devices have now
            self._measure.start()  # (from the first load on: there is nothing to measure before)
            self._measure.fresh(now)
        rid = next(self._ids)
        fut: asyncio.Future[Hop] = asyncio.get_running_loop().create_future()
        self._waiters[rid] = fut
        req = Request(
            id=rid, model=model, spec=spec, explicit=explicit, size=size, keep_alive=keep_alive,
            arrived=now, deadline=now + self._queue_timeout, pinned=pinned, priority=priority,
            place=place, process=process,
        ).offering(smaller)  # fmt: skip
        req = req.scaled(self._measure.raised.get(model, 1.0))  # more room after running out
        try:
            self._core.request(req, now)
        except QueueFull as e:
            del self._waiters[rid]
            self._journal.record("refused", model, message=str(e))
            raise SchedulerError(503, str(e), e.retry_after) from None
        self._apply()
        return Ticket(rid, now, fut)

    async def wait(self, ticket: Ticket) -> Lease:
        """The lease for a submitted ticket; SchedulerError if its load failed or it timed out.
        Cancelling the wait (the client went away) leaves nothing behind in the books."""
        try:
            hop = await ticket.fut
        except asyncio.CancelledError:
            self._waiters.pop(ticket.id, None)
            self._core.cancel(ticket.id, self._clock())
            self._apply()
            raise
        runner = hop.runner
        waited = self._clock() - ticket.arrived
        if self._hooks.on_wait is not None:
            self._hooks.on_wait(runner.name, waited)
        tally = self._meter.tally(runner, runner.name)
        loaded = runner.started_at >= ticket.arrived
        return Lease(self, ticket.id, runner, waited, loaded, tally, hop)

    async def acquire(self, model: str, spec: RunnerSpec, **kw: Any) -> Lease:
        return await self.wait(self.submit(model, spec, **kw))

    def _runner_failed(self, runner: Runner) -> None:
        rid = next((i for i, rec in self._runners.items() if rec.runner is runner), None)
        if rid is None or self._runners[rid].oom_noted:
            return
        self._runners[rid].oom_noted = self._ran_out_of_memory(runner)
        self._core.dying(rid, self._clock())
        self._apply()

    def _release(self, request_id: int, tool_call: bool = False) -> None:
        hold = self._tool_hold if tool_call else 0.0
        self._core.release(request_id, self._clock(), hold)
        self._apply()

    def unload(self, model: str) -> bool:
        found = self._core.unload(model, self._clock())
        self._apply()
        return found

    def view(self) -> SchedulerView:
        """The books, the runners and what was measured of them, as a plain snapshot."""
        return snapshot(
            self._core, self._runners, self._measure, self._meter.read(),
            tuple(self._journal.recent), closing=self._closing or self._draining,
            now=self._clock(),
        )  # fmt: skip

    def gpu_contexts(self) -> Mapping[str, int]:
        """What a runner holds on a GPU beyond llama.cpp's buffers, by card (gpu_context)."""
        return self._measure.learned_context

    def drafter(self, model: str) -> str:  # auto's drafting now (a Choice's fields: no call)
        c = self._measure.drafting.get(model)
        return "off" if c is not None and not c.on and c.retry_at > self._clock() else DRAFTER

    def no_drafts(self, model: str, why: str) -> None:  # ... turned off: Measure.no_drafts
        self._measure.no_drafts(model, why)

    def listen(self, fn: Listener) -> Callable[[], None]:
        """Call fn with every journal event from now on; returns the function that stops it."""
        return self._journal.listen(fn)

    # ---- carrying out decisions --------------------------------------------------------------
    def _apply(self) -> None:
        for a in self._core.drain():
            if isinstance(a, Grant):
                fut = self._waiters.pop(a.request, None)
                if fut is None or fut.done():  # cancelled between decision and delivery
                    self._core.release(a.request, self._clock())
                    continue
                rec = self._runners[a.runner]
                if rec.hop is None:  # its first grant
                    rec.hop = Hop.of(rec.runner, self._clock)
                fut.set_result(rec.hop)
            elif isinstance(a, Fail):
                fut = self._waiters.pop(a.request, None)
                if fut is not None and not fut.done():
                    fut.set_exception(SchedulerError(a.status, a.message, a.retry_after))
            elif isinstance(a, Load):
                layout = a.fit.layout if isinstance(a.fit.layout, Layout) else None
                runner = self._new_runner(a.model, a.spec, layout=layout)
                runner.short_spin = runner.layout.n_gpu_layers == 0 and self._computing_on_cpu()
                rec = self._runners[a.runner] = Record(runner)
                log.info(
                    "loading model '%s' (runner %d): booked %s", a.model, a.runner,
                    ", ".join(f"{n / 2**20:.1f} MiB on {d}" for d, n in a.fit.devices.items() if n),
                )  # fmt: skip
                self._journal.record("load", a.model, runner=a.runner, devices=dict(a.fit.devices))
                self._spawn(self._load(a.runner, rec))
            elif isinstance(a, Stop):
                rec = self._runners[a.runner]
                self._note_free_before(rec, a.runner)
                if a.room_for is not None:
                    self._measure.prefetch_for(a.room_for)
                self._journal.record(
                    "unload", rec.runner.name, runner=a.runner, reason=a.kind,
                    message=a.reason, room_for=a.room_for,
                )  # fmt: skip
                log.info(
                    "unloading model '%s' (runner %d): %s", rec.runner.name, a.runner, a.reason
                )
                self._spawn(self._stop_runner(a, rec))
        self._arm_timer()

    def _computing_on_cpu(self) -> bool:
        """Whether a runner that stays (loading or ready, not on its way out) computes on the
        CPU: then a CPU runner started now gets the short spin (runner.GOMP_SPINCOUNT)."""
        return any(
            book.state != "unloading" and rid in self._runners
            and self._runners[rid].runner.layout.n_gpu_layers == 0
            for rid, book in self._core.runners.items()
        )  # fmt: skip

    async def _stop_runner(self, stop: Stop, rec: Record) -> None:
        runner = rec.runner
        if runner.load_duration > 0 and runner.stalled is None and not self._closing:
            # what it processed since the last measure (2 s) would be lost with it
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._measure.count_tokens(rec), 1.0)
        before_stop = self._hooks.before_stop
        if before_stop is not None and rec.hop is not None and not self._closing:
            waiting = stop.room_for is not None or stop.kind == "options_change"
            try:
                await asyncio.wait_for(before_stop(rec.hop, waiting), BEFORE_STOP_TIMEOUT)
            except asyncio.TimeoutError:
                log.warning(
                    "saving state of '%s' took over %.0fs; stopping it anyway",
                    runner.name, BEFORE_STOP_TIMEOUT,
                )  # fmt: skip
            except Exception:  # saving is an optimisation: never a reason not to stop
                log.exception("before stopping the runner for '%s'", runner.name)
        await runner.stop()

    def _spawn(self, coro: Any) -> None:
        t = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def _load(self, rid: int, rec: Record) -> None:
        runner = rec.runner
        if self._closing or self._draining:  # decided as the server stops: nobody will use it
            self._runners.pop(rid, None)
            self._core.load_failed(rid, "server is shutting down", self._clock())
            self._apply()
            return
        # How much of the file is cached as the load starts (read beside the spawn: the child
        # takes far longer to reach the file than mincore takes to answer).
        res = asyncio.ensure_future(asyncio.to_thread(resident, runner.spec.path))
        self._measure.load_starting(runner.spec.path)
        try:
            await runner.start(self._load_timeout)
            if (fraction := await res) is not None:
                rec.cached_at_load = fraction
        except RunnerError as e:
            if runner.shutting_down:
                log.info("loading '%s' stopped: the server is shutting down", runner.name)
            else:
                log.error("loading '%s' failed: %s", runner.name, e)
                self._journal.record("load_failed", runner.name, runner=rid, message=str(e))
            self._runners.pop(rid, None)
            if not runner.shutting_down and self._ran_out_of_memory(runner):
                # Placed again only once the driver has released what the dead runner held
                # (its bytes stay booked meanwhile), on free memory read after that.
                if runner.pid and not await self._measure.released(
                    runner.pid, self._recovery_timeout
                ):
                    log.warning("GPU memory of '%s' was not released within %.0fs",
                                runner.name, self._recovery_timeout)  # fmt: skip
                self._measure.fresh(self._clock(), max_age=0.0)
                self._load_ran_out(rid, runner, str(e))
            else:
                self._core.load_failed(rid, str(e), self._clock())
            self._apply()
            return
        except Exception as e:  # spawn failures (OSError, ...): same contract, clear message
            log.exception("loading '%s' failed", runner.name)
            self._runners.pop(rid, None)
            self._core.load_failed(
                rid, f"could not start a runner for '{runner.name}': {e}", self._clock()
            )
            self._apply()
            return
        # From here the process runs: whatever happens next, it is watched (and so its exit
        # frees the books).
        self._spawn(self._watch(rid, rec))
        try:
            self._loaded(rid, rec)
        except Exception:
            log.exception("booking the runner for '%s' failed; killing it", runner.name)
            self._core.dying(rid, self._clock())
            runner.kill_now()
        self._apply()

    def _ran_out_of_memory(self, runner: Runner) -> bool:
        """Whether the runner ended for want of memory: it said so (on a GPU, or a failed
        allocation), or the kernel's OOM killer took it. Its model is booked higher from now
        on, and the devices' free memory is read again for the next placement."""
        oom = runner.out_of_memory is not None or (
            runner.exit_code == -signal.SIGKILL and self._measure.oom_killed()
        )
        if oom:
            self._measure.ran_out_of_memory(runner.name)
            self._measure.fresh(self._clock(), max_age=0.0)
        return oom

    def _load_ran_out(self, rid: int, runner: Runner, message: str) -> None:
        """A load that ran out of memory: its requests are placed again with the higher
        booking (evicting idle models, fewer layers on GPUs, or system memory), once; a second
        time in a row they get a 503 with the numbers, never the same crash again."""
        now = self._clock()
        if runner.name not in self._oom_retried:
            self._oom_retried.add(runner.name)
            k = self._measure.raised.get(runner.name, 1.0)
            before = self._measure.raised_before.get(runner.name, 1.0)
            log.warning("loading '%s' ran out of memory: placing its requests again", runner.name)
            self._core.load_failed(rid, message, now, again=k / before)
            return
        self._oom_retried.discard(runner.name)
        book = self._core.runners.get(rid)
        wanted = ", ".join(f"{n / 2**20:.0f} MiB on {d}" for d, n in (
            book.devices.items() if book is not None else ()) if n)  # fmt: skip
        room = ", ".join(
            f"{d.free / 2**20:.0f} MiB free on {d.id}" for d in self._measure.last_devices
        )
        self._core.load_failed(
            rid, f"model '{runner.name}' ran out of memory twice in a row"
            + (f" (booked {wanted})" if wanted else "") + f"; {room}: {message}",
            now, status=503, retry_after=OOM_RETRY_AFTER,
        )  # fmt: skip

    def _loaded(self, rid: int, rec: Record) -> None:
        runner = rec.runner
        log.info(
            "model '%s' ready in %.2fs at %s (pid %s)",
            runner.name,
            runner.load_duration,
            runner.base_url,
            runner.pid,
        )
        self._oom_retried.discard(runner.name)
        alloc = runner.allocation
        book = self._core.runners.get(rid)
        shown = [d for d, n in book.devices.items() if d != CPU] if book is not None else None
        real = alloc.booked(self._core.budgets.keys(), shown) if alloc and alloc.total else None
        if real is not None and book is not None:
            log.info(
                "model '%s' allocated %.1f MiB (estimated %.1f MiB)",
                runner.name,
                sum(real.values()) / 2**20,
                book.size / 2**20,
            )
        if real is not None:  # llama.cpp's buffers, the process that holds them, its contexts
            rec.buffers = dict(real)
            on_gpu = [d for d, n in real.items() if d != CPU and n]
            real[CPU] = real.get(CPU, 0) + (book.process if book is not None else 0)
            real[CPU] += GPU_HOST_BYTES if on_gpu else 0
            for dev in on_gpu:
                real[dev] += self._measure.gpu_context(dev)
            k = self._measure.raised.get(runner.name, 1.0)
            real = {d: int(n * k) for d, n in real.items()}
        self._measure.learn_disk_speed(rec)
        now = self._clock()
        if book is not None and any(n for d, n in book.devices.items() if d != CPU):
            # The next load onto this card is placed on what it left free (seen on an H200:
            # one placed on the headroom read while this one loaded ran out of memory).
            self._measure.fresh(now, max_age=0.0)
        self._core.loaded(rid, now, real)  # the real allocation replaces the estimate
        if book is not None:
            self._journal.record(
                "ready", runner.name, runner=rid, seconds=round(runner.load_duration, 3),
                devices=dict(book.devices),
            )  # fmt: skip
        self._measure.ready(rid, rec, now)

    async def _watch(self, rid: int, rec: Record) -> None:
        """Wait for the runner's process to end, then free its books. Never dies silently: if
        watching fails, the runner is killed, and its books are freed once it is gone."""
        runner = rec.runner
        dog = asyncio.ensure_future(self._watchdog(rid, runner))
        try:
            try:
                await self._wait_exit(rid, rec)
            except Exception:
                log.exception("watching the runner for '%s' failed; killing it", runner.name)
                self._core.dying(rid, self._clock())
                self._apply()
                runner.kill_now()
                await runner.wait_gone()
                if runner.api is not None:
                    await runner.api.close()
        finally:
            dog.cancel()
            self._runners.pop(rid, None)
            self._measure.stale()
            self._core.exited(rid, self._clock())
            self._apply()

    async def _wait_exit(self, rid: int, rec: Record) -> None:
        runner = rec.runner
        assert runner.proc is not None
        await runner.proc.wait()
        self._core.dying(rid, self._clock())  # grant nothing while its last words are read
        self._apply()
        code = await runner.wait_exit()
        if runner.stalled is not None or runner.stopping or runner.shutting_down:
            log.info("runner for '%s' exited (code %s)", runner.name, code)
        else:
            log.error("%s", runner.failure_message())
            self._journal.record("crash", runner.name, runner=rid, message=runner.failure_message())
            if rec.oom_noted or self._ran_out_of_memory(runner):
                pass  # booked higher from now on
            elif code == -signal.SIGKILL:
                log.warning(
                    "runner for '%s' was killed by someone, not for memory: the kernel's OOM "
                    "kill count did not change", runner.name,
                )  # fmt: skip
        if runner.api is not None:
            await runner.api.close()
        before = rec.free_before
        book = self._core.runners.get(rid)
        if before and book is not None and self._refresh is not None:
            # Keep the bytes booked until the driver reports them free again, so the next
            # placement does not trust a free figure that still counts the dead runner.
            ok = await wait_for_recovery(
                self._refresh, self._devices, before, book.devices, self._recovery_timeout
            )
            if not ok:
                log.warning(
                    "GPU memory of '%s' did not show as free within %.0fs",
                    runner.name,
                    self._recovery_timeout,
                )

    async def _watchdog(self, rid: int, runner: Runner) -> None:
        """Kill a runner that stops answering while it has requests in flight (frozen, swapped
        out, wedged): its clients get an error naming the stall instead of waiting forever.
        It probes /health, not output progress, so a long prompt being processed is fine."""
        timeout = self._stall_timeout
        if not math.isfinite(timeout) or timeout <= 0:
            return
        interval = min(5.0, timeout / 4)
        failing_since: float | None = None  # when the first unanswered probe went out
        try:
            while not (runner.stopping or runner.shutting_down):
                await asyncio.sleep(interval)
                book = self._core.runners.get(rid)
                if book is None or book.state != "ready":
                    return  # on its way out: Runner.stop has a deadline of its own
                if book.inflight == 0:
                    failing_since = None
                    continue
                sent = self._clock()
                since = sent if failing_since is None else failing_since
                api = runner.api
                left = max(timeout - (sent - since), 0.1)
                # any answer (even 503) shows the process serves HTTP
                if api is not None and await api.health(left) is not None:
                    failing_since = None
                elif self._clock() - since >= timeout:
                    await self._stalled(rid, runner)
                    return
                else:
                    failing_since = since  # refused at once (no HTTP server?): try again
        except Exception:
            log.exception("the watchdog of the runner for '%s' failed; killing it", runner.name)
            self._core.dying(rid, self._clock())
            self._apply()
            runner.kill_now()

    async def _stalled(self, rid: int, runner: Runner) -> None:
        runner.stalled = self._stall_timeout
        self._journal.record("stall", runner.name, runner=rid, seconds=self._stall_timeout)
        log.error(
            "runner for model '%s' (pid %s) did not answer for %gs with requests in flight; "
            "killing it",
            runner.name,
            runner.pid,
            self._stall_timeout,
        )
        self._core.dying(rid, self._clock())  # no new grants; memory booked until it is gone
        self._apply()
        runner.kill_now()
        assert runner.proc is not None
        try:
            await asyncio.wait_for(asyncio.shield(runner.proc.wait()), 1.0)
        except asyncio.TimeoutError:
            # Still there (a process in uninterruptible sleep dies only when it leaves it):
            # break the in-flight streams now rather than when it finally goes.
            if runner.api is not None:
                runner.api.break_connections()

    def _note_free_before(self, rec: Record, rid: int) -> None:
        book = self._core.runners.get(rid)
        gpus = {d.id for d in self._devices if d.library != "cpu" and d.free_reliable}
        if (
            self._refresh is None
            or book is None
            or not gpus & {d for d, n in book.devices.items() if n}
        ):
            return
        rec.free_before = {d.id: d.free for d in self._refresh(self._devices)}

    def _arm_timer(self) -> None:
        wake = self._core.next_wake()
        if self._timer is not None:
            if self._timer_at == wake:
                return
            self._timer.cancel()
            self._timer = None
        if math.isfinite(wake) and not self._closing:
            # A delay, not loop.call_at: the loop's clock (uvloop's) need not be this one.
            delay = max(0.0, wake - self._clock())
            self._timer = asyncio.get_running_loop().call_later(delay, self._on_timer)
            self._timer_at = wake

    def _on_timer(self) -> None:
        self._timer = None
        self._core.tick(self._clock())
        self._apply()

    def begin_drain(self) -> None:
        """The server stops taking work (SIGTERM, before its grace): requests still waiting for
        a slot get 503 with Retry-After at once, loads under way are abandoned (their runners
        killed; the books free their memory once they are gone), and new requests are refused.
        Requests already granted keep their runners until they end or `begin_shutdown`."""
        if self._draining or self._closing:
            return
        self._draining = True
        now = self._clock()
        waiters, self._waiters = self._waiters, {}
        for rid, fut in waiters.items():
            self._core.cancel(rid, now)  # out of the queue: no load starts for it
            if not fut.done():  # one exception each: a shared one would gather tracebacks
                fut.set_exception(
                    SchedulerError(503, "server is shutting down", SHUTDOWN_RETRY_AFTER)
                )
        self._apply()  # a load the cancels started is dropped by `_load`
        for rid, rec in list(self._runners.items()):
            book = self._core.runners.get(rid)
            if book is not None and book.state == "loading":
                log.info(
                    "abandoning the load of '%s': the server is shutting down", rec.runner.name
                )
                rec.runner.shutting_down = True
                rec.runner.kill_now()  # `_load` sees it fail, and frees its books

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
        self._measure.stop()
        for fut in self._waiters.values():
            if not fut.done():  # one exception each: a shared one would gather tracebacks
                fut.set_exception(
                    SchedulerError(503, "server is shutting down", SHUTDOWN_RETRY_AFTER)
                )
        self._waiters.clear()
        for rid, rec in list(self._runners.items()):
            runner = rec.runner
            runner.shutting_down = True
            book = self._core.runners.get(rid)
            if book is None or book.state == "loading":
                runner.kill_now()
            else:
                self._spawn(runner.stop(grace=SHUTDOWN_GRACE))

    async def shutdown(self) -> None:
        """Stop every runner; used on server exit."""
        self.begin_shutdown()
        runners = [rec.runner for rec in self._runners.values()]
        await asyncio.gather(
            *(r.stop(grace=SHUTDOWN_GRACE) for r in runners), return_exceptions=True
        )
        for t in list(self._tasks):
            t.cancel()
        with contextlib.suppress(Exception):
            await asyncio.gather(*self._tasks, return_exceptions=True)

    def kill_all(self) -> None:
        for rec in self._runners.values():
            rec.runner.kill_now()

