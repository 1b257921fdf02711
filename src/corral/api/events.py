"""The layer every generating API family shares: one neutral chat request goes down to the
runner, one stream of neutral events comes back up, and each family only renders them.

A request's path: the adapter builds a `Chat` (api/chat: OpenAI chat messages, which is what
llama.cpp's templates take, plus tools and sampling parameters), `Service.generate` leases a
runner slot and starts the upstream call, and a `Generation` (one class per kind of runner
stream) yields `Text`, `Thinking`, `ToolCall` and finally `Done` events. The lease is returned
however the response ends (`Generation.response`); an answer that ended in tool calls marks it
(`Lease.tool_call`), so the runner is held for the agent's next turn.

Forced tool use (`tool_choice` "required" or a named function) does not rely on the model's
template being one llama.cpp knows how to constrain: the prompt is rendered with the tools by
the runner's own template (/apply-template) and the completion is constrained by a JSON schema
to `{"name": ..., "arguments": {...}}` for one of the allowed tools, so any model answers with
a well-formed call (`ForcedToolEvents`).

A model whose template knows no tools gets them from corral (`corral.api.toolprompt`): the
tools rendered into its system prompt in Hermes' words, the completion constrained by a lazy
grammar from the `<tool_call>` trigger on, and the calls parsed out of the text as it streams
(`FallbackEvents`), so every chat model takes tools in every API family.
"""

from __future__ import annotations

import re
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from typing import Any

import orjson
from starlette.responses import Response

from corral.api.chat import (
    Done,
    Event,
    RawText,
    Result,
    Text,
    Thinking,
    ToolCall,
    Usage,
    new_id,
    unhandled,
)
from corral.api.family import Family
from corral.api.stream import RelayResponse
from corral.api.toolprompt import Call, CallScanner
from corral.errors import ApiError
from corral.runtime.continuation import Upstream
from corral.runtime.hop import Lease
from corral.runtime.meter import Tally, token_events
from corral.runtime.runner_api import UPSTREAM_ERRORS
from corral.runtime.runner_errors import runner_error_message, stream_failure

# ---- a generation in progress --------------------------------------------------------------


class Generation:
    """One leased runner call turned into events. Iterate `events()` once, inside
    `response()` (streamed) or `collect()` (whole). One class per kind of runner stream:
    `ChatEvents` (a /v1/chat/completions stream), `CompletionEvents` (a /completion or /infill
    stream of raw text), `ForcedToolEvents` (a /completion constrained to one tool call) and
    `FallbackEvents` (a /completion whose text may hold `<tool_call>` blocks)."""

    def __init__(
        self,
        lease: Lease,
        upstream: Upstream,
        stop: list[str],
        explain: Callable[[], Awaitable[str]],
    ) -> None:
        self.lease = lease
        self.upstream = upstream
        self.stop = stop
        self.explain = explain
        self.started = time.monotonic()
        self.source: SSE | None = None
        self.left = 0  # events of the current batch events() has not yielded yet

    def close(self) -> None:
        self.upstream.close()
        self.lease.release()

    def _sse(self) -> SSE:
        self.source = sse_events(self.upstream, self.explain, self.lease.tally)
        return self.source

    def buffered(self) -> bool:
        """Whether the runner's next event has already been read (the events that follow now
        come without waiting)."""
        return self.left > 0 or (self.source is not None and bool(self.source.pending))

    async def events(self) -> AsyncIterator[Event]:
        async for batch in self.batches():
            self.left = len(batch)
            for ev in batch:
                self.left -= 1
                assert not isinstance(ev, RawText)  # only batches(plain=True) gives those
                yield ev

    async def batches(self, plain: bool = False) -> AsyncIterator[list[Event | RawText]]:
        """The events, a list per read from the runner (what came together goes out together).

        With `plain`, a chat stream's content-only delta comes as `RawText`, the JSON string
        literal llama.cpp wrote, unparsed (`Text` otherwise); only where that literal is what
        orjson writes for its text (`PLAIN_TEXT`) and no stop sequence needs the text, so a
        renderer can put it in its own JSON as it is. An answer that ends in tool calls marks
        the lease (`Lease.tool_call`): the agent comes back with the result, so its runner is
        held."""
        async for batch in self._batches(plain):
            last = batch[-1]
            if type(last) is Done and last.reason == "tool_calls":
                self.lease.tool_call = True
            yield batch

    async def _batches(self, plain: bool) -> AsyncIterator[list[Event | RawText]]:
        """A stream of raw text comes an event at a time."""
        async for ev in self._events():
            yield [ev]

    def _events(self) -> AsyncIterator[Event]:
        """The events of a stream of raw text (ChatEvents reads its batches itself)."""
        raise NotImplementedError

    async def collect(self) -> Result:
        text: list[str] = []
        thinking: list[str] = []
        calls: dict[int, dict[str, str]] = {}
        logprobs: list[dict[str, Any]] = []
        done = Done("stop", Usage())
        async for ev in self.events():
            match ev:
                case Text():
                    text.append(ev.text)
                    logprobs.extend(ev.logprobs)
                case Thinking():
                    thinking.append(ev.text)
                case ToolCall():
                    c = calls.setdefault(ev.index, {"id": "", "name": "", "arguments": ""})
                    c["id"] = c["id"] or ev.id or new_id("call_")
                    c["name"] += ev.name
                    c["arguments"] += ev.arguments
                case Done():
                    done = ev
                case _:
                    unhandled(ev)
        tool_calls = [calls[i] for i in sorted(calls)]
        return Result("".join(text), "".join(thinking), tool_calls, done, logprobs)

    def response(
        self, render: Callable[[AsyncIterator[Event]], AsyncIterator[bytes]], family: Family
    ) -> Response:
        """A streaming response of `render(events)` in `family`'s stream type; the lease and
        the upstream go back when it ends, fails or the client leaves. What the events of one
        read from the runner render to goes out in one write."""
        return _GenerationStream(render(self.events()), self, family.media_type)


