"""A stream that the shared KV cache filled mid-answer, continued where it stopped.

A runner's slots share one KV cache (kv_unified). Requests that each fit it can still outgrow
it together as their answers grow, and llama.cpp then fails every request it is processing
("Context size has been exceeded"), clearing their cells. A request that has not answered yet
is simply sent again (RunnerClient); a stream whose client has already had part of the answer
cannot be started over. `ContinuedStream` continues it instead: once the request can run
alone, it is sent again with the answer so far as its prefill (llama.cpp's assistant prefill
for a chat; the prompt and the text for a completion) and what is left of its token budget,
and the new stream is joined to the old one, so the client reads one answer: the new stream's
opening role event is dropped, its id is the first one's, and its final counts include the
tokens generated before.

Only plain text can be continued this way: an answer that has started a tool call or reasoning,
or that a grammar or schema constrains (which would start over from the prefill; a lazy
grammar's text before its trigger is free), ends with llama.cpp's error as before (a 503,
CacheFull, where corral renders the stream; the OpenAI pass-through relays llama.cpp's own)."""

from __future__ import annotations

import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

import orjson

from corral.errors import ApiError
from corral.runtime.affinity import GENERATION_PATHS
from corral.runtime.meter import ROLE_EVENT, token_events
from corral.runtime.runner_errors import is_cache_full

log = logging.getLogger(__name__)

CONTINUATIONS = 8  # at most this many continuations of one stream
KEEP_MAX = 8 << 20  # bytes of a stream kept to continue it: past them it is not continued
_BUDGETS = ("max_tokens", "max_completion_tokens", "n_predict")
WORD_TRIGGER = 1  # llama.cpp's COMMON_GRAMMAR_TRIGGER_TYPE_WORD
_ID = re.compile(rb'"id":"[^"\\]*"')
# Counts in a stream's last events: those of generated tokens grow by the tokens generated
# before, the prompt's (which now include the answer so far as prefill) shrink by its tokens.
_GENERATED = re.compile(rb'"(completion_tokens|predicted_n|tokens_predicted)":(\d+)')
_PROMPT = re.compile(rb'"(prompt_tokens|tokens_evaluated|prompt_n)":(\d+)')
_TOTAL = re.compile(rb'"(total_tokens)":(\d+)')


def continuable(path: str, payload: dict[str, Any]) -> bool:
    """Whether a streamed request to `path` could be continued from a prefill of its answer."""
    if path not in GENERATION_PATHS or not payload.get("stream") or payload.get("echo"):
        return False
    if payload.get("json_schema") or (payload.get("grammar") and not lazy_words(payload)):
        return False
    fmt = payload.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type", "text") != "text":
        return False
    if path == "/v1/chat/completions":
        messages = payload.get("messages")
        if not isinstance(messages, list) or not messages or not isinstance(messages[-1], dict):
            return False
        last = messages[-1]
        # a client's own prefill is extended (a string only)
        return last.get("role") != "assistant" or isinstance(last.get("content"), str)
    prompt = payload.get("prompt")
    if isinstance(prompt, str):
        return True
    return isinstance(prompt, list) and all(
        isinstance(p, (str, int)) and not isinstance(p, bool) for p in prompt
    )


def lazy_words(payload: dict[str, Any]) -> list[str] | None:
    """The words that start a lazy grammar (a tool call corral offers a model whose template
    knows none): until one is written the text is free, so an answer without one continues
    as it would have. None for a grammar that constrains from the start, or from a trigger
    other than a word."""
    triggers = payload.get("grammar_triggers")
    if not payload.get("grammar_lazy") or not isinstance(triggers, list) or not triggers:
        return None
    if not all(
        isinstance(t, dict) and t.get("type") == WORD_TRIGGER and isinstance(t.get("value"), str)
        for t in triggers
    ):
        return None
    return [t["value"] for t in triggers]


