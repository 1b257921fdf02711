"""OpenAI's answers where corral renders them (not llama.cpp's own bytes passed on): the chat
completion chunks the shared events render to (`chunks_of`, usage included), the legacy
completions' logprobs and echoed prompt (`Legacy`), and n choices' generations merged into one
stream (`Fan`, `fan_stream`: each choice's index, one usage at the end)."""

from __future__ import annotations

import asyncio
import codecs
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import orjson

from corral.api.chat import Done, Event, Text, Thinking, ToolCall, Usage, unhandled
from corral.api.family import OPENAI
from corral.api.service import Service
from corral.api.stream import RelayResponse
from corral.errors import ApiError
from corral.runtime.hop import Lease


def usage_object(u: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }


def add_usage(total: dict[str, Any], u: Any) -> None:
    if not isinstance(u, dict):
        return
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        total[key] += int(u.get(key) or 0)
    details = u.get("prompt_tokens_details") or {}
    total["prompt_tokens_details"]["cached_tokens"] += int(details.get("cached_tokens") or 0)


def choice_chunk(
    delta: dict[str, Any], finish: str | None = None, logprobs: dict[str, Any] | None = None
) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": delta, "logprobs": logprobs,
                         "finish_reason": finish}]}  # fmt: skip


def chunks_of(ev: Event) -> list[dict[str, Any]]:
    """The chat completion chunks an event renders to."""
    match ev:
        case Text():
            return [choice_chunk({"content": ev.text}, None, chat_logprobs(ev.logprobs))]
        case Thinking():
            return [choice_chunk({"reasoning_content": ev.text})]
        case ToolCall():
            call: dict[str, Any] = {"index": ev.index}
            if ev.id:
                call["id"] = ev.id
                call["type"] = "function"
            call["function"] = ({"name": ev.name, "arguments": ev.arguments} if ev.name
                                else {"arguments": ev.arguments})  # fmt: skip
            return [choice_chunk({"tool_calls": [call]})]
        case Done():
            return [choice_chunk({}, ev.reason), {"choices": [], "usage": usage_object(ev.usage)}]
        case _:
            unhandled(ev)