class _GenerationStream(RelayResponse):
    def __init__(self, body: AsyncIterator[bytes], gen: Generation, media_type: str) -> None:
        super().__init__(body, media_type, more=gen.buffered)
        self.gen = gen

    async def close(self) -> None:
        self.gen.close()  # closing the upstream makes llama.cpp stop generating


class ChatEvents(Generation):
    """A /v1/chat/completions stream: content, reasoning and tool-call deltas as events; stop
    sequences found by corral."""

    async def _batches(self, plain: bool) -> AsyncIterator[list[Event | RawText]]:
        reason, usage = "stop", Usage()
        scan = StopScanner(self.stop)
        deltas = 0  # content deltas: one token each, the count when a stop sequence cuts in
        sse = self._sse()
        sse.plain = plain and not scan.stops
        while items := await sse.batch():
            out: list[Event | RawText] = []
            for data in items:
                if type(data) is bytes:  # a plain content delta (never empty)
                    deltas += 1
                    out.append(RawText(data))
                    continue
                if data.get("timings"):
                    usage = _usage(data)
                for choice in data.get("choices") or ():
                    delta = choice.get("delta") or {}
                    if delta.get("reasoning_content"):
                        out.append(Thinking(delta["reasoning_content"]))
                    if delta.get("content"):
                        deltas += 1
                        text, hit = scan.feed(delta["content"])
                        lp = tuple((choice.get("logprobs") or {}).get("content") or ())
                        if text or lp:
                            out.append(Text(text, lp))
                        if hit is not None:  # returning closes the upstream: llama.cpp stops
                            out.append(Done("stop", replace(usage, completion_tokens=deltas), hit))
                            yield out
                            return
                    for tc in delta.get("tool_calls") or ():
                        fn = tc.get("function") or {}
                        out.append(ToolCall(
                            tc.get("index", 0), tc.get("id") or "", fn.get("name") or "",
                            fn.get("arguments") or "",
                        ))  # fmt: skip
                    if choice.get("finish_reason"):
                        reason = choice["finish_reason"]
            if out:
                yield out
        rest = scan.flush()
        yield [Text(rest), Done(reason, usage)] if rest else [Done(reason, usage)]


