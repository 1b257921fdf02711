"""The Anthropic Messages API: the real `anthropic` Python client against a running corral
server, raw SSE and error bodies with httpx, and the pure request/stream translation."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import anthropic
import httpx
import orjson
import pytest

from corral.api.chat import Done, Event, Text, Thinking, ToolCall, Usage
from corral.api.families.anthropic.protocol import to_chat
from corral.api.families.anthropic.render import sse_stream
from corral.errors import ApiError

SMOL = "smollm2:135m"
# Random-weight models only finish a forced call when the schema bounds every string and closes
# every object; a real tool schema would not need to.
WEATHER: dict[str, Any] = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 12},
            "unit": {"enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}
HI = [{"role": "user", "content": "Say hello."}]
# The SDK no longer has sampling parameters; the API (and corral) still take them.
GREEDY: dict[str, Any] = {"extra_body": {"temperature": 0}}


def raw_events(http: httpx.Client, body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) of every SSE event, checking that the name and data.type agree."""
    out = []
    with http.stream("POST", "/v1/messages", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        text = r.read().decode()
    for chunk in text.split("\n\n"):
        if not chunk.strip():
            continue
        name_line, data_line = chunk.split("\n")
        name, data = name_line.removeprefix("event: "), orjson.loads(data_line[6:])
        assert data["type"] == name
        out.append((name, data))
    return out


# ---- text ----------------------------------------------------------------------------------
def test_message(anthropic_client: anthropic.Anthropic) -> None:
    r = anthropic_client.messages.create(model=SMOL, max_tokens=8, messages=HI, **GREEDY)
    assert r.type == "message" and r.role == "assistant" and r.id.startswith("msg_")
    assert r.model == SMOL
    assert [b.type for b in r.content] == ["text"]
    assert r.content[0].type == "text" and r.content[0].text.strip()
    assert r.stop_reason in ("end_turn", "max_tokens") and r.stop_sequence is None
    assert 0 < r.usage.output_tokens <= 8
    assert r.usage.input_tokens + (r.usage.cache_read_input_tokens or 0) > 0
    assert r.usage.cache_creation_input_tokens == 0


def test_max_tokens_stop(anthropic_client: anthropic.Anthropic) -> None:
    r = anthropic_client.messages.create(
        model=SMOL, max_tokens=3, **GREEDY,
        messages=[{"role": "user", "content": "Write a long story about a dragon."}],
    )  # fmt: skip
    assert r.stop_reason == "max_tokens" and r.usage.output_tokens == 3


def test_stop_sequence(anthropic_client: anthropic.Anthropic) -> None:
    r = anthropic_client.messages.create(
        model=SMOL, max_tokens=40, **GREEDY, stop_sequences=["e"],
        messages=[{"role": "user", "content": "Describe the sea in one sentence."}],
    )  # fmt: skip
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == "e"
    assert all(b.type == "text" and "e" not in b.text for b in r.content)
    assert r.usage.output_tokens < 40


def test_prefill(anthropic_client: anthropic.Anthropic) -> None:
    # A last assistant turn is continued, not answered.
    r = anthropic_client.messages.create(
        model=SMOL, max_tokens=4, **GREEDY, messages=[
            {"role": "user", "content": "Count to five."},
            {"role": "assistant", "content": [{"type": "text", "text": "1, 2,"}]},
        ],
    )  # fmt: skip
    assert r.content[0].type == "text" and r.content[0].text.lstrip().startswith("3")


def test_system_string_and_blocks(anthropic_client: anthropic.Anthropic) -> None:
    plain = anthropic_client.messages.create(
        model=SMOL, max_tokens=4, **GREEDY, system="You answer in French.", messages=HI
    )
    blocks = anthropic_client.messages.create(
        model=SMOL, max_tokens=4, **GREEDY, messages=HI,
        system=[{"type": "text", "text": "You answer in French."}],
    )  # fmt: skip
    default = anthropic_client.messages.create(model=SMOL, max_tokens=4, **GREEDY, messages=HI)

    def prompt(m: anthropic.types.Message) -> int:
        return m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0)

    # SmolLM2's template adds a default system prompt only when the request has none.
    assert prompt(plain) == prompt(blocks) != prompt(default)


