"""The soak's requests: one request in each API family's shape, sent and its answer classified
(complete, an explicit error in the family's shape, a client that left on purpose, or BAD);
see `bench/soak.py`."""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from typing import Any

import httpx

__all__ = ["FAMILIES", "PATHS", "Outcome", "StreamState", "build_request", "send"]

FAMILIES = (
    "ollama_chat", "ollama_generate", "openai_chat", "openai_completions", "anthropic",
    "responses",
)  # fmt: skip
PATHS = {
    "ollama_chat": "/api/chat", "ollama_generate": "/api/generate",
    "openai_chat": "/v1/chat/completions", "openai_completions": "/v1/completions",
    "anthropic": "/v1/messages", "responses": "/v1/responses",
}  # fmt: skip


@dataclass
class Outcome:
    family: str
    stream: bool
    model: str
    start: float  # seconds from the start of the soak
    latency: float = math.nan
    status: int | None = None
    outcome: str = "bad"  # complete | error | left | bad
    reason: str = ""  # why BAD, or what kind of error
    message: str = ""  # the error's message
    retry_after: str | None = None
    num_ctx: int | None = None  # set on the requests that flip options
    sent_at: str = ""  # wall clock, as in the server's log


def build_request(
    family: str, model: str, stream: bool, n: int, prompt: str, num_ctx: int | None
) -> dict[str, Any]:
    messages = [{"role": "user", "content": prompt}]
    if family in ("ollama_chat", "ollama_generate"):
        options: dict[str, Any] = {"num_predict": n, "temperature": 0.8}
        if num_ctx is not None:
            options["num_ctx"] = num_ctx
        body: dict[str, Any] = {"model": model, "stream": stream, "options": options}
        if family == "ollama_chat":
            body["messages"] = messages
        else:
            body["prompt"] = prompt
        return body
    if family == "openai_chat":
        return {"model": model, "messages": messages, "max_tokens": n, "stream": stream}
    if family == "openai_completions":
        return {"model": model, "prompt": prompt, "max_tokens": n, "stream": stream}
    if family == "anthropic":
        return {"model": model, "messages": messages, "max_tokens": n, "stream": stream}
    if family == "responses":
        return {"model": model, "input": prompt, "max_output_tokens": n, "stream": stream}
    raise ValueError(family)


def error_message(family: str, body: Any) -> str | None:
    """The message of an error body in the family's shape, else None."""
    if not isinstance(body, dict):
        return None
    err = body.get("error")
    if family.startswith("ollama"):
        return err if isinstance(err, str) and err else None
    if family == "anthropic":
        if body.get("type") != "error" or not isinstance(err, dict):
            return None
        msg = err.get("message")
        return msg if isinstance(msg, str) and msg and isinstance(err.get("type"), str) else None
    if isinstance(err, dict):  # OpenAI and Responses
        msg = err.get("message")
        return msg if isinstance(msg, str) and msg else None
    return None


def whole_answer(family: str, body: Any) -> tuple[str, str]:
    """(outcome, reason or message) of a non-streamed 200 answer."""
    if not isinstance(body, dict):
        return "bad", "200 with a body that is not a JSON object"
    if family.startswith("ollama"):
        if body.get("done") is True:
            return "complete", ""
    elif family in ("openai_chat", "openai_completions"):
        choices = body.get("choices")
        if isinstance(choices, list) and choices and choices[0].get("finish_reason"):
            return "complete", ""
    elif family == "anthropic":
        if body.get("type") == "message" and body.get("stop_reason"):
            return "complete", ""
    elif family == "responses":
        if body.get("status") in ("completed", "incomplete"):
            return "complete", ""
        err = body.get("error")
        if body.get("status") == "failed" and isinstance(err, dict) and err.get("message"):
            return "error", str(err["message"])
    msg = error_message(family, body)
    if msg:
        return "error", msg
    return "bad", "200 without the family's finished answer"


