"""The dashboard's charts: the last hour of the scheduler's view, sampled every few seconds and
kept in memory (`GET /api/corral/history`).

A sample is a handful of numbers read from one `SchedulerView` (memory per device: booked,
measured in corral's runners, in use by all programs; generated tokens/s per model; requests in
flight and queued), so a ring of 720 of them (an hour at 5 s) is small and taking one is cheap
enough for the server's event loop. Loads, evictions, crashes and the like come from the journal
as marks on the time axis. Nothing is written to disk: a restart starts a new history.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from corral.runtime.journal import Event
from corral.runtime.view import SchedulerView

log = logging.getLogger("corral")

WINDOW = 3600.0  # seconds of history kept
INTERVAL = 5.0  # seconds between samples (CORRAL_HISTORY_INTERVAL)
# The journal events that mark the time axis (a refusal is a request's, not the machine's).
MARK_KINDS = frozenset({"load", "ready", "load_failed", "unload", "crash", "stall", "oom"})
MAX_MARKS = 2000  # a flapping model cannot grow the marks without bound


@dataclass(frozen=True)
class DeviceSample:
    booked: int
    measured: int
    in_use: int | None  # all programs, as the OS reports it (None: not measured yet)


@dataclass(frozen=True)
class Sample:
    at: float  # wall-clock seconds
    devices: dict[str, DeviceSample]
    rates: dict[str, float]  # model -> generated tokens/s (models generating only)
    in_flight: int
    queued: int


def sample_of(view: SchedulerView, at: float) -> Sample:
    """What one sample keeps of a view."""
    measured = {d.id: d for d in view.devices}
    devices = {}
    for dev in view.budgets:
        d = measured.get(dev)
        devices[dev] = DeviceSample(
            booked=view.booked.get(dev, 0),
            measured=view.measured.get(dev, 0),
            in_use=d.total - d.free if d is not None else None,
        )
    rates = {m: round(r, 2) for m, r in view.tokens_per_second.items() if r > 0}
    return Sample(
        at=at,
        devices=devices,
        rates=rates,
        in_flight=sum(r.inflight for r in view.runners),
        queued=sum(view.queued.values()),
    )


class History:
    """A ring of samples and the journal's marks over the last `window` seconds.

    `read` gives the scheduler's view, `clock` the wall time (both fakes in unit tests). The
    sampler is a timer on the running loop (no task to cancel): `start()` arms it, `stop()`
    disarms it, and it stops by itself once the view says the server is closing."""

    def __init__(
        self,
        read: Callable[[], SchedulerView],
        *,
        interval: float = INTERVAL,
        window: float = WINDOW,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.read = read
        self.interval = max(0.05, interval)
        self.window = window
        self.clock = clock
        self.samples: deque[Sample] = deque(maxlen=max(2, math.ceil(window / self.interval)))
        self.marks: deque[dict[str, Any]] = deque(maxlen=MAX_MARKS)
        self.names: dict[str, str] = {}  # device id -> its name, as last measured
        self.budgets: dict[str, int] = {}
        self.totals: dict[str, int] = {}
        self.closing = False
        self._timer: asyncio.Handle | None = None
        self._stopped = False

    # ---- feeding ---------------------------------------------------------------------------
    def take(self) -> Sample:
        """Record one sample of the view now."""
        view = self.read()
        self.closing = view.closing
        self.budgets = dict(view.budgets)
        for d in view.devices:
            self.names[d.id] = d.name
            self.totals[d.id] = d.total
        s = sample_of(view, self.clock())
        self.samples.append(s)
        return s

    def on_event(self, ev: Event) -> None:
        """A journal listener: loads, evictions and crashes become marks."""
        if ev.kind not in MARK_KINDS:
            return
        mark: dict[str, Any] = {"at": ev.at, "kind": ev.kind, "model": ev.model}
        for k in ("reason", "room_for", "seconds", "runner"):
            if ev.detail.get(k) is not None:
                mark[k] = ev.detail[k]
        self.marks.append(mark)

    # ---- the sampler -----------------------------------------------------------------------
    def start(self) -> None:
        """Arm the sampler on the running loop (idempotent): a first sample as soon as the
        caller is done (it may be the scheduler, in the middle of a decision), then one every
        `interval`."""
        if self._timer is not None or self._stopped:
            return
        with contextlib.suppress(RuntimeError):  # no running loop: sampled on demand only
            self._timer = asyncio.get_running_loop().call_soon(self._tick)

    def stop(self) -> None:
        self._stopped = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    @property
    def running(self) -> bool:
        return self._timer is not None

    def _tick(self) -> None:
        self._timer = None
        if self._stopped:
            return
        try:
            self.take()
        except Exception:  # a bad sample must not end the history
            log.exception("taking a history sample")
        if self.closing:  # the server is on its way down
            self._stopped = True
            return
        with contextlib.suppress(RuntimeError):  # no running loop: sampled on demand only
            self._timer = asyncio.get_running_loop().call_later(self.interval, self._tick)

    # ---- reading ---------------------------------------------------------------------------
    def document(self, since: float | None = None) -> dict[str, Any]:
        """The history as columns (one list per series, aligned with `time`) for the page;
        `since`: only samples and marks after that wall time."""
        now = self.clock()
        start, after = now - self.window, -math.inf if since is None else since

        def shown(at: float) -> bool:
            return at >= start and at > after

        rows = [s for s in self.samples if shown(s.at)]
        devices: dict[str, dict[str, Any]] = {}
        for dev in sorted({d for s in rows for d in s.devices} | set(self.budgets)):
            devices[dev] = {
                "name": self.names.get(dev, dev),
                "budget": self.budgets.get(dev),
                "total": self.totals.get(dev),
                "booked": [s.devices[dev].booked if dev in s.devices else None for s in rows],
                "measured": [s.devices[dev].measured if dev in s.devices else None for s in rows],
                "in_use": [s.devices[dev].in_use if dev in s.devices else None for s in rows],
            }
        models = sorted({m for s in rows for m in s.rates})
        rates = {m: [s.rates.get(m, 0.0) for s in rows] for m in models}
        return {
            "interval": self.interval,
            "window": self.window,
            "now": now,
            "time": [s.at for s in rows],
            "devices": devices,
            "tokens_per_second": rates,
            "in_flight": [s.in_flight for s in rows],
            "queued": [s.queued for s in rows],
            "marks": [m for m in self.marks if shown(m["at"])],
        }
