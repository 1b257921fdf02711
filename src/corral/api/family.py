"""API families: the shape each API the server speaks gives an error.

A `Family` renders an `ApiError` two ways: as a whole body (before a response has started)
and as the bytes that end a stream already under way (its headers long gone, so only the last
line or event can say what failed). Every route declares its family (`FamilyRoute`);
`Families` says which one a request speaks: its matched route's, else (a path no route holds,
the guard before routing, the cluster entry that has no routes) the family whose namespace
holds the path. Ollama's plain `{"error": "..."}` is the default: corral's own routes and
llama.cpp's router API answer in it too.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Match, Route
from starlette.types import Scope

from corral.api.activity import note_error
from corral.errors import ApiError

NDJSON = "application/x-ndjson"
SSE = "text/event-stream"


@dataclass(frozen=True)
class Family:
    """An API family's errors: `body` the JSON of a whole-body error, `ending` the bytes that
    end one of its streams (`media_type`) with the error. Both are rendered through `response`
    and `event`, which also note the error on the request's log record (api/activity.py)."""

    name: str
    body: Callable[[ApiError], Any]
    ending: Callable[[ApiError], bytes]
    media_type: str = SSE

    def response(self, e: ApiError) -> Response:
        """The error as a whole response."""
        note_error(e)
        response = Response(orjson.dumps(self.body(e)), e.status, media_type="application/json")
        if e.retry_after is not None:  # the OpenAI and Anthropic SDKs wait this long to retry
            response.headers["Retry-After"] = str(max(1, math.ceil(e.retry_after)))
        return response

    def event(self, e: ApiError) -> bytes:
        """The bytes that end a stream under way with the error."""
        note_error(e)
        return self.ending(e)


def sse(event: str, data: Any) -> bytes:
    """One named server-sent event."""
    return b"event: " + event.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


# ---- Ollama (and corral's own routes, llama.cpp's router API) ------------------------------
def _ollama_body(e: ApiError) -> dict[str, Any]:
    return {"error": e.message}


OLLAMA = Family(
    "ollama", _ollama_body, lambda e: orjson.dumps(_ollama_body(e)) + b"\n", media_type=NDJSON
)


# ---- OpenAI --------------------------------------------------------------------------------
def openai_error(e: ApiError) -> dict[str, Any]:
    """The object under OpenAI's `error` key."""
    kind = "invalid_request_error" if e.status < 500 else "server_error"
    code = e.code
    if code is None and e.status == 404 and e.param == "model":
        code = "model_not_found"
    return {"message": e.message, "type": kind, "param": e.param, "code": code}


def _data(body: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(body) + b"\n\n"


OPENAI = Family(
    "openai", lambda e: {"error": openai_error(e)}, lambda e: _data({"error": openai_error(e)})
)


# ---- OpenAI Responses: OpenAI's error bodies; a stream ends with response.failed -------------
def _response_failed(e: ApiError) -> bytes:
    """A stream cut short where nothing of the response is known (the cluster entry); a
    stream that has a response renders it failed with what it had
    (families/responses/render.Builder.fail)."""
    fail = {"status": "failed", "error": {"code": "server_error", "message": e.message}}
    return sse("response.failed", {"type": "response.failed", "response": fail})


RESPONSES = Family("responses", OPENAI.body, _response_failed)


# ---- Anthropic -----------------------------------------------------------------------------
# HTTP status -> Anthropic's error type (https://docs.anthropic.com/en/api/errors)
ANTHROPIC_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
    500: "api_error", 503: "overloaded_error", 529: "overloaded_error",
}  # fmt: skip


def _anthropic_body(e: ApiError) -> dict[str, Any]:
    default = "invalid_request_error" if e.status < 500 else "api_error"
    return {"type": "error", "error": {"type": ANTHROPIC_TYPES.get(e.status, default),
                                       "message": e.message}}  # fmt: skip


ANTHROPIC = Family("anthropic", _anthropic_body, lambda e: sse("error", _anthropic_body(e)))


# ---- llama.cpp's server API ------------------------------------------------------------------
LLAMACPP_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 501: "not_supported_error", 503: "unavailable_error",
}  # fmt: skip


def _llamacpp_body(e: ApiError) -> dict[str, Any]:
    """llama.cpp's error body: {"error": {"code", "message", "type"}}."""
    default = "server_error" if e.status >= 500 else "invalid_request_error"
    kind = LLAMACPP_TYPES.get(e.status, default)
    return {"error": {"code": e.status, "message": e.message, "type": kind}}


LLAMACPP = Family("llamacpp", _llamacpp_body, lambda e: _data(_llamacpp_body(e)))


# ---- which family a request speaks -----------------------------------------------------------
class FamilyRoute(Route):
    """A route that says which family its errors take."""

    def __init__(
        self, family: Family, path: str, endpoint: Callable[..., Any], methods: Sequence[str]
    ) -> None:
        super().__init__(path, endpoint, methods=list(methods))
        self.family = family


# Paths no route holds, by the family whose namespace holds them (the first prefix that does).
NAMESPACES: tuple[tuple[str, Family], ...] = (
    ("/v1/messages", ANTHROPIC), ("/v1/responses", RESPONSES), ("/v1/", OPENAI),
)  # fmt: skip


class Families:
    """Which family a request speaks, from the route its path matches (whatever the method),
    else from `paths` (exact paths of routes the resolver has not got: the cluster entry's),
    else from NAMESPACES, else Ollama's."""

    def __init__(
        self, routes: Sequence[BaseRoute] = (), paths: Mapping[str, Family] | None = None
    ) -> None:
        self.routes = routes
        self.paths = paths or {}

    def of(self, scope: Scope) -> Family:
        route = scope.get("route")  # set by the router once it matched
        if route is None:
            for r in self.routes:
                if r.matches(scope)[0] != Match.NONE:
                    route = r
                    break
        if isinstance(route, FamilyRoute):
            return route.family
        return self.at(scope["path"])

    def at(self, path: str) -> Family:
        """The family of a path no route of this resolver holds."""
        if path in self.paths:
            return self.paths[path]
        return next((f for prefix, f in NAMESPACES if path.startswith(prefix)), OLLAMA)

    def response(self, request: Request, e: ApiError) -> Response:
        """The error in the shape of the API family the client spoke."""
        return self.of(request.scope).response(e)
