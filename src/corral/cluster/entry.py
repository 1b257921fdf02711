"""Cluster mode's entry process: one HTTP endpoint for every node of a Ray cluster.

`corral serve --ray auto` (or CORRAL_RAY_ADDRESS) connects to Ray as a driver and keeps a view
of every alive node, its agent and its books (cluster/membership.py).

The data path does not touch Ray: a request's `model` (from its JSON body, or its path) goes to
`placement.choose`, and the request is forwarded over HTTP to the chosen node's corral, its
response relayed as it comes (cluster/relay.py: a keep-alive connection pool per node). If that
node is lost while the response streams (its agent or raylet dies, or its agent stops answering
for LOST_AFTER seconds), the client gets an error naming the node in its API's shape (the
family of the path, api/family.py), and the node's models leave the books, so the next request
loads elsewhere.

`/api/tags`, `/v1/models` and the router's `/models` are the union of the nodes' lists;
`/api/ps` lists every node's runners, each with its `node`; `/metrics` is every node's metrics
with a `node` label; `/api/cluster` shows the entry's view of the nodes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import aiohttp
import orjson
from starlette.requests import Request
from starlette.types import Message, Receive, Scope, Send

import corral
from corral.api.families.llamacpp.routes import NATIVE_PATHS
from corral.api.families.ollama import routes as ollama
from corral.api.family import LLAMACPP, NDJSON, OLLAMA, OPENAI, SSE, Families
from corral.cluster.membership import Cluster, Node, Relay, Usage
from corral.cluster.placement import Choice
from corral.cluster.relay import Broken, Unreachable, exchange
from corral.config import Settings
from corral.errors import ApiError

log = logging.getLogger("corral.cluster")

WATCH_AFTER = 0.02  # seconds into a relayed request before its client's disconnect is watched

# Hop-by-hop headers, and those the entry's own server writes.
_DROP_RESPONSE = {
    b"connection", b"keep-alive", b"transfer-encoding", b"te", b"trailer", b"upgrade",
    b"proxy-authenticate", b"date", b"server",
}  # fmt: skip
_DROP_REQUEST = {
    "host", "connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade",
    "content-length", "expect", "proxy-authorization",
    "origin",  # the entry's guard checked it (and answers CORS); the nodes' lists may differ
}  # fmt: skip
_DROP_REQUEST_B = {k.encode() for k in _DROP_REQUEST}
# Requests that only read about a model: sent to a node that has it, no load expected.
_LOOKUP_PATHS = ("/api/show", "/v1/messages/count_tokens")
# Model management: on the node a client names (header X-Corral-Node), else the entry's own.
_HOME_PATHS = ("/api/pull", "/api/create", "/api/blobs/", "/api/push")


# ---- the HTTP side ---------------------------------------------------------------------------
# The entry has no routes: a path's family is the one whose namespace holds it, llama.cpp's
# server API told apart by its paths.
FAMILIES = Families(paths=dict.fromkeys(NATIVE_PATHS, LLAMACPP))


def error_tail(path: str, content_type: str, message: str, last: bytes) -> bytes | None:
    """The end of a stream cut short, in its API's shape (None: not a stream)."""
    ct = content_type.split(";")[0].strip().lower()
    if ct == NDJSON:
        sep = b"" if not last or last.endswith(b"\n") else b"\n"
    elif ct == SSE:
        sep = (b"" if not last or last.endswith(b"\n\n")
               else (b"\n" if last.endswith(b"\n") else b"\n\n"))  # fmt: skip
    else:
        return None
    family = FAMILIES.at(path)
    if family.media_type != ct:  # corral's own event streams (the dashboard's, the router's)
        family = OLLAMA if ct == NDJSON else OPENAI
    return sep + family.event(ApiError(500, message))