def test_stream_final_message(anthropic_client: anthropic.Anthropic) -> None:
    with anthropic_client.messages.stream(model=SMOL, max_tokens=8, messages=HI, **GREEDY) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text.strip()
    assert final.model == SMOL and final.content[0].type == "text"
    assert final.content[0].text == text
    assert final.stop_reason in ("end_turn", "max_tokens")
    assert 0 < final.usage.output_tokens <= 8
    assert final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0) > 0


def test_stream_event_order(anthropic_client: anthropic.Anthropic, http: httpx.Client) -> None:
    story = [{"role": "user", "content": "Write a long story about a dragon."}]
    events = raw_events(http, {"model": SMOL, "max_tokens": 6, "messages": story})
    names = [n for n, _ in events]
    assert names[:2] == ["message_start", "ping"]
    assert names[2] == "content_block_start"
    assert names[-4:] == ["content_block_delta", "content_block_stop", "message_delta",
                          "message_stop"]  # fmt: skip
    assert set(names[3:-3]) == {"content_block_delta"}
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["model"] == SMOL
    assert start["usage"]["input_tokens"] > 0  # counted before the first token
    assert events[2][1] == {
        "type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""},
    }  # fmt: skip
    assert all(d["index"] == 0 and d["delta"]["type"] == "text_delta" for _, d in events[3:-3])
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == 6
    u = delta["usage"]
    assert u["input_tokens"] + u["cache_read_input_tokens"] == start["usage"]["input_tokens"]
    # The SDK's raw stream reads the same events.
    raw = anthropic_client.messages.create(model=SMOL, max_tokens=6, messages=story, stream=True)
    assert [e.type for e in raw] == [n for n in names if n != "ping"]


# ---- tools ---------------------------------------------------------------------------------
def test_forced_tool_use(anthropic_client: anthropic.Anthropic) -> None:
    r = anthropic_client.messages.create(
        model="tools", max_tokens=64, **GREEDY, tools=[WEATHER],
        tool_choice={"type": "any"},
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
    )  # fmt: skip
    assert r.stop_reason == "tool_use"
    calls = [b for b in r.content if b.type == "tool_use"]
    assert len(calls) == 1
    call = calls[0]
    assert call.type == "tool_use" and call.id.startswith("toolu_")
    assert call.name == "get_weather"
    assert isinstance(call.input, dict) and set(call.input) == {"city", "unit"}
    assert call.input["unit"] in ("celsius", "fahrenheit")


def test_forced_tool_use_streamed(
    anthropic_client: anthropic.Anthropic, http: httpx.Client
) -> None:
    body: dict[str, Any] = {
        "model": "tools", "max_tokens": 64, "tools": [WEATHER],
        "tool_choice": {"type": "tool", "name": "get_weather"},
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
    }  # fmt: skip
    events = raw_events(http, {**body, "temperature": 0})
    start = next(d for n, d in events if n == "content_block_start")
    assert start["content_block"]["type"] == "tool_use"
    assert start["content_block"]["name"] == "get_weather" and start["content_block"]["input"] == {}
    parts = [d["delta"]["partial_json"] for n, d in events if n == "content_block_delta"]
    assert set(orjson.loads("".join(parts))) == {"city", "unit"}
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"
    # The SDK's helper assembles the input from the input_json_delta events.
    with anthropic_client.messages.stream(**body, **GREEDY) as s:
        final = s.get_final_message()
    assert final.stop_reason == "tool_use" and final.content[-1].type == "tool_use"
    assert set(final.content[-1].input) == {"city", "unit"}


HISTORY: list[dict[str, Any]] = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "I should call the tool.", "signature": "sig"},
        {"type": "text", "text": "Let me check."},
        {"type": "tool_use", "id": "toolu_01", "name": "get_weather",
         "input": {"city": "Paris", "unit": "celsius"}},
    ]},
    {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_01",
         "content": [{"type": "text", "text": "Sunny and 21 degrees celsius"}]},
        {"type": "text", "text": "Thanks! Anything else?"},
    ]},
]  # fmt: skip