def chat_logprobs(entries: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    return {"content": list(entries)} if entries else None


class Cursor:
    """Character offsets of tokens in the text they make up. A token can hold part of a UTF-8
    character (llama.cpp then gives its bytes): it adds no characters until one completes."""

    def __init__(self, at: int = 0) -> None:
        self.at = at
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def advance(self, data: bytes) -> int:
        """The offset of a token with these bytes, moving past it."""
        start = self.at
        self.at += len(self.decoder.decode(data))
        return start


def token_bytes(token: Any) -> bytes:
    # llama.cpp gives a token that is not valid UTF-8 on its own as a list of byte values.
    return bytes(token) if isinstance(token, list) else str(token).encode()


class Legacy:
    """One generation's completions in OpenAI's legacy shape: the echoed prompt before the
    text, and logprobs as parallel lists (tokens, token_logprobs, top_logprobs, text_offset)
    instead of llama.cpp's chat-style `content` list.

    llama.cpp cannot score prompt tokens, so an echoed prompt's tokens (as the model's
    tokenizer splits its text) come with null token_logprobs and top_logprobs."""

    def __init__(self, prompts: list[str | list[int]], k: int | None, echo: bool) -> None:
        self.prompts = prompts
        self.k = k
        self.echo = echo
        self.prefix: list[tuple[str, dict[str, Any] | None]] = []  # per prompt: text, logprobs
        self.cursors: dict[int, Cursor] = {}  # per prompt: where its next token starts

    async def prepare(self, svc: Service, lease: Lease) -> None:
        if not self.echo:
            return
        for p in self.prompts:
            if isinstance(p, str):
                text = p
            else:
                detok = await lease.hop.api.post_json("/detokenize", {"tokens": p})
                text = detok["content"]
            lp = None
            if self.k is not None:
                toks = await lease.hop.api.post_json(
                    "/tokenize", {"content": text, "with_pieces": True}
                )
                pieces = [token_bytes(t.get("piece", "")) for t in toks.get("tokens") or ()]
                cursor = Cursor()
                lp = {
                    "tokens": [b.decode(errors="replace") for b in pieces],
                    "token_logprobs": [None] * len(pieces),
                    "top_logprobs": [None] * len(pieces),
                    "text_offset": [cursor.advance(b) for b in pieces],
                }
            self.prefix.append((text, lp))

    def _convert(self, choice: dict[str, Any]) -> None:
        p = int(choice.get("index") or 0)
        cursor = self.cursors.get(p)
        if cursor is None:  # the generated text starts after the echoed prompt
            start = len(self.prefix[p][0]) if p < len(self.prefix) else 0
            cursor = self.cursors[p] = Cursor(start)
        lp = choice.get("logprobs")
        content = lp.get("content") if isinstance(lp, dict) else None
        if self.k is not None and content is not None:
            out: dict[str, list[Any]] = {
                "tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": [],
            }  # fmt: skip
            for t in content:
                token = str(t.get("token", ""))
                top = {
                    str(x.get("token", "")): x.get("logprob")
                    for x in (t.get("top_logprobs") or ())[: self.k]
                }
                top.setdefault(token, t.get("logprob"))  # OpenAI: the top k plus the sampled
                out["tokens"].append(token)
                out["token_logprobs"].append(t.get("logprob"))
                out["top_logprobs"].append(top)
                out["text_offset"].append(cursor.advance(token_bytes(t.get("bytes", token))))
            choice["logprobs"] = out
        else:
            choice["logprobs"] = None
        choice["text"] = str(choice.get("text") or "")

    def whole(self, data: dict[str, Any]) -> None:
        for choice in data.get("choices") or ():
            p = int(choice.get("index") or 0)
            self._convert(choice)
            if self.echo and p < len(self.prefix):
                text, plp = self.prefix[p]
                choice["text"] = text + choice["text"]
                lp = choice.get("logprobs")
                if plp is not None:
                    lp = lp or {key: [] for key in plp}
                    choice["logprobs"] = {key: plp[key] + lp[key] for key in plp}

    def head(self) -> list[dict[str, Any]]:
        """Streamed: one chunk per prompt with the echoed prompt, before the generated text."""
        return [
            {"choices": [{"text": text, "index": p, "logprobs": lp, "finish_reason": None}]}
            for p, (text, lp) in enumerate(self.prefix)
        ]

    def chunk(self, data: dict[str, Any]) -> None:
        for choice in data.get("choices") or ():
            self._convert(choice)


class Fan:
    """n chunk sources pumped concurrently into one queue, tagged with their choice index."""

    def __init__(self, sources: list[AsyncIterator[dict[str, Any]]]) -> None:
        self.n = len(sources)
        self.queue: asyncio.Queue[tuple[int, dict[str, Any] | BaseException | None]] = (
            asyncio.Queue()
        )
        self.tasks = [asyncio.ensure_future(self._pump(i, s)) for i, s in enumerate(sources)]

    async def _pump(self, i: int, source: AsyncIterator[dict[str, Any]]) -> None:
        try:
            async for chunk in source:
                self.queue.put_nowait((i, chunk))
        except Exception as e:  # handed to the reader, which reports it
            self.queue.put_nowait((i, e))
        else:
            self.queue.put_nowait((i, None))

    async def __aiter__(self) -> AsyncIterator[tuple[int, dict[str, Any]]]:
        left = self.n
        while left:
            i, item = await self.queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item

    def close(self) -> None:
        """Stop every generation: their leases go back and the runner stops generating."""
        for t in self.tasks:
            t.cancel()


async def fan_stream(
    fan: Fan, n: int, obj: str, ident: str, model: str, include_usage: bool
) -> AsyncIterator[bytes]:
    """The merged SSE stream. An error before the first chunk is raised (an HTTP error);
    after it, it is reported in the stream as OpenAI does."""
    created = int(time.time())
    usage = usage_object(Usage())
    sent = False
    try:
        async for i, chunk in fan:
            add_usage(usage, chunk.pop("usage", None))
            choices = chunk.get("choices")
            if not choices:
                continue
            for c in choices:
                c["index"] = int(c.get("index") or 0) * n + i
            chunk.update(id=ident, object=obj, created=created, model=model)
            sent = True
            yield b"data: " + orjson.dumps(chunk) + b"\n\n"
    except ApiError as e:
        if not sent:
            raise
        yield OPENAI.event(e)
        return
    if include_usage:
        last = {"id": ident, "object": obj, "created": created, "model": model,
                "choices": [], "usage": usage}  # fmt: skip
        yield b"data: " + orjson.dumps(last) + b"\n\n"
    yield b"data: [DONE]\n\n"


async def prepend(first: bytes, rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    yield first
    async for chunk in rest:
        yield chunk


class FanStream(RelayResponse):
    """Streams a fan-out; every generation is stopped however the response ends."""

    def __init__(self, body: AsyncIterator[bytes], fan: Fan) -> None:
        super().__init__(body, OPENAI.media_type)
        self.fan = fan

    async def close(self) -> None:
        self.fan.close()
