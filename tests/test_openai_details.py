"""The details real OpenAI clients send, answered as OpenAI documents them: the model name
echoed, forced tool calls, n choices, legacy completions logprobs and echo, embedding
dimensions and base64, images refused, wrong types named."""

from __future__ import annotations

import base64
import json
import math
from typing import Any

import httpx
import numpy as np
import openai
import pytest

SMOL = "smollm2:135m"
HI = [{"role": "user", "content": "hi"}]
# Closed schemas with an enum: even the random-weight "tools" model's forced call is short
# and well-formed.
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "London"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
    },
}
TOOLS: Any = [WEATHER, TIME]


def sse(http: httpx.Client, path: str, body: dict[str, Any]) -> list[Any]:
    """The JSON payloads of a raw SSE response, "[DONE]" kept as a string."""
    with http.stream("POST", path, json=body) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    return [e if e == "[DONE]" else json.loads(e) for e in events]


def error_of(r: httpx.Response, status: int = 400) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error"
    return dict(err)


# ---- the model name ------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["tiny", "tiny:latest", "Tiny"])
def test_model_is_the_name_asked_for(
    openai_client: openai.OpenAI, http: httpx.Client, name: str
) -> None:
    r = openai_client.chat.completions.create(model=name, messages=HI, max_tokens=2)
    assert r.model == name
    c = openai_client.completions.create(model=name, prompt="hi", max_tokens=2)
    assert c.model == name
    for path, body in [
        ("/v1/chat/completions", {"messages": HI}),
        ("/v1/completions", {"prompt": "hi"}),
    ]:
        events = sse(http, path, {"model": name, **body, "max_tokens": 2, "stream": True})
        assert events[-1] == "[DONE]"
        chunks = [e for e in events if e != "[DONE]"]
        assert chunks and all(e["model"] == name for e in chunks)


def test_pass_through_stays_a_pass_through(http: httpx.Client) -> None:
    # llama.cpp's own extension fields survive: the common request is not rebuilt.
    r = http.post("/v1/chat/completions", json={"model": "tiny", "messages": HI, "max_tokens": 2})
    assert r.status_code == 200 and "timings" in r.json() and r.json()["model"] == "tiny"


def test_embeddings_model_is_the_name_asked_for(openai_client: openai.OpenAI) -> None:
    for name in ("embed", "embed:latest"):
        assert openai_client.embeddings.create(model=name, input="hi").model == name
        r = openai_client.embeddings.create(model=name, input="hi", dimensions=4)
        assert r.model == name


# ---- forced tool calls ---------------------------------------------------------------------


def check_call(call: Any, name: str | None = None) -> dict[str, Any]:
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in ("get_weather", "get_time")
    if name:
        assert call.function.name == name
    args = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        assert args == {"city": "Paris"} or args == {"city": "London"}
    else:
        assert args == {}
    return dict(args)