class Entry:
    """The entry's ASGI app: a few routes answered from every node, the rest forwarded."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        try:
            await self._http(scope, receive, send)
        except ApiError as e:
            await self._error(scope, receive, send, e)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await self.cluster.start()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.cluster.stop()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _error(self, scope: Scope, receive: Receive, send: Send, e: ApiError) -> None:
        await FAMILIES.response(Request(scope), e)(scope, receive, send)

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        method, path = scope["method"], scope["path"]
        if method in ("GET", "HEAD"):
            local = _GETS.get(path)
            if local is not None:
                await _json(send, await local(self))
                return
            if path in ("/", "/health"):
                body = b"Ollama is running" if path == "/" else b'{"status":"ok"}'
                kind = b"text/plain" if path == "/" else b"application/json"
                await _send(send, 200, body, kind)
                return
            if path == "/metrics":
                await _send(send, 200, await self.metrics(), b"text/plain; version=0.0.4")
                return
        body = await _read_body(receive)
        model: str | None = None
        if path.startswith("/v1/models/") and method == "GET":
            model = path.removeprefix("/v1/models/")
        elif body[:1] == b"{" and method in ("POST", "DELETE"):
            with contextlib.suppress(orjson.JSONDecodeError):
                parsed = orjson.loads(body)
                m = parsed.get("model") or parsed.get("name") or parsed.get("source")
                model = m if isinstance(m, str) and m else None
                if _is_unload(path, parsed) or path in ("/api/delete", "/api/copy"):
                    await self._fan(scope, receive, send, body, model, path)
                    return
                if path == "/models" and method == "DELETE":
                    await self._fan(scope, receive, send, body, model, path)
                    return
        if path.startswith(_HOME_PATHS) or model is None or path == "/models":
            await self._deliver(scope, receive, send, body, None, lambda: self._home(scope))
            return
        await self._route(scope, receive, send, body, model)

    def _home(self, scope: Scope) -> tuple[Node, Choice | None]:
        node = self.cluster.home_node(scope["headers"])
        if node is None:
            raise ApiError(503, "no node of the cluster is up yet", retry_after=2)
        return node, None

    async def _route(
        self, scope: Scope, receive: Receive, send: Send, body: bytes, requested: str
    ) -> None:
        c = self.cluster
        if not c.known(c.canonical(requested)):  # a model just pulled or copied?
            await c.refresh()
        model = c.canonical(requested)
        lookup = scope["path"].startswith(_LOOKUP_PATHS) or scope["method"] == "GET"

        def pick() -> tuple[Node, Choice | None]:
            choice = c.choose(model)
            if choice.node is None:
                if not c.up():
                    raise ApiError(503, "no node of the cluster is up yet", retry_after=2)
                status = 404 if "not found" in choice.reason else 503
                raise ApiError(status, choice.reason, "model")
            node = c.nodes[choice.node]
            if lookup:
                return node, None
            now = time.monotonic()
            node.touch()
            for v in choice.victims:
                node.evicting[v] = now
            if choice.how not in ("ready", "queue"):
                node.recent[model] = (now, choice.need)
            return node, choice

        if not lookup:
            c.heat.bump(model)
        await self._deliver(scope, receive, send, body, None if lookup else model, pick)

    async def _deliver(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        body: bytes,
        model: str | None,
        pick: Callable[[], tuple[Node, Choice | None]],
    ) -> None:
        """Forward to the node `pick` names. A node that fails before it answered anything (it
        cannot be reached, or it is lost meanwhile) is checked at once (lost if its corral does
        not answer) and the request goes where `pick` says next: the client sees no error."""
        for attempt in range(3):
            node, choice = pick()
            try:
                await self._forward(scope, receive, send, node, body, model, choice)
                return
            except _Unreachable as e:
                if attempt == 2:
                    raise ApiError(502, str(e)) from None
                if node.up and not await self.cluster.probe(node):
                    self.cluster.lose(node, "does not answer: its corral is unreachable")

    async def _forward(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        node: Node,
        body: bytes,
        model: str | None,
        choice: Choice | None,
    ) -> None:
        """Send the request to `node`'s corral and relay its response as it comes."""
        assert node.pool is not None
        path = scope["path"]
        target = scope["raw_path"].decode("latin-1")
        if scope.get("query_string"):
            target += "?" + scope["query_string"].decode("latin-1")
        headers = [(k, v) for k, v in scope["headers"] if k.lower() not in _DROP_REQUEST_B]
        request = node.pool.request_bytes(scope["method"], target, headers, body)
        relay = Relay(node, model, asyncio.current_task())
        node.relays.add(relay)
        if model is not None:
            node.inflight[model] += 1
            node.touch()
        # The client's disconnect is watched for only once the answer takes a moment (a task
        # per request costs more CPU than a short request's whole relay).
        watcher: asyncio.Future[None] | None = None

        def watch() -> None:
            nonlocal watcher
            watcher = asyncio.ensure_future(_watch_disconnect(receive, relay))

        timer = asyncio.get_running_loop().call_later(WATCH_AFTER, watch)
        started = False
        last = b""
        content_type = ""
        t0 = time.monotonic()
        try:
            try:
                async with exchange(node.pool, request) as conn:
                    if model is not None and choice is not None and choice.how != "ready":
                        u = node.usage.setdefault(model, Usage())
                        u.load_cost = max(0.0, time.monotonic() - t0)
                        node.touch()
                        if choice.how != "queue":  # a load ended: the node's books changed
                            self.cluster.poll_soon(node)
                    out = []
                    for k, v in conn.headers:
                        k = k.lower()
                        if k == b"content-type":
                            content_type = v.decode("latin-1")
                        if k not in _DROP_RESPONSE:
                            out.append((k, v))
                    out.append((b"x-corral-node", node.name.encode()))
                    await send(
                        {"type": "http.response.start", "status": conn.status, "headers": out}
                    )
                    started = True
                    if scope["method"] != "HEAD":
                        async for chunk in conn.body():
                            last = chunk
                            await send(
                                {"type": "http.response.body", "body": chunk, "more_body": True}
                            )
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            except asyncio.CancelledError:
                if relay.gone or relay.lost is None:
                    raise
                task = asyncio.current_task()
                if task is not None:
                    task.uncancel()
                raise _Lost(relay.lost) from None
        except (Unreachable, Broken, _Lost) as e:
            why = relay.lost or f"{node.label} failed: {e}".rstrip(": ")
            if not started and not isinstance(e, Broken):
                raise _Unreachable(why) from None  # nothing sent yet: _deliver tries again
            if relay.lost is None:
                self.cluster.check_soon(node)
            if not started:
                raise ApiError(502, why) from None
            tail = error_tail(path, content_type, why, last)
            if tail is None:  # a plain body cut short: only closing the connection says so
                raise
            await send({"type": "http.response.body", "body": tail, "more_body": False})
        finally:
            timer.cancel()
            if watcher is not None:
                watcher.cancel()
            node.relays.discard(relay)
            if model is not None:
                node.inflight[model] -= 1
                if node.inflight[model] <= 0:
                    del node.inflight[model]
                u = node.usage.setdefault(model, Usage())
                u.last_used = time.monotonic()
                u.uses += 1
                node.touch()

    async def _fan(
        self, scope: Scope, receive: Receive, send: Send, body: bytes, model: str | None,
        path: str,
    ) -> None:  # fmt: skip
        """A request for every node that has (or runs) the model: delete, copy, unload. The
        answer is the first success, else the first failure."""
        c = self.cluster
        name = c.canonical(model) if model else None
        unload = path != "/api/delete" and path != "/api/copy"
        targets = []
        for n in c.up():
            books = n.books or {}
            if unload:
                has = any(r["model"] == name for r in books.get("runners", []))
            else:
                has = name in books.get("models", {})
            if has:
                targets.append(n)
        if not targets:
            node = c.home_node(scope["headers"])
            if node is None:
                raise ApiError(503, "no node of the cluster is up yet", retry_after=2)
            await self._forward(scope, receive, send, node, body, None, None)
            return
        headers = {
            k.decode("latin-1"): v.decode("latin-1")
            for k, v in scope["headers"]
            if k.decode("latin-1").lower() not in _DROP_REQUEST
        }

        async def one(n: Node) -> tuple[int, bytes, str]:
            assert n.session is not None
            async with n.session.request(
                scope["method"], f"{n.url}{path}", data=body, headers=headers
            ) as r:
                return r.status, await r.read(), r.headers.get("content-type", "application/json")

        results = await asyncio.gather(*(one(n) for n in targets), return_exceptions=True)
        done = [r for r in results if isinstance(r, tuple)]
        if not done:
            raise ApiError(502, f"no node answered: {results[0]}")
        best = next((r for r in done if r[0] < 300), done[0])
        await c.refresh(force=True)
        await _send(send, best[0], best[1], best[2].encode())

    # ---- answered from every node -----------------------------------------------------------
    async def _gather(self, path: str) -> list[tuple[Node, Any]]:
        async def one(n: Node) -> tuple[Node, Any]:
            assert n.session is not None
            async with n.session.get(f"{n.url}{path}", timeout=aiohttp.ClientTimeout(10)) as r:
                r.raise_for_status()
                return n, (await r.read())

        nodes = sorted(self.cluster.up(), key=lambda n: n.name)
        out = await asyncio.gather(*(one(n) for n in nodes), return_exceptions=True)
        return [r for r in out if isinstance(r, tuple)]

    async def tags(self) -> dict[str, Any]:
        merged: dict[str, dict[str, Any]] = {}
        for node, raw in await self._gather("/api/tags"):
            for m in orjson.loads(raw)["models"]:
                item = merged.setdefault(m["name"], {**m, "nodes": []})
                item["nodes"].append(node.name)
        return {"models": sorted(merged.values(), key=lambda m: str(m["name"]))}

    async def ps(self) -> dict[str, Any]:
        models = []
        for node, raw in await self._gather("/api/ps"):
            for m in orjson.loads(raw)["models"]:
                models.append({**m, "node": node.name, "node_id": node.id})
        return {"models": models}

    async def openai_models(self) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        for _, raw in await self._gather("/v1/models"):
            for m in orjson.loads(raw)["data"]:
                merged.setdefault(m["id"], m)
        return {"object": "list", "data": list(merged.values())}

    async def router_models(self) -> dict[str, Any]:
        rank = {"loaded": 2, "loading": 1}
        merged: dict[str, Any] = {}
        for _, raw in await self._gather("/models"):
            for m in orjson.loads(raw)["data"]:
                old = merged.get(m["id"])
                state = m.get("status", {}).get("value", "")
                if old is None or rank.get(state, 0) > rank.get(old["status"]["value"], 0):
                    merged[m["id"]] = m
        return {"object": "list", "data": list(merged.values())}

    async def version(self) -> dict[str, Any]:
        return ollama.version()

    async def status(self) -> dict[str, Any]:
        return self.cluster.status()

    async def metrics(self) -> bytes:
        """Every node's metrics, each sample labelled with its node."""
        from prometheus_client import CollectorRegistry, generate_latest
        from prometheus_client.metrics_core import Metric
        from prometheus_client.parser import text_string_to_metric_families

        families: dict[str, Metric] = {}
        for node, raw in await self._gather("/metrics"):
            for fam in text_string_to_metric_families(raw.decode()):
                out = families.get(fam.name)
                if out is None:
                    out = families[fam.name] = Metric(fam.name, fam.documentation, fam.type)
                for s in fam.samples:
                    labels = {**s.labels, "node": node.name}
                    out.add_sample(s.name, labels, s.value, s.timestamp, s.exemplar)

        class Collected:
            def collect(self) -> Iterable[Metric]:
                return families.values()

        registry = CollectorRegistry(auto_describe=False)
        registry.register(Collected())
        return bytes(generate_latest(registry))


