"""The live dashboard (`GET /ui`), its state (`GET /api/corral/state`, and as a stream
`GET /api/corral/events`).

The page is plain HTML, CSS and JS shipped in `corral/ui` (package data: no build step, no
CDN, works offline). It reads one JSON document, built here from the scheduler's view on each
request: every registered model with its runner's state (loading with its progress, ready,
draining, unloading), bytes per device booked and measured, slots, queue, keep-alive,
tokens per second (generated ones counted as corral relays them, per runner and slot); a bar
per device (budget, booked by corral, in use as the device reports it); who waits (each
request's model, place, time waited and why: `waiting`); the journal's recent decisions.
The events stream pushes that document every second and at once after each journal event
(load, ready, eviction, crash, refusal), so the page updates without a reload and without
polling; the last hour's history (api/history.py) for the
page's charts; the requests as they end (the activity ring, api/activity.py) and the server's
log lines (logs.RING), for the activity view and the log pane. `GET /api/corral/model` adds to
/api/show what the page's detail view shows.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from importlib import resources
from pathlib import Path
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute

import corral
from corral import logs
from corral.api.activity import Activity, Record
from corral.api.common import json_response
from corral.api.family import OLLAMA, SSE, FamilyRoute
from corral.api.history import History
from corral.api.paths import shown_path
from corral.api.service import Service
from corral.api.stream import SSE_HEADERS, RelayResponse, stopping
from corral.core.devices import device_memory
from corral.core.gguf import split_parts
from corral.core.waits import WHY
from corral.errors import ApiError
from corral.runtime.journal import Event
from corral.runtime.registry import canonical_name, runner_model
from corral.runtime.view import RunnerView, SchedulerView

ASSETS = {
    "app.js": "text/javascript",
    "activity.js": "text/javascript",
    "charts.js": "text/javascript",
    "models.js": "text/javascript",
    "playground.js": "text/javascript",
    "style.css": "text/css",
}
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
REQUESTS_SHOWN = 200  # finished requests the events stream starts with
LINES_SHOWN = 500  # log lines the events stream starts with
FEED_MAX = 5000  # what may wait for a slow page (then the newest is dropped)
BATCH = 0.05  # seconds what comes together waits to go in one event
def ui_file(name: str) -> bytes:
    return resources.files("corral.ui").joinpath(name).read_bytes()


def _num(x: float) -> float | None:
    return round(x, 3) if math.isfinite(x) else None


def waiting(v: SchedulerView) -> list[dict[str, Any]]:
    """Each request waiting for its turn, the queue's first: its model, its place among its
    model's requests (`of` them; for room, on its runner), its place in the one queue across
    models, the seconds it has waited, and why it waits (a code, and in words)."""
    return [
        {"request": w.request, "model": w.model, "place": w.place, "of": w.of,
         "position": w.position, "waited": round(w.waited, 1), "why": w.why,
         "reason": WHY[w.why], "runner": w.runner}
        for w in v.waiting
    ]  # fmt: skip


class _Rates:
    """Prompt tokens per second per model, from the runners' cumulative counters (refreshed by
    the scheduler's measure every 2 s): the change over the last RATE_WINDOW seconds of
    samples. (Generated tokens per second are corral's own, counted as they are relayed.)"""

    def __init__(self) -> None:
        self._samples: dict[str, deque[tuple[float, int, int]]] = {}

    def rate(self, model: str, counts: tuple[int, int] | None, now: float) -> float | None:
        if counts is None:
            return None
        q = self._samples.setdefault(model, deque())
        if not q or (q[-1][1], q[-1][2]) != (counts[0], counts[1]) or now - q[-1][0] >= 1.0:
            q.append((now, counts[0], counts[1]))
        while len(q) > 2 and now - q[1][0] >= RATE_WINDOW:
            q.popleft()
        t0, p0, _ = q[0]
        span = now - t0
        if span < 1.0:
            return None
        return round((counts[0] - p0) / span, 2)


class Dashboard:
    def __init__(
        self, service: Service, activity: Activity | None = None,
        log_ring: logs.LogRing | None = logs.RING,
    ) -> None:  # fmt: skip
        self.svc = service
        self.activity = activity
        self.log_ring = log_ring
        self.scheduler = service.scheduler
        self._rates = _Rates()
        self._details: dict[tuple[str, float, int], dict[str, Any]] = {}
        interval = getattr(service.settings, "history_interval", None) or 5.0
        self.history = History(self.scheduler.view, interval=interval)
        self.scheduler.listen(self._on_event)

    def _on_event(self, ev: Event) -> None:
        self.history.on_event(ev)
        self.history.start()  # on the loop now: the sampler runs from the first decision on

    def close(self) -> None:
        """Stop the history's sampler (it also stops by itself once the server is closing)."""
        self.history.stop()

    def routes(self) -> list[BaseRoute]:
        return [
            FamilyRoute(OLLAMA, "/ui", self.page, ["GET", "HEAD"]),
            FamilyRoute(OLLAMA, "/ui/", self.page, ["GET", "HEAD"]),
            FamilyRoute(OLLAMA, "/ui/{name}", self.asset, ["GET", "HEAD"]),
            FamilyRoute(OLLAMA, "/api/corral/state", self.state_endpoint, ["GET"]),
            FamilyRoute(OLLAMA, "/api/corral/books", self.books_endpoint, ["GET"]),
            FamilyRoute(OLLAMA, "/api/corral/events", self.events_endpoint, ["GET"]),
            FamilyRoute(OLLAMA, "/api/corral/history", self.history_endpoint, ["GET"]),
            FamilyRoute(OLLAMA, "/api/corral/model", self.model_endpoint, ["GET"]),
        ]

    # ---- the page -----------------------------------------------------------------------------
    async def page(self, request: Request) -> Response:
        self.history.start()
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
        v = self.scheduler.view()
        now_wall, now = time.time(), time.monotonic()
        # The runner each model shows: its current one (loading or ready), else one on its way
        # out; every runner's bytes count on the device bars either way.
        shown: dict[str, RunnerView] = {}
        for run in v.runners:
            if run.model not in shown or run.state != "unloading":
                shown[run.model] = run
        entries = {e.name: e for e in self.svc.registry.all()}
        names = sorted(set(entries) | set(shown))
        if model is not None:
            e = self.svc.registry.get(model)
            names = [e.name if e else canonical_name(model)]
        models = []
        for name in names:
            # a generative model's embedding runner: a row of its own, its model's details
            of = runner_model(name) if name not in entries else name
            e = entries.get(of)
            item: dict[str, Any] = {
                "name": name,
                "registered": e is not None,
                "embedding_of": of if of != name else None,
                "file_bytes": e.size if e else None,
                "pinned": bool(e and e.pinned),
                "priority": e.priority if e else 0,
                "keep_alive_fixed": bool(e and getattr(e, "keep_alive_fixed", False)),
                "queued": v.queued.get(name, 0),
                "tokens": None,
                "tokens_per_second": None,
            }
            if e is not None:
                item |= self._model_details(of, e.modified_at, e.size)
            counts = v.tokens.get(name)
            relayed = v.relayed.get(name)
            if counts is not None or relayed is not None:
                drafts = v.drafts.get(name, (0, 0))
                item["tokens"] = {"prompt": counts[0] if counts else 0,
                                  "generated": counts[1] if counts else 0,
                                  "relayed": relayed or 0,
                                  # speculative decoding: drafted, and accepted by the model
                                  "drafted": drafts[0], "accepted": drafts[1]}  # fmt: skip
            if (choice := v.drafting.get(name)) is not None:  # auto's drafting, and why
                item["drafting"] = {"on": choice.on, "why": choice.why}
            prompt = self._rates.rate(name, counts, now)
            if prompt is not None or name in v.tokens_per_second:
                # generated: as corral relays them (live); prompt: from the runner's counters
                item["tokens_per_second"] = {
                    "prompt": prompt if prompt is not None else 0.0,
                    "generated": round(v.tokens_per_second.get(name, 0.0), 2),
                }
            # Models of one file and runner shape share one runner, named by the first of them
            r = shown.get(name) or shown.get(self.svc.registry.runner_name(name))
            if r is None:
                item |= {"state": "not_loaded", "runner": None}
                models.append(item)
                continue
            state = "draining" if r.state == "ready" and r.draining else r.state
            if r.state != "ready" or r.inflight or not math.isfinite(r.expires_in):
                expires_in = None
            else:
                expires_in = max(0.0, r.expires_in)
            item["state"] = state
            item["pinned"] = item["pinned"] or r.pinned
            item["priority"] = r.priority or item["priority"]
            item["runner"] = {
                "id": r.id,
                "pid": r.pid,
                "devices": {d: n for d, n in r.devices.items() if n},
                "booked": r.size,
                "measured": r.measured,
                "measured_devices": dict(r.measured_devices),
                "slots": r.slots,
                "in_use": r.inflight,
                # of those, granted requests waiting for room in the slots' shared cache
                "waiting_for_room": r.waiting_for_room,
                "context_length": r.context_length,
                "speculative": r.speculative,  # its drafter, or "off"
                "keep_alive": _num(r.keep_alive),  # null: forever
                "expires_in": _num(expires_in) if expires_in is not None else None,
                "expires_at": _num(now_wall + expires_in) if expires_in is not None else None,
                # seconds it is still held for an agent's next turn (its answer was a tool call)
                "held_for": round(r.held_for, 1) if 0 < r.held_for < math.inf else None,
                "progress": r.progress if r.loading_for is not None else None,
                "loading_for": round(r.loading_for, 1) if r.loading_for is not None else None,
                "load_seconds": round(r.load_seconds, 3) if r.load_seconds else None,
                # share of the file in the page cache, and the reload the policy predicts
                "page_cache": r.page_cache,
                "reload_seconds": round(r.load_cost, 3) if r.load_seconds else None,
                "uses": r.uses,
                # generated tokens/s this runner relays now, in all and per slot
                "tokens_per_second": round(r.tokens_per_second, 2),
                "slot_tokens_per_second": [round(x, 2) for x in r.slot_tokens_per_second],
                # every model it serves (one file, one runner shape), its own name first
                "models": self.svc.registry.sharing(r.model),
            }
            models.append(item)
        last = {d.id: d for d in v.devices}
        devices = []
        for dev, budget in v.budgets.items():
            d = last.get(dev)
            mem = device_memory(d, v.measured[dev]) if d else None
            devices.append({
                "id": dev,
                "name": d.name if d else dev,
                "total": d.total if d else None,
                "in_use": d.total - d.free if d else None,  # all programs, as reported
                "others": mem.others if mem else None,  # held by other programs
                "free": mem.free if mem else None,
                "budget": budget,
                "booked": v.booked.get(dev, 0),  # reserved included
                "reserved": v.reserved.get(dev, 0),  # for all runners: their shared code
                "measured": v.measured[dev],  # what corral's runners really hold there
                "headroom": v.headroom.get(dev),
            })  # fmt: skip
        events = [ev.as_dict() for ev in v.events[-EVENTS_SHOWN:]]
        return {
            "version": corral.__version__,
            "time": now_wall,
            "devices": devices,
            "advice": list(self.svc.advice),  # what the operator should do (a GPU left unused)
            "models": models,
            "loaded": sum(1 for r in v.runners if r.state != "unloading"),
            "in_flight": sum(r.inflight for r in v.runners),
            "queued": sum(v.queued.values()),
            "waiting": waiting(v),  # who waits for a slot or for room, and why
            "events": events[::-1],  # newest first
        }

    async def state_endpoint(self, request: Request) -> Response:
        state = self.state(request.query_params.get("model") or None)
        body = orjson.dumps(state, option=orjson.OPT_NON_STR_KEYS)
        return Response(body, media_type="application/json", headers={"Cache-Control": "no-cache"})

    async def history_endpoint(self, request: Request) -> Response:
        """The charts' data: the last hour of samples as columns, and the journal's marks
        (`?since=` a wall time: only what came after it)."""
        self.history.start()
        since: float | None = None
        if raw := request.query_params.get("since"):
            try:
                since = float(raw)
            except ValueError:
                raise ApiError(400, "invalid 'since': expected seconds since the epoch") from None
            if not math.isfinite(since):
                raise ApiError(400, "invalid 'since': expected seconds since the epoch")
        return json_response(self.history.document(since))

    async def model_endpoint(self, request: Request) -> Response:
        """What the page's detail view adds to /api/show: the model's files with their sizes
        and digests, the context it trained on and the one its runner has, and its loads."""
        name = request.query_params.get("name") or request.query_params.get("model")
        if not name:
            raise ApiError(400, "'name' is required")
        r = self.svc.resolve(name)
        models_dir = self.svc.registry.models_dir
        files = []
        named: list[tuple[str, Path]] = [
            ("model" if i == 0 else "part", p) for i, p in enumerate(split_parts(r.entry.path))
        ]
        if r.entry.projector is not None:
            named.append(("projector", r.entry.projector))
        named += [("adapter", Path(a.path)) for a in r.entry.adapters]
        for role, path in named:
            try:
                size: int | None = path.stat().st_size
            except OSError:
                size = None
            # Blobs in corral's store are named by their sha256; other files are not hashed
            # here (reading gigabytes for a page would be too slow).
            digest = path.name.replace("sha256-", "sha256:") if path.name.startswith(
                "sha256-") else None  # fmt: skip
            files.append({"role": role, "file": shown_path(request, path, models_dir),
                          "size": size, "digest": digest})  # fmt: skip
        v = self.scheduler.view()
        runners = [
            {"id": run.id, "state": run.state, "context_length": run.context_length,
             "slots": run.slots, "booked": run.size, "measured": run.measured}
            for run in v.runners if run.model == r.runner
        ]  # fmt: skip
        seen = {(m["at"], m["kind"]) for m in self.history.marks if m["model"] == r.runner}
        loads = [dict(m) for m in self.history.marks if m["model"] == r.runner]
        for ev in v.events:  # the journal's ring may hold what came before the history
            if ev.model == r.runner and ev.kind != "refused" and (ev.at, ev.kind) not in seen:
                detail = {k: x for k, x in ev.detail.items() if k != "devices"}
                loads.append({"at": ev.at, "kind": ev.kind, "model": ev.model, **detail})
        loads.sort(key=lambda m: m["at"])
        return json_response({
            "name": r.name,
            "digest": r.digest,
            "files": files,
            "context": {"trained": r.info.context_length or None,
                        "default": r.entry.options.get("num_ctx")},
            "runners": runners,
            "journal": loads[-100:],
        })  # fmt: skip

    async def books_endpoint(self, request: Request) -> Response:
        """The scheduler's budgets and what it holds for all runners at once (their shared
        code), per device: what a cluster's entry needs of a node's books besides /api/ps;
        and each device's memory as the operator reads it (total, held by corral's runners,
        by other programs, free), where corral may book the smaller of budget and headroom;
        and who waits for a slot or for room (as in the state document)."""
        v = self.scheduler.view()
        memory = {
            d.id: {**vars(device_memory(d, v.measured.get(d.id, 0))),
                   "headroom": v.headroom.get(d.id)}
            for d in v.devices if d.id in v.budgets
        }  # fmt: skip
        return json_response({"budgets": v.budgets, "reserved": v.reserved, "memory": memory,
                              "waiting": waiting(v)})  # fmt: skip

    # ---- streams ------------------------------------------------------------------------------
    async def events_endpoint(self, request: Request) -> Response:
        """The state document as server-sent events: now, every second, and right after each
        journal event (`event: state`); each journal event itself too (`event: journal`); the
        history (`event: history`): all of it first (`"full": true`), then what is new, with
        the state when there is something (so the page's charts need no polling, and the
        request log no line every few seconds); the finished requests (`event: activity`,
        newest first) and the log lines (`event: log`, oldest first): the last ones kept
        first (`"full": true`), then each as it comes, a burst in one event."""
        self.history.start()

        async def stream() -> AsyncIterator[bytes]:
            loop = asyncio.get_running_loop()
            with self._feed(loop) as q:
                yield b"retry: 2000\n\n"
                sent: float | None = None  # the history up to this time is with the client
                due = 0.0  # when the state goes next (loop time)
                first = True
                while not stopping(request, self.scheduler):
                    if loop.time() >= due:
                        state = orjson.dumps(self.state(), option=orjson.OPT_NON_STR_KEYS)
                        yield b"event: state\ndata: " + state + b"\n\n"
                        doc = self.history.document(sent)
                        if sent is None or doc["time"] or doc["marks"]:
                            # Everything later is stamped after `now` (one clock, one loop).
                            sent, doc["full"] = doc["now"], sent is None
                            yield _sse("history", doc)
                        if first:  # what is kept, after the first state
                            first = False
                            for chunk in self._kept():
                                yield chunk
                        due = loop.time() + STATE_INTERVAL
                    try:
                        item = await asyncio.wait_for(q.get(), max(0.0, due - loop.time()))
                    except asyncio.TimeoutError:
                        continue
                    items = [item]
                    await asyncio.sleep(BATCH)  # what one decision or burst sets off comes together
                    while not q.empty():
                        items.append(q.get_nowait())
                    reqs: list[Record] = []
                    lines: list[logs.Line] = []
                    for kind, x in items:
                        if kind == "journal":
                            yield _sse("journal", x.as_dict())
                            due = 0.0  # the state at once after a decision
                        elif kind == "activity":
                            reqs.append(x)
                        else:
                            lines.append(x)
                    if reqs:
                        yield _sse("activity", {"requests": [r.json() for r in reversed(reqs)]})
                    if lines:
                        yield _sse("log", {"lines": [x.json() for x in lines]})

        return RelayResponse(stream(), SSE, headers=SSE_HEADERS)

    def _kept(self) -> Iterator[bytes]:
        """The last requests and log lines, as the events stream starts with them."""
        if self.activity is not None:
            recent = itertools.islice(self.activity.find(), REQUESTS_SHOWN)
            yield _sse("activity", {"full": True, "requests": [r.json() for r in recent]})
        if self.log_ring is not None:
            kept = self.log_ring.recent(LINES_SHOWN)
            yield _sse("log", {"full": True, "lines": [x.json() for x in kept]})

    @contextlib.contextmanager
    def _feed(self, loop: asyncio.AbstractEventLoop) -> Iterator[asyncio.Queue[tuple[str, Any]]]:
        """Journal events, finished requests and log lines from now on, in one queue (what does
        not fit is dropped: listeners must not block). A line may be logged on another thread:
        it comes to the loop's."""
        q: asyncio.Queue[tuple[str, Any]] = asyncio.Queue(maxsize=FEED_MAX)
        loop_thread = threading.get_ident()

        def put(item: tuple[str, Any]) -> None:
            with contextlib.suppress(asyncio.QueueFull):
                q.put_nowait(item)

        def put_line(line: logs.Line) -> None:
            if threading.get_ident() == loop_thread:
                put(("log", line))
            else:
                with contextlib.suppress(RuntimeError):  # the loop is closed: nobody reads
                    loop.call_soon_threadsafe(put, ("log", line))

        stops: list[Callable[[], Any]] = [self.scheduler.listen(lambda e: put(("journal", e)))]
        if self.activity is not None:
            stops.append(self.activity.listen(lambda r: put(("activity", r))))
        if self.log_ring is not None:
            stops.append(self.log_ring.listen(put_line))
        try:
            yield q
        finally:
            for stop in stops:
                stop()


def _sse(event: str, data: Any) -> bytes:
    return b"event: " + event.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


def wants_html(request: Request) -> bool:
    """A browser asking for a page (not a client probing `GET /`)."""
    return "text/html" in request.headers.get("accept", "")