def answered(path: str, events: bytes) -> str | None:
    """The text these whole SSE events of llama.cpp's streamed for a request to `path`; None
    if they hold anything but text (a tool call, reasoning) or cannot be read."""
    out: list[str] = []
    for line in events.split(b"\n"):
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        try:
            data = orjson.loads(line[6:])
        except orjson.JSONDecodeError:
            return None
        if not isinstance(data, dict):
            return None
        if path == "/completion":
            text = data.get("content")
        else:
            choices = data.get("choices")
            if choices == []:  # the usage event
                continue
            if not isinstance(choices, list) or len(choices) != 1:
                return None
            choice = choices[0]
            if path == "/v1/completions":
                text = choice.get("text")
            else:
                delta = choice.get("delta")
                if not isinstance(delta, dict):
                    return None
                if delta.get("tool_calls") or delta.get("reasoning_content"):
                    return None
                text = delta.get("content")
        if text is None:
            continue
        if not isinstance(text, str):
            return None
        out.append(text)
    return "".join(out)


def continued(path: str, payload: dict[str, Any], text: str, tokens: int) -> dict[str, Any]:
    """`payload` sent again with `text` (`tokens` generated tokens) already answered."""
    out = dict(payload)
    if not text and not tokens:  # failed before its first token: sent again as it was
        return out
    for key in _BUDGETS:
        budget = out.get(key)
        if isinstance(budget, int) and not isinstance(budget, bool) and budget > 0:
            out[key] = max(budget - tokens, 1)
    if path == "/v1/chat/completions":
        messages = list(out["messages"])
        last = messages[-1]
        if last.get("role") == "assistant":  # the client's prefill, extended
            messages[-1] = {**last, "content": last["content"] + text}
        else:
            messages.append({"role": "assistant", "content": text})
        out["messages"] = messages
    elif isinstance(out["prompt"], str):
        out["prompt"] = out["prompt"] + text
    else:  # tokens and strings: llama.cpp joins them
        out["prompt"] = [*out["prompt"], text]
    return out


def cache_full_at(data: bytes) -> int:
    """Where in `data` (a stream's bytes) llama.cpp's "Context size has been exceeded" event
    (runner_errors.is_cache_full) starts; -1 if it holds none."""
    if b"exceeded" not in data and b"sub-batch" not in data:  # the common case: two scans
        return -1
    for head in (b'\ndata: {"error"', b"\nerror: "):
        i = (b"\n" + data).find(head)
        if i >= 0 and is_cache_full(data[i:].decode(errors="replace")):
            return i
    return -1


class Upstream(Protocol):
    """A runner's streamed answer as the API layer reads it: a RunnerStream (runtime/runner_api),
    or a ContinuedStream of them."""

    status: int

    async def read(self) -> bytes: ...

    async def read_all(self) -> bytes: ...

    def close(self) -> None: ...

    def release(self) -> None: ...

    def __aiter__(self) -> AsyncIterator[bytes]: ...

    async def __anext__(self) -> bytes: ...


class Reader:
    """What a stream read by `read()` (b"" at its end) offers besides: its whole body, and its
    chunks as an async iterator."""

    async def read(self) -> bytes:
        raise NotImplementedError

    async def read_all(self) -> bytes:
        parts = []
        while chunk := await self.read():
            parts.append(chunk)
        return b"".join(parts)

    def __aiter__(self) -> Reader:
        return self

    async def __anext__(self) -> bytes:
        data = await self.read()
        if not data:
            raise StopAsyncIteration
        return data


class _Part(Protocol):
    async def read(self) -> bytes: ...

    def close(self) -> None: ...


