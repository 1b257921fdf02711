"""The benchmark harness (corral.bench): its pure parts exactly, and a smoke run of every
section (tiny sizes: it must run and report, its figures are not checked)."""

from __future__ import annotations

import itertools
import json
import math
import random
from collections import Counter
from pathlib import Path

import pytest

from corral.bench.common import Goal, Section, Table, goal_max, goal_min, percentile, summary
from corral.bench.report import TITLES, existing_blocks, render
from corral.bench.trace import EMBED, generate_trace, simulate

# --------------------------------------------------------------------------- traces


def test_generate_trace_is_reproducible() -> None:
    models = ["a", "b", "c", "d"]
    one = generate_trace(7, 300, models, embed_model="e")
    assert one == generate_trace(7, 300, models, embed_model="e")
    assert one != generate_trace(8, 300, models, embed_model="e")


def test_generate_trace_shape() -> None:
    models = [f"m{i}" for i in range(6)]
    trace = generate_trace(1, 2000, models, embed_model="emb", long_session_model="m3")
    assert len(trace) == 2000
    assert trace[0].t == 0.0
    assert all(a.t <= b.t for a, b in itertools.pairwise(trace))
    assert {e.model for e in trace} <= {*models, "emb"}
    kinds = Counter(e.kind for e in trace)
    assert 0.2 < kinds[EMBED] / len(trace) < 0.4  # embed_share 0.3
    long = [e for e in trace if e.session == 0]
    assert long and {e.model for e in long} == {"m3"}
    assert long[-1].t > 0.8 * trace[-1].t  # the long session spans the trace
    # Zipf popularity: the chat load is skewed, not uniform.
    counts = Counter(e.model for e in trace if e.kind != EMBED and e.session != 0)
    assert max(counts.values()) > 3 * min(counts.values())


def test_generate_trace_edges() -> None:
    assert generate_trace(0, 0, ["a"]) == []
    trace = generate_trace(0, 50, ["a"])
    assert len(trace) == 50 and {e.model for e in trace} == {"a"}
    with pytest.raises(ValueError):
        generate_trace(0, 10, [])
    with pytest.raises(ValueError):
        generate_trace(0, 10, ["a"], embed_model="e", embed_share=0.9, long_share=0.5)


# --------------------------------------------------------------------------- offline simulation


def _reference(seq: list[str], slots: int, victim: str) -> int:
    """Loads of a plain `slots`-entry cache, evicting by LRU or by farthest next use."""
    cache: dict[str, int] = {}  # model -> last use
    loads = 0
    for i, m in enumerate(seq):
        if m not in cache:
            loads += 1
            if len(cache) >= slots:

                def next_use(x: str, i: int = i) -> float:
                    return next((j for j in range(i + 1, len(seq)) if seq[j] == x), math.inf)

                if victim == "lru":
                    out = min(cache, key=lambda x: cache[x])
                else:
                    out = max(cache, key=next_use)
                del cache[out]
        cache[m] = i
    return loads


