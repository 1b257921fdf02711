"""The OpenAI Responses API (POST /v1/responses) with the real `openai` client, and its wire
format checked against the SDK's own types."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pydantic
import pytest
from openai.types.responses import Response, ResponseStreamEvent

from corral.api.common import ApiError
from corral.api.events import Done, Event, Text, Thinking, ToolCall, Usage
from corral.api.responses import Builder, parse_request
from corral.testing.server import CorralServer

SMOL = "smollm2:135m"
EVENTS: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(ResponseStreamEvent)

# Every argument is bounded (enums, an integer range, a boolean), so a call forced by the JSON
# schema is complete within a few tokens even from random weights.
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather forecast for a city.",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "enum": ["Paris", "London"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
            "hourly": {"type": "boolean"},
        },
        "required": ["city", "days", "hourly"],
        "additionalProperties": False,
    },
    "strict": True,
}
TIME = {
    "type": "function",
    "name": "get_time",
    "parameters": {
        "type": "object",
        "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
        "required": ["zone"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def client(server: CorralServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)


def check_weather_args(arguments: str) -> None:
    args = json.loads(arguments)
    assert set(args) == {"city", "days", "hourly"}
    assert args["city"] in ("Paris", "London")
    assert isinstance(args["days"], int) and 1 <= args["days"] <= 7
    assert isinstance(args["hourly"], bool)


def raw_stream(server: CorralServer, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The SSE events of a streamed response, each checked against the SDK's event types
    (the SDK itself parses without validating)."""
    events = []
    with server.client.stream("POST", "/v1/responses", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        kind = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                kind = line[7:]
            elif line.startswith("data: "):
                ev = json.loads(line[6:])
                assert ev["type"] == kind
                EVENTS.validate_python(ev)
                events.append(ev)
    return events


# ---- plain text --------------------------------------------------------------------------


def test_string_input(client: openai.OpenAI, server: CorralServer) -> None:
    r = client.responses.create(model=SMOL, input="Say hello.", max_output_tokens=16, temperature=0)
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.model == SMOL
    assert r.status in ("completed", "incomplete")
    assert r.output_text.strip()
    msg = r.output[-1]
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    assert msg.content[0].type == "output_text" and msg.content[0].annotations == []
    assert r.usage is not None
    assert r.usage.input_tokens > 0 and 0 < r.usage.output_tokens <= 16
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    assert r.temperature == 0 and r.max_output_tokens == 16 and r.error is None
    # The whole body is a valid Response by the SDK's (validating) types.
    body = server.client.post(
        "/v1/responses", json={"model": SMOL, "input": "Hi", "max_output_tokens": 4}
    ).json()
    Response.model_validate(body)


def test_list_input_with_instructions_and_system_messages(client: openai.OpenAI) -> None:
    question = {"role": "user", "content": [{"type": "input_text", "text": "Name a colour."}]}
    bare = client.responses.create(model=SMOL, input=[question], max_output_tokens=4)
    r = client.responses.create(
        model=SMOL,
        instructions="You are a terse assistant.",
        input=[
            {"role": "developer", "content": "Answer in one word."},
            {"type": "message", "role": "system", "content": "Never apologise."},
            {"role": "user", "content": "Hello."},
            {"role": "assistant", "content": [{"type": "output_text", "text": "Hi."}]},
            question,
        ],
        max_output_tokens=4,
        metadata={"run": "1"},
        store=True,
        user="tester",
    )
    assert r.output_text
    assert r.instructions == "You are a terse assistant."
    assert r.metadata == {"run": "1"} and r.user == "tester"
    # Instructions and every earlier message reached the prompt.
    assert r.usage and bare.usage
    assert r.usage.input_tokens > bare.usage.input_tokens + 10


def test_max_output_tokens_makes_it_incomplete(client: openai.OpenAI) -> None:
    r = client.responses.create(
        model=SMOL, input="Write a long story about a dragon.", max_output_tokens=3
    )
    assert r.status == "incomplete"
    assert r.incomplete_details and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage and r.usage.output_tokens == 3
    assert r.output[-1].type == "message" and r.output[-1].status == "incomplete"


def test_streamed_text_events(client: openai.OpenAI, server: CorralServer) -> None:
    events = list(
        client.responses.create(
            model=SMOL, input="Count to five.", max_output_tokens=10, temperature=0, stream=True
        )
    )
    types = [e.type for e in events]
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert types[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",  # 10 tokens do not reach five
    ]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    created, final = events[0].response, events[-1].response
    assert created.status == "in_progress" and created.output == [] and created.id == final.id
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = next(e for e in events if e.type == "response.output_text.done")
    assert deltas and deltas == done.text == final.output_text
    item_ids = {e.item_id for e in events if hasattr(e, "item_id")}
    assert item_ids == {final.output[0].id}
    assert final.usage and final.usage.output_tokens == 10
    # The same stream on the wire: every event valid by the SDK's types, named by its type.
    raw = raw_stream(server, {"model": SMOL, "input": "Hi", "max_output_tokens": 3})
    assert raw[-1]["type"] in ("response.completed", "response.incomplete")


def test_stream_helper(client: openai.OpenAI) -> None:
    with client.responses.stream(
        model=SMOL, input="Say hi.", max_output_tokens=40, temperature=0,
        text={"format": {"type": "json_object"}},
    ) as stream:  # fmt: skip
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text
    json.loads(final.output_text)


def test_logprobs(client: openai.OpenAI, server: CorralServer) -> None:
    r = client.responses.create(
        model=SMOL, input="Hi", max_output_tokens=3, temperature=0, top_logprobs=2,
        include=["message.output_text.logprobs"],
    )  # fmt: skip
    part = r.output[0].content[0]  # type: ignore[union-attr]
    assert part.type == "output_text" and part.logprobs and len(part.logprobs) == 3
    assert "".join(lp.token for lp in part.logprobs) == part.text
    assert all(len(lp.top_logprobs) == 2 and lp.logprob <= 0 for lp in part.logprobs)
    assert r.top_logprobs == 2
    events = raw_stream(
        server, {"model": SMOL, "input": "Hi", "max_output_tokens": 2,
                 "include": ["message.output_text.logprobs"]},
    )  # fmt: skip
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert all(len(e["logprobs"]) == 1 and e["logprobs"][0]["top_logprobs"] == [] for e in deltas)


# ---- structured output -------------------------------------------------------------------


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=12)
    age: int = pydantic.Field(ge=0, le=120)