class StreamState:
    """Reads a streamed answer line by line: `end` once the family's end arrived, `error`
    (its message) once an error in the family's shape did."""

    def __init__(self, family: str) -> None:
        self.family = family
        self.end = False
        self.error: str | None = None
        self.event = ""  # the current SSE event name
        self.content = False  # some generated output arrived
        self.malformed = ""

    def feed(self, line: str) -> None:
        if not line:
            self.event = ""
            return
        if self.family.startswith("ollama"):
            try:
                obj = json.loads(line)
            except ValueError:
                self.malformed = self.malformed or line[:120]
                return
            self._ollama(obj)
            return
        if line.startswith("event:"):
            self.event = line[6:].strip()
            return
        if not line.startswith("data:"):
            return  # SSE comments and fields corral does not use
        data = line[5:].strip()
        if data == "[DONE]":
            if self.family in ("openai_chat", "openai_completions"):
                self.end = True
            return
        try:
            obj = json.loads(data)
        except ValueError:
            self.malformed = self.malformed or data[:120]
            return
        if isinstance(obj, dict):
            self._sse(obj)

    def _ollama(self, obj: Any) -> None:
        if not isinstance(obj, dict):
            return
        msg = error_message(self.family, obj)
        if msg:
            self.error = msg
        elif obj.get("done") is True:
            self.end = True
        else:
            self.content = True

    def _sse(self, obj: dict[str, Any]) -> None:
        if self.family in ("openai_chat", "openai_completions"):
            msg = error_message(self.family, obj)
            if msg:
                self.error = msg
            else:
                self.content = True
        elif self.family == "anthropic":
            kind = self.event or str(obj.get("type", ""))
            if kind == "message_stop":
                self.end = True
            elif kind == "error":
                msg = error_message("anthropic", obj)
                self.error = msg or self.error or ""
                if not msg:
                    self.malformed = self.malformed or "Anthropic error event without a message"
            elif kind == "content_block_delta":
                self.content = True
        elif self.family == "responses":
            kind = str(obj.get("type") or self.event)
            if kind in ("response.completed", "response.incomplete"):
                self.end = True
            elif kind == "response.failed":
                err = (obj.get("response") or {}).get("error") or {}
                msg = err.get("message") if isinstance(err, dict) else None
                self.error = msg or ""
                if not msg:
                    self.malformed = self.malformed or "response.failed without a message"
            elif kind == "error":
                msg = obj.get("message") or error_message("responses", obj)
                self.error = str(msg or "")
                if not msg:
                    self.malformed = self.malformed or "error event without a message"
            elif kind.endswith(".delta"):
                self.content = True


async def send(
    client: httpx.AsyncClient, out: Outcome, body: dict[str, Any], leave: bool, t0: float
) -> None:
    """Send one request and fill `out` with what came back."""
    start = time.monotonic()
    try:
        async with client.stream("POST", PATHS[out.family], json=body) as r:
            out.status = r.status_code
            out.retry_after = r.headers.get("retry-after")
            if r.status_code >= 400 or not out.stream:
                raw = await r.aread()
                try:
                    obj = json.loads(raw)
                except ValueError:
                    obj = None
                if r.status_code >= 400:
                    msg = error_message(out.family, obj)
                    if msg:
                        out.outcome, out.reason, out.message = "error", str(r.status_code), msg
                    else:
                        out.reason = f"{r.status_code} without an error in the family's shape"
                        out.message = raw[:200].decode(errors="replace")
                elif r.status_code == 200:
                    out.outcome, text = whole_answer(out.family, obj)
                    if out.outcome == "error":
                        out.reason, out.message = "200 failed", text
                    else:
                        out.reason = text
                else:
                    out.reason = f"unexpected status {r.status_code}"
                return
            if r.status_code != 200:
                out.reason = f"unexpected status {r.status_code}"
                return
            state = StreamState(out.family)
            async for line in r.aiter_lines():
                state.feed(line)
                if state.error is not None or state.end:
                    continue  # read on to the close: nothing may follow but the close
                if leave and state.content:
                    out.outcome, out.reason = "left", "client left mid-stream"
                    return
            if state.error is not None and not state.malformed:
                out.outcome, out.reason, out.message = "error", "mid-stream", state.error
            elif state.end and not state.malformed:
                out.outcome = "complete"
            elif state.malformed:
                out.reason = f"malformed stream: {state.malformed}"
            else:
                out.reason = "stream closed without the family's end or an error"
    except httpx.TransportError as e:
        out.reason = f"{type(e).__name__}: {e}"[:200]
    finally:
        out.latency = time.monotonic() - start