def test_tool_history(anthropic_client: anthropic.Anthropic) -> None:
    r = anthropic_client.messages.create(
        model="tools", max_tokens=5, tools=[WEATHER], messages=HISTORY
    )
    # Random weights with tool_choice auto answer in text (or whitespace, which llama.cpp's
    # tool-call parser trims); what matters is that the history with its tool call and result
    # went through the model's template.
    assert r.stop_reason in ("end_turn", "max_tokens", "tool_use") and r.usage.output_tokens
    count = anthropic_client.messages.count_tokens
    first = count(model="tools", tools=[WEATHER], messages=HISTORY[:1])
    whole = count(model="tools", tools=[WEATHER], messages=HISTORY)
    assert whole.input_tokens > first.input_tokens + 20


def test_error_tool_result(anthropic_client: anthropic.Anthropic) -> None:
    history = [*HISTORY[:2], {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_01", "content": "city not found",
         "is_error": True},
    ]}]  # fmt: skip
    r = anthropic_client.messages.create(
        model="tools", max_tokens=3, tools=[WEATHER], messages=history
    )
    assert r.usage.output_tokens <= 3


def test_to_chat_history() -> None:
    chat = to_chat({"system": [{"type": "text", "text": "Be brief."}], "messages": HISTORY,
                    "tools": [WEATHER], "tool_choice": {"type": "any"}})  # fmt: skip
    assert chat.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": "Let me check.", "tool_calls": [
            {"id": "toolu_01", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city":"Paris","unit":"celsius"}'}},
        ]},
        {"role": "tool", "tool_call_id": "toolu_01", "content": "Sunny and 21 degrees celsius"},
        {"role": "user", "content": "Thanks! Anything else?"},
    ]  # fmt: skip
    assert chat.tools == [{"type": "function", "function": {
        "name": "get_weather", "parameters": WEATHER["input_schema"],
        "description": WEATHER["description"],
    }}]  # fmt: skip
    assert chat.tool_choice == "required"
    assert chat.params["chat_template_kwargs"] == {"enable_thinking": False}
    named = to_chat({"messages": HI, "tools": [WEATHER],
                     "tool_choice": {"type": "tool", "name": "get_weather",
                                     "disable_parallel_tool_use": True}})  # fmt: skip
    assert named.tool_choice == "get_weather" and named.params["parallel_tool_calls"] is False
    image = to_chat({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}},
        {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}},
    ]}]})  # fmt: skip
    assert image.messages[0]["content"] == [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}},
        {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
    ]


# ---- thinking ------------------------------------------------------------------------------
def test_thinking(anthropic_client: anthropic.Anthropic) -> None:
    r = anthropic_client.messages.create(
        model="think", max_tokens=6, messages=HI,
        thinking={"type": "enabled", "budget_tokens": 1024},
    )  # fmt: skip
    assert r.content and r.content[0].type == "thinking"
    assert r.content[0].thinking and r.content[0].signature == ""
    off = anthropic_client.messages.create(
        model="think", max_tokens=6, messages=HI, thinking={"type": "disabled"}
    )
    assert all(b.type != "thinking" for b in off.content)
    default = anthropic_client.messages.create(model="think", max_tokens=6, messages=HI)
    assert all(b.type != "thinking" for b in default.content)


def test_thinking_omitted(anthropic_client: anthropic.Anthropic, http: httpx.Client) -> None:
    omitted = {"type": "enabled", "budget_tokens": 1024, "display": "omitted"}
    r = anthropic_client.messages.create(model="think", max_tokens=4, messages=HI, thinking=omitted)
    assert r.content == [] and r.stop_reason == "max_tokens"  # all of it was reasoning
    events = raw_events(http, {"model": "think", "max_tokens": 4, "messages": HI,
                               "thinking": omitted})  # fmt: skip
    assert [n for n, _ in events] == ["message_start", "ping", "message_delta", "message_stop"]


def test_thinking_streamed(anthropic_client: anthropic.Anthropic) -> None:
    with anthropic_client.messages.stream(
        model="think", max_tokens=6, messages=HI,
        thinking={"type": "enabled", "budget_tokens": 1024},
    ) as s:  # fmt: skip
        kinds = [e.delta.type for e in s if e.type == "content_block_delta"]
        final = s.get_final_message()
    assert "thinking_delta" in kinds and kinds[-1] == "signature_delta"
    assert final.content[0].type == "thinking" and final.content[0].thinking