class ContinuedStream(Reader):
    """A runner's stream (a RunnerStream) that is continued when the shared cache fills
    mid-answer. `again(payload)` sends the request again once it can run alone and returns the
    new stream; `count(text)` is the tokens the model reads `text` as (the prefill's share of
    the new part's prompt). Reads, iterates and closes as a RunnerStream does."""

    def __init__(
        self,
        stream: Upstream,
        path: str,
        payload: dict[str, Any],
        again: Callable[[dict[str, Any]], Awaitable[Upstream]],
        count: Callable[[str], Awaitable[int]],
    ) -> None:
        self.stream: _Part = stream
        self.status: int = stream.status
        self.path = path
        self.payload = payload
        self.again = again
        self.count = count
        self.prefill = 0  # the tokens the answer so far is read as, in the last part's prompt
        self.kept: list[bytes] = []  # this part's events passed on so far
        self.size = 0
        self.text = ""  # the answer of the earlier parts
        self.tokens = 0  # their generated tokens
        self.times = 0  # continuations so far
        self.pending: dict[str, Any] | None = None  # the next part's payload, to send
        self.first_id: bytes | None = None  # the stream's id, as its first part gave it
        self.opening = False  # the next read opens a new part: its role event is dropped
        self.swap: tuple[bytes, bytes] | None = None  # a new part's id -> the first's
        self.failure = b""  # llama.cpp's error event that ended the last part

    async def read(self) -> bytes:
        while True:
            if self.pending is not None:
                payload, self.pending = self.pending, None
                self.stream.close()
                try:
                    self.prefill = await self.count(self.text)
                    self.stream = await self.again(payload)
                except ApiError as e:  # the runner failed meanwhile: the stream ends on its error
                    log.info("a stream could not be continued: %s", e.message)
                    self.stream = _Ended()
                    return self.failure
                self.opening = True
            data = await self.stream.read()
            if not data:
                return data  # the end
            if self.opening:
                data = self._open(data)
            elif self.swap is not None:
                data = data.replace(*self.swap)
            if self.tokens and (b'"usage":{' in data or b'"timings":{' in data
                                or b'"tokens_predicted":' in data):  # fmt: skip
                data = self._counts(data)
            if self.first_id is None:
                m = _ID.search(data)
                self.first_id = m.group(0) if m else b""
            cut = cache_full_at(data)
            if cut >= 0 and (before := self._continue(data[:cut], data[cut:])) is not None:
                data = before  # the rest comes from the next part
            elif self.size < KEEP_MAX:
                self.kept.append(data)
                self.size += len(data)
            if data:
                return data

    def _continue(self, before: bytes, failure: bytes) -> bytes | None:
        """The stream failed for a full cache (`failure`, llama.cpp's error event) after
        `before`: the next read asks for the rest of the answer (`before` is returned), or None
        if it cannot be continued."""
        self.failure = failure
        self.kept.append(before)
        events = b"".join(self.kept)
        text = answered(self.path, events) if self.size < KEEP_MAX else None
        words = lazy_words(self.payload) or []
        if text is None or self.times >= CONTINUATIONS or any(w in self.text + text for w in words):
            return None  # llama.cpp's error ends it, as before
        self.times += 1
        self.text += text
        self.tokens += token_events(events)
        self.kept, self.size = [], 0
        log.info("the shared context filled mid-answer: the stream continues alone after "
                 "%d tokens (continuation %d)", self.tokens, self.times)  # fmt: skip
        self.pending = continued(self.path, self.payload, self.text, self.tokens)
        return before

    def _open(self, data: bytes) -> bytes:
        """A new part's first bytes: its role event dropped, its id made the first part's."""
        self.opening = False
        m = _ID.search(data)
        if m is not None and self.first_id and m.group(0) != self.first_id:
            self.swap = (m.group(0), self.first_id)
            data = data.replace(*self.swap)
        if data.startswith(ROLE_EVENT):
            end = data.find(b"\n\n")
            data = data[end + 2 :] if end >= 0 else b""
        return data

    def _counts(self, data: bytes) -> bytes:
        """The last part's counts as the whole answer's: its prompt less the prefill, its
        generated tokens and those before."""
        k, p = self.tokens, self.prefill
        data = _GENERATED.sub(lambda m: b'"%s":%d' % (m[1], int(m[2]) + k), data)
        data = _PROMPT.sub(lambda m: b'"%s":%d' % (m[1], max(int(m[2]) - p, 0)), data)
        return _TOTAL.sub(lambda m: b'"%s":%d' % (m[1], max(int(m[2]) + k - p, k)), data)

    def close(self) -> None:
        self.pending = None
        self.stream.close()

    release = close


class _Ended:
    """A stream with nothing more to read: where a continuation could not be sent."""

    async def read(self) -> bytes:
        return b""

    def close(self) -> None:
        pass