@pytest.mark.parametrize(
    ("choice", "name"),
    [("required", None), ({"type": "function", "function": {"name": "get_time"}}, "get_time")],
)
def test_forced_tool_call(openai_client: openai.OpenAI, choice: Any, name: str | None) -> None:
    r = openai_client.chat.completions.create(
        model="tools",
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=TOOLS,
        tool_choice=choice,
        max_tokens=40,
    )
    assert r.object == "chat.completion" and r.model == "tools" and r.id.startswith("chatcmpl-")
    (c,) = r.choices
    assert c.index == 0 and c.finish_reason == "tool_calls"
    assert c.message.role == "assistant" and c.message.content is None
    assert c.message.tool_calls and len(c.message.tool_calls) == 1
    check_call(c.message.tool_calls[0], name)
    assert r.usage and r.usage.prompt_tokens > 0 and r.usage.completion_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_forced_tool_call_streamed(openai_client: openai.OpenAI, http: httpx.Client) -> None:
    stream = openai_client.chat.completions.create(
        model="tools:latest",
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=40,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" and c.model == "tools:latest" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    deltas = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or ()]
    assert deltas and deltas[0].id and deltas[0].type == "function"
    assert deltas[0].function and deltas[0].function.name == "get_weather"
    args = "".join(d.function.arguments or "" for d in deltas if d.function)
    assert json.loads(args) in ({"city": "Paris"}, {"city": "London"})
    finish = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finish[-1] == "tool_calls"
    # include_usage: a last chunk with no choices and the usage.
    assert not chunks[-1].choices and chunks[-1].usage and chunks[-1].usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])
    # Raw: OpenAI's framing, ending in [DONE]; without include_usage, no usage chunk.
    events = sse(
        http,
        "/v1/chat/completions",
        {
            "model": "tools",
            "messages": HI,
            "tools": TOOLS,
            "tool_choice": "required",
            "max_tokens": 40,
            "stream": True,
        },
    )
    assert events[-1] == "[DONE]"
    assert all("usage" not in e and e["model"] == "tools" for e in events[:-1])


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        ({"tool_choice": "always", "tools": TOOLS}, "tool_choice", "'tool_choice'"),
        ({"tool_choice": 3, "tools": TOOLS}, "tool_choice", "'tool_choice'"),
        ({"tool_choice": {"type": "function"}, "tools": TOOLS}, "tool_choice", "'tool_choice'"),
        ({"tool_choice": "required"}, "tool_choice", "'tools'"),
        (
            {"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": TOOLS},
            "tool_choice",
            "'nope'",
        ),
        ({"tools": {"get_time": {}}}, "tools", "'tools'"),
        ({"tools": ["get_time"]}, "tools[0]", "'tools[0]'"),
        ({"tools": [{"type": "function"}]}, "tools[0].function", "'tools[0].function'"),
        (
            {"tools": [{"type": "function", "function": {"name": 5}}]},
            "tools[0].function.name",
            "'tools[0].function.name'",
        ),
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type", "'tools[0].type'"),
    ],
)
def test_bad_tools_are_400(
    http: httpx.Client, extra: dict[str, Any], param: str, words: str
) -> None:
    for stream in (False, True):
        r = http.post(
            "/v1/chat/completions",
            json={"model": "tools", "messages": HI, "stream": stream, **extra},
        )
        err = error_of(r)
        assert err["param"] == param and words in err["message"]


def test_bad_tool_choice_through_the_client(openai_client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        openai_client.chat.completions.create(
            model="tools",
            messages=HI,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "nope"}},
        )
    assert isinstance(e.value.body, dict) and e.value.body["param"] == "tool_choice"


# ---- n choices -----------------------------------------------------------------------------


