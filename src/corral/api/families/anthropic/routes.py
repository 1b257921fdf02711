"""Anthropic Messages API: POST /v1/messages and /v1/messages/count_tokens.

A thin renderer over the shared generation layer (`api/events.py`): the Anthropic request
becomes a neutral `Chat` (OpenAI chat messages, function tools), and the neutral events become
Anthropic's message object or its SSE events. `x-api-key` and `anthropic-version` are accepted
and ignored (no authentication). Errors take Anthropic's shape (`family.ANTHROPIC`).

Token usage: a streamed answer's `message_start` carries the prompt's token count, rendered by
the runner's own template and tokenizer before the first event; the `message_delta` at the end
repeats it as llama.cpp counted it, split into `input_tokens` (evaluated) and
`cache_read_input_tokens` (reused from the slot's KV cache), as Anthropic splits them.

A request's fields are checked and converted in protocol.py; the message object and the
content-block events are rendered in render.py.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from corral.api.chat import Chat, Event
from corral.api.common import field, json_response, model_field, read_json, until_disconnect
from corral.api.families.anthropic.protocol import stop_sequences, thinking, to_chat
from corral.api.families.anthropic.render import message, sse_stream
from corral.api.family import ANTHROPIC, FamilyRoute
from corral.api.service import Resolved, Service, effective_template
from corral.core.roles import place_system, renders_later_system
from corral.errors import ApiError
from corral.runtime.hop import Lease

log = logging.getLogger("corral.anthropic")


class Anthropic:
    def __init__(self, service: Service) -> None:
        self.svc = service

    def routes(self) -> list[Route]:
        return [
            FamilyRoute(ANTHROPIC, "/v1/messages", self.messages, ["POST"]),
            FamilyRoute(ANTHROPIC, "/v1/messages/count_tokens", self.count_tokens, ["POST"]),
        ]

    async def messages(self, request: Request) -> Response:
        body = await read_json(request)
        name = model_field(body)
        max_tokens = field(body, "max_tokens", int)
        if max_tokens is None:
            raise ApiError(400, "max_tokens: Field required", "max_tokens")
        if max_tokens < 1:
            raise ApiError(400, "max_tokens: must be greater than or equal to 1", "max_tokens")
        stream = field(body, "stream", bool, False)
        stop = stop_sequences(body)
        chat = to_chat(body)
        shown = thinking(body.get("thinking"))[1]
        chat.params["max_tokens"] = max_tokens
        r = self.svc.resolve(name)
        placed(r, chat)
        gen = await self.svc.generate(request, r, chat, options={}, keep_alive=None, stop=stop)
        if stream:
            try:
                input_tokens = await self._count(gen.lease, chat)
            except ApiError:
                input_tokens = 0  # a courtesy figure: the message_delta carries the real one
            except BaseException:
                gen.close()
                raise

            def render(events: AsyncIterator[Event]) -> AsyncIterator[bytes]:
                return sse_stream(events, r.requested, input_tokens, shown)

            return gen.response(render, ANTHROPIC)
        try:
            result = await until_disconnect(request, gen.collect())
        finally:
            gen.close()
        return json_response(message(r.requested, result, shown))

    async def count_tokens(self, request: Request) -> Response:
        body = await read_json(request)
        name = model_field(body)
        chat = to_chat(body)
        r = self.svc.resolve(name)
        placed(r, chat)
        self.svc.check_chat(r, chat.messages)
        async with await self.svc.lease(request, r, {}, None) as lease:
            n = await until_disconnect(request, self._count(lease, chat))
        return json_response({"input_tokens": n})

    async def _count(self, lease: Lease, chat: Chat) -> int:
        return len(await self.svc.prompt_tokens(lease, chat))


# ---- request -> Chat ------------------------------------------------------------------------
def placed(r: Resolved, chat: Chat) -> None:
    """The chat's system messages where the model's template takes them (core/roles.py)."""
    chat.messages = place_system(chat.messages, renders_later_system(effective_template(r)))


