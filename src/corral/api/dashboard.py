"""The live dashboard (`GET /ui`), its state (`GET /api/corral/state`, and as a stream
`GET /api/corral/events`).

The page is plain HTML, CSS and JS shipped in `corral/ui` (package data: no build step, no
CDN, works offline). It reads one JSON document, built here from the scheduler's books on each
request: every registered model with its runner's state (loading with its progress, ready,
draining, unloading), bytes per device booked and measured, slots, queue, keep-alive,
tokens per second; a bar per device (budget, booked by corral, in use as the device reports
it); the journal's recent decisions. The events stream pushes that document every second and
at once after each journal event (load, ready, eviction, crash, refusal), so the page updates
without a reload and without polling.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from importlib import resources
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute

import corral
from corral.api.common import ApiError
from corral.api.family import OLLAMA, SSE, FamilyRoute
from corral.api.service import Service
from corral.api.stream import RelayResponse, json_response
from corral.runtime.journal import Event
from corral.runtime.registry import canonical_name
from corral.runtime.scheduler import Scheduler

ASSETS = {"app.js": "text/javascript", "style.css": "text/css"}
# The page and its files come from corral itself and nothing else.
UI_HEADERS = {
    "Cache-Control": "no-cache",
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; "
    "style-src 'self' 'unsafe-inline'; script-src 'self'; connect-src 'self'; base-uri 'none'; "
    "frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
}
STATE_INTERVAL = 1.0  # seconds between state pushes on /api/corral/events
PING_INTERVAL = 15.0  # an SSE comment this often, so a dead connection is noticed
RATE_WINDOW = 10.0  # seconds of token counts a tokens/s figure spans
EVENTS_SHOWN = 60  # journal events in the state document
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def ui_file(name: str) -> bytes:
    return resources.files("corral.ui").joinpath(name).read_bytes()


def _num(x: float) -> float | None:
    return round(x, 3) if math.isfinite(x) else None


class _Rates:
    """Tokens per second per model, from the scheduler's cumulative counters (refreshed by
    its measure every 2 s): the change over the last RATE_WINDOW seconds of samples."""

    def __init__(self) -> None:
        self._samples: dict[str, deque[tuple[float, int, int]]] = {}

    def rate(self, model: str, counts: list[int] | None, now: float) -> dict[str, float] | None:
        if counts is None:
            return None
        q = self._samples.setdefault(model, deque())
        if not q or (q[-1][1], q[-1][2]) != (counts[0], counts[1]) or now - q[-1][0] >= 1.0:
            q.append((now, counts[0], counts[1]))
        while len(q) > 2 and now - q[1][0] >= RATE_WINDOW:
            q.popleft()
        t0, p0, g0 = q[0]
        span = now - t0
        if span < 1.0:
            return None
        return {"prompt": round((counts[0] - p0) / span, 2),
                "generated": round((counts[1] - g0) / span, 2)}  # fmt: skip


class Dashboard:
    def __init__(self, service: Service) -> None:
        self.svc = service
        self.scheduler = service.scheduler
        self._rates = _Rates()
        self._details: dict[tuple[str, float, int], dict[str, Any]] = {}

    def routes(self) -> list[BaseRoute]:
        return [
            FamilyRoute(OLLAMA, "/ui", self.page, ["GET", "HEAD"]),
            FamilyRoute(OLLAMA, "/ui/", self.page, ["GET", "HEAD"]),
            FamilyRoute(OLLAMA, "/ui/{name}", self.asset, ["GET", "HEAD"]),
            FamilyRoute(OLLAMA, "/api/corral/state", self.state_endpoint, ["GET"]),
            FamilyRoute(OLLAMA, "/api/corral/books", self.books_endpoint, ["GET"]),
            FamilyRoute(OLLAMA, "/api/corral/events", self.events_endpoint, ["GET"]),
        ]

    # ---- the page -----------------------------------------------------------------------------
    async def page(self, request: Request) -> Response:
        return Response(ui_file("index.html"), media_type="text/html", headers=UI_HEADERS)

    async def asset(self, request: Request) -> Response:
        name = request.path_params["name"]
        if name == "index.html":
            return await self.page(request)
        if name not in ASSETS:
            raise ApiError(404, "not found")
        return Response(ui_file(name), media_type=ASSETS[name], headers=UI_HEADERS)

    # ---- the state ----------------------------------------------------------------------------
    def _model_details(self, name: str, modified: float, size: int) -> dict[str, Any]:
        key = (name, modified, size)
        if key not in self._details:
            if len(self._details) > 4096:
                self._details.clear()
            try:
                r = self.svc.resolve(name)
                self._details[key] = {"details": r.info.details(),
                                      "capabilities": sorted(r.info.capabilities)}  # fmt: skip
            except ApiError as e:
                self._details[key] = {"details": {}, "capabilities": [], "error": e.message}
        return self._details[key]

    def state(self, model: str | None = None) -> dict[str, Any]:
        """Everything the page shows, as plain JSON; with `model`, only that model is listed
        (`corral run` follows its load with it)."""
        s, core = self.scheduler, self.scheduler.core
        now_wall, now = time.time(), time.monotonic()
        measured_dev: dict[int, dict[str, int]] = getattr(s, "measured_devices", {})
        # The runner each model shows: its current one (loading or ready), else one on its way
        # out; every runner's bytes count on the device bars either way.
        shown: dict[str, int] = {}
        for rid, b in core.runners.items():
            if b.model not in shown or b.state != "unloading":
                shown[b.model] = rid
        entries = {e.name: e for e in self.svc.registry.all()}
        names = sorted(set(entries) | set(shown))
        if model is not None:
            e = self.svc.registry.get(model)
            names = [e.name if e else canonical_name(model)]
        models = []
        for name in names:
            e = entries.get(name)
            item: dict[str, Any] = {
                "name": name,
                "registered": e is not None,
                "file_bytes": e.size if e else None,
                "pinned": bool(e and e.pinned),
                "priority": e.priority if e else 0,
                "keep_alive_fixed": bool(e and getattr(e, "keep_alive_fixed", False)),
                "queued": core.queued(name),
                "tokens": None,
                "tokens_per_second": None,
            }
            if e is not None:
                item |= self._model_details(name, e.modified_at, e.size)
            counts = s.tokens.get(name)
            if counts is not None:
                item["tokens"] = {"prompt": counts[0], "generated": counts[1]}
            item["tokens_per_second"] = self._rates.rate(name, counts, now)
            shown_id = shown.get(name)
            book = core.runners.get(shown_id) if shown_id is not None else None
            if book is None:
                item |= {"state": "not_loaded", "runner": None}
                models.append(item)
                continue
            runner = s.runners.get(book.id)
            state: str = book.state
            if state == "ready" and book.draining:
                state = "draining"
            if book.state != "ready":
                expires_in = None
            elif book.inflight or not math.isfinite(book.expires_at):
                expires_in = None
            else:
                expires_in = max(0.0, book.expires_at - now)
            loading = runner is not None and book.state == "loading" and runner.started_at > 0
            ready = runner is not None and runner.load_duration > 0
            item["state"] = state
            item["pinned"] = item["pinned"] or book.pinned
            item["priority"] = book.priority or item["priority"]
            item["runner"] = {
                "id": book.id,
                "pid": runner.pid if runner else None,
                "devices": {d: n for d, n in book.devices.items() if n},
                "booked": book.size,
                "measured": s.measured.get(book.id),
                "measured_devices": measured_dev.get(book.id) or {},
                "slots": book.spec.num_parallel,
                "in_use": book.inflight,
                "context_length": book.spec.n_ctx,
                "keep_alive": _num(book.keep_alive),  # null: forever
                "expires_in": _num(expires_in) if expires_in is not None else None,
                "expires_at": _num(now_wall + expires_in) if expires_in is not None else None,
                "progress": runner.progress if loading and runner else None,
                "loading_for": round(now - runner.started_at, 1) if loading and runner else None,
                "load_seconds": round(runner.load_duration, 3) if ready and runner else None,
                # share of the file in the page cache, and the reload the policy predicts
                "page_cache": s.residency.get(book.id),
                "reload_seconds": round(book.load_cost, 3) if ready and runner else None,
                "uses": book.uses,
            }
            models.append(item)
        used = core.used()
        last = {d.id: d for d in s.last_devices}
        devices = []
        for dev, budget in core.budgets.items():
            d = last.get(dev)
            measured = 0
            for rid in core.runners:
                m = measured_dev.get(rid)
                if m and dev in m:
                    measured += m[dev]
                elif dev == "cpu" and rid in s.measured:
                    measured += s.measured[rid]
            if dev == "cpu" and measured:  # the runners' code, in memory once for all of them
                measured += s.code_last
            devices.append({
                "id": dev,
                "name": d.name if d else dev,
                "total": d.total if d else None,
                "in_use": d.total - d.free if d else None,  # all programs, as reported
                "budget": budget,
                "booked": used.get(dev, 0),  # reserved included
                "reserved": core.reserved.get(dev, 0),  # for all runners: their shared code
                "measured": measured,  # what corral's runners really hold there
                "headroom": core.headroom.get(dev) if hasattr(core, "headroom") else None,
            })  # fmt: skip
        events = [ev.as_dict() for ev in list(s.journal.recent)[-EVENTS_SHOWN:]]
        return {
            "version": corral.__version__,
            "time": now_wall,
            "devices": devices,
            "models": models,
            "loaded": sum(1 for b in core.runners.values() if b.state != "unloading"),
            "in_flight": sum(b.inflight for b in core.runners.values()),
            "queued": len(core.queue),
            "events": events[::-1],  # newest first
        }

    async def state_endpoint(self, request: Request) -> Response:
        state = self.state(request.query_params.get("model") or None)
        body = orjson.dumps(state, option=orjson.OPT_NON_STR_KEYS)
        return Response(body, media_type="application/json", headers={"Cache-Control": "no-cache"})

    async def books_endpoint(self, request: Request) -> Response:
        """The scheduler's budgets and what it holds for all runners at once (their shared
        code), per device: what a cluster's entry needs of a node's books besides /api/ps."""
        core = self.scheduler.core
        return json_response({"budgets": core.budgets, "reserved": core.reserved})

    # ---- streams ------------------------------------------------------------------------------
    async def events_endpoint(self, request: Request) -> Response:
        """The state document as server-sent events: now, every second, and right after each
        journal event (`event: state`); each journal event itself too (`event: journal`)."""

        async def stream() -> AsyncIterator[bytes]:
            async with journal_events(self.scheduler) as q:
                yield b"retry: 2000\n\n"
                while not stopping(request, self.scheduler):
                    state = orjson.dumps(self.state(), option=orjson.OPT_NON_STR_KEYS)
                    yield b"event: state\ndata: " + state + b"\n\n"
                    try:
                        ev = await asyncio.wait_for(q.get(), STATE_INTERVAL)
                    except asyncio.TimeoutError:
                        continue
                    evs = [ev]
                    await asyncio.sleep(0.05)  # what one decision sets off comes together
                    while not q.empty():
                        evs.append(q.get_nowait())
                    for e in evs:
                        yield b"event: journal\ndata: " + orjson.dumps(e.as_dict()) + b"\n\n"

        return RelayResponse(stream(), SSE, headers=SSE_HEADERS)


def wants_html(request: Request) -> bool:
    """A browser asking for a page (not a client probing `GET /`)."""
    return "text/html" in request.headers.get("accept", "")


def stopping(request: Request, scheduler: Scheduler) -> bool:
    """Whether the server is on its way down: an endless stream ends."""
    gate = getattr(request.app.state, "gate", None)
    return bool(getattr(scheduler, "_closing", False) or getattr(gate, "draining", False))


@contextlib.asynccontextmanager
async def journal_events(scheduler: Scheduler) -> AsyncIterator[asyncio.Queue[Event]]:
    """Journal events from now on, in a queue (listeners must not block)."""
    q: asyncio.Queue[Event] = asyncio.Queue(maxsize=1000)

    def put(ev: Event) -> None:
        with contextlib.suppress(asyncio.QueueFull):
            q.put_nowait(ev)

    stop: Callable[[], Any] = scheduler.journal.listen(put)
    try:
        yield q
    finally:
        stop()
