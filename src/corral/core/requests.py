"""What the scheduler core takes and emits, as plain data: a `Request` (its spec, its size
and the pure placer that says where it fits, with the smaller runners it may take instead, one
`Sizing` each) and the `Action`s the core appends for the shell (`Grant`, `Fail`, `Load`,
`Stop`); `QueueFull` for a request refused at once."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

from corral.core.spec import RunnerSpec


@dataclass(frozen=True)
class Fit:
    """Where a runner would go: bytes per device, and the layout the runner needs to be
    started with (GPU layers, tensor split: opaque to the core)."""

    devices: Mapping[str, int]
    layout: Any = None

    @property
    def size(self) -> int:
        return sum(self.devices.values())


# Free bytes per device -> where the runner fits, or None. Pure: the core asks it "what if".
Placer = Callable[[Mapping[str, int]], Fit | None]


def cpu_placer(size: int) -> Placer:
    def place(free: Mapping[str, int]) -> Fit | None:
        return Fit({"cpu": size}) if free.get("cpu", 0) >= size else None

    return place


def scaled_placer(place: Placer, k: float) -> Placer:
    """`place` for a runner that needs k times the bytes on every device (a model that ran out
    of memory with its estimate): it fits where the original fits in 1/k of the room."""

    def scaled(free: Mapping[str, int]) -> Fit | None:
        fit = place({d: int(n / k) for d, n in free.items()})
        if fit is None:
            return None
        return Fit({d: int(n * k) for d, n in fit.devices.items()}, fit.layout)

    return scaled


@dataclass(frozen=True)
class Sizing:
    """One runner a request may load: its spec, its bytes in all, where it goes, and of its
    bytes its process's own (Request.smaller)."""

    spec: RunnerSpec
    size: int
    place: Placer | None = None
    process: int = 0


@dataclass
class Request:
    id: int
    model: str
    spec: RunnerSpec  # the runner to load if none is loaded
    explicit: frozenset[str]  # spec fields the request set itself; only these must match
    size: int  # estimated bytes of a runner with `spec`, in all
    keep_alive: float | None  # None: keep what the model has
    arrived: float
    deadline: float = math.inf
    pinned: bool = False
    priority: int = 0
    place: Placer | None = None  # None: all of `size` in system memory
    process: int = 0  # of `size`, its process's own memory (beside llama.cpp's allocation)
    # Smaller runners that serve it too, best first (an automatic slot count: fewer slots,
    # each with its spec, size, placer and process): a load takes the first of this request
    # and these that fits without stopping a busy runner (`Core._choose`).
    smaller: tuple[Request, ...] = ()

    def fit(self, free: Mapping[str, int]) -> Fit | None:
        return (self.place or cpu_placer(self.size))(free)

    @property
    def choices(self) -> tuple[Request, ...]:
        return (self, *self.smaller)

    def offering(self, sizings: Sequence[Sizing]) -> Request:
        """This request, that may also load the runners of `sizings` (best first)."""
        return replace(self, smaller=tuple(
            replace(self, spec=z.spec, size=z.size, place=z.place, process=z.process)
            for z in sizings
        ))  # fmt: skip

    def scaled(self, k: float) -> Request:
        """This request, its runners needing k times the bytes on every device (a model that
        ran out of memory with its estimate)."""
        if k == 1.0:
            return self
        return replace(
            self, size=int(self.size * k), smaller=tuple(z.scaled(k) for z in self.smaller),
            place=scaled_placer(self.place or cpu_placer(self.size), k),
        )  # fmt: skip

    @property
    def least(self) -> Request:
        """The smallest runner that serves it: what memory must hold for it at the least."""
        return self.smaller[-1] if self.smaller else self


@dataclass(frozen=True)
class Grant:
    request: int
    runner: int


@dataclass(frozen=True)
class Fail:
    request: int
    status: int  # HTTP status the API should answer with
    message: str
    retry_after: float | None = None  # seconds, for a 503 a retry may cure


@dataclass(frozen=True)
class Load:
    runner: int
    model: str
    spec: RunnerSpec
    fit: Fit


# Why a runner is stopped, for metrics and the operator: the reason's class.
StopKind = Literal["memory", "keep_alive", "options_change", "requested"]


@dataclass(frozen=True)
class Stop:
    runner: int
    reason: str  # in words, for the log
    kind: StopKind = "requested"
    room_for: str | None = None  # the model an eviction made room for


Action = Grant | Fail | Load | Stop


class QueueFull(Exception):
    """The request is refused at once (503): the queue is full, or its wait could not end
    before its deadline. `retry_after`: seconds after which a retry is likely to be served."""

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after
