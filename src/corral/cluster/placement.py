"""Which node serves a request: a pure function over snapshots of the nodes' books.

The entry process keeps one `NodeView` per node (from the node agent's books, with its own
requests in flight and the loads it has just sent there laid over them) and asks `choose` for
every request that names a model. In order of preference:

1. a node where the model is ready with a free slot (most free slots, then most free bytes);
2. a node where it is ready but busy, or loading (fewest requests waiting per slot): it will be
   served there without a second load;
3. a node where it fits without evicting anything: best fit, the one with the fewest free bytes
   left after the load (keeps the large holes for large models);
4. a node where evicting idle runners makes room: the one whose victims the eviction policy
   values least. The policy ranks every idle runner of the cluster once, as if they were on one
   machine; a node's cost is the highest rank among the victims it would need (then the bytes
   evicted), so one policy decides across the cluster;
5. a node where it fits once requests in flight there finish (the node's corral queues it);
6. else, the largest node that has the model (its corral answers that it can never fit).

Nodes without the model's file never get it; a model pinned to nodes (models.toml `nodes`) only
goes to nodes one of whose names matches. Nothing here does I/O or reads a clock.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from corral.core.policy import Candidate, Policy, Snapshot, cost_aware

How = Literal["ready", "queue", "fits", "evict", "wait", "too-big", "none"]


@dataclass(frozen=True)
class RunnerView:
    """One model's runner on a node."""

    model: str  # canonical name
    state: str  # loading | ready | unloading
    bytes: int
    inflight: int = 0
    slots: int = 1
    queued: int = 0
    # what the entry saw of its use (its own clock, monotonic seconds)
    last_used: float = 0.0
    uses: int = 0
    load_cost: float = 0.0
    heat: float = 0.0
    pinned: bool = False  # models.toml `pinned`: never evicted
    priority: int = 0

    @property
    def idle(self) -> bool:
        return self.state == "ready" and self.inflight == 0 and self.queued == 0


@dataclass(frozen=True)
class NodeView:
    id: str  # Ray node id
    name: str  # what errors and /api/ps call it
    budget: int  # bytes its runners may book, all devices together (less its reservation)
    models: Mapping[str, int]  # canonical name -> bytes a runner of it books on this node
    runners: tuple[RunnerView, ...] = ()
    names: frozenset[str] = frozenset()  # what `nodes = [...]` pins may match: id, host, labels

    @property
    def booked(self) -> int:
        return sum(r.bytes for r in self.runners)

    @property
    def free(self) -> int:
        return max(0, self.budget - self.booked)

    def runner(self, model: str) -> RunnerView | None:
        live = [r for r in self.runners if r.model == model and r.state != "unloading"]
        return max(live, key=lambda r: r.state == "ready") if live else None

    def matches(self, selectors: frozenset[str]) -> bool:
        return any(s == self.id or s in self.names for s in selectors) or any(
            len(s) >= 8 and self.id.startswith(s) for s in selectors
        )


@dataclass(frozen=True)
class Choice:
    node: str | None  # node id; None when no node has the model
    how: How
    victims: tuple[str, ...] = ()  # models the node is expected to evict (how == "evict")
    need: int = 0  # bytes the model books there
    reason: str = ""  # for how == "none"


@dataclass(frozen=True)
class Request:
    model: str  # canonical name
    pin: frozenset[str] = frozenset()  # node selectors; empty: any node
    now: float = 0.0
    waiting: frozenset[str] = field(default_factory=frozenset)  # models with queued requests