def test_n_chat_choices_follow_the_seed(openai_client: openai.OpenAI) -> None:
    args: Any = {"model": "tiny", "messages": HI, "max_tokens": 4, "temperature": 1.0}
    r = openai_client.chat.completions.create(n=3, seed=11, **args)
    assert [c.index for c in r.choices] == [0, 1, 2]
    texts = [c.message.content for c in r.choices]
    assert all(texts) and len(set(texts)) > 1  # seed+i: the choices differ
    assert all(c.finish_reason in ("stop", "length") for c in r.choices)
    assert r.model == "tiny" and r.object == "chat.completion"
    # Each choice is the generation a single request with seed+i gives.
    for i in range(3):
        one = openai_client.chat.completions.create(seed=11 + i, **args)
        assert one.choices[0].message.content == texts[i]
    # Usage sums the three generations.
    assert r.usage and one.usage
    assert r.usage.prompt_tokens == 3 * one.usage.prompt_tokens
    assert 3 <= r.usage.completion_tokens <= 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_n_chat_streamed(openai_client: openai.OpenAI, http: httpx.Client) -> None:
    stream = openai_client.chat.completions.create(
        model="tiny",
        messages=HI,
        max_tokens=3,
        n=3,
        seed=5,
        temperature=1.0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert len({c.id for c in chunks}) == 1 and all(c.model == "tiny" for c in chunks)
    texts: dict[int, str] = {}
    finished: dict[int, str] = {}
    for c in chunks[:-1]:
        (choice,) = c.choices
        texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
        if choice.finish_reason:
            finished[choice.index] = choice.finish_reason
    assert sorted(texts) == [0, 1, 2] and all(texts.values())
    assert sorted(finished) == [0, 1, 2]
    usage = chunks[-1].usage
    assert not chunks[-1].choices and usage and 3 <= usage.completion_tokens <= 9
    # The same seeds, not streamed, give the same choices.
    whole = openai_client.chat.completions.create(
        model="tiny", messages=HI, max_tokens=3, n=3, seed=5, temperature=1.0
    )
    assert [c.message.content for c in whole.choices] == [texts[i] for i in range(3)]
    events = sse(
        http,
        "/v1/chat/completions",
        {"model": "tiny", "messages": HI, "max_tokens": 2, "n": 2, "stream": True},
    )
    assert events[-1] == "[DONE]" and {e["choices"][0]["index"] for e in events[:-1]} == {0, 1}


def test_n_forced_tool_calls(openai_client: openai.OpenAI) -> None:
    r = openai_client.chat.completions.create(
        model="tools", messages=HI, tools=TOOLS, tool_choice="required", max_tokens=40, n=2
    )
    assert [c.index for c in r.choices] == [0, 1]
    for c in r.choices:
        assert c.finish_reason == "tool_calls" and c.message.tool_calls
        check_call(c.message.tool_calls[0])


def test_n_completions(openai_client: openai.OpenAI) -> None:
    r = openai_client.completions.create(
        model="tiny", prompt="Once", max_tokens=3, n=2, seed=3, temperature=1.0
    )
    assert [c.index for c in r.choices] == [0, 1] and all(c.text for c in r.choices)
    assert r.object == "text_completion" and r.model == "tiny"
    assert r.usage and r.usage.completion_tokens == 6
    chunks = list(
        openai_client.completions.create(
            model="tiny",
            prompt="Once",
            max_tokens=3,
            n=2,
            seed=3,
            temperature=1.0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    texts = ["", ""]
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] += choice.text
    assert texts == [c.text for c in r.choices]
    assert chunks[-1].usage and chunks[-1].usage.completion_tokens == 6


def test_n_with_several_prompts_is_prompt_major(openai_client: openai.OpenAI) -> None:
    r = openai_client.completions.create(model="tiny", prompt=["a", "b"], max_tokens=2, n=2, seed=1)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    # index = prompt * n + choice: choice 0 of each prompt has the request's own seed.
    single = openai_client.completions.create(model="tiny", prompt=["a", "b"], max_tokens=2, seed=1)
    assert [r.choices[0].text, r.choices[2].text] == [c.text for c in single.choices]


def test_several_prompts_stream_parses(openai_client: openai.OpenAI) -> None:
    # llama.cpp opens such a stream with `data: null`, which the client cannot parse.
    chunks = list(
        openai_client.completions.create(model="tiny", prompt=["a", "b"], max_tokens=2, stream=True)
    )
    assert {c.choices[0].index for c in chunks if c.choices} == {0, 1}


@pytest.mark.parametrize("n", [0, 17, -1, "2", 1.5, True])
def test_bad_n_is_400(http: httpx.Client, n: Any) -> None:
    for path, body in [
        ("/v1/chat/completions", {"messages": HI}),
        ("/v1/completions", {"prompt": "x"}),
    ]:
        err = error_of(http.post(path, json={"model": "tiny", "n": n, **body}))
        assert err["param"] == "n" and "'n'" in err["message"]


# ---- completions logprobs and echo ---------------------------------------------------------


def check_logprobs(lp: Any, k: int, text: str, start: int = 0) -> None:
    n = len(lp.tokens)
    assert n and len(lp.token_logprobs) == n and len(lp.top_logprobs) == n
    assert len(lp.text_offset) == n
    assert lp.text_offset[0] == start
    assert all(b > a for a, b in zip(lp.text_offset, lp.text_offset[1:], strict=False))
    assert "".join(lp.tokens) == text
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert isinstance(logprob, float) and logprob <= 0
        # the top k, plus the sampled token when it is not among them
        assert 1 <= len(top) <= k + 1 and top[token] == logprob
        assert all(v <= 0 for v in top.values())


@pytest.mark.parametrize("k", [0, 2, 5])
def test_completion_logprobs_legacy_shape(openai_client: openai.OpenAI, k: int) -> None:
    r = openai_client.completions.create(
        model=SMOL, prompt="The capital of France is", max_tokens=4, logprobs=k, temperature=0
    )
    c = r.choices[0]
    assert c.logprobs and r.usage and len(c.logprobs.tokens or ()) == r.usage.completion_tokens
    check_logprobs(c.logprobs, k, c.text)
    if k == 0:
        assert all(len(t) == 1 for t in c.logprobs.top_logprobs or ())


def test_completion_logprobs_streamed(openai_client: openai.OpenAI) -> None:
    whole = openai_client.completions.create(
        model=SMOL, prompt="The capital of France is", max_tokens=4, logprobs=2, temperature=0
    )
    chunks = list(
        openai_client.completions.create(
            model=SMOL,
            prompt="The capital of France is",
            max_tokens=4,
            logprobs=2,
            temperature=0,
            stream=True,
        )
    )
    text = "".join(c.choices[0].text for c in chunks)
    assert text == whole.choices[0].text
    lps = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs]
    merged = {
        key: [x for lp in lps for x in getattr(lp, key)]
        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    }
    assert merged == {key: getattr(whole.choices[0].logprobs, key) for key in merged}


def test_completion_echo(openai_client: openai.OpenAI) -> None:
    prompt = "The capital of France is"
    r = openai_client.completions.create(
        model=SMOL, prompt=prompt, max_tokens=3, echo=True, temperature=0
    )
    plain = openai_client.completions.create(model=SMOL, prompt=prompt, max_tokens=3, temperature=0)
    assert r.choices[0].text == prompt + plain.choices[0].text
    assert r.choices[0].logprobs is None
    chunks = list(
        openai_client.completions.create(
            model=SMOL, prompt=prompt, max_tokens=3, echo=True, temperature=0, stream=True
        )
    )
    assert chunks[0].choices[0].text == prompt
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text
    # A token prompt echoes as its text.
    toks = openai_client.completions.create(model=SMOL, prompt=[504, 3575], max_tokens=1, echo=True)
    assert toks.choices[0].text.startswith("The capital")


def test_completion_echo_with_logprobs(openai_client: openai.OpenAI) -> None:
    # llama.cpp cannot score prompt tokens: they come as the tokenizer splits the prompt, with
    # null logprobs (as OpenAI gives for a first token), then the scored completion.
    prompt = "The capital of France is"
    r = openai_client.completions.create(
        model=SMOL, prompt=prompt, max_tokens=3, echo=True, logprobs=1, temperature=0
    )
    c = r.choices[0]
    lp = c.logprobs
    assert lp and lp.tokens and lp.token_logprobs and lp.top_logprobs and lp.text_offset
    n_prompt = len(lp.tokens) - 3
    assert "".join(lp.tokens[:n_prompt]) == prompt and c.text.startswith(prompt)
    assert lp.token_logprobs[:n_prompt] == [None] * n_prompt
    assert lp.top_logprobs[:n_prompt] == [None] * n_prompt
    assert lp.text_offset[0] == 0 and lp.text_offset[n_prompt] == len(prompt)
    assert all(b > a for a, b in zip(lp.text_offset, lp.text_offset[1:], strict=False))
    assert "".join(lp.tokens) == c.text
    assert all(isinstance(x, float) for x in lp.token_logprobs[n_prompt:])
    # Streamed: the echoed prompt (with its unscored tokens) comes first.
    chunks = list(
        openai_client.completions.create(
            model=SMOL,
            prompt=prompt,
            max_tokens=3,
            echo=True,
            logprobs=1,
            temperature=0,
            stream=True,
        )
    )
    first = chunks[0].choices[0]
    assert first.text == prompt and first.logprobs
    assert first.logprobs.tokens == lp.tokens[:n_prompt]
    offsets = [
        o
        for ch in chunks
        if ch.choices[0].logprobs
        for o in ch.choices[0].logprobs.text_offset or ()
    ]
    assert offsets == lp.text_offset


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"logprobs": 6}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": True}, "logprobs"),
        ({"logprobs": "2"}, "logprobs"),
        ({"echo": 1}, "echo"),
        ({"echo": "yes"}, "echo"),
        ({"seed": "1"}, "seed"),
        ({"stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
        ({"echo": True, "prompt": [["a"]]}, "prompt"),
    ],
)
def test_bad_completion_fields_are_400(
    http: httpx.Client, extra: dict[str, Any], param: str
) -> None:
    err = error_of(http.post("/v1/completions", json={"model": "tiny", "prompt": "x", **extra}))
    assert err["param"] == param and f"'{param}'" in err["message"]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"logprobs": 1}, "logprobs"),
        ({"top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": "3"}, "top_logprobs"),
        ({"seed": 1.5}, "seed"),
        ({"stream_options": []}, "stream_options"),
    ],
)
def test_bad_chat_fields_are_400(http: httpx.Client, extra: dict[str, Any], param: str) -> None:
    err = error_of(
        http.post("/v1/chat/completions", json={"model": "tiny", "messages": HI, **extra})
    )
    assert err["param"] == param and f"'{param}'" in err["message"]