# ---- structured output --------------------------------------------------------------------
def test_output_config_format(anthropic_client: anthropic.Anthropic) -> None:
    schema = {
        "type": "object",
        "properties": {"colour": {"enum": ["red", "green", "blue"]}},
        "required": ["colour"],
        "additionalProperties": False,
    }
    r = anthropic_client.messages.create(
        model=SMOL, max_tokens=30, **GREEDY,
        messages=[{"role": "user", "content": "Name a colour, as JSON."}],
        output_config={"format": {"type": "json_schema", "schema": schema}},
    )  # fmt: skip
    assert r.content[0].type == "text"
    assert orjson.loads(r.content[0].text)["colour"] in ("red", "green", "blue")


# ---- counting ------------------------------------------------------------------------------
def test_count_tokens(anthropic_client: anthropic.Anthropic) -> None:
    short = anthropic_client.messages.count_tokens(model=SMOL, messages=HI).input_tokens
    long = anthropic_client.messages.count_tokens(
        model=SMOL, messages=[{"role": "user", "content": "Say hello. " * 20}]
    ).input_tokens
    assert isinstance(short, int) and 0 < short < long
    with_system = anthropic_client.messages.count_tokens(
        model="tools", messages=HI, system="Be brief."
    ).input_tokens
    with_tools = anthropic_client.messages.count_tokens(
        model="tools", messages=HI, system="Be brief.", tools=[WEATHER]
    ).input_tokens
    assert 0 < with_system < with_tools
    r = anthropic_client.messages.create(model=SMOL, max_tokens=2, messages=HI)
    assert r.usage.input_tokens + (r.usage.cache_read_input_tokens or 0) == short


# ---- errors --------------------------------------------------------------------------------
def test_unknown_model(anthropic_client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.NotFoundError) as e:
        anthropic_client.messages.create(model="nope", max_tokens=5, messages=HI)
    body = e.value.body
    assert isinstance(body, dict) and body["type"] == "error"
    assert body["error"]["type"] == "not_found_error" and "nope" in body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError):
        anthropic_client.messages.count_tokens(model="nope", messages=HI)


def test_images_need_a_projector(anthropic_client: anthropic.Anthropic) -> None:
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "iVBORw0KGgo="}}  # fmt: skip
    messages = [{"role": "user", "content": [image, {"type": "text", "text": "What is it?"}]}]
    with pytest.raises(anthropic.BadRequestError) as e:
        anthropic_client.messages.create(model=SMOL, max_tokens=5, messages=messages)
    body = e.value.body
    assert isinstance(body, dict) and body["error"]["type"] == "invalid_request_error"
    assert "does not support images" in body["error"]["message"]


def test_model_without_chat(anthropic_client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError) as e:
        anthropic_client.messages.create(model="embed", max_tokens=5, messages=HI)
    assert "does not support chat" in str(e.value)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b'{"model": "smollm2:135m", "max_tokens": 5,', "invalid JSON"),
        (b"[1, 2]", "JSON object"),
        (b'{"model": "smollm2:135m", "messages": [{"role": "user", "content": "x"}]}',
         "max_tokens: Field required"),
        (b'{"model": "smollm2:135m", "max_tokens": 0, "messages": []}', "max_tokens"),
        (b'{"model": "smollm2:135m", "max_tokens": "5", "messages": []}', "max_tokens"),
        (b'{"model": 5, "max_tokens": 5, "messages": []}', "model"),
        (b'{"model": "smollm2:135m", "max_tokens": 5, "messages": "hi"}', "messages"),
        (b'{"model": "smollm2:135m", "max_tokens": 5, "messages": []}', "messages"),
        (b'{"model": "smollm2:135m", "max_tokens": 5, '
         b'"messages": [{"role": "system", "content": "x"}]}', "at least one user or assistant"),
        (b'{"model": "smollm2:135m", "max_tokens": 5, '
         b'"messages": [{"role": "tool", "content": "x"}]}', "messages.0.role"),
        (b'{"model": "smollm2:135m", "max_tokens": 5, '
         b'"messages": [{"role": "user", "content": [{"type": "video"}]}]}',
         "messages.0.content.0"),
        (b'{"model": "smollm2:135m", "max_tokens": 5, "temperature": 3, '
         b'"messages": [{"role": "user", "content": "x"}]}', "temperature"),
        (b'{"model": "smollm2:135m", "max_tokens": 5, "stop_sequences": [1], '
         b'"messages": [{"role": "user", "content": "x"}]}', "stop_sequences"),
        (b'{"model": "smollm2:135m", "max_tokens": 5, "tool_choice": {"type": "any"}, '
         b'"messages": [{"role": "user", "content": "x"}]}', "tool_choice"),
        (b'{"model": "smollm2:135m", "max_tokens": 5, "thinking": {"type": "enabled"}, '
         b'"messages": [{"role": "user", "content": "x"}]}', "budget_tokens"),
        (b'{"model": "smollm2:135m", "max_tokens": 5, "output_config": {"format": {}}, '
         b'"messages": [{"role": "user", "content": "x"}]}', "output_config.format"),
    ],
)  # fmt: skip
def test_bad_requests(http: httpx.Client, body: bytes, message: str) -> None:
    r = http.post(
        "/v1/messages", content=body,
        headers={"x-api-key": "x", "anthropic-version": "2023-06-01",
                 "content-type": "application/json"},
    )  # fmt: skip
    assert r.status_code == 400, r.text
    data = r.json()
    assert data["type"] == "error" and data["error"]["type"] == "invalid_request_error"
    assert message in data["error"]["message"]


