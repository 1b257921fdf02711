"""A stream the shared cache fills mid-answer, continued alone (runtime/continuation): what can
be continued, the answer read back from llama.cpp's events, the request sent again, and the
parts joined into one stream. The real runner's case is in test_slots.py."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, cast

import orjson
import pytest

from corral.api.family import ANTHROPIC
from corral.errors import ApiError
from corral.runtime.affinity import Slots
from corral.runtime.continuation import (
    ContinuedStream,
    Reader,
    answered,
    cache_full_at,
    continuable,
    continued,
)
from corral.runtime.hop import Hop, RunnerClient
from corral.runtime.runner_errors import CacheFull, stream_failure

CHAT = "/v1/chat/completions"
FULL = b'data: {"error":{"code":500,"message":"Context size has been exceeded.","type":"server_error"}}\n\n'  # noqa: E501


def chat_event(content: str | None = None, cid: str = "chatcmpl-a", **delta: Any) -> bytes:
    d = {"content": content, **delta} if content is not None else delta
    obj = {"choices": [{"finish_reason": None, "index": 0, "delta": d}], "created": 1,
           "id": cid, "model": "m", "object": "chat.completion.chunk"}  # fmt: skip
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def role_event(cid: str) -> bytes:
    """llama.cpp's opening event of a chat stream."""
    obj = {"choices": [{"finish_reason": None, "index": 0,
                        "delta": {"role": "assistant", "content": None}}],
           "created": 1, "id": cid, "model": "m", "object": "chat.completion.chunk"}  # fmt: skip
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def test_what_can_be_continued() -> None:
    user = [{"role": "user", "content": "hi"}]
    assert continuable(CHAT, {"stream": True, "messages": user})
    assert not continuable(CHAT, {"messages": user})  # a whole answer is sent again instead
    assert continuable(CHAT, {"stream": True, "messages": [
        *user, {"role": "assistant", "content": "Sure,"}]})  # fmt: skip
    assert not continuable(CHAT, {"stream": True, "messages": [
        *user, {"role": "assistant", "content": [{"type": "text", "text": "x"}]}]})  # fmt: skip
    for constrained in ({"grammar": "root ::= x"}, {"json_schema": {"type": "object"}},
                        {"response_format": {"type": "json_object"}},
                        {"grammar": "root ::= x", "grammar_lazy": True,
                         "grammar_triggers": [{"type": 3, "value": "^<"}]}):  # fmt: skip
        assert not continuable(CHAT, {"stream": True, "messages": user, **constrained})
    # a lazy grammar from a word: the text before it is free
    lazy = {"grammar": "root ::= x", "grammar_lazy": True,
            "grammar_triggers": [{"type": 1, "value": "<tool_call>"}]}  # fmt: skip
    assert continuable("/completion", {"stream": True, "prompt": "p", **lazy})
    assert continuable(CHAT, {"stream": True, "messages": user,
                              "response_format": {"type": "text"}})  # fmt: skip
    assert continuable("/completion", {"stream": True, "prompt": "once"})
    assert continuable("/completion", {"stream": True, "prompt": [1, 2, "x"]})
    assert not continuable("/completion", {"stream": True, "prompt": {"prompt_string": "x"}})
    assert not continuable("/v1/completions", {"stream": True, "prompt": "x", "echo": True})
    assert not continuable("/v1/embeddings", {"stream": True, "input": "x"})


def test_the_answer_so_far_is_read_back_from_the_events() -> None:
    events = role_event("c") + chat_event("Hello") + chat_event(", world")
    assert answered(CHAT, events) == "Hello, world"
    assert answered(CHAT, events + chat_event(None, reasoning_content="hmm")) is None
    assert answered(CHAT, events + chat_event(None, tool_calls=[{"index": 0}])) is None
    native = b'data: {"content":"once","stop":false}\n\ndata: {"content":" more","stop":false}\n\n'
    assert answered("/completion", native) == "once more"
    legacy = b'data: {"choices":[{"text":"ab","index":0}]}\n\n'
    assert answered("/v1/completions", legacy) == "ab"
    assert answered(CHAT, b"data: {not json\n\n") is None


