"""Start and drive real `corral serve` processes (tests and benchmarks)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

from corral.core.drafting import KEPT_FILE
from corral.runtime.runner import free_port
from corral.runtime.store import STORE_DIR


def runner_pids(server_pid: int) -> set[int]:
    """Runner processes started by a corral server (its children running a model)."""
    try:
        kids = psutil.Process(server_pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return set()
    return {p.pid for p in kids}


def all_runner_pids() -> set[int]:
    out: set[int] = set()
    for p in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if "corral.runtime.runner_child" in " ".join(p.info["cmdline"] or []):
                out.add(p.pid)
    return out


@dataclass
class CorralServer:
    url: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    client: httpx.Client = field(init=False)

    def __post_init__(self) -> None:
        self.client = httpx.Client(base_url=self.url, timeout=120)

    @property
    def host(self) -> str:
        return self.url.removeprefix("http://")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def ps(self) -> list[dict[str, Any]]:
        return self.client.get("/api/ps").json()["models"]

    def wait_for(
        self, predicate: Callable[[], bool], timeout: float = 30.0, what: str = "condition"
    ) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return
            time.sleep(0.05)
        raise AssertionError(f"timed out waiting for {what}; server log:\n{self.log()[-3000:]}")

    def runners(self) -> set[int]:
        return runner_pids(self.proc.pid)

    def stop_and_check(self) -> None:
        """Stop the server; AssertionError if any of its runners outlives it."""
        pids = self.runners()
        self.stop()
        for pid in pids:
            with contextlib.suppress(psutil.NoSuchProcess):
                psutil.Process(pid).wait(10)
        leaked = pids & all_runner_pids()
        assert not leaked, f"runners {leaked} outlived the server: {self.log()[-2000:]}"

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.client.close()


def start_corral(
    models: Path, log_path: Path, env: Mapping[str, str] | None = None, timeout: float = 30.0,
    command: Sequence[str] = ("-m", "corral", "serve"),
) -> CorralServer:
    """`corral serve` on a free loopback port, returned once it answers (`command`: what the
    Python interpreter runs, for a test that wraps the server). It starts as a fresh install
    would: what auto's drafting chose for an earlier server on these models (kept across
    restarts, runtime/measure) does not carry over to this one's tests or bench rounds."""
    (models / STORE_DIR / KEPT_FILE).unlink(missing_ok=True)
    port = free_port()
    full_env = {
        **os.environ,
        "CORRAL_HOST": f"127.0.0.1:{port}",
        "CORRAL_MODELS": str(models),
        "CORRAL_LOG_LEVEL": "info",
        # saved conversations stay with this server, not in the user's ~/.corral
        "CORRAL_KV_CACHE_DIR": str(log_path.parent / "kvcache"),
        **(env or {}),
    }
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, *command],
            env=full_env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    server = CorralServer(f"http://127.0.0.1:{port}", proc, log_path)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"corral serve exited early:\n{server.log()}")
        with contextlib.suppress(httpx.TransportError):
            if server.client.get("/api/version").status_code == 200:
                return server
        time.sleep(0.05)
    server.stop()
    raise RuntimeError(f"corral serve did not start:\n{server.log()}")
