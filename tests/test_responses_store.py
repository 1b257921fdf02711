"""Stored OpenAI Responses: `store`, `previous_response_id`, `GET`/`DELETE /v1/responses/{id}`
and `/input_items`, through the official `openai` client on the shared server, and the store's
bounds and journal on their own."""

from __future__ import annotations

import json
import logging
import stat
from pathlib import Path
from typing import Any

import openai
import pytest
from openai.types.responses import Response
from openai.types.responses.response_input_message_item import ResponseInputMessageItem
from openai.types.responses.response_output_message import ResponseOutputMessage

from corral.api.chat import Done, Text, Usage
from corral.api.families.responses.protocol import input_messages, parse_request
from corral.api.families.responses.render import Builder
from corral.api.families.responses.stored import stored_items
from corral.runtime.response_store import ResponseStore
from corral.testing.server import CorralServer

SMOL = "smollm2:135m"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "London"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


def _create(client: openai.OpenAI, **kw: Any) -> Response:
    return client.responses.create(
        **{"model": SMOL, "temperature": 0, "max_output_tokens": 8, **kw}
    )


def _error(e: openai.APIStatusError) -> dict[str, Any]:
    assert isinstance(e.body, dict)
    return e.body


# ---- through the API -----------------------------------------------------------------------


def test_stored_response_is_retrieved_as_returned(
    openai_client: openai.OpenAI, server: CorralServer
) -> None:
    body = server.client.post(
        "/v1/responses",
        json={"model": SMOL, "input": "Say hi.", "max_output_tokens": 4, "metadata": {"k": "v"}},
    ).json()
    assert body["store"] is True and body["previous_response_id"] is None
    got = server.client.get(f"/v1/responses/{body['id']}")
    assert got.status_code == 200 and got.json() == body
    r = openai_client.responses.retrieve(body["id"])
    assert r.id == body["id"] and r.status == body["status"] and r.metadata == {"k": "v"}
    assert r.output_text == "".join(
        c["text"] for o in body["output"] if o["type"] == "message" for c in o["content"]
    )
    Response.model_validate(got.json())


def test_continued_conversation(openai_client: openai.OpenAI) -> None:
    first = _create(
        openai_client, instructions="You are terse.", input="My name is Ann. Say my name."
    )
    assert first.store is True
    second = _create(
        openai_client, instructions="You are terse.", input="Say it again.",
        previous_response_id=first.id,
    )  # fmt: skip
    assert second.previous_response_id == first.id and second.instructions == "You are terse."
    assert first.usage is not None and second.usage is not None
    # The prompt holds the first turn's prompt and answer: llama.cpp's cache had all of it but
    # the last token, which it evaluates again.
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 1

    # The earlier instructions are not carried over: without them the prompt starts with the
    # template's own system prompt instead. (What of it llama.cpp finds cached depends on the
    # module's other conversations, so it is not asserted.)
    bare = _create(openai_client, input="Say it again.", previous_response_id=first.id)
    assert bare.instructions is None and bare.usage is not None
    assert bare.usage.input_tokens != second.usage.input_tokens

    # The input items: the first turn's input and output, then the second's input.
    page = openai_client.responses.input_items.list(second.id, order="asc")
    items = [i.model_dump(exclude_none=True) for i in page.data]
    assert [(i["type"], i["role"]) for i in items] == [
        ("message", "user"), ("message", "assistant"), ("message", "user"),
    ]  # fmt: skip
    assert items[0]["content"] == [{"type": "input_text", "text": "My name is Ann. Say my name."}]
    assert items[1] == first.output[-1].model_dump(exclude_none=True)
    assert items[2]["content"] == [{"type": "input_text", "text": "Say it again."}]
    assert all(i["id"] for i in items) and items[0]["id"].startswith("msg_")
    ResponseInputMessageItem.model_validate(items[0])
    ResponseOutputMessage.model_validate(items[1])
    assert page.first_id == items[0]["id"] and page.last_id == items[2]["id"]
    assert page.has_more is False

    # A third turn continues the second.
    third = _create(openai_client, input="Once more.", previous_response_id=second.id)
    ids = [i.id for i in openai_client.responses.input_items.list(third.id)]
    assert len(ids) == 5 and ids[1] == second.output[-1].id  # newest first by default


