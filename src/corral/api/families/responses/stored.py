"""OpenAI Responses' stored state, as OpenAI's reference serves it: `GET` and `DELETE
/v1/responses/{id}`, `GET /v1/responses/{id}/input_items`, and the conversation a
`previous_response_id` continues (the store itself is runtime/response_store.py).

A response created with `store` (OpenAI's default, true) is kept with its input items: the
conversation it continued (the earlier response's input and output items), then the request's
own input, each item with an id (a string input is one user message; message content is a list
of parts). A request with `previous_response_id` answers that conversation and its own input,
so its prompt continues the earlier prompt and the runner's cached prefix is reused. The
earlier request's `instructions` are not carried over (OpenAI's rule): send them again to keep
the prefix.

Errors as OpenAI gives them: an unknown `previous_response_id` is a 400 with the code
`previous_response_not_found`, an unknown id in a path a 404.
"""

from __future__ import annotations

import re
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from corral.api.chat import new_id
from corral.api.common import field as get
from corral.api.common import json_response
from corral.api.family import RESPONSES, FamilyRoute
from corral.errors import ApiError
from corral.runtime.response_store import ResponseStore, Stored

ID = re.compile(r"^[A-Za-z0-9_-]+$")  # OpenAI's rule for an id a request names
# The id an input item gets when the client gave it none, by its type (else "item_").
PREFIXES = {
    "message": "msg_", "function_call": "fc_", "function_call_output": "fco_",
    "custom_tool_call": "ctc_", "custom_tool_call_output": "ctco_", "reasoning": "rs_",
    "additional_tools": "at_",
}  # fmt: skip
MAX_LIMIT = 100  # input_items: the most items a page holds (OpenAI's)
DEFAULT_LIMIT = 20


def previous_id(body: dict[str, Any]) -> str | None:
    """`previous_response_id`, checked as OpenAI checks it."""
    value = get(body, "previous_response_id", str)
    if value is not None and not ID.match(value):
        raise ApiError(
            400,
            f"Invalid 'previous_response_id': '{value}'. Expected an ID that contains letters, "
            "numbers, underscores, or dashes, but this value contained additional characters.",
            "previous_response_id",
        )
    return value


def stored_items(value: str | list[Any]) -> list[dict[str, Any]]:
    """A request's input (checked already) as input_items lists it: a string as a user
    message, message content as a list of parts, an id for every item. Read back as chat
    messages, the items give the same messages as the input did."""
    if isinstance(value, str):
        value = [{"role": "user", "content": value}]
    items = []
    for item in value:
        kind = item.get("type", "message" if "role" in item else None)
        given = item.get("id")
        known = isinstance(given, str) and given
        out = {**item, "id": given if known else new_id(PREFIXES.get(kind, "item_")), "type": kind}
        if kind == "message":
            content = out.get("content")
            if isinstance(content, str):
                part = (
                    {"type": "output_text", "text": content, "annotations": []}
                    if out.get("role") == "assistant"
                    else {"type": "input_text", "text": content}
                )
                out["content"] = [part]
            out.setdefault("status", "completed")
        items.append(out)
    return items


class StoredResponses:
    """The routes that read and delete stored responses, and the lookup of the response a
    request continues."""

    def __init__(self, store: ResponseStore) -> None:
        self.store = store

    def routes(self) -> list[Route]:
        at = "/v1/responses/{response_id}"
        return [
            FamilyRoute(RESPONSES, at, self.retrieve, ["GET"]),
            FamilyRoute(RESPONSES, at, self.delete, ["DELETE"]),
            FamilyRoute(RESPONSES, f"{at}/input_items", self.input_items, ["GET"]),
        ]

    def previous(self, response_id: str) -> Stored:
        rec = self.store.get(response_id)
        if rec is None:
            raise ApiError(
                400,
                f"Previous response with id '{response_id}' not found.",
                "previous_response_id",
                code="previous_response_not_found",
            )
        return rec

    def _stored(self, request: Request) -> Stored:
        response_id = request.path_params["response_id"]
        rec = self.store.get(response_id)
        if rec is None:
            raise ApiError(404, f"Response with id '{response_id}' not found.")
        return rec

    async def retrieve(self, request: Request) -> Response:
        rec = self._stored(request)
        if request.query_params.get("stream", "false").lower() == "true":
            raise ApiError(
                400, "corral cannot stream a stored response again: retrieve it whole", "stream"
            )
        return json_response(rec.response)

    async def delete(self, request: Request) -> Response:
        rec = self._stored(request)
        self.store.delete(rec.id)
        return json_response({"id": rec.id, "object": "response", "deleted": True})

    async def input_items(self, request: Request) -> Response:
        rec = self._stored(request)
        q = request.query_params
        order = q.get("order", "desc")
        if order not in ("asc", "desc"):
            raise ApiError(400, "'order' must be asc or desc", "order")
        limit = _limit(q.get("limit"))
        items = rec.inputs if order == "asc" else rec.inputs[::-1]
        ids = [item.get("id") for item in items]
        after, before = q.get("after"), q.get("before")
        start, end = 0, len(items)
        if after is not None:
            start = _at(ids, after, "after", rec.id) + 1
        if before is not None:
            end = _at(ids, before, "before", rec.id)
        window = items[start:end]
        # `before` pages back: the items just before it, in the list's order.
        page = window[-limit:] if before is not None and after is None else window[:limit]
        return json_response({
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(window) > len(page),
        })  # fmt: skip


def _limit(value: str | None) -> int:
    if value is None:
        return DEFAULT_LIMIT
    try:
        limit = int(value)
    except ValueError:
        raise ApiError(400, "invalid type for 'limit': expected an integer", "limit") from None
    if not 1 <= limit <= MAX_LIMIT:
        raise ApiError(400, f"'limit' must be between 1 and {MAX_LIMIT}", "limit")
    return limit


def _at(ids: list[Any], item_id: str, param: str, response_id: str) -> int:
    try:
        return ids.index(item_id)
    except ValueError:
        raise ApiError(
            400, f"No item with id '{item_id}' in the input items of response '{response_id}'.",
            param,
        ) from None  # fmt: skip
