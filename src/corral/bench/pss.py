"""The real memory of a server's processes: a thread that sums the proportional set size
(PSS, /proc/PID/smaps_rollup) of a process's descendants every 100 ms, and drops a model file
from the page cache once no process maps it (a cold disk for the next load). Used by the swap
benchmark (`bench/swap.py`) beside corral and llama.cpp's router alike."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from corral.bench.common import safe_div

__all__ = [
    "SAMPLE_EVERY", "MemorySampler", "drop_files", "mapped_models", "parse_smaps_rollup",
    "process_pss",
]  # fmt: skip

SAMPLE_EVERY = 0.1  # seconds between memory samples


def parse_smaps_rollup(text: str) -> dict[str, int]:
    """The sizes in /proc/PID/smaps_rollup, in bytes (`Pss:  1234 kB` -> {"Pss": 1263616})."""
    out = {}
    for line in text.splitlines():
        key, sep, rest = line.partition(":")
        parts = rest.split()
        if sep and len(parts) == 2 and parts[1] == "kB" and parts[0].isdigit():
            out[key.strip()] = int(parts[0]) * 1024
    return out


def process_pss(pid: int) -> int:
    """A process's proportional set size in bytes (0 when it is gone)."""
    text = _read(f"/proc/{pid}/smaps_rollup")
    return parse_smaps_rollup(text).get("Pss", 0) if text is not None else 0


def mapped_models(maps: str, suffix: str = ".gguf") -> set[str]:
    """The files ending in `suffix` that a process maps (the text of /proc/PID/maps)."""
    out = set()
    for line in maps.splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and parts[5].endswith(suffix):
            out.add(parts[5])
    return out


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:  # the process is gone
        return None


@dataclass
class MemorySampler:
    """A thread that sums the PSS of `root`'s descendants (not `root` itself) every `every`
    seconds. With `drop_unmapped`, a model file no descendant maps any more (its model was
    unloaded) is dropped from the page cache, so its next load reads it from disk."""

    root: int
    limit: int
    every: float = SAMPLE_EVERY
    drop_unmapped: bool = False
    peak: int = 0
    peak_processes: int = 0
    samples: int = 0
    over: int = 0  # samples above the limit
    drops: int = 0
    max_gap: float = 0.0
    _mapped: set[str] = field(default_factory=set)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> MemorySampler:
        self._thread = threading.Thread(target=self._loop, name="swap-pss", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        return self.result()

    def result(self) -> dict[str, Any]:
        return {
            "peak_pss": self.peak, "limit": self.limit,
            "peak_ratio": safe_div(self.peak, self.limit), "samples": self.samples,
            "over_limit_samples": self.over, "processes_at_peak": self.peak_processes,
            "page_cache_drops": self.drops, "max_gap_s": round(self.max_gap, 3),
        }  # fmt: skip

    def sample(self) -> int:
        """One sample: the descendants' summed PSS (also recorded)."""
        import psutil

        try:
            kids = [p.pid for p in psutil.Process(self.root).children(recursive=True)]
        except psutil.Error:
            kids = []
        total, mapped = 0, set()
        for pid in kids:
            total += process_pss(pid)
            if self.drop_unmapped:
                mapped |= mapped_models(_read(f"/proc/{pid}/maps") or "")
        self.samples += 1
        if total > self.limit:
            self.over += 1
        if total > self.peak:
            self.peak, self.peak_processes = total, len(kids)
        if self.drop_unmapped:
            from corral.runtime.pagecache import drop

            for path in self._mapped - mapped:
                self.drops += drop(path)
            self._mapped = mapped
        return total

    def _loop(self) -> None:
        last = time.monotonic()
        while True:
            self.sample()
            now = time.monotonic()
            self.max_gap = max(self.max_gap, now - last)
            last = now
            if self._stop.wait(self.every):
                return


def drop_files(paths: Sequence[Path]) -> None:
    """Drop every file from the page cache (a cold start for the next replay)."""
    from corral.runtime.pagecache import drop

    for path in paths:
        drop(str(path))
