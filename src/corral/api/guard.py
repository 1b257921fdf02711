"""The guard in front of every route, and the connections under it.

`Guard` (ASGI middleware, the outermost): where a request may come from (a `Host` that is not a
loopback name while corral listens on loopback is DNS rebinding; an `Origin` that is neither
loopback, nor corral's own page, nor listed in CORRAL_ORIGINS is another web site driving the
visitor's browser: both 403), CORS headers and preflights for the allowed origins, who may call
(CORRAL_API_KEY: `Authorization: Bearer KEY` or `x-api-key: KEY`, else 401 in the route's own
error shape), how much a body may hold (Content-Length over the limit refused before reading,
a chunked body cut off when it passes it, a cap on the body bytes being received across all
clients, a body that stops arriving timed out) and whether corral still takes requests (503
with Retry-After while it drains for shutdown).

`guarded_protocol`: uvicorn's HTTP protocol with what uvicorn lacks: a connection must send its
request's headers within the read timeout (idle connections and slowloris are closed), headers
are capped in size, and past the connection cap the oldest connection with no request in
progress makes room for a new one (or, when every connection is serving, the new one gets 503).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import ipaddress
import logging
import math
import re
import resource
import time
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import urlsplit

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from corral.api.common import MAX_BODY
from corral.api.family import OLLAMA
from corral.api.paths import AUTHORIZED
from corral.errors import ApiError

log = logging.getLogger("corral")

# Routes open without a key: liveness probes and clients' "is it running?" checks, and the
# dashboard's static files (no data: the page asks for the key before it reads any).
PUBLIC = frozenset({
    ("GET", "/"), ("HEAD", "/"), ("GET", "/api/version"), ("HEAD", "/api/version"),
    ("GET", "/health"), ("HEAD", "/health"),
    ("GET", "/ui"), ("GET", "/ui/"), ("GET", "/ui/app.js"), ("GET", "/ui/style.css"),
})  # fmt: skip
# Ollama's default origins besides loopback: desktop apps and editor web views.
DEFAULT_ORIGINS = ("app://*", "file://*", "tauri://*", "vscode-webview://*", "vscode-file://*")
CORS_METHODS = "GET, POST, PUT, PATCH, DELETE, HEAD, OPTIONS"
CORS_HEADERS = (
    "Authorization, Content-Type, Accept, User-Agent, X-Requested-With, x-api-key, "
    "anthropic-version, anthropic-beta, anthropic-dangerous-direct-browser-access, "
    "OpenAI-Beta, OpenAI-Organization, OpenAI-Project, x-stainless-arch, x-stainless-async, "
    "x-stainless-lang, x-stainless-os, x-stainless-package-version, x-stainless-retry-count, "
    "x-stainless-runtime, x-stainless-runtime-version, x-stainless-timeout"
)
_TOKEN = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")  # an HTTP header name

# Body bytes being received at once, across all clients. One body may always grow to MAX_BODY
# while no other is being received; beyond this, the request that would pass it gets 503.
BODY_BYTES_IN_FLIGHT = 64 * 2**20
# After the read timeout a body must keep arriving at this rate on average (bytes/s).
MIN_BODY_RATE = 16 * 2**10
MAX_HEADER_BYTES = 64 * 2**10  # a request's line and headers; beyond it, 431
FD_RESERVE = 256  # descriptors kept for runners, their pipes and sockets, model files, logs
MISSING_KEY = "missing API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'"
DRAIN_RETRY_AFTER = 5.0  # seconds a client is told to wait while corral drains for shutdown


# ---- names and addresses -----------------------------------------------------------------
def loopback_name(name: str) -> bool:
    """localhost, *.localhost, 127.x, ::1 (and 0.0.0.0 / ::, which reach this machine)."""
    name = name.strip().rstrip(".").lower().strip("[]")
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        ip = ipaddress.ip_address(name)
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or ip.is_unspecified or bool(mapped and mapped.is_loopback)


def loopback_bind(host: str) -> bool:
    """Whether listening on `host` serves this machine only."""
    name = host.strip().strip("[]").lower()
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def _split_host(value: str) -> tuple[str, int | None] | None:
    """(name, port) of a Host header or an origin's authority; None if malformed."""
    try:
        parts = urlsplit("//" + value)
        return (parts.hostname or "", parts.port)
    except ValueError:
        return None