class CompletionEvents(Generation):
    """A /completion (or /infill) stream of raw text."""

    def _events(self) -> AsyncIterator[Event]:
        return self._text_events()

    async def _text_events(self) -> AsyncIterator[Event]:
        scan = StopScanner(self.stop)
        deltas = 0
        async for data in self._sse():
            if data.get("content"):
                deltas += 1
                text, hit = scan.feed(data["content"])
                lp = tuple(data.get("completion_probabilities") or ())
                if text or lp:
                    yield Text(text, lp)
                if hit is not None:
                    yield Done("stop", Usage(completion_tokens=deltas), hit)
                    return
            if data.get("stop"):
                rest = scan.flush()
                if rest:
                    yield Text(rest)
                reason = "length" if data.get("stop_type") == "limit" else "stop"
                yield Done(reason, _usage(data))
                return


class FallbackEvents(CompletionEvents):
    """A /completion whose text may hold `<tool_call>` blocks calling `tools` (a model whose
    template knows no tools: api/toolprompt)."""

    def __init__(
        self,
        lease: Lease,
        upstream: Upstream,
        stop: list[str],
        explain: Callable[[], Awaitable[str]],
        *,
        tools: frozenset[str],
    ) -> None:
        super().__init__(lease, upstream, stop, explain)
        self.tools = tools

    async def _events(self) -> AsyncIterator[Event]:
        """A completion's text with the `<tool_call>` blocks in it as calls: text before a
        call streams as it comes; a call goes out whole once its block is closed (its name,
        then its arguments); a block that is not a call stays text. Logprobs go with the next
        text that goes out (a call's own are dropped)."""
        scan = CallScanner(self.tools)
        index = 0
        logprobs: list[dict[str, Any]] = []
        async for ev in self._text_events():
            if isinstance(ev, Done):
                pieces = scan.finish()
            elif isinstance(ev, Text):
                pieces = scan.feed(ev.text)
                logprobs.extend(ev.logprobs)
            else:
                continue
            for p in pieces:
                if isinstance(p, Call):
                    yield ToolCall(index, new_id("call_"), p.name, "")
                    yield ToolCall(index, arguments=p.arguments)
                    index += 1
                    logprobs.clear()
                else:
                    yield Text(p, tuple(logprobs))
                    logprobs.clear()
            if isinstance(ev, Done):
                if index and ev.reason == "stop":
                    ev = Done("tool_calls", ev.usage, ev.stop_sequence)
                yield ev
                return


class ForcedToolEvents(Generation):
    """A /completion constrained by a JSON schema to one call of the allowed tools."""

    async def _events(self) -> AsyncIterator[Event]:
        """A forced call streams like a native one: its name once the schema-shaped output
        `{"name": "...", "arguments": {...}}` has it, then the arguments' JSON as it comes,
        less the closing brace of the outer object. Cut short by max_tokens, the call keeps
        its partial arguments and the reason is "length"."""
        out = ""  # everything generated
        header: re.Match[str] | None = None
        sent = 0  # characters of the arguments already passed on
        final: dict[str, Any] = {}
        async for data in self._sse():
            out += data.get("content", "")
            if data.get("stop"):
                final = data
                break
            if header is None:
                header = _CALL_HEAD.match(out)
                if header is None:
                    continue
                yield ToolCall(0, new_id("call_"), json_string(header.group(1)), "")
            # The last "}" may be the outer object's: hold it back until more follows.
            args = out[header.end() :].rstrip()
            safe = len(args) - 1 if args.endswith("}") else len(args)
            if safe > sent:
                yield ToolCall(0, arguments=args[sent:safe])
                sent = safe
        usage = _usage(final)
        complete = True
        try:
            orjson.loads(out)
        except orjson.JSONDecodeError:
            complete = False
        if header is None:
            # Cut before the arguments began: the call still has its name, if that is whole.
            named = _CALL_HEAD.match(out) or _NAME_HEAD.match(out)
            if named is not None:
                yield ToolCall(0, new_id("call_"), json_string(named.group(1)), "")
            if named is None or named.re is _NAME_HEAD:
                yield Done("length", usage)
                return
            header = named
        args = out[header.end() :].rstrip()
        if complete:
            args = args.removesuffix("}").rstrip()
        if len(args) > sent:
            yield ToolCall(0, arguments=args[sent:])
        yield Done("tool_calls" if complete else "length", usage)


