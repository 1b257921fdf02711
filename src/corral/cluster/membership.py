"""Cluster mode's view of its nodes: which Ray nodes are alive, an agent on each, and their
books.

Membership is `ray.nodes()`, polled every couple of seconds; a node that joins gets a node agent
(cluster/agent.py, found again by name after the entry restarts), one that leaves is dropped.
Each agent runs that node's own single-node corral. Every second the entry asks each agent for
its books over Ray (runners with state, slots and bytes; budgets; the node's models and what
each would book) and lays over them what it knows better: its own requests in flight per node
and model, and the loads and evictions it has just caused. A node whose agent dies or stops
answering for LOST_AFTER seconds is lost: its relays in flight end (cluster/entry.py ends each
in its API's shape) and its models leave the books.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import Counter
from collections.abc import Awaitable, Iterable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from corral.cluster.placement import Choice, NodeView, RunnerView, choose
from corral.cluster.relay import Pool
from corral.config import Settings
from corral.core.policy import POLICIES
from corral.runtime.registry import canonical_name

log = logging.getLogger("corral.cluster")

POLL_INTERVAL = 1.0  # seconds between two asks of an agent for its books
MEMBERSHIP_INTERVAL = 2.0  # seconds between two reads of ray.nodes()
LOST_AFTER = 4.0  # an agent that has not answered for this long: its node is unreachable
POLL_TIMEOUT = 3.0
FIRST_POLL_TIMEOUT = 120.0
SETTLE = 0.5  # books polled this long after an eviction was asked for show it
HEAT_DECAY = 0.97  # per request, as in core.books
NODE_LABEL = "corral-node"  # a Ray node label naming the node (`ray start --labels`)
KEEPALIVE = 4.0  # idle pooled connections to a node: below its server's 5 s keep-alive


@dataclass
class Usage:
    last_used: float = 0.0
    uses: int = 0
    load_cost: float = 0.0


@dataclass(eq=False)
class Relay:
    """One request the entry has sent to a node."""

    node: Node
    model: str | None
    task: asyncio.Task[Any] | None
    lost: str | None = None  # why the node was lost under it
    gone: bool = False  # the client disconnected


@dataclass(eq=False)
class Node:
    id: str
    name: str
    names: frozenset[str]
    address: str
    agent: Any = None
    about: dict[str, Any] = field(default_factory=dict)  # the agent's info()
    url: str | None = None
    session: aiohttp.ClientSession | None = None  # for the few calls off the data path
    pool: Pool | None = None  # the data path's connections
    books: dict[str, Any] | None = None
    polled_at: float = -math.inf  # when the poll that gave `books` started
    last_ok: float = -math.inf
    up: bool = False
    relays: set[Relay] = field(default_factory=set)
    inflight: Counter[str] = field(default_factory=Counter)  # the entry's requests per model
    foreign: dict[str, int] = field(default_factory=dict)  # requests others sent it directly
    evicting: dict[str, float] = field(default_factory=dict)  # model -> when routing said so
    # model -> (when, bytes): loads the entry sent here, kept in its view until books polled
    # after them show them (a runner loaded and idle again between two polls is still there)
    recent: dict[str, tuple[float, int]] = field(default_factory=dict)
    usage: dict[str, Usage] = field(default_factory=dict)
    ready: dict[str, dict[str, Any]] = field(default_factory=dict)  # model -> its ready runner
    version: int = 0  # bumped by every change the view shows
    _view: tuple[int, NodeView] | None = None
    free: int = 0  # bytes free in the books as polled

    @property
    def label(self) -> str:
        return f"node '{self.name}' ({self.address})"

    def touch(self) -> None:
        """Something the view shows changed."""
        self.version += 1

    def view(self) -> NodeView:
        """The node as placement sees it (without heat: `Cluster.heat` is the cluster's),
        rebuilt only when something it shows changed."""
        if self._view is not None and self._view[0] == self.version:
            return self._view[1]
        books = self.books or {}
        runners = []
        seen = set()
        for r in books.get("runners", []):
            model = r["model"]
            seen.add(model)
            state = r["state"]
            routed = self.evicting.get(model)
            if routed is not None and self.polled_at > routed + SETTLE:
                del self.evicting[model]
                routed = None
            if routed is not None and state == "ready" and not self.inflight[model]:
                state = "unloading"
            u = self.usage.get(model) or Usage()
            runners.append(
                RunnerView(
                    model=model, state=state, bytes=int(r["bytes"]),
                    inflight=self.inflight[model] + self.foreign.get(model, 0),
                    slots=max(1, int(r.get("slots") or 1)), last_used=u.last_used, uses=u.uses,
                    load_cost=u.load_cost,
                )
            )  # fmt: skip
        models: dict[str, int] = books.get("models", {})
        for model, (at, need) in list(self.recent.items()):
            if self.polled_at > at + SETTLE:
                del self.recent[model]
            elif model not in seen:  # loaded (or loading) here, not yet in its books
                seen.add(model)
                n = self.inflight[model]
                u = self.usage.get(model) or Usage()
                runners.append(
                    RunnerView(
                        model=model, state="loading" if n else "ready", bytes=need, inflight=n,
                        last_used=u.last_used, uses=u.uses, load_cost=u.load_cost,
                    )
                )  # fmt: skip
        for model, n in self.inflight.items():
            if n and model not in seen and model in models:  # sent here, not yet in its books
                runners.append(RunnerView(model, "loading", models[model], inflight=n))
        view = NodeView(
            id=self.id,
            name=self.name,
            budget=room(books),
            models=models,
            runners=tuple(runners),
            names=self.names,
        )
        self._view = (self.version, view)
        return view

    def take(self, books: dict[str, Any], started: float, counts: Counter[str]) -> None:
        self.touch()
        self.books = books
        self.ready = {r["model"]: r for r in books["runners"] if r["state"] == "ready"}
        self.free = room(books) - sum(r["bytes"] for r in books["runners"])
        self.polled_at = started
        self.last_ok = time.monotonic()
        self.foreign = {}
        for r in books["runners"]:
            m = r["model"]
            others = int(r.get("inflight", 0)) + int(r.get("queued", 0)) - counts.get(m, 0)
            if others > 0:
                self.foreign[m] = others
        if books.get("url") and books["url"] != self.url:  # (an agent restarted its corral)
            self.set_url(books["url"])

    def set_url(self, url: str) -> None:
        if self.pool is not None:
            self.pool.close()
        self.url = url
        parts = urlsplit(url)
        self.pool = Pool(parts.hostname or "127.0.0.1", parts.port or 80)


class Heat:
    """A model's recency-weighted request count, as core.books keeps it per node."""

    def __init__(self) -> None:
        self.arrivals = 0
        self.h: dict[str, tuple[float, int]] = {}

    def bump(self, model: str) -> None:
        self.arrivals += 1
        self.h[model] = (self(model) + 1.0, self.arrivals)

    def __call__(self, model: str) -> float:
        h, at = self.h.get(model, (0.0, self.arrivals))
        return h * HEAT_DECAY ** (self.arrivals - at)


def room(books: dict[str, Any]) -> int:
    """Bytes a node's runners may book in all: its budgets less what its scheduler holds for
    all of them at once (their shared code)."""
    return sum(books.get("budgets", {}).values()) - sum(books.get("reserved", {}).values())


def node_names(info: dict[str, Any]) -> tuple[str, frozenset[str]]:
    """A Ray node's display name (its `corral-node` label, else its address and id) and every
    name a models.toml pin may use for it: id, label values, host name, address, custom
    resources."""
    labels = {k: v for k, v in (info.get("Labels") or {}).items() if not k.startswith("ray.io/")}
    address = info.get("NodeManagerAddress", "")
    name = labels.get(NODE_LABEL) or f"{address}/{info['NodeID'][:8]}"
    names = {
        info["NodeID"], name, address, info.get("NodeManagerHostname", ""), *labels.values(),
        *(r for r in (info.get("Resources") or {}) if r not in ("CPU", "GPU", "memory",
          "object_store_memory") and not r.startswith("node:")),
    }  # fmt: skip
    return name, frozenset(n for n in names if n)


class Cluster:
    """The entry's view of the cluster: membership, agents, books, and the choice of a node."""

    def __init__(self, settings: Settings, overrides: dict[str, str] | None = None) -> None:
        self.settings = settings
        self.policy = POLICIES[settings.eviction_policy]
        self.overrides = dict(overrides or {})
        self.nodes: dict[str, Node] = {}
        self.attaching: set[str] = set()
        self.heat = Heat()
        self.home: str | None = None  # the node the entry runs on
        self._tasks: list[asyncio.Task[None]] = []
        self._background: set[asyncio.Future[Any]] = set()
        self._refreshed = -math.inf
        self._agent_cls: Any = None

    # ---- life ------------------------------------------------------------------------------
    async def start(self) -> None:
        import ray

        with contextlib.suppress(Exception):
            self.home = ray.get_runtime_context().get_node_id()
        self._tasks = [
            asyncio.ensure_future(self._membership_forever()),
            asyncio.ensure_future(self._watch_forever()),
        ]

    async def stop(self) -> None:
        for t in [*self._tasks, *self._background]:
            t.cancel()
        for t in [*self._tasks, *self._background]:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        for n in self.nodes.values():
            if n.session is not None:
                await n.session.close()
            if n.pool is not None:
                n.pool.close()

    def _spawn(self, aw: Awaitable[Any]) -> None:
        t = asyncio.ensure_future(aw)
        self._background.add(t)
        t.add_done_callback(self._background.discard)

    def up(self) -> list[Node]:
        return [n for n in self.nodes.values() if n.up]

    # ---- membership --------------------------------------------------------------------------
    async def _membership_forever(self) -> None:
        while True:
            try:
                await self.membership()
            except Exception:
                log.exception("reading the cluster's nodes")
            await asyncio.sleep(MEMBERSHIP_INTERVAL)

    async def membership(self) -> None:
        import ray

        infos = await asyncio.to_thread(ray.nodes)
        alive = {i["NodeID"]: i for i in infos if i.get("Alive")}
        for nid, node in list(self.nodes.items()):
            if nid not in alive:
                self.lose(node, "left the cluster")
        for nid, info in alive.items():
            if nid not in self.nodes and nid not in self.attaching:
                self.attaching.add(nid)
                self._spawn(self._attach(info))

    async def _attach(self, info: dict[str, Any]) -> None:
        nid = info["NodeID"]
        name, names = node_names(info)
        node = Node(nid, name, names, info.get("NodeManagerAddress", ""))
        try:
            node.agent = await asyncio.to_thread(self._agent_for, nid)
            about = await asyncio.wait_for(node.agent.info.remote(), timeout=180)
            node.about = about
            node.set_url(about["url"])
            node.session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=5),
                auto_decompress=False,
            )
            self.nodes[nid] = node
            await self._poll(node)
            if not node.up:
                raise RuntimeError("its agent gave no books")
            self._spawn(self._poll_node(node))
            log.info("%s is up: corral at %s (log %s)", node.label, node.url, about["log"])
        except Exception as e:
            log.error("%s: no agent: %s", node.label, e)
            if node.session is not None:
                await node.session.close()
            self.nodes.pop(nid, None)
        finally:
            self.attaching.discard(nid)

    def _agent_for(self, node_id: str) -> Any:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from corral.cluster.agent import NAMESPACE, NodeAgent, agent_name

        if self._agent_cls is None:
            self._agent_cls = ray.remote(NodeAgent)
        return self._agent_cls.options(
            name=agent_name(node_id),
            namespace=NAMESPACE,
            lifetime="detached",
            get_if_exists=True,
            num_cpus=0,
            max_restarts=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        ).remote(node_id, self.overrides)

    def lose(self, node: Node, why: str) -> None:
        """The node is gone (or out of reach): its requests fail now, naming it, and its
        models leave the books."""
        if self.nodes.get(node.id) is not node:
            return
        del self.nodes[node.id]
        node.up = False
        log.warning("%s %s: %d requests in flight fail", node.label, why, len(node.relays))
        for relay in list(node.relays):
            relay.lost = f"{node.label} {why}"
            if relay.task is not None:
                relay.task.cancel()
        if node.session is not None:
            self._spawn(node.session.close())
        if node.pool is not None:
            node.pool.close()

    # ---- books -------------------------------------------------------------------------------
    async def _poll_node(self, node: Node) -> None:
        """One node's books every POLL_INTERVAL, on its own clock: a slow node never delays
        the others'."""
        while self.nodes.get(node.id) is node:
            await self._poll(node)
            await asyncio.sleep(POLL_INTERVAL)

    async def _watch_forever(self) -> None:
        """A node whose agent has not answered for LOST_AFTER is lost (a frozen agent, a
        partition): checked twice a second, whatever its poll is waiting for."""
        while True:
            await asyncio.sleep(0.5)
            now = time.monotonic()
            for n in self.up():
                if now - n.last_ok > LOST_AFTER:
                    self.lose(n, f"did not answer for {LOST_AFTER:g}s")

    async def _poll(self, node: Node) -> None:
        from ray.exceptions import RayActorError, RayTaskError

        started = time.monotonic()
        counts = Counter(node.inflight)
        try:
            # the first books take longer: the agent reads every model's header once
            timeout = POLL_TIMEOUT if node.up else FIRST_POLL_TIMEOUT
            books = await asyncio.wait_for(node.agent.books.remote(), timeout)
        except RayActorError:
            self.lose(node, "lost its agent")
            return
        except RayTaskError as e:  # its corral died under a living agent: start afresh
            self.lose(node, f"lost its corral ({e.cause})")
            with contextlib.suppress(Exception):
                import ray

                ray.kill(node.agent)
            return
        except Exception:  # a timeout: _watch_forever decides when the node is lost
            return
        if started >= node.polled_at:  # (a poll that started earlier may end later)
            node.take(books, started, counts)
        node.last_ok = time.monotonic()
        node.up = True

    def known(self, name: str) -> bool:
        for n in self.nodes.values():
            books = n.books or {}
            if name in books.get("models", {}) or name in books.get("aliases", {}):
                return True
        return False

    async def probe(self, node: Node) -> bool:
        """Does the node's corral answer (within 2 s)?"""
        if node.session is None or node.session.closed:
            return False
        try:
            async with node.session.get(
                f"{node.url}/api/version", timeout=aiohttp.ClientTimeout(total=2)
            ) as r:
                return r.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return False

    def poll_soon(self, node: Node) -> None:
        self._spawn(self._poll(node))

    def check_soon(self, node: Node) -> None:
        """A request to the node failed: lose it now if its corral does not answer."""

        async def check() -> None:
            if not await self.probe(node):
                self.lose(node, "does not answer: its corral is unreachable")

        self._spawn(check())

    async def refresh(self, force: bool = False) -> None:
        """Every node's books now (at most once a second unless forced: requests for unknown
        names cannot make a storm of polls)."""
        now = time.monotonic()
        if now - self._refreshed < POLL_INTERVAL and not force:
            return
        self._refreshed = now
        await asyncio.gather(*(self._poll(n) for n in self.up()), return_exceptions=True)

    # ---- choosing ----------------------------------------------------------------------------
    def canonical(self, name: str) -> str:
        c = canonical_name(name)
        for n in self.up():
            alias = (n.books or {}).get("aliases", {}).get(c)
            if alias:
                return str(alias)
        return c

    def pin(self, model: str) -> frozenset[str]:
        out: set[str] = set()
        for n in self.up():
            out.update((n.books or {}).get("pins", {}).get(model, ()))
        return frozenset(out)

    def choose(self, model: str) -> Choice:
        from corral.cluster.placement import Request as Want

        # The common case first, without building every node's view: the model is ready with
        # a free slot somewhere (placement's first rule: most free slots, then most free bytes).
        best: tuple[int, int, Node] | None = None
        for n in self.nodes.values():
            r = n.ready.get(model)
            if r is None or not n.up or model in n.evicting:
                continue
            free_slots = int(r["slots"]) - n.inflight[model] - n.foreign.get(model, 0)
            if free_slots > 0 and (best is None or (free_slots, n.free) > best[:2]):
                best = (free_slots, n.free, n)
        if best is not None and not self.pin(model):  # (a pinned model takes the long way)
            n = best[2]
            return Choice(n.id, "ready", need=int((n.books or {})["models"].get(model, 0)))
        views = [n.view() for n in self.up()]
        waiting = frozenset(
            r.model for v in views for r in v.runners if r.state == "loading" and r.inflight
        )
        want = Want(model=model, pin=self.pin(model), now=time.monotonic(), waiting=waiting)
        return choose(want, views, self.policy, self.heat)

    def home_node(self, request_headers: Iterable[tuple[bytes, bytes]]) -> Node | None:
        up = sorted(self.up(), key=lambda n: n.name)
        wanted = dict(request_headers).get(b"x-corral-node")
        if wanted:
            w = wanted.decode(errors="replace")
            return next((n for n in up if n.id == w or w in n.names), None)
        return next((n for n in up if n.id == self.home), up[0] if up else None)

    def status(self) -> dict[str, Any]:
        now = time.monotonic()
        out = []
        for n in sorted(self.nodes.values(), key=lambda n: n.name):
            v = n.view()
            out.append({
                "id": n.id, "name": n.name, "address": n.address, "url": n.url, "up": n.up,
                "budget": v.budget, "booked": v.booked, "free": v.free,
                "models": dict(v.models), "polled_ago": round(now - n.last_ok, 3),
                "pid": n.about.get("pid"), "agent_pid": n.about.get("agent_pid"),
                "log": n.about.get("log"),
                "runners": [
                    {"model": r.model, "state": r.state, "bytes": r.bytes,
                     "inflight": r.inflight, "slots": r.slots}
                    for r in v.runners
                ],
            })  # fmt: skip
        return {"nodes": out, "starting": len(self.attaching)}