def host_allowed(host: str) -> bool:
    if host.count(":") > 1 and "[" not in host:  # a bare IPv6 address
        return loopback_name(host)
    split = _split_host(host)
    return split is not None and loopback_name(split[0])


def origin_pattern(text: str) -> re.Pattern[str]:
    """CORRAL_ORIGINS entries: exact origins, `*` matching anything (as Ollama's)."""
    text = text.strip().rstrip("/")
    return re.compile("^" + ".*".join(re.escape(p) for p in text.split("*")) + "$", re.I)


def loopback_origin(origin: str) -> bool:
    try:
        parts = urlsplit(origin)
        port = parts.port  # ValueError when it is not a number
    except ValueError:
        return False
    del port
    return parts.scheme in ("http", "https") and loopback_name(parts.hostname or "")


def same_origin(origin: str, host: str) -> bool:
    """A page corral served itself (its dashboard) calling back to the address it came from."""
    try:
        parts = urlsplit(origin)
        port = parts.port
    except ValueError:
        return False
    default = {"http": 80, "https": 443}.get(parts.scheme)
    mine = _split_host(host)
    if default is None or mine is None or not parts.hostname:
        return False
    return (parts.hostname, port or default) == (mine[0], mine[1] or default)


# ---- the ASGI guard ------------------------------------------------------------------------
class Gate:
    """What the guard and the shutdown share: whether new requests are refused (draining) and
    how many are in flight."""

    def __init__(self) -> None:
        self.draining = False
        self.in_flight = 0

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no request is in flight; False if `timeout` passed first."""
        deadline = time.monotonic() + timeout
        while self.in_flight > 0:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.05)
        return True


class Guard:
    def __init__(
        self,
        app: ASGIApp,
        *,
        render: Callable[[Request, ApiError], Response],
        gate: Gate,
        keys: Iterable[str] = (),
        origins: Iterable[str] = (),
        check_host: bool = True,
        read_timeout: float = 10.0,
        max_body: int = MAX_BODY,
        max_in_flight: int = BODY_BYTES_IN_FLIGHT,
        min_rate: float = MIN_BODY_RATE,
    ) -> None:
        self.app = app
        self.render = render
        self.gate = gate
        self.keys = [hashlib.sha256(k.encode()).digest() for k in keys if k]
        self.origins = [origin_pattern(o) for o in (*DEFAULT_ORIGINS, *origins) if o.strip()]
        self.check_host = check_host
        self.read_timeout = read_timeout
        self.max_body = max_body
        self.max_in_flight = max_in_flight
        self.min_rate = min_rate
        self.receiving = 0  # body bytes received by requests whose body is not complete yet

    def origin_allowed(self, origin: str, host: str) -> bool:
        if loopback_origin(origin) or same_origin(origin, host):
            return True
        return any(p.match(origin.rstrip("/")) for p in self.origins)

    def authorized(self, request: Request) -> bool:
        """Whether the request carries a key; every key is compared, in constant time."""
        given: list[str] = []
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            given.append(token.strip())
        if request.headers.get("x-api-key"):
            given.append(request.headers["x-api-key"].strip())
        ok = False
        for g in given:
            digest = hashlib.sha256(g.encode()).digest()
            for k in self.keys:
                ok |= hmac.compare_digest(digest, k)
        return ok

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        headers = request.headers
        host = headers.get("host", "")
        origin = headers.get("origin")
        method = scope["method"]

        async def refuse(err: ApiError, extra: dict[str, str] | None = None) -> None:
            response = self.render(request, err)
            response.headers.update(extra or {})
            if origin is not None and self.origin_allowed(origin, host):
                response.headers.update(self._cors(origin))
            # Whatever body the client meant to send is not read: end the connection.
            response.headers["connection"] = "close"
            await response(scope, receive, send)

        if self.check_host and host and not host_allowed(host):
            await refuse(ApiError(403, f"forbidden: host {host!r} is not a loopback name; corral "
                                  "listens on loopback and answers only requests addressed to "
                                  "localhost (DNS rebinding)"))  # fmt: skip
            return
        if origin is not None and not self.origin_allowed(origin, host):
            await refuse(ApiError(403, f"forbidden: origin {origin!r} is not allowed "
                                  "(add it to CORRAL_ORIGINS)"))  # fmt: skip
            return
        preflight = method == "OPTIONS" and "access-control-request-method" in headers
        if origin is not None and preflight:
            await self._preflight(request, origin)(scope, receive, send)
            return
        if self.gate.draining:
            await refuse(ApiError(503, "server is shutting down", retry_after=DRAIN_RETRY_AFTER))
            return
        if self.keys:
            scope[AUTHORIZED] = ok = self.authorized(request)
            if not ok and (method, scope["path"]) not in PUBLIC:
                given = "authorization" in headers or "x-api-key" in headers
                msg = "invalid API key" if given else MISSING_KEY
                await refuse(ApiError(401, msg), {"www-authenticate": "Bearer"})
                return
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_body:
            await refuse(self._too_large())
            return
        self.gate.in_flight += 1
        try:
            await self._serve(scope, receive, send, origin)
        finally:
            self.gate.in_flight -= 1

    def _too_large(self) -> ApiError:
        return ApiError(413, f"request body too large (limit {self.max_body // 2**20} MiB)")

    def _cors(self, origin: str) -> dict[str, str]:
        return {"access-control-allow-origin": origin, "vary": "Origin",
                "access-control-expose-headers": "Retry-After"}  # fmt: skip

    def _preflight(self, request: Request, origin: str) -> Response:
        asked = [
            h.strip()
            for h in request.headers.get("access-control-request-headers", "").split(",")
            if _TOKEN.match(h.strip())
        ]
        allow = CORS_HEADERS + "".join(
            f", {h}" for h in asked if h.lower() not in CORS_HEADERS.lower().split(", ")
        )
        return Response(status_code=204, headers={
            **self._cors(origin), "access-control-allow-methods": CORS_METHODS,
            "access-control-allow-headers": allow, "access-control-max-age": "600",
        })  # fmt: skip

    async def _serve(self, scope: Scope, receive: Receive, send: Send, origin: str | None) -> None:
        start = time.monotonic()
        got = 0  # this request's body bytes so far
        held = 0  # of them, counted in self.receiving
        done = False
        close = False

        def release() -> None:
            nonlocal held
            self.receiving -= held
            held = 0

        def cut(err: ApiError) -> ApiError:
            nonlocal done, close
            release()
            done = close = True
            return err

        async def guarded_receive() -> Message:
            nonlocal got, held, done
            if done:  # the body is in: the app now only listens for a disconnect
                return await receive()
            left = start + self.read_timeout + got / self.min_rate - time.monotonic()
            try:
                message = await asyncio.wait_for(receive(), max(left, 0.001))
            except asyncio.TimeoutError:
                raise cut(ApiError(408, "request body arrived too slowly")) from None
            if message["type"] == "http.disconnect":
                release()
                done = True
                raise ApiError(499, "client disconnected")
            n = len(message.get("body", b""))
            got += n
            if got > self.max_body:
                raise cut(self._too_large())
            if self.receiving + n > self.max_in_flight and self.receiving > held:
                raise cut(ApiError(503, "server busy receiving other request bodies",
                                   retry_after=1))  # fmt: skip
            self.receiving += n
            held += n
            if not message.get("more_body", False):
                release()
                done = True
            return message

        async def guarded_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                extra: list[tuple[bytes, bytes]] = []
                if origin is not None:
                    extra += [(k.encode(), v.encode()) for k, v in self._cors(origin).items()]
                if close or self.gate.draining:
                    extra.append((b"connection", b"close"))
                if extra:
                    message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        try:
            await self.app(scope, guarded_receive, guarded_send)
        finally:
            release()


# ---- connections ---------------------------------------------------------------------------
def raise_open_files_limit() -> int:
    """Raise the soft limit on open files to the hard one; the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    for want in (hard, 1 << 20, 10240):  # infinite hard limits are refused on some systems
        if want == resource.RLIM_INFINITY or want <= soft:
            continue
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            return want
        except (ValueError, OSError):
            continue
    return soft