def test_json_schema_format(client: openai.OpenAI) -> None:
    r = client.responses.create(
        model=SMOL,
        input="Invent a person: give a name and an age.",
        max_output_tokens=60,
        temperature=0,
        text={
            "format": {
                "type": "json_schema",
                "name": "person",
                "schema": Person.model_json_schema() | {"additionalProperties": False},
                "strict": True,
            }
        },
    )
    assert r.status == "completed"
    person = Person.model_validate_json(r.output_text)
    assert person.name and 0 <= person.age <= 120
    assert r.text and r.text.format and r.text.format.type == "json_schema"
    # The SDK's parse helper builds the same request from a pydantic model.
    parsed = client.responses.parse(
        model=SMOL, input="Invent a person.", max_output_tokens=60, text_format=Person
    )
    assert isinstance(parsed.output_parsed, Person)


# ---- function calls ----------------------------------------------------------------------


def test_forced_function_call(client: openai.OpenAI) -> None:
    r = client.responses.create(
        model="tools",
        input="What is the weather in Paris this week?",
        tools=[WEATHER, TIME],  # type: ignore[list-item]
        tool_choice="required",
        max_output_tokens=60,
    )
    assert r.status == "completed"
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1
    call = calls[0]
    assert call.id and call.id.startswith("fc_") and call.call_id.startswith("call_")
    assert call.status == "completed" and call.name in ("get_weather", "get_time")
    args = json.loads(call.arguments)
    if call.name == "get_weather":
        check_weather_args(call.arguments)
    else:
        assert args in ({"zone": "UTC"}, {"zone": "CET"})
    assert r.tool_choice == "required"
    assert [t.name for t in r.tools] == ["get_weather", "get_time"]  # type: ignore[union-attr]

    named = client.responses.create(
        model="tools",
        input="Weather?",
        tools=[WEATHER, TIME],  # type: ignore[list-item]
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=60,
    )
    (call,) = named.output
    assert call.type == "function_call" and call.name == "get_weather"
    check_weather_args(call.arguments)
    assert named.tool_choice.type == "function"  # type: ignore[union-attr]


