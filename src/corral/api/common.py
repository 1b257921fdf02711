"""What every API adapter shares: errors with an HTTP status (corral.errors), body parsing, field
and option checks, work cancelled when the client leaves (`until_disconnect`), timestamps."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import math
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import orjson
from starlette.requests import Request
from starlette.responses import Response

from corral.api.activity import note_model
from corral.core.options import REQUEST_OPTIONS, Option
from corral.errors import ApiError

T = TypeVar("T")

MAX_BODY = 64 * 2**20  # a request body larger than this is refused before parsing
# JSON nested deeper than this is refused: no API nests nearly as deep (a tool's schema with
# 25 levels of objects is ~55), and orjson cannot write back values nested past 254 levels.
MAX_DEPTH = 64


TOO_DEEP = f"request body is too deeply nested (limit {MAX_DEPTH} levels)"


async def read_json(request: Request) -> dict[str, Any]:
    """The body as a JSON object, or a 400 that says what is wrong with it."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > MAX_BODY:
        raise ApiError(413, f"request body too large (limit {MAX_BODY // 2**20} MiB)")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY:
            raise ApiError(413, f"request body too large (limit {MAX_BODY // 2**20} MiB)")
        chunks.append(chunk)
    body = b"".join(chunks)
    if not body.strip():
        raise ApiError(400, "missing request body")
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        if "depth limit" in str(e):  # orjson's own limit, 1024 levels
            raise ApiError(400, TOO_DEEP) from None
        raise ApiError(400, f"invalid JSON in request body: {e}") from None
    if not isinstance(data, dict):
        raise ApiError(400, "request body must be a JSON object")
    if too_deep(body, data, MAX_DEPTH):
        raise ApiError(400, TOO_DEEP)
    return data


def too_deep(raw: bytes, data: Any, limit: int) -> bool:
    """Whether parsed JSON nests more than `limit` arrays and objects deep. A body with fewer
    brackets than that cannot (counted in C); others are walked level by level, without
    recursion, visiting each container once."""
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False
    level: list[Any] = [data]
    for _ in range(limit):
        nxt: list[Any] = []
        for v in level:
            items = v.values() if isinstance(v, dict) else v
            nxt += [x for x in items if isinstance(x, dict | list)]
        if not nxt:
            return False
        level = nxt
    return True


_JSON_TYPES = {
    str: "a string",
    int: "an integer",
    float: "a number",
    bool: "a boolean",
    list: "an array",
    dict: "an object",
}


def field(
    body: dict[str, Any],
    name: str,
    typ: type | tuple[type, ...],
    default: Any = None,
    *,
    prefix: str = "",
) -> Any:
    """body[name] checked against a JSON type; 400 naming the field if it has another type."""
    value = body.get(name)
    if value is None:
        return default
    types = typ if isinstance(typ, tuple) else (typ,)
    ok = any(
        (isinstance(value, t) and not (isinstance(value, bool) and t is not bool))
        or (t is float and isinstance(value, int) and not isinstance(value, bool))
        for t in types
    )
    if not ok or (isinstance(value, float) and not math.isfinite(value)):
        want = " or ".join(_JSON_TYPES.get(t, t.__name__) for t in types)
        raise ApiError(
            400, f"invalid type for '{prefix}{name}': expected {want}", f"{prefix}{name}"
        )
    return value


def model_field(body: dict[str, Any]) -> str:
    """The request's `model` (also the model its log line names)."""
    name = field(body, "model", str)
    if not name or not name.strip():
        raise ApiError(400, "'model' is required", "model")
    note_model(name)
    return name


def check_options(options: Any) -> dict[str, Any]:
    """A request's Ollama options with their types and ranges checked (core/options.py)."""
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise ApiError(400, "invalid type for 'options': expected an object", "options")
    out: dict[str, Any] = {}
    for name, opt in REQUEST_OPTIONS.items():
        value = option_value(options, opt, "options.")
        if value is not None:
            out[name] = value
    return out


def option_value(values: dict[str, Any], opt: Option, prefix: str, param: str | None = None) -> Any:
    """`values[opt.name]` checked against the option's type and range (None if absent; a lone
    stop string as a list); 400 naming `prefix` + the option (`param`: the error's field for a
    value out of range, that name by default)."""
    where = f"{prefix}{opt.name}"
    value = field(values, opt.name, opt.type, prefix=prefix)
    if value is None:
        return None
    lo, hi = opt.range
    if isinstance(value, int | float) and not lo <= value <= hi:
        raise ApiError(400, f"'{where}' must be between {lo:g} and {hi:g}", param or where)
    if opt.name == "stop":
        value = [value] if isinstance(value, str) else value
        if not all(isinstance(s, str) for s in value):
            raise ApiError(400, f"invalid type for '{where}': expected strings", param or where)
    return value


async def until_disconnect(
    request: Request, work: Awaitable[T], undo: Callable[[T], object] | None = None
) -> T:
    """Run `work`, cancelling it if the client goes away first (frees the runner slot at once).
    If the caller itself is cancelled (e.g. one of n choices failed), so is `work`, and `undo`
    gives back what it won just before (a lease granted as the caller was cancelled)."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        if undo is not None:
            task.add_done_callback(
                lambda t: undo(t.result()) if not t.cancelled() and t.exception() is None else None
            )
        raise
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        raise ApiError(499, "client disconnected")
    return task.result()


def now_rfc3339() -> str:
    return rfc3339(dt.datetime.now(dt.timezone.utc).timestamp())


def rfc3339(ts: float) -> str:
    if not math.isfinite(ts) or ts > 253402300799:  # year 9999: Go clients' "forever"
        ts = 253402300799 if ts > 0 else 0
    return dt.datetime.fromtimestamp(ts, dt.timezone.utc).isoformat().replace("+00:00", "Z")


def json_response(data: Any, status: int = 200) -> Response:
    # numpy arrays too: embeddings are written straight from their matrix (api/embed.py)
    return Response(
        orjson.dumps(data, option=orjson.OPT_SERIALIZE_NUMPY), status, media_type="application/json"
    )
