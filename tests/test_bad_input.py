"""Bad input gets a clear error with the right status, and the server keeps serving."""

from __future__ import annotations

import httpx
import pytest

SMOL = "smollm2:135m"


@pytest.fixture(scope="module")
def http(server) -> httpx.Client:
    return server.client


@pytest.mark.parametrize(
    "path",
    [
        "/api/generate",
        "/api/chat",
        "/api/embed",
        "/api/show",
        "/v1/chat/completions",
        "/v1/embeddings",
        "/models/load",
    ],
)
def test_malformed_json_is_400(http: httpx.Client, path: str) -> None:
    r = http.post(path, content=b'{"model": "x", ')
    assert r.status_code == 400
    body = r.json()
    msg = body["error"]["message"] if isinstance(body["error"], dict) else body["error"]
    assert "invalid JSON" in msg


@pytest.mark.parametrize("body", [b"", b"[1, 2]", b'"text"', b"null"])
def test_body_not_an_object_is_400(http: httpx.Client, body: bytes) -> None:
    r = http.post("/api/generate", content=body)
    assert r.status_code == 400 and r.json()["error"]


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"model": 5, "prompt": "x"}, "model"),
        ({"model": SMOL, "prompt": 7}, "prompt"),
        ({"model": SMOL, "prompt": "x", "stream": "yes"}, "stream"),
        ({"model": SMOL, "prompt": "x", "options": []}, "options"),
        ({"model": SMOL, "prompt": "x", "options": {"temperature": "hot"}}, "options.temperature"),
        ({"model": SMOL, "prompt": "x", "options": {"num_ctx": 1.5}}, "options.num_ctx"),
        ({"model": SMOL, "prompt": "x", "options": {"num_predict": True}}, "options.num_predict"),
        ({"model": SMOL, "prompt": "x", "keep_alive": "forever"}, "keep_alive"),
        ({"model": SMOL, "prompt": "x", "format": 3}, "format"),
        ({"prompt": "x"}, "model"),
    ],
)
def test_wrong_types_name_the_field(http: httpx.Client, body: dict, field: str) -> None:
    r = http.post("/api/generate", json=body)
    assert r.status_code == 400
    assert f"'{field}'" in r.json()["error"]


def test_chat_message_shape_is_checked(http: httpx.Client) -> None:
    r = http.post("/api/chat", json={"model": SMOL, "messages": [{"content": "no role"}]})
    assert r.status_code == 400 and "messages[0].role" in r.json()["error"]
    r = http.post("/api/chat", json={"model": SMOL, "messages": "hi"})
    assert r.status_code == 400 and "'messages'" in r.json()["error"]


def test_absurd_sizes_are_refused(http: httpx.Client) -> None:
    r = http.post(
        "/api/generate", json={"model": SMOL, "prompt": "x", "options": {"num_ctx": 10**12}}
    )
    assert r.status_code == 400 and "options.num_ctx" in r.json()["error"]
    r = http.post(
        "/api/generate", json={"model": SMOL, "prompt": "x", "options": {"num_predict": 10**15}}
    )
    assert r.status_code == 400
    r = http.post(
        "/api/generate", content=b" " * (65 * 2**20), headers={"content-type": "application/json"}
    )
    assert r.status_code == 413


def test_context_that_cannot_fit_in_memory_is_refused_naming_sizes(http: httpx.Client) -> None:
    # 2M tokens of context for SmolLM2 is ~90 GiB of KV cache: far more than this machine.
    r = http.post(
        "/api/generate", json={"model": SMOL, "prompt": "x", "options": {"num_ctx": 2**21}}
    )
    assert r.status_code == 507
    assert "GiB" in r.json()["error"] and SMOL in r.json()["error"]


def test_unknown_routes_and_methods(http: httpx.Client) -> None:
    r = http.get("/api/nothing")
    assert r.status_code == 404 and r.json()["error"]
    r = http.get("/api/generate")
    assert r.status_code == 405 and r.json()["error"]
    r = http.get("/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["message"]


@pytest.mark.parametrize(
    ("model", "words"), [("notgguf", "not a GGUF"), ("truncated", "truncated")]
)
def test_broken_model_files_give_clear_errors_and_others_keep_working(
    http: httpx.Client, server, model: str, words: str
) -> None:
    r = http.post("/api/generate", json={"model": model, "prompt": "hi", "stream": False})
    assert r.status_code == 500
    err = r.json()["error"]
    assert f"model '{model}' cannot be loaded" in err and words in err
    assert "Traceback" not in err
    ok = http.post(
        "/api/generate",
        json={"model": "tiny", "prompt": "hi", "stream": False, "options": {"num_predict": 2}},
    )
    assert ok.status_code == 200 and ok.json()["done"]
    tags = http.get("/api/tags").json()["models"]
    broken = next(m for m in tags if m["name"] == f"{model}:latest")
    assert words in broken["error"]


def test_generate_on_embedding_model_is_400(http: httpx.Client) -> None:
    r = http.post("/api/generate", json={"model": "embed", "prompt": "hi"})
    assert r.status_code == 400 and "does not support generate" in r.json()["error"]


def test_router_unload_of_a_model_not_loaded(http: httpx.Client) -> None:
    r = http.post("/models/unload", json={"model": "tiny2"})
    assert r.status_code == 400 and "not loaded" in r.json()["error"]
    r = http.post("/models/load", json={"model": "nope"})
    assert r.status_code == 404
