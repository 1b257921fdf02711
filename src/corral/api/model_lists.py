"""The model lists of the families that share `GET /v1/models`: OpenAI's, and Anthropic's for a
client that says `anthropic-version` (Claude Code's model discovery), in a module of their own
so that neither family imports the other."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from corral.api.common import rfc3339
from corral.errors import ApiError
from corral.runtime.registry import ModelEntry


def openai_model(entry: ModelEntry) -> dict[str, Any]:
    return {
        "id": entry.name, "object": "model", "created": int(entry.modified_at),
        "owned_by": "corral",
    }  # fmt: skip


def anthropic_model(entry: ModelEntry) -> dict[str, Any]:
    return {
        "type": "model", "id": entry.name, "display_name": entry.name,
        "created_at": rfc3339(entry.modified_at),
    }  # fmt: skip


def anthropic_model_list(entries: list[ModelEntry], query: Mapping[str, str]) -> dict[str, Any]:
    """Anthropic's paged model list (`limit` 1-1000, default 20; `after_id` / `before_id`)."""
    try:
        limit = int(query.get("limit", "20"))
    except ValueError:
        raise ApiError(400, "limit: expected an integer", "limit") from None
    if not 1 <= limit <= 1000:
        raise ApiError(400, "limit: must be between 1 and 1000", "limit")
    ids = [e.name for e in entries]
    start, end = 0, len(entries)
    for key in ("after_id", "before_id"):
        if key in query:
            if query[key] not in ids:
                raise ApiError(404, f"{key}: model '{query[key]}' not found", key)
            at = ids.index(query[key])
            start, end = (at + 1, end) if key == "after_id" else (start, at)
    page = entries[start:end]
    page = page[-limit:] if "before_id" in query and "after_id" not in query else page[:limit]
    data = [anthropic_model(e) for e in page]
    return {
        "data": data, "has_more": len(page) < end - start,
        "first_id": data[0]["id"] if data else None, "last_id": data[-1]["id"] if data else None,
    }  # fmt: skip
