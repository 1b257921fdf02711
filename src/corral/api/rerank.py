"""Reranking: POST /v1/rerank and /rerank (llama.cpp's names), the Jina/Cohere body and answer,
for models whose GGUF pools by rank (a relevance head over query + document)."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from corral.api.common import field, json_response, model_field, read_json, until_disconnect
from corral.api.family import OLLAMA, OPENAI, FamilyRoute
from corral.api.service import Service
from corral.errors import ApiError

MAX_DOCUMENTS = 10_000


class Rerank:
    def __init__(self, service: Service) -> None:
        self.svc = service

    def routes(self) -> list[Route]:
        return [
            FamilyRoute(OPENAI, "/v1/rerank", self.rerank, ["POST"]),
            FamilyRoute(OLLAMA, "/rerank", self.rerank, ["POST"]),
        ]

    async def rerank(self, request: Request) -> Response:
        body = await read_json(request)
        name = model_field(body)
        query = field(body, "query", str)
        if not query:
            raise ApiError(400, "'query' is required", "query")
        docs = [document_text(d, i) for i, d in enumerate(field(body, "documents", list, []))]
        if not docs:
            raise ApiError(400, "'documents' is required and must not be empty", "documents")
        if len(docs) > MAX_DOCUMENTS:
            raise ApiError(400, f"at most {MAX_DOCUMENTS} documents", "documents")
        top_n = field(body, "top_n", int, len(docs))
        if top_n < 1:
            raise ApiError(400, "'top_n' must be positive", "top_n")
        with_docs = field(body, "return_documents", bool, False)
        r = self.svc.resolve(name)
        self.svc.require(r, "rerank", "reranking")
        async with await self.svc.lease(request, r, {}, None) as lease:
            data = await until_disconnect(
                request,
                lease.hop.api.post_json("/v1/rerank", {"query": query, "documents": docs}),
            )
        ranked = sorted(data["results"], key=lambda x: -x["relevance_score"])[:top_n]
        results: list[dict[str, Any]] = []
        for item in ranked:
            out = {"index": item["index"], "relevance_score": item["relevance_score"]}
            if with_docs:
                out["document"] = {"text": docs[item["index"]]}
            results.append(out)
        usage = data.get("usage") or {}
        return json_response({
            "model": r.requested, "object": "list", "results": results,
            "usage": {"prompt_tokens": usage.get("prompt_tokens", 0),
                      "total_tokens": usage.get("total_tokens", 0)},
        })  # fmt: skip


def document_text(doc: Any, i: int) -> str:
    """A document is a string, or an object with "text" (Jina, Cohere)."""
    if isinstance(doc, dict) and isinstance(doc.get("text"), str):
        return str(doc["text"])
    if isinstance(doc, str):
        return doc
    raise ApiError(400, f"invalid 'documents[{i}]': expected a string or {{\"text\": ...}}",
                   "documents")  # fmt: skip
