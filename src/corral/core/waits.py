"""Why each queued request waits, read from the scheduler core's books (pure, read only).

The core keeps one queue across models, in arrival order, and `Core._pump` goes through it
after every event: a request whose model's runner is ready with a free slot is granted at once,
whatever waits ahead of it for other models; loads start first come, first served (a model
reloading with new options first), one at a time per GPU. So what tells a waiting client how
far it is from its turn is its place among the requests for its own model (they are granted in
queue order), and why it waits: its runner is loading, has every slot busy or must reload, or
its load waits behind another model's load, for a GPU, for models that are unloading, or for
busy models to free memory. `waits` reads that off the books as the last event left them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from corral.core.books import Core, compatible
from corral.core.requests import Request

Why = Literal[
    "loading", "busy", "reload", "exiting", "behind_load", "gpu", "evicting", "memory", "room"
]
# What each reason means, in the words the dashboard and `corral ps` show.
WHY: dict[Why, str] = {
    "loading": "its model is loading",
    "busy": "every slot of its model is busy",
    "reload": "its model reloads with other options",
    "exiting": "its model's old runner is still exiting",
    "behind_load": "another model's load goes first",
    "gpu": "another model is loading onto its GPU",
    "evicting": "models are unloading to make room for it",
    "memory": "waiting for memory the busy models hold",
    # granted a slot (runtime/hop): its prompt waits for room in the runner's shared cache
    "room": "waiting for room in its runner's shared context",
}


@dataclass(frozen=True)
class Wait:
    request: Request
    place: int  # 1: the next of its model's requests to be granted
    of: int  # requests waiting for its model
    position: int  # its place in the one queue across models (arrival order; loads go so)
    why: Why
    runner: int | None  # its model's runner (loading, busy or draining), if it has one


def waits(core: Core) -> list[Wait]:
    """Every queued request in queue order, with its place and why it waits, as the core's
    last `_pump` left the books (nothing it could be granted waits: `_pump` would have)."""
    order = core.load_order()
    # The load every other one waits behind: the first request with no runner of its model
    head = next((q.model for q in order if core.current(q.model) is None), None)
    stopping: dict[str, int] = {}
    leaving = 0
    for b in core.runners.values():
        if b.state == "unloading":
            leaving += 1
            for d, n in b.devices.items():
                stopping[d] = stopping.get(d, 0) + n
    counts: dict[str, int] = {}
    for q in core.queue:
        counts[q.model] = counts.get(q.model, 0) + 1
    seen: dict[str, int] = {}
    out = []
    for i, q in enumerate(core.queue):
        seen[q.model] = seen.get(q.model, 0) + 1
        r = core.current(q.model)
        why: Why
        if r is not None and (r.draining or not compatible(r.spec, q)):
            why = "reload"
        elif r is not None and r.state == "loading":
            why = "loading"
        elif r is not None:
            # ready with a free slot, yet not granted: a load that has waited past
            # starve_after needs this runner's memory, and goes first
            why = "busy" if r.inflight >= r.spec.num_parallel else "behind_load"
        elif any(b.model == q.model for b in core.runners.values()):
            why = "exiting"
        elif q.model != head:
            why = "behind_load"
        elif core.gpu_loading(q):
            why = "gpu"
        elif leaving and core.fit(q.least, stopping, leaving) is not None:
            why = "evicting"
        else:
            why = "memory"
        out.append(Wait(q, seen[q.model], counts[q.model], i + 1, why, r.id if r else None))
    return out