def test_forced_function_call_streamed(server: CorralServer) -> None:
    events = raw_stream(
        server,
        {"model": "tools", "input": "Weather in London?", "tools": [WEATHER],
         "tool_choice": {"type": "function", "name": "get_weather"}, "max_output_tokens": 60},
    )  # fmt: skip
    types = [e["type"] for e in events]
    assert types[2] == "response.output_item.added"
    assert events[2]["item"]["type"] == "function_call"
    assert events[2]["item"]["name"] == "get_weather"
    assert "response.function_call_arguments.delta" in types
    assert types[-3:] == [
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    deltas = "".join(e["delta"] for e in events if "arguments.delta" in e["type"])
    done = events[-3]["arguments"]
    final = events[-1]["response"]["output"][0]
    assert deltas == done == final["arguments"] == events[-2]["item"]["arguments"]
    check_weather_args(done)
    assert final["id"] == events[2]["item"]["id"] and final["call_id"].startswith("call_")


def test_stream_helper_with_function_call(client: openai.OpenAI) -> None:
    with client.responses.stream(
        model="tools", input="Weather?", tools=[WEATHER],  # type: ignore[list-item]
        tool_choice="required", max_output_tokens=60,
    ) as stream:  # fmt: skip
        done = [e for e in stream if e.type == "response.function_call_arguments.done"]
        final = stream.get_final_response()
    (call,) = final.output
    assert call.type == "function_call" and done[0].arguments == call.arguments
    check_weather_args(call.arguments)


def test_follow_up_with_function_call_output(client: openai.OpenAI) -> None:
    question = {"role": "user", "content": "What is the weather in Paris?"}
    first = client.responses.create(
        model="tools", input=[question], tools=[WEATHER],  # type: ignore[list-item]
        tool_choice="required", max_output_tokens=60,
    )  # fmt: skip
    (call,) = first.output
    assert call.type == "function_call"
    # The client sends the call back as the model wrote it, with its result.
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 24C."}
    second = client.responses.create(
        model="tools",
        input=[question, *first.output, result],  # type: ignore[list-item]
        tools=[WEATHER],  # type: ignore[list-item]
        max_output_tokens=8,
    )
    assert second.status in ("completed", "incomplete")
    assert second.output and second.output[0].type in ("message", "function_call")
    # The call and its output were rendered into the prompt.
    assert second.usage and first.usage
    assert second.usage.input_tokens > first.usage.input_tokens + 15
    # A plain function_call (as a client would write one itself) works as well.
    again = client.responses.create(
        model="tools",
        input=[
            question,
            {"type": "function_call", "call_id": "call_1", "name": "get_weather",
             "arguments": '{"city": "Paris", "days": 1, "hourly": false}'},
            {"type": "function_call_output", "call_id": "call_1",
             "output": [{"type": "input_text", "text": "Rain."}]},
        ],  # type: ignore[list-item]
        max_output_tokens=4,
    )  # fmt: skip
    assert again.output


# ---- reasoning ---------------------------------------------------------------------------


def test_reasoning_item(client: openai.OpenAI, server: CorralServer) -> None:
    # The "think" template opens <think>: everything a random model writes is reasoning.
    r = client.responses.create(model="think", input="Hi", max_output_tokens=6)
    item = r.output[0]
    assert item.type == "reasoning" and item.id.startswith("rs_") and item.summary == []
    assert item.content and item.content[0].type == "reasoning_text" and item.content[0].text
    assert r.usage and r.usage.output_tokens_details.reasoning_tokens > 0
    assert r.output_text == ""

    # Effort "none" turns thinking off: the answer is text.
    off = client.responses.create(
        model="think", input="Hi", max_output_tokens=6, reasoning={"effort": "none"}
    )
    assert [o.type for o in off.output] == ["message"] and off.output_text
    assert off.reasoning and off.reasoning.effort == "none"

    events = raw_stream(
        server, {"model": "think", "input": "Hi", "max_output_tokens": 6,
                 "reasoning": {"effort": "high"}},
    )  # fmt: skip
    types = [e["type"] for e in events]
    assert types[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert events[3]["part"] == {"type": "reasoning_text", "text": ""}
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    done = next(e for e in events if e["type"] == "response.reasoning_text.done")
    assert deltas and deltas == done["text"]
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == deltas


# ---- input items as chat messages (no server) -------------------------------------------


def test_input_items_become_chat_messages() -> None:
    req = parse_request({
        "model": "m", "instructions": "Be brief.",
        "input": [
            {"role": "developer", "content": "Use metric units."},
            {"role": "user", "content": [
                {"type": "input_text", "text": "Weather?"},
                {"type": "input_image", "image_url": "data:image/png;base64,AAAA"},
            ]},
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
             "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather",
             "arguments": '{"city":"Paris"}'},
            {"type": "function_call", "call_id": "call_2", "name": "get_time", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "Sunny"},
            {"type": "function_call_output", "call_id": "call_2",
             "output": [{"type": "input_text", "text": "noon"}]},
        ],
        "tools": [WEATHER, TIME], "tool_choice": {"type": "function", "name": "get_time"},
        "max_output_tokens": 9, "temperature": 0.5, "reasoning": {"effort": "minimal"},
        "text": {"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}}},
    })  # fmt: skip
    chat = req.chat
    assert chat.messages == [
        {"role": "system", "content": "Be brief.\n\nUse metric units."},
        {"role": "user", "content": [
            {"type": "text", "text": "Weather?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        ]},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}},
            {"id": "call_2", "type": "function",
             "function": {"name": "get_time", "arguments": "{}"}},
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny", "name": "get_weather"},
        {"role": "tool", "tool_call_id": "call_2", "content": "noon", "name": "get_time"},
    ]  # fmt: skip
    assert chat.tool_choice == "get_time"
    assert [t["function"]["name"] for t in chat.tools] == ["get_weather", "get_time"]
    assert chat.tools[0]["function"]["parameters"] == WEATHER["parameters"]
    assert chat.params == {
        "max_tokens": 9, "temperature": 0.5,
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": "w", "schema": {"type": "object"}}},
        "chat_template_kwargs": {"enable_thinking": False},
    }  # fmt: skip
    assert req.echo["tool_choice"] == {"type": "function", "name": "get_time"}
    assert parse_request(
        {"model": "m", "input": "x", "reasoning": {"effort": "xhigh"}}
    ).chat.params["chat_template_kwargs"] == {"enable_thinking": True, "reasoning_effort": "high"}


# ---- errors ------------------------------------------------------------------------------


def test_previous_response_id_is_refused(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=SMOL, input="x", previous_response_id="resp_123")
    assert "previous_response_id" in e.value.message
    assert isinstance(e.value.body, dict) and e.value.body["param"] == "previous_response_id"


def test_unsupported_tool_type_is_refused(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=SMOL, input="x", tools=[{"type": "web_search"}])
    assert "not supported" in e.value.message and "web_search" in e.value.message


def test_unknown_model_and_wrong_capability(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model="nope", input="x")
    assert isinstance(e.value.body, dict) and e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="embed", input="x")
    with pytest.raises(openai.BadRequestError):
        client.responses.create(
            model="tools", input="x", tools=[WEATHER],  # type: ignore[list-item]
            tool_choice={"type": "function", "name": "missing"},
        )  # fmt: skip


def test_malformed_json_is_400_in_openai_shape(server: CorralServer) -> None:
    r = server.client.post("/v1/responses", content=b'{"model": ')
    assert r.status_code == 400
    err = r.json()["error"]
    assert "invalid JSON" in err["message"] and err["type"] == "invalid_request_error"
    assert set(err) == {"message", "type", "param", "code"}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": 5, "input": "x"}, "model"),
        ({"model": SMOL}, "input"),
        ({"model": SMOL, "input": 5}, "input"),
        ({"model": SMOL, "input": []}, "input"),
        ({"model": SMOL, "input": [{"role": "robot", "content": "x"}]}, "input"),
        ({"model": SMOL, "input": [{"role": "user", "content": 3}]}, "input"),
        ({"model": SMOL, "input": [{"type": "function_call", "name": "f"}]}, "input"),
        ({"model": SMOL, "input": [{"type": "item_reference", "id": "msg_1"}]}, "input"),
        ({"model": SMOL, "input": "x", "stream": "yes"}, "stream"),
        ({"model": SMOL, "input": "x", "max_output_tokens": "many"}, "max_output_tokens"),
        ({"model": SMOL, "input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"model": SMOL, "input": "x", "temperature": "hot"}, "temperature"),
        ({"model": SMOL, "input": "x", "temperature": 3}, "temperature"),
        ({"model": SMOL, "input": "x", "tools": {}}, "tools"),
        ({"model": SMOL, "input": "x", "tools": [{"type": "function"}]}, "tools"),
        ({"model": SMOL, "input": "x", "tool_choice": "sometimes"}, "tool_choice"),
        ({"model": SMOL, "input": "x", "tool_choice": "required"}, "tool_choice"),
        ({"model": SMOL, "input": "x", "text": {"format": {"type": "xml"}}}, "text.format.type"),
        ({"model": SMOL, "input": "x", "text": {"format": {"type": "json_schema"}}},
         "text.format.schema"),
        ({"model": SMOL, "input": "x", "reasoning": {"effort": "extreme"}}, "reasoning.effort"),
        ({"model": SMOL, "input": "x", "metadata": {"a": 1}}, "metadata"),
        ({"model": SMOL, "input": "x", "conversation": "conv_1"}, "conversation"),
        ({"model": SMOL, "input": "x", "background": True}, "background"),
    ],
)  # fmt: skip
def test_bad_fields_are_400_naming_the_field(
    server: CorralServer, body: dict[str, Any], param: str
) -> None:
    r = server.client.post("/v1/responses", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert err["message"]


# ---- failures mid-stream -----------------------------------------------------------------


async def _events(*evs: Event, fail: str | None = None) -> AsyncIterator[Event]:
    for ev in evs:
        yield ev
    if fail is not None:
        raise ApiError(500, fail)


async def _render(b: Builder, events: AsyncIterator[Event]) -> list[dict[str, Any]]:
    out = []
    async for chunk in b.sse(events):
        head, data = chunk.decode().rstrip("\n").split("\n")
        ev = json.loads(data.removeprefix("data: "))
        assert head == f"event: {ev['type']}"
        EVENTS.validate_python(ev)
        out.append(ev)
    return out


async def test_failure_mid_stream_is_response_failed() -> None:
    b = Builder("m", {"tools": [], "tool_choice": "auto", "parallel_tool_calls": True})
    events = await _render(b, _events(Text("Hel"), Text("lo"), fail="runner died"))
    assert [e["type"] for e in events][-2:] == ["response.output_text.delta", "response.failed"]
    resp = events[-1]["response"]
    assert resp["status"] == "failed"
    assert resp["error"] == {"code": "server_error", "message": "runner died"}
    assert resp["output"][0]["status"] == "incomplete"
    assert resp["output"][0]["content"][0]["text"] == "Hello"


async def test_items_follow_the_order_of_the_events() -> None:
    b = Builder("m", {"tools": [], "tool_choice": "auto", "parallel_tool_calls": True})
    events = await _render(
        b,
        _events(
            Thinking("hmm"), Text("Let me look."),
            ToolCall(0, "call_a", "f", '{"x":'), ToolCall(0, arguments="1}"),
            ToolCall(1, "call_b", "g", "{}"), Done("tool_calls", Usage(10, 6)),
        ),
    )  # fmt: skip
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.completed"
    assert [o["type"] for o in final["output"]] == [
        "reasoning", "message", "function_call", "function_call"
    ]  # fmt: skip
    assert final["output"][2]["arguments"] == '{"x":1}' and final["output"][3]["name"] == "g"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    added = [e["output_index"] for e in events if e["type"] == "response.output_item.added"]
    done = [e["output_index"] for e in events if e["type"] == "response.output_item.done"]
    assert added == done == [0, 1, 2, 3]
    assert final["usage"]["output_tokens_details"]["reasoning_tokens"] == 1
    Response.model_validate(final)


def test_runner_killed_mid_stream(server: CorralServer) -> None:
    # Greedy decoding of a random model runs until the context is full: time to kill it.
    body = {"model": "long", "input": "once upon a time", "temperature": 0, "stream": True}
    events = []
    with server.client.stream("POST", "/v1/responses", json=body) as r:
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
                if events[-1]["type"] == "response.output_text.delta":
                    break
        pid = next(m["pid"] for m in server.ps() if m["model"] == "long:latest")
        os.kill(pid, signal.SIGKILL)
        events += [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    last = events[-1]
    assert last["type"] == "response.failed", last["type"]
    assert "runner for model 'long:latest'" in last["response"]["error"]["message"]
    server.wait_for(
        lambda: all(m["model"] != "long:latest" for m in server.ps()),
        timeout=10, what="dead runner to leave",
    )  # fmt: skip
    again = httpx.post(
        f"{server.url}/v1/responses", json={"model": "long", "input": "hi", "max_output_tokens": 2},
        timeout=60,
    )  # fmt: skip
    assert again.status_code == 200 and again.json()["status"] == "incomplete"