def test_the_request_is_sent_again_with_the_answer_as_its_prefill() -> None:
    user = [{"role": "user", "content": "hi"}]
    again = continued(CHAT, {"messages": user, "max_tokens": 100}, "Hello", 3)
    assert again["messages"] == [*user, {"role": "assistant", "content": "Hello"}]
    assert again["max_tokens"] == 97
    prefilled = [*user, {"role": "assistant", "content": "Sure,"}]
    again = continued(CHAT, {"messages": prefilled}, " here", 1)
    assert again["messages"][-1] == {"role": "assistant", "content": "Sure, here"}
    assert "max_tokens" not in again
    assert continued("/completion", {"prompt": "once", "n_predict": 2}, " upon", 5) == {
        "prompt": "once upon", "n_predict": 1,  # never 0 (llama.cpp's "no limit")
    }  # fmt: skip
    assert continued("/completion", {"prompt": [1, 2]}, "x", 1)["prompt"] == [1, 2, "x"]
    # failed before its first token (no prefill of nothing: templates render one differently)
    assert continued(CHAT, {"messages": user, "max_tokens": 5}, "", 0) == {
        "messages": user, "max_tokens": 5,
    }  # fmt: skip
    assert continued("/completion", {"prompt": "a", "n_predict": -1}, "b", 1)["n_predict"] == -1


def test_only_the_cache_full_error_is_found() -> None:
    before = chat_event("x")
    assert cache_full_at(before + FULL) == len(before)
    assert cache_full_at(FULL) == 0
    assert cache_full_at(b'error: {"message":"Context size has been exceeded."}\n\n') == 0
    assert cache_full_at(chat_event("the limit was exceeded")) == -1
    other = b'data: {"error":{"message":"Compute error."}}\n\n'
    assert cache_full_at(other) == -1


class Part(Reader):
    """A runner's stream that hands out prepared reads."""

    def __init__(self, reads: list[bytes]) -> None:
        self.reads = list(reads)
        self.status = 200
        self.closed = False

    async def read(self) -> bytes:
        return self.reads.pop(0) if self.reads else b""

    def close(self) -> None:
        self.closed = True

    release = close



async def never(_: Any) -> Any:
    raise AssertionError("no continuation was due")


async def two(text: str) -> int:
    """The tokens of "Hello" in these tests' made-up vocabulary."""
    return 2


def read_through(stream: ContinuedStream) -> bytes:
    async def go() -> bytes:
        return b"".join([chunk async for chunk in stream])

    return asyncio.run(go())


def test_the_parts_are_joined_into_one_answer() -> None:
    first = Part([role_event("chatcmpl-a") + chat_event("Hel", "chatcmpl-a"),
                  chat_event("lo", "chatcmpl-a") + FULL])  # fmt: skip
    usage = (b'data: {"choices":[],"id":"chatcmpl-b","usage":{"completion_tokens":2,'
             b'"prompt_tokens":12,"total_tokens":14}}\n\n')  # fmt: skip
    second = Part([role_event("chatcmpl-b") + chat_event(" there", "chatcmpl-b"),
                   chat_event("!", "chatcmpl-b") + usage + b"data: [DONE]\n\n"])  # fmt: skip
    sent: list[dict[str, Any]] = []

    async def again(payload: dict[str, Any]) -> Part:
        sent.append(payload)
        return second

    user = [{"role": "user", "content": "hi"}]
    payload = {"stream": True, "messages": user, "max_tokens": 9}
    out = read_through(ContinuedStream(first, CHAT, payload, again, two))
    assert first.closed
    prefill = {"role": "assistant", "content": "Hello"}
    assert sent == [{**payload, "max_tokens": 7, "messages": [*user, prefill]}]
    assert b"error" not in out and b"chatcmpl-b" not in out
    assert out.count(b'"role":"assistant"') == 1
    assert answered(CHAT, out.split(b"data: [DONE]")[0]) == "Hello there!"
    # 2 tokens before, and the prefill's 2 are not the client's prompt
    assert b'"completion_tokens":4,"prompt_tokens":10,"total_tokens":14' in out
    assert out.endswith(b"data: [DONE]\n\n")


def test_what_cannot_be_continued_ends_on_llamas_error() -> None:
    tool = chat_event(None, tool_calls=[{"index": 0, "function": {"name": "f"}}])
    stream = ContinuedStream(Part([role_event("c"), tool + FULL]), CHAT,
                             {"stream": True, "messages": [{"role": "user", "content": "x"}]},
                             never, never)  # fmt: skip
    assert read_through(stream).endswith(FULL)


