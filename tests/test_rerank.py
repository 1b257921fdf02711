"""Reranking (/v1/rerank, /rerank) with a synthetic rank-pooling model."""

from __future__ import annotations

from pathlib import Path

import pytest

from corral.testing import synth
from corral.testing.server import CorralServer

DOCS = ["a cat is an animal", "paris is a city", "dogs bark", "the sky is blue"]


@pytest.fixture(scope="module")
def server(start_server, tmp_path_factory: pytest.TempPathFactory) -> CorralServer:
    d: Path = tmp_path_factory.mktemp("rerank-models")
    synth.write_bert_model(d / "ranker.gguf", pooling_type=4)
    synth.write_bert_model(d / "embed.gguf")
    return start_server(d, CORRAL_BUILTIN_MODELS="0")


def test_rerank_orders_documents_by_score(server: CorralServer) -> None:
    r = server.client.post("/v1/rerank", json={
        "model": "ranker:latest", "query": "what is a cat", "documents": DOCS,
        "top_n": 3, "return_documents": True,
    })  # fmt: skip
    assert r.status_code == 200, r.text
    data = r.json()
    assert data["model"] == "ranker:latest" and data["usage"]["total_tokens"] > 0
    results = data["results"]
    assert len(results) == 3
    scores = [x["relevance_score"] for x in results]
    assert scores == sorted(scores, reverse=True)
    assert all(x["document"]["text"] == DOCS[x["index"]] for x in results)
    assert len({x["index"] for x in results}) == 3
    # llama.cpp's path, object documents, no documents back
    r = server.client.post("/rerank", json={
        "model": "ranker", "query": "q", "documents": [{"text": t} for t in DOCS],
    })  # fmt: skip
    assert sorted(x["index"] for x in r.json()["results"]) == [0, 1, 2, 3]
    assert "document" not in r.json()["results"][0]


def test_rerank_capability_and_errors(server: CorralServer) -> None:
    show = server.client.post("/api/show", json={"model": "ranker"}).json()
    assert show["capabilities"] == ["rerank"]
    r = server.client.post("/v1/rerank", json={"model": "embed", "query": "q", "documents": DOCS})
    assert r.status_code == 400 and "does not support reranking" in r.json()["error"]["message"]
    r = server.client.post("/v1/rerank", json={"model": "nope", "query": "q", "documents": DOCS})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    for body in ({"query": "q"}, {"documents": DOCS}, {"query": "q", "documents": [1]},
                 {"query": "q", "documents": DOCS, "top_n": 0}):  # fmt: skip
        r = server.client.post("/v1/rerank", json={"model": "ranker", **body})
        assert r.status_code == 400, body
    r = server.client.post("/api/embed", json={"model": "ranker", "input": "x"})
    assert r.status_code == 400
