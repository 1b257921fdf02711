"""OpenAI API: /v1/chat/completions, /v1/completions, /v1/embeddings, /v1/models.

llama.cpp's server already speaks OpenAI's wire format, so requests pass through to the runner
and its bytes stream back untouched: the fastest proxy is the one that parses least.
"""

from __future__ import annotations

import time
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from corral.api.common import ApiError, field, model_field, read_json
from corral.api.service import Service, until_disconnect
from corral.api.stream import LeasedStream, json_response


def openai_error(e: ApiError) -> Response:
    kind = "invalid_request_error" if e.status < 500 else "server_error"
    code = "model_not_found" if e.status == 404 and e.param == "model" else None
    return json_response(
        {"error": {"message": e.message, "type": kind, "param": e.param, "code": code}}, e.status
    )


class OpenAI:
    def __init__(self, service: Service) -> None:
        self.svc = service

    def routes(self) -> list[Route]:
        return [
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/embeddings", self.embeddings, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model:path}", self.model, methods=["GET"]),
        ]

    async def chat(self, request: Request) -> Response:
        body = await read_json(request)
        messages = field(body, "messages", list)
        if not messages:
            raise ApiError(400, "'messages' is required and must not be empty", "messages")
        return await self._proxy(request, body, "/v1/chat/completions", "completion", "chat")

    async def completions(self, request: Request) -> Response:
        body = await read_json(request)
        if not isinstance(body.get("prompt"), str | list):
            raise ApiError(400, "'prompt' is required: a string or array", "prompt")
        return await self._proxy(request, body, "/v1/completions", "completion", "completions")

    async def embeddings(self, request: Request) -> Response:
        body = await read_json(request)
        inputs = body.get("input")
        if not inputs or not isinstance(inputs, str | list):
            raise ApiError(400, "'input' is required: a string or array", "input")
        return await self._proxy(request, body, "/v1/embeddings", "embedding", "embeddings")

    async def _proxy(
        self, request: Request, body: dict[str, Any], path: str, capability: str, what: str
    ) -> Response:
        r = self.svc.resolve(model_field(body))
        self.svc.require(r, capability, what)
        stream = field(body, "stream", bool, False)
        field(body, "stream_options", dict)
        lease = await self.svc.lease(request, r, {}, None)
        try:
            resp = await self.svc.post(lease, path, body)
        except BaseException:
            lease.release()
            raise
        if stream:
            return LeasedStream(
                resp.content.iter_any(), lease, resp, media_type="text/event-stream"
            )
        try:
            data = await until_disconnect(request, resp.read())
        finally:
            resp.release()
            lease.release()
        return Response(data, media_type="application/json")

    def _model(self, name: str) -> dict[str, Any]:
        entry = self.svc.entry(name)
        return {
            "id": entry.name,
            "object": "model",
            "created": int(entry.modified_at),
            "owned_by": "corral",
        }

    async def models(self, request: Request) -> Response:
        data = [self._model(e.name) for e in self.svc.registry.all()]
        return json_response({"object": "list", "data": data})

    async def model(self, request: Request) -> Response:
        return json_response(self._model(request.path_params["model"]))


class Router:
    """llama.cpp's router-mode API, so its clients and web UI can drive corral."""

    def __init__(self, service: Service) -> None:
        self.svc = service

    def routes(self) -> list[Route]:
        return [
            Route("/models", self.models, methods=["GET"]),
            Route("/models/load", self.load, methods=["POST"]),
            Route("/models/unload", self.unload, methods=["POST"]),
        ]

    async def models(self, request: Request) -> Response:
        states = {b.model: b.state for b, _ in self.svc.scheduler.snapshot()}
        data = [
            {"id": e.name, "object": "model", "owned_by": "corral", "created": int(e.modified_at),
             "path": str(e.path), "status": {"value": _router_state(states.get(e.name))}}
            for e in self.svc.registry.all()
        ]  # fmt: skip
        return json_response({"object": "list", "data": data})

    async def load(self, request: Request) -> Response:
        body = await read_json(request)
        r = self.svc.resolve(model_field(body))
        start = time.monotonic()
        lease = await self.svc.lease(request, r, {}, None)
        lease.release()
        return json_response({"success": True, "load_ms": int((time.monotonic() - start) * 1e3)})

    async def unload(self, request: Request) -> Response:
        body = await read_json(request)
        entry = self.svc.entry(model_field(body))
        if not self.svc.scheduler.unload(entry.name):
            raise ApiError(400, f"model '{entry.name}' is not loaded", "model")
        return json_response({"success": True})


def _router_state(state: str | None) -> str:
    return {"loading": "loading", "ready": "loaded"}.get(state or "", "unloaded")
