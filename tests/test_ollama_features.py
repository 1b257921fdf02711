"""Ollama's generation details through the real `ollama` client: thinking, tools, logprobs,
images, fill-in-the-middle, context, format and stop; plus the chunk renderer on its own."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import ollama
import pytest

from corral.api.chat import Done, Event, Text, Thinking, ToolCall, Usage
from corral.api.families.ollama.render import OllamaChunks, merge

SMOL = "smollm2:135m"
PNG = (  # a 1x1 PNG
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


def test_think_separates_reasoning(ollama_client: ollama.Client) -> None:
    r = ollama_client.chat(
        model="think", messages=[{"role": "user", "content": "hi"}], think=True,
        options={"num_predict": 8, "seed": 1},
    )  # fmt: skip
    # The template opens <think> and random weights never close it: all of it is reasoning.
    assert r.message.thinking and not r.message.content
    off = ollama_client.chat(
        model="think", messages=[{"role": "user", "content": "hi"}], think=False,
        options={"num_predict": 8, "seed": 1},
    )  # fmt: skip
    assert off.message.content and not off.message.thinking
    streamed = list(ollama_client.generate(
        model="think", prompt="hi", think="high", stream=True, options={"num_predict": 6},
    ))  # fmt: skip
    assert "".join(c.thinking or "" for c in streamed) and streamed[-1].done


def test_think_on_a_model_without_reasoning_is_a_400(ollama_client: ollama.Client) -> None:
    with pytest.raises(ollama.ResponseError) as e:
        ollama_client.chat(model="tiny", messages=[{"role": "user", "content": "hi"}], think=True)
    assert e.value.status_code == 400 and "does not support thinking" in e.value.error


def test_tools_without_a_tool_template(ollama_client: ollama.Client) -> None:
    # corral shows the tools to a model whose template has none (tests/test_tools_fallback.py).
    r = ollama_client.chat(
        model="tiny", messages=[{"role": "user", "content": "hi"}], tools=[WEATHER],
        options={"num_predict": 4},
    )  # fmt: skip
    assert r.done


def test_tool_history_goes_through_the_template(ollama_client: ollama.Client) -> None:
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "18 degrees, sunny", "tool_name": "get_weather"},
    ]  # fmt: skip
    r = ollama_client.chat(
        model="tools", messages=messages, tools=[WEATHER], options={"num_predict": 4}
    )
    assert r.done and r.prompt_eval_count and r.prompt_eval_count > 30


def test_logprobs_on_generate_and_chat(ollama_client: ollama.Client) -> None:
    r = ollama_client.generate(
        model=SMOL, prompt="Say hi.", logprobs=True, top_logprobs=3,
        options={"num_predict": 5, "temperature": 0},
    )  # fmt: skip
    assert r.logprobs and len(r.logprobs) == r.eval_count
    for lp in r.logprobs:
        assert lp.token and lp.logprob <= 0
        assert lp.top_logprobs and len(lp.top_logprobs) == 3
        assert lp.top_logprobs[0].logprob >= lp.top_logprobs[-1].logprob
    assert "".join(lp.token for lp in r.logprobs) == r.response
    chunks = list(ollama_client.chat(
        model=SMOL, messages=[{"role": "user", "content": "Say hi."}], logprobs=True,
        stream=True, options={"num_predict": 5, "temperature": 0},
    ))  # fmt: skip
    tokens = [lp.token for c in chunks for lp in (c.logprobs or [])]
    assert "".join(tokens) == "".join(c.message.content for c in chunks)
    plain = ollama_client.generate(model=SMOL, prompt="Say hi.", options={"num_predict": 2})
    assert plain.logprobs is None


def test_images_without_a_projector_are_a_400(ollama_client: ollama.Client) -> None:
    with pytest.raises(ollama.ResponseError) as e:
        ollama_client.generate(model=SMOL, prompt="What is this?", images=[PNG])
    assert e.value.status_code == 400 and "does not support images" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        ollama_client.chat(model=SMOL, messages=[{"role": "user", "content": "?", "images": [PNG]}])
    assert e.value.status_code == 400 and "does not support images" in e.value.error


def test_generate_details(ollama_client: ollama.Client, server) -> None:
    with pytest.raises(ollama.ResponseError) as e:
        ollama_client.generate(model=SMOL, prompt="def f(", suffix="return 1")
    assert e.value.status_code == 400 and "does not support insert" in e.value.error
    raw = ollama_client.generate(
        model=SMOL, prompt="The sky is", raw=True, options={"num_predict": 3}
    )
    assert raw.response and raw.context is None  # as Ollama: no context for a raw prompt
    # A request's own Go template, as Ollama renders it, completed as a raw prompt.
    templated = server.client.post("/api/generate", json={
        "model": SMOL, "prompt": "The sky is", "system": "Be brief.", "stream": False,
        "template": "{{ if .System }}[{{ .System }}] {{ end }}Q: {{ .Prompt }} A:",
        "options": {"num_predict": 2},
    }).json()  # fmt: skip
    toks = server.client.post("/tokenize", json={
        "model": SMOL, "content": "[Be brief.] Q: The sky is A:", "add_special": True,
    }).json()["tokens"]  # fmt: skip
    assert templated["prompt_eval_count"] == len(toks)
    # Ollama gives a templated prompt its context too: the prompt's ids, then the answer's
    assert templated["context"][: len(toks)] == toks
    assert len(templated["context"]) == len(toks) + templated["eval_count"]
    resp = server.client.post(
        "/api/generate", json={"model": SMOL, "prompt": "x", "template": "{{ html .Prompt }}"}
    )
    assert resp.status_code == 400 and "html" in resp.json()["error"]
    for body in ({"think": "max"}, {"top_logprobs": 50, "logprobs": True}, {"images": "x"}):
        resp = server.client.post("/api/generate", json={"model": SMOL, "prompt": "x", **body})
        assert resp.status_code == 400, body


def test_generate_context_continues_the_conversation(
    ollama_client: ollama.Client, http: httpx.Client
) -> None:
    # Ollama's `context` (deprecated, still read by older clients): every templated answer
    # ends with the token ids of its prompt and answer, streamed or not.
    opts = {"num_predict": 12, "temperature": 0}
    first = ollama_client.generate(model=SMOL, prompt="My name is Ada. Greet me.", options=opts)
    ctx = first.context
    assert ctx and all(type(t) is int for t in ctx)
    assert len(ctx) == first.prompt_eval_count + first.eval_count
    answer = http.post("/tokenize", json={"model": SMOL, "content": first.response}).json()
    assert ctx[-len(answer["tokens"]) :] == answer["tokens"]
    chunks = list(ollama_client.generate(
        model=SMOL, prompt="My name is Ada. Greet me.", options=opts, stream=True
    ))  # fmt: skip
    assert chunks[-1].done and chunks[-1].context == ctx
    assert all(c.context is None for c in chunks[:-1])
    # Sent back, it goes before the next prompt: the model reads both, and the new context
    # extends the old one.
    alone = ollama_client.generate(model=SMOL, prompt="What is my name?", options=opts)
    follow = ollama_client.generate(model=SMOL, prompt="What is my name?", context=ctx,
                                    options=opts)  # fmt: skip
    assert follow.prompt_eval_count == len(ctx) + alone.prompt_eval_count
    assert follow.context[: len(ctx)] == ctx
    assert len(follow.context) == follow.prompt_eval_count + follow.eval_count
    again = ollama_client.generate(model=SMOL, prompt="What is my name?", context=ctx,
                                   options=opts)  # fmt: skip
    assert again.response == follow.response and again.context == follow.context
    # the raw HTTP answer, streamed: one final line with the same ids
    with http.stream("POST", "/api/generate", json={
        "model": SMOL, "prompt": "What is my name?", "context": ctx, "options": opts,
    }) as r:  # fmt: skip
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert lines[-1]["done"] and lines[-1]["context"] == follow.context
    assert not any("context" in line for line in lines[:-1])


@pytest.mark.parametrize("context", ["x", {"a": 1}, ["a"], [1.5], [-1], [True], [10**9], [2**70]])
def test_generate_context_of_the_wrong_kind_is_a_400(http: httpx.Client, context: Any) -> None:
    resp = http.post("/api/generate", json={"model": SMOL, "prompt": "x", "context": context})
    assert resp.status_code == 400, resp.text
    assert "'context'" in resp.json()["error"]


def test_chat_format_schema_and_stop(ollama_client: ollama.Client) -> None:
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}},
              "required": ["answer"]}  # fmt: skip
    r = ollama_client.chat(
        model=SMOL, messages=[{"role": "user", "content": "Is the sky blue?"}], format=schema,
        options={"num_predict": 40, "temperature": 0},
    )  # fmt: skip
    assert json.loads(r.message.content)["answer"] in ("yes", "no")
    r = ollama_client.chat(
        model=SMOL, messages=[{"role": "user", "content": "Write a sentence about cats."}],
        options={"num_predict": 30, "temperature": 0, "stop": [" "]},
    )  # fmt: skip
    assert r.message.content and " " not in r.message.content and r.done_reason == "stop"


def test_generate_model_name_is_echoed(server) -> None:
    body = {"model": "tiny:latest", "prompt": "hi", "stream": False, "options": {"num_predict": 2}}
    assert httpx.post(f"{server.url}/api/generate", json=body, timeout=60).json()["model"] == (
        "tiny:latest"
    )


# ---- the renderer alone ---------------------------------------------------------------------
class _Lease:
    waited, loaded = 0.0, False


class _Gen:
    lease = _Lease()


async def _events() -> AsyncIterator[Event]:
    yield Thinking("hmm")
    yield Text("ok")
    yield ToolCall(0, "call_1", "get_weather", '{"ci')
    yield ToolCall(0, "", "", 'ty": "Paris"}')
    yield ToolCall(1, "call_2", "get_time", "{}")
    yield Done("tool_calls", Usage(7, 5, 0, 1.0, 2.0))


def test_chunks_carry_tool_calls_with_object_arguments() -> None:
    async def run() -> list[dict[str, Any]]:
        gen: Any = _Gen()
        return [c async for c in OllamaChunks(gen, "m", "message", 0.0, None).of(_events())]

    chunks = asyncio.run(run())
    assert [c["done"] for c in chunks] == [False, False, False, True]
    calls = chunks[2]["message"]["tool_calls"]
    assert calls == [
        {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
        {"function": {"name": "get_time", "arguments": {}}},
    ]
    final = chunks[-1]
    assert final["done_reason"] == "stop" and final["eval_count"] == 5
    assert final["prompt_eval_count"] == 7 and final["eval_duration"] == 2_000_000
    whole = merge(chunks, "message")
    assert whole["message"]["content"] == "ok" and whole["message"]["thinking"] == "hmm"
    assert whole["message"]["tool_calls"] == calls


def test_embed_truncates_long_input_unless_told_not_to(ollama_client: ollama.Client) -> None:
    long = "word " * 3000  # well past the 512 tokens one embedding batch holds
    r = ollama_client.embed(model="embed", input=["short", long])
    assert len(r.embeddings) == 2 and len(r.embeddings[0]) == len(r.embeddings[1])
    assert r.embeddings[0] != r.embeddings[1]
    with pytest.raises(ollama.ResponseError) as e:
        ollama_client.embed(model="embed", input=long, truncate=False)
    assert e.value.status_code == 400 and "truncate" in e.value.error


def test_a_loaded_model_whose_file_is_deleted_stays_listed_and_unloads(
    start_server, tmp_path_factory: pytest.TempPathFactory
) -> None:
    from corral.testing import synth

    d = tmp_path_factory.mktemp("vanishing")
    synth.write_llama_model(d / "gone.gguf")
    s = start_server(d, CORRAL_BUILTIN_MODELS="0")
    ok = s.client.post("/api/generate", json={"model": "gone", "prompt": "hi", "stream": False,
                                               "options": {"num_predict": 1}})  # fmt: skip
    assert ok.status_code == 200
    (d / "gone.gguf").unlink()
    ps = s.client.get("/api/ps")
    assert ps.status_code == 200 and [m["name"] for m in ps.json()["models"]] == ["gone:latest"]
    r = s.client.post("/api/generate", json={"model": "gone", "keep_alive": 0})
    assert r.status_code == 200 and r.json()["done_reason"] == "unload"
    s.wait_for(lambda: not s.ps(), what="the runner to stop")
    r = s.client.post("/api/generate", json={"model": "gone", "prompt": "hi"})
    assert r.status_code == 404