def _random_traces(n: int, seed: int = 0) -> list[tuple[list[str], int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        k = rng.randint(2, 6)
        models = [f"m{i}" for i in range(k)]
        seq = [rng.choice(models) for _ in range(rng.randint(1, 40))]
        out.append((seq, rng.randint(1, k)))
    return out


def test_simulation_matches_reference_caches_with_equal_sizes() -> None:
    # Driving corral's scheduler core one request at a time is a plain cache for equal sizes:
    # the same loads as a textbook LRU cache and as Belady's optimal algorithm.
    for seq, slots in _random_traces(300):
        sizes = dict.fromkeys(set(seq), 100)
        assert simulate(seq, sizes, 100 * slots, "lru").loads == _reference(seq, slots, "lru")
        assert simulate(seq, sizes, 100 * slots, "belady").loads == _reference(seq, slots, "opt")


def test_belady_never_loads_more_than_online_policies_with_equal_sizes() -> None:
    for seq, slots in _random_traces(300, seed=1):
        sizes = dict.fromkeys(set(seq), 10)
        best = simulate(seq, sizes, 10 * slots, "belady").loads
        for policy in ("lru", "ollama", "cost"):
            assert best <= simulate(seq, sizes, 10 * slots, policy).loads


def test_simulation_counts() -> None:
    seq = ["a", "b", "a", "c", "b", "a"]
    sizes = {"a": 10, "b": 20, "c": 30}
    roomy = simulate(seq, sizes, 60, "lru")
    assert (roomy.loads, roomy.evictions, roomy.bytes_loaded) == (3, 0, 60)
    tight = simulate(seq, sizes, 30, "belady", loaded_sizes={"a": 9, "b": 19, "c": 29})
    # a b | a | c (evict both) | b | a: 5 loads of the real sizes.
    assert tight.loads == 5 and tight.evictions == 3
    assert tight.bytes_loaded == 9 + 19 + 29 + 19 + 9
    with pytest.raises(ValueError):
        simulate(["c"], sizes, 20, "lru")  # can never fit


# --------------------------------------------------------------------------- statistics, docs


def test_percentile_and_summary() -> None:
    xs = [float(x) for x in range(1, 101)]
    assert percentile(xs, 50) == pytest.approx(50.5)
    assert percentile(xs, 99) == pytest.approx(99.01)
    assert percentile([3.0], 99) == 3.0
    assert math.isnan(percentile([], 50))
    s = summary([2.0, 1.0, 3.0])
    assert (s["n"], s["p50"], s["min"], s["max"]) == (3, 2.0, 1.0, 3.0)


def test_goals_say_by_how_much_they_are_missed() -> None:
    ok = goal_max("added < 1 ms", 0.5e-3, 1e-3, lambda x: f"{x * 1e3:.1f} ms")
    bad = goal_max("added < 1 ms", 1.5e-3, 1e-3, lambda x: f"{x * 1e3:.1f} ms")
    assert ok.met and bad.met is False and bad.detail == "missed by 0.5 ms"
    low = goal_min(">= 98%", 90.0, 98.0, lambda x: f"{x:.0f}%")
    assert low.met is False and low.detail == "missed by 8%"
    assert goal_min(">= 98%", math.nan, 98.0, str).verdict() == "not measured"


def test_docs_keep_the_sections_a_run_did_not_measure() -> None:
    host = {
        "date": "2026-01-01 00:00 UTC", "cpu": "cpu", "usable_cores": 2, "logical_cores": 2,
        "physical_cores": 1, "ram_bytes": 2**30, "os": "os", "python": "3", "xllamacpp": "x",
        "corral": "c", "load_average_at_start": [0.0, 0.0, 0.0],
    }  # fmt: skip
    proxy = Section("proxy", "Proxy overhead", tables=[Table("T", ["a"], [["1"]])])
    proxy.goals.append(Goal("added < 1 ms", "0.2 ms", True))
    cold = Section("cold", "Cold start", notes=["first"])
    first = render([proxy, cold], host, "quick", "corral bench all")
    assert "**met** (0.2 ms)" in first and "Not measured yet" in first  # swap, estimates
    cold2 = Section("cold", "Cold start", notes=["second"])
    cold2.goals.append(Goal("ttft within 15%", "+20%", False, "missed by 5 points"))
    second = render([cold2], host, "quick", "corral bench cold", first)
    blocks = existing_blocks(second)
    assert "| 1 |" in blocks[("results", "proxy")]  # kept from the first run
    assert "second" in blocks[("results", "cold")] and "first" not in blocks[("results", "cold")]
    assert "**MISSED**, +20%, missed by 5 points" in blocks[("goals", "cold")]
    assert render([cold2], host, "quick", "corral bench cold", second) == second


# --------------------------------------------------------------------------- concurrency, agent


def test_concurrency_figures_are_medians_of_each_rounds_own() -> None:
    from corral.bench.concurrency import Burst, over_rounds

    b = Burst(clients=2, wall=2.0, tokens=256, latencies=[1.0, 2.0, 1.5], ttfts=[0.1, 0.3, 0.2])
    assert b.figures() == {"tok_s": 128.0, "p50": 1.5, "max": 2.0, "ttft_p50": 0.2}
    rounds = [
        {"tok_s": 100.0, "max": 9.0},
        {"tok_s": 130.0, "max": 1.0},
        {"tok_s": 120.0, "max": 2.0},
    ]
    assert over_rounds(rounds) == {"tok_s": 120.0, "max": 2.0}
    assert over_rounds([]) == {}
    empty = Burst(clients=1, wall=0.0, tokens=0).figures()
    assert all(math.isnan(v) for v in empty.values())


def test_concurrency_table_and_goal_give_corral_over_llama_server() -> None:
    from corral.bench.concurrency import CORRAL_LS, CORRAL_WHEEL, level_table, throughput_goal

    def f(tok_s: float) -> dict[str, float]:
        return {"tok_s": tok_s, "p50": 0.5, "max": 1.25, "ttft_p50": 0.05}

    figures = {
        "corral": {1: f(131.0), 4: f(150.0)},
        "llama-server": {1: f(131.0), 4: f(120.0)},
    }
    table = level_table("SmolLM2", [1, 4], figures)
    assert table.headers[:4] == ["clients", "llama-server tok/s", "corral tok/s",
                                 "corral/llama-server"]  # fmt: skip
    assert table.rows[0][:4] == ["1", "131", "131", "1.000x"]
    assert table.rows[1][:4] == ["4", "120", "150", "1.250x"]
    assert table.rows[1][4:] == ["500 ms / 500 ms", "1250 ms / 1250 ms", "50 ms / 50 ms"]
    assert throughput_goal("SmolLM2", [1, 4], figures).met is True
    figures["corral"][1] = f(104.8)
    miss = throughput_goal("SmolLM2", [1, 4], figures)
    assert miss.met is False and miss.detail == "1 clients 20% short"
    assert miss.measured == "0.800x at 1 / 1.250x at 4"
    # Without llama-server: corral's figures alone, the ratio and the goal not measured.
    alone = {"corral": figures["corral"]}
    assert level_table("SmolLM2", [1, 4], alone).rows[0][1:4] == ["n/a", "105", "n/a"]
    assert throughput_goal("SmolLM2", [1, 4], alone).met is None
    # With corral on llama-server's own binary beside them: its rate and ratio, the goal still
    # corral's defaults against llama-server.
    three = {**figures, CORRAL_LS: {1: f(128.0), 4: f(96.0)}}
    table = level_table("SmolLM2", [1, 4], three)
    assert table.headers[4:6] == ["corral, llama-server runner tok/s", "its /llama-server"]
    assert table.rows[1][1:6] == ["120", "150", "1.250x", "96", "0.800x"]
    assert throughput_goal("SmolLM2", [1, 4], three).measured == miss.measured
    # With corral's defaults on a CPU build, the wheel is the third side.
    wheel = {**figures, CORRAL_WHEEL: {1: f(90.0), 4: f(60.0)}}
    table = level_table("SmolLM2", [1, 4], wheel)
    assert table.headers[4:6] == ["corral, wheel runner tok/s", "its /llama-server"]
    assert table.rows[1][1:6] == ["120", "150", "1.250x", "60", "0.500x"]
    # The paired ratio (same round's sides), where the rounds gave it: the goal goes by it.
    three["corral"][4]["paired"] = 0.95
    assert level_table("SmolLM2", [1, 4], three).rows[1][3] == "1.250x (paired 0.950x)"
    paired = throughput_goal("SmolLM2", [1, 4], three)
    assert paired.measured == "0.800x at 1 / 0.950x at 4" and paired.met is False
    assert paired.detail == "1 clients 20% short, 4 clients 5% short"


def test_concurrency_pairs_each_round_with_llama_server_s_same_round() -> None:
    from corral.bench.concurrency import Burst, paired

    def rounds(*rates: float) -> list[dict[int, Burst]]:
        return [{4: Burst(clients=4, wall=1.0, tokens=int(r))} for r in rates]

    # A machine that drifts: medians' ratio 100/100, each round's own 0.8x.
    bursts = {"llama-server": rounds(125, 100, 150), "corral": rounds(100, 80, 120)}
    assert paired(bursts, "corral", 4) == pytest.approx(0.8)
    assert math.isnan(paired(bursts, "corral", 16))
    assert math.isnan(paired({"corral": rounds(1)}, "corral", 4))


def test_concurrency_names_the_cpu_features_a_build_uses() -> None:
    from corral.bench.concurrency import built_for

    log = (
        "main: system_info: n_threads = 2 (n_threads_batch = 2) / 2 | CPU : SSE3 = 1 | "
        "AVX2 = 1 | AVX512 = 0 | AMX_INT8 = 1 | REPACK = 1 | \nsrv  init: ready\n"
    )
    assert built_for(log) == "SSE3, AVX2, AMX_INT8, REPACK"
    assert built_for("no such line") == "unknown"


def test_agent_reads_usage_and_text_from_the_stream() -> None:
    from corral.bench.agent import streamed_turn

    events = [
        ("message_start", {"type": "message_start", "message": {"usage": {"input_tokens": 9}}}),
        ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                 "delta": {"type": "text_delta", "text": "Hel"}}),
        ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                 "delta": {"type": "text_delta", "text": "lo"}}),
        ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "max_tokens"},
                           "usage": {"input_tokens": 3, "cache_read_input_tokens": 40,
                                     "output_tokens": 2}}),
        ("message_stop", {"type": "message_stop"}),
    ]  # fmt: skip
    raw = b"".join(f"event: {k}\ndata: {json.dumps(v)}\n\n".encode() for k, v in events)
    usage, text = streamed_turn(raw)
    assert text == "Hello" and usage["input_tokens"] == 3
    assert usage["cache_read_input_tokens"] == 40
    error = b'event: error\ndata: {"type": "error", "error": {"message": "boom"}}\n\n'
    with pytest.raises(RuntimeError, match="boom"):
        streamed_turn(error)


