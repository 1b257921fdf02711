"""The HTTP server: one Starlette app with every API family's routes; each error takes the shape of
the family of the route it came from (api/family.py)."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import functools
import logging
import math
import signal
import socket
from collections.abc import AsyncIterator, Mapping
from types import FrameType

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.auto import AutoHTTPProtocol

import corral
from corral import logs
from corral.api.activity import Activity, RequestLog, note_error
from corral.api.common import json_response
from corral.api.dashboard import Dashboard, wants_html
from corral.api.families.anthropic.routes import Anthropic
from corral.api.families.llamacpp.routes import Native
from corral.api.families.ollama.routes import Ollama
from corral.api.families.openai.routes import OpenAI
from corral.api.families.responses.routes import Responses
from corral.api.family import OLLAMA, Families, FamilyRoute
from corral.api.guard import (
    Gate,
    Guard,
    connection_cap,
    guarded_protocol,
    loopback_bind,
    raise_open_files_limit,
)
from corral.api.manage import Manage
from corral.api.metrics import MeasureRequests, Metrics
from corral.api.rerank import Rerank
from corral.api.router import Router
from corral.api.service import Service
from corral.config import ConfigError, Settings
from corral.core.devices import Device, budgets, device_memory
from corral.errors import ApiError
from corral.runtime.devices import cpu_cores, discover, refresh
from corral.runtime.hop import RunnerClient
from corral.runtime.kvcache import KVCache
from corral.runtime.registry import BUILTIN_NAME, Registry
from corral.runtime.response_store import ResponseStore, journal_path
from corral.runtime.runner import Runner
from corral.runtime.runner_build import installed_runner
from corral.runtime.runner_devices import choose_runner
from corral.runtime.scheduler import Hooks, Scheduler, SchedulerConfig

log = logging.getLogger("corral")


# GET / answers as Ollama does, and says which server this is in a header.
ROOT_HEADERS = {"x-corral-version": corral.__version__}


class Unhandled:
    """The last line of defence: an exception no handler expected becomes a 500 in the
    family's shape and the connection stays open for the client's next request. (Starlette's
    handler for Exception answers and then re-raises, and uvicorn then closes the keep-alive
    connection under the client.)"""

    def __init__(self, app: ASGIApp, families: Families | None = None) -> None:
        self.app = app
        self.families = families or Families()  # by default, by the paths' namespaces

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def watch(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except Exception as exc:
            if started:  # a response half sent: only closing the connection can say so
                raise
            request = Request(scope)
            log.exception("unexpected error on %s %s", request.method, request.url.path)
            err = ApiError(500, f"internal error: {type(exc).__name__}")
            await self.families.response(request, err)(scope, receive, send)


def kv_cache(settings: Settings) -> KVCache | None:
    """Conversations' KV caches saved before runners stop and restored after a reload
    (runtime.kvcache); None when CORRAL_KV_CACHE_SIZE is 0 or the directory is unusable."""
    if settings.kv_cache_size <= 0:
        return None
    try:
        return KVCache(settings.kv_cache_dir, settings.kv_cache_size, settings.kv_park_after)
    except OSError as e:
        log.warning("conversations' KV caches will not be saved: %s", e)
        return None


def create_app(settings: Settings, devices: list[Device] | None = None) -> Starlette:
    """The app; `devices` defaults to what this machine has (tests may pass a fake set)."""
    devices = discover() if devices is None else devices
    # The runner build, and only the GPUs it can use (a CPU build never books a GPU).
    installed = functools.partial(installed_runner, root=settings.runners_dir)
    chosen = choose_runner(settings.llama_server, devices, installed, cores=cpu_cores())
    devices = chosen.devices
    registry = Registry(settings.models_dir, builtin=settings.builtin_models)
    if pruned := registry.store.prune():
        log.info("removed %d file(s) no model uses from %s", len(pruned), registry.store.root)
    cache = kv_cache(settings)
    metrics = Metrics()
    scheduler = Scheduler(
        budgets(devices, settings.memory_margin, settings.memory_limit),
        SchedulerConfig.of(settings),
        devices=devices,
        refresh=refresh,
        # runners save and restore slots in the KV cache's directory
        runners=functools.partial(
            Runner,
            llama_server=chosen.llama_server,
            slot_save_path=cache.slot_save_path if cache else None,
        ),
        hooks=Hooks(before_stop=cache.before_stop if cache else None, on_wait=metrics.waited),
    )
    metrics.follow(scheduler)
    # runners are called with the KV cache of saved conversations at hand
    service = Service(settings, registry, scheduler, devices, RunnerClient(cache))
    service.advice = chosen.advice
    gate = Gate()  # shared by the guard and the graceful shutdown
    atexit.register(scheduler.kill_all)  # last resort if the loop dies without a clean stop

    async def api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        if exc.status == 499:  # the client is gone; nobody reads this but the log
            note_error(exc)
            return Response(status_code=499)
        return families.response(request, exc)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        msg = "not found" if exc.status_code == 404 else str(exc.detail)
        return families.response(request, ApiError(exc.status_code, msg))

    async def root(request: Request) -> Response:
        if request.method == "GET" and wants_html(request):  # a browser: the dashboard
            return RedirectResponse("/ui", status_code=302)
        # Some clients compare the body with Ollama's; corral's name goes in a header.
        return Response("Ollama is running", media_type="text/plain", headers=ROOT_HEADERS)

    async def health(request: Request) -> Response:
        return json_response({"status": "ok"})

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        view = scheduler.view()
        log.info("corral %s serving models from %s", corral.__version__, settings.models_dir)
        for d in view.devices:
            if d.id in view.budgets:  # what a load may book there is the smaller of the two
                log.info(
                    "%s (%s): %s; corral may book %.1f GiB", d.id, d.name,
                    device_memory(d, view.measured.get(d.id, 0)).describe(),
                    min(view.budgets[d.id], view.headroom.get(d.id, view.budgets[d.id])) / 2**30,
                )  # fmt: skip
        log.info("runner: %s", chosen.llama_server or "llama.cpp through xllamacpp")
        for line in service.advice:
            log.warning("%s", line)
        log.info("%s; dashboard at %s", models_found(registry), dashboard_url(settings))
        yield
        dashboard.close()  # the history's sampler
        await scheduler.shutdown()

    manage = Manage(service)
    activity = Activity()  # the last requests, for the dashboard's activity view
    dashboard = Dashboard(service, activity)  # its events stream pushes them and the log lines
    routes = [
        FamilyRoute(OLLAMA, "/", root, ["GET", "HEAD"]),
        FamilyRoute(OLLAMA, "/health", health, ["GET"]),
        FamilyRoute(OLLAMA, "/metrics", metrics.endpoint, ["GET"]),
        FamilyRoute(OLLAMA, "/api/corral/activity", activity.endpoint, ["GET"]),
        *Ollama(service).routes(),
        *OpenAI(service).routes(),
        *Anthropic(service).routes(),
        *Responses(service, ResponseStore(journal_path(settings.models_dir))).routes(),
        *Rerank(service).routes(),
        *Router(service, manage).routes(),
        *Native(service).routes(),
        *manage.routes(),
        *dashboard.routes(),
    ]
    families = Families(routes)
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={ApiError: api_error, HTTPException: http_error},
        middleware=[
            Middleware(RequestLog, activity=activity),  # outermost: it sees every request
            Middleware(MeasureRequests, metrics=metrics),
            Middleware(
                Guard,
                render=families.response,
                gate=gate,
                keys=settings.api_keys,
                origins=settings.origins,
                check_host=loopback_bind(settings.host),
                read_timeout=settings.read_timeout,
            ),
            Middleware(Unhandled, families=families),
        ],
    )
    app.state.service = service
    app.state.scheduler = scheduler
    app.state.gate = gate
    app.state.activity = activity
    app.state.dashboard = dashboard
    return app


class _Server(uvicorn.Server):
    """uvicorn's server with a graceful stop. The first SIGTERM drains: new requests, and those
    still waiting for a slot or a load (which is abandoned), get 503 with Retry-After while those
    generating finish, for up to the shutdown grace; then the
    scheduler stops every runner (streams still open end with "server is shutting down") and
    uvicorn exits. SIGINT (Ctrl-C), a second SIGTERM, or a grace of 0 stop at once: waiting
    requests get 503, loading runners die and streams end with an error, so the connections
    uvicorn then waits for close at once instead of after its graceful timeout."""

    def __init__(
        self, config: uvicorn.Config, scheduler: Scheduler, gate: Gate, grace: float
    ) -> None:
        super().__init__(config)
        self.scheduler = scheduler
        self.gate = gate
        self.grace = grace
        self.loop: asyncio.AbstractEventLoop | None = None
        self._drain: asyncio.Task[None] | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        loop = self.loop
        if loop is None or loop.is_closed():
            super().handle_exit(sig, frame)
            return
        if sig == signal.SIGTERM and self.grace > 0 and not self.gate.draining:
            self.gate.draining = True  # from now on the guard answers 503
            loop.call_soon_threadsafe(self._start_drain, sig)
            return
        super().handle_exit(sig, frame)
        loop.call_soon_threadsafe(self.scheduler.begin_shutdown)

    def _start_drain(self, sig: int) -> None:
        # Requests still waiting for a slot (a model loading, a full runner) get 503 now and
        # loads under way are abandoned: only those already generating keep the grace.
        self.scheduler.begin_drain()
        log.info(
            "stopping: no new requests; %d in flight may take up to %gs to finish",
            self.gate.in_flight,
            self.grace,
        )
        self._drain = asyncio.ensure_future(self._drained(sig))

    async def _drained(self, sig: int) -> None:
        if not await self.gate.wait_idle(self.grace):
            log.warning(
                "shutdown grace of %gs is over: ending %d requests still in flight",
                self.grace,
                self.gate.in_flight,
            )
        if not self.should_exit:
            self.scheduler.begin_shutdown()
            super().handle_exit(sig, None)


def serve(overrides: Mapping[str, str] | None = None) -> None:
    """`corral serve`: run until interrupted; every runner is stopped on the way out."""
    try:
        settings = Settings.load(overrides)
    except ConfigError as e:
        raise SystemExit(f"Error: {e}") from None
    logs.setup(settings.log_level, settings.log_format)
    settings.models_dir.mkdir(parents=True, exist_ok=True)
    app = create_app(settings)
    if not settings.api_keys and not loopback_bind(settings.host):
        log.warning(
            "listening on %s without an API key: anyone who can reach this address can use, "
            "load and unload every model; set CORRAL_API_KEY",
            settings.host,
        )
    # Every connection holds a descriptor: the soft limit (often 1024) goes up to the hard one,
    # and connections are capped below it so runners and files always get theirs.
    open_files = raise_open_files_limit()
    max_connections = connection_cap(settings.max_connections, open_files)
    if max_connections < settings.max_connections:
        log.info("at most %d connections (open files limit %d)", max_connections, open_files)
    config = uvicorn.Config(
        app, host=settings.host, port=settings.port, log_level=settings.log_level,
        # corral.request logs every request (api/activity.py): uvicorn's own line would repeat it
        access_log=False, timeout_graceful_shutdown=5,
        # httptools' protocol (h11's without it) with timeouts for headers and a connection cap
        http=guarded_protocol(
            AutoHTTPProtocol, settings.read_timeout, max_connections, settings.idle_timeout
        ),
        ws="none", timeout_keep_alive=math.ceil(settings.idle_timeout),
        # JSON logs: uvicorn's loggers go through the root handler too, not its own format
        log_config=None if settings.log_format == "json" else uvicorn.config.LOGGING_CONFIG,
    )  # fmt: skip
    logs.keep_lines_of(logging.getLogger("uvicorn"))  # its own log config: the pane shows it too
    with contextlib.suppress(KeyboardInterrupt):
        # picks uvloop when installed
        server = _Server(config, app.state.scheduler, app.state.gate, settings.shutdown_grace)
        server.run()


def models_found(registry: Registry) -> str:
    """What a newcomer wants to know at start-up: how many models, and the built-in one."""
    names = [e.name for e in registry.all()]
    found = f"{len(names)} model{'s' if len(names) != 1 else ''} found"
    if BUILTIN_NAME in names:
        return f"{found}, among them the built-in {BUILTIN_NAME} (try: corral run {BUILTIN_NAME})"
    return found


def dashboard_url(settings: Settings) -> str:
    host = settings.host if settings.host not in ("0.0.0.0", "::", "") else "127.0.0.1"
    host = f"[{host}]" if ":" in host else host
    return f"http://{host}:{settings.port}/ui"
