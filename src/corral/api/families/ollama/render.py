"""Ollama's answers from a generation's events: NDJSON chunks (`response` for generate,
`message` for chat) streamed a read from the runner at a time, or merged into one answer; a
failure mid-stream ends the stream with the family's error line (the routes are in
routes.py).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from corral.api.chat import Done, Event, RawText, Text, Thinking, ToolCall, unhandled
from corral.api.common import json_response, now_rfc3339, until_disconnect
from corral.api.events import Generation
from corral.api.family import OLLAMA
from corral.errors import ApiError


def ns(seconds: float) -> int:
    return int(seconds * 1e9)


class OllamaChunks:
    """Events -> Ollama chunks (`response` for generate, `message` for chat); the last one
    carries done, the reason and the timings."""

    def __init__(
        self,
        gen: Generation,
        model: str,
        kind: str,
        start: float,
        top: int | None,
        context_of: Callable[[str], Awaitable[list[int] | None]] | None = None,
    ) -> None:
        self.gen, self.model, self.kind, self.start, self.top = gen, model, kind, start, top
        self.context_of = context_of
        self.calls: dict[int, dict[str, str]] = {}
        # the answer's text, for `context`: strings, and the plain path's JSON string literals
        self.answer: list[str | bytes] = []

    async def feed(self, ev: Event) -> list[dict[str, Any]]:
        """The chunks `ev` renders to: a tool call's go out whole with the last chunk."""
        match ev:
            case Text():
                self.answer.append(ev.text)
                lp = _logprobs(ev.logprobs, self.top)
                return [_chunk(self.model, self.kind, ev.text, None, lp)]
            case Thinking():
                return [_chunk(self.model, self.kind, "", ev.text, None)]
            case ToolCall():
                c = self.calls.setdefault(ev.index, {"name": "", "arguments": ""})
                c["name"] += ev.name
                c["arguments"] += ev.arguments
                return []
            case Done():
                return await self.last(ev)
            case _:
                unhandled(ev)

    async def last(self, ev: Done) -> list[dict[str, Any]]:
        model, kind, out = self.model, self.kind, []
        if self.calls and kind == "message":
            last = _chunk(model, kind, "", None, None)
            last["message"]["tool_calls"] = [
                {"function": {"name": c["name"], "arguments": _json_or_str(c["arguments"])}}
                for _, c in sorted(self.calls.items())
            ]
            out.append(last)
        u = ev.usage
        final: dict[str, Any] = {
            "model": model, "created_at": now_rfc3339(),
            kind: "" if kind == "response" else {"role": "assistant", "content": ""},
            "done": True, "done_reason": "length" if ev.reason == "length" else "stop",
        }  # fmt: skip
        if self.context_of is not None:
            context = await self.context_of(self.answer_text())
            if context is not None:
                final["context"] = context
        final |= {
            "total_duration": ns(time.monotonic() - self.start),
            "load_duration": ns(self.gen.lease.waited) if self.gen.lease.loaded else 0,
            "prompt_eval_count": u.prompt_tokens,
            "prompt_eval_duration": int(u.prompt_ms * 1e6),
            "eval_count": u.completion_tokens,
            "eval_duration": int(u.predicted_ms * 1e6),
        }
        out.append(final)
        return out

    def answer_text(self) -> str:
        """The answer so far: the plain path's literals decoded at once, here at the end."""
        texts = [a for a in self.answer if isinstance(a, str)]
        if len(texts) == len(self.answer):
            return "".join(texts)
        literals = [a if isinstance(a, bytes) else orjson.dumps(a) for a in self.answer]
        return "".join(orjson.loads(b"[" + b",".join(literals) + b"]"))

    async def of(self, events: AsyncIterator[Event]) -> AsyncIterator[dict[str, Any]]:
        """The chunks of `events`, one by one."""
        async for ev in events:
            for c in await self.feed(ev):
                yield c