def test_agent_cases_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    from corral.bench.agent import CASES, chosen_cases

    monkeypatch.delenv("CORRAL_BENCH_AGENT", raising=False)
    assert chosen_cases() == list(CASES)
    monkeypatch.setenv("CORRAL_BENCH_AGENT", "side, 12k")
    assert [c.key for c in chosen_cases()] == ["12k", "side"]
    monkeypatch.setenv("CORRAL_BENCH_AGENT", "12k,nope")
    with pytest.raises(ValueError, match="nope"):
        chosen_cases()


def test_agent_turn_figures() -> None:
    from corral.bench.agent import case_summary, turn_table

    def row(turn: int, prompt: int, evaluated: int, new: int, ttft: float) -> dict[str, float]:
        return {"turn": turn, "prompt": prompt, "evaluated": evaluated,
                "reused": prompt - evaluated, "new": new, "ttft": ttft}  # fmt: skip

    rows = [
        row(1, 1000, 1000, 1000, 4.0), row(1, 1002, 1002, 1002, 6.0),
        row(2, 1030, 30, 30, 0.25), row(2, 1032, 1032, 30, 5.0),  # the second missed its cache
        row(3, 1060, 30, 30, 0.5), row(3, 1062, 30, 30, 0.75),
    ]  # fmt: skip
    table = turn_table({"case": rows}, 3)
    assert [r[0] for r in table.rows] == ["1", "2", "3"]
    assert table.rows[0][1] == "1001 / 1001 / 0 / 5.00 s"
    line, share = case_summary("case", rows, 3)
    assert share == 0.75
    assert line.startswith("case: 3 of 4 turns after the first evaluated only their new tokens")
    assert "evaluated 1,122 of 4,184 prompt tokens (26.8%)" in line
    assert "turn 1 5.00 s, turns 2-3 median 0.62 s, max 5.00 s" in line


