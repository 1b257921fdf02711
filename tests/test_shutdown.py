"""Graceful shutdown: on SIGTERM new requests, and those still waiting for a load (which is
abandoned), get 503 with Retry-After; those generating finish within CORRAL_SHUTDOWN_GRACE,
then every runner stops. Real `corral serve` processes."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import psutil
from helpers import held_runner_env

from corral.testing.server import all_runner_pids

STREAM = {"model": "long", "prompt": "Once upon a time", "raw": True,
          "options": {"num_predict": 200, "temperature": 0}}  # fmt: skip
GEN = {"model": "tiny", "prompt": "hi", "stream": False, "options": {"num_predict": 2}}


def test_sigterm_lets_a_stream_finish_and_refuses_new_requests(
    start_server, models_dir: Path
) -> None:
    # a 16k context: the stream takes seconds, time enough to knock while it runs
    s = start_server(models_dir, CORRAL_SHUTDOWN_GRACE="30s", CORRAL_BUILTIN_MODELS="0",
                     CORRAL_CONTEXT_LENGTH="16384")  # fmt: skip
    with s.client.stream("POST", "/api/generate", json=STREAM) as stream:
        assert stream.status_code == 200
        lines = stream.iter_lines()
        first = json.loads(next(lines))
        assert first["done"] is False
        pids = s.runners()
        start = time.monotonic()
        assert pids
        # The runner is held still while the server drains, so that the stream is surely in
        # flight (a quiet machine wrote all 200 tokens before the SIGTERM was handled).
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        try:
            s.proc.send_signal(signal.SIGTERM)
            s.wait_for(lambda: "stopping: no new requests" in s.log(), timeout=5, what="the drain")
            with httpx.Client(base_url=s.url, timeout=10) as fresh:
                r = fresh.post("/api/generate", json=GEN)
                assert r.status_code == 503, r.text
                assert r.json() == {"error": "server is shutting down"}
                assert int(r.headers["retry-after"]) >= 1
                r = fresh.post("/v1/chat/completions", json={"model": "tiny", "messages": []})
                assert r.status_code == 503 and r.headers["retry-after"]
                assert r.json()["error"]["message"] == "server is shutting down"
        finally:
            for pid in pids:
                os.kill(pid, signal.SIGCONT)
        assert s.proc.poll() is None  # still serving the stream
        rest = [json.loads(line) for line in lines if line.strip()]
    print(f"the stream went on for {time.monotonic() - start:.2f}s after SIGTERM")
    assert rest[-1]["done"] is True and rest[-1]["eval_count"] == 200, rest[-1]
    assert not any("error" in chunk for chunk in rest)
    s.proc.wait(15)
    assert "1 in flight" in s.log()
    deadline = time.monotonic() + 10
    while pids & all_runner_pids() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pids & all_runner_pids()


def test_when_the_grace_runs_out_streams_end_with_an_error(start_server, models_dir: Path) -> None:
    # A 16k context: the model's own (1k) let a fast machine write every token within the
    # grace, and the stream ended well instead of being cut.
    s = start_server(models_dir, CORRAL_SHUTDOWN_GRACE="1s", CORRAL_BUILTIN_MODELS="0",
                     CORRAL_CONTEXT_LENGTH="16384")  # fmt: skip
    endless = {**STREAM, "options": {"num_predict": 100000, "temperature": 0}}
    with s.client.stream("POST", "/api/generate", json=endless) as stream:
        lines = stream.iter_lines()
        next(lines)
        pids = s.runners()
        start = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        rest = [json.loads(line) for line in lines if line.strip()]
    ended = time.monotonic() - start
    assert rest[-1] == {"error": "server is shutting down"}, rest[-1:]
    assert 0.9 < ended < 6, ended
    s.proc.wait(10)
    assert "shutdown grace of 1s is over: ending 1 requests still in flight" in s.log()
    deadline = time.monotonic() + 10
    while pids & all_runner_pids() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pids & all_runner_pids()


def test_an_idle_server_stops_at_once(start_server, models_dir: Path) -> None:
    s = start_server(models_dir, CORRAL_BUILTIN_MODELS="0")
    assert s.client.post("/api/generate", json=GEN).status_code == 200
    pids = s.runners()
    start = time.monotonic()
    s.proc.send_signal(signal.SIGTERM)
    s.proc.wait(10)
    assert time.monotonic() - start < 5
    deadline = time.monotonic() + 10
    while pids & all_runner_pids() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pids & all_runner_pids()


def _held(s, known: set[int]) -> int:
    """The pid of the server's runner, not among `known`, that holds itself still before its
    load (helpers.held_runner_env), once it does."""
    found: list[int] = []

    def stopped() -> bool:
        for pid in s.runners() - known:
            with contextlib.suppress(psutil.NoSuchProcess):
                if psutil.Process(pid).status() == psutil.STATUS_STOPPED:
                    found.append(pid)
                    return True
        return False

    s.wait_for(stopped, timeout=30, what="a runner held before its load")
    return found[0]


def _post_in_thread(url: str, body: dict) -> tuple[threading.Thread, list[httpx.Response]]:
    out: list[httpx.Response] = []

    def post() -> None:
        with httpx.Client(base_url=url, timeout=120) as c:
            out.append(c.post("/api/generate", json=body))

    t = threading.Thread(target=post, daemon=True)
    t.start()
    return t, out


def _assert_refused_for_shutdown(r: httpx.Response) -> None:
    assert r.status_code == 503, r.text
    assert r.json() == {"error": "server is shutting down"}
    assert int(r.headers["retry-after"]) >= 1


def test_sigterm_refuses_a_request_waiting_for_a_load_and_abandons_the_load(
    start_server, models_dir: Path, tmp_path: Path
) -> None:
    s = start_server(models_dir, CORRAL_SHUTDOWN_GRACE="60s", CORRAL_BUILTIN_MODELS="0",
                     **held_runner_env(tmp_path / "hold", "tiny.gguf"))  # fmt: skip
    waiting, answers = _post_in_thread(s.url, GEN)
    runner = _held(s, set())  # its load cannot finish: the process is stopped
    start = time.monotonic()
    s.proc.send_signal(signal.SIGTERM)
    waiting.join(60)
    assert answers, "the request waiting for the load got no answer"
    _assert_refused_for_shutdown(answers[0])
    s.proc.wait(30)  # the server is gone, the runner never continued
    print(f"the server stopped {time.monotonic() - start:.2f}s after SIGTERM")
    log = s.log()
    assert "abandoning the load of 'tiny:latest'" in log
    assert "model 'tiny:latest' ready" not in log
    s.wait_for(lambda: runner not in all_runner_pids(), timeout=10, what="the runner gone")


def test_sigterm_keeps_the_grace_for_a_stream_but_not_for_a_load(
    start_server, models_dir: Path, tmp_path: Path
) -> None:
    s = start_server(models_dir, CORRAL_SHUTDOWN_GRACE="60s", CORRAL_BUILTIN_MODELS="0",
                     CORRAL_CONTEXT_LENGTH="16384",
                     **held_runner_env(tmp_path / "hold", "tiny.gguf"))  # fmt: skip
    with s.client.stream("POST", "/api/generate", json=STREAM) as stream:
        assert stream.status_code == 200
        lines = stream.iter_lines()
        assert json.loads(next(lines))["done"] is False
        generating = s.runners()
        for pid in generating:  # the stream is surely still in flight at the SIGTERM
            os.kill(pid, signal.SIGSTOP)
        try:
            waiting, answers = _post_in_thread(s.url, GEN)
            loading = _held(s, generating)
            s.proc.send_signal(signal.SIGTERM)
            waiting.join(60)
            assert answers, "the request waiting for the load got no answer"
            _assert_refused_for_shutdown(answers[0])
            # The load is abandoned while the stream still holds the server up.
            s.wait_for(lambda: loading not in all_runner_pids(), timeout=10, what="the load gone")
            assert s.proc.poll() is None
        finally:
            for pid in generating:
                os.kill(pid, signal.SIGCONT)
        rest = [json.loads(line) for line in lines if line.strip()]
    assert rest[-1]["done"] is True and rest[-1]["eval_count"] == 200, rest[-1]
    s.proc.wait(30)
    assert "model 'tiny:latest' ready" not in s.log()
    s.wait_for(lambda: not generating & all_runner_pids(), timeout=10, what="the runners gone")
