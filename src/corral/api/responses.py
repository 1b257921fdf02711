"""OpenAI Responses API: POST /v1/responses (stateless: store is not kept)."""

from __future__ import annotations

from starlette.routing import Route

from corral.api.service import Service


class Responses:
    def __init__(self, service: Service) -> None:
        self.svc = service

    def routes(self) -> list[Route]:
        return []