# --------------------------------------------------------------------------- smoke run


@pytest.mark.e2e
def test_smoke_run_of_every_section(tmp_path: Path) -> None:
    from corral.bench import main

    out, docs = tmp_path / "bench.json", tmp_path / "benchmarks.md"
    argv = ["all", "--smoke", "--json", str(out), "--write-docs", "--docs", str(docs)]
    assert main(["--workdir", str(tmp_path / "work"), *argv]) == 0
    data = json.loads(out.read_text())
    assert data["machine"]["cpu"] and data["machine"]["xllamacpp"]
    sections = data["sections"]
    assert list(sections) == ["proxy", "cold", "swap", "estimates"]
    for name in ("proxy", "cold", "swap"):
        assert sections[name]["error"] is None
        assert sections[name]["tables"] and all(t["rows"] for t in sections[name]["tables"])
    assert sections["proxy"]["goals"] and sections["cold"]["goals"]
    titles = [t["title"] for t in sections["proxy"]["tables"]]
    assert any(t.startswith("Two runners computing at once") for t in titles), titles
    est = sections["estimates"]
    assert est["error"] is None and (est["blocks"] or "skipped" in " ".join(est["notes"]))
    text = docs.read_text()
    for heading in ("## Goals vs measured", "## 1. Proxy overhead", "## 4. Estimate accuracy"):
        assert heading in text
    assert "Not measured yet" not in text
    # The JSON holds everything the docs show: rendering from it gives the same page.
    again = tmp_path / "again.md"
    assert main(["all", "--from-json", str(out), "--docs", str(again)]) == 0
    assert again.read_text() == text


