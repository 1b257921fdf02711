"""OpenAI API: /v1/chat/completions, /v1/completions, /v1/embeddings, /v1/models.

llama.cpp's server already speaks OpenAI's wire format, so the common request passes through
to the runner and its bytes stream back untouched but for the model's name: the fastest proxy
is the one that parses least. Requests llama.cpp answers differently from OpenAI are parsed
and rebuilt here:

- `tool_choice` "required" or a named function: `Service.generate` forces a call (llama.cpp
  does not constrain it for every template), and the events are rendered as OpenAI's.
- `n` > 1: n generations on n leased slots (seed+i), merged into one answer or one stream.
- completions `logprobs` / `echo`: llama.cpp's chat-style logprobs become the legacy shape.
- embeddings `dimensions` / `encoding_format: "base64"`: truncated, renormalised, encoded here.

The checks of a request's fields are in protocol.py; the chunks the shared events render to,
the legacy completions' shape and the merged stream of n choices are in render.py.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from corral.api import defaults, embed
from corral.api.activity import note_model
from corral.api.chat import Chat, Usage, new_id
from corral.api.common import field, json_response, model_field, read_json, until_disconnect
from corral.api.events import sse_events
from corral.api.families.openai.protocol import (
    check_messages,
    check_params,
    check_prompts,
    check_tools,
    choice_count,
    int_in,
    stream_fields,
    tool_choice,
)
from corral.api.families.openai.render import (
    Fan,
    FanStream,
    Legacy,
    add_usage,
    chat_logprobs,
    choice_chunk,
    chunks_of,
    fan_stream,
    prepend,
    usage_object,
)
from corral.api.family import OPENAI, FamilyRoute
from corral.api.model_lists import anthropic_model, anthropic_model_list, openai_model
from corral.api.service import Resolved, Service
from corral.errors import ApiError
from corral.runtime.continuation import Upstream
from corral.runtime.hop import Lease
from corral.runtime.meter import settle_whole

T = TypeVar("T")

MAX_LOGPROBS = 5  # legacy completions' limit
MAX_TOP_LOGPROBS = 20  # chat's limit
# Chat fields corral handles itself; the rest go to llama.cpp as sampling parameters.
CHAT_OWN = frozenset({
    "model", "messages", "tools", "tool_choice", "stream", "stream_options", "n",
    "parallel_tool_calls",
})  # fmt: skip


class OpenAI:
    def __init__(self, service: Service) -> None:
        self.svc = service

    def routes(self) -> list[Route]:
        return [
            FamilyRoute(OPENAI, "/v1/chat/completions", self.chat, ["POST"]),
            FamilyRoute(OPENAI, "/v1/completions", self.completions, ["POST"]),
            FamilyRoute(OPENAI, "/v1/embeddings", self.embeddings, ["POST"]),
            FamilyRoute(OPENAI, "/v1/models", self.models, ["GET"]),
            FamilyRoute(OPENAI, "/v1/models/{model:path}", self.model, ["GET"]),
        ]

    # ---- chat ------------------------------------------------------------------------------
    async def chat(self, request: Request) -> Response:
        body = await read_json(request)
        messages = check_messages(body)
        check_params(body)
        stream, include_usage = stream_fields(body)
        n = choice_count(body)
        seed = field(body, "seed", int)
        tools = check_tools(body)
        choice = tool_choice(body, tools)
        field(body, "logprobs", bool)
        int_in(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
        r = self.svc.resolve(model_field(body))
        self.svc.check_chat(r, messages)
        if r.entry.has_defaults:  # a created model's defaults
            body = defaults.openai_body(r.entry, body, chat=True)
        forced = choice not in ("auto", "none")
        # A model whose template knows no tools gets them from corral (api/toolprompt), on
        # the events path that forced calls take; llama.cpp's chat endpoint would drop them.
        own_tools = bool(tools) and choice != "none" and not self.svc.native_tools(r)
        if n == 1 and not forced and not own_tools:
            return await self.svc.pass_through(request, r, "/v1/chat/completions", body, stream)

        if forced or own_tools:
            params = {k: v for k, v in body.items() if k not in CHAT_OWN}
            # /completion (where forced calls go) knows max_tokens, not OpenAI's newer name.
            if params.get("max_tokens") is None and "max_completion_tokens" in params:
                params["max_tokens"] = params["max_completion_tokens"]

            def chat_for(i: int) -> Chat:
                return Chat(messages, tools, choice, _seeded(params, seed, i))

            def whole(i: int) -> Awaitable[dict[str, Any]]:
                return self._forced_whole(request, r, chat_for(i))

            def chunks(i: int) -> AsyncIterator[dict[str, Any]]:
                return self._forced_chunks(request, r, chat_for(i))

        else:
            upstream = {k: v for k, v in body.items() if k not in ("n", "stream_options")}

            def whole(i: int) -> Awaitable[dict[str, Any]]:
                return self._raw_whole(request, r, "/v1/chat/completions", {
                    **_seeded(upstream, seed, i), "stream": False})  # fmt: skip

            def chunks(i: int) -> AsyncIterator[dict[str, Any]]:
                return self._raw_chunks(request, r, "/v1/chat/completions",
                                        _seeded(upstream, seed, i))  # fmt: skip

        if stream:
            return await self._fan_out(
                request, r, n, chunks, "chat.completion.chunk", "chatcmpl-", include_usage
            )
        return await self._merge(request, r, n, whole, "chat.completion", "chatcmpl-")

    async def _forced_whole(self, request: Request, r: Resolved, chat: Chat) -> dict[str, Any]:
        gen = await self.svc.generate(request, r, chat, {}, None)
        try:
            res = await gen.collect()
        finally:
            gen.close()
        message: dict[str, Any] = {
            "role": "assistant", "content": res.text or (None if res.tool_calls else ""),
        }  # fmt: skip
        if res.thinking:
            message["reasoning_content"] = res.thinking  # llama.cpp's name for it
        if res.tool_calls:
            message["tool_calls"] = [
                {"id": c["id"], "type": "function",
                 "function": {"name": c["name"], "arguments": c["arguments"]}}
                for c in res.tool_calls
            ]  # fmt: skip
        return {
            "choices": [{"index": 0, "message": message, "logprobs": chat_logprobs(res.logprobs),
                         "finish_reason": res.done.reason}],
            "usage": usage_object(res.done.usage),
        }  # fmt: skip

    async def _forced_chunks(
        self, request: Request, r: Resolved, chat: Chat
    ) -> AsyncIterator[dict[str, Any]]:
        gen = await self.svc.generate(request, r, chat, {}, None)
        try:
            yield choice_chunk({"role": "assistant", "content": None})
            async for ev in gen.events():
                for c in chunks_of(ev):
                    yield c
        finally:
            gen.close()

    # ---- completions -----------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        body = await read_json(request)
        prompt = body.get("prompt")
        if not isinstance(prompt, str | list):
            raise ApiError(400, "'prompt' is required: a string or array", "prompt")
        prompts = check_prompts(prompt)
        check_params(body)
        field(body, "suffix", str)
        field(body, "best_of", int)
        stream, include_usage = stream_fields(body)
        n = choice_count(body)
        seed = field(body, "seed", int)
        k = int_in(body, "logprobs", 0, MAX_LOGPROBS)  # top k per token, or None
        echo = field(body, "echo", bool, False)
        r = self.svc.resolve(model_field(body))
        self.svc.require(r, "completion", "completions")
        if r.entry.has_defaults:  # a created model's defaults
            body = defaults.openai_body(r.entry, body, chat=False)
        # llama.cpp streams several prompts with a `data: null` first event, which OpenAI's
        # clients cannot parse: such streams are rebuilt too.
        several = isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)
        if n == 1 and k is None and not echo and not (stream and several):
            return await self.svc.pass_through(request, r, "/v1/completions", body, stream)

        drop = ("n", "echo", "stream_options")
        upstream = {key: value for key, value in body.items() if key not in drop}
        if k is not None:
            upstream["logprobs"] = max(k, 1)  # llama.cpp returns none at 0; the sampled token

        def legacy() -> Legacy | None:
            return Legacy(prompts, k, echo) if k is not None or echo else None

        def whole(i: int) -> Awaitable[dict[str, Any]]:
            payload = {**_seeded(upstream, seed, i), "stream": False}
            return self._raw_whole(request, r, "/v1/completions", payload, legacy())

        def chunks(i: int) -> AsyncIterator[dict[str, Any]]:
            payload = _seeded(upstream, seed, i)
            return self._raw_chunks(request, r, "/v1/completions", payload, legacy())

        if stream:
            return await self._fan_out(
                request, r, n, chunks, "text_completion", "cmpl-", include_usage
            )
        return await self._merge(request, r, n, whole, "text_completion", "cmpl-")

    # ---- embeddings ------------------------------------------------------------------------
    async def embeddings(self, request: Request) -> Response:
        body = await read_json(request)
        inputs = body.get("input")
        if not inputs or not isinstance(inputs, str | list):
            raise ApiError(400, "'input' is required: a string or array", "input")
        # strings, tokens or token arrays, as for completions
        prompts = check_prompts(inputs, "input") if isinstance(inputs, list) else [inputs]
        field(body, "user", str)
        dims = field(body, "dimensions", int)
        if dims is not None and dims < 1:
            raise ApiError(400, "'dimensions' must be a positive integer", "dimensions")
        fmt = field(body, "encoding_format", str, "float")
        if fmt not in ("float", "base64"):
            raise ApiError(400, "'encoding_format' must be 'float' or 'base64'", "encoding_format")
        r = self.svc.embedder(self.svc.resolve(model_field(body)))
        if (
            len(prompts) <= embed.CHUNK_MIN
            and dims is None
            and (fmt == "float" or sys.byteorder == "little")
        ):
            # llama.cpp's answer as it is (it encodes base64 itself, in host byte order).
            return await self.svc.pass_through(request, r, "/v1/embeddings", body, False)
        # Many inputs: in chunks over the runner's slots, decoded and written by numpy.
        extra = {k: v for k, v in body.items() if k not in ("input", "dimensions",
                                                             "encoding_format")}  # fmt: skip

        async def send(lease: Lease) -> tuple[Any, int]:
            async with lease:
                work = embed.embed(lease.hop, prompts, extra)
                return await until_disconnect(request, work)

        # an input longer than the runner's context reloads it bigger and all are sent again
        vectors, tokens = await self.svc.leased(request, r, {}, None, body, send)
        out = embed.openai_body(r.requested, vectors, tokens, fmt, dims)
        return Response(out, media_type="application/json")

    # ---- talking to the runner ---------------------------------------------------------------
    async def _raw_whole(
        self,
        request: Request,
        r: Resolved,
        path: str,
        payload: dict[str, Any],
        legacy: Legacy | None = None,
    ) -> dict[str, Any]:

        async def send(lease: Lease) -> dict[str, Any]:
            async with lease:
                if legacy is not None:
                    await legacy.prepare(self.svc, lease)
                out: dict[str, Any] = await self.svc.client.post_json(lease, path, payload)
                settle_whole(lease.tally, out)
                lease.tool_call = _ends_in_tool_calls(out)  # the agent comes back: hold it
                return out

        # a prompt longer than the runner's context reloads it bigger and is sent again
        data = await self.svc.leased(request, r, {}, None, payload, send)
        if legacy is not None:
            legacy.whole(data)
        return data

    async def _raw_chunks(
        self,
        request: Request,
        r: Resolved,
        path: str,
        payload: dict[str, Any],
        legacy: Legacy | None = None,
    ) -> AsyncIterator[dict[str, Any]]:
        payload = {**payload, "stream_options": {"include_usage": True}}

        async def open_stream(lease: Lease) -> tuple[Lease, Upstream]:
            if legacy is not None:
                await legacy.prepare(self.svc, lease)
            return lease, await self.svc.client.stream(lease, path, payload)

        # a prompt longer than the runner's context reloads it bigger and is sent again
        lease, resp = await self.svc.leased(request, r, {}, None, payload, open_stream)
        async with lease:
            try:
                if legacy is not None:
                    for c in legacy.head():
                        yield c
                async for data in sse_events(resp, lease.runner.why_failed, lease.tally):
                    if not isinstance(data, dict):  # llama.cpp's `data: null` (several prompts)
                        continue
                    if legacy is not None:
                        legacy.chunk(data)
                    if _ends_in_tool_calls(data):  # the agent comes back: hold its runner
                        lease.tool_call = True
                    yield data
            finally:
                resp.close()  # makes llama.cpp stop generating if we stop early

    # ---- n choices -------------------------------------------------------------------------
    async def _merge(
        self,
        request: Request,
        r: Resolved,
        n: int,
        whole: Callable[[int], Awaitable[dict[str, Any]]],
        obj: str,
        prefix: str,
    ) -> Response:
        """n whole answers, one choice each (one per prompt for several), as one answer."""
        results = await until_disconnect(request, _gather([whole(i) for i in range(n)]))
        choices, usage = [], usage_object(Usage())
        for i, res in enumerate(results):
            for c in res.get("choices") or ():
                c["index"] = int(c.get("index") or 0) * n + i  # prompt-major, as OpenAI orders
                choices.append(c)
            add_usage(usage, res.get("usage"))
        choices.sort(key=lambda c: c["index"])
        out: dict[str, Any] = {"id": new_id(prefix), "object": obj, "created": int(time.time()),
                               "model": r.requested}  # fmt: skip
        if "system_fingerprint" in results[0]:
            out["system_fingerprint"] = results[0]["system_fingerprint"]
        out["choices"] = choices
        out["usage"] = usage
        if n == 1 and "timings" in results[0]:  # llama.cpp's extension, for one generation
            out["timings"] = results[0]["timings"]
        return json_response(out)

    async def _fan_out(
        self,
        request: Request,
        r: Resolved,
        n: int,
        chunks: Callable[[int], AsyncIterator[dict[str, Any]]],
        obj: str,
        prefix: str,
        include_usage: bool,
    ) -> Response:
        """n streamed generations as one SSE stream, each chunk carrying its choice's index.
        The first chunk is awaited before the response starts, so that a failure to start
        (unknown tool, full queue, a runner that refuses the request) is an HTTP error."""
        fan = Fan([chunks(i) for i in range(n)])
        body = fan_stream(fan, n, obj, new_id(prefix), r.requested, include_usage)
        try:
            first = await until_disconnect(request, anext(body))
        except BaseException:
            fan.close()
            raise
        return FanStream(prepend(first, body), fan)

    # ---- models ----------------------------------------------------------------------------
    async def models(self, request: Request) -> Response:
        # Anthropic's clients (Claude Code's model discovery) list models on the same path;
        # they say so with anthropic-version, and get Anthropic's shape.
        entries = list(self.svc.registry.all())
        if "anthropic-version" in request.headers:
            return json_response(anthropic_model_list(entries, request.query_params))
        return json_response({"object": "list", "data": [openai_model(e) for e in entries]})

    async def model(self, request: Request) -> Response:
        name = request.path_params["model"]
        note_model(name)  # the request log's model: as asked (a 404 too), then as found
        entry = self.svc.entry(name)
        note_model(entry.name)
        if "anthropic-version" in request.headers:
            return json_response(anthropic_model(entry))
        return json_response(openai_model(entry))


def _ends_in_tool_calls(data: dict[str, Any]) -> bool:
    """Whether a runner's answer (or chunk) ends a choice in tool calls."""
    return any(isinstance(c, dict) and c.get("finish_reason") == "tool_calls"
               for c in data.get("choices") or ())  # fmt: skip


def _seeded(params: dict[str, Any], seed: int | None, i: int) -> dict[str, Any]:
    """Choice i's parameters: its own seed, so that seeded choices differ yet reproduce."""
    return params if seed is None else {**params, "seed": seed + i}


async def _gather(aws: list[Awaitable[T]]) -> list[T]:
    """All results; the first failure (or cancellation) stops the rest."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()
