"""OpenAI Responses output: a generation's events as Responses output items (reasoning,
message, function and custom tool calls) and the `response.*` server-sent events that build
them, streamed or whole from the same `Builder` (the request side is in routes.py)."""

from __future__ import annotations

import json
import re
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import orjson

from corral.api.activity import note_error
from corral.api.chat import Done, Event, Text, Thinking, ToolCall, Usage, new_id, unhandled
from corral.api.family import sse
from corral.errors import ApiError


@dataclass(frozen=True)
class ToolRef:
    """A tool as the client knows it, behind the name the model sees."""

    name: str
    namespace: str | None = None
    custom: bool = False


class Builder:
    """Turns a generation's events into Responses output items, and the stream events that
    build them, one item per run of one kind (reasoning, text, each tool call). The same
    code serves both streamed and whole answers, so they cannot disagree.

    `tools` maps the names the model sees to the client's tools: a call to a namespace's
    member comes back under its own name with its `namespace`, one to a custom tool as a
    `custom_tool_call`.

    `on_end` gets the final response object (completed, incomplete or failed) before the event
    that carries it is sent: a client that continues from it at once finds it stored."""

    def __init__(
        self,
        model: str,
        echo: dict[str, Any],
        tools: dict[str, ToolRef] | None = None,
        on_end: Callable[[dict[str, Any]], object] | None = None,
    ) -> None:
        self.id = new_id("resp_")
        self.created_at = int(time.time())
        self.completed_at: int | None = None
        self.on_end = on_end
        self.model = model
        self.echo = echo
        self.tools = tools or {}
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item still being written
        self.calls: dict[int, dict[str, Any]] = {}  # ToolCall.index -> its item
        self.inputs: dict[str, CustomInput] = {}  # custom tool call's item id -> its input
        self.seq = 0
        self.thinking_deltas = 0  # one token each: the count of reasoning tokens
        self.done: Done | None = None
        self.error: str | None = None

    # -- stream events ----------------------------------------------------------------------
    def _ev(self, kind: str, **fields: Any) -> dict[str, Any]:
        ev = {"type": kind, **fields, "sequence_number": self.seq}
        self.seq += 1
        return ev

    def start(self) -> list[dict[str, Any]]:
        snapshot = self.response()
        return [
            self._ev("response.created", response=snapshot),
            self._ev("response.in_progress", response=snapshot),
        ]

    def feed(self, ev: Event) -> list[dict[str, Any]]:
        match ev:
            case Text():
                top = self.echo.get("top_logprobs") or 0
                return self._text(ev.text, [_logprob(lp, top) for lp in ev.logprobs])
            case Thinking():
                self.thinking_deltas += 1
                return self._thinking(ev.text)
            case ToolCall():
                return self._tool_call(ev)
            case Done():
                return self.finish(ev)
            case _:
                unhandled(ev)

    def _text(self, text: str, logprobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        out = [] if self._is_open("message") else self._open_message()
        item = self._current()
        item["content"][0]["text"] += text
        item["content"][0]["logprobs"] += logprobs
        out.append(
            self._ev(
                "response.output_text.delta",
                item_id=item["id"],
                output_index=self._index(),
                content_index=0,
                delta=text,
                logprobs=logprobs,
            )
        )
        return out

    def _thinking(self, text: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if not self._is_open("reasoning"):
            out += self._close()
            item: dict[str, Any] = {
                "id": new_id("rs_"),
                "type": "reasoning",
                "summary": [],
                "content": [],
                "status": "in_progress",
            }
            out += self._add(item)
            item["content"].append({"type": "reasoning_text", "text": ""})
            out.append(
                self._ev(
                    "response.content_part.added",
                    item_id=item["id"],
                    output_index=self._index(),
                    content_index=0,
                    part={"type": "reasoning_text", "text": ""},
                )
            )
        item = self._current()
        item["content"][0]["text"] += text
        out.append(
            self._ev(
                "response.reasoning_text.delta",
                item_id=item["id"],
                output_index=self._index(),
                content_index=0,
                delta=text,
            )
        )
        return out

    def _tool_call(self, ev: ToolCall) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        item = self.calls.get(ev.index)
        if item is None:
            out += self._close()
            # llama.cpp sends a call's name whole, in its first event: the kind of item it
            # makes is known from there.
            ref = self.tools.get(ev.name) or ToolRef(ev.name)
            call_id = ev.id if ev.id.startswith("call_") else new_id("call_")
            item = {
                "id": new_id("ctc_" if ref.custom else "fc_"),
                "type": "custom_tool_call" if ref.custom else "function_call",
                "status": "in_progress",
                "call_id": call_id,
                "name": ref.name,
            }
            if ref.namespace is not None:
                item["namespace"] = ref.namespace
            if ref.custom:
                item["input"] = ""
                self.inputs[item["id"]] = CustomInput()
            else:
                item["arguments"] = ""
            self.calls[ev.index] = item
            out += self._add(item)
        elif ev.name and item["type"] == "function_call":
            item["name"] += ev.name  # a name streamed in pieces (llama.cpp sends it whole)
        if not ev.arguments:
            return out
        at = {"item_id": item["id"], "output_index": self.items.index(item)}
        if item["type"] == "custom_tool_call":
            text = self.inputs[item["id"]].feed(ev.arguments)
            if text:
                item["input"] += text
                out.append(self._ev("response.custom_tool_call_input.delta", **at, delta=text))
            return out
        item["arguments"] += ev.arguments
        out.append(self._ev("response.function_call_arguments.delta", **at, delta=ev.arguments))
        return out

    def finish(self, done: Done) -> list[dict[str, Any]]:
        """Close the last item and end the stream with completed or incomplete."""
        self.done = done
        out: list[dict[str, Any]] = []
        if not self.items:  # clients read output[0]: an empty answer is an empty message
            out += self._open_message()
        out += self._close("incomplete" if done.reason == "length" else "completed")
        self.completed_at = int(time.time())
        snapshot = self._ended()
        kind = "response.incomplete" if snapshot["status"] == "incomplete" else "response.completed"
        return [*out, self._ev(kind, response=snapshot)]

    def fail(self, message: str) -> list[dict[str, Any]]:
        """A failure mid-generation: the response ends as failed, with what it had so far."""
        self.error = message
        if self.open is not None:
            self.open["status"] = "incomplete"
            self.open = None
        return [self._ev("response.failed", response=self._ended())]

    def _ended(self) -> dict[str, Any]:
        snapshot = self.response()
        if self.on_end is not None:
            self.on_end(snapshot)
        return snapshot

    # -- items --------------------------------------------------------------------------------
    def _is_open(self, kind: str) -> bool:
        return self.open is not None and self.open["type"] == kind

    def _current(self) -> dict[str, Any]:
        assert self.open is not None
        return self.open

    def _index(self) -> int:
        return len(self.items) - 1  # the open item is always the last one

    def _add(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        self.items.append(item)
        self.open = item
        return [
            self._ev("response.output_item.added", output_index=self._index(), item=_copy(item))
        ]

    def _open_message(self) -> list[dict[str, Any]]:
        out = self._close()
        item: dict[str, Any] = {
            "id": new_id("msg_"),
            "type": "message",
            "role": "assistant",
            "status": "in_progress",
            "content": [],
        }
        out += self._add(item)
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        item["content"].append(part)
        out.append(
            self._ev(
                "response.content_part.added",
                item_id=item["id"],
                output_index=self._index(),
                content_index=0,
                part=_copy(part),
            )
        )
        return out

    def _close(self, status: str = "completed") -> list[dict[str, Any]]:
        item = self.open
        if item is None:
            return []
        self.open = None
        at = {"item_id": item["id"], "output_index": self.items.index(item)}
        out = []
        if item["type"] == "message":
            part = item["content"][0]
            out += [
                self._ev(
                    "response.output_text.done",
                    **at,
                    content_index=0,
                    text=part["text"],
                    logprobs=part["logprobs"],
                ),
                self._ev("response.content_part.done", **at, content_index=0, part=_copy(part)),
            ]
        elif item["type"] == "reasoning":
            part = item["content"][0]
            out += [
                self._ev("response.reasoning_text.done", **at, content_index=0, text=part["text"]),
                self._ev("response.content_part.done", **at, content_index=0, part=_copy(part)),
            ]
        elif item["type"] == "custom_tool_call":
            text = self.inputs.pop(item["id"]).final()
            if text.startswith(item["input"]) and len(text) > len(item["input"]):
                rest = text[len(item["input"]) :]
                out.append(self._ev("response.custom_tool_call_input.delta", **at, delta=rest))
            item["input"] = text
            out.append(self._ev("response.custom_tool_call_input.done", **at, input=text))
        else:
            out.append(
                self._ev(
                    "response.function_call_arguments.done",
                    **at,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            )
        item["status"] = status
        out.append(
            self._ev("response.output_item.done", output_index=at["output_index"], item=_copy(item))
        )
        return out

    # -- the response object -----------------------------------------------------------------
    def response(self) -> dict[str, Any]:
        done = self.done
        if self.error is not None:
            status = "failed"
        elif done is None:
            status = "in_progress"
        else:
            status = "incomplete" if done.reason == "length" else "completed"
        usage = None
        if done is not None:
            u = done.usage
            usage = {
                "input_tokens": u.prompt_tokens,
                # corral keeps no separate account of tokens written to the prompt cache
                "input_tokens_details": {"cached_tokens": u.cached_tokens, "cache_write_tokens": 0},
                "output_tokens": u.completion_tokens,
                "output_tokens_details": {
                    "reasoning_tokens": min(self.thinking_deltas, u.completion_tokens)
                },
                "total_tokens": u.prompt_tokens + u.completion_tokens,
            }
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": False,
            "completed_at": self.completed_at if status == "completed" else None,
            "error": None
            if self.error is None
            else {"code": "server_error", "message": self.error},
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete"
            else None,
            "model": self.model,
            "output": [_copy(i) for i in self.items],
            "usage": usage,
            **self.echo,
        }

    # -- driving it ----------------------------------------------------------------------------
    async def consume(self, events: AsyncIterator[Event]) -> None:
        """A whole answer: feed every event, keep only the result."""
        async for ev in events:
            self.feed(ev)
        if self.done is None:
            self.finish(Done("stop", Usage()))

    async def sse(self, events: AsyncIterator[Event]) -> AsyncIterator[bytes]:
        """The streamed answer, as OpenAI's server-sent events."""
        for e in self.start():
            yield sse(e["type"], e)
        try:
            async for ev in events:
                for e in self.feed(ev):
                    yield sse(e["type"], e)
        except ApiError as err:  # the runner failed mid-stream: the headers are long gone
            note_error(err)  # rendered here, not by the family: the log says it too
            for e in self.fail(err.message):
                yield sse(e["type"], e)
            return
        if self.done is None:
            for e in self.finish(Done("stop", Usage())):
                yield sse(e["type"], e)


class CustomInput:
    """A custom tool call's input: the string the model writes as the function argument
    `{"input": "..."}`, decoded as the JSON arrives so that it streams. Escapes are decoded
    whole (a piece ending inside one waits for the rest), so the pieces add up to the string."""

    HEAD = '{"input":"'

    def __init__(self) -> None:
        self.raw = ""  # the arguments' JSON as written
        self.pos = -1  # where the undecoded rest of the string starts; -1: not yet found
        self.done = False  # the string's closing quote was seen, or the JSON has another shape

    def feed(self, piece: str) -> str:
        """The input text that `piece` of the arguments completes."""
        self.raw += piece
        if self.done:
            return ""
        if self.pos < 0:
            head = _STRING_HEAD.match(self.raw)
            if head is None:
                # Another shape than {"input": "..."}: the whole input comes at the end.
                self.done = not self.HEAD.startswith("".join(self.raw.split()))
                return ""
            self.pos = head.end()
        end = self.pos
        while end < len(self.raw):
            c = self.raw[end]
            if c == '"':
                self.done = True
                break
            if c != "\\":
                end += 1
                continue
            # \uD83D\uDE00: a surrogate pair is decoded together
            size = 2 if self.raw[end + 1 : end + 2] != "u" else 6
            if size == 6 and 0xD8 <= _hex_byte(self.raw[end + 2 : end + 4]) <= 0xDB:
                size = 12
            if end + size > len(self.raw):
                break
            end += size
        text = self.raw[self.pos : end]
        self.pos = end
        try:
            return str(json.loads(f'"{text}"', strict=False))
        except ValueError:  # not JSON after all
            self.done = True
            return ""

    def final(self) -> str:
        """The whole input: the string value of the arguments' one key (`input` as asked,
        or another name a model chose), else the arguments as they were written."""
        try:
            args = json.loads(self.raw)
        except ValueError:  # cut short (max_output_tokens): what the string had so far
            return self._prefix() if self.pos >= 0 else self.raw
        if isinstance(args, str):
            return args
        if isinstance(args, dict):
            if isinstance(args.get("input"), str):
                return str(args["input"])
            strings = [v for v in args.values() if isinstance(v, str)]
            if len(args) == 1 and strings:
                return strings[0]
        return self.raw

    def _prefix(self) -> str:
        head = _STRING_HEAD.match(self.raw)
        assert head is not None
        return str(json.loads(f'"{self.raw[head.end() : self.pos]}"', strict=False))


_STRING_HEAD = re.compile(r'\s*\{\s*"input"\s*:\s*"')


def _hex_byte(digits: str) -> int:
    try:
        return int(digits, 16)
    except ValueError:
        return -1


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    """A snapshot of an item: the one in `items` keeps growing after an event carries it."""
    return orjson.loads(orjson.dumps(item))


def _logprob(lp: dict[str, Any], top: int) -> dict[str, Any]:
    """A llama.cpp (OpenAI chat) logprob entry as the Responses API writes one."""

    def one(e: dict[str, Any]) -> dict[str, Any]:
        return {
            "token": e.get("token", ""),
            "bytes": e.get("bytes") or [],
            "logprob": e.get("logprob", 0.0),
        }

    return {**one(lp), "top_logprobs": [one(t) for t in (lp.get("top_logprobs") or [])[:top]]}
