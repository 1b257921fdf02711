"""The node agent: one Ray actor per node, pinned there, that runs that node's corral.

The agent starts today's single-node corral (`python -m corral.cluster.node`) on the node, with
the node's own settings: the CORRAL_* variables of the environment `ray start` ran in on that
machine (its models directory, memory limit, margin, ...), over which the entry may lay a few
(its API keys). The node's corral listens on the node's address at a free port; the entry sends
requests there over HTTP. The agent is the control plane only: Ray calls answer where the
node's corral is (`info`), what its books hold (`books`: budgets, runners with their state,
slots and bytes, and the models on the node with the bytes a runner of each would book), and
`stop`. No request or token passes through it.

Agents are detached named actors (`corral-agent-<node id>` in the `corral` namespace), so they
and their runners outlive an entry process that restarts; the new entry finds them by name.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
import httpx

from corral.config import Settings

if TYPE_CHECKING:
    from corral.runtime.registry import ModelEntry, Registry

log = logging.getLogger("corral.cluster")

NAMESPACE = "corral"
START_TIMEOUT = 120.0  # for the node's corral to answer
# Variables Ray sets in its workers that must not reach the node's corral: a worker that asked
# for no GPU may see CUDA_VISIBLE_DEVICES="" and OMP_NUM_THREADS=1.
_RAY_SET = (
    "CUDA_VISIBLE_DEVICES",
    "HIP_VISIBLE_DEVICES",
    "ROCR_VISIBLE_DEVICES",
    "OMP_NUM_THREADS",
)


def agent_name(node_id: str) -> str:
    return f"corral-agent-{node_id}"


def node_environment(
    environ: dict[str, str], overrides: dict[str, str], host: str, agent_pid: int
) -> dict[str, str]:
    """The environment of a node's corral: the node's own, with what Ray set for its worker
    taken out, the entry's overrides, and the address the agent chose."""
    env = dict(environ)
    for k in _RAY_SET:
        if env.get(k) == ("1" if k == "OMP_NUM_THREADS" else ""):
            del env[k]
    env.pop("CORRAL_RAY_ADDRESS", None)  # the node's corral is a single-node corral
    env.update(overrides)
    env["CORRAL_HOST"] = host
    env["CORRAL_AGENT_PID"] = str(agent_pid)
    return env


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


