"""What corral's runners and the devices really hold, measured into the scheduler's books.

At a runner's readiness and then every `interval` seconds: each runner's own memory (resident
less its code) and GPU memory go to `Core.observed`, what other programs leave free on each
device to `Core.set_headroom`, the runners' token counters to per-model totals; every few
measures, each loaded model's share in the page cache, from which the cost-aware policy's
reload cost is predicted. A model whose runner ran out of memory is booked higher from then on
(`raised`). The shell (runtime/scheduler.py) owns the runner records and calls in here; what is
measured is read through its `view()`.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import math
import os
import time
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import psutil

from corral.core.books import Core
from corral.core.devices import CPU, GPU_CONTEXT_BYTES, Device, gpu_context, live_headroom
from corral.core.drafting import (
    KEPT_FILE,
    Choice,
    Counters,
    Where,
    kept,
    quiet,
    restored,
    undrafted,
    verdict,
)
from corral.core.gguf import split_parts
from corral.core.policy import DEFAULT_DISK_SECONDS_PER_BYTE, disk_seconds_per_byte, reload_seconds
from corral.runtime.devices import gpu_process_memory
from corral.runtime.hop import Hop
from corral.runtime.journal import Journal
from corral.runtime.memwatch import Usage, code_rss, oom_kills, process_usage
from corral.runtime.pagecache import prefetch, resident
from corral.runtime.runner import Runner

log = logging.getLogger(__name__)

LEARNED_FILE = "gpu-contexts.json"  # card name -> what a runner holds there beyond its buffers

OOM_RAISE = 1.25  # a model that ran out of memory is booked this much higher next time ...
OOM_RAISE_MAX = 4.0  # ... up to this factor in all
# A runner measured above its booking is said so (a WARNING) from this much over: less is
# the measures' noise, and the booking grows to the measure anyway.
OVER_NOTED = 16 * 2**20
CONTEXT_SLACK = 16 * 2**20  # booked above the largest GPU context measured: it varies a little
RESIDENCY_EVERY = 5  # measures between two reads of every loaded model's page-cache residency

Refresh = Callable[[list[Device]], list[Device]]


@dataclass
class Record:
    """One runner as the shell knows it: its process and what was measured of it."""

    runner: Runner
    own: int | None = None  # its own memory at the last measure (resident less its code)
    devices: dict[str, int] = field(default_factory=dict)  # ... per device (GPU: NVML's figure)
    code: int | None = None  # its resident code (memwatch.code_rss, measured once)
    tokens: Counters = field(default_factory=Counters)  # its counters at the last read
    # ... where its drafting's window began (auto's drafting: a verdict every MIN_DRAFTED)
    window: Counters = field(default_factory=Counters)
    quiet: Counters = field(default_factory=Counters)  # ... its reads with one stream at a time
    cached_at_load: float | None = None  # share of its file in the page cache as its load began
    cached: float | None = None  # ... and at the last look
    free_before: dict[str, int] | None = None  # GPUs' free bytes as it was told to stop
    buffers: dict[str, int] | None = None  # llama.cpp's own buffers per device, at its load
    over: dict[str, int] = field(default_factory=dict)  # device -> excess to warn again from
    oom_noted: bool = False  # a request found it dead of running out of memory (noted then)
    hop: Hop | None = None  # from its first grant: what its requests are sent through


class Measure:
    def __init__(
        self,
        core: Core,
        records: Mapping[int, Record],
        journal: Journal,
        *,
        devices: list[Device],
        refresh: Refresh | None,
        margin: int,
        interval: float,
        read_ahead: bool,
        clock: Callable[[], float],
        apply: Callable[[], None],
        spawn: Callable[[Coroutine[Any, Any, Any]], None],
        state_dir: Path | None = None,
    ) -> None:
        self._core = core
        self._records = records
        self._journal = journal
        self._devices = devices
        self._refresh = refresh
        self.margin = margin  # bytes to keep free per device (headroom is checked against it)
        self.interval = interval  # seconds between measures; inf: none but at readiness
        self._read_ahead = read_ahead  # a waiting load's file, while its victims exit
        self._clock = clock
        self._apply = apply
        self._spawn = spawn
        self._task: asyncio.Task[None] | None = None
        self._count = 0
        # The last runner's code measured: for a runner whose own is not yet in.
        self.code_last = 0
        self.last_devices: list[Device] = list(devices)  # as last measured
        # Tokens each model's runners processed (prompt, generated, drafted, accepted drafts),
        # summed over the runners' own counters (llama.cpp's /metrics), read every measure.
        self.tokens: dict[str, list[int]] = {}
        # What corral learned here, kept across restarts in `state_dir` (when given).
        self._learned_path = state_dir / LEARNED_FILE if state_dir else None
        self._drafting_path = state_dir / KEPT_FILE if state_dir else None
        # Model -> what `speculative = "auto"` chose for its drafting, from its runners' windows
        # (core/drafting); a model missing has not been judged (it drafts).
        self.drafting: dict[str, Choice] = restored(
            read_kept(self._drafting_path), clock(), time.time()
        )
        # Model -> its generation without drafts, by load and context (core/drafting.undrafted):
        # what a verdict compares drafting's measured speed with, where it has enough of it.
        self.undrafted: dict[str, dict[Where, Counters]] = {}
        self.raised: dict[str, float] = {}  # model -> booking factor after running out of memory
        self.raised_before: dict[str, float] = {}  # ... and before it last ran out
        # Card name -> the most a runner was measured to hold on such a GPU beyond llama.cpp's
        # buffers (NVML's figure less its buffers): booked with every later runner there.
        # Kept (`state_dir`), so that the first load after a restart books it too.
        self.learned_context: dict[str, int] = read_learned(self._learned_path)
        self._read_at = -math.inf  # when the devices were last read (headroom)
        # What a byte read from disk costs beyond one in the page cache (learned from two loads
        # of one file with different residency), and each file's last load (seconds, residency).
        self.disk_spb = DEFAULT_DISK_SECONDS_PER_BYTE
        self._file_loads: dict[str, tuple[float, float]] = {}
        self._prefetched: set[str] = set()  # files read ahead for a load waiting for room
        self._warned_headroom: set[int] = set()  # requests whose wait for room was logged
        # The kernel's OOM kill count at the last two measures (the older one is compared).
        self._oom_seen: collections.deque[int | None] = collections.deque([oom_kills()], maxlen=2)
        self._set_headroom(devices, [], {})  # as discovered; then at every measure

    def start(self) -> None:
        """Measure every `interval` seconds from now on (idempotent)."""
        if self._task is None and math.isfinite(self.interval):
            self._task = asyncio.ensure_future(self._forever())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _forever(self) -> None:
        """Every few seconds: what each runner really holds goes to the books (Core.observed:
        a booking below the measure grows to it, and idle runners make room if that is over
        the budget), and what other programs leave free becomes the headroom loads must fit
        under (Core.headroom)."""
        while True:
            try:
                await self._once()
            except Exception:  # a measure must never end the measuring
                log.exception("measuring the runners' memory failed")
            await asyncio.sleep(self.interval)

    async def _once(self) -> None:
        self._oom_seen.append(oom_kills())
        pids = {rid: rec.runner.pid for rid, rec in self._records.items() if rec.runner.pid}
        # Device refreshes and NVML calls take ~0.1-1 ms each: off the event loop.
        devices, usages, gpu = await asyncio.to_thread(self._read_machine, list(pids.values()))
        self.last_devices = devices
        now = self._read_at = self._clock()
        for rid, usage in zip(pids, usages, strict=True):
            if usage is not None:
                self._observe(rid, now, usage, gpu)
        self._set_headroom(devices, usages, gpu)
        self._apply()
        self._warn_short_of_headroom()
        await self._count_tokens()
        # mincore over each model file (~35 ms per GB): every few measures, and at once for a
        # runner that has no residency yet
        self._count += 1
        await self._predict_reloads(every=self._count % RESIDENCY_EVERY == 0)

    def _read_machine(
        self, pids: list[int]
    ) -> tuple[list[Device], list[Usage | None], dict[int, dict[str, int]]]:
        devices = self._refresh(self._devices) if self._refresh is not None else self._devices
        gpus = [d for d in devices if d.library != "cpu"]
        return devices, [process_usage(p) for p in pids], gpu_process_memory(gpus) if gpus else {}

    def fresh(self, now: float, max_age: float | None = None) -> None:
        """Read the devices again if the last read is older than `max_age` (default: the
        measuring interval, at most 2 s), so that a load is placed on what other programs hold
        now, not at the last measure (or at start-up). Synchronous: NVML and /proc answer in
        about a millisecond."""
        limit = min(self.interval, 2.0) if max_age is None else max_age
        if now - self._read_at < limit or self._refresh is None:
            return
        pids = [rec.runner.pid for rec in self._records.values() if rec.runner.pid]
        devices, usages, gpu = self._read_machine(pids)
        self.last_devices, self._read_at = devices, now
        self._set_headroom(devices, usages, gpu)

    async def released(self, pid: int, timeout: float, interval: float = 0.1) -> bool:
        """Wait until the driver no longer lists the ended process `pid` as holding GPU memory
        (it releases a process's memory a little after the process ends), at most `timeout`
        seconds; False if it still holds some then. True at once where the driver does not say
        what each process holds."""
        gpus = [d for d in self._devices if d.library != "cpu"]
        deadline = time.monotonic() + timeout
        while gpus:
            held = await asyncio.to_thread(gpu_process_memory, gpus)
            if not any(held.get(pid, {}).values()):
                return True
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(interval)
        return True

    def stale(self) -> None:
        """A runner exited: the next load reads the devices again first (Measure.fresh)."""
        self._read_at = -math.inf

    def gpu_context(self, device: str) -> int:
        """What a runner holds on this GPU beyond llama.cpp's buffers (devices.gpu_context)."""
        d = next((d for d in self._devices if d.id == device), None)
        return gpu_context(d, self.learned_context) if d is not None else GPU_CONTEXT_BYTES

    # ---- a runner's memory -------------------------------------------------------------------
    def ready(self, rid: int, rec: Record, now: float) -> None:
        """A runner just became ready: measured at once too, for the books must hold what it
        holds from the start, not from the next measure (/proc/PID/status: ~50 us). Its code
        is measured once, off the event loop (a walk of every page it maps), and it is
        measured again then."""
        pid = rec.runner.pid
        if pid is None or not math.isfinite(self.interval):
            return
        usage = process_usage(pid)
        if usage is not None:
            self._observe(rid, now, usage, {})
        self._spawn(self._measure_code(rid, pid))

    async def _measure_code(self, rid: int, pid: int) -> None:
        """A new runner's resident code, once: then its measure is its own memory, and the
        reservation for all runners' code is raised if one of them holds more (never lowered:
        the code is the same for every runner, in memory once)."""
        code = await asyncio.to_thread(code_rss, pid)
        rec = self._records.get(rid)
        if code is None or rec is None:
            return
        rec.code = self.code_last = code
        now = self._clock()
        reserved = self._core.reserved.get(CPU)
        if reserved is not None and code > reserved:
            log.warning(
                "the runners' shared code holds %.1f MiB, more than the %.1f MiB reserved for "
                "it: reserving that", code / 2**20, reserved / 2**20,
            )  # fmt: skip
            self._core.reserve(CPU, code, now)
        usage = process_usage(pid)
        if usage is not None:
            self._observe(rid, now, usage, {})
        self._apply()

    def _observe(
        self, rid: int, now: float, usage: Usage, gpu: Mapping[int, Mapping[str, int]]
    ) -> None:
        book = self._core.runners.get(rid)
        rec = self._records.get(rid)
        if book is None or rec is None or book.state != "ready":
            return
        # its own memory: the code is reserved for all runners (until a runner's code is
        # measured, the last one measured or, before any, what is reserved for it)
        code = rec.code or self.code_last or self._core.reserved.get(CPU, 0)
        own = max(0, usage.rss - code)
        seen = {CPU: own}
        for pid in usage.pids:
            for dev, n in gpu.get(pid, {}).items():
                seen[dev] = seen.get(dev, 0) + n
        rec.own, rec.devices = own, seen
        self._learn_context(rec, seen)
        for dev, n in seen.items():
            over = n - book.devices.get(dev, 0)
            # Said once per runner and device, and again only if it grew by as much again:
            # the booking grows to the measure, so the next measure would repeat it.
            if over > max(OVER_NOTED, rec.over.get(dev, 0)):
                rec.over[dev] = 2 * over
                log.warning(
                    "model '%s' holds %.1f MiB on %s, %.1f MiB more than booked: booking that",
                    book.model, n / 2**20, dev, over / 2**20,
                )  # fmt: skip
        self._core.observed(rid, now, seen)

    def _learn_context(self, rec: Record, seen: Mapping[str, int]) -> None:
        """NVML's figure for a runner on a GPU less llama.cpp's buffers there is what a
        runner holds beyond them on that card (its CUDA context, cuBLAS, pools): the most
        measured is booked for every later runner on a card of that name."""
        if not rec.buffers:
            return
        for d in self._devices:
            n, buffers = seen.get(d.id), rec.buffers.get(d.id)
            if d.library == "cpu" or not n or not buffers or n <= buffers:
                continue
            extra = n - buffers + CONTEXT_SLACK
            if extra > self.learned_context.get(d.name, 0):
                before = gpu_context(d, self.learned_context)
                self.learned_context[d.name] = extra
                write_kept(self._learned_path, self.learned_context, "the learned GPU allowances")
                log.info(
                    "a runner holds %.0f MiB on %s (%s) beyond llama.cpp's buffers: booking "
                    "that with each runner there (was %.0f MiB)",
                    (extra - CONTEXT_SLACK) / 2**20, d.id, d.name, before / 2**20,
                )  # fmt: skip

    # ---- the devices -------------------------------------------------------------------------
    def _set_headroom(
        self,
        devices: list[Device],
        usages: list[Usage | None],
        gpu: Mapping[int, Mapping[str, int]],
    ) -> None:
        """What other programs leave for corral's runners on each device, right now."""
        core = self._core
        booked = core.used()
        ours = {p for u in usages if u is not None for p in u.pids}
        in_use: dict[str, int] = {CPU: sum(u.anon for u in usages if u is not None)}
        for pid, by_dev in gpu.items():
            if pid in ours:
                for dev, n in by_dev.items():
                    in_use[dev] = in_use.get(dev, 0) + n
        headroom = {}
        for d in devices:
            if d.id in core.budgets:
                headroom[d.id] = live_headroom(
                    d, booked.get(d.id, 0), in_use_by_us=in_use.get(d.id), margin=self.margin
                )
        core.set_headroom(headroom, self._clock())

    def _warn_short_of_headroom(self) -> None:
        core = self._core
        for q in core.queue:
            if core.current(q.model) is not None or q.id in self._warned_headroom:
                continue
            if core.short_of_headroom(q):
                self._warned_headroom.add(q.id)
                room = ", ".join(f"{n / 2**20:.0f} MiB on {d}" for d, n in core.headroom.items())
                log.warning(
                    "loading model '%s' waits: other programs leave corral's runners only %s",
                    q.model, room,
                )  # fmt: skip
            break  # loads start first come, first served: only the first one waits for room
        if len(self._warned_headroom) > 4096:
            self._warned_headroom.clear()

    # ---- tokens ------------------------------------------------------------------------------
    async def _count_tokens(self) -> None:
        """Add what each ready runner processed since the last read to its model's count."""
        books = self._core.runners
        ready = [rec for rid, rec in self._records.items()
                 if rid in books and books[rid].state == "ready"]  # fmt: skip
        await asyncio.gather(*(self.count_tokens(rec) for rec in ready))

    async def count_tokens(self, rec: Record) -> None:
        api = rec.runner.api
        c = await api.token_counts() if api is not None else None
        if c is None:
            return
        if rec.hop is not None:  # the context its requests generated at (core/drafting.where)
            c = replace(c, context=rec.hop.context, contexted=rec.hop.contexted)
        before = rec.tokens
        total = self.tokens.setdefault(rec.runner.name, [0, 0, 0, 0])
        for i, (now, then) in enumerate(zip(
            (c.prompt, c.generated, c.drafted, c.accepted),
            (before.prompt, before.generated, before.drafted, before.accepted), strict=True,
        )):  # fmt: skip
            total[i] += max(0, now - then)
        read, spec = c - before, rec.runner.spec
        rec.tokens, rec.quiet = c, quiet(rec.quiet, read)
        if spec.speculative_auto:  # what auto's verdict compares drafting with
            model = rec.runner.name
            self.undrafted[model] = undrafted(
                self.undrafted.get(model, {}), read, spec.speculative != "off"
            )
            if spec.speculative != "off":
                self._judge_drafting(rec, c)

    # ---- auto's drafting ---------------------------------------------------------------------
    def no_drafts(self, model: str, why: str) -> None:
        """Turn auto's drafting off for `model` (for a while: Choice.off)."""
        before = self.drafting.get(model, Choice())
        after = self.drafting[model] = before.off(why, self._clock())
        if after is not before:
            log.info("model '%s' drafts no more for %.0f s: %s", model, after.retry_at -
                     self._clock(), why)  # fmt: skip
            self._keep_drafting()

    def _judge_drafting(self, rec: Record, c: Counters) -> None:
        model, now = rec.runner.name, self._clock()
        choice = was = self.drafting.get(model, Choice())
        if not choice.on and now >= choice.retry_at:  # this runner drafts again after a turn off
            choice = self.drafting[model] = choice.trying()
        v = verdict(c - rec.window, rec.quiet.batch_s or c.batch_s, self.undrafted.get(model))
        if v is not None:
            rec.window = c
            after = self.drafting[model] = choice.judged(v, now)
            if after.on != choice.on:  # said once: a runner still drafting is judged again
                log.info("model '%s': drafting %s (%s)", model, "on" if after.on else "off",
                         after.why)  # fmt: skip
            if after is not was and not (after.on and was.on):  # what `kept` holds changed
                self._keep_drafting()
            choice = after
        if not choice.on:
            # Restarted without drafting once idle, with nothing waiting (what it holds of
            # conversations is saved, and restored into the next runner: runtime/kvcache).
            for b in self._core.runners.values():
                if b.model == model and b.spec.speculative_auto and b.spec.speculative != "off":
                    self._core.restart(b.id, f"drafting off: {choice.why}", now)
            self._apply()

    def _keep_drafting(self) -> None:
        """Keep what is off across a restart (core/drafting.kept)."""
        write_kept(self._drafting_path, kept(self.drafting, self._clock(), time.time()),
                   "auto's drafting choices")  # fmt: skip

    # ---- the page cache ----------------------------------------------------------------------
    def load_starting(self, path: str) -> None:
        """A load of `path` starts: a read ahead for it stops (it reads the file itself)."""
        self._prefetched.discard(path)

    def learn_disk_speed(self, rec: Record) -> None:
        """Two loads of one file with different page-cache residency tell what reading a byte
        from disk costs here (beyond reading it from the cache)."""
        if rec.cached_at_load is None:
            return
        runner = rec.runner
        path, now = runner.spec.path, (runner.load_duration, rec.cached_at_load)
        size = file_size(path)
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
            (rid, rec)
            for rid, rec in self._records.items()
            if (b := self._core.runners.get(rid)) is not None
            and b.state == "ready" and rec.cached_at_load is not None
            and (every or rec.cached is None)
        ]  # fmt: skip
        if not ready:
            return
        paths = [rec.runner.spec.path for _, rec in ready]
        fractions = await asyncio.to_thread(lambda: [resident(p) for p in paths])
        for (rid, rec), path, now_res in zip(ready, paths, fractions, strict=True):
            if now_res is None or rec.cached_at_load is None:
                continue
            rec.cached = now_res
            cost = reload_seconds(
                rec.runner.load_duration, rec.cached_at_load, now_res, file_size(path),
                self.disk_spb,
            )  # fmt: skip
            self._core.reload_cost(rid, cost)

    def prefetch_for(self, model: str) -> None:
        """A load waits for evicted runners to exit: start reading its file into the page
        cache meanwhile, within the memory the kernel reports available less a margin (so
        what it pushes out is the coldest cache, not pages in use)."""
        q = next((q for q in self._core.queue if q.model == model), None)
        if not self._read_ahead or q is None or q.spec.path in self._prefetched:
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

    # ---- running out of memory ---------------------------------------------------------------
    def oom_killed(self) -> bool:
        """Whether the kernel's OOM killer killed a process lately (since the reading before
        the last measure, 2-4 s ago): nothing of corral's sends SIGKILL to a serving runner.
        Where the count cannot be read, a SIGKILL is taken for the OOM killer's."""
        now, before = oom_kills(), self._oom_seen[0]
        return now is None or before is None or now > before

    def ran_out_of_memory(self, model: str) -> None:
        self.raised_before[model] = self.raised.get(model, 1.0)
        k = min(OOM_RAISE_MAX, self.raised.get(model, 1.0) * OOM_RAISE)
        self.raised[model] = k
        self._journal.record("oom", model, factor=k)
        log.warning(
            "model '%s' ran out of memory: booking it %.0f%% above its estimate from now on",
            model, (k - 1) * 100,
        )  # fmt: skip


def file_size(path: str) -> int:
    """The model's bytes on disk (all the parts of a split model)."""
    try:
        return sum(os.stat(p).st_size for p in split_parts(path))
    except OSError:
        return 0


async def wait_for_recovery(
    refresh: Refresh,
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


def read_kept(path: Path | None) -> Any:
    """What was kept in `path` (JSON), or None if it is missing or unreadable (then what it
    held is learned again)."""
    if path is None:
        return None
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        log.warning("ignoring %s: %s", path, e)
        return None


def write_kept(path: Path | None, data: Any, what: str) -> None:
    """Keep `data` in `path` (atomically; a failure only costs learning it again)."""
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        tmp.replace(path)
    except OSError as e:
        log.warning("could not keep %s in %s: %s", what, path, e)


def read_learned(path: Path | None) -> dict[str, int]:
    """The GPU context allowances learned before (card name -> bytes); none if the file is
    missing or unreadable."""
    data = read_kept(path)
    if not isinstance(data, dict):
        return {}
    return {str(k): v for k, v in data.items() if isinstance(v, int) and v > 0}
