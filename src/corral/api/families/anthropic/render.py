"""Anthropic's answers from a generation's events: the whole message object (`message`) and
the streamed events (`sse_stream`: message_start, content blocks opened, filled and closed as
the events come, message_delta with the stop reason and usage, message_stop; a failure once
begun is an `error` event)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import orjson

from corral.api.chat import (
    Done,
    Event,
    Result,
    Text,
    Thinking,
    ToolCall,
    Usage,
    new_id,
    unhandled,
)
from corral.api.family import ANTHROPIC, sse
from corral.errors import ApiError


# ---- events -> Anthropic ----------------------------------------------------------------------
def stop_reason(done: Done, called: bool) -> str:
    if done.stop_sequence is not None:
        return "stop_sequence"
    if done.reason == "length":
        return "max_tokens"
    if done.reason == "tool_calls" or called:
        return "tool_use"
    return "end_turn"


def usage(u: Usage) -> dict[str, int]:
    # Anthropic's input_tokens excludes tokens read from the cache; their sum is the prompt.
    return {
        "input_tokens": max(u.prompt_tokens - u.cached_tokens, 0),
        "output_tokens": u.completion_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": u.cached_tokens,
    }


def tool_input(arguments: str) -> dict[str, Any]:
    try:
        value = orjson.loads(arguments) if arguments.strip() else {}
    except orjson.JSONDecodeError:
        return {}  # llama.cpp parses calls out of the output, so this is not expected
    return value if isinstance(value, dict) else {}


def message(model: str, result: Result, shown: bool = True) -> dict[str, Any]:
    """The whole message object of a non-streamed answer."""
    content: list[dict[str, Any]] = []
    if result.thinking and shown:
        content.append({"type": "thinking", "thinking": result.thinking, "signature": ""})
    if result.text:
        content.append({"type": "text", "text": result.text})
    for c in result.tool_calls:
        content.append({
            "type": "tool_use", "id": new_id("toolu_"), "name": c["name"],
            "input": tool_input(c["arguments"]),
        })  # fmt: skip
    done = result.done
    return {
        "id": new_id("msg_"), "type": "message", "role": "assistant", "model": model,
        "content": content, "stop_reason": stop_reason(done, bool(result.tool_calls)),
        "stop_sequence": done.stop_sequence, "usage": usage(done.usage),
    }  # fmt: skip


class _Blocks:
    """The content blocks of a streamed message: one is open at a time; an event of another
    kind (or another tool call) closes it and opens the next at the next index."""

    def __init__(self, shown: bool = True) -> None:
        self.index = -1
        self.open: tuple[str, int] | None = None  # (block type, tool call index)
        self.called = False
        self.shown = shown  # False: the reasoning is left out (thinking.display "omitted")
        self.done = Done("stop", Usage())  # how it ended, once it has

    def switch(self, key: tuple[str, int], start: dict[str, Any]) -> list[bytes]:
        if self.open == key:
            return []
        out = self.close()
        self.index += 1
        self.open = key
        out.append(sse("content_block_start", {
            "type": "content_block_start", "index": self.index, "content_block": start,
        }))  # fmt: skip
        return out

    def delta(self, delta: dict[str, Any]) -> bytes:
        return sse("content_block_delta", {
            "type": "content_block_delta", "index": self.index, "delta": delta,
        })  # fmt: skip

    def close(self) -> list[bytes]:
        if self.open is None:
            return []
        out = []
        if self.open[0] == "thinking":  # Anthropic ends every thinking block with a signature
            out.append(self.delta({"type": "signature_delta", "signature": ""}))
        out.append(sse("content_block_stop", {"type": "content_block_stop", "index": self.index}))
        self.open = None
        return out

    def feed(self, ev: Event) -> list[bytes]:
        """The content-block events `ev` renders to (the end's come from `close`)."""
        match ev:
            case Thinking():
                if not self.shown:
                    return []
                start = {"type": "thinking", "thinking": "", "signature": ""}
                out = self.switch(("thinking", 0), start)
                return [*out, self.delta({"type": "thinking_delta", "thinking": ev.text})]
            case Text():
                out = self.switch(("text", 0), {"type": "text", "text": ""})
                return [*out, self.delta({"type": "text_delta", "text": ev.text})]
            case ToolCall():
                self.called = True
                out = self.switch(("tool_use", ev.index), {
                    "type": "tool_use", "id": new_id("toolu_"), "name": ev.name, "input": {},
                })  # fmt: skip
                if ev.arguments:
                    out.append(
                        self.delta({"type": "input_json_delta", "partial_json": ev.arguments})
                    )
                return out
            case Done():
                self.done = ev
                return []
            case _:
                unhandled(ev)


async def sse_stream(
    events: AsyncIterator[Event], model: str, input_tokens: int, shown: bool = True
) -> AsyncIterator[bytes]:
    """Anthropic's event stream; a failure once it has begun becomes an `error` event.
    `shown`: False leaves the reasoning out (thinking.display "omitted")."""
    yield sse("message_start", {"type": "message_start", "message": {
        "id": new_id("msg_"), "type": "message", "role": "assistant", "model": model,
        "content": [], "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": input_tokens, "output_tokens": 0,
                  "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0},
    }})  # fmt: skip
    yield sse("ping", {"type": "ping"})
    blocks = _Blocks(shown)
    try:
        async for ev in events:
            for chunk in blocks.feed(ev):
                yield chunk
    except ApiError as e:
        yield ANTHROPIC.event(e)
        return
    for chunk in blocks.close():
        yield chunk
    done = blocks.done
    yield sse("message_delta", {
        "type": "message_delta",
        "delta": {"stop_reason": stop_reason(done, blocks.called),
                  "stop_sequence": done.stop_sequence},
        "usage": usage(done.usage),
    })  # fmt: skip
    yield sse("message_stop", {"type": "message_stop"})
