"""The scheduler's decisions as a feed: what it loaded, evicted and why, what crashed.

One line per decision goes to the log; the same events go to listeners (the metrics, the
dashboard's live feed) and stay in a short ring for a page that opens later. Recording is
synchronous and cheap: listeners must not block (an SSE client's listener just queues)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# kind: load (started), ready, load_failed, unload (with its reason class), crash, stall,
# oom (a booking raised), refused (queue full or an expected wait past the timeout)
KINDS = ("load", "ready", "load_failed", "unload", "crash", "stall", "oom", "refused")


@dataclass(frozen=True)
class Event:
    kind: str
    model: str
    at: float  # wall-clock seconds (time.time())
    detail: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "model": self.model, "at": self.at, **self.detail}


Listener = Callable[[Event], None]


class Journal:
    def __init__(self, keep: int = 200) -> None:
        self.recent: deque[Event] = deque(maxlen=keep)
        self._listeners: list[Listener] = []

    def record(self, kind: str, model: str, **detail: Any) -> Event:
        ev = Event(kind, model, time.time(), detail)
        self.recent.append(ev)
        for fn in list(self._listeners):
            fn(ev)
        return ev

    def listen(self, fn: Listener) -> Callable[[], None]:
        """Call fn for every event from now on; returns the function that stops it."""
        self._listeners.append(fn)
        return lambda: self._listeners.remove(fn) if fn in self._listeners else None
