"""Cross-node placement (corral.cluster.placement): plain cases for each rule, and properties
over random clusters. Pure: no Ray, no processes."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from corral.cluster.entry import error_tail
from corral.cluster.placement import Choice, NodeView, Request, RunnerView, choose
from corral.core.policy import POLICIES

MB = 10**6


def node(nid: str, budget: int, models: dict[str, int], *runners: RunnerView) -> NodeView:
    return NodeView(nid, nid, budget * MB, {m: n * MB for m, n in models.items()}, runners)


def run(model: str, state: str = "ready", mb: int = 100, **kw: float) -> RunnerView:
    return RunnerView(model, state, mb * MB, **kw)  # type: ignore[arg-type]


def pick(model: str, *nodes: NodeView, pin: frozenset[str] = frozenset()) -> Choice:
    return choose(Request(model, pin=pin, now=100.0), nodes)


def test_ready_with_a_free_slot_wins_over_free_memory() -> None:
    a = node("a", 1000, {"m": 100})
    b = node("b", 1000, {"m": 100}, run("m"))
    assert pick("m", a, b) == Choice("b", "ready", need=100 * MB)


def test_busy_or_loading_runner_is_preferred_to_a_second_load() -> None:
    a = node("a", 1000, {"m": 100})
    b = node("b", 1000, {"m": 100}, run("m", "loading"))
    assert pick("m", a, b).node == "b"
    c = node("c", 1000, {"m": 100}, run("m", inflight=1))
    assert pick("m", a, c) == Choice("c", "queue", need=100 * MB)
    # two busy ones: the one with fewer requests per slot
    d = node("d", 1000, {"m": 100}, run("m", inflight=3, slots=4))
    assert pick("m", c, d).how == "ready"  # d still has a free slot
    e = node("e", 1000, {"m": 100}, run("m", inflight=2, slots=2))
    f = node("f", 1000, {"m": 100}, run("m", inflight=2, slots=1))
    assert pick("m", f, e).node == "e"


def test_best_fit_among_nodes_where_it_fits_without_evicting() -> None:
    a = node("a", 1000, {"m": 300})
    b = node("b", 500, {"m": 300})
    c = node("c", 200, {"m": 300})
    assert pick("m", a, b, c) == Choice("b", "fits", need=300 * MB)


def test_nodes_without_the_model_never_get_it() -> None:
    a = node("a", 10_000, {"x": 1})
    b = node("b", 500, {"m": 300}, run("y", mb=400))
    choice = pick("m", a, b)
    assert choice.node == "b" and choice.how == "evict" and choice.victims == ("y",)
    none = pick("zzz", a, b)
    assert none.node is None and "not found" in none.reason


def test_pinned_model_goes_only_to_its_nodes() -> None:
    a = node("a", 1000, {"m": 100})
    b = NodeView("b-id-123456789", "b", 1000 * MB, {"m": 100 * MB}, names=frozenset({"gpu"}))
    assert pick("m", a, b, pin=frozenset({"gpu"})).node == b.id
    assert pick("m", a, b, pin=frozenset({"b-id-1234"})).node == b.id  # an id prefix
    none = pick("m", a, pin=frozenset({"gpu"}))
    assert none.node is None and "pinned" in none.reason


def test_eviction_goes_where_the_policy_values_the_victims_least() -> None:
    hot = run("hot", mb=500, last_used=90.0, uses=9, load_cost=5.0, heat=5.0)
    cold = run("cold", mb=500, last_used=10.0, uses=1, load_cost=5.0, heat=0.2)
    a = node("a", 600, {"m": 400}, hot)
    b = node("b", 600, {"m": 400}, cold)
    for name in ("cost", "lru"):
        c = choose(Request("m", now=100.0), [a, b], POLICIES[name])
        assert (c.node, c.how, c.victims) == ("b", "evict", ("cold",)), name


def test_eviction_spares_runners_it_does_not_need_and_counts_bytes_on_their_way_out() -> None:
    small = run("small", mb=50, last_used=1.0)
    big = run("big", mb=500, last_used=2.0)
    a = node("a", 600, {"m": 450}, small, big)
    c = pick("m", a)
    assert c.victims == ("big",)  # small was first in LRU order but does not make room alone
    leaving = run("old", "unloading", mb=500)
    b = node("b", 600, {"m": 450}, leaving)
    assert pick("m", b) == Choice("b", "evict", victims=(), need=450 * MB)


def test_busy_everywhere_waits_on_the_least_busy_node_and_too_big_goes_to_the_largest() -> None:
    a = node("a", 600, {"m": 400}, run("x", mb=500, inflight=3))
    b = node("b", 600, {"m": 400}, run("y", mb=500, inflight=1))
    assert pick("m", a, b) == Choice("b", "wait", need=400 * MB)
    c = node("c", 100, {"m": 400})
    d = node("d", 300, {"m": 400})
    assert pick("m", c, d).how == "too-big" and pick("m", c, d).node == "d"


def test_pinned_runners_are_never_victims() -> None:
    a = node("a", 600, {"m": 400}, run("p", mb=500, pinned=True))
    b = node("b", 600, {"m": 400}, run("q", mb=500, last_used=99.0, heat=9.0))
    assert pick("m", a, b).node == "b"


# ---- properties ------------------------------------------------------------------------------
models_st = st.sampled_from(["m0", "m1", "m2", "m3"])
runner_st = st.builds(
    RunnerView,
    model=models_st,
    state=st.sampled_from(["loading", "ready", "ready", "unloading"]),
    bytes=st.integers(1, 800),
    inflight=st.integers(0, 2),
    slots=st.integers(1, 2),
    last_used=st.floats(0, 100),
    heat=st.floats(0, 10),
)


@st.composite
def cluster_st(draw: st.DrawFn) -> list[NodeView]:
    out = []
    for i in range(draw(st.integers(1, 5))):
        runners = draw(st.lists(runner_st, max_size=4, unique_by=lambda r: r.model))
        models = draw(st.dictionaries(models_st, st.integers(1, 900), max_size=4))
        out.append(NodeView(f"n{i}", f"n{i}", draw(st.integers(0, 1500)), models, tuple(runners)))
    return out


@settings(max_examples=300, deadline=None)
@given(cluster_st(), models_st, st.sampled_from(sorted(POLICIES)))
def test_choice_is_always_a_node_that_has_the_model_and_follows_the_order(
    nodes: list[NodeView], model: str, policy: str
) -> None:
    c = choose(Request(model, now=50.0), nodes, POLICIES[policy])
    has = [n for n in nodes if model in n.models]
    if not has:
        assert c.node is None and c.how == "none"
        return
    chosen = next(n for n in nodes if n.id == c.node)
    assert model in chosen.models
    need = chosen.models[model]
    warm = [n for n in has if n.runner(model) is not None]
    if c.how in ("ready", "queue"):
        assert chosen.runner(model) is not None
    else:  # a load: only when no node has the model warm
        assert not warm, c
    if c.how == "fits":
        assert need <= chosen.free
        left = chosen.free - need  # best fit: no node where it fits is left with less
        assert all(n.models[model] > n.free or n.free - n.models[model] >= left for n in has)
    if c.how == "evict":
        assert not [n for n in has if n.models[model] <= n.free]  # nothing fitted as it was
        freed = sum(r.bytes for r in chosen.runners if r.state == "unloading")
        by_model = {r.model: r for r in chosen.runners}
        assert all(by_model[v].idle for v in c.victims)
        freed += sum(by_model[v].bytes for v in c.victims)
        assert chosen.free + freed >= need
    if c.how == "too-big":
        assert all(n.models[model] > n.budget for n in has)


def test_error_tails_in_each_family_shape() -> None:
    msg = "node 'b' (10.0.0.2) left the cluster"
    nd = error_tail("/api/chat", "application/x-ndjson", msg, b'{"x":1}')
    assert nd == b'\n{"error":"node \'b\' (10.0.0.2) left the cluster"}\n'
    oa = error_tail("/v1/chat/completions", "text/event-stream", msg, b"data: {}\n\n")
    assert oa is not None and oa.startswith(b'data: {"error":{"message":"node')
    an = error_tail("/v1/messages", "text/event-stream; charset=utf-8", msg, b"data: {}\n")
    assert an is not None and an.startswith(b"\nevent: error\ndata: ")
    rs = error_tail("/v1/responses", "text/event-stream", msg, b"")
    assert rs is not None and b"response.failed" in rs and b'"status":"failed"' in rs
    assert error_tail("/api/show", "application/json", msg, b"{") is None


@pytest.mark.e2e
def test_single_node_corral_does_not_import_ray() -> None:
    import subprocess
    import sys

    code = (
        "import sys, corral.server, corral.cli, corral.cluster.placement\n"
        "assert 'ray' not in sys.modules, 'ray imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
