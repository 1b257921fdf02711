"""A runner whose answer ended in a tool call is held for the agent's next turn (the pure
core, with its clock in the test's hands): other loads take other idle victims first and wait
for it at most its reload time; the hold ends on the model's next request or an unload; a held
runner still expires. The random event sequences of tests/test_books.py release with holds
too."""

from __future__ import annotations

import math

from corral.core.books import Core
from corral.core.policy import POLICIES
from corral.core.requests import Grant, Load, Request, Stop
from corral.core.spec import RunnerSpec

HOLD = 30.0


class Books:
    """A Core with a clock the test moves, and the actions it emitted."""

    def __init__(self, budget: int = 1000, policy: str = "lru", keep_alive: float = 300.0):
        self.core = Core(
            budgets={"cpu": budget}, policy=POLICIES[policy], default_keep_alive=keep_alive
        )
        self.now = 0.0
        self.ids = 0
        self.actions: list[object] = []

    def at(self, t: float) -> None:
        self.now = t
        self.core.tick(t)
        self.actions += self.core.drain()

    def request(self, model: str, size: int) -> int:
        self.ids += 1
        spec = RunnerSpec(path=f"/m/{model}.gguf", n_ctx=1024, num_parallel=1)
        req = Request(self.ids, model, spec, frozenset(), size, None, self.now)
        self.core.request(req, self.now)
        self.actions += self.core.drain()
        return self.ids

    def release(self, rid: int, hold: float = 0.0) -> None:
        self.core.release(rid, self.now, hold)
        self.actions += self.core.drain()

    def runner(self, model: str) -> int:
        """The id of the model's runner (on its way out or not)."""
        (rid,) = [r.id for r in self.core.runners.values() if r.model == model]
        return rid

    def load(self, model: str, size: int, took: float = 2.0) -> int:
        """A request for `model` served by a fresh runner that took `took` seconds to load;
        the request's id (still granted)."""
        rid = self.request(model, size)
        self.at(self.now + took)
        self.core.loaded(self.runner(model), self.now)
        self.actions += self.core.drain()
        assert self.granted(rid)
        return rid

    def granted(self, rid: int) -> bool:
        return any(isinstance(a, Grant) and a.request == rid for a in self.actions)

    def stopped(self) -> list[int]:
        out = [a.runner for a in self.actions if isinstance(a, Stop)]
        self.actions = [a for a in self.actions if not isinstance(a, Stop)]
        return out

    def exit(self, runner: int) -> None:
        self.core.exited(runner, self.now)
        self.actions += self.core.drain()


def test_a_held_runner_is_spared_while_another_idle_runner_makes_room() -> None:
    b = Books()
    x = b.load("x", 400)
    y = b.load("y", 400)
    b.at(3.0)
    b.release(x, HOLD)  # x's answer ended in a tool call; x is the least recently used
    b.at(4.0)
    b.release(y)
    b.at(5.0)
    b.request("z", 400)  # one of x and y must go: LRU says x, the hold says y
    assert b.stopped() == [b.runner("y")]
    assert b.core.runners[b.runner("x")].state == "ready"


def test_without_the_hold_the_policy_evicts_as_before() -> None:
    b = Books()
    x = b.load("x", 400)
    y = b.load("y", 400)
    b.at(3.0)
    b.release(x)
    b.at(4.0)
    b.release(y)
    b.at(5.0)
    b.request("z", 400)
    assert b.stopped() == [b.runner("x")]


def test_a_load_that_needs_the_held_runner_waits_its_reload_time_then_proceeds() -> None:
    b = Books()
    x = b.load("x", 600, took=2.0)  # a reload of x would take 2 s
    b.at(3.0)
    b.release(x, HOLD)
    b.at(4.0)
    z = b.request("z", 600)  # only x can make room: z waits for the agent's turn...
    assert b.stopped() == [] and not b.granted(z)
    # ... at most as long as a reload of x would take, counted from when z began to wait
    assert b.core.next_wake() == 6.0
    b.at(5.9)
    assert b.stopped() == []
    b.at(6.0)
    assert b.stopped() == [b.runner("x")]
    b.exit(1)
    assert any(isinstance(a, Load) and a.model == "z" for a in b.actions)


def test_the_held_models_next_request_is_served_and_ends_the_hold() -> None:
    b = Books()
    x = b.load("x", 600)
    b.at(3.0)
    b.release(x, HOLD)
    assert b.core.runners[b.runner("x")].held_until == 3.0 + HOLD
    b.at(3.5)
    x2 = b.request("x", 600)  # the tool's result: the turn the hold was for
    assert b.granted(x2)
    assert b.core.runners[b.runner("x")].held_until == -math.inf
    b.at(4.0)
    b.release(x2)  # a plain answer this time: nothing held
    b.request("z", 600)
    assert b.stopped() == [b.runner("x")]


def test_an_agent_that_keeps_coming_back_does_not_starve_another_load() -> None:
    """x's agent returns within x's reload time after every tool call, so each release holds
    x anew; z's load still gets x's memory once it has waited starve_after (5 s)."""
    b = Books()
    x = b.load("x", 600, took=2.0)
    b.at(3.0)
    b.release(x, HOLD)
    b.at(4.0)
    z = b.request("z", 600)
    t = 4.0
    while b.core.runners[b.runner("x")].state == "ready":
        assert t < 4.0 + b.core.starve_after + 1.0, "z starves"
        t += 0.5
        b.at(t)
        nxt = b.request("x", 600)  # the tool's result, 0.5 s later
        if not b.granted(nxt):  # held back behind z's load, which has starved
            break
        t += 0.3
        b.at(t)
        b.release(nxt, HOLD)  # another tool call
    assert b.core.runners[b.runner("x")].state == "unloading"
    b.exit(1)
    assert any(isinstance(a, Load) and a.model == "z" for a in b.actions)
    assert not b.granted(z)  # it waits for its load, not for x


def test_a_held_runner_still_expires_and_an_unload_ends_the_hold() -> None:
    b = Books(keep_alive=10.0)
    x = b.load("x", 400)
    b.at(3.0)
    b.release(x, HOLD)  # held until 33, but its keep-alive ends at 13
    assert b.core.next_wake() == 13.0
    b.at(13.0)
    assert b.stopped() == [b.runner("x")]
    b.exit(1)
    y = b.load("y", 400)
    b.release(y, HOLD)
    assert b.core.unload("y", b.now)  # keep_alive 0, `corral stop`: it goes at once
    b.actions += b.core.drain()
    assert b.stopped() == [b.runner("y")]


def test_an_expected_wait_counts_the_hold_a_load_would_wait_for() -> None:
    b = Books()
    z = b.load("z", 600, took=2.0)  # z's load and service times are measured
    b.at(3.0)
    b.release(z)
    x = b.request("x", 600)  # evicts z
    b.exit(b.runner("z"))
    b.at(5.0)
    b.core.loaded(b.runner("x"), b.now)  # a reload of x would take 2 s
    b.actions += b.core.drain()
    assert b.granted(x)
    b.at(6.0)
    b.release(x, HOLD)
    b.at(6.5)
    spec = RunnerSpec(path="/m/z.gguf", n_ctx=1024, num_parallel=1)
    later = Request(99, "z", spec, frozenset(), 600, None, b.now)
    # the hold yields 2 s (x's reload time) after z would begin to wait, then z loads (2 s)
    assert b.core.expected_wait(later, b.now) == 2.0 + 2.0
    assert b.core.runners[b.runner("x")].held_until == 6.0 + HOLD
