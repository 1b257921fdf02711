"""Cluster mode on a real three-node Ray cluster on this machine (ray.cluster_utils.Cluster),
driven through a real `corral serve --ray ADDRESS` entry process.

Each node has its own models directory and memory limit (the CORRAL_* variables of its raylet,
as `ray start` on a machine would give them):

  node a (the head): alpha, beta, gamma       limit: one of them, never two
  node b           : alpha, beta, gamma, delta, epsilon   the same limit
  node c           : delta, epsilon (pinned to c)        plenty
  node d (joins)   : zeta

The tests share one cluster (Ray starts slowly) and run in order, each building on the state
the one before left: models spread by memory, a warm model stays on its node, a load that fits
nowhere evicts on the node whose victim the policy values least, the real ollama and openai
clients, `corral ps`, an entry restart that finds the runners where they were, a pinned model,
a frozen agent, a node that joins, and last a node killed mid-stream. Every runner must be
gone once the cluster is down.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

pytest.importorskip("ray")

from ray.cluster_utils import Cluster

from corral.cluster.agent import model_needs
from corral.config import Settings
from corral.core.estimate import RUNNER_CODE_BYTES
from corral.runtime.registry import Registry
from corral.runtime.runner import free_port
from corral.testing import synth

MB = 10**6
BASE = {
    "CORRAL_BUILTIN_MODELS": "0",
    "CORRAL_CONTEXT_LENGTH": "512",
    "CORRAL_KEEP_ALIVE": "10m",
    "CORRAL_LOG_LEVEL": "info",
    "CORRAL_SHUTDOWN_GRACE": "0",
}
BIG = ("alpha", "beta", "gamma")


@dataclass
class Entry:
    url: str
    proc: subprocess.Popen[bytes]
    log: Path
    client: httpx.Client = field(init=False)

    def __post_init__(self) -> None:
        self.client = httpx.Client(base_url=self.url, timeout=120)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.client.close()


@dataclass
class Rig:
    cluster: Cluster
    nodes: dict[str, Any]  # name -> ray's Node object
    root: Path
    needs: dict[str, int]
    entry: Entry
    log_dir: Path
    seen_pids: set[int] = field(default_factory=set)  # node corrals and runners we saw

    @property
    def c(self) -> httpx.Client:
        return self.entry.client

    def status(self) -> dict[str, Any]:
        st = self.c.get("/api/cluster").json()
        for n in st["nodes"]:
            self.seen_pids.update(p for p in (n.get("pid"),) if p)
        return {n["name"]: n for n in st["nodes"]}

    def ps(self) -> dict[str, dict[str, Any]]:
        models = self.c.get("/api/ps").json()["models"]
        self.seen_pids.update(m["pid"] for m in models)
        return {m["model"].removesuffix(":latest"): m for m in models}

    def generate(self, model: str, **options: Any) -> httpx.Response:
        body = {"model": model, "prompt": "hi", "stream": False, "options": {"num_predict": 4}}
        body["options"].update(options)
        r = self.c.post("/api/generate", json=body)
        assert r.status_code == 200, r.text
        return r


def start_entry(address: str, log: Path, port: int | None = None) -> Entry:
    port = port or free_port()
    env = {**os.environ, "CORRAL_HOST": f"127.0.0.1:{port}", "CORRAL_LOG_LEVEL": "info"}
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "corral", "serve", "--ray", address],
            env=env, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    return Entry(f"http://127.0.0.1:{port}", proc, log)


def wait_nodes(entry: Entry, n: int, timeout: float = 240) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        assert entry.proc.poll() is None, entry.log.read_text()[-3000:]
        with contextlib.suppress(httpx.HTTPError):
            st = entry.client.get("/api/cluster").json()
            if sum(x["up"] for x in st["nodes"]) >= n:
                return time.monotonic() - t0
        time.sleep(0.2)
    raise AssertionError(f"{n} nodes not up: {entry.log.read_text()[-3000:]}")


def our_processes(root: Path) -> list[psutil.Process]:
    """Runners of this test's models and the nodes' corrals still alive."""
    out = []
    for p in psutil.process_iter(["cmdline", "environ"]):
        with contextlib.suppress(psutil.Error):
            cmd = " ".join(p.info["cmdline"] or [])
            if "corral.runtime.runner_child" in cmd and str(root) in cmd:
                out.append(p)
            elif "corral.cluster.node" in cmd and str(root) in str(p.info["environ"] or {}):
                out.append(p)
    return out


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    t0 = time.monotonic()
    root = tmp_path_factory.mktemp("cluster")
    files = root / "files"
    files.mkdir()
    for i, m in enumerate(BIG):
        synth.write_llama_model(files / f"{m}.gguf", target_bytes=40 * MB, seed=40 + i)
    # long training contexts: a request with a large num_ctx streams for seconds
    synth.write_llama_model(files / "delta.gguf", context_length=32768, seed=50)
    synth.write_llama_model(files / "epsilon.gguf", seed=51)
    layout = {"a": [*BIG], "b": [*BIG, "delta", "epsilon"], "c": ["delta", "epsilon"]}
    for name, models in layout.items():
        d = root / name
        d.mkdir()
        for m in models:
            os.link(files / f"{m}.gguf", d / f"{m}.gguf")
    toml = '[models.epsilon]\nfile = "epsilon.gguf"\nnodes = ["c"]\n'
    for name in ("b", "c"):
        (root / name / "models.toml").write_text(toml)
    # what each node's scheduler will book for each model, as the agents compute it
    settings = Settings.load(environ={**BASE, "CORRAL_MODELS": str(files)})
    needs, _ = model_needs(settings, Registry(settings.models_dir, settings.builtin_models))
    needs = {k.removesuffix(":latest"): v for k, v in needs.items()}
    big = [needs[m] for m in BIG]
    # one big model fits (its real allocation may replace the estimate), two never do
    limit = int(max(big) * 1.3)
    assert 2 * min(big) * 0.9 > limit, needs
    limit += RUNNER_CODE_BYTES  # booked once for all runners
    env = {
        "a": {**BASE, "CORRAL_MODELS": str(root / "a"), "CORRAL_MEMORY_LIMIT": str(limit)},
        "b": {**BASE, "CORRAL_MODELS": str(root / "b"), "CORRAL_MEMORY_LIMIT": str(limit)},
        "c": {**BASE, "CORRAL_MODELS": str(root / "c"), "CORRAL_MEMORY_LIMIT": "2GiB"},
    }
    log_dir = root / "logs"
    log_dir.mkdir()
    for e in env.values():
        e["CORRAL_NODE_LOG_DIR"] = str(log_dir)
    common = {"num_cpus": 1, "object_store_memory": 80 * 2**20}
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            **common, "include_dashboard": False, "labels": {"corral-node": "a"},
            "env_vars": env["a"],
        },
    )  # fmt: skip
    entry = None
    try:
        nodes = {"a": cluster.head_node}
        for name in ("b", "c"):
            nodes[name] = cluster.add_node(
                **common, labels={"corral-node": name}, env_vars=env[name]
            )
        t_cluster = time.monotonic() - t0
        entry = start_entry(cluster.address, log_dir / "entry.log")
        t_entry = wait_nodes(entry, 3)
        print(
            f"\nray cluster of 3 nodes up in {t_cluster:.1f}s; entry and agents in {t_entry:.1f}s"
            f"; needs (MB): { {k: round(v / MB, 1) for k, v in needs.items()} }, "
            f"limit {limit / MB:.1f} MB"
        )
        rig = Rig(cluster, nodes, root, needs, entry, log_dir)
        rig.status()
        yield rig
    finally:
        t1 = time.monotonic()
        if entry is not None:
            entry.stop()
        cluster.shutdown()
        deadline = time.monotonic() + 30
        while our_processes(root) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = our_processes(root)
        for p in left:
            with contextlib.suppress(psutil.Error):
                p.kill()
        print(f"cluster down in {time.monotonic() - t1:.1f}s")
        assert not left, f"processes outlived the cluster: {left}"


def node_of(rig: Rig, model: str) -> str:
    return str(rig.ps()[model]["node"])


def test_models_spread_by_memory(rig: Rig) -> None:
    """alpha and beta do not fit together on one node: they load on different nodes; c, which
    has neither file, gets neither."""
    first = rig.generate("alpha").headers["x-corral-node"]
    second = rig.generate("beta").headers["x-corral-node"]
    assert {first, second} == {"a", "b"}
    ps = rig.ps()
    assert ps["alpha"]["node"] == first and ps["beta"]["node"] == second
    assert all(m["state"] == "ready" for m in ps.values())
    tags = {m["name"]: m["nodes"] for m in rig.c.get("/api/tags").json()["models"]}
    assert tags["alpha:latest"] == ["a", "b"] and tags["delta:latest"] == ["b", "c"]
    metrics = rig.c.get("/metrics").text
    for name in ("a", "b", "c"):
        assert f'corral_device_budget_bytes{{device="cpu",node="{name}"}}' in metrics


def test_warm_model_is_served_on_its_node(rig: Rig) -> None:
    where = node_of(rig, "alpha")
    pid = rig.ps()["alpha"]["pid"]
    for _ in range(3):
        r = rig.generate("alpha")
        assert r.headers["x-corral-node"] == where
        assert r.json()["load_duration"] < 0.5e9  # no load: the runner was warm
    ps = rig.ps()
    assert ps["alpha"]["pid"] == pid and len([m for m in ps if m == "alpha"]) == 1


def test_load_that_fits_nowhere_evicts_on_the_cheapest_node(rig: Rig) -> None:
    """gamma fits beside nothing: alpha is hot (several requests, the latest), beta was used
    once; the cluster's policy evicts beta, on beta's node."""
    alpha_node, beta_node = node_of(rig, "alpha"), node_of(rig, "beta")
    r = rig.generate("gamma")
    assert r.headers["x-corral-node"] == beta_node
    ps = rig.ps()
    assert "beta" not in ps and ps["gamma"]["node"] == beta_node
    assert ps["alpha"]["node"] == alpha_node


def test_ollama_and_openai_clients(rig: Rig) -> None:
    import ollama
    import openai

    where = node_of(rig, "alpha")
    client = ollama.Client(host=rig.entry.url)
    out = client.chat(
        model="alpha", messages=[{"role": "user", "content": "hi"}], options={"num_predict": 4}
    )
    assert out.message.role == "assistant" and out.done
    parts = list(
        client.generate(model="alpha", prompt="hi", stream=True, options={"num_predict": 4})
    )
    assert parts[-1].done
    assert {m.model for m in client.list().models} >= {"alpha:latest", "delta:latest"}
    assert {m.model for m in client.ps().models} >= {"alpha:latest", "gamma:latest"}
    oa = openai.OpenAI(base_url=f"{rig.entry.url}/v1", api_key="none")
    chunks = list(
        oa.chat.completions.create(
            model="alpha", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True
        )
    )
    assert chunks and chunks[-1].choices[0].finish_reason == "length"
    assert {m.id for m in oa.models.list()} >= {"alpha:latest", "epsilon:latest"}
    assert node_of(rig, "alpha") == where


def test_corral_ps_shows_each_model_s_node(rig: Rig) -> None:
    env = {**os.environ, "CORRAL_HOST": rig.entry.url}
    out = subprocess.run(
        [sys.executable, "-m", "corral", "ps"], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    header, *rows = out.stdout.splitlines()
    assert header.split()[-1] == "NODE"
    ps = rig.ps()
    for row in rows:
        name, node = row.split()[0], row.split()[-1]
        assert ps[name.removesuffix(":latest")]["node"] == node


def test_entry_restart_finds_the_runners_where_they_were(rig: Rig) -> None:
    before = rig.ps()
    port = int(rig.entry.url.rsplit(":", 1)[1])
    rig.entry.stop(signal.SIGKILL)
    t0 = time.monotonic()
    rig.entry = start_entry(rig.cluster.address, rig.log_dir / "entry.log", port)
    wait_nodes(rig.entry, 3)
    print(f"\nentry restarted and found 3 agents in {time.monotonic() - t0:.1f}s")
    after = rig.ps()
    assert {m: (x["node"], x["pid"]) for m, x in after.items()} == {
        m: (x["node"], x["pid"]) for m, x in before.items()
    }
    r = rig.generate("alpha")
    assert r.headers["x-corral-node"] == before["alpha"]["node"]
    assert rig.ps()["alpha"]["pid"] == before["alpha"]["pid"]


def test_pinned_model_loads_on_its_node(rig: Rig) -> None:
    """epsilon is on b and c, pinned to c by models.toml; b would fit it too."""
    assert rig.generate("epsilon").headers["x-corral-node"] == "c"


def test_copy_delete_and_stop_reach_every_node_concerned(rig: Rig) -> None:
    """/api/copy and /api/delete go to every node that has the model; `corral stop` (Ollama's
    unload) to every node that runs it."""
    r = rig.c.post("/api/copy", json={"source": "alpha", "destination": "alpha-copy"})
    assert r.status_code == 200, r.text
    tags = {m["name"]: m["nodes"] for m in rig.c.get("/api/tags").json()["models"]}
    assert tags["alpha-copy:latest"] == ["a", "b"]
    r = rig.c.request("DELETE", "/api/delete", json={"model": "alpha-copy"})
    assert r.status_code == 200, r.text
    assert "alpha-copy:latest" not in {m["name"] for m in rig.c.get("/api/tags").json()["models"]}
    assert "epsilon" in rig.ps()
    env = {**os.environ, "CORRAL_HOST": rig.entry.url}
    out = subprocess.run(
        [sys.executable, "-m", "corral", "stop", "epsilon"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    deadline = time.monotonic() + 20
    while "epsilon" in rig.ps():
        assert time.monotonic() < deadline, "epsilon was not unloaded"
        time.sleep(0.1)


def test_unresponsive_agent_is_detected_and_rejoins(rig: Rig) -> None:
    """A node whose agent stops answering (frozen, as a partition looks from the entry) leaves
    the entry's books within a few seconds, and comes back with its runners when it answers."""
    st = rig.status()
    agent = psutil.Process(st["b"]["agent_pid"])
    before = {m: x["pid"] for m, x in rig.ps().items() if x["node"] == "b"}
    agent.suspend()
    t0 = time.monotonic()
    try:
        while "b" in rig.status():
            assert time.monotonic() - t0 < 20, "node b was not dropped"
            time.sleep(0.1)
        lost = time.monotonic() - t0
    finally:
        agent.resume()
    t1 = time.monotonic()
    wait_nodes(rig.entry, 3)
    print(
        f"\nfrozen agent: node dropped after {lost:.1f}s; back {time.monotonic() - t1:.1f}s later"
    )
    assert lost < 10
    assert {m: x["pid"] for m, x in rig.ps().items() if x["node"] == "b"} == before


