"""The OpenAI Responses API (POST /v1/responses) with the real `openai` client, and its wire
format checked against the SDK's own types."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pydantic
import pytest
from openai.types.responses import Response, ResponseStreamEvent

from corral.api.chat import Done, Event, Text, Thinking, ToolCall, Usage
from corral.api.families.responses.protocol import parse_request
from corral.api.families.responses.render import Builder, CustomInput, ToolRef
from corral.errors import ApiError
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


def test_string_input(openai_client: openai.OpenAI, server: CorralServer) -> None:
    r = openai_client.responses.create(
        model=SMOL, input="Say hello.", max_output_tokens=16, temperature=0
    )
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


def test_list_input_with_instructions_and_system_messages(openai_client: openai.OpenAI) -> None:
    question = {"role": "user", "content": [{"type": "input_text", "text": "Name a colour."}]}
    bare = openai_client.responses.create(model=SMOL, input=[question], max_output_tokens=4)
    r = openai_client.responses.create(
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


def test_max_output_tokens_makes_it_incomplete(openai_client: openai.OpenAI) -> None:
    r = openai_client.responses.create(
        model=SMOL, input="Write a long story about a dragon.", max_output_tokens=3
    )
    assert r.status == "incomplete"
    assert r.incomplete_details and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage and r.usage.output_tokens == 3
    assert r.output[-1].type == "message" and r.output[-1].status == "incomplete"


def test_streamed_text_events(openai_client: openai.OpenAI, server: CorralServer) -> None:
    events = list(
        openai_client.responses.create(
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


def test_stream_helper(openai_client: openai.OpenAI) -> None:
    with openai_client.responses.stream(
        model=SMOL, input="Say hi.", max_output_tokens=40, temperature=0,
        text={"format": {"type": "json_object"}},
    ) as stream:  # fmt: skip
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text
    json.loads(final.output_text)


def test_logprobs(openai_client: openai.OpenAI, server: CorralServer) -> None:
    r = openai_client.responses.create(
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


def test_json_schema_format(openai_client: openai.OpenAI) -> None:
    r = openai_client.responses.create(
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
    parsed = openai_client.responses.parse(
        model=SMOL, input="Invent a person.", max_output_tokens=60, text_format=Person
    )
    assert isinstance(parsed.output_parsed, Person)


# ---- function calls ----------------------------------------------------------------------


def test_forced_function_call(openai_client: openai.OpenAI) -> None:
    r = openai_client.responses.create(
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

    named = openai_client.responses.create(
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


def test_stream_helper_with_function_call(openai_client: openai.OpenAI) -> None:
    with openai_client.responses.stream(
        model="tools", input="Weather?", tools=[WEATHER],  # type: ignore[list-item]
        tool_choice="required", max_output_tokens=60,
    ) as stream:  # fmt: skip
        done = [e for e in stream if e.type == "response.function_call_arguments.done"]
        final = stream.get_final_response()
    (call,) = final.output
    assert call.type == "function_call" and done[0].arguments == call.arguments
    check_weather_args(call.arguments)


def test_follow_up_with_function_call_output(openai_client: openai.OpenAI) -> None:
    question = {"role": "user", "content": "What is the weather in Paris?"}
    first = openai_client.responses.create(
        model="tools", input=[question], tools=[WEATHER],  # type: ignore[list-item]
        tool_choice="required", max_output_tokens=60,
    )  # fmt: skip
    (call,) = first.output
    assert call.type == "function_call"
    # The client sends the call back as the model wrote it, with its result.
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 24C."}
    second = openai_client.responses.create(
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
    again = openai_client.responses.create(
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


def test_reasoning_item(openai_client: openai.OpenAI, server: CorralServer) -> None:
    # The "think" template opens <think>: everything a random model writes is reasoning.
    r = openai_client.responses.create(model="think", input="Hi", max_output_tokens=6)
    item = r.output[0]
    assert item.type == "reasoning" and item.id.startswith("rs_") and item.summary == []
    assert item.content and item.content[0].type == "reasoning_text" and item.content[0].text
    assert r.usage and r.usage.output_tokens_details.reasoning_tokens > 0
    assert r.output_text == ""

    # Effort "none" turns thinking off: the answer is text.
    off = openai_client.responses.create(
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


def test_unknown_tool_type_is_refused(openai_client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        openai_client.responses.create(model=SMOL, input="x", tools=[{"type": "teleport"}])  # type: ignore[misc,list-item]
    assert "not supported" in e.value.message and "teleport" in e.value.message
    assert isinstance(e.value.body, dict) and e.value.body["param"] == "tools"


def test_unknown_model_and_wrong_capability(openai_client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        openai_client.responses.create(model="nope", input="x")
    assert isinstance(e.value.body, dict) and e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError):
        openai_client.responses.create(model="embed", input="x")
    with pytest.raises(openai.BadRequestError):
        openai_client.responses.create(
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


# ---- Codex's tools: namespaces, custom (free-form) tools, hosted tools ----------------------
# The shapes below are those Codex CLI 0.169.0 sends (captured from its requests): its
# multi-agent tools as a namespace, web_search beside them, apply_patch as a custom tool with
# a Lark grammar, and a function_call back from OpenAI that names its namespace.

AGENTS: dict[str, Any] = {
    "type": "namespace",
    "name": "multi_agent_v1",
    "description": "Tools for spawning and managing sub-agents.",
    "tools": [
        {"type": "function", "name": "close_agent", "description": "Close an agent.",
         "strict": False,
         "parameters": {"type": "object", "properties": {"target": {"type": "string"}},
                        "required": ["target"], "additionalProperties": False}},
        WEATHER,
    ],
}  # fmt: skip
PATCH: dict[str, Any] = {
    "type": "custom",
    "name": "apply_patch",
    "description": "Edit files with a patch.",
    "format": {
        "type": "grammar",
        "syntax": "lark",
        "definition": 'start: "*** Begin Patch" LF "*** End Patch"\nLF: "\\n"',
    },
}
# A regex-formatted custom tool: its pattern bounds a forced call, so even a random model
# writes one of its few words.
ANSWER: dict[str, Any] = {
    "type": "custom",
    "name": "answer",
    "description": "Answer yes or no.",
    "format": {"type": "grammar", "syntax": "regex", "definition": "yes|no|maybe"},
}
HOSTED: list[dict[str, Any]] = [
    {"type": "web_search", "external_web_access": False},
    {"type": "file_search", "vector_store_ids": ["vs_1"]},
    {"type": "code_interpreter", "container": {"type": "auto"}},
    {"type": "image_generation"},
]
CODEX: dict[str, Any] = {
    "model": "tools",
    "input": [
        {"type": "message", "id": "msg_1", "role": "developer",
         "content": [{"type": "input_text", "text": "You are a coding agent."}]},
        {"type": "message", "id": "msg_2", "role": "user",
         "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
    ],
    "tools": [TIME, AGENTS, PATCH, *HOSTED],
    "tool_choice": "auto",
    "parallel_tool_calls": False,
    "reasoning": {"effort": "medium", "summary": "auto", "context": "all_turns"},
    "store": False,
    "include": ["reasoning.encrypted_content"],
    "prompt_cache_key": "01a2137e-13f2-7ff1-b767-f5186a3c8392",
    "client_metadata": {"thread_id": "01a2137e", "x-codex-window-id": "01a2137e:0"},
    "text": {"verbosity": "low"},
    "service_tier": "default",
    "safety_identifier": "user-1",
    "user": "someone",
    "metadata": {"run": "1"},
    "max_output_tokens": 4,
}  # fmt: skip


def test_codex_request_becomes_chat(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="corral.api.families.responses.protocol"):
        req = parse_request(CODEX)
    tools = {t["function"]["name"]: t["function"] for t in req.chat.tools}
    # Namespaces flattened into their functions under their own names; hosted tools left out.
    assert list(tools) == ["get_time", "close_agent", "get_weather", "apply_patch"]
    assert tools["get_weather"]["parameters"] == WEATHER["parameters"]
    assert tools["close_agent"]["description"] == "Close an agent."
    assert tools["close_agent"]["strict"] is False
    # The custom tool is a function of one string, shown its grammar.
    assert tools["apply_patch"]["parameters"] == {
        "type": "object",
        "properties": {"input": {"type": "string", "description": (
            "The input, which must match this lark grammar:\n"
            + PATCH["format"]["definition"])}},
        "required": ["input"],
        "additionalProperties": False,
    }  # fmt: skip
    assert tools["apply_patch"]["description"] == "Edit files with a patch."
    assert req.tools == {
        "get_time": ToolRef("get_time"),
        "close_agent": ToolRef("close_agent", "multi_agent_v1"),
        "get_weather": ToolRef("get_weather", "multi_agent_v1"),
        "apply_patch": ToolRef("apply_patch", custom=True),
    }
    # One log line names what was left out.
    lines = [r for r in caplog.records if r.name == "corral.api.families.responses.protocol"]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO
    msg = lines[0].getMessage()
    assert all(
        t in msg for t in ("web_search", "file_search", "code_interpreter", "image_generation")
    )
    # What means something locally is used; the rest is accepted and echoed or ignored.
    assert req.chat.params["parallel_tool_calls"] is False
    assert req.chat.params["chat_template_kwargs"] == {
        "enable_thinking": True,
        "reasoning_effort": "medium",
    }
    assert req.chat.tool_choice == "auto" and req.stream is False
    assert req.chat.messages == [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "Weather in Paris?"},
    ]
    echo = req.echo
    assert echo["store"] is False and echo["parallel_tool_calls"] is False
    assert echo["prompt_cache_key"] == CODEX["prompt_cache_key"]
    assert echo["reasoning"] == {"effort": "medium", "summary": "auto"}
    assert echo["text"]["verbosity"] == "low" and echo["safety_identifier"] == "user-1"
    assert [t["type"] for t in echo["tools"]] == [
        "function", "namespace", "custom",
        "web_search", "file_search", "code_interpreter", "image_generation",
    ]  # fmt: skip


def test_codex_tools_in_additional_tools_items() -> None:
    # Codex's newer models get their tools in an additional_tools input item: a "functions"
    # namespace with a custom tool, and more namespaces.
    req = parse_request({
        "model": "m",
        "input": [
            {"type": "additional_tools", "id": "at_1", "role": "developer", "tools": [
                {"type": "namespace", "name": "functions", "description": "", "tools": [
                    {"type": "custom", "name": "exec", "description": "Run JavaScript.",
                     "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}},
                    {"type": "function", "name": "wait", "parameters": {"type": "object"}},
                ]},
                {"type": "namespace", "name": "clock", "description": "Time.", "tools": [
                    {"type": "function", "name": "wait", "parameters": {"type": "object"}},
                ]},
                {"type": "web_search"},
            ]},
            {"role": "user", "content": "hi"},
        ],
        "parallel_tool_calls": False,
    })  # fmt: skip
    # Two namespaces both have "wait": each is shown qualified.
    assert [t["function"]["name"] for t in req.chat.tools] == [
        "exec", "functions__wait", "clock__wait"
    ]  # fmt: skip
    assert req.tools["exec"] == ToolRef("exec", "functions", custom=True)
    assert req.tools["clock__wait"] == ToolRef("wait", "clock")
    assert req.chat.messages == [{"role": "user", "content": "hi"}]
    assert req.chat.params["parallel_tool_calls"] is False
    assert req.echo["tools"] == []  # only `tools` is echoed
    # A member whose name a plain function has is qualified; the plain one keeps it.
    namespaced = {"type": "function", "name": "get_weather", "namespace": "multi_agent_v1"}
    req = parse_request({"model": "m", "input": "x", "tools": [
        {"type": "function", "name": "get_weather"}, AGENTS,
    ], "tool_choice": namespaced})  # fmt: skip
    assert [t["function"]["name"] for t in req.chat.tools] == [
        "get_weather", "close_agent", "multi_agent_v1__get_weather"
    ]  # fmt: skip
    assert req.chat.tool_choice == "multi_agent_v1__get_weather"
    # Without the namespace, the tool in no namespace is the one meant.
    req = parse_request({"model": "m", "input": "x", "tools": [
        {"type": "function", "name": "get_weather"}, AGENTS,
    ], "tool_choice": {"type": "function", "name": "get_weather"}})  # fmt: skip
    assert req.chat.tool_choice == "get_weather"


def test_tool_choice_names_namespaced_and_custom_tools() -> None:
    def choice(value: Any) -> str:
        return parse_request({**CODEX, "tool_choice": value}).chat.tool_choice

    assert choice({"type": "function", "name": "get_weather"}) == "get_weather"
    assert choice({"type": "custom", "name": "apply_patch"}) == "apply_patch"
    assert choice("required") == "required"
    req = parse_request({**CODEX, "tool_choice": {"type": "custom", "name": "apply_patch"}})
    assert req.echo["tool_choice"] == {"type": "custom", "name": "apply_patch"}
    # Two namespaces with the same member, and none outside them: the namespace must be given.
    other = {**AGENTS, "name": "other_agents"}
    with pytest.raises(ApiError) as e:
        parse_request({**CODEX, "tools": [AGENTS, other],
                       "tool_choice": {"type": "function", "name": "close_agent"}})  # fmt: skip
    assert e.value.param == "tool_choice" and "namespace" in e.value.message


@pytest.mark.parametrize("kind", [
    "web_search", "file_search", "web_search_preview", "code_interpreter", "image_generation",
    "computer_use_preview", "mcp",
])  # fmt: skip
def test_tool_choice_forcing_a_hosted_tool_is_400(kind: str) -> None:
    with pytest.raises(ApiError) as e:
        parse_request({**CODEX, "tool_choice": {"type": kind, "server_label": "x"}})
    assert e.value.status == 400 and e.value.param == "tool_choice"
    assert kind in e.value.message and "cannot run" in e.value.message


def test_later_turn_items_become_chat_messages() -> None:
    req = parse_request({**CODEX, "input": [
        {"role": "user", "content": "Weather, then patch."},
        # As Codex sends back what the model called: name plus namespace, ids and status.
        {"type": "function_call", "status": "completed", "id": "fc_1", "name": "get_weather",
         "namespace": "multi_agent_v1", "arguments": '{"city":"Paris"}', "call_id": "call_a"},
        {"type": "custom_tool_call", "id": "ctc_1", "status": "completed", "call_id": "call_b",
         "name": "apply_patch", "input": "*** Begin Patch\n*** End Patch"},
        {"type": "function_call_output", "id": "fco_1", "call_id": "call_a", "output": "Sunny"},
        {"type": "custom_tool_call_output", "id": "ctco_1", "call_id": "call_b",
         "output": [{"type": "input_text", "text": "Done"}, {"type": "input_text", "text": "!"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": None},
        {"type": "custom_tool_call", "call_id": "call_c", "name": "exec", "namespace": "gone",
         "input": "1"},
        {"type": "custom_tool_call_output", "call_id": "call_c", "output": "2"},
    ]})  # fmt: skip
    assert req.chat.messages == [
        {"role": "user", "content": "Weather, then patch."},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_a", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}},
            {"id": "call_b", "type": "function",
             "function": {"name": "apply_patch",
                          "arguments": '{"input":"*** Begin Patch\\n*** End Patch"}'}},
        ]},
        {"role": "tool", "tool_call_id": "call_a", "content": "Sunny", "name": "get_weather"},
        {"role": "tool", "tool_call_id": "call_b", "content": "Done\n!", "name": "apply_patch"},
        # A tool no longer offered keeps the name the model would have seen.
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_c", "type": "function",
             "function": {"name": "gone__exec", "arguments": '{"input":"1"}'}},
        ]},
        {"role": "tool", "tool_call_id": "call_c", "content": "2", "name": "gone__exec"},
    ]  # fmt: skip


def test_images_in_tool_outputs_follow_the_tool_messages() -> None:
    # Codex's view_image answers with an image; a chat tool message holds only text, so the
    # image goes to the model in a user message after the turn's tool results.
    image = {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}
    req = parse_request({"model": "m", "input": [
        {"role": "user", "content": "Look."},
        {"type": "function_call", "call_id": "c1", "name": "view_image", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": [image]},
        {"type": "function_call_output", "call_id": "c2",
         "output": [{"type": "input_text", "text": "noon"}, image]},
        {"role": "user", "content": "Well?"},
    ]})  # fmt: skip
    url = {"type": "image_url", "image_url": {"url": image["image_url"]}}
    assert req.chat.messages[2:] == [
        {"role": "tool", "tool_call_id": "c1", "content": "(an image: it follows)",
         "name": "view_image"},
        {"role": "tool", "tool_call_id": "c2", "content": "noon", "name": "get_time"},
        {"role": "user", "content": [
            {"type": "text", "text": "The images the tool calls above returned:"}, url, url,
        ]},
        {"role": "user", "content": "Well?"},
    ]  # fmt: skip


def test_custom_input_streams_as_it_is_decoded() -> None:
    text = 'line 1\n"quoted" \\ tab\t \u00e9 \U0001f600 end'
    raw = json.dumps({"input": text})  # \uXXXX escapes, a surrogate pair among them
    for step in (1, 2, 3, 5, 7):
        c = CustomInput()
        got = "".join(c.feed(raw[i : i + step]) for i in range(0, len(raw), step))
        assert got == text and c.final() == text
    c = CustomInput()  # cut short: what it had
    assert c.feed('{"input": "ab') == "ab" and c.final() == "ab"
    c = CustomInput()  # another key: nothing streams, the value comes whole at the end
    assert c.feed('{"patch": "x"}') == "" and c.final() == "x"
    c = CustomInput()  # not JSON at all: the text as written
    assert c.feed("*** Begin Patch") == "" and c.final() == "*** Begin Patch"


async def test_calls_come_back_as_the_client_knows_them() -> None:
    refs = {
        "get_weather": ToolRef("get_weather", "multi_agent_v1"),
        "apply_patch": ToolRef("apply_patch", custom=True),
    }
    b = Builder("m", {"tools": [], "tool_choice": "auto", "parallel_tool_calls": True}, refs)
    events = await _render(
        b,
        _events(
            ToolCall(0, "call_a", "get_weather", '{"city":'), ToolCall(0, arguments='"Paris"}'),
            ToolCall(1, "call_b", "apply_patch", '{"input": "a\\'),
            ToolCall(1, arguments='nb"'), ToolCall(1, arguments="}"),
            Done("tool_calls", Usage(10, 6)),
        ),
    )  # fmt: skip
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.output_item.added",
        "response.custom_tool_call_input.delta",  # "a": the escape waits for its second half
        "response.custom_tool_call_input.delta",  # "\nb"
        "response.custom_tool_call_input.done", "response.output_item.done",
        "response.completed",
    ]  # fmt: skip
    fc, ctc = events[-1]["response"]["output"]
    assert fc == {"id": fc["id"], "type": "function_call", "status": "completed",
                  "call_id": "call_a", "name": "get_weather", "namespace": "multi_agent_v1",
                  "arguments": '{"city":"Paris"}'}  # fmt: skip
    assert ctc == {"id": ctc["id"], "type": "custom_tool_call", "status": "completed",
                   "call_id": "call_b", "name": "apply_patch", "input": "a\nb"}  # fmt: skip
    assert ctc["id"].startswith("ctc_") and fc["id"].startswith("fc_")
    assert events[2]["item"]["namespace"] == "multi_agent_v1"
    assert events[7]["item"] == {**ctc, "status": "in_progress", "input": ""}
    assert [e["delta"] for e in events[8:10]] == ["a", "\nb"]
    assert events[10]["input"] == "a\nb" and events[10]["item_id"] == ctc["id"]
    assert events[10]["output_index"] == 1
    Response.model_validate(events[-1]["response"])


def test_codex_request_is_accepted(server: CorralServer) -> None:
    r = server.client.post("/v1/responses", json=CODEX)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["store"] is False and body["parallel_tool_calls"] is False
    Response.model_validate(body)
    events = raw_stream(server, CODEX)  # Codex streams
    assert events[-1]["type"] in ("response.completed", "response.incomplete")


def test_forced_namespaced_call(openai_client: openai.OpenAI, server: CorralServer) -> None:
    body = {**CODEX, "tool_choice": {"type": "function", "name": "get_weather"},
            "max_output_tokens": 60}  # fmt: skip
    r = server.client.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text
    (call,) = r.json()["output"]
    assert call["type"] == "function_call" and call["status"] == "completed"
    assert call["name"] == "get_weather" and call["namespace"] == "multi_agent_v1"
    check_weather_args(call["arguments"])
    parsed = Response.model_validate(r.json()).output[0]
    assert parsed.type == "function_call" and parsed.namespace == "multi_agent_v1"

    events = raw_stream(server, body)
    types = [e["type"] for e in events]
    assert types[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert set(types[3:-3]) == {"response.function_call_arguments.delta"}
    assert types[-3:] == [
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    added, done = events[2]["item"], events[-2]["item"]
    assert added["namespace"] == done["namespace"] == "multi_agent_v1"
    assert added["name"] == done["name"] == events[-3]["name"] == "get_weather"
    deltas = "".join(e["delta"] for e in events if e["type"].endswith("arguments.delta"))
    assert deltas == events[-3]["arguments"] == done["arguments"]
    check_weather_args(deltas)


def test_forced_custom_tool_call(server: CorralServer) -> None:
    body = {**CODEX, "tools": [*CODEX["tools"], ANSWER],
            "tool_choice": {"type": "custom", "name": "answer"},
            "max_output_tokens": 30}  # fmt: skip
    r = server.client.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    (call,) = out["output"]
    assert out["status"] == "completed"
    assert call["type"] == "custom_tool_call" and call["status"] == "completed"
    assert call["name"] == "answer" and "namespace" not in call
    assert call["id"].startswith("ctc_") and call["call_id"].startswith("call_")
    assert call["input"] in ("yes", "no", "maybe")
    assert out["tool_choice"] == {"type": "custom", "name": "answer"}
    Response.model_validate(out)

    events = raw_stream(server, body)
    types = [e["type"] for e in events]
    assert types[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert set(types[3:-3]) == {"response.custom_tool_call_input.delta"}
    assert types[-3:] == [
        "response.custom_tool_call_input.done",
        "response.output_item.done",
        "response.completed",
    ]
    added, done = events[2]["item"], events[-2]["item"]
    assert added["type"] == "custom_tool_call" and added["input"] == ""
    assert added["status"] == "in_progress" and done["status"] == "completed"
    deltas = "".join(e["delta"] for e in events if e["type"].endswith("input.delta"))
    assert deltas == events[-3]["input"] == done["input"]
    assert re.fullmatch("yes|no|maybe", deltas)
    assert events[-1]["response"]["output"] == [done]
    assert {e["item_id"] for e in events[3:-2]} == {added["id"]}


def test_later_turn_with_custom_and_namespaced_calls(server: CorralServer) -> None:
    first = {**CODEX, "max_output_tokens": 60,
             "tool_choice": {"type": "function", "name": "get_weather"}}  # fmt: skip
    r = server.client.post("/v1/responses", json=first)
    (call,) = r.json()["output"]
    # Codex sends the turn back: the calls as the model wrote them, with their outputs.
    history = [
        *CODEX["input"],
        {**call},
        {"type": "custom_tool_call", "id": "ctc_1", "status": "completed", "call_id": "call_p",
         "name": "apply_patch", "input": "*** Begin Patch\n*** End Patch"},
        {"type": "function_call_output", "id": "fco_1", "call_id": call["call_id"],
         "output": "Sunny, 24C."},
        {"type": "custom_tool_call_output", "id": "ctco_1", "call_id": "call_p",
         "output": [{"type": "input_text", "text": "Success. Updated 0 files."}]},
    ]  # fmt: skip
    second = server.client.post("/v1/responses", json={**CODEX, "input": history})
    assert second.status_code == 200, second.text
    # The calls and their outputs reached the prompt.
    assert second.json()["usage"]["input_tokens"] > r.json()["usage"]["input_tokens"] + 20
    # A custom call forced next comes back as one, after that history.
    third = server.client.post("/v1/responses", json={
        **CODEX, "input": history, "tools": [*CODEX["tools"], ANSWER],
        "tool_choice": {"type": "custom", "name": "answer"}, "max_output_tokens": 30,
    })  # fmt: skip
    assert third.status_code == 200, third.text
    assert [o["type"] for o in third.json()["output"]] == ["custom_tool_call"]


def test_forcing_a_hosted_tool_is_400_in_openai_shape(openai_client: openai.OpenAI) -> None:
    tools: list[Any] = [{"type": "web_search"}, TIME]
    with pytest.raises(openai.BadRequestError) as e:
        openai_client.responses.create(
            model="tools", input="x", tools=tools, tool_choice={"type": "web_search_preview"}
        )
    assert "web_search_preview" in e.value.message and "cannot run" in e.value.message
    assert isinstance(e.value.body, dict)
    assert (
        e.value.body["param"] == "tool_choice" and e.value.body["type"] == "invalid_request_error"
    )
    # Only hosted tools, and a call required: nothing corral could call.
    with pytest.raises(openai.BadRequestError) as e:
        openai_client.responses.create(
            model="tools", input="x", tools=[{"type": "web_search"}], tool_choice="required"
        )
    assert "hosted" in e.value.message
    # Hosted tools alone, with the model free to choose: accepted, the model answers in text.
    r = openai_client.responses.create(
        model="tools", input="x", tools=[{"type": "web_search"}], max_output_tokens=2
    )
    assert r.output[0].type == "message"