@pytest.mark.e2e
def test_smoke_run_of_the_embed_section(tmp_path: Path) -> None:
    """`corral bench embed` (run only when named): corral's two routes, beside llama-server
    where one is built, and its block in the docs."""
    from corral.bench import main

    out, docs = tmp_path / "bench.json", tmp_path / "benchmarks.md"
    argv = ["embed", "--smoke", "--json", str(out), "--write-docs", "--docs", str(docs)]
    assert main(["--workdir", str(tmp_path / "work"), *argv]) == 0
    sec = json.loads(out.read_text())["sections"]["embed"]
    assert sec["error"] is None
    (table,) = sec["tables"]
    variants = [row[0] for row in table["rows"]]
    assert variants[:2] == ["corral /api/embed", "corral /v1/embeddings"]
    if "no llama-server" not in " ".join(sec["notes"]):  # beside it, and as corral's runner
        assert variants[2:] == ["corral /v1/embeddings, llama-server as its runner",
                                "llama-server /v1/embeddings"]  # fmt: skip
    else:
        assert len(variants) == 2
    text = docs.read_text()
    assert f"## {TITLES['embed']}" in text and "<!-- bench:results:embed -->" in text


# --------------------------------------------------------------------------- speculative


def test_speculative_tables_pair_each_round_and_compare_the_answers() -> None:
    from corral.bench.speculative import CASES, EDITED, Run, tables

    def side(rate: float, drafted: int, answer: str, chose: str = "") -> dict[str, Run]:
        why = "no gain measured" if chose == "off" else None
        return {c.key: Run(1.0, int(rate), drafted, drafted // 2, [answer] * c.clients,
                           speculative=chose, drafting=why)
                for c in CASES}  # fmt: skip

    runs = {
        "corral": [side(160, 100, "a", "off"), side(150, 90, EDITED, "ngram-mod")],
        "corral, speculative off": [side(100, 0, "a"), side(100, 0, EDITED)],
        "llama-server": [side(100, 0, "b"), side(75, 0, "b")],
    }
    sec = Section("speculative", "t")
    tables(sec, "SmolLM2-135M", runs, smoke=False)
    cases = sec.data["models"]["SmolLM2-135M"]["cases"]
    assert cases["edit@1"]["vs_llama_server"] == (1.6 + 2.0) / 2  # each round's own ratio
    assert cases["edit@1"]["vs_off"] == (1.6 + 1.5) / 2
    assert cases["edit@1"]["drafted"] == 190 and cases["edit@1"]["same_answer"] is True
    # what auto chose: every round's in the data, the last round's in the table
    assert cases["story@1"]["speculative"] == ["off", "ngram-mod"]
    assert cases["story@1"]["drafting"] == ["no gain measured", None]
    assert [g.met for g in sec.goals] == [True, True, True, True]
    assert all(g.goal.startswith("SmolLM2-135M, ") for g in sec.goals)
    (t,) = sec.tables
    assert len(t.rows) == len(CASES)
    col = {h: [row[i] for row in t.rows] for i, h in enumerate(t.headers)}
    assert col["case"] == ["edit", "search/replace", "story", "edit", "edit"]
    assert col["clients"] == ["1", "1", "1", "4", "8"]
    assert col["up to"] == ["2048", "2048", "300", "300", "300"]
    assert col["auto chose"] == ["ngram-mod"] * len(CASES)
    assert col["same answer"] == ["yes"] * len(CASES)
    # the last round's answers checked where the whole change was asked for
    assert col["usable answer"] == ["yes", "no", "-", "-", "-"]
    assert cases["edit@1"]["usable"]["llama-server"] == [False]
    # no side did the search/replace: a note says so
    assert any("search/replace@1" in n for n in sec.notes)

    first = {s: r[:1] for s, r in runs.items()}
    sec = Section("speculative", "t")
    tables(sec, "SmolLM2-135M", first, smoke=True)
    (t,) = sec.tables
    assert t.rows[0][t.headers.index("auto chose")] == "off: no gain measured"
    assert "up to 16 tokens" in t.title and not sec.notes  # smoke: nothing checked
