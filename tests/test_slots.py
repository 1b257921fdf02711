"""Automatic parallel slots (CORRAL_NUM_PARALLEL auto): the setting, the runner spec and its
unified KV cache, the estimate that follows it, and the core's choice of a slot count (the most
of 4..1 that fits the budget without stopping a busy runner)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import json
import os
import re
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from corral.config import ConfigError, Settings
from corral.core.books import Core
from corral.core.estimate import N_UBATCH, SWA_PAD, estimate, llama_params, process_bytes
from corral.core.gguf import ModelInfo, read_model_info
from corral.core.requests import Fail, Grant, Load, Request, Sizing, Stop
from corral.core.spec import (
    AUTO_PARALLEL,
    EMBED_PARALLEL,
    LAST_POOLING,
    Adapter,
    RunnerSpec,
    runner_spec,
    slot_choices,
    slot_counts,
)
from corral.runtime.slotfile import read_tokens
from corral.testing import synth

# ---- the setting and the spec ----------------------------------------------------------------


def test_num_parallel_defaults_to_auto_and_a_number_fixes_it() -> None:
    assert Settings.load(environ={}).num_parallel == 0  # auto
    assert Settings.load(environ={"CORRAL_NUM_PARALLEL": "auto"}).num_parallel == 0
    assert Settings.load(environ={"CORRAL_NUM_PARALLEL": " AUTO "}).num_parallel == 0
    assert Settings.load(environ={"CORRAL_NUM_PARALLEL": "3"}).num_parallel == 3
    for bad in ("0", "x", "-1"):
        with pytest.raises(ConfigError, match="CORRAL_NUM_PARALLEL"):
            Settings.load(environ={"CORRAL_NUM_PARALLEL": bad})


@dataclass
class Model:
    path: Path
    options: dict[str, Any] = field(default_factory=dict)
    projector: Path | None = None
    adapters: tuple[Adapter, ...] = ()
    template: str | None = None
    draft: Path | None = None


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, ModelInfo]:
    d = tmp_path_factory.mktemp("slot-models")
    paths = {
        "llama": synth.write_llama_model(d / "llama.gguf"),
        "swa8": synth.write_swa_model(d / "swa8.gguf", n_layer=8),
        "bert": synth.write_bert_model(d / "bert.gguf"),
    }
    return {k: read_model_info(p) for k, p in paths.items()}


def spec_for(info: ModelInfo, env: dict[str, str], **own: Any) -> RunnerSpec:
    model = Model(Path(info.path), dict(own))
    return runner_spec(model, info, {}, Settings.load(environ=env), 4)[0]


@pytest.mark.parametrize(
    ("name", "most", "counts"),
    [("llama", AUTO_PARALLEL, [4, 3, 2, 1]), ("bert", EMBED_PARALLEL, [16, 8, 4, 3, 2, 1])],
)
def test_auto_gives_up_to_4_slots_on_one_cache_and_a_number_keeps_a_cache_per_slot(
    models: dict[str, ModelInfo], name: str, most: int, counts: list[int]
) -> None:
    """Embedding models get more: llama.cpp batches the inputs of all their slots at once, and
    a slot costs them an output row."""
    info = models[name]
    auto = spec_for(info, {})
    assert (auto.num_parallel, auto.kv_unified) == (most, True)
    assert [s.num_parallel for s in slot_choices(auto)] == counts
    assert all(s.kv_unified and s.n_ctx == auto.n_ctx for s in slot_choices(auto))
    fixed = spec_for(info, {"CORRAL_NUM_PARALLEL": "2"})
    assert (fixed.num_parallel, fixed.kv_unified) == (2, False)
    assert slot_choices(fixed) == (fixed,)
    own = spec_for(info, {}, num_parallel=3)  # models.toml fixes it too
    assert (own.num_parallel, own.kv_unified) == (3, False)
    assert slot_choices(own) == (own,)


@given(st.integers(1, 300))
def test_slot_counts_run_from_the_most_down_to_one_every_count_up_to_4(most: int) -> None:
    counts = slot_counts(most)
    assert counts[0] == most and counts[-1] == 1
    assert all(a > b for a, b in itertools.pairwise(counts))  # best first, no repeat
    assert set(range(1, min(most, AUTO_PARALLEL) + 1)) <= set(counts)
    # above 4 each step halves (to no fewer than 4): few choices for a big count
    assert all(
        b == max(a // 2, AUTO_PARALLEL) for a, b in itertools.pairwise(counts) if a > AUTO_PARALLEL
    )
    assert len(counts) <= AUTO_PARALLEL + most.bit_length()


def test_an_embedding_slot_books_no_sampler(models: dict[str, ModelInfo]) -> None:
    """A generating model's slot books a sampler over its vocabulary; an embedding model's slot
    gets none (llama.cpp makes one only for a task that samples): what it books does not grow
    with the vocabulary."""
    bert, llama = models["bert"], models["llama"]

    def per_slot(info: ModelInfo) -> int:
        return process_bytes(info, 2) - process_bytes(info, 1)

    def big(info: ModelInfo) -> ModelInfo:
        return dataclasses.replace(info, n_vocab=152_064)  # Qwen's

    assert per_slot(big(llama)) > per_slot(llama) > 0
    assert per_slot(big(bert)) == per_slot(bert) > 0
    assert process_bytes(big(bert), EMBED_PARALLEL) < process_bytes(big(llama), AUTO_PARALLEL)


def test_a_chat_models_embedding_runner_is_a_second_shape_of_its_file(
    models: dict[str, ModelInfo],
) -> None:
    """Embeddings from a generative model come from a runner of its file in embedding mode:
    the last token's hidden state (llama.cpp's /v1/embeddings refuses no pooling), an embedding
    model's slots, no drafter, no projector; it books no sampler, and its graph the logits of
    every token of the micro-batch (llama.cpp makes each an output)."""
    info = models["llama"]
    model = Model(Path(info.path), {"speculative": "ngram-mod"}, projector=Path("/p.gguf"))
    settings = Settings.load(environ={})
    chat, _ = runner_spec(model, info, {}, settings, 4)
    embed, _ = runner_spec(model, info, {}, settings, 4, embedder=True)
    assert not chat.embedding and chat.pooling_type is None and chat.projector == "/p.gguf"
    assert embed.embedding and embed.pooling_type == LAST_POOLING
    assert embed.num_parallel == EMBED_PARALLEL and embed.kv_unified
    assert embed.speculative == "off" and embed.projector is None
    assert embed.path == chat.path and embed.n_ctx == chat.n_ctx
    # an embedding model's runner is the same whichever way it is asked
    bert = models["bert"]
    assert runner_spec(Model(Path(bert.path)), bert, {}, settings, 4, embedder=True) == (
        runner_spec(Model(Path(bert.path)), bert, {}, settings, 4)
    )
    gen = estimate(info, 2048, 16, unified=True)
    emb = estimate(info, 2048, 16, unified=True, embedding=True)
    rows = llama_params(info, 2048, 16, unified=True).n_ubatch
    assert emb.compute == gen.compute + rows * info.n_vocab * 4
    assert emb.overhead == gen.overhead + rows * (info.n_vocab + info.n_embd) * 4 - (
        16 * info.n_vocab * 4
    )
    assert emb.process == process_bytes(info, 16, embedding=True) != gen.process
    assert estimate(bert, 512, 4).total == estimate(bert, 512, 4, embedding=True).total


# ---- the estimate of a unified cache ---------------------------------------------------------


def test_a_unified_cache_holds_the_context_once_whatever_the_slots(
    models: dict[str, ModelInfo],
) -> None:
    info = models["llama"]
    p = llama_params(info, 2000, 4, unified=True)
    # llama_context: n_ctx padded, one stream, each slot may use every cell
    assert (p.n_ctx, p.n_seq, p.n_ctx_seq, p.n_outputs) == (2048, 1, 2048, 4)
    one, four = estimate(info, 2048, 1), estimate(info, 2048, 4, unified=True)
    separate = estimate(info, 2048, 4)
    assert sum(four.kv_per_layer) == sum(one.kv_per_layer) == sum(separate.kv_per_layer) // 4
    assert four.compute == one.compute  # the graph is reserved for one stream
    assert four.overhead > one.overhead  # one output row per slot
    assert four.process > one.process  # and each slot's sampler
    assert one.total < four.total < separate.total
    # more slots always cost more, so fewer fit where memory is short
    totals = [estimate(info, 2048, n, unified=True).total for n in (1, 2, 3, 4)]
    assert totals == sorted(set(totals))


def test_a_unified_sliding_window_cache_holds_every_slots_window(
    models: dict[str, ModelInfo],
) -> None:
    info = models["swa8"]
    n_swa = info.sliding_window
    assert n_swa
    p = llama_params(info, 8192, 4, unified=True)
    # llama_kv_cache_iswa: min(size, n_swa * n_seq_max + n_ubatch), padded to 256
    want = -(-min(8192, 4 * n_swa + N_UBATCH) // SWA_PAD) * SWA_PAD
    assert (p.n_ctx_seq, p.n_ctx_swa) == (8192, want)
    assert llama_params(info, 8192, 1, unified=True) == llama_params(info, 8192, 1)


# ---- the core's choice of a slot count -------------------------------------------------------


def auto_request(rid: int, model: str, sizes: dict[int, int], now: float = 0.0) -> Request:
    """A request for a model with an automatic slot count: `sizes[n]` is the runner's bytes
    with n slots."""
    order = sorted(sizes, reverse=True)
    z = [
        Sizing(RunnerSpec(f"/m/{model}.gguf", 1024, n, kv_unified=True), sizes[n]) for n in order
    ]
    return Request(
        id=rid, model=model, spec=z[0].spec, explicit=frozenset(), size=z[0].size,
        keep_alive=None, arrived=now, deadline=now + 60,
    ).offering(z[1:])  # fmt: skip


def plain_request(rid: int, model: str, size: int) -> Request:
    return Request(
        id=rid, model=model, spec=RunnerSpec(f"/m/{model}.gguf", 1024, 1), explicit=frozenset(),
        size=size, keep_alive=None, arrived=0.0, deadline=60.0,
    )  # fmt: skip


def drain(core: Core) -> list[Any]:
    actions = core.drain()
    for d, n in core.used().items():
        assert n <= core.budgets[d], "over-committed"
    return actions


def loaded_runner(core: Core, rid: int, model: str, size: int, busy: bool) -> int:
    """A runner of another model, ready, serving one request (busy) or idle."""
    core.request(plain_request(rid, model, size), 0.0)
    (load,) = [a for a in drain(core) if isinstance(a, Load)]
    core.loaded(load.runner, 0.0)
    assert any(isinstance(a, Grant) for a in drain(core))
    if not busy:
        core.release(rid, 0.0)
        drain(core)
    return load.runner


def chosen_slots(budget: int, base: int, per_slot: int, busy: int, idle: int) -> int | None:
    """The slots the core loads for an automatic request, with a busy and an idle runner of
    other models holding memory; None if it loads nothing (waits or fails). Checks on the way
    that the books are never over-committed and that a busy runner is never stopped."""
    core = Core(budgets={"cpu": budget})
    busy_id = loaded_runner(core, 1, "busy", busy, True) if busy else None
    idle_id = loaded_runner(core, 2, "idle", idle, False) if idle else None
    sizes = {n: base + per_slot * n for n in range(1, AUTO_PARALLEL + 1)}
    core.request(auto_request(3, "m", sizes), 0.0)
    actions = drain(core)
    assert not any(isinstance(a, Stop) and a.runner == busy_id for a in actions)
    if any(isinstance(a, Stop) and a.runner == idle_id for a in actions):
        assert idle_id is not None
        core.exited(idle_id, 0.0)  # the evicted runner's memory is back
        actions = drain(core)
    loads = [a for a in actions if isinstance(a, Load)]
    if not loads:
        fails = [a for a in actions if isinstance(a, Fail)]
        assert not fails or (fails[0].status == 507 and sizes[1] > budget)
        return None
    (load,) = loads
    n = load.spec.num_parallel
    assert load.spec.kv_unified and load.fit.size == sizes[n]
    core.loaded(load.runner, 0.0)
    grants = [a for a in drain(core) if isinstance(a, Grant)]
    assert [g.request for g in grants] == [3]  # the runner with fewer slots serves it
    return n


def expected_slots(budget: int, base: int, per_slot: int, busy: int, idle: int) -> int | None:
    def most(room: int) -> int | None:
        fit = [n for n in range(1, AUTO_PARALLEL + 1) if base + per_slot * n <= room]
        return max(fit) if fit else None

    free = budget - busy - idle
    # without stopping anyone, then stopping the idle runner; never the busy one
    return most(free) or (most(free + idle) if idle else None)


@settings(max_examples=500, deadline=None)
@given(
    budget=st.integers(100, 4000),
    base=st.integers(1, 3000),
    per_slot=st.integers(1, 600),
    busy=st.integers(0, 2000),
    idle=st.integers(0, 2000),
)
def test_the_slot_count_is_the_most_that_fits_and_never_over_commits(
    budget: int, base: int, per_slot: int, busy: int, idle: int
) -> None:
    if busy + idle > budget:  # the other runners must have fitted first
        idle = max(0, budget - busy)
        if busy > budget:
            busy = 0
    got = chosen_slots(budget, base, per_slot, busy, idle)
    assert got == expected_slots(budget, base, per_slot, busy, idle)


@settings(max_examples=300, deadline=None)
@given(
    budgets=st.lists(st.integers(100, 4000), min_size=2, max_size=6),
    base=st.integers(1, 2000),
    per_slot=st.integers(1, 600),
    busy=st.integers(0, 1000),
)
def test_the_slot_count_falls_as_memory_shrinks(
    budgets: list[int], base: int, per_slot: int, busy: int
) -> None:
    counts = []
    held = min(busy, *budgets)  # the same busy runner at every budget
    for budget in sorted(budgets, reverse=True):
        counts.append(chosen_slots(budget, base, per_slot, held, 0) or 0)
    assert counts == sorted(counts, reverse=True)


def test_a_runner_loaded_with_fewer_slots_serves_as_many_at_once_and_queues_the_rest() -> None:
    core = Core(budgets={"cpu": 1000})
    sizes = {1: 700, 2: 800, 3: 1100, 4: 1200}
    core.request(auto_request(1, "m", sizes), 0.0)
    (load,) = [a for a in drain(core) if isinstance(a, Load)]
    assert load.spec.num_parallel == 2
    core.loaded(load.runner, 0.0)
    drain(core)
    for rid in (2, 3):
        core.request(auto_request(rid, "m", sizes), 0.0)
    grants = [a.request for a in drain(core) if isinstance(a, Grant)]
    assert grants == [2]  # 1 and 2 in its two slots; 3 waits for one, with no reload
    assert [q.id for q in core.queue] == [3] and core.loads == 1
    core.release(1, 1.0)
    assert [a.request for a in drain(core) if isinstance(a, Grant)] == [3]


def test_fewer_slots_are_taken_before_an_idle_model_is_evicted() -> None:
    core = Core(budgets={"cpu": 1000})
    loaded_runner(core, 1, "other", 400, busy=False)
    core.request(auto_request(2, "m", {1: 500, 2: 550, 3: 650, 4: 700}), 0.0)
    actions = drain(core)
    assert not any(isinstance(a, Stop) for a in actions)  # the other model stays
    (load,) = [a for a in actions if isinstance(a, Load)]
    assert load.spec.num_parallel == 2


def test_corral_ps_shows_slots_in_use_of_slots() -> None:
    from corral.cli.models import slots_text

    assert slots_text({"num_parallel": 4, "requests_in_flight": 2}) == "2/4"
    assert slots_text({"name": "from-ollama"}) == "-"


# ---- a real server with no settings ----------------------------------------------------------


@pytest.fixture(scope="module")
def auto_server(start_server: Any, models_dir: Path) -> Any:
    # Idle slots parked by the next request however soon it comes, as the parking tests read
    # (test_kvcache holds the wait for CORRAL_KV_PARK_AFTER).
    return start_server(models_dir, CORRAL_NUM_PARALLEL="auto", CORRAL_CONTEXT_LENGTH="16384",
                        CORRAL_KV_PARK_AFTER="0")  # fmt: skip


def plain(s: Any, *bases: str) -> None:
    """`<base>-plain`: the model without drafting. llama.cpp b11434 fails a drafting slot whose
    batch it halves for room (#24840) without freeing its cells, so a stream continued beside
    it may fail again (corral reports the full cache it is: a 503; docs/architecture.md)."""
    for base in bases:
        r = s.client.post("/api/create", json={"model": f"{base}-plain", "from": base,
                                               "parameters": {"speculative": "off"}})  # fmt: skip
        assert r.status_code == 200, r.text


# A seeded random model never samples EOS greedily: a stream runs until the context fills.
LONG = {"model": "long", "prompt": "once upon a time", "raw": True,
        "options": {"num_predict": 100000, "temperature": 0}}  # fmt: skip


def test_two_clients_of_one_model_generate_at_once_with_no_settings(auto_server: Any) -> None:
    """With one slot the second stream's first token would come only after the first stream's
    thousands: here both streams make progress before either ends, and /api/ps shows both
    slots in use."""
    s, body = auto_server, LONG
    with s.client.stream("POST", "/api/generate", json=body) as a:
        assert a.status_code == 200
        lines_a = a.iter_lines()
        assert not json.loads(next(lines_a))["done"]
        with s.client.stream("POST", "/api/generate", json=body) as b:
            assert b.status_code == 200
            lines_b = b.iter_lines()
            assert not json.loads(next(lines_b))["done"]
            (m,) = [m for m in s.ps() if m["model"] == "long:latest"]
            assert (m["requests_in_flight"], m["num_parallel"]) == (2, AUTO_PARALLEL)
            assert m["context_length"] == 16384  # each request may use all of it
            assert not json.loads(next(lines_a))["done"]  # the first goes on beside it
            assert not json.loads(next(lines_b))["done"]
    # Embedding models get slots too (llama.cpp batches their inputs).
    r = s.client.post("/api/embed", json={"model": "embed", "input": ["a", "b"]})
    assert r.status_code == 200, r.text
    (e,) = [m for m in s.ps() if m["model"] == "embed:latest"]
    assert e["num_parallel"] == EMBED_PARALLEL


def test_parallel_streams_that_fill_their_shared_context_are_continued_alone(
    auto_server: Any,
) -> None:
    """Slots share one context: two streams that together outgrow it are failed by llama.cpp
    ("Context size has been exceeded") after both have answered for a while. Each is continued
    where it stopped once it can run alone, so each client reads one whole answer that goes on
    to the context's end: together more tokens than the shared context holds, in Ollama's shape
    and in OpenAI's (one id, one opening role event, usage counting every token, [DONE])."""
    s = auto_server
    plain(s, "long", "tiny")
    continued = s.log().count("continues alone")
    body = {**LONG, "model": "long-plain",
            "options": {**LONG["options"], "num_ctx": 1024}}  # type: ignore[dict-item]
    with s.client.stream("POST", "/api/generate", json=body) as a, s.client.stream(
        "POST", "/api/generate", json=body
    ) as b:
        lines = [a.iter_lines(), b.iter_lines()]
        assert not any(json.loads(next(it))["done"] for it in lines)  # both hold cells now
        out = [[json.loads(ln) for ln in it if ln] for it in lines]
    last = [o[-1] for o in out]
    assert all(e.get("done") and "error" not in e for e in last), last
    assert sum(e["eval_count"] for e in last) > 1024, last  # more than both could have had
    assert all(e["prompt_eval_count"] < 32 for e in last), last  # the prompt, not the prefill
    for o, e in zip(out, last, strict=True):  # every token reached its client
        assert abs((len(o) + 1) - e["eval_count"]) <= 8, (len(o), e["eval_count"])
    assert s.log().count("continues alone") >= continued + 2
    # The pass-through: a model whose own context is 2048 (OpenAI requests set no context).
    chat = {"model": "tiny-plain", "messages": [{"role": "user", "content": "once upon a time"}],
            "max_tokens": 100000, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    with s.client.stream("POST", "/v1/chat/completions", json=chat) as a, s.client.stream(
        "POST", "/v1/chat/completions", json=chat
    ) as b:
        its = [a.iter_lines(), b.iter_lines()]
        events: list[list[str]] = [[], []]
        for i, it in enumerate(its):  # the first event of each: both hold cells now
            events[i].append(next(ln for ln in it if ln.startswith("data: "))[6:])
            assert events[i][0] != "[DONE]" and "error" not in events[i][0]
        for i, it in enumerate(its):  # then the rest of both
            events[i] += [ln[6:] for ln in it if ln.startswith("data: ")]
    used = 0
    for ev in events:
        assert ev[-1] == "[DONE]", ev[-3:]
        chunks = [json.loads(e) for e in ev[:-1]]
        assert not [c for c in chunks if "error" in c], [c for c in chunks if "error" in c]
        assert len({c["id"] for c in chunks}) == 1  # one answer
        assert sum("role" in c["choices"][0]["delta"] for c in chunks if c["choices"]) == 1
        usage = chunks[-1]["usage"]
        content = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]
        assert abs(usage["completion_tokens"] - len(content)) <= 8, (usage, len(content))
        used += usage["completion_tokens"]
        assert usage["prompt_tokens"] < 64, usage  # the prompt, not the prefill
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert used > 2048  # more than both could have had in the shared context
    assert s.log().count("continues alone") >= continued + 4


def test_claude_code_shaped_streams_that_fill_their_shared_context_are_continued(
    auto_server: Any,
) -> None:
    """Anthropic's Messages streams with tools (as Claude Code sends them), two at once on a
    shared 2,048-token context: each is continued where it stopped, and each client reads one
    message (one message_start, one text block, no error event) that stops at the context's
    end."""
    s = auto_server
    continued = s.log().count("continues alone")
    tool = {"name": "Bash", "description": "Run a shell command.", "input_schema": {
        "type": "object", "properties": {"command": {"type": "string"}},
        "required": ["command"]}}  # fmt: skip
    plain(auto_server, "tiny")
    body = {"model": "tiny-plain", "max_tokens": 100000, "temperature": 0, "stream": True,
            "tools": [tool], "messages": [{"role": "user", "content": "once upon"}]}  # fmt: skip
    head = {"x-api-key": "x", "anthropic-version": "2023-06-01"}
    with s.client.stream("POST", "/v1/messages", json=body, headers=head) as a, s.client.stream(
        "POST", "/v1/messages", json=body, headers=head
    ) as b:
        its = [a.iter_lines(), b.iter_lines()]
        events: list[list[dict[str, Any]]] = [[], []]
        for i, it in enumerate(its):  # up to the first text of each: both hold cells now
            for ln in it:
                if ln.startswith("data: "):
                    events[i].append(json.loads(ln[6:]))
                    if events[i][-1]["type"] == "content_block_delta":
                        break
        for i, it in enumerate(its):  # then the rest of both
            events[i] += [json.loads(ln[6:]) for ln in it if ln.startswith("data: ")]
    out = 0
    for ev in events:
        kinds = [e["type"] for e in ev]
        assert "error" not in kinds, [e for e in ev if e["type"] == "error"]
        assert kinds.count("message_start") == 1 and kinds[-1] == "message_stop", kinds[-3:]
        assert kinds.count("content_block_start") == 1  # one text block
        (delta,) = [e for e in ev if e["type"] == "message_delta"]
        assert delta["delta"]["stop_reason"] == "max_tokens"  # the context's end
        out += delta["usage"]["output_tokens"]
    assert out > 2048  # more than both could have had in the shared context
    assert s.log().count("continues alone") >= continued + 2


def test_a_prompt_that_would_overfill_the_shared_context_waits_for_room(
    auto_server: Any,
) -> None:
    """Two prompts that each fit the shared context but not both at once: llama.cpp would fail
    both ("Context size has been exceeded"). The second waits until the first has ended, then
    runs; both answer in full. The runner is held still (SIGSTOP) while the second arrives, so
    the first cannot end before it."""
    s = auto_server
    # ~1,780 bytes, ~690 tokens: one fits 1,024 with its output, two do not (as corral
    # estimates them too, at 3 bytes a token).
    words = " ".join(f"word{i % 97} alpha beta" for i in range(100))
    body = {"model": "long", "raw": True, "options": {"num_ctx": 1024, "num_predict": 24,
            "temperature": 0}}  # fmt: skip
    with s.client.stream("POST", "/api/generate", json={**body, "prompt": "A " + words}) as a:
        lines = a.iter_lines()
        assert not json.loads(next(lines))["done"]  # the first holds its cells now
        (m,) = [m for m in s.ps() if m["model"] == "long:latest"]
        assert m["context_length"] == 1024
        waits = s.log().count("is full: a request waits for room")
        os.kill(m["pid"], signal.SIGSTOP)
        try:
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                second = pool.submit(s.client.post, "/api/generate",
                                     json={**body, "prompt": "B " + words, "stream": False})
                s.wait_for(lambda: s.log().count("is full: a request waits for room") > waits,
                           what="the second request to wait for room")
                os.kill(m["pid"], signal.SIGCONT)
                first = [json.loads(ln) for ln in lines if ln]
                b = second.result()
        finally:
            os.kill(m["pid"], signal.SIGCONT)
    assert first[-1]["done"] and "error" not in first[-1], first[-1]
    assert b.status_code == 200, b.text
    assert b.json()["done"] and b.json()["eval_count"] == 24
    assert b.json()["prompt_eval_count"] + first[-1]["prompt_eval_count"] > 1024


SMOL = "smollm2:135m"


def ask(s: Any, messages: list[dict[str, str]], **extra: Any) -> dict[str, Any]:
    r = s.client.post("/v1/chat/completions", json={
        "model": SMOL, "messages": messages, "max_tokens": 8, "temperature": 0, **extra,
    })  # fmt: skip
    assert r.status_code == 200, r.text
    return dict(r.json())


def tokens(s: Any, messages: list[dict[str, str]]) -> list[int]:
    """The prompt's tokens as the runner reads them (its template, its tokenizer)."""
    r = s.client.post("/apply-template", json={"model": SMOL, "messages": messages})
    assert r.status_code == 200, r.text
    t = s.client.post("/tokenize", json={
        "model": SMOL, "content": r.json()["prompt"], "add_special": True, "parse_special": True,
    })  # fmt: skip
    assert t.status_code == 200, t.text
    return list(t.json()["tokens"])


def common(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(a))


def rules(topic: str, n: int = 40) -> str:
    return f"You are a careful assistant on {topic}. " + " ".join(
        f"Rule {i}: answer briefly and precisely about {topic} number {i}." for i in range(n)
    )


def test_a_conversations_second_turn_lands_on_its_slot(auto_server: Any) -> None:
    """Two conversations that share a system prompt, one turn each, then the first's second
    turn: it reads its first turn's prompt from its own slot's cache. (llama.cpp alone would put
    the second conversation on the first's slot, the only one holding anything, and the first's
    second turn would reuse the system prompt only: 637 of 888 tokens where this gets 873.)
    The second conversation takes an empty slot, started from a copy of the first's state
    (runtime/slotcopy): it reads from the cache all it shares with the first."""
    s, system = auto_server, rules("topics")
    a = [{"role": "system", "content": system},
         {"role": "user", "content": "About apples. " + "Apples grow on trees. " * 40}]
    b = [{"role": "system", "content": system},
         {"role": "user", "content": "About boats. " + "Boats float on water. " * 40}]  # fmt: skip
    first = ask(s, a)
    other = ask(s, b)
    shared = common(tokens(s, a), tokens(s, b))
    assert shared > 500  # the system prompt
    assert other["timings"]["cache_n"] == shared
    assert other["timings"]["prompt_n"] == other["usage"]["prompt_tokens"] - shared
    # The copy left the first's own slot as it was.
    second = ask(s, [*a, {"role": "assistant", "content": first["choices"][0]["message"][
        "content"]}, {"role": "user", "content": "And pears?"}])  # fmt: skip
    assert second["timings"]["cache_n"] >= first["usage"]["prompt_tokens"]


def test_a_new_conversation_starts_from_a_short_idle_one_it_shares_a_start_with(
    auto_server: Any,
) -> None:
    """A conversation too short to be parked (runtime/affinity.parked: its cells cost the other
    slots less than its save) stays in its slot. A new one that shares its system prompt takes
    an empty slot started from a copy of it, as llama.cpp alone would reuse that prompt in that
    slot, and the first keeps its own: without the copy the new one read its whole prompt."""
    s, system = auto_server, rules("orchards", 8)
    r = s.client.post("/api/generate", json={"model": SMOL, "keep_alive": 0})
    assert r.status_code == 200, r.text
    s.wait_for(lambda: not any(m["model"] == SMOL for m in s.ps()), 60, "unload")
    # Questions that differ early: a conversation is another's own where it continues all but
    # its last 32 bytes (runtime/affinity).
    a = [{"role": "system", "content": system},
         {"role": "user", "content": "Which apples grow best in a cold and windy orchard?"}]
    b = [{"role": "system", "content": system},
         {"role": "user", "content": "Name a pear that keeps well through a long winter."}]
    first = ask(s, a)
    assert first["usage"]["prompt_tokens"] + first["usage"]["completion_tokens"] < 200
    other = ask(s, b)
    shared = common(tokens(s, a), tokens(s, b))
    assert shared > 100  # the system prompt
    assert other["timings"]["cache_n"] == shared
    second = ask(s, [*a, first["choices"][0]["message"], {"role": "user", "content": "Why?"}])
    assert second["timings"]["cache_n"] >= first["usage"]["prompt_tokens"]


def test_no_copy_from_a_slot_still_generating(auto_server: Any) -> None:
    """llama.cpp would save a slot that is generating only once it is done: a new conversation
    beside one that is generating evaluates the prompt they share (the stream's lease holds its
    slot until the answer ends)."""
    s, system = auto_server, rules("rivers")
    a = [{"role": "system", "content": system}, {"role": "user", "content": "Tell a story."}]
    b = [{"role": "system", "content": system}, {"role": "user", "content": "Name a river."}]
    body = {"model": SMOL, "messages": a, "max_tokens": 4000, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    with s.client.stream("POST", "/v1/chat/completions", json=body) as stream:
        lines = stream.iter_lines()
        assert next(ln for ln in lines if ln.startswith("data: ")) != "data: [DONE]"
        other = ask(s, b, max_tokens=2)
    shared = common(tokens(s, a), tokens(s, b))
    assert shared > 500
    assert other["timings"]["cache_n"] < 50  # a template's preamble at most, never a's prompt


def test_a_copy_that_fails_leaves_the_prompt_to_be_evaluated(auto_server: Any) -> None:
    """The KV cache directory (llama.cpp's slot_save_path) gone: the save fails and the new
    conversation is answered, evaluating what it shares; once it is back, copies resume."""
    s, system = auto_server, rules("mountains")
    kv = s.log_path.parent / "kvcache"
    # A runner with its slots empty: the next conversation lands on an empty one.
    r = s.client.post("/api/generate", json={"model": SMOL, "keep_alive": 0})
    assert r.status_code == 200, r.text
    s.wait_for(lambda: not any(m["model"] == SMOL for m in s.ps()), 60, "unload")

    def conversation(question: str) -> list[dict[str, str]]:
        # Questions that differ early: a conversation is another's own where it continues all
        # but its last 32 bytes (runtime/affinity).
        return [{"role": "system", "content": system}, {"role": "user", "content": question}]

    first = conversation("Which are the highest mountains of the Alps, and who climbed them?")
    ask(s, first)
    kv.rename(kv.with_name("kvcache-away"))
    try:
        failed = ask(s, conversation("Name the longest mountain range on the Earth, please."))
    finally:
        kv.with_name("kvcache-away").rename(kv)
    assert failed["choices"][0]["message"]["content"]
    assert failed["timings"]["cache_n"] < 50  # a template's preamble at most
    later = conversation("Tell me how mountains are made, from the start to the end.")
    assert ask(s, later)["timings"]["cache_n"] == common(tokens(s, first), tokens(s, later))


def test_with_every_slot_taken_a_new_conversation_leaves_the_live_one_its_slot(
    auto_server: Any,
) -> None:
    """Every slot holds something, and a new conversation shares its system prompt with a live
    one whose history is shorter than that prompt: where llama.cpp's copy pays (a CPU), the
    least recently used slot takes it, the shared prompt copied in, and the live conversation's
    next turn still finds its own history."""
    s, system = auto_server, rules("rivers and lakes")
    r = s.client.post("/api/generate", json={"model": SMOL, "keep_alive": 0})
    assert r.status_code == 200, r.text
    s.wait_for(lambda: not any(m["model"] == SMOL for m in s.ps()), 60, "unload")
    live = [{"role": "system", "content": system},
            {"role": "user", "content": "Which is the longest river of Europe, and its source?"}]
    first = ask(s, live)
    for i in range(AUTO_PARALLEL - 1):  # side requests (titles) in the other slots
        ask(s, [{"role": "user", "content": f"{i}: a title for a conversation about lakes"}])
    live += [first["choices"][0]["message"], {"role": "user", "content": "And the deepest lake?"}]
    second = ask(s, live)  # the live conversation is the most recently used
    new = [{"role": "system", "content": system},
           {"role": "user", "content": "Tell me how a delta is made by a river, step by step."}]
    other = ask(s, new)
    assert other["timings"]["cache_n"] == common(tokens(s, live), tokens(s, new))
    third = ask(s, [*live, second["choices"][0]["message"], {"role": "user", "content": "Why?"}])
    assert third["timings"]["cache_n"] >= second["usage"]["prompt_tokens"]


def test_an_idle_conversation_leaves_the_shared_cache_and_comes_back(auto_server: Any) -> None:
    """On a CPU runner whose slots share one cache, a conversation's slot is parked (saved as a
    conversation, then erased) before another conversation's prompt is read: every decoding
    step attends over every used cell of the cache. Its next turn is restored from the save and
    reads only what it added."""
    s = auto_server
    a = [{"role": "system", "content": rules("gardens")},
         {"role": "user", "content": "Which flowers grow well in the shade of old trees?"}]
    b = [{"role": "user", "content": "Tell me about the trains of the Alps. " * 30}]  # fmt: skip
    first = ask(s, a)
    ask(s, b)
    assert re.search(r"kv cache: parked slot \d+ of 'smollm2:135m' \(\d+ cells freed\)", s.log())
    mine = tokens(s, a)
    kv = s.log_path.parent / "kvcache"
    assert any(list(read_tokens(p)[: len(mine)]) == mine for p in kv.glob("*.slot"))
    reply = first["choices"][0]["message"]
    second = ask(s, [*a, reply, {"role": "user", "content": "And which grow in full sun?"}])
    assert second["timings"]["cache_n"] >= first["usage"]["prompt_tokens"]
