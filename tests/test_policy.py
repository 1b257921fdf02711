"""Eviction policies are pure functions of a snapshot; each gets a scenario it must handle."""

from __future__ import annotations

import math

from corral.core.books import Core
from corral.core.policy import POLICIES, Candidate, Snapshot, cost_aware, lru, ollama_like


def cand(
    i: int,
    model: str,
    *,
    size: int = 100,
    last_used: float = 0.0,
    heat: float = 1.0,
    load_cost: float = 1.0,
    expires_at: float = math.inf,
    priority: int = 0,
    held_until: float = -math.inf,
) -> Candidate:
    return Candidate(
        id=i,
        model=model,
        size=size,
        last_used=last_used,
        uses=1,
        load_cost=load_cost,
        expires_at=expires_at,
        priority=priority,
        heat=heat,
        held_until=held_until,
    )


SNAP = Snapshot(now=100.0, need=100, waiting_models=frozenset())


def test_lru_evicts_least_recently_used_first() -> None:
    cs = [cand(1, "a", last_used=50), cand(2, "b", last_used=10), cand(3, "c", last_used=90)]
    assert lru(cs, SNAP) == [2, 1, 3]


def test_ollama_like_evicts_the_soonest_to_expire() -> None:
    cs = [
        cand(1, "a", expires_at=400),
        cand(2, "b", expires_at=math.inf),
        cand(3, "c", expires_at=200),
    ]
    assert ollama_like(cs, SNAP) == [3, 1, 2]


def test_cost_aware_keeps_a_steady_favourite_over_a_recent_burst() -> None:
    core = Core(budgets={"cpu": 1})
    for i in range(60):  # 'chat' is asked for all along; 'burst' only in a short spell
        core._heat["chat"] = (core.heat("chat") + 1.0, core._arrivals)
        core._arrivals += 1
        if 20 <= i < 25:
            core._heat["burst"] = (core.heat("burst") + 1.0, core._arrivals)
            core._arrivals += 1
    assert core.heat("chat") > 5 * core.heat("burst")
    chat = cand(1, "chat", last_used=10, heat=core.heat("chat"))
    burst = cand(2, "burst", last_used=20, heat=core.heat("burst"))  # used more recently
    assert lru([chat, burst], SNAP)[0] == 1  # LRU would evict the favourite
    assert cost_aware([chat, burst], SNAP)[0] == 2


def test_cost_aware_prefers_evicting_what_is_cheap_to_reload_per_byte() -> None:
    quick = cand(1, "quick", size=100, load_cost=0.1)
    slow = cand(2, "slow", size=100, load_cost=5.0)
    assert cost_aware([slow, quick], SNAP)[0] == 1


def test_cost_aware_spares_models_with_waiting_requests_and_high_priority() -> None:
    waiting = Snapshot(now=100.0, need=100, waiting_models=frozenset({"a"}))
    cs = [cand(1, "a", heat=0.1), cand(2, "b", heat=5.0)]
    assert cost_aware(cs, waiting)[0] == 2
    cs = [cand(1, "a", heat=0.1, priority=5), cand(2, "b", heat=5.0)]
    assert cost_aware(cs, SNAP)[0] == 2


def test_every_policy_offers_a_runner_held_for_an_agents_turn_last() -> None:
    """Its last answer ended in a tool call (held until 130, now is 100): whatever else makes
    it the first victim, it comes after the others; once the hold is over it is ordinary."""
    held = cand(1, "agent", last_used=1, heat=0.01, load_cost=0.01, expires_at=101,
                held_until=130)  # fmt: skip
    others = [cand(2, "b", last_used=50, heat=9.0, load_cost=9.0, expires_at=500),
              cand(3, "c", last_used=60, heat=9.0, load_cost=9.0, expires_at=600)]  # fmt: skip
    for name, policy in POLICIES.items():
        assert policy([held, *others], SNAP)[-1] == 1, name
        after = Snapshot(now=130.0, need=100, waiting_models=frozenset())
        assert policy([held, *others], after)[0] == 1, name