def test_input_items_pages(openai_client: openai.OpenAI, server: CorralServer) -> None:
    turns = [{"role": "user", "content": f"Item {n}."} for n in range(5)]
    r = _create(openai_client, input=turns, max_output_tokens=1)  # type: ignore[arg-type]
    url = f"/v1/responses/{r.id}/input_items"
    whole = server.client.get(url, params={"order": "asc"}).json()
    ids = [i["id"] for i in whole["data"]]
    assert len(ids) == 5 and whole["object"] == "list" and whole["has_more"] is False
    assert [i["content"][0]["text"] for i in whole["data"]] == [f"Item {n}." for n in range(5)]

    page = server.client.get(url, params={"limit": 2}).json()
    assert [i["id"] for i in page["data"]] == ids[::-1][:2]
    assert page["has_more"] is True and page["first_id"] == ids[4] and page["last_id"] == ids[3]
    nxt = server.client.get(url, params={"limit": 2, "after": page["last_id"]}).json()
    assert [i["id"] for i in nxt["data"]] == [ids[2], ids[1]] and nxt["has_more"] is True
    last = server.client.get(url, params={"limit": 2, "after": ids[1]}).json()
    assert [i["id"] for i in last["data"]] == [ids[0]] and last["has_more"] is False
    back = server.client.get(url, params={"order": "asc", "limit": 2, "before": ids[3]}).json()
    assert [i["id"] for i in back["data"]] == [ids[1], ids[2]] and back["has_more"] is True
    # The SDK's paginator walks it all.
    walked = [i.id for i in openai_client.responses.input_items.list(r.id, limit=2)]
    assert walked == ids[::-1]


