"""`GET /metrics`: Prometheus metrics, written with prometheus-client.

Three sources, none of which walks anything slow at scrape time:
- the scheduler's journal (loads, unloads by reason, crashes, stalls, refusals), counted as
  the events happen;
- an ASGI middleware: requests by route and status, their latency, time to the first byte of
  a stream (per model, which the service notes in the request's scope);
- a collector that reads the scheduler's view when scraped: queue depth, requests in flight,
  bytes per device and per model, the runners' measured memory, tokens processed (the
  runners' own counters, read with each memory measure, which move when a request ends) and
  generated tokens relayed (counted by corral as they pass: live).
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from corral.api.activity import current
from corral.runtime.journal import Event
from corral.runtime.scheduler import Scheduler
from corral.runtime.view import SchedulerView

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
# Per-model histograms have fewer buckets: with 50 models their lines are most of a scrape.
_WAIT = (0.01, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
_LOAD = (0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300)


class Metrics:
    """Made before the scheduler, whose `Hooks.on_wait` is `waited`; then it `follow`s it."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "corral_requests", "HTTP requests answered", ["route", "status"], registry=r
        )
        self.latency = Histogram(
            "corral_request_duration_seconds", "Time to answer a request in full (streams: "
            "until the last byte)", ["route"], buckets=_LATENCY, registry=r,
        )  # fmt: skip
        self.ttft = Histogram(
            "corral_time_to_first_token_seconds", "Time from a streamed request's arrival to "
            "the first byte of its answer (queueing and loading included)", ["model"],
            buckets=_WAIT, registry=r,
        )  # fmt: skip
        self.queue_wait = Histogram(
            "corral_queue_wait_seconds", "Time a request waited for a runner slot (queue and "
            "load)", ["model"], buckets=_WAIT, registry=r,
        )  # fmt: skip
        self.loads = Counter("corral_loads", "Runner loads started", ["model"], registry=r)
        self.load_seconds = Histogram(
            "corral_load_duration_seconds", "Time from spawning a runner to its serving",
            ["model"], buckets=_LOAD, registry=r,
        )  # fmt: skip
        self.load_failures = Counter(
            "corral_load_failures", "Runner loads that failed", ["model"], registry=r
        )
        self.unloads = Counter(
            "corral_unloads", "Runners stopped or lost, by reason (memory, keep_alive, "
            "options_change, requested, crashed)", ["model", "reason"], registry=r,
        )  # fmt: skip
        self.crashes = Counter(
            "corral_runner_crashes", "Runners that exited without being asked to (stalled "
            "ones included)", ["model"], registry=r,
        )  # fmt: skip
        self.stalls = Counter(
            "corral_runner_stalls", "Runners killed for not answering", ["model"], registry=r
        )
        self.refused = Counter(
            "corral_requests_refused", "Requests refused at once with 503: queue full, or an "
            "expected wait longer than the queue timeout", ["model"], registry=r,
        )  # fmt: skip
        self.oom = Counter(
            "corral_out_of_memory", "Runners that ran out of memory (their model's booking "
            "was raised)", ["model"], registry=r,
        )  # fmt: skip
        self.books = _Books()
        r.register(self.books)

    def follow(self, scheduler: Scheduler) -> None:
        """Count the scheduler's decisions, and read its view at each scrape."""
        self.books.scheduler = scheduler
        scheduler.listen(self.on_event)

    def waited(self, model: str, seconds: float) -> None:
        """A request waited `seconds` for a slot of `model` (the scheduler's Hooks.on_wait)."""
        self.queue_wait.labels(model).observe(seconds)

    def on_event(self, ev: Event) -> None:
        m = ev.model
        if ev.kind == "load":
            self.loads.labels(m).inc()
        elif ev.kind == "ready":
            self.load_seconds.labels(m).observe(float(ev.detail.get("seconds", 0.0)))
        elif ev.kind == "load_failed":
            self.load_failures.labels(m).inc()
        elif ev.kind == "unload":
            self.unloads.labels(m, str(ev.detail.get("reason", "requested"))).inc()
        elif ev.kind == "crash":
            self.crashes.labels(m).inc()
            self.unloads.labels(m, "crashed").inc()
        elif ev.kind == "stall":
            self.stalls.labels(m).inc()
            self.crashes.labels(m).inc()
            self.unloads.labels(m, "crashed").inc()
        elif ev.kind == "refused":
            self.refused.labels(m).inc()
        elif ev.kind == "oom":
            self.oom.labels(m).inc()

    async def endpoint(self, request: Request) -> Response:
        # The books are read here, on the event loop that owns them (under a millisecond
        # with 50 models); the text is written in a thread (tens of milliseconds of pure
        # Python with 50 models' histograms), so requests are not held up meanwhile.
        self.books.snapshot()
        body = await asyncio.to_thread(generate_latest, self.registry)
        return Response(body, media_type=CONTENT_TYPE)


