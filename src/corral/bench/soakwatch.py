"""The soak's memory watch: two threads beside the load, one summing the runners' real memory
(PSS, and RSS beside it) every 200 ms, one polling /api/ps for what corral booked; the peaks and
every sample over the limit are kept for the report (`bench/soak.py`)."""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import psutil

from corral.testing.server import runner_pids

__all__ = ["MemoryWatch", "alive"]


@dataclass
class MemoryWatch:
    """Two threads: the runners' PSS and RSS every `every` seconds, /api/ps every `ps_every`."""

    server_pid: int
    url: str
    limit: int
    every: float = 0.2
    ps_every: float = 0.5
    samples: int = 0
    max_gap: float = 0.0  # longest time between two PSS samples (a busy sampler shows here)
    peak_pss: int = 0
    peak_rss: int = 0
    peak_runners: int = 0
    pss_over: list[dict[str, Any]] = field(default_factory=list)  # samples above the limit
    pss_over_count: int = 0
    rss_over_count: int = 0
    peak_pss_sample: dict[str, Any] = field(default_factory=dict)
    ps_polls: int = 0
    ps_failures: int = 0
    peak_booked: int = 0
    booked_over: list[dict[str, Any]] = field(default_factory=list)
    peak_measured: int = 0
    last_ps: list[dict[str, Any]] = field(default_factory=list)
    pid_model: dict[int, str] = field(default_factory=dict)
    watched: dict[int, float] = field(default_factory=dict)  # stopped pid -> when it died
    watch_pids: set[int] = field(default_factory=set)
    t0: float = field(default_factory=time.monotonic)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> None:
        self._threads = [
            threading.Thread(target=self._sample_loop, name="soak-pss", daemon=True),
            threading.Thread(target=self._ps_loop, name="soak-ps", daemon=True),
        ]
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(10)

    def watch_death(self, pid: int) -> None:
        self.watch_pids.add(pid)

    def _sample(self) -> None:
        now = time.monotonic()
        per: dict[int, tuple[int, int]] = {}
        for pid in runner_pids(self.server_pid):
            try:
                mi = psutil.Process(pid).memory_full_info()
            except psutil.Error:
                continue
            per[pid] = (int(getattr(mi, "pss", mi.rss)), int(mi.rss))
        pss = sum(p for p, _ in per.values())
        rss = sum(r for _, r in per.values())
        self.samples += 1
        self.peak_rss = max(self.peak_rss, rss)
        self.peak_runners = max(self.peak_runners, len(per))
        at = round(now - self.t0, 2)
        if rss > self.limit:
            self.rss_over_count += 1
        if pss > self.limit:
            self.pss_over_count += 1
            if len(self.pss_over) < 20:
                self.pss_over.append(self._describe(at, pss, rss, per))
        if pss > self.peak_pss:
            self.peak_pss = pss
            self.peak_pss_sample = self._describe(at, pss, rss, per)
        for pid in list(self.watch_pids):
            if pid not in self.watched and not alive(pid):
                self.watched[pid] = now

    def _describe(
        self, at: float, pss: int, rss: int, per: dict[int, tuple[int, int]]
    ) -> dict[str, Any]:
        books = {m.get("pid"): m for m in self.last_ps}
        runners = []
        for pid, (p, r) in sorted(per.items()):
            b = books.get(pid, {})
            runners.append({
                "pid": pid, "model": self.pid_model.get(pid, "?"), "pss": p, "rss": r,
                "state": b.get("state"), "booked": b.get("size"),
                "measured": b.get("measured_bytes"), "in_flight": b.get("requests_in_flight"),
            })  # fmt: skip
        return {"t": at, "pss": pss, "rss": rss, "runners": runners}

    def _sample_loop(self) -> None:
        last = time.monotonic()
        while not self._stop.is_set():
            start = time.monotonic()
            self.max_gap = max(self.max_gap, start - last)
            last = start
            with contextlib.suppress(Exception):  # a sampler must outlive odd /proc states
                self._sample()
            self._stop.wait(max(0.0, self.every - (time.monotonic() - start)))

    def _ps_loop(self) -> None:
        with httpx.Client(base_url=self.url, timeout=5.0) as client:
            while not self._stop.is_set():
                start = time.monotonic()
                try:
                    models = client.get("/api/ps").raise_for_status().json()["models"]
                except (httpx.HTTPError, ValueError, KeyError):
                    self.ps_failures += 1
                else:
                    self.ps_polls += 1
                    self.last_ps = models
                    for m in models:
                        if isinstance(m.get("pid"), int):
                            self.pid_model[m["pid"]] = str(m.get("model"))
                    booked = sum(int(m.get("size") or 0) for m in models)
                    measured = sum(int(m.get("measured_bytes") or 0) for m in models)
                    self.peak_booked = max(self.peak_booked, booked)
                    self.peak_measured = max(self.peak_measured, measured)
                    if booked > self.limit and len(self.booked_over) < 20:
                        self.booked_over.append({
                            "t": round(start - self.t0, 2), "booked": booked,
                            "runners": [
                                {k: m.get(k) for k in ("model", "pid", "state", "size",
                                                      "measured_bytes", "context_length")}
                                for m in models
                            ],
                        })  # fmt: skip
                self._stop.wait(max(0.0, self.ps_every - (time.monotonic() - start)))


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
