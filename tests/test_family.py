"""API families: every route's errors take its family's shape, and the cluster entry, which has
no routes, finds the same family from the path alone."""

from __future__ import annotations

import re
from pathlib import Path

from helpers import fake_devices

from corral.api.family import ANTHROPIC, LLAMACPP, OLLAMA, OPENAI, RESPONSES, FamilyRoute
from corral.cluster.entry import FAMILIES
from corral.config import Settings
from corral.errors import ApiError
from corral.server import create_app


def test_the_entry_finds_each_route_s_family_by_its_path(tmp_path: Path) -> None:
    settings = Settings.load({"CORRAL_MODELS": str(tmp_path), "CORRAL_KV_CACHE_SIZE": "0"}, {})
    app = create_app(settings, fake_devices("cpu=8GiB"))
    routes = [r for r in app.routes if isinstance(r, FamilyRoute)]
    assert routes == app.routes  # every route declares its family
    for route in routes:
        path = re.sub(r"\{[^}]*\}", "x", route.path)
        assert FAMILIES.at(path) is route.family, route.path
    families = {r.path: r.family for r in routes}
    assert families["/v1/messages"] is ANTHROPIC
    assert families["/v1/responses"] is RESPONSES
    assert families["/v1/rerank"] is OPENAI and families["/rerank"] is OLLAMA
    assert families["/completion"] is LLAMACPP and families["/models/sse"] is OLLAMA


def test_stream_endings_in_each_family_shape() -> None:
    e = ApiError(500, "boom")
    assert OLLAMA.event(e) == b'{"error":"boom"}\n'
    assert OPENAI.event(e) == (
        b'data: {"error":{"message":"boom","type":"server_error","param":null,"code":null}}\n\n'
    )
    assert ANTHROPIC.event(e) == (
        b'event: error\ndata: {"type":"error","error":{"type":"api_error","message":"boom"}}\n\n'
    )
    assert LLAMACPP.event(e) == (
        b'data: {"error":{"code":500,"message":"boom","type":"server_error"}}\n\n'
    )
    assert RESPONSES.event(e).startswith(b"event: response.failed\ndata: ")
    assert RESPONSES.body(e) == OPENAI.body(e)
