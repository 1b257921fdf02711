"""Anthropic Messages API: POST /v1/messages and /v1/messages/count_tokens."""

from __future__ import annotations

from starlette.responses import Response
from starlette.routing import Route

from corral.api.common import ApiError
from corral.api.service import Service
from corral.api.stream import json_response

# HTTP status -> Anthropic's error type (https://docs.anthropic.com/en/api/errors)
ERROR_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
    500: "api_error", 503: "overloaded_error", 529: "overloaded_error",
}  # fmt: skip


def anthropic_error(e: ApiError) -> Response:
    kind = ERROR_TYPES.get(e.status, "invalid_request_error" if e.status < 500 else "api_error")
    return json_response({"type": "error", "error": {"type": kind, "message": e.message}}, e.status)


class Anthropic:
    def __init__(self, service: Service) -> None:
        self.svc = service

    def routes(self) -> list[Route]:
        return []