class NodeAgent:
    """The actor's class (wrapped with `ray.remote` by the entry)."""

    def __init__(self, node_id: str, overrides: dict[str, str]) -> None:
        import ray

        self.node_id = node_id
        ip = os.environ.get("CORRAL_NODE_ADDRESS") or ray.util.get_node_ip_address()
        port = free_port(ip)
        self.url = f"http://{ip}:{port}" if ":" not in ip else f"http://[{ip}]:{port}"
        self.env = node_environment(dict(os.environ), overrides, f"{ip}:{port}", os.getpid())
        self.settings = Settings.load(environ=self.env)
        self.settings.models_dir.mkdir(parents=True, exist_ok=True)
        log_dir = Path(self.env.get("CORRAL_NODE_LOG_DIR") or tempfile.gettempdir())
        self.log_path = log_dir / f"corral-node-{node_id[:12]}-{os.getpid()}.log"
        self.started = time.time()
        with open(self.log_path, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "corral.cluster.node"],
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        self._wait_ready()
        self._registry: Registry | None = None
        self._needs: dict[tuple[str, str, int, float], int] = {}
        self._session: aiohttp.ClientSession | None = None

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        with httpx.Client(timeout=5) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"the node's corral exited:\n{self.log_tail()}")
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(f"{self.url}/api/version").status_code == 200:
                        return
                time.sleep(0.05)
        self.proc.kill()
        raise RuntimeError(f"the node's corral did not start:\n{self.log_tail()}")

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    # ---- Ray calls ---------------------------------------------------------------------------
    async def info(self) -> dict[str, Any]:
        return {
            "node_id": self.node_id,
            "url": self.url,
            "pid": self.proc.pid,
            "agent_pid": os.getpid(),
            "host": socket.gethostname(),
            "started": self.started,
            "log": str(self.log_path),
        }

    async def books(self) -> dict[str, Any]:
        """What the node's corral holds and can load: runners from its /api/ps, budgets, and
        every model on the node with the bytes its runner would book at default options."""
        if self.proc.poll() is not None:
            raise RuntimeError(f"the node's corral exited ({self.proc.returncode})")
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5))
        async with self._session.get(f"{self.url}/api/ps") as resp:
            resp.raise_for_status()
            ps = (await resp.json())["models"]
        async with self._session.get(f"{self.url}/api/corral/books") as resp:
            resp.raise_for_status()
            books = await resp.json()
        models, aliases, pins = await asyncio.to_thread(self._models)
        return {
            "node_id": self.node_id,
            "url": self.url,
            "pid": self.proc.pid,
            "budgets": books["budgets"],
            "reserved": books["reserved"],  # for all the node's runners at once
            "runners": [
                {
                    "model": m["model"],
                    "state": m.get("state", "ready"),
                    "bytes": sum(d["bytes"] for d in m.get("devices", [])) or int(m["size"]),
                    "inflight": m.get("requests_in_flight", 0),
                    "queued": m.get("queued", 0),
                    "slots": m.get("num_parallel", 1),
                    "expires_at": m.get("expires_at"),
                }
                for m in ps
            ],
            "ps": ps,
            "models": models,
            "aliases": aliases,
            "pins": pins,  # models.toml `nodes = [...]` per model
        }

    async def ping(self) -> bool:
        return self.proc.poll() is None

    async def stop(self, grace: float = 10.0) -> int | None:
        """Stop the node's corral (its runners with it); the actor can be killed after."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # at once: no drain of requests in flight
            try:
                await asyncio.to_thread(self.proc.wait, grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                await asyncio.to_thread(self.proc.wait)
        if self._session is not None:
            await self._session.close()
        return self.proc.returncode

    # ---- the node's models -------------------------------------------------------------------
    def _models(self) -> tuple[dict[str, int], dict[str, str], dict[str, list[str]]]:
        """Every model's booking at default options, the aliases, and the nodes each model is
        pinned to (models.toml `nodes`), as the node's registry reads them."""
        if self._registry is None:
            from corral.runtime.registry import Registry

            self._registry = Registry(self.settings.models_dir, self.settings.builtin_models)
        needs, aliases = model_needs(self.settings, self._registry, self._needs)
        pins = {e.name: list(e.nodes) for e in self._registry.all() if e.nodes}
        return needs, aliases, pins

def model_needs(
    settings: Settings,
    registry: Registry,
    cache: dict[tuple[str, str, int, float], int] | None = None,
) -> tuple[dict[str, int], dict[str, str]]:
    """Every model on the node -> the bytes its runner books at default options, as the node's
    scheduler books it (0 where the file cannot be read: the node's corral says why when asked
    for it); and the aliases."""
    from corral.core.gguf import GGUFError

    cache = {} if cache is None else cache
    models: dict[str, int] = {}
    aliases: dict[str, str] = {}
    for entry in registry.all():
        for a in entry.aliases:
            aliases[a] = entry.name
        key = (entry.name, str(entry.path), entry.size, entry.modified_at)
        need = cache.get(key)
        if need is None:
            try:
                need = runner_need(settings, entry)
            except (GGUFError, OSError, ValueError) as e:  # a TemplateError is a ValueError
                log.warning("model %s: %s", entry.name, e)
                need = 0
            cache[key] = need
        models[entry.name] = need
    return models, aliases


def runner_need(settings: Settings, entry: ModelEntry) -> int:
    """The bytes a runner of `entry` books at default options (as Service.lease books it)."""
    from corral.core.gguf import read_model_info, read_parts
    from corral.core.spec import runner_spec, spec_estimate
    from corral.runtime.devices import cpu_cores

    info = read_model_info(entry.path)
    projector, adapters = read_parts(info, entry.projector, entry.adapters)
    spec, _ = runner_spec(entry, info, {}, settings, cpu_cores())
    draft = read_model_info(spec.draft) if spec.draft else None  # booked with its target
    est = spec_estimate(info, spec, projector, adapters, draft)
    return int(est.total + est.process)
