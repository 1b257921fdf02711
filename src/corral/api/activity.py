"""Every request, visible: one log line per request (as Ollama's `[GIN]` line) and a ring of
the last ones (`GET /api/corral/activity`, which the dashboard's activity view reads).

`RequestLog` (ASGI middleware, the outermost) opens an `Entry` for each request and keeps it
in a context variable while the request is served, so whatever serves it adds what it learns
without being handed anything: the model as the body names it (`common.model_field`) and as
resolved, each lease (`Service.lease` -> `note_lease`: its tally counts the tokens and holds
llama.cpp's timings), and every error a client hears, whole or ending a stream, where its
family renders it (`api/family.py`). The middleware's call returns once the response's last
byte was sent (or the client left), so the line is written then, with the final counts: time,
client, method, route, model, status, prompt and generated tokens, time to first token, tokens
per second, duration and, for an error, its message. With CORRAL_LOG_FORMAT=json the same
fields are keys of the line's object.

Requests a page or a probe makes on its own all the time (the dashboard's state, assets,
health, metrics) are logged at debug level and not kept, unless they fail.
"""

from __future__ import annotations

import contextvars
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from corral.errors import ApiError
from corral.runtime.meter import Tally
from corral.runtime.registry import canonical_name

log = logging.getLogger("corral.request")

KEEP = 500  # requests the ring holds
_STREAMS = (b"text/event-stream", b"application/x-ndjson")
# Requests made on their own all the time: logged at debug level, not kept (unless they fail).
QUIET_PATHS = frozenset({
    "/", "/health", "/metrics", "/api/version", "/api/corral/state", "/api/corral/events",
    "/api/corral/books", "/api/corral/activity",
})  # fmt: skip


@dataclass(eq=False)
class Entry:
    """One request, filled in while it is served."""

    started: float  # wall clock (seconds since the epoch) at its arrival
    arrived: float  # time.monotonic() at its arrival
    client: str | None
    method: str
    route: str
    model: str | None = None
    status: int = 0
    error: str | None = None
    streamed: bool = False  # its body is a stream of events (SSE or NDJSON)
    granted: float | None = None  # time.monotonic() when its (first) lease was granted
    tallies: list[Tally] = field(default_factory=list)
    embedded: int | None = None  # an embedding request's prompt tokens (it generates none)


_current: contextvars.ContextVar[Entry | None] = contextvars.ContextVar(
    "corral_request", default=None
)


def note_model(model: str) -> None:
    """The model the request being served is for (the name asked, then the one resolved)."""
    entry = _current.get()
    if entry is not None:
        entry.model = model


def current() -> Entry | None:
    """The request being served (None outside one)."""
    return _current.get()


def note_lease(tally: Tally) -> None:
    """The request being served was granted a runner slot; `tally` counts its tokens."""
    entry = _current.get()
    if entry is not None:
        if entry.granted is None:
            entry.granted = time.monotonic()
        entry.tallies.append(tally)


def note_embedded(tokens: int) -> None:
    """The request being served embedded `tokens` prompt tokens and generates none."""
    entry = _current.get()
    if entry is not None:
        entry.embedded = (entry.embedded or 0) + tokens


def note_error(e: ApiError | str) -> None:
    """What went wrong with the request being served, as its client is told (the last word
    counts: an error that ends a stream comes after any before it)."""
    entry = _current.get()
    if entry is not None:
        entry.error = e.message if isinstance(e, ApiError) else e


@dataclass(frozen=True)
class Record:
    """A request once it is over: what the log line says and the activity view shows."""

    id: int
    time: float  # wall clock at its arrival
    client: str | None
    method: str
    route: str
    model: str | None
    status: int
    prompt_tokens: int | None
    generated_tokens: int | None
    time_to_first_token: float | None  # seconds from its arrival
    tokens_per_second: float | None  # generation speed
    duration: float  # seconds from its arrival to its last byte
    error: str | None

    def fields(self) -> dict[str, Any]:
        """Its fields as the log's JSON object has them (the log line's own time is its end)."""
        return {
            "client": self.client, "method": self.method, "route": self.route,
            "model": self.model, "status": self.status, "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "time_to_first_token": _round(self.time_to_first_token),
            "tokens_per_second": _round(self.tokens_per_second, 2),
            "duration": _round(self.duration), "error": self.error,
        }  # fmt: skip

    def json(self) -> dict[str, Any]:
        """As `GET /api/corral/activity` shows it."""
        when = datetime.fromtimestamp(self.time, timezone.utc).isoformat(timespec="milliseconds")
        return {"id": self.id, "time": when, **self.fields()}

    def line(self) -> str:
        """The text log line: status, duration, client, method and route, model, then the
        tokens and speeds or the error."""
        parts = [str(self.status), f"{self.duration:.3f}s", self.client or "-",
                 f"{self.method} {self.route}", self.model or "-"]  # fmt: skip
        figures = []
        if self.prompt_tokens is not None:
            figures.append(f"{self.prompt_tokens} prompt tokens")
        if self.generated_tokens is not None:
            figures.append(f"{self.generated_tokens} generated")
        if self.time_to_first_token is not None:
            figures.append(f"first token {self.time_to_first_token:.3f}s")
        if self.tokens_per_second is not None:
            figures.append(f"{self.tokens_per_second:.1f} tokens/s")
        if figures:
            parts.append(", ".join(figures))
        if self.error:  # one line, whatever the message (a runner's last log lines)
            parts.append("error: " + "; ".join(s.strip() for s in self.error.splitlines()
                                               if s.strip()))  # fmt: skip
        return " | ".join(parts)

    def matches(self, model: str | None, status: Callable[[int], bool] | None) -> bool:
        if model is not None and (
            self.model is None or canonical_name(self.model) != canonical_name(model)
        ):
            return False
        return status is None or status(self.status)