def test_streamed_response_is_stored(openai_client: openai.OpenAI, server: CorralServer) -> None:
    events = []
    body = {"model": SMOL, "input": "Count to three.", "max_output_tokens": 6, "stream": True}
    with server.client.stream("POST", "/v1/responses", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    final = events[-1]
    assert final["type"] in ("response.completed", "response.incomplete")
    stored = server.client.get(f"/v1/responses/{final['response']['id']}").json()
    assert stored == final["response"]
    # Continued at once, streamed too (cut short: the SDK's stream helper wants "completed").
    stream = openai_client.responses.create(
        model=SMOL, input="And on?", previous_response_id=stored["id"], max_output_tokens=2,
        stream=True,
    )  # fmt: skip
    *_, end = stream
    # (cut at 2 tokens, unless the model ends its answer sooner)
    assert end.type in ("response.completed", "response.incomplete")
    again = end.response
    assert again.previous_response_id == stored["id"]
    assert len(openai_client.responses.input_items.list(again.id).data) == 3


def test_incomplete_response_is_stored_with_its_status(openai_client: openai.OpenAI) -> None:
    r = _create(openai_client, input="Tell me a long story.", max_output_tokens=1)
    assert r.status == "incomplete"
    got = openai_client.responses.retrieve(r.id)
    assert got.status == "incomplete" and got.incomplete_details is not None
    assert got.incomplete_details.reason == "max_output_tokens"


def test_continued_tool_call(openai_client: openai.OpenAI) -> None:
    call = openai_client.responses.create(
        model="tools", input="Weather in Paris?", tools=[WEATHER],  # type: ignore[list-item]
        tool_choice="required", max_output_tokens=30,
    )  # fmt: skip
    (fc,) = call.output
    assert fc.type == "function_call"
    answer = openai_client.responses.create(
        model="tools", previous_response_id=call.id, tools=[WEATHER],  # type: ignore[list-item]
        input=[{"type": "function_call_output", "call_id": fc.call_id, "output": "Sunny."}],
        max_output_tokens=4,
    )  # fmt: skip
    assert answer.status in ("completed", "incomplete")
    kinds = [i.type for i in openai_client.responses.input_items.list(answer.id, order="asc")]
    assert kinds == ["message", "function_call", "function_call_output"]


def test_store_false_is_not_kept(openai_client: openai.OpenAI) -> None:
    r = _create(openai_client, input="Hi.", store=False, max_output_tokens=2)
    assert r.store is False
    with pytest.raises(openai.NotFoundError):
        openai_client.responses.retrieve(r.id)
    with pytest.raises(openai.BadRequestError) as e:
        _create(openai_client, input="Again.", previous_response_id=r.id)
    assert _error(e.value) == {
        "message": f"Previous response with id '{r.id}' not found.",
        "type": "invalid_request_error",
        "param": "previous_response_id",
        "code": "previous_response_not_found",
    }


def test_delete(openai_client: openai.OpenAI, server: CorralServer) -> None:
    r = _create(openai_client, input="Hi.", max_output_tokens=2)
    gone = server.client.delete(f"/v1/responses/{r.id}")
    assert gone.status_code == 200
    assert gone.json() == {"id": r.id, "object": "response", "deleted": True}
    for method, path in (("GET", ""), ("DELETE", ""), ("GET", "/input_items")):
        resp = server.client.request(method, f"/v1/responses/{r.id}{path}")
        assert resp.status_code == 404, (method, path)
        assert resp.json() == {"error": {
            "message": f"Response with id '{r.id}' not found.",
            "type": "invalid_request_error", "param": None, "code": None,
        }}  # fmt: skip
    other = _create(openai_client, input="Hi.", max_output_tokens=2)
    openai_client.responses.delete(other.id)  # the SDK's call
    with pytest.raises(openai.NotFoundError):
        openai_client.responses.retrieve(other.id)


def test_unknown_ids(openai_client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        openai_client.responses.retrieve("resp_nope")
    with pytest.raises(openai.NotFoundError):
        openai_client.responses.input_items.list("resp_nope")
    with pytest.raises(openai.BadRequestError) as e:
        _create(openai_client, input="x", previous_response_id="resp_nope")
    assert _error(e.value)["code"] == "previous_response_not_found"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"previous_response_id": 5}, "previous_response_id"),
        ({"previous_response_id": ["resp_1"]}, "previous_response_id"),
        ({"previous_response_id": "resp 1!"}, "previous_response_id"),
        ({"previous_response_id": ""}, "previous_response_id"),
        ({"store": "yes"}, "store"),
    ],
)  # fmt: skip
def test_malformed_fields_are_400(server: CorralServer, body: dict[str, Any], param: str) -> None:
    r = server.client.post("/v1/responses", json={"model": SMOL, "input": "x", **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param


@pytest.mark.parametrize(
    ("query", "param"),
    [({"limit": "0"}, "limit"), ({"limit": "101"}, "limit"), ({"limit": "many"}, "limit"),
     ({"order": "sideways"}, "order"), ({"after": "msg_nope"}, "after"),
     ({"before": "msg_nope"}, "before")],
)  # fmt: skip
def test_malformed_input_items_queries_are_400(
    openai_client: openai.OpenAI, server: CorralServer, query: dict[str, str], param: str
) -> None:
    r = _create(openai_client, input="Hi.", max_output_tokens=1)
    got = server.client.get(f"/v1/responses/{r.id}/input_items", params=query)
    assert got.status_code == 400, got.text
    assert got.json()["error"]["param"] == param


# ---- the request and the items on their own ------------------------------------------------


def test_stored_items_read_back_as_the_input() -> None:
    given: list[Any] = [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "id": "msg_mine", "role": "user",
         "content": [{"type": "input_text", "text": "Hi"}]},
        {"role": "assistant", "content": "Hello."},
        {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "ok"},
    ]  # fmt: skip
    items = stored_items(given)
    assert input_messages(items) == input_messages(given)
    assert [i["id"].split("_")[0] for i in items] == ["msg", "msg", "msg", "fc", "fco"]
    assert items[1]["id"] == "msg_mine"
    assert items[0]["content"] == [{"type": "input_text", "text": "Be brief."}]
    assert items[2]["content"] == [{"type": "output_text", "text": "Hello.", "annotations": []}]
    assert stored_items("Hi")[0]["content"] == [{"type": "input_text", "text": "Hi"}]


def test_continued_request_reads_the_conversation_first() -> None:
    store = ResponseStore(None)
    own = stored_items("My name is Ann.")
    base = store.put(_response("resp_1", "Hi Ann."), own)
    req = parse_request({"model": "m", "input": "Name?", "instructions": "Be brief."}, base)
    assert req.chat.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "My name is Ann."},
        {"role": "assistant", "content": "Hi Ann."},
        {"role": "user", "content": "Name?"},
    ]
    assert req.echo["previous_response_id"] == "resp_1" and req.echo["store"] is True
    assert [i["content"][0]["text"] for i in req.items] == ["Name?"]
    off = parse_request({"model": "m", "input": "x", "store": False})
    assert off.store is False and off.echo["store"] is False and off.items == []


async def test_builder_hands_over_failed_and_finished_responses() -> None:
    ended: list[dict[str, Any]] = []
    b = Builder("m", {}, on_end=ended.append)
    b.feed(Text("Hel"))
    (failed,) = b.fail("runner died")
    assert ended == [failed["response"]] and ended[0]["status"] == "failed"
    b = Builder("m", {}, on_end=ended.append)
    b.feed(Text("Hi"))
    *_, last = b.feed(Done("stop", Usage(3, 1)))
    assert ended[-1] is last["response"] and ended[-1]["status"] == "completed"
    assert ended[-1] == b.response()  # completed_at is fixed at the end


