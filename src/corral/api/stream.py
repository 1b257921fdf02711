"""Responses that carry a runner lease: the lease is returned however the response ends."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from corral.runtime.scheduler import Lease


def json_response(data: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(data), status, media_type="application/json")


class LeasedStream(StreamingResponse):
    """Streams from a runner; releases the slot at once when the stream ends, fails, or the
    client disconnects (Starlette cancels the body on disconnect), and also when the body is
    never started at all."""

    def __init__(
        self,
        body: AsyncIterator[bytes],
        lease: Lease,
        upstream: aiohttp.ClientResponse,
        media_type: str,
    ) -> None:
        super().__init__(body, media_type=media_type)
        self.lease = lease
        self.upstream = upstream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            # Closing the upstream connection makes llama.cpp stop generating for this slot.
            self.upstream.close()
            self.lease.release()