def _usage(ev: dict[str, Any]) -> Usage:
    t = ev.get("timings") or {}
    u = ev.get("usage") or {}
    prompt = int(u.get("prompt_tokens") or (t.get("prompt_n", 0) + t.get("cache_n", 0)))
    completion = int(u.get("completion_tokens") or t.get("predicted_n", 0))
    return Usage(
        prompt, completion, int(t.get("cache_n", 0)),
        float(t.get("prompt_ms", 0.0)), float(t.get("predicted_ms", 0.0)),
    )  # fmt: skip


class SSE:
    """The JSON objects of a llama.cpp SSE stream; ApiError if the runner fails mid-stream
    (`explain` says why: its exit status and last log lines). Each read from the runner is
    split and parsed whole: `pending` holds what it brought that was not taken yet."""

    def __init__(
        self,
        resp: Upstream,
        explain: Callable[[], Awaitable[str]],
        tally: Tally | None = None,
    ) -> None:
        self.upstream = resp
        self.explain = explain
        self.tally = tally  # the generated tokens, counted as they are read
        self.pending: deque[Any] = deque()  # objects, or the ApiError that ends the stream
        self.tail = b""  # a line not yet complete
        self.ended = False
        self.plain = False  # plain content deltas are taken as their JSON string (bytes)
        self.rest = b""  # the last rest of a plain delta's line that PLAIN_REST matched

    def __aiter__(self) -> SSE:
        return self

    async def __anext__(self) -> Any:
        pending = self.pending
        while not pending:
            if self.ended:
                raise StopAsyncIteration
            await self._read()
        item = pending.popleft()
        if isinstance(item, ApiError):
            self.ended = True
            pending.clear()
            raise item
        return item

    async def batch(self) -> list[Any]:
        """What one read from the runner brought (at most one read: [] at the end); the
        ApiError that ends a stream is raised once the objects before it were taken."""
        pending = self.pending
        while not pending:
            if self.ended:
                return []
            await self._read()
        if isinstance(pending[0], ApiError):
            self.ended = True
            item = pending.popleft()
            pending.clear()
            raise item
        items = list(pending)
        pending.clear()
        # A failure is the last thing a read brings (`_read` stops there): raised next time.
        if isinstance(items[-1], ApiError):
            pending.append(items.pop())
        return items

    async def _read(self) -> None:
        try:
            data = await self.upstream.read()
        except UPSTREAM_ERRORS:  # the runner died, was killed, or closed the stream
            raise ApiError(500, await self.explain()) from None
        if data:
            lines = (self.tail + data).split(b"\n")
            self.tail = lines.pop()
        else:  # the end: a last line without its newline counts too
            lines, self.tail, self.ended = [self.tail], b"", True
        plain = self.plain
        tokens = 0  # generated tokens among these events (one a chunk; `token_events`)
        final: Any = None  # llama.cpp's timings at the end (its own count among them)
        for line in lines:
            if plain and line.startswith(PLAIN_HEAD) and (text := self._plain(line)):
                self.pending.append(text)
                tokens += 1
                continue
            if line.startswith(b"data: "):
                body = line[6:].strip()
                if body == b"[DONE]":
                    self.ended = True
                    break
                try:
                    obj = orjson.loads(body)
                except orjson.JSONDecodeError:  # not llama.cpp's own: end the stream with why
                    self.pending.append(ApiError(
                        500, f"the runner sent an event corral cannot read: {body[:200]!r}"))
                    break
                if type(obj) is dict and "error" in obj and len(obj) == 1:
                    # llama.cpp's error mid-stream (e.g. a context its parallel requests
                    # share has filled): the stream ends with it
                    self.pending.append(stream_failure(runner_error_message(body, 500)))
                    break
                self.pending.append(obj)
                tokens += token_events(line)
                if type(obj) is dict and type(timings := obj.get("timings")) is dict:
                    final = timings
            elif line.startswith(b"error: "):
                self.pending.append(stream_failure(runner_error_message(line[7:], 500)))
                break
        if self.tally is not None:
            self.tally.add(tokens)
            if final is not None:
                self.tally.timed(final)

    def _plain(self, line: bytes) -> bytes | None:
        """The JSON string of a plain content delta (PLAIN_HEAD...), None if it is not one
        (or is empty: no token)."""
        start = len(PLAIN_HEAD)
        end = line.find(PLAIN_END, start)
        if end <= start or PLAIN_TEXT.fullmatch(line, start, end) is None:
            return None
        rest = line[end:]
        if rest != self.rest:  # the same but for "created" (seconds) all along a stream
            if PLAIN_REST.fullmatch(rest) is None:
                return None
            self.rest = rest
        return line[start - 1 : end + 1]