# ---- the store -----------------------------------------------------------------------------


def _response(rid: str, text: str = "ok") -> dict[str, Any]:
    item = {"id": f"msg_{rid}", "type": "message", "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}  # fmt: skip
    return {"id": rid, "object": "response", "status": "completed", "output": [item]}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_store_bounds() -> None:
    clock = Clock()
    s = ResponseStore(None, max_count=3, max_age=60, clock=clock)
    for n in range(4):
        s.put(_response(f"r{n}"), stored_items(f"q{n}"))
        clock.now += 10
    assert list(s.records) == ["r1", "r2", "r3"]  # the oldest went
    clock.now += 35  # r1 is 65 s old
    assert s.get("r1") is None and s.get("r2") is not None
    assert s.delete("r2") and not s.delete("r2") and list(s.records) == ["r3"]

    big = ResponseStore(None, max_bytes=2000)
    for n in range(5):
        big.put(_response(f"r{n}", "x" * 600), [])
    assert 1 <= len(big) < 5 and big.bytes <= 2000 and "r4" in big.records
    huge = ResponseStore(None, max_bytes=10)
    huge.put(_response("only", "x" * 100), [])
    assert list(huge.records) == ["only"]  # the newest stays, whatever its size


def test_chain_shares_the_conversation() -> None:
    s = ResponseStore(None)
    a = s.put(_response("a"), stored_items("one"))
    b = s.put(_response("b"), stored_items("two"), a)
    assert b.inputs == [*a.inputs, *a.output, *b.own] and b.base == "a"
    assert b.inputs[0] is a.inputs[0]  # shared, not copied
    assert s.delete("a") and s.get("b") is b  # the conversation stays with the one continuing


def test_journal_survives_a_restart(tmp_path: Path) -> None:
    path = tmp_path / ".corral" / "responses.jsonl"
    s = ResponseStore(path)
    a = s.put(_response("a"), stored_items("one"))
    b = s.put(_response("b"), stored_items("two"), a)
    s.put(_response("c"), stored_items("three"))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600  # conversations: the owner's alone
    lines = [json.loads(line) for line in path.read_bytes().splitlines()]
    assert [(d["id"], d["base"], len(d["items"])) for d in lines] == [
        ("a", None, 1), ("b", "a", 1), ("c", None, 1),
    ]  # b's line holds only its own items  # fmt: skip

    again = ResponseStore(path)
    assert list(again.records) == ["a", "b", "c"]
    assert again.records["b"].inputs == b.inputs and again.records["b"].response == b.response

    again.delete("a")  # compacts: a's line is gone, b's is written whole
    lines = [json.loads(line) for line in path.read_bytes().splitlines()]
    assert [(d["id"], d["base"], len(d["items"])) for d in lines] == [
        ("b", None, 3),
        ("c", None, 1),
    ]
    third = ResponseStore(path)
    assert list(third.records) == ["b", "c"] and third.records["b"].inputs == b.inputs


def test_journal_bounds_and_damage(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "responses.jsonl"
    clock = Clock()
    s = ResponseStore(path, max_age=60, clock=clock)
    s.put(_response("old"), [])
    clock.now += 100
    s.put(_response("new"), [])
    with path.open("ab") as f:
        f.write(b'{"id": "cut", "at": 10')  # a crash mid-line
    with caplog.at_level(logging.WARNING):
        loaded = ResponseStore(path, max_age=60, clock=clock)
    assert list(loaded.records) == ["new"] and "could not be read" in caplog.text
    assert len(path.read_bytes().splitlines()) == 1  # compacted on load

    many = ResponseStore(tmp_path / "many.jsonl", max_count=2)
    for n in range(120):
        many.put(_response(f"r{n}"), [])
    assert len((tmp_path / "many.jsonl").read_bytes().splitlines()) <= 2 * 2 + 101
    heavy = ResponseStore(tmp_path / "heavy.jsonl", max_bytes=4000)
    for n in range(50):
        heavy.put(_response(f"r{n}", "x" * 500), [])
    assert heavy.file_bytes == (tmp_path / "heavy.jsonl").stat().st_size <= 2 * 4000 + 700


def test_unwritable_journal_keeps_memory(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with caplog.at_level(logging.WARNING):
        s = ResponseStore(blocker / "responses.jsonl")  # its directory is a file
        s.put(_response("a"), [])
    assert s.path is None and s.get("a") is not None and "memory only" in caplog.text