# ---- embeddings ----------------------------------------------------------------------------


def test_embeddings_base64_is_little_endian_float32(openai_client: openai.OpenAI) -> None:
    embed = openai_client.embeddings.create
    floats = embed(model="embed", input=["a", "b"], encoding_format="float")
    b64 = embed(model="embed", input=["a", "b"], encoding_format="base64")
    for f, b in zip(floats.data, b64.data, strict=True):
        assert isinstance(b.embedding, str)
        decoded = np.frombuffer(base64.b64decode(b.embedding), dtype="<f4")
        assert decoded.shape == (64,)
        np.testing.assert_allclose(decoded, np.asarray(f.embedding, dtype=np.float32), rtol=1e-6)
    # The client's default (base64, decoded by the client) gives the same vectors.
    default = openai_client.embeddings.create(model="embed", input=["a", "b"])
    for f, d in zip(floats.data, default.data, strict=True):
        np.testing.assert_allclose(d.embedding, f.embedding, rtol=1e-6)


@pytest.mark.parametrize("fmt", ["float", "base64"])
def test_embeddings_dimensions(openai_client: openai.OpenAI, fmt: Any) -> None:
    full = openai_client.embeddings.create(model="embed", input=["a", "b"], encoding_format="float")
    r = openai_client.embeddings.create(
        model="embed", input=["a", "b"], dimensions=8, encoding_format=fmt
    )
    assert [d.index for d in r.data] == [0, 1] and r.usage.prompt_tokens == full.usage.prompt_tokens
    for d, f in zip(r.data, full.data, strict=True):
        vec = (
            np.frombuffer(base64.b64decode(d.embedding), dtype="<f4")
            if fmt == "base64"
            else np.asarray(d.embedding)
        )
        assert vec.shape == (8,)
        assert math.isclose(float(np.linalg.norm(vec)), 1.0, rel_tol=1e-5)
        # The leading dimensions, renormalised (Matryoshka truncation).
        head = np.asarray(f.embedding[:8])
        np.testing.assert_allclose(vec, head / np.linalg.norm(head), rtol=1e-5, atol=1e-6)
    # More dimensions than the model has: all of them.
    big = openai_client.embeddings.create(
        model="embed", input="a", dimensions=10_000, encoding_format="float"
    )
    np.testing.assert_allclose(big.data[0].embedding, full.data[0].embedding, rtol=1e-6)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"dimensions": 0}, "dimensions"),
        ({"dimensions": -3}, "dimensions"),
        ({"dimensions": "8"}, "dimensions"),
        ({"dimensions": 8.5}, "dimensions"),
        ({"dimensions": True}, "dimensions"),
        ({"encoding_format": "hex"}, "encoding_format"),
        ({"encoding_format": 1}, "encoding_format"),
    ],
)
def test_bad_embedding_fields_are_400(
    http: httpx.Client, extra: dict[str, Any], param: str
) -> None:
    err = error_of(http.post("/v1/embeddings", json={"model": "embed", "input": "a", **extra}))
    assert err["param"] == param and f"'{param}'" in err["message"]