async def ollama_ndjson(render: OllamaChunks) -> AsyncIterator[bytes]:
    """The streamed answer: the chunks of one read from the runner in one piece. A plain
    content token (Generation.batches) is written around its JSON string as it came: the same
    bytes as its chunk through orjson, without parsing and re-encoding it; the chunks of one
    read share their `created_at`; the literals are kept where `context` needs the answer."""
    plain = render.top is None
    keep = render.answer if render.context_of is not None else None
    head = b'{"model":' + orjson.dumps(render.model) + b',"created_at":"'
    if render.kind == "response":
        mid, tail = b'","response":', b',"done":false}\n'
    else:
        mid, tail = b'","message":{"role":"assistant","content":', b'},"done":false}\n'
    try:
        async for batch in render.gen.batches(plain):
            out: list[bytes] = []
            stamp = b""
            for ev in batch:
                if isinstance(ev, RawText):  # the plain fast path, on purpose
                    if not stamp:
                        stamp = head + created_at().encode() + mid
                    out += (stamp, ev.literal, tail)
                    if keep is not None:
                        keep.append(ev.literal)
                else:
                    out += [orjson.dumps(c) + b"\n" for c in await render.feed(ev)]
            if out:
                yield b"".join(out)
    except ApiError as e:  # mid-stream failure: Ollama reports it as a final error line
        yield OLLAMA.event(e)


_second: list[Any] = [None, ""]  # the last whole second formatted, and its text


def created_at() -> str:
    """now_rfc3339() (the time to the microsecond, as datetime.isoformat writes it), with the
    date and time of day formatted once a second: it is in every streamed chunk."""
    t = time.time()
    sec = int(t)
    us = round((t - sec) * 1e6)
    if us >= 1_000_000:
        sec, us = sec + 1, us - 1_000_000
    if _second[0] != sec:
        _second[:] = sec, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(sec))
    return f"{_second[1]}.{us:06d}Z" if us else f"{_second[1]}Z"


def _chunk(
    model: str, kind: str, text: str, thinking: str | None, logprobs: list[dict[str, Any]] | None
) -> dict[str, Any]:
    """One streamed Ollama chunk: generate has `response` (+ `thinking`), chat a `message`."""
    out: dict[str, Any] = {"model": model, "created_at": created_at()}
    if kind == "response":
        out["response"] = text
        if thinking:
            out["thinking"] = thinking
    else:
        out["message"] = {"role": "assistant", "content": text}
        if thinking:
            out["message"]["thinking"] = thinking
    out["done"] = False
    if logprobs is not None:
        out["logprobs"] = logprobs
    return out


def _logprobs(entries: tuple[dict[str, Any], ...], top: int | None) -> list[dict[str, Any]] | None:
    """llama.cpp's per-token entries in Ollama's shape; None when not asked for."""
    if top is None:
        return None

    def one(e: dict[str, Any]) -> dict[str, Any]:
        return {"token": e.get("token", ""), "logprob": e.get("logprob", 0.0),
                "bytes": e.get("bytes")}  # fmt: skip

    return [
        {**one(e), "top_logprobs": [one(t) for t in (e.get("top_logprobs") or [])[:top]]}
        for e in entries
    ]


def _json_or_str(text: str) -> Any:
    try:
        return orjson.loads(text) if text else {}
    except orjson.JSONDecodeError:
        return text


def merge(chunks: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    """A whole non-streamed answer from the chunks of a streamed one."""
    final = chunks[-1]
    body = [c for c in chunks[:-1]]
    if kind == "response":
        final["response"] = "".join(c["response"] for c in body)
        thinking = "".join(c.get("thinking", "") for c in body)
        if thinking:
            final["thinking"] = thinking
    else:
        msg = final["message"]
        msg["content"] = "".join(c["message"]["content"] for c in body)
        thinking = "".join(c["message"].get("thinking", "") for c in body)
        if thinking:
            msg["thinking"] = thinking
        calls = [tc for c in body for tc in c["message"].get("tool_calls", [])]
        if calls:
            msg["tool_calls"] = calls
    if any("logprobs" in c for c in body):
        final["logprobs"] = [lp for c in body for lp in c.get("logprobs", [])]
    return final


async def respond(
    request: Request,
    stream: bool,
    gen: Generation,
    model: str,
    kind: str,
    start: float,
    top: int | None,
    context_of: Callable[[str], Awaitable[list[int] | None]] | None = None,
) -> Response:
    render = OllamaChunks(gen, model, kind, start, top, context_of)
    if stream:
        return gen.response(lambda _: ollama_ndjson(render), OLLAMA)
    try:
        whole = await until_disconnect(request, _all(render.of(gen.events())))
        return json_response(merge(whole, kind))
    finally:
        gen.close()


async def _all(chunks: AsyncIterator[dict[str, Any]]) -> list[dict[str, Any]]:
    return [c async for c in chunks]
