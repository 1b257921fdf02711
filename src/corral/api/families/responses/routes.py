"""OpenAI Responses API: POST /v1/responses, field for field as OpenAI's reference gives it.

The request becomes a neutral `chat.Chat` (input items -> chat messages, function tools ->
chat tools, text.format -> llama.cpp's response_format, reasoning.effort -> the template's
enable_thinking) and the generation's events are rendered as Responses output items, streamed
as Responses SSE events or returned whole.

Responses are stored as OpenAI stores them (`store`, true by default): `previous_response_id`
continues a stored response's conversation, and `GET`/`DELETE /v1/responses/{id}` and
`/input_items` read and delete them (stored.py, runtime/response_store.py).
`conversation` objects and item references are refused with a 400 that says to send the
conversation in `input` or continue it with `previous_response_id`.

A request is checked and turned into the shared chat in protocol.py (below: tools, reasoning,
logprobs); the output items and events are built in render.py.
"""

from __future__ import annotations

import logging

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from corral.api.common import json_response, read_json, until_disconnect
from corral.api.families.responses.protocol import parse_request
from corral.api.families.responses.render import Builder
from corral.api.families.responses.stored import StoredResponses, previous_id
from corral.api.family import RESPONSES, FamilyRoute
from corral.api.service import Service
from corral.runtime.response_store import ResponseStore

log = logging.getLogger(__name__)


class Responses:
    def __init__(self, service: Service, store: ResponseStore | None = None) -> None:
        self.svc = service
        self.stored = StoredResponses(store if store is not None else ResponseStore(None))

    def routes(self) -> list[Route]:
        return [
            FamilyRoute(RESPONSES, "/v1/responses", self.create, ["POST"]),
            *self.stored.routes(),
        ]

    async def create(self, request: Request) -> Response:
        body = await read_json(request)
        previous = previous_id(body)
        base = self.stored.previous(previous) if previous is not None else None
        req = parse_request(body, base)
        r = self.svc.resolve(req.model)
        gen = await self.svc.generate(request, r, req.chat, options={}, keep_alive=None)
        store = self.stored.store
        # Kept as it ends, whole or streamed, whatever its status.
        keep = (lambda resp: store.put(resp, req.items, base)) if req.store else None
        out = Builder(req.model, req.echo, req.tools, on_end=keep)
        if req.stream:
            return gen.response(out.sse, RESPONSES)
        try:
            await until_disconnect(request, out.consume(gen.events()))
        finally:
            gen.close()
        return json_response(out.response())


# ---- the request ---------------------------------------------------------------------------