def choose(
    req: Request,
    nodes: Sequence[NodeView],
    policy: Policy = cost_aware,
    heat: Callable[[str], float] | None = None,
) -> Choice:
    """The node for `req` (see the module's docstring). `heat` gives a model's heat for the
    eviction ranking where the runners' own `heat` fields are not kept current."""
    has = [n for n in nodes if req.model in n.models]
    if not has:
        return Choice(None, "none", reason=f"model '{req.model}' not found on any node")
    eligible = [n for n in has if not req.pin or n.matches(req.pin)]
    if not eligible:
        pins = ", ".join(sorted(req.pin))
        return Choice(
            None, "none", reason=f"model '{req.model}' is pinned to nodes {pins}: none is up"
        )
    need = {n.id: n.models[req.model] for n in eligible}

    # 1. ready with a free slot
    free_slot = []
    for n in eligible:
        r = n.runner(req.model)
        if r is not None and r.state == "ready" and r.inflight + r.queued < r.slots:
            free_slot.append((r.slots - r.inflight - r.queued, n.free, n))
    if free_slot:
        n = max(free_slot, key=lambda t: (t[0], t[1]))[2]
        return Choice(n.id, "ready", need=need[n.id])

    # 2. ready but busy, or loading: served there without another load
    warm = []
    for n in eligible:
        r = n.runner(req.model)
        if r is not None:
            warm.append(((r.inflight + r.queued) / max(1, r.slots), -n.free, n))
    if warm:
        n = min(warm, key=lambda t: (t[0], t[1]))[2]
        return Choice(n.id, "queue", need=need[n.id])

    # 3. fits without evicting anything: best fit
    fits = [(n.free - need[n.id], n) for n in eligible if need[n.id] <= n.free]
    if fits:
        n = min(fits, key=lambda t: t[0])[1]
        return Choice(n.id, "fits", need=need[n.id])

    # 4. evict where the policy values the victims least
    possible = [n for n in eligible if need[n.id] <= n.budget]
    if not possible:
        n = max(eligible, key=lambda n: n.budget)
        return Choice(n.id, "too-big", need=need[n.id])
    ranks = _cluster_ranks(possible, req, policy, max(need.values()), heat)
    best: tuple[tuple[float, int, float], NodeView, tuple[str, ...]] | None = None
    for n in possible:
        found = _victims(n, need[n.id], ranks)
        if found is None:
            continue
        victims, cost = found
        if best is None or cost < best[0]:
            best = (cost, n, victims)
    if best is not None:
        _, n, victims = best
        return Choice(n.id, "evict", victims=victims, need=need[n.id])

    # 5. everything evictable is busy: wait where the fewest requests are in flight
    def busy(n: NodeView) -> tuple[int, int]:
        return (sum(r.inflight + r.queued for r in n.runners), -n.free)

    n = min(possible, key=busy)
    return Choice(n.id, "wait", need=need[n.id])


def _cluster_ranks(
    nodes: Sequence[NodeView],
    req: Request,
    policy: Policy,
    need: int,
    heat: Callable[[str], float] | None,
) -> dict[tuple[str, int], int]:
    """Every idle runner of these nodes ranked by the policy at once: (node id, index) -> the
    position in the policy's eviction order (0 = evicted first)."""
    keys: list[tuple[str, int]] = []
    cands: list[Candidate] = []
    for n in nodes:
        for i, r in enumerate(n.runners):
            if r.idle and not r.pinned:
                keys.append((n.id, i))
                cands.append(
                    Candidate(
                        id=len(cands), model=r.model, size=r.bytes, last_used=r.last_used,
                        uses=r.uses, load_cost=r.load_cost, expires_at=math.inf,
                        priority=r.priority, heat=heat(r.model) if heat else r.heat,
                    )
                )  # fmt: skip
    snap = Snapshot(now=req.now, need=need, waiting_models=req.waiting)
    return {keys[cid]: pos for pos, cid in enumerate(policy(cands, snap))}


def _victims(
    n: NodeView, need: int, ranks: Mapping[tuple[str, int], int]
) -> tuple[tuple[str, ...], tuple[float, int, float]] | None:
    """The idle runners of `n` to evict, in the cluster order, until `need` fits (sparing any
    that turn out not to be needed), and their cost: (highest rank, bytes evicted, sum of
    ranks); None if evicting every idle runner is not enough."""
    free = n.free + sum(r.bytes for r in n.runners if r.state == "unloading")
    if need <= free:  # enough is already on its way out
        return (), (-1.0, 0, 0.0)
    order = sorted(
        ((ranks[(n.id, i)], r) for i, r in enumerate(n.runners) if (n.id, i) in ranks),
        key=lambda t: t[0],
    )
    chosen: list[tuple[int, RunnerView]] = []
    for rank, r in order:
        chosen.append((rank, r))
        if free + sum(v.bytes for _, v in chosen) >= need:
            break
    else:
        return None
    for item in list(chosen):  # spare a victim the load does not need after all
        rest = [c for c in chosen if c is not item]
        if free + sum(v.bytes for _, v in rest) >= need:
            chosen = rest
    cost = (
        float(max(rank for rank, _ in chosen)),
        sum(r.bytes for _, r in chosen),
        float(sum(rank for rank, _ in chosen)),
    )
    return tuple(r.model for _, r in chosen), cost