# ---- images --------------------------------------------------------------------------------


IMAGE_MESSAGES: Any = [
    {
        "role": "user",
        "content": [
            {"type": "text", "text": "What is this?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
        ],
    }
]


@pytest.mark.parametrize("extra", [{}, {"stream": True}, {"n": 2}])
def test_images_to_a_model_without_a_projector_are_400(
    openai_client: openai.OpenAI, extra: dict[str, Any]
) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        openai_client.chat.completions.create(model="tiny", messages=IMAGE_MESSAGES, **extra)
    body = e.value.body
    assert isinstance(body, dict) and body["param"] == "messages"
    assert body["type"] == "invalid_request_error"
    assert "does not support images" in body["message"] and "'tiny'" in body["message"]


# ---- leaving early -------------------------------------------------------------------------


def in_flight(server, model: str) -> int:
    return sum(m["requests_in_flight"] for m in server.ps() if m["name"] == model)


def test_a_client_that_leaves_stops_every_choice(server, http: httpx.Client) -> None:
    # Two 400-token SmolLM2 generations (llama.cpp's ignore_eos: no early end) take seconds on
    # a CPU; leaving must stop both at once.
    body = {"model": SMOL, "messages": HI, "max_tokens": 400, "n": 2, "stream": True,
            "ignore_eos": True}  # fmt: skip
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # kept: dropping the iterator closes the response
        next(lines)
        assert in_flight(server, SMOL) >= 1
    server.wait_for(lambda: in_flight(server, SMOL) == 0, 3.0, "streamed choices stop")
    with pytest.raises(httpx.ReadTimeout):
        http.post("/v1/chat/completions", json={**body, "stream": False}, timeout=0.5)
    server.wait_for(lambda: in_flight(server, SMOL) == 0, 3.0, "whole choices stop")


def test_legacy_offsets_count_characters() -> None:
    # Tokens holding parts of one UTF-8 character (llama.cpp gives their bytes) add no
    # characters until it completes: offsets index the returned text.
    from corral.api.families.openai.render import Legacy

    legacy = Legacy([], 1, False)
    content = [
        {"token": "h", "bytes": [104], "logprob": -1.0, "top_logprobs": []},
        {"token": "\ufffd", "bytes": [230], "logprob": -2.0, "top_logprobs": []},
        {"token": "\ufffd", "bytes": [151, 165], "logprob": -3.0, "top_logprobs": []},
        {"token": "!", "bytes": [33], "logprob": -0.5, "top_logprobs": []},
    ]
    data = {"choices": [{"index": 0, "text": "h日!", "logprobs": {"content": content}}]}
    legacy.whole(data)
    lp = data["choices"][0]["logprobs"]
    assert lp["text_offset"] == [0, 1, 1, 2]
    assert lp["token_logprobs"] == [-1.0, -2.0, -3.0, -0.5]
    assert lp["top_logprobs"][3] == {"!": -0.5}