END = b'data: {"content":" done","stop":true}\n\n'


def test_an_answer_that_wrote_its_lazy_grammars_trigger_is_not_continued() -> None:
    lazy = {"grammar": "root ::= x", "grammar_lazy": True,
            "grammar_triggers": [{"type": 1, "value": "<tool_call>"}]}  # fmt: skip
    payload = {"stream": True, "prompt": "p", **lazy}
    sent: list[dict[str, Any]] = []

    async def again(payload: dict[str, Any]) -> Part:
        sent.append(payload)
        return Part([END])

    def native(text: str) -> bytes:
        return b'data: {"content":' + orjson.dumps(text) + b',"stop":false}\n\n'

    free = ContinuedStream(Part([native("Let me look") + FULL]), "/completion", payload, again, two)
    assert read_through(free) == native("Let me look") + END
    assert sent[0]["prompt"] == "pLet me look"
    called = ContinuedStream(Part([native("<tool_call>{") + FULL]), "/completion", payload,
                             never, never)  # fmt: skip
    assert read_through(called).endswith(FULL)


def test_a_continuation_the_runner_cannot_take_ends_on_the_first_error() -> None:
    async def again(payload: dict[str, Any]) -> Part:
        raise ApiError(500, "the runner crashed")

    stream = ContinuedStream(Part([role_event("c") + chat_event("a") + FULL]), CHAT,
                             {"stream": True, "messages": [{"role": "user", "content": "x"}]},
                             again, two)  # fmt: skip
    out = read_through(stream)
    assert out.endswith(FULL) and answered(CHAT, out[: -len(FULL)]) == "a"


@dataclass(eq=False)  # compared by identity, as a scheduler Lease is in the waiting list
class Lease:
    hop: Hop
    released: bool = False
    released_at: float = 0.0
    generated: int = 0
    prompt_tokens: int | None = None

    def release(self) -> None:  # as scheduler.Lease does: those waiting for room look again
        self.released = True
        self.hop.changed()


@dataclass(eq=False)
class Runner:
    name: str = "m"


def test_a_request_waiting_to_run_alone_is_not_overtaken_by_newcomers_that_fit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stream waiting to be continued alone waits for the requests running beside it; a
    newcomer that would fit beside them waits behind it (first come, first served) instead
    of starting at once, or a steady trickle of such newcomers would hold it back for ever.
    The release of the running request wakes them: nothing polls."""
    client = RunnerClient()
    hop = Hop(cast(Any, Runner()), Slots(4, capacity=1000))
    assert hop.slots is not None
    slots = hop.slots
    running, stalled, newcomer = Lease(hop), Lease(hop), Lease(hop)
    for lease, text in ((running, b"a" * 300), (stalled, b"b" * 300), (newcomer, b"c" * 300)):
        assert slots.claim(lease, (text,)) is not None
    sent: list[str] = []

    async def send(hop: Hop, path: str, payload: dict[str, Any], streamed: bool,
                   crowded: bool = False) -> Any:  # fmt: skip
        sent.append(payload["who"])
        return b"{}"

    monkeypatch.setattr(client, "_send", send)

    async def go() -> None:
        alone = asyncio.create_task(
            client._alone(hop, slots, CHAT, {"who": "stalled"}, stalled, False)
        )
        await asyncio.sleep(0.01)
        # 900 bytes is 300 tokens of 1,000: the newcomer fits, yet waits its turn
        later = asyncio.create_task(
            client._admitted(hop, slots, CHAT, {"who": "newcomer"}, newcomer, False)
        )
        await asyncio.sleep(0.01)
        assert sent == []  # the stalled stream waits for the one running, the newcomer behind it
        assert hop.waiting == [stalled, newcomer]
        running.release()
        await asyncio.wait_for(asyncio.gather(alone, later), 5)

    asyncio.run(go())
    assert sent == ["stalled", "newcomer"] and hop.waiting == []


def test_a_stream_that_cannot_be_continued_ends_with_a_503_in_each_family() -> None:
    """llama.cpp's full-cache error mid-stream is corral's 503 (Anthropic's overloaded_error,
    which agents retry); any other error the runner sends stays a 500."""
    full = stream_failure("Context size has been exceeded.")
    assert isinstance(full, CacheFull) and full.status == 503
    assert b'"type":"overloaded_error"' in ANTHROPIC.event(full)
    assert stream_failure("Compute error.").status == 500
