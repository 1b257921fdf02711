"""Cluster-mode figures: `python -m corral.bench.cluster [--quick] [--json FILE]`.

1. Start-up: a three-node Ray cluster on this machine (ray.cluster_utils), then the entry and
   its three agents.
2. The cluster hop: p50 of short requests sent straight to a node's corral against the same
   requests through the entry (interleaved), and one long stream's tokens/s both ways.
3. A swap trace (corral.bench.swap's models and trace) replayed against one corral with a
   memory limit B, and against the cluster with B/3 on each of its three nodes.
4. Scale: what grows with the number of nodes, with fake nodes (no Ray, no processes): the cost
   of one routing decision, and the size of a node's books, at 20 nodes and 200 models.

Prints a JSON document (and writes it to --json); docs/benchmarks.md quotes it by hand.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from corral.bench.common import EVICT_LINE, logged_loads
from corral.testing.server import free_port

BASE = {
    "CORRAL_BUILTIN_MODELS": "0", "CORRAL_CONTEXT_LENGTH": "512", "CORRAL_NUM_PARALLEL": "1",
    "CORRAL_KEEP_ALIVE": "1h", "CORRAL_MEMORY_MARGIN": "0", "CORRAL_QUEUE_TIMEOUT": "10m",
    "CORRAL_LOG_LEVEL": "info", "CORRAL_EVICTION_POLICY": "cost",
}  # fmt: skip


def p(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def start_entry(address: str, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    env = {**os.environ, "CORRAL_HOST": f"127.0.0.1:{port}", "CORRAL_LOG_LEVEL": "warning"}
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "corral", "serve", "--ray", address],
            env=env, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    return proc, f"http://127.0.0.1:{port}"


def wait_up(url: str, n: int, timeout: float = 300) -> None:
    t0 = time.monotonic()
    with httpx.Client(timeout=10) as c:
        while time.monotonic() - t0 < timeout:
            try:
                st = c.get(url + "/api/cluster").json()
                if sum(x["up"] for x in st["nodes"]) >= n:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
    raise TimeoutError(f"{n} nodes not up")


# ---- the hop ---------------------------------------------------------------------------------
def cpu(pid: int) -> float:
    import psutil

    t = psutil.Process(pid).cpu_times()
    return float(t.user + t.system)


def hop(entry: str, model: str, reps: int, entry_pid: int) -> dict[str, Any]:
    """Latency both ways, and the entry's CPU time per request it relays (less what it spends
    idle on its polls): contention on a busy machine inflates latency, not CPU time."""
    c = httpx.Client(timeout=120)
    r = c.post(entry + "/api/generate", json={"model": model, "prompt": "x", "stream": False,
                                              "options": {"num_predict": 1}})  # fmt: skip
    r.raise_for_status()
    node = r.headers["x-corral-node"]
    direct = next(n["url"] for n in c.get(entry + "/api/cluster").json()["nodes"]
                  if n["name"] == node)  # fmt: skip
    routes = {
        "POST /api/show": ("/api/show", {"model": model}),
        "POST /v1/chat/completions, 1 token": (
            "/v1/chat/completions",
            {
                "model": model,
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 1,
                "temperature": 0,
            },
        ),
    }
    out: dict[str, Any] = {"node": node}
    t0, c0 = time.perf_counter(), cpu(entry_pid)
    time.sleep(3)
    idle_cpu_per_s = (cpu(entry_pid) - c0) / (time.perf_counter() - t0)
    out["entry_idle_cpu_ms_per_s"] = idle_cpu_per_s * 1e3
    for label, (path, body) in routes.items():
        times: dict[str, list[float]] = {"direct": [], "entry": []}
        w0, c0 = time.perf_counter(), cpu(entry_pid)
        for i in range(reps + 10):
            order = ("direct", "entry") if i % 2 else ("entry", "direct")
            for way in order:
                base = direct if way == "direct" else entry
                t0 = time.perf_counter()
                c.post(base + path, json=body).raise_for_status()
                if i >= 10:  # warm-up
                    times[way].append(time.perf_counter() - t0)
        busy = cpu(entry_pid) - c0 - idle_cpu_per_s * (time.perf_counter() - w0)
        d50, e50 = statistics.median(times["direct"]), statistics.median(times["entry"])
        out[label] = {
            "entry_cpu_us_per_request": busy / (reps + 10) * 1e6,
            "direct_p50_ms": d50 * 1e3, "entry_p50_ms": e50 * 1e3, "hop_p50_ms": (e50 - d50) * 1e3,
            "direct_p95_ms": p(times["direct"], 0.95) * 1e3,
            "entry_p95_ms": p(times["entry"], 0.95) * 1e3,
        }  # fmt: skip
    # one long stream, each way
    long = {"model": model, "prompt": "x", "options": {"num_predict": 600, "num_ctx": 2048,
            "temperature": 0}}  # fmt: skip
    c.post(direct + "/api/generate", json={**long, "stream": False}).raise_for_status()
    for way, base in (("direct", direct), ("entry", entry), ("direct", direct), ("entry", entry)):
        t0 = time.perf_counter()
        n = 0
        with c.stream("POST", base + "/api/generate", json=long) as resp:
            for line in resp.iter_lines():
                if line:
                    n += 1
        rate = n / (time.perf_counter() - t0)
        out.setdefault("stream_chunks_per_s", {}).setdefault(way, []).append(rate)
    c.close()
    return out


# ---- the swap trace --------------------------------------------------------------------------
def swap(work: Path, quick: bool, make_cluster: Any, fractions: list[float]) -> dict[str, Any]:
    """The same trace on one node with a memory limit B (a `fraction` of all models' real
    sizes) and on three nodes with B/3 each, for each fraction."""
    from corral.bench.swap import (
        calibrate,
        estimated_sizes,
        replay,
        replay_corral,
        summarize,
        write_models,
    )
    from corral.bench.trace import EMBED, generate_trace

    models_dir = work / "swap-models"
    sizes = (4, 8, 12, 16, 20, 24, 28, 32) if not quick else (4, 8, 12, 16)
    chat = write_models(models_dir, sizes, print)
    names = [*chat, "embed"]
    est = estimated_sizes(models_dir, names)
    cal = calibrate(models_dir, names, work, print)
    real: dict[str, int] = cal["sizes"]
    requests, seconds = (120, 40.0) if not quick else (40, 15.0)
    trace = generate_trace(20250101, requests, chat, embed_model="embed",
                           long_session_model=chat[-2])  # fmt: skip
    factor = seconds / max(trace[-1].t, 1e-9)
    out: dict[str, Any] = {
        "models": {n: {"real": real[n], "estimate": est[n]} for n in names},
        "requests": len(trace), "seconds": seconds,
        "embed_requests": sum(e.kind == EMBED for e in trace),
    }  # fmt: skip
    for fraction in fractions:
        budget = int(sum(real.values()) * fraction)
        per_node = budget // 3
        res: dict[str, Any] = {"budget_one_node": budget, "budget_per_node": per_node}
        print(f"swap: one node, limit {budget / 2**20:.0f} MiB")
        res["one node"] = replay_corral(models_dir, "cost", budget, trace, factor, real, work)
        print(f"swap: three nodes, limit {per_node / 2**20:.0f} MiB each")
        url, logs, stop = make_cluster(models_dir, per_node)
        try:
            results = asyncio.run(replay(url, trace, factor))
        finally:
            stop()
        text = "".join(f.read_text(errors="replace") for f in logs.glob("corral-node-*.log"))
        loads = logged_loads(text)
        r = summarize(results)
        r |= {
            "loads": len(loads), "evictions": len(EVICT_LINE.findall(text)),
            "bytes_loaded": sum(real.get(m, 0) for m in loads),
            "loads_per_model": dict(Counter(loads)),
        }  # fmt: skip
        res["three nodes"] = r
        out[f"fraction {fraction:g}"] = res
        print(json.dumps(res, indent=1, default=str))
    return out


# ---- scale, with fake nodes ------------------------------------------------------------------
def scale(nodes: int, models: int, runners: int, full: bool = False) -> dict[str, Any]:
    """One routing decision over `nodes` fake nodes, each with `models` models on disk and
    `runners` loaded (`full`: no room left, so a cold model's choice ranks every idle runner of
    the cluster for eviction), and the size of one node's books as its agent sends them."""
    import pickle

    from corral.cluster.membership import Cluster, Node
    from corral.config import Settings

    names = [f"model-{i:03d}:latest" for i in range(models)]
    cluster = Cluster(Settings.load(environ={}))
    for n in range(nodes):
        node = Node(f"{n:056x}", f"node-{n}", frozenset({f"node-{n}"}), f"10.0.0.{n}")
        loaded = [names[(n * runners + k) % models] for k in range(runners)]
        books = {
            "budgets": {"cpu": runners * 6 * 2**30}
            if full
            else {"cpu": 64 * 2**30, "cuda:0": 80 * 2**30},
            "models": {m: (1 + i % 20) * 2**30 for i, m in enumerate(names)},
            "aliases": {},
            "pins": {},
            "runners": [
                {"model": m, "state": "ready", "bytes": 6 * 2**30, "inflight": 0, "queued": 0,
                 "slots": 4}
                for m in loaded
            ],
        }  # fmt: skip
        node.take(books, 0.0, Counter())
        node.up = True
        cluster.nodes[node.id] = node
    first = next(iter(cluster.nodes.values()))
    books_bytes = len(pickle.dumps(first.books))
    loaded_anywhere = {r["model"] for n in cluster.nodes.values() for r in n.books["runners"]}  # type: ignore[index]
    cold = [m for m in names if m not in loaded_anywhere] or names
    warm = sorted(loaded_anywhere)
    out: dict[str, Any] = {"nodes": nodes, "models": models, "runners_per_node": runners,
                           "full": full, "books_bytes_per_node": books_bytes}  # fmt: skip
    for label, want in (("warm", warm), ("cold", cold)):
        t0, reps = time.perf_counter(), 0
        while time.perf_counter() - t0 < 1.0:
            cluster.choose(want[reps % len(want)])
            reps += 1
        out[f"choose_{label}_us"] = (time.perf_counter() - t0) / reps * 1e6
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--skip", nargs="*", default=[], choices=["hop", "swap", "scale"])
    ap.add_argument(
        "--fractions",
        nargs="*",
        type=float,
        default=[0.5, 0.75],
        help="memory limits for the swap trace, as shares of all models' sizes",
    )
    args = ap.parse_args()
    out: dict[str, Any] = {}
    if "scale" not in args.skip:
        configs = ((3, 10, 2, True), (20, 200, 5, False), (20, 200, 5, True), (100, 200, 1, True))
        out["scale"] = [scale(*c) for c in configs]
        print(json.dumps(out["scale"], indent=1))
    from ray.cluster_utils import Cluster

    from corral.testing import synth

    work = Path(tempfile.mkdtemp(prefix="corral-cluster-bench-"))

    def make_cluster(models_dir: Path, limit: int | None) -> tuple[str, Path, Any]:
        logs = Path(tempfile.mkdtemp(dir=work, prefix="logs-"))
        env = {**BASE, "CORRAL_MODELS": str(models_dir), "CORRAL_NODE_LOG_DIR": str(logs)}
        if limit:
            env["CORRAL_MEMORY_LIMIT"] = str(limit)
        t0 = time.monotonic()
        common: dict[str, Any] = {
            "num_cpus": 1, "object_store_memory": 80 * 2**20, "env_vars": env,
        }  # fmt: skip
        cl = Cluster(initialize_head=True, head_node_args={
            **common, "include_dashboard": False, "labels": {"corral-node": "a"}})  # fmt: skip
        for name in ("b", "c"):
            cl.add_node(**common, labels={"corral-node": name})
        t_ray = time.monotonic() - t0
        proc, url = start_entry(cl.address, logs / "entry.log")
        wait_up(url, 3)
        out.setdefault("startup", []).append(
            {"ray_cluster_s": t_ray, "entry_and_agents_s": time.monotonic() - t0 - t_ray}
        )

        def stop() -> None:
            proc.terminate()
            proc.wait(20)
            cl.shutdown()

        stop.pid = proc.pid  # type: ignore[attr-defined]

        return url, logs, stop

    if "hop" not in args.skip:
        tiny = work / "hop-models"
        tiny.mkdir()
        synth.write_llama_model(tiny / "tiny.gguf", n_layer=2, context_length=4096)
        url, _, stop = make_cluster(tiny, None)
        try:
            out["hop"] = hop(url, "tiny", 60 if args.quick else 300, stop.pid)
        finally:
            stop()
        print(json.dumps(out["hop"], indent=1))
    if "swap" not in args.skip:
        out["swap"] = swap(work, args.quick, make_cluster, args.fractions)
    text = json.dumps(out, indent=1, default=str)
    if args.json:
        args.json.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