def connection_cap(wanted: int, open_files: int) -> int:
    """At most `wanted` connections, leaving FD_RESERVE descriptors for everything else."""
    if open_files == resource.RLIM_INFINITY:
        return wanted
    return max(16, min(wanted, open_files - FD_RESERVE))


# Written before a request is read, so with no route to name a family: the default's shape.
_BUSY = orjson.dumps(OLLAMA.body(ApiError(503, "server busy: too many connections")))
_BUSY_RESPONSE = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
    b"retry-after: 1\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(_BUSY), _BUSY)
)
_TOO_LARGE_RESPONSE = (
    b"HTTP/1.1 431 Request Header Fields Too Large\r\nconnection: close\r\n"
    b"content-length: 0\r\n\r\n"
)


def guarded_protocol(
    base: type[asyncio.Protocol],
    read_timeout: float,
    max_connections: int,
    idle_timeout: float | None = None,
) -> type[asyncio.Protocol]:
    """A subclass of uvicorn's HTTP protocol (`base`: httptools' or h11's) that times out
    connections waiting for a request's headers, caps header bytes and connections.

    A new connection must send its first request's headers within `read_timeout`; a kept-alive
    one may wait `idle_timeout` (default: the same) for its next request, whose headers are
    then due within `read_timeout` of its first byte.

    It reads only what both of uvicorn's protocols have: `cycle` (the current request, with
    `response_complete`), `connections` (the server's set), `transport`, `loop`, and the
    hooks `data_received` / `on_response_complete` / `connection_lost`."""
    # Connections with no request in progress, oldest first: the ones that make room.
    waiting: dict[Any, None] = {}
    warned = [-math.inf]  # when a refused connection was last logged (once a minute at most)
    idle = read_timeout if idle_timeout is None else idle_timeout

    class Guarded(base):  # type: ignore[valid-type, misc]
        _g_since: float
        _g_bytes: int
        _g_timer: asyncio.TimerHandle | None
        _g_allow: float  # seconds from _g_since, until the next request's first byte

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(transport)
            self._g_timer = None
            self._g_wait(read_timeout)
            if len(self.connections) > max_connections and not self._g_make_room():
                if self.loop.time() - warned[0] > 60:
                    warned[0] = self.loop.time()
                    log.warning(
                        "refusing new connections with 503: all %d are serving requests "
                        "(CORRAL_MAX_CONNECTIONS)",
                        max_connections,
                    )
                self.transport.write(_BUSY_RESPONSE)
                self.transport.close()

        def data_received(self, data: bytes) -> None:
            if not self._g_busy():
                if self._g_bytes == 0 and data:  # a request starts: its headers are due
                    self._g_since, self._g_allow = self.loop.time(), read_timeout
                self._g_bytes += len(data)
            super().data_received(data)
            if self._g_busy():  # its headers are in: the request is the app's now
                waiting.pop(self, None)
            elif self._g_bytes > MAX_HEADER_BYTES and not self.transport.is_closing():
                self.transport.write(_TOO_LARGE_RESPONSE)
                self.transport.close()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self._g_busy() and not self.transport.is_closing():
                self._g_wait(idle)

        def connection_lost(self, exc: Exception | None) -> None:
            waiting.pop(self, None)
            if self._g_timer is not None:
                self._g_timer.cancel()
                self._g_timer = None
            super().connection_lost(exc)

        def _g_busy(self) -> bool:
            c = self.cycle
            return c is not None and not c.response_complete

        def _g_wait(self, allow: float) -> None:
            """Start waiting for the next request: it must start within `allow` seconds."""
            self._g_since, self._g_allow = self.loop.time(), allow
            self._g_bytes = 0
            waiting.pop(self, None)
            waiting[self] = None
            first = min(allow, read_timeout)
            if self._g_timer is None and math.isfinite(first):
                self._g_timer = self.loop.call_later(first, self._g_check)

        def _g_check(self) -> None:
            self._g_timer = None
            if self.transport.is_closing() or self._g_busy():
                return  # re-armed when the response completes
            left = self._g_since + self._g_allow - self.loop.time()
            if left > 0:
                self._g_timer = self.loop.call_later(left, self._g_check)
                return
            log.debug("closing a connection that sent no complete request in %gs", self._g_allow)
            waiting.pop(self, None)
            self.transport.close()

        def _g_make_room(self) -> bool:
            for conn in waiting:
                if conn is not self:
                    waiting.pop(conn)
                    conn.transport.close()
                    return True
            return False

    Guarded.__name__ = Guarded.__qualname__ = f"Guarded{base.__name__}"
    return Guarded
