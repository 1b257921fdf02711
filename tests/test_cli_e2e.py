"""The `corral` CLI as a user runs it, against a real server: a subprocess per command."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from corral.testing.server import CorralServer


def corral(
    server: CorralServer, *args: str, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "CORRAL_HOST": server.host}
    return subprocess.run(
        [sys.executable, "-m", "corral", *args],
        env=env,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_run_list_ps_show_stop(server: CorralServer) -> None:
    r = corral(server, "run", "smollm2:135m", "Say", "hi.", "--verbose")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()  # the streamed answer
    assert "eval count" in r.stderr and "eval rate" in r.stderr
    assert corral(server, "run", "tiny2").returncode == 0  # load only: no prompt, no TTY

    r = corral(server, "list")
    assert r.returncode == 0 and "smollm2:135m" in r.stdout and "tiny2:latest" in r.stdout
    assert "98 MB" in r.stdout  # the built-in model's size, ollama-style

    r = corral(server, "ps")
    assert r.returncode == 0
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("tiny2:latest"))
    assert "100% CPU" in line and "from now" in line

    r = corral(server, "show", "smollm2:135m")
    assert r.returncode == 0
    for word in ("llama", "134.52M", "Q4_1", "completion"):
        assert word in r.stdout

    r = corral(server, "stop", "tiny2")
    assert r.returncode == 0
    server.wait_for(
        lambda: "tiny2:latest" not in {m["model"] for m in server.ps()}, what="tiny2 to stop"
    )


def test_run_reads_prompt_from_stdin(server: CorralServer) -> None:
    r = corral(server, "run", "smollm2:135m", stdin="Say something.\n")
    assert r.returncode == 0, r.stderr and r.stdout.strip()


@pytest.mark.parametrize("args", [("run", "nope", "hi"), ("show", "nope"), ("stop", "nope")])
def test_unknown_model_is_a_clean_error(server: CorralServer, args: tuple[str, ...]) -> None:
    r = corral(server, *args)
    assert r.returncode == 1
    assert "Error: model 'nope' not found" in r.stderr
    assert "Traceback" not in r.stderr


def test_unreachable_server(tmp_path) -> None:
    env = {**os.environ, "CORRAL_HOST": "127.0.0.1:9"}
    r = subprocess.run(
        [sys.executable, "-m", "corral", "ps"], env=env, capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 1 and "could not connect" in r.stderr