def test_node_that_joins_gets_an_agent(rig: Rig) -> None:
    """A node added to the running cluster gets an agent and its models are served."""
    d = rig.root / "d"
    d.mkdir()
    os.link(rig.root / "files" / "epsilon.gguf", d / "zeta.gguf")
    env = {**BASE, "CORRAL_MODELS": str(d), "CORRAL_NODE_LOG_DIR": str(rig.log_dir)}
    t0 = time.monotonic()
    rig.nodes["d"] = rig.cluster.add_node(
        num_cpus=1, object_store_memory=80 * 2**20, labels={"corral-node": "d"}, env_vars=env
    )
    wait_nodes(rig.entry, 4)
    print(f"\nnode d joined and was serving {time.monotonic() - t0:.1f}s after ray start")
    assert rig.generate("zeta").headers["x-corral-node"] == "d"
    tags = {m["name"]: m["nodes"] for m in rig.c.get("/api/tags").json()["models"]}
    assert tags["zeta:latest"] == ["d"]


def test_node_killed_mid_stream(rig: Rig) -> None:
    """delta loads on c (b has no room); c dies while delta streams: the client gets an error
    naming c, and the next request for delta loads it on b."""
    long = {"num_ctx": 16384, "temperature": 0}  # greedy on random weights: no end of text
    before = rig.ps()
    assert rig.generate("delta", **long).headers["x-corral-node"] == "c", (before, rig.status())
    st = rig.status()
    body = {"model": "delta", "prompt": "hi", "options": {**long, "num_predict": 16000}}
    lines: list[dict[str, Any]] = []
    with rig.c.stream("POST", "/api/generate", json=body) as resp:
        assert resp.status_code == 200 and resp.headers["x-corral-node"] == "c"
        it = resp.iter_lines()
        for line in it:
            lines.append(json.loads(line))
            if len(lines) == 3:
                t0 = time.monotonic()
                rig.cluster.remove_node(rig.nodes["c"], allow_graceful=False)
                break
        for line in it:
            lines.append(json.loads(line))
    took = time.monotonic() - t0
    print(f"\nnode c removed: the stream ended {took:.2f}s later after {len(lines)} chunks")
    assert "error" in lines[-1] and "node 'c'" in lines[-1]["error"], lines[-3:]
    assert not any(x.get("done") for x in lines)
    # The node's corral dies with its agent: within seconds, not by the time the client
    # has its error (a loaded machine takes a while to reap it).
    def gone(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
        except psutil.NoSuchProcess:
            return True

    deadline = time.monotonic() + 15
    while not gone(st["c"]["pid"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert gone(st["c"]["pid"]), "node c's corral outlived its node"
    r = rig.generate("delta")
    assert r.headers["x-corral-node"] == "b"
    ps = rig.ps()
    assert ps["delta"]["node"] == "b" and "epsilon" not in ps
    assert "c" not in rig.status()