def _round(x: float | None, digits: int = 3) -> float | None:
    return None if x is None else round(x, digits)


def record(entry: Entry, rid: int, now: float) -> Record:
    """The record of a request that is over (`now`: time.monotonic() at its end)."""
    tallies = entry.tallies
    prompt = generated = ttft = speed = None
    if tallies:
        generated = sum(t.total for t in tallies)
        prompts = [t.prompt for t in tallies if t.prompt is not None]
        prompt = max(prompts) if prompts else None  # n choices read one prompt
        firsts = [a for t in tallies if (a := t.since_first()) is not None]
        read = [t.prompt_ms for t in tallies if t.prompt_ms is not None]
        if entry.streamed and firsts:  # when its first token reached the client
            ttft = max(0.0, now - entry.arrived - max(firsts))
        elif entry.granted is not None and read:  # a whole answer: when llama.cpp made it
            ttft = entry.granted - entry.arrived + min(read) / 1000
        rates = [t.total * 1000 / t.predicted_ms for t in tallies if t.predicted_ms]
        speed = sum(rates) if rates else None
    if entry.embedded is not None:  # read, not generated: no tokens out, no first token
        prompt, generated, ttft, speed = entry.embedded, None, None, None
    return Record(
        rid, entry.started, entry.client, entry.method, entry.route, entry.model,
        entry.status, prompt, generated, ttft, speed, now - entry.arrived, entry.error,
    )  # fmt: skip


Listener = Callable[[Record], None]


def status_filter(text: str) -> Callable[[int], bool]:
    """`?status=`: a code (404), a class (4xx), `ok` (below 400) or `error` (400 and up)."""
    t = text.strip().lower()
    if t == "ok":
        return lambda s: s < 400
    if t == "error":
        return lambda s: s >= 400
    if len(t) == 3 and t[0] in "12345" and t[1:] == "xx":
        cls = int(t[0])
        return lambda s: s // 100 == cls
    if t.isdigit() and len(t) == 3:
        code = int(t)
        return lambda s: s == code
    raise ApiError(
        400, f"status {text!r} is not a status: use a code (404), a class (4xx), ok or error",
        "status",
    )  # fmt: skip


class Activity:
    """The last KEEP requests (a ring, not a database), newest last; listeners hear each one
    as it ends (a live view)."""

    def __init__(self, keep: int = KEEP) -> None:
        self.records: deque[Record] = deque(maxlen=keep)
        self._ids = itertools.count(1)
        self._listeners: list[Listener] = []

    def next_id(self) -> int:
        return next(self._ids)

    def add(self, rec: Record) -> None:
        self.records.append(rec)
        for fn in list(self._listeners):
            try:
                fn(rec)
            except Exception:  # a listener's failure is its own, never the request's
                logging.getLogger(__name__).exception("an activity listener failed")

    def listen(self, fn: Listener) -> Callable[[], None]:
        """Call fn with every request that ends from now on; returns the function that stops
        it."""
        self._listeners.append(fn)
        return lambda: self._listeners.remove(fn) if fn in self._listeners else None

    def find(
        self, model: str | None = None, status: Callable[[int], bool] | None = None
    ) -> Iterator[Record]:
        """The kept requests that match, newest first."""
        return (r for r in reversed(self.records) if r.matches(model, status))

    async def endpoint(self, request: Request) -> Response:
        """`GET /api/corral/activity?model=&status=&limit=`: the kept requests, newest first."""
        q = request.query_params
        status = status_filter(q["status"]) if q.get("status") else None
        limit = q.get("limit", "")
        if limit and not limit.isdigit():
            raise ApiError(400, f"limit {limit!r} is not a whole number", "limit")
        n = int(limit) if limit else KEEP
        found = itertools.islice(self.find(q.get("model") or None, status), n)
        body = orjson.dumps({"requests": [r.json() for r in found]})
        return Response(body, media_type="application/json")


class RequestLog:
    """The outermost middleware: one `Entry` per HTTP request, written to the log and kept in
    the `Activity` ring once the response is over."""

    def __init__(self, app: ASGIApp, activity: Activity) -> None:
        self.app = app
        self.activity = activity

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        client = scope.get("client")
        entry = Entry(
            time.time(), time.monotonic(), client[0] if client else None, scope["method"],
            scope["path"],
        )  # fmt: skip

        async def watch(message: Message) -> None:
            if message["type"] == "http.response.start":
                entry.status = message["status"]
                entry.streamed = any(
                    k.lower() == b"content-type" and v.split(b";")[0].strip() in _STREAMS
                    for k, v in message.get("headers") or []
                )
            await send(message)

        token = _current.set(entry)
        try:
            await self.app(scope, receive, watch)
        except BaseException as e:
            if not entry.status:  # nothing was sent: the server's error handler answers 500
                entry.status = 500
            if entry.error is None:
                entry.error = f"internal error: {type(e).__name__}"
            raise
        finally:
            _current.reset(token)
            self._done(entry)

    def _done(self, entry: Entry) -> None:
        quiet = entry.status < 400 and (
            entry.route in QUIET_PATHS or entry.route.startswith("/ui")
        )
        if quiet and not log.isEnabledFor(logging.DEBUG):
            return  # a page's or a probe's own request: nothing to build
        rec = record(entry, self.activity.next_id(), time.monotonic())
        # The JSON formatter asks for the fields (logs.JsonFormatter); text lines never build them.
        if quiet:
            log.debug("%s", rec.line(), extra={"fields": rec.fields})
            return
        if log.isEnabledFor(logging.INFO):
            log.info("%s", rec.line(), extra={"fields": rec.fields})
        self.activity.add(rec)