def test_bad_count_tokens(http: httpx.Client) -> None:
    r = http.post("/v1/messages/count_tokens", json={"model": SMOL, "messages": "x"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


# ---- the stream renderer -------------------------------------------------------------------
async def _events(items: list[Event], fail: ApiError | None = None) -> AsyncIterator[Event]:
    for ev in items:
        yield ev
    if fail is not None:
        raise fail


def _render(items: list[Event], fail: ApiError | None = None) -> list[tuple[str, Any]]:
    async def run() -> list[bytes]:
        return [c async for c in sse_stream(_events(items, fail), "m", 7)]

    out = []
    for chunk in asyncio.run(run()):
        name, data = chunk.decode().removesuffix("\n\n").split("\n")
        out.append((name.removeprefix("event: "), orjson.loads(data.removeprefix("data: "))))
    return out


def test_stream_blocks_in_order() -> None:
    events = _render([
        Thinking("hm"), Thinking("m"), Text("Let me "), Text("look."),
        ToolCall(0, "call_1", "get_weather", ""), ToolCall(0, arguments='{"city":'),
        ToolCall(0, arguments='"Paris"}'), ToolCall(1, "call_2", "get_time", "{}"),
        Done("tool_calls", Usage(prompt_tokens=7, completion_tokens=9, cached_tokens=4)),
    ])  # fmt: skip
    starts = [(d["index"], d["content_block"]["type"]) for n, d in events
              if n == "content_block_start"]  # fmt: skip
    assert starts == [(0, "thinking"), (1, "text"), (2, "tool_use"), (3, "tool_use")]
    stops = [d["index"] for n, d in events if n == "content_block_stop"]
    assert stops == [0, 1, 2, 3]
    deltas = [(d["index"], d["delta"]) for n, d in events if n == "content_block_delta"]
    assert deltas[:3] == [
        (0, {"type": "thinking_delta", "thinking": "hm"}),
        (0, {"type": "thinking_delta", "thinking": "m"}),
        (0, {"type": "signature_delta", "signature": ""}),
    ]
    assert [d["partial_json"] for i, d in deltas if i == 2] == ['{"city":', '"Paris"}']
    assert events[-2][1] == {
        "type": "message_delta",
        "delta": {"stop_reason": "tool_use", "stop_sequence": None},
        "usage": {"input_tokens": 3, "output_tokens": 9, "cache_creation_input_tokens": 0,
                  "cache_read_input_tokens": 4},
    }  # fmt: skip
    assert events[0][1]["message"]["usage"]["input_tokens"] == 7


def test_stream_failure_becomes_error_event() -> None:
    events = _render([Text("partial")], ApiError(500, "runner died"))
    assert [n for n, _ in events] == [
        "message_start", "ping", "content_block_start", "content_block_delta", "error",
    ]  # fmt: skip
    assert events[-1][1] == {
        "type": "error", "error": {"type": "api_error", "message": "runner died"},
    }  # fmt: skip