class MeasureRequests:
    """Counts and times every HTTP request; a stream's first body byte is its first token."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics
        self._literal: set[str] | None = None
        self._patterns: list[tuple[re.Pattern[str], str]] = []

    def route(self, scope: Scope) -> str:
        """The route template (bounded label values): the path for a fixed route, the
        pattern for one with parameters, "other" for anything else."""
        if self._literal is None:
            routes: list[BaseRoute] = list(getattr(scope.get("app"), "routes", []))
            self._literal = {r.path for r in routes if isinstance(r, Route) and "{" not in r.path}
            self._patterns = [
                (r.path_regex, r.path) for r in routes if isinstance(r, Route) and "{" in r.path
            ]
        path = scope.get("path", "")
        if path in self._literal:
            return str(path)
        for rx, template in self._patterns:
            if rx.match(path):
                return template
        return "other"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        entry = current()  # the request log's record of it (api/activity): status, model
        first = True

        async def watch(message: Message) -> None:
            nonlocal first
            if message["type"] == "http.response.body" and first and message.get("body"):
                first = False
                # a generation's stream (its model was granted a slot): its first bytes
                if entry and entry.streamed and entry.status == 200 and entry.granted:
                    self.metrics.ttft.labels(entry.model).observe(time.perf_counter() - start)
            await send(message)

        try:
            await self.app(scope, receive, watch)
        finally:
            route = self.route(scope)
            status = entry.status if entry and entry.status else 500
            self.metrics.requests.labels(route, str(status)).inc()
            self.metrics.latency.labels(route).observe(time.perf_counter() - start)


class _Books(Collector):
    """Gauges read from the scheduler's view at scrape time: a few dict walks, microseconds
    per model."""

    def __init__(self) -> None:
        self.scheduler: Scheduler | None = None
        self._families: list[Metric] = []

    def snapshot(self) -> None:
        if self.scheduler is not None:
            self._families = list(self._read(self.scheduler.view()))

    def collect(self) -> Iterator[Metric]:
        yield from self._families

    def _read(self, v: SchedulerView) -> Iterator[Metric]:
        queued = GaugeMetricFamily(
            "corral_queue_depth", "Requests waiting for a runner slot", labels=["model"]
        )
        for m, n in sorted(v.queued.items()):
            queued.add_metric([m], n)
        yield queued
        inflight = GaugeMetricFamily(
            "corral_requests_in_flight", "Requests a runner is serving", labels=["model"]
        )
        room = GaugeMetricFamily(
            "corral_requests_waiting_for_room", "Granted requests waiting for room in their "
            "runner's shared KV cache (counted in flight too)", labels=["model"],
        )  # fmt: skip
        booked = GaugeMetricFamily(
            "corral_model_booked_bytes", "Bytes booked for a model's runner, per device",
            labels=["model", "device"],
        )  # fmt: skip
        resident = GaugeMetricFamily(
            "corral_model_resident_bytes", "System memory a model's runner really holds "
            "(proportional set size, last measure)", labels=["model"],
        )  # fmt: skip
        loaded = GaugeMetricFamily(
            "corral_models_loaded", "Runners by state", labels=["state"]
        )
        states = {"loading": 0, "ready": 0, "unloading": 0}
        for r in v.runners:
            states[r.state] = states.get(r.state, 0) + 1
            inflight.add_metric([r.model], r.inflight)
            room.add_metric([r.model], r.waiting_for_room)
            for dev, n in r.devices.items():
                booked.add_metric([r.model, dev], n)
            if r.measured is not None:
                resident.add_metric([r.model], r.measured)
        for state, n in states.items():
            loaded.add_metric([state], n)
        yield inflight
        yield room
        yield booked
        yield resident
        yield loaded
        budget = GaugeMetricFamily(
            "corral_device_budget_bytes", "Bytes corral's runners may book on a device",
            labels=["device"],
        )  # fmt: skip
        used = GaugeMetricFamily(
            "corral_device_booked_bytes", "Bytes booked by corral's runners on a device "
            "(the reserved bytes included)", labels=["device"],
        )  # fmt: skip
        reserved = GaugeMetricFamily(
            "corral_device_reserved_bytes", "Bytes booked on a device for all runners at once "
            "(the code every runner maps, resident once)", labels=["device"],
        )  # fmt: skip
        real = GaugeMetricFamily(
            "corral_device_used_bytes", "Bytes in use on a device as the OS or driver reports "
            "it (all processes; last measure)", labels=["device"],
        )  # fmt: skip
        for dev, n in v.budgets.items():
            budget.add_metric([dev], n)
        for dev, n in v.booked.items():
            used.add_metric([dev], n)
            reserved.add_metric([dev], v.reserved.get(dev, 0))
        for d in v.devices:
            real.add_metric([d.id], d.total - d.free)
        yield budget
        yield used
        yield reserved
        yield real
        prompt = CounterMetricFamily(
            "corral_prompt_tokens", "Prompt tokens the runners processed", labels=["model"]
        )
        generated = CounterMetricFamily(
            "corral_generated_tokens", "Tokens the runners generated", labels=["model"]
        )
        for m, (p, g) in sorted(v.tokens.items()):
            prompt.add_metric([m], p)
            generated.add_metric([m], g)
        yield prompt
        yield generated
        drafted = CounterMetricFamily(
            "corral_draft_tokens", "Tokens speculative decoding drafted (models that drafted)",
            labels=["model"],
        )  # fmt: skip
        accepted = CounterMetricFamily(
            "corral_draft_accepted_tokens", "Drafted tokens the model accepted", labels=["model"]
        )
        for m, (n, ok) in sorted(v.drafts.items()):
            drafted.add_metric([m], n)
            accepted.add_metric([m], ok)
        yield drafted
        yield accepted
        drafting = GaugeMetricFamily(
            "corral_drafting", "1 while speculative = auto drafts for the model, 0 while it "
            "turned drafting off (it did not pay, or a client asked for logprobs)",
            labels=["model"],
        )  # fmt: skip
        stream = GaugeMetricFamily(
            "corral_drafting_stream_tokens_per_second", "A stream's generated tokens/s over "
            "auto's last judged window: measured with drafting; without, measured where the "
            "model generated enough without drafts at the same load and context (or at one that "
            "decides: core/drafting.compared), else estimated",
            labels=["model", "drafting"],
        )  # fmt: skip
        for m, c in sorted(v.drafting.items()):
            drafting.add_metric([m], 1.0 if c.on else 0.0)
            if c.last is not None:
                stream.add_metric([m, "with"], c.last.with_tps)
                stream.add_metric([m, "without"], c.last.without_tps)
        yield drafting
        yield stream
        relayed = CounterMetricFamily(
            "corral_relayed_tokens", "Generated tokens corral relayed to clients, counted as "
            "they passed (rate() of it is the live tokens per second)", labels=["model"],
        )  # fmt: skip
        for m, n in sorted(v.relayed.items()):
            relayed.add_metric([m], n)
        yield relayed
