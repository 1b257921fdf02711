"""Eviction policies: pure functions from a snapshot of idle runners to an eviction order.

The scheduler core asks a policy only when a load does not fit; it evicts candidates in the
returned order until the load fits. Candidates are always idle (no request in flight) and
unpinned: a policy cannot evict a serving runner because it is never offered one. A runner
held for an agent's next turn (`Candidate.held_until`) comes last in every order.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Candidate:
    id: int
    model: str
    size: int  # bytes it holds
    last_used: float  # monotonic seconds
    uses: int  # requests served since load
    load_cost: float  # seconds a reload would take (its last load, adjusted for the page cache)
    expires_at: float  # when its keep-alive runs out (math.inf = never)
    priority: int  # from models.toml; higher stays longer
    heat: float = 0.0  # the model's recency-weighted request frequency (see Core.heat)
    held_until: float = -math.inf  # its last answer was a tool call: held for the next turn


def held(c: Candidate, snap: Snapshot) -> bool:
    """Whether c is held for an agent's next turn (its last answer ended in a tool call):
    every policy offers such runners last."""
    return c.held_until > snap.now


@dataclass(frozen=True)
class Snapshot:
    now: float
    need: int  # bytes the waiting load needs freed
    waiting_models: frozenset[str]  # models with queued requests (about to be used)


Policy = Callable[[Sequence[Candidate], Snapshot], list[int]]


def lru(candidates: Sequence[Candidate], snap: Snapshot) -> list[int]:
    """Least recently used first."""
    return [c.id for c in sorted(candidates, key=lambda c: (held(c, snap), c.last_used))]


def ollama_like(candidates: Sequence[Candidate], snap: Snapshot) -> list[int]:
    """Ollama's choice: the runner whose keep-alive would run out soonest."""
    return [
        c.id for c in sorted(candidates, key=lambda c: (held(c, snap), c.expires_at, c.last_used))
    ]


def cost_aware(candidates: Sequence[Candidate], snap: Snapshot) -> list[int]:
    """Keep what is requested often and slow to reload per byte it holds; evict the rest first.

    In the spirit of GreedyDual-Size-Frequency: value = heat x reload seconds / bytes held,
    where heat is the model's request frequency with exponential decay (so a burst fades and a
    steady favourite stays). Models with queued requests, then those held for an agent's turn,
    and higher priority go last.
    """

    def score(c: Candidate) -> tuple[bool, bool, int, float, float]:
        value = c.heat * max(c.load_cost, 1e-3) / max(c.size, 1)
        return (c.model in snap.waiting_models, held(c, snap), c.priority, value, c.last_used)

    return [c.id for c in sorted(candidates, key=score)]


# Reading a file from disk instead of the page cache costs this much more per byte until
# corral has measured it on this machine (1 GB/s: between a SATA SSD and an NVMe drive).
DEFAULT_DISK_SECONDS_PER_BYTE = 1e-9


def reload_seconds(
    last: float, last_resident: float, resident: float, size: int, disk_spb: float
) -> float:
    """A model's reload time predicted from its last load (`last` seconds with `last_resident`
    of its file in the page cache) and how much of the file is cached now: each byte that
    left the cache since costs `disk_spb` more seconds, each byte that came in that much less
    (never below a fifth of the last load: spawning and allocating cost time too)."""
    delta = (last_resident - resident) * size * disk_spb
    return max(last * 0.2, last + delta)


def disk_seconds_per_byte(
    a: tuple[float, float], b: tuple[float, float], size: int
) -> float | None:
    """What reading from disk costs per byte beyond the page cache, from two loads of one file
    ((seconds, resident fraction) each) whose residency differed by at least 30%."""
    (ta, ra), (tb, rb) = a, b
    if abs(ra - rb) < 0.3 or size <= 0:
        return None
    spb = (ta - tb) / ((rb - ra) * size)
    return spb if spb > 0 else None


POLICIES: dict[str, Policy] = {"lru": lru, "ollama": ollama_like, "cost": cost_aware}
DEFAULT_POLICY = "cost"  # fewest loads and lowest tail latency in `corral bench swap`
