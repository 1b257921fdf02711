"""Graceful shutdown: on SIGTERM new requests get 503 with Retry-After, those in flight finish
within CORRAL_SHUTDOWN_GRACE, then every runner stops. Real `corral serve` processes."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import httpx

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
