"""Every stream ends with an answer or an error in its family's shape, never a bare close:
a runner killed mid-stream (every API family), and the server stopped mid-load (SIGTERM exits
within a second, leaves no runner, and open streams get "server is shutting down")."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import aiohttp
import httpx
import openai
import pytest

from corral.api.stream import LeasedStream
from corral.core.spec import RunnerSpec
from corral.runtime.meter import Meter
from corral.runtime.runner import Runner
from corral.testing import synth
from corral.testing.server import CorralServer, all_runner_pids

StartServer = Callable[..., CorralServer]
PROMPT = "once upon a time"
# A seeded random model never samples EOS with greedy decoding: the stream runs until its 16k
# context is full, seconds, long enough to kill the runner under it.
LONG = {
    "model": "long",
    "prompt": PROMPT,
    "raw": True,
    "options": {"num_predict": 100000, "temperature": 0},
}
KILLED = "runner for model 'long:latest' was killed by signal 9"


@pytest.fixture(scope="module")
def crash_server(start_server: StartServer, models_dir: Path) -> CorralServer:
    return start_server(models_dir, CORRAL_CONTEXT_LENGTH="16384", CORRAL_NUM_PARALLEL="1")


def kill_runner(s: CorralServer) -> int:
    pid = next(m["pid"] for m in s.ps() if m["model"] == "long:latest")
    os.kill(pid, signal.SIGKILL)
    return pid


def sse_events(r: httpx.Response) -> Iterator[tuple[str, dict[str, Any]]]:
    """(event name, data) pairs of an SSE response."""
    name = ""
    for line in r.iter_lines():
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            yield name, json.loads(line[6:])
            name = ""


def assert_next_request_succeeds(s: CorralServer, dead: int) -> None:
    r = s.client.post(
        "/api/generate", json={**LONG, "stream": False, "options": {"num_predict": 2}}
    )
    assert r.status_code == 200 and r.json()["done"], r.text
    assert all(m["pid"] != dead for m in s.ps())


def test_ollama_chat_ends_with_an_error_line(crash_server: CorralServer) -> None:
    s = crash_server
    body = {
        "model": "long",
        "messages": [{"role": "user", "content": PROMPT}],
        "options": {"num_predict": 100000, "temperature": 0},
    }
    with s.client.stream("POST", "/api/chat", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        first = json.loads(next(lines))
        assert first["message"]["content"] and not first["done"]
        pid = kill_runner(s)
        rest = [json.loads(line) for line in lines]
    assert rest and rest[-1]["error"].startswith(KILLED), rest[-1]
    assert_next_request_succeeds(s, pid)


def test_openai_pass_through_ends_with_an_error_event_the_sdk_raises(
    crash_server: CorralServer,
) -> None:
    s = crash_server
    client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="x", max_retries=0, timeout=30)
    stream = client.chat.completions.create(
        model="long",
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=100000,
        temperature=0,
        stream=True,
    )
    pid = 0
    with pytest.raises(openai.APIError) as e:  # not httpx.RemoteProtocolError
        for i, _chunk in enumerate(stream):
            if i == 1:
                pid = kill_runner(s)
    assert type(e.value) is openai.APIError, repr(e.value)  # not a connection error
    assert e.value.message.startswith(KILLED), e.value.message
    assert pid
    assert_next_request_succeeds(s, pid)


def test_openai_legacy_completions_pass_through_ends_with_an_error_event(
    crash_server: CorralServer,
) -> None:
    s = crash_server
    body = {"model": "long", "prompt": PROMPT, "max_tokens": 100000, "temperature": 0,
            "stream": True}  # fmt: skip
    with s.client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        events = sse_events(r)
        next(events)
        pid = kill_runner(s)
        rest = [data for _, data in events]
    assert rest[-1]["error"]["message"].startswith(KILLED), rest[-1]
    assert rest[-1]["error"]["type"] == "server_error"
    assert_next_request_succeeds(s, pid)


def test_anthropic_messages_end_with_an_error_event(crash_server: CorralServer) -> None:
    s = crash_server
    body = {
        "model": "long",
        "max_tokens": 100000,
        "temperature": 0,
        "stream": True,
        "messages": [{"role": "user", "content": PROMPT}],
    }
    with s.client.stream("POST", "/v1/messages", json=body) as r:
        assert r.status_code == 200
        events = sse_events(r)
        pid = 0
        seen: list[tuple[str, dict[str, Any]]] = []
        for name, data in events:
            seen.append((name, data))
            if name == "content_block_delta" and not pid:
                pid = kill_runner(s)
    name, data = seen[-1]
    assert name == "error" and data["type"] == "error", seen[-1]
    assert data["error"]["message"].startswith(KILLED)
    assert_next_request_succeeds(s, pid)


def test_responses_stream_ends_with_response_failed(crash_server: CorralServer) -> None:
    s = crash_server
    body = {
        "model": "long",
        "input": PROMPT,
        "max_output_tokens": 100000,
        "temperature": 0,
        "stream": True,
    }
    with s.client.stream("POST", "/v1/responses", json=body) as r:
        assert r.status_code == 200
        pid = 0
        seen: list[tuple[str, dict[str, Any]]] = []
        for name, data in sse_events(r):
            seen.append((name, data))
            if data.get("type") == "response.output_text.delta" and not pid:
                pid = kill_runner(s)
    last = seen[-1][1]
    assert last["type"] == "response.failed", last
    assert last["response"]["status"] == "failed"
    assert last["response"]["error"]["message"].startswith(KILLED)
    assert_next_request_succeeds(s, pid)


# ---- the server stopped while a model loads ---------------------------------------------------


def test_sigterm_during_a_load_exits_at_once_and_leaves_no_runner(
    start_server: StartServer, models_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    d = tmp_path_factory.mktemp("sigterm-models")
    (d / "long.gguf").symlink_to(models_dir / "long.gguf")
    # 512 MiB of KV cache at 64k context: a load of seconds for an 11 MB file.
    synth.write_llama_model(
        d / "bigctx.gguf", n_layer=8, n_embd=256, n_head=4, n_head_kv=4, n_ff=256,
        context_length=65536, seed=6,
    )  # fmt: skip
    s = start_server(
        d, CORRAL_BUILTIN_MODELS="0", CORRAL_NUM_PARALLEL="1", CORRAL_CONTEXT_LENGTH="16384",
        CORRAL_SHUTDOWN_GRACE="0",  # stop at once: streams are cut, not given time to end
    )  # fmt: skip
    answers: list[httpx.Response | Exception] = []

    def load() -> None:
        try:
            answers.append(httpx.post(
                f"{s.url}/api/generate",
                json={"model": "bigctx", "prompt": "hi", "stream": False,
                      "options": {"num_ctx": 65536, "num_predict": 1}},
                timeout=30,
            ))  # fmt: skip
        except Exception as e:  # recorded, asserted on below
            answers.append(e)

    with s.client.stream("POST", "/api/generate", json=LONG) as stream:
        assert stream.status_code == 200
        lines = stream.iter_lines()
        next(lines)
        t = threading.Thread(target=load)
        t.start()
        s.wait_for(
            lambda: any(m["model"] == "bigctx:latest" and m["state"] == "loading"
                        for m in s.ps()),
            timeout=10, what="the load to start",
        )  # fmt: skip
        pids = s.runners()
        assert len(pids) == 2
        time.sleep(0.3)
        assert any(m["state"] == "loading" for m in s.ps())
        start = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        rest = [json.loads(line) for line in lines]
    s.proc.wait(10)
    took = time.monotonic() - start
    t.join(10)
    print(f"SIGTERM during a load: server exited in {took:.2f}s")
    assert rest and rest[-1] == {"error": "server is shutting down"}, rest[-1:]
    assert isinstance(answers[0], httpx.Response), answers
    assert answers[0].status_code == 503, answers[0].text
    assert answers[0].json() == {"error": "server is shutting down"}
    assert took < 1.5
    assert not pids & all_runner_pids()


# ---- the pass-through's ending, piece by piece ----------------------------------------------


def ended(chunks: list[bytes], fail: Exception | None = None) -> bytes:
    """What LeasedStream sends for an upstream of `chunks` (then `fail`, if given), from a
    runner killed by SIGKILL."""
    runner = Runner("m", RunnerSpec(path="/nonexistent", n_ctx=16, num_parallel=1))
    runner.exit_code = -9
    released: list[bool] = []
    tally = Meter(time.monotonic).tally(runner, "m")
    lease = SimpleNamespace(runner=runner, release=lambda: released.append(True), tally=tally)

    async def body() -> AsyncIterator[bytes]:
        for c in chunks:
            yield c
        if fail is not None:
            raise fail

    async def run() -> bytes:
        resp = LeasedStream(body(), lease, None, "text/event-stream")
        return b"".join([c async for c in resp.body_iterator])

    return asyncio.run(run())


SIGKILLED = "runner for model 'm' was killed by signal 9 (SIGKILL: out of memory?)"


def error_event(message: str) -> bytes:
    err = {"message": message, "type": "server_error", "param": None, "code": None}
    return b"data: " + json.dumps({"error": err}, separators=(",", ":")).encode() + b"\n\n"


def test_a_complete_stream_passes_through_unchanged() -> None:
    chunks = [b'data: {"a":1}\n\ndata: {"b', b'":2}\n\ndata: [DO', b"NE]\n\n"]
    assert ended(chunks) == b"".join(chunks)


def test_a_broken_stream_drops_the_cut_event_and_ends_with_the_reason() -> None:
    out = ended([b'data: {"a":1}\n\n', b'data: {"b"'], aiohttp.ClientPayloadError("cut"))
    assert out == b'data: {"a":1}\n\n' + error_event(SIGKILLED)


def test_a_stream_ended_by_a_runner_error_line_reports_it() -> None:
    out = ended([b'data: {"a":1}\n\n', b'error: {"error":{"code":500,"message":"boom"}}\n\n'])
    assert out.endswith(b"\n\n" + error_event("boom"))


def test_a_stream_that_just_stops_says_why() -> None:
    out = ended([b'data: {"a":1}\n\ndata: {"b":2}'])
    assert out == (
        b'data: {"a":1}\n\ndata: {"b":2}\n\n'
        + error_event(SIGKILLED)
    )
