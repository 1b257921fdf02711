"""Who may call corral and from where: API keys (401 in each family's shape), the browser's
Origin (403 unless loopback, corral's own page or CORRAL_ORIGINS), DNS rebinding (a foreign Host
while bound to loopback: 403), CORS preflights, file paths shown only to key holders, and the
CLI sending the key. Real `corral serve` processes, real HTTP."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.requests import Request

from corral.api.guard import (
    host_allowed,
    loopback_bind,
    loopback_origin,
    origin_pattern,
    same_origin,
)
from corral.api.paths import AUTHORIZED, shown_path
from corral.cli.client import api_key
from corral.config import ConfigError, Settings
from corral.testing.server import CorralServer

KEYS = "sk-first,sk-second"
ORIGINS = "https://app.example.com,https://*.corp.test"
GEN = {"model": "tiny", "prompt": "hi", "stream": False, "options": {"num_predict": 2}}
CHAT = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def keyed(start_server, models_dir: Path) -> CorralServer:
    s = start_server(models_dir, CORRAL_API_KEY=KEYS, CORRAL_ORIGINS=ORIGINS)
    s.client.headers["Authorization"] = "Bearer sk-first"  # for the harness's own calls
    return s


def bare(s: CorralServer, **headers: str) -> httpx.Client:
    return httpx.Client(base_url=s.url, timeout=60, headers=headers)


# (method, path, body, family): one or more routes of every family
ROUTES: list[tuple[str, str, Any, str]] = [
    ("GET", "/api/tags", None, "ollama"),
    ("GET", "/api/ps", None, "ollama"),
    ("POST", "/api/show", {"model": "tiny"}, "ollama"),
    ("POST", "/api/generate", GEN, "ollama"),
    ("POST", "/api/chat", {**CHAT, "stream": False}, "ollama"),
    ("GET", "/v1/models", None, "openai"),
    ("POST", "/v1/chat/completions", CHAT, "openai"),
    ("POST", "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2}, "openai"),
    ("POST", "/v1/embeddings", {"model": "embed", "input": "hi"}, "openai"),
    ("POST", "/v1/responses", {"model": "tiny", "input": "hi", "max_output_tokens": 2}, "openai"),
    ("POST", "/v1/messages", CHAT, "anthropic"),
    ("POST", "/v1/messages/count_tokens", {"model": "tiny", "messages": CHAT["messages"]},
     "anthropic"),
    ("GET", "/models", None, "ollama"),
    ("GET", "/metrics", None, "ollama"),
]  # fmt: skip


def assert_shape(r: httpx.Response, status: int, family: str) -> str:
    """The error's message, after checking the family's error shape."""
    assert r.status_code == status, (r.request.url, r.text)
    body = r.json()
    if family == "openai":
        err = body["error"]
        assert set(err) == {"message", "type", "param", "code"}, body
        return str(err["message"])
    if family == "anthropic":
        assert body["type"] == "error", body
        kind = {401: "authentication_error", 403: "permission_error"}[status]
        assert body["error"]["type"] == kind, body
        return str(body["error"]["message"])
    assert set(body) == {"error"} and isinstance(body["error"], str), body
    return str(body["error"])


@pytest.mark.parametrize(("method", "path", "body", "family"), ROUTES)
def test_every_family_needs_the_key(keyed: CorralServer, method, path, body, family) -> None:
    with bare(keyed) as c:
        r = c.request(method, path, json=body)
        assert "missing API key" in assert_shape(r, 401, family)
        assert r.headers["www-authenticate"] == "Bearer"
        r = c.request(method, path, json=body, headers={"Authorization": "Bearer sk-wrong"})
        assert assert_shape(r, 401, family) == "invalid API key"
        # Bearer with either key, or Anthropic's x-api-key
        for headers in ({"Authorization": "Bearer sk-first"}, {"x-api-key": "sk-second"}):
            r = c.request(method, path, json=body, headers=headers)
            assert r.status_code == 200, (path, r.text)


@pytest.mark.parametrize("route", ["/", "/api/version", "/health"])
def test_probes_need_no_key(keyed: CorralServer, route: str) -> None:
    with bare(keyed) as c:
        assert c.get(route).status_code == 200
        assert c.head(route).status_code == 200


def test_foreign_host_is_refused_while_bound_to_loopback(keyed: CorralServer) -> None:
    port = keyed.url.rsplit(":", 1)[1]
    with bare(keyed, Authorization="Bearer sk-first") as c:
        for host in (f"evil.example:{port}", "evil.example", "192.168.1.20", "localhost.evil.com"):
            r = c.post("/api/generate", json=GEN, headers={"Host": host})
            assert "DNS rebinding" in assert_shape(r, 403, "ollama"), host
            assert r.headers["connection"] == "close"
        r = c.get("/v1/models", headers={"Host": "attacker.test"})
        assert_shape(r, 403, "openai")
        for host in (f"localhost:{port}", f"127.0.0.1:{port}", "127.0.0.2", f"[::1]:{port}",
                     "app.localhost"):  # fmt: skip
            assert c.get("/api/tags", headers={"Host": host}).status_code == 200, host


def test_cross_origin_simple_posts_are_refused(keyed: CorralServer) -> None:
    """A page elsewhere can make a browser POST text/plain without a preflight: refused,
    even when the request carries the key."""
    with bare(keyed, Authorization="Bearer sk-first") as c:
        for path, body in (("/api/generate", GEN), ("/models/unload", {"model": "tiny"})):
            r = c.post(
                path,
                content=json.dumps(body),
                headers={"Origin": "https://evil.example", "Content-Type": "text/plain"},
            )
            assert "origin 'https://evil.example' is not allowed" in assert_shape(r, 403, "ollama")
            assert "access-control-allow-origin" not in r.headers
        r = c.post("/v1/messages", json=CHAT, headers={"Origin": "http://evil.example:11434"})
        assert_shape(r, 403, "anthropic")
        r = c.post("/api/generate", json=GEN, headers={"Origin": "null"})
        assert r.status_code == 403


@pytest.mark.parametrize(
    "origin",
    [
        "http://localhost:5173",
        "http://127.0.0.1:8080",
        "https://localhost",
        "http://[::1]:3000",
        "app://obsidian.md",
        "vscode-webview://abc",
        "https://app.example.com",
        "https://ui.corp.test",
    ],
)
def test_allowed_origins_get_cors(keyed: CorralServer, origin: str) -> None:
    with bare(keyed) as c:
        pre = c.options(
            "/v1/chat/completions",
            headers={
                "Origin": origin,
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os, "
                "anthropic-version, x-api-key",
            },
        )
        assert pre.status_code == 204, pre.text
        assert pre.headers["access-control-allow-origin"] == origin
        assert "POST" in pre.headers["access-control-allow-methods"]
        allowed = {
            h.strip().lower() for h in pre.headers["access-control-allow-headers"].split(",")
        }
        assert {
            "authorization",
            "content-type",
            "x-api-key",
            "anthropic-version",
            "x-stainless-os",
            "openai-beta",
        } <= allowed
        assert pre.headers["vary"] == "Origin"
        r = c.post(
            "/api/generate",
            json=GEN,
            headers={"Origin": origin, "Authorization": "Bearer sk-second"},
        )
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin
        # a refusal is still readable by the page that asked
        r = c.get("/api/tags", headers={"Origin": origin})
        assert r.status_code == 401 and r.headers["access-control-allow-origin"] == origin


def test_preflight_from_a_foreign_origin_is_refused(keyed: CorralServer) -> None:
    with bare(keyed) as c:
        for origin in ("https://evil.example", "https://corp.test.evil.example",
                       "http://localhost.evil.example"):  # fmt: skip
            r = c.options(
                "/api/chat", headers={"Origin": origin, "Access-Control-Request-Method": "POST"}
            )
            assert r.status_code == 403, origin
            assert "access-control-allow-origin" not in r.headers


def test_key_holders_see_absolute_paths(keyed: CorralServer, models_dir: Path) -> None:
    (tiny,) = [m for m in keyed.client.get("/models").json()["data"] if m["id"] == "tiny:latest"]
    assert tiny["path"] == str(models_dir / "tiny.gguf")
    show = keyed.client.post("/api/show", json={"model": "tiny"}).json()
    assert f"FROM {models_dir / 'tiny.gguf'}" in show["modelfile"]


def test_without_a_key_paths_are_relative(start_server, models_dir: Path) -> None:
    s = start_server(models_dir)
    data = {m["id"]: m["path"] for m in s.client.get("/models").json()["data"]}
    assert data["tiny:latest"] == "tiny.gguf"
    assert data["smollm2:135m"].endswith(".gguf") and "/" not in data["smollm2:135m"]
    show = s.client.post("/api/show", json={"model": "tiny"}).json()
    assert "FROM tiny.gguf\n" in show["modelfile"] and str(models_dir) not in show["modelfile"]


def cli(s: CorralServer, *args: str, key: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "CORRAL_API_KEY"}
    env["CORRAL_HOST"] = s.host
    if key is not None:
        env["CORRAL_API_KEY"] = key
    return subprocess.run(
        [sys.executable, "-m", "corral", *args], env=env, capture_output=True, text=True, timeout=60
    )


def test_cli_sends_the_key_from_corral_api_key(keyed: CorralServer) -> None:
    r = cli(keyed, "list", key=None)
    assert r.returncode == 1 and r.stderr.startswith("Error: missing API key"), r.stderr
    r = cli(keyed, "list", key="sk-nope")
    assert r.returncode == 1 and "invalid API key" in r.stderr, r.stderr
    r = cli(keyed, "list", key=KEYS)  # the same value as the server's: its first key is sent
    assert r.returncode == 0 and "tiny:latest" in r.stdout, r.stderr


# ---- the pieces, without a server --------------------------------------------------------------
def test_loopback_names_and_binds() -> None:
    for host in ("localhost", "localhost:11434", "127.0.0.1:1", "127.9.9.9", "[::1]:80", "::1",
                 "0.0.0.0:11434", "LOCALHOST", "localhost.", "a.b.localhost:8080",
                 "[::ffff:127.0.0.1]:11434"):  # fmt: skip
        assert host_allowed(host), host
    for host in ("evil.com", "localhost.evil.com", "10.0.0.1", "[fe80::1]:80", "127.0.0.1:x",
                 "[::1", "169.254.169.254", "localhost:99999"):  # fmt: skip
        assert not host_allowed(host), host
    assert loopback_bind("127.0.0.1") and loopback_bind("::1") and loopback_bind("localhost")
    assert not loopback_bind("0.0.0.0") and not loopback_bind("::")
    assert not loopback_bind("192.168.1.2") and not loopback_bind("myhost")


def test_origins() -> None:
    assert loopback_origin("http://localhost:3000") and loopback_origin("https://127.0.0.1")
    assert not loopback_origin("http://localhost:3000.evil.com")
    assert not loopback_origin("ftp://localhost") and not loopback_origin("null")
    assert same_origin("http://box.lan:11434", "box.lan:11434")
    assert same_origin("http://box.lan", "box.lan:80")
    assert not same_origin("http://box.lan:8080", "box.lan:11434")
    assert not same_origin("https://box.lan:11434", "other.lan:11434")
    p = origin_pattern("https://*.corp.test")
    assert p.match("https://a.corp.test") and p.match("https://a.b.corp.test")
    assert not p.match("https://corp.test.evil.com") and not p.match("http://a.corp.test")
    assert origin_pattern("*").match("https://anything")


def test_shown_paths(tmp_path: Path) -> None:
    models = tmp_path / "models"
    scope: dict[str, Any] = {"type": "http", "headers": []}
    assert shown_path(scope, models / "a.gguf", models) == "a.gguf"
    assert shown_path(scope, models / ".corral/blobs/x", models) == ".corral/blobs/x"
    assert shown_path(scope, "/usr/lib/x/m.gguf", models) == "m.gguf"
    assert shown_path(Request({**scope, AUTHORIZED: True}), models / "a.gguf", models) == str(
        models / "a.gguf"
    )


def test_settings() -> None:
    s = Settings.load(
        environ={
            "CORRAL_API_KEY": " k1 , k2,",
            "CORRAL_ORIGINS": "'https://a'",
            "CORRAL_SHUTDOWN_GRACE": "1m",
            "CORRAL_READ_TIMEOUT": "2s",
        }
    )
    assert s.api_keys == ("k1", "k2") and s.origins == ("https://a",)
    assert s.shutdown_grace == 60 and s.read_timeout == 2 and s.max_connections == 4096
    assert "k1" not in repr(s)
    with pytest.raises(ConfigError, match="CORRAL_READ_TIMEOUT"):
        Settings.load(environ={"CORRAL_READ_TIMEOUT": "0"})
    with pytest.raises(ConfigError, match="CORRAL_MAX_CONNECTIONS"):
        Settings.load(environ={"CORRAL_MAX_CONNECTIONS": "3"})
    assert api_key("a,b") == "a" and api_key(" ") is None


def test_the_dashboard_page_opens_without_the_key_but_its_data_needs_it(
    keyed: CorralServer,
) -> None:
    with bare(keyed) as c:
        for path in ("/ui", "/ui/app.js", "/ui/style.css"):
            assert c.get(path).status_code == 200, path  # static files, no data
        assert c.get("/api/corral/state").status_code == 401
        assert c.get("/metrics").status_code == 401
