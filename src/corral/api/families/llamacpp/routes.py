"""llama.cpp's own server API, routed by the `model` field as llama.cpp's router mode does:
/completion (/completions), /infill, /tokenize, /detokenize, /apply-template, /embedding
(/embeddings) and GET /props?model=. The runner's answer is relayed as it is, with the model
renamed to the one the client asked for; errors in llama.cpp's shape (`family.LLAMACPP`).

Not relayed (they would change a runner every client shares, or corral's own state): POST
/props, POST /slots (save/restore/erase: corral keeps conversations' caches there), POST
/lora-adapters."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from corral.api.common import model_field, read_json
from corral.api.family import LLAMACPP, FamilyRoute
from corral.api.service import Service
from corral.api.stream import LeasedStream
from corral.errors import ApiError

# path -> (the runner's path, the capability it needs or None)
POST_ROUTES = {
    "/completion": ("/completion", "completion"),
    "/completions": ("/completion", "completion"),
    "/infill": ("/infill", "insert"),
    "/tokenize": ("/tokenize", None),
    "/detokenize": ("/detokenize", None),
    "/apply-template": ("/apply-template", "completion"),
    "/embedding": ("/embedding", "embedding"),
    "/embeddings": ("/embeddings", "embedding"),
}
NATIVE_PATHS = frozenset({*POST_ROUTES, "/props"})


class Native:
    def __init__(self, service: Service) -> None:
        self.svc = service

    def routes(self) -> list[Route]:
        return [
            *(FamilyRoute(LLAMACPP, p, self.post, ["POST"]) for p in POST_ROUTES),
            FamilyRoute(LLAMACPP, "/props", self.props, ["GET"]),
        ]

    async def post(self, request: Request) -> Response:
        body = await read_json(request)
        path, capability = POST_ROUTES[request.url.path]
        r = self.svc.resolve(model_field(body))
        if capability == "embedding" and "embedding" not in r.info.capabilities:
            raise ApiError(400, f"model '{r.requested}' does not support embeddings", "model")
        if capability in ("completion", "insert"):
            self.svc.require(r, capability, "insertion" if capability == "insert" else "completion")
        stream = body.get("stream") is True and path in ("/completion", "/infill")
        payload = {k: v for k, v in body.items() if k != "model"}
        return await self.svc.pass_through(request, r, path, payload, stream, NativeStream)

    async def props(self, request: Request) -> Response:
        """The model's runner's /props (loading it, as llama.cpp's router does)."""
        name = request.query_params.get("model")
        if not name:
            raise ApiError(400, "'model' is required (?model=...)", "model")
        r = self.svc.resolve(name)
        async with await self.svc.lease(request, r, {}, None) as lease:
            status, data = await lease.hop.api.props()
        return Response(data, status, media_type="application/json")


class NativeStream(LeasedStream):
    """A /completion stream relayed as llama.cpp sends it: it ends with an event holding
    `"stop":true` (no `[DONE]`), or llama.cpp's own error line; a runner that dies before that
    adds an error event."""

    family = LLAMACPP

    def _ended_well(self, tail: bytes) -> bool:
        return b'"stop":true' in tail or self.relay.error is not None