def sse_events(
    resp: Upstream, explain: Callable[[], Awaitable[str]], tally: Tally | None = None
) -> SSE:
    """The JSON objects of a llama.cpp SSE stream (see SSE); its tokens counted on `tally`."""
    return SSE(resp, explain, tally)


class StopScanner:
    """Finds stop sequences in streamed text, holding back only what may be the start of one,
    so that corral (not llama.cpp, whose chat API does not say which one matched) can report
    the sequence that ended a generation."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self.buf = ""

    def feed(self, text: str) -> tuple[str, str | None]:
        """The text that is safe to pass on, and the stop sequence if one is now complete
        (the text from it on is dropped)."""
        if not self.stops:
            return text, None
        self.buf += text
        hits = [(i, s) for s in self.stops if (i := self.buf.find(s)) >= 0]
        if hits:
            i, s = min(hits)
            out, self.buf = self.buf[:i], ""
            return out, s
        keep = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.buf)), keep, -1):
                if self.buf.endswith(s[:k]):
                    keep = k
                    break
        out, self.buf = self.buf[: len(self.buf) - keep], self.buf[len(self.buf) - keep :]
        return out, None

    def flush(self) -> str:
        out, self.buf = self.buf, ""
        return out


# A content-only delta as llama.cpp's chat stream writes it (its keys, in its order) ...
PLAIN_HEAD = b'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":"'
PLAIN_END = b'"}}],"created":'
# ... whose string literal is exactly what orjson writes for the text it holds: no escapes but
# those orjson writes the same way (\u escapes, `\/` and raw control characters go the parsed
# way; an escaped quote before PLAIN_END leaves a lone backslash, which does not match) ...
PLAIN_TEXT = re.compile(rb'(?:[^"\\\x00-\x1f]|\\["\\bfnrt])+')
# ... and nothing after it but these (no usage, timings or logprobs).
PLAIN_REST = re.compile(
    rb'"}}],"created":\d+,"id":"[^"\\]*","model":"[^"\\]*","system_fingerprint":"[^"\\]*",'
    rb'"object":"chat\.completion\.chunk"}\r?'
)


# The start of a forced call as the schema shapes it, up to the arguments' first character.
_NAME_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_CALL_HEAD = re.compile(_NAME_HEAD.pattern + r'\s*,\s*"arguments"\s*:\s*')


def json_string(body: str) -> str:
    """The value of a JSON string literal's body (escapes resolved)."""
    return str(orjson.loads(f'"{body}"'))


def forced_schema(tools: list[dict[str, Any]]) -> dict[str, Any]:
    """The JSON schema of one call to one of `tools`."""
    variants = []
    for t in tools:
        fn = t.get("function") or {}
        params = fn.get("parameters") or {"type": "object"}
        variants.append({
            "type": "object",
            "properties": {"name": {"const": fn.get("name", "")}, "arguments": params},
            "required": ["name", "arguments"],
            # Closed, or a weak model goes on after the arguments with keys of its own.
            "additionalProperties": False,
        })  # fmt: skip
    schema = variants[0] if len(variants) == 1 else {"anyOf": variants}
    # llama.cpp's llguidance allows any whitespace between JSON tokens by default, and a weak
    # model can fill max_tokens with it before the call's first key.
    return {**schema, "x-guidance": {"whitespace_flexible": False}}
