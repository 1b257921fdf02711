"""Responses that carry a runner lease: the lease is returned however the response ends."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from corral.api.common import runner_error_message
from corral.api.service import explain_failure
from corral.runtime.scheduler import Lease

SSE_DONE = b"data: [DONE]"
MAX_HELD = 1 << 20  # an "event" longer than this without its blank line passes on as it is


def json_response(data: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(data), status, media_type="application/json")


class LeasedStream(StreamingResponse):
    """Streams from a runner; releases the slot at once when the stream ends, fails, or the
    client disconnects (Starlette cancels the body on disconnect), and also when the body is
    never started at all.

    An SSE stream (the OpenAI pass-through) always ends with `data: [DONE]` or an error event:
    when the runner dies mid-stream, or ends it without [DONE], the client gets a final
    `data: {"error": {...}}` (what OpenAI sends, and its SDK raises as an APIError) saying why,
    never a bare close."""

    def __init__(
        self,
        body: AsyncIterator[bytes],
        lease: Lease,
        upstream: aiohttp.ClientResponse,
        media_type: str,
    ) -> None:
        if media_type == "text/event-stream":
            body = self._ended(body)
        super().__init__(body, media_type=media_type)
        self.lease = lease
        self.upstream = upstream

    async def _ended(self, body: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        held = b""  # an event not yet complete: passed on whole, or not at all
        last = b""  # the last non-empty line passed on
        between = True  # what was passed on ends between events
        error: str | None = None  # llama.cpp's own `error: {...}` line, if it sent one

        def passed(out: bytes) -> bytes:
            nonlocal last, between, error
            between = out.endswith(b"\n\n")
            for line in out.split(b"\n"):
                if line := line.strip():
                    last = line
                    if line.startswith(b"error: "):
                        error = runner_error_message(line[7:], 500)
            return out

        try:
            async for chunk in body:
                held += chunk
                cut = held.rfind(b"\n\n") + 2
                if cut >= 2:
                    out, held = held[:cut], held[cut:]
                elif len(held) >= MAX_HELD:
                    out, held = held, b""
                else:
                    continue
                yield passed(out)
        except (aiohttp.ClientError, OSError, asyncio.IncompleteReadError):
            message = await explain_failure(self.lease.runner)
        else:
            if held:
                yield passed(held)
            if last == SSE_DONE:
                return
            message = error or await explain_failure(self.lease.runner)
        # A cut event was never passed on (unless huge), so this one starts on its own.
        err = {"message": message, "type": "server_error", "param": None, "code": None}
        yield (b"" if between else b"\n\n") + b"data: " + orjson.dumps({"error": err}) + b"\n\n"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            # Closing the upstream connection makes llama.cpp stop generating for this slot.
            self.upstream.close()
            self.lease.release()
