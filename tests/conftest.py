"""Shared fixtures: synthetic models written once per session, and real `corral serve`
processes started on free loopback ports."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
import pytest

from corral.testing import synth


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def runner_pids(server_pid: int) -> set[int]:
    """Runner processes started by a corral server (its children running a model)."""
    try:
        kids = psutil.Process(server_pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return set()
    return {p.pid for p in kids}


def all_runner_pids() -> set[int]:
    out = set()
    for p in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if "corral.runner_child" in " ".join(p.info["cmdline"] or []):
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

    def ps(self) -> list[dict]:
        return self.client.get("/api/ps").json()["models"]

    def wait_for(self, predicate, timeout: float = 30.0, what: str = "condition") -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return
            time.sleep(0.05)
        raise AssertionError(f"timed out waiting for {what}; server log:\n{self.log()[-3000:]}")

    def runners(self) -> set[int]:
        return runner_pids(self.proc.pid)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.client.close()


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("models")
    synth.write_llama_model(d / "tiny.gguf", n_layer=2, context_length=2048)
    synth.write_llama_model(d / "tiny2.gguf", n_layer=3, context_length=2048, seed=1)
    synth.write_bert_model(d / "embed.gguf")
    synth.write_not_gguf(d / "notgguf.gguf")
    synth.write_truncated_copy(d / "tiny.gguf", d / "truncated.gguf", 0.6)
    return d


@pytest.fixture(scope="session")
def start_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    """Start `corral serve` with extra environment; every server is stopped at session end and
    must leave no runner process behind."""
    started: list[CorralServer] = []

    def start(models: Path, **env: str) -> CorralServer:
        port = free_port()
        log_path = tmp_path_factory.mktemp("server") / "corral.log"
        full_env = {
            **os.environ,
            "CORRAL_HOST": f"127.0.0.1:{port}",
            "CORRAL_MODELS": str(models),
            "CORRAL_CONTEXT_LENGTH": "1024",
            "CORRAL_LOG_LEVEL": "info",
            **env,
        }
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "corral", "serve"], env=full_env, stdout=log,
                stderr=subprocess.STDOUT,
            )
        server = CorralServer(f"http://127.0.0.1:{port}", proc, log_path)
        started.append(server)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"corral serve exited early:\n{server.log()}")
            with contextlib.suppress(httpx.TransportError):
                if server.client.get("/api/version").status_code == 200:
                    return server
            time.sleep(0.05)
        raise RuntimeError(f"corral serve did not start:\n{server.log()}")

    yield start
    for s in started:
        pids = s.runners()
        s.stop()
        for pid in pids:
            with contextlib.suppress(psutil.NoSuchProcess):
                psutil.Process(pid).wait(10)
        assert not (pids & all_runner_pids()), f"runners outlived the server: {s.log()[-2000:]}"


@pytest.fixture(scope="session")
def server(start_server, models_dir: Path) -> CorralServer:
    """One shared server with the built-in SmolLM2 model and the synthetic ones."""
    return start_server(models_dir, CORRAL_NUM_PARALLEL="2")