_GETS: dict[str, Callable[[Entry], Awaitable[dict[str, Any]]]] = {
    "/api/tags": Entry.tags,
    "/api/ps": Entry.ps,
    "/v1/models": Entry.openai_models,
    "/models": Entry.router_models,
    "/api/version": Entry.version,
    "/api/cluster": Entry.status,
}


class _Lost(Exception):
    pass


class _Unreachable(Exception):
    pass


def _is_unload(path: str, body: dict[str, Any]) -> bool:
    """Ollama's unload (`keep_alive: 0` and nothing to generate) and the router's: every node
    running the model unloads it."""
    if path == "/models/unload":
        return True
    if path not in ("/api/generate", "/api/chat"):
        return False
    ka = body.get("keep_alive")
    zero = ka == 0 or (isinstance(ka, str) and ka.strip() in ("0", "0s", "0m", "0h"))
    return zero and not body.get("prompt") and not body.get("messages")


async def _watch_disconnect(receive: Receive, relay: Relay) -> None:
    while True:
        message: Message = await receive()
        if message["type"] == "http.disconnect":
            relay.gone = True
            if relay.task is not None:
                relay.task.cancel()
            return


async def _read_body(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise asyncio.CancelledError
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


async def _send(send: Send, status: int, body: bytes, content_type: bytes) -> None:
    await send({
        "type": "http.response.start", "status": status,
        "headers": [(b"content-type", content_type), (b"content-length", str(len(body)).encode())],
    })  # fmt: skip
    await send({"type": "http.response.body", "body": body})


async def _json(send: Send, obj: Any) -> None:
    await _send(send, 200, orjson.dumps(obj), b"application/json")


# ---- serving ---------------------------------------------------------------------------------
def connect(address: str) -> None:
    import ray

    ray.init(
        address=address,
        namespace="corral",
        logging_level=logging.WARNING,
        log_to_driver=False,
        configure_logging=False,
    )


def serve_cluster(settings: Settings) -> None:
    """`corral serve --ray ADDRESS`: the entry process, until interrupted. The nodes' agents
    and runners stay up when it stops (a restarted entry finds them)."""
    import uvicorn
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    from corral.api.guard import (
        Gate,
        Guard,
        connection_cap,
        guarded_protocol,
        loopback_bind,
        raise_open_files_limit,
    )
    from corral.server import Unhandled

    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    assert settings.ray_address
    connect(settings.ray_address)
    overrides: dict[str, str] = {}
    if settings.api_keys:  # the nodes' corrals listen on the network: they want the key too
        overrides["CORRAL_API_KEY"] = ",".join(settings.api_keys)
    cluster = Cluster(settings, overrides)
    # The same guard as a single corral's: API keys, origins and CORS, the Host check on a
    # loopback bind, body limits; the nodes check keys again (the entry passes them on).
    app = Guard(
        Unhandled(Entry(cluster), FAMILIES),  # an unexpected error: a 500 in its shape
        render=FAMILIES.response,
        gate=Gate(),
        keys=settings.api_keys,
        origins=settings.origins,
        check_host=loopback_bind(settings.host),
        read_timeout=settings.read_timeout,
    )
    log.info("corral %s: one endpoint for the Ray cluster at %s", corral.__version__,
             settings.ray_address)  # fmt: skip
    max_connections = connection_cap(settings.max_connections, raise_open_files_limit())
    config = uvicorn.Config(
        app, host=settings.host, port=settings.port, log_level=settings.log_level,
        access_log=settings.log_level == "debug", timeout_graceful_shutdown=5,
        http=guarded_protocol(
            AutoHTTPProtocol, settings.read_timeout, max_connections, settings.idle_timeout
        ),
        timeout_keep_alive=math.ceil(settings.idle_timeout), ws="none", lifespan="on",
    )  # fmt: skip
    server = uvicorn.Server(config)
    with contextlib.suppress(KeyboardInterrupt):
        server.run()
