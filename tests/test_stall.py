"""The watchdog: a runner that stops answering while it serves is killed, its clients get an
error naming the stall, and the next request loads it again; a long prompt being processed is
not a stall (the watchdog probes /health, which llama.cpp answers from its HTTP threads)."""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import aiohttp
import openai
import psutil
import pytest

from corral.config import ConfigError, Settings
from corral.core.spec import RunnerSpec
from corral.runtime.hop import Lease
from corral.runtime.measure import Record
from corral.runtime.runner_api import RunnerAPI
from corral.runtime.scheduler import Scheduler, SchedulerConfig
from corral.testing import synth
from corral.testing.server import CorralServer

StartServer = Callable[..., CorralServer]
STALL = 2.0  # CORRAL_RUNNER_STALL_TIMEOUT of the module's server, seconds
# A seeded random model never samples EOS with greedy decoding: the stream runs for seconds.
LONG = {
    "model": "long",
    "prompt": "once upon a time",
    "raw": True,
    "options": {"num_predict": 100000, "num_ctx": 16384, "temperature": 0},
}


@pytest.fixture(scope="module")
def stall_server(
    start_server: StartServer, models_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> CorralServer:
    d = tmp_path_factory.mktemp("stall-models")
    (d / "long.gguf").symlink_to(models_dir / "long.gguf")
    # Wide enough that a prompt takes seconds on a CPU (1,500 tokens: about 2-4 s on 2 cores),
    # with room for the prompt a faster machine needs to outlast the stall timeout.
    synth.write_llama_model(
        d / "slow.gguf", n_layer=16, n_embd=512, n_head=8, n_head_kv=8, n_ff=1024,
        context_length=32768, seed=5,
    )  # fmt: skip
    # No drafting: a random model's loops, drafted whole, would end an answer before the test
    # freezes its runner mid-stream
    (d / "models.toml").write_text(
        '[models.long]\nfile = "long.gguf"\nspeculative = "off"\n'
        '[models.slow]\nfile = "slow.gguf"\nspeculative = "off"\n'
    )
    return start_server(
        d,
        CORRAL_RUNNER_STALL_TIMEOUT=f"{STALL:g}s",
        CORRAL_NUM_PARALLEL="1",
        CORRAL_CONTEXT_LENGTH="2048",
        CORRAL_BUILTIN_MODELS="0",
    )


def test_stall_timeout_setting() -> None:
    def stall(value: str | None) -> float:
        env = {} if value is None else {"CORRAL_RUNNER_STALL_TIMEOUT": value}
        return Settings.load(environ=env).runner_stall_timeout

    assert stall(None) == 30.0
    assert stall("2s") == 2.0 and stall("1m") == 60.0
    assert stall("0") == math.inf and stall("-1s") == math.inf  # off
    with pytest.raises(ConfigError, match="CORRAL_RUNNER_STALL_TIMEOUT"):
        stall("soon")


def runner_pid(s: CorralServer, model: str) -> int:
    return next(m["pid"] for m in s.ps() if m["model"] == model and m["state"] != "unloading")


def freeze_mid_stream(s: CorralServer) -> tuple[int, float]:
    """SIGSTOP the runner 0.5 s into the stream; its pid and when it froze."""
    pid = runner_pid(s, "long:latest")
    time.sleep(0.5)
    os.kill(pid, signal.SIGSTOP)
    return pid, time.monotonic()


def test_frozen_runner_is_killed_and_its_client_gets_an_error(stall_server: CorralServer) -> None:
    s = stall_server
    lines: list[dict] = []
    with s.client.stream("POST", "/api/generate", json=LONG) as r:
        assert r.status_code == 200
        it = r.iter_lines()
        lines += [json.loads(next(it)) for _ in range(3)]  # it streams before it freezes
        pid, frozen = freeze_mid_stream(s)
        try:
            lines += [json.loads(line) for line in it]
            detected = time.monotonic() - frozen
        finally:
            if psutil.pid_exists(pid):
                os.kill(pid, signal.SIGCONT)
    print(f"stall detected {detected:.2f}s after SIGSTOP (stall timeout {STALL:g}s)")
    assert "error" in lines[-1], lines[-1]
    assert lines[-1]["error"] == (
        f"runner for model 'long:latest' stopped responding for {STALL:g}s and was killed"
    )
    assert len(lines) > 3  # the tokens before the freeze, then the error
    assert detected < STALL + 3
    assert "did not answer for 2s with requests in flight; killing it" in s.log()
    # It was killed, not continued: the next request loads a new runner.
    s.wait_for(lambda: not psutil.pid_exists(pid), timeout=5, what="the frozen runner to die")
    r2 = s.client.post(
        "/api/generate", json={**LONG, "stream": False, "options": {"num_predict": 4}}
    )
    assert r2.status_code == 200 and r2.json()["done"], r2.text
    assert runner_pid(s, "long:latest") != pid


def test_frozen_runner_on_the_openai_pass_through(stall_server: CorralServer) -> None:
    """The byte pass-through ends with an error event the openai SDK raises as APIError."""
    s = stall_server
    client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="x", max_retries=0, timeout=30)
    stream = client.chat.completions.create(
        model="long",
        messages=[{"role": "user", "content": "once upon a time"}],
        max_tokens=100000,
        temperature=0,
        stream=True,
    )
    pid = 0
    with pytest.raises(openai.APIError) as e:
        for i, _ in enumerate(stream):
            if i == 0:
                pid, _ = freeze_mid_stream(s)
    if pid and psutil.pid_exists(pid):
        os.kill(pid, signal.SIGCONT)
    assert f"stopped responding for {STALL:g}s and was killed" in e.value.message


def prompt_seconds(s: CorralServer, words: int, num_ctx: int) -> tuple[int, float]:
    """Tokens and seconds the slow model took to read a prompt of `words` x 6 tokens."""
    r = s.client.post(
        "/api/generate",
        json={"model": "slow", "prompt": " ".join(["hello world the cat sat"] * words),
              "raw": True, "stream": False,
              "options": {"num_predict": 1, "num_ctx": num_ctx}},
    )  # fmt: skip
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["done"]
    return body["prompt_eval_count"], body["prompt_eval_duration"] / 1e9


def test_long_prompt_does_not_trip_the_watchdog(stall_server: CorralServer) -> None:
    """A prompt that takes longer than the stall timeout to read: the prompt grows until it
    does on this machine, so the test proves the same on any CPU."""
    s = stall_server
    words, took = 100, 0.0
    for _ in range(6):  # grow the prompt until it takes twice the timeout (~30k tokens at most)
        tokens, took = prompt_seconds(s, words, 32768)
        if took > 2 * STALL or words == 5000:
            break
        words = min(5000, math.ceil(words * max(2.0, 3 * STALL / max(took, 0.01))))
    print(f"{tokens}-token prompt processed in {took:.2f}s under a {STALL:g}s stall timeout")
    assert took > STALL + 0.5, "the prompt must outlast the stall timeout for this test"
    assert "runner for model 'slow:latest' (pid" not in s.log()  # no stall logged for it


# ---- in process: the scheduler with a real runner, failures forced ----------------------------


async def leased(models_dir: Path, stall: float = math.inf) -> tuple[Scheduler, Lease]:
    sched = Scheduler({"cpu": 8 * 2**30}, SchedulerConfig(stall_timeout=stall))
    spec = RunnerSpec(path=str(models_dir / "long.gguf"), n_ctx=16384, num_parallel=1)
    return sched, await sched.acquire("long", spec, size=2**20)


async def stream(lease: Lease) -> AsyncIterator[bytes]:
    """A long generation on the leased runner, on one of its API's pooled connections (those
    `RunnerAPI.break_connections` ends)."""
    body = {"prompt": "once upon a time", "n_predict": 100000, "temperature": 0, "stream": True}
    async with lease.hop.api._session.post(
        "/completion", json=body, headers={"Connection": "close"}
    ) as resp:
        async for line in resp.content:
            yield line


async def until_broken(lines: AsyncIterator[bytes], timeout: float) -> float:
    """Seconds until the stream breaks (AssertionError if it ends or outlasts `timeout`)."""
    start = time.monotonic()
    try:
        async with asyncio.timeout(timeout):
            async for _ in lines:
                pass
    except aiohttp.ClientError:
        return time.monotonic() - start
    raise AssertionError("the stream ended without breaking")


def record_exits(sched: Scheduler, pid: int) -> list[bool]:
    """Whether the runner's process still existed each time the books were told it exited."""
    seen: list[bool] = []
    exited = sched._core.exited

    def spy(rid: int, now: float) -> None:
        seen.append(psutil.pid_exists(pid))
        exited(rid, now)

    sched._core.exited = spy
    return seen


async def test_a_failing_watch_kills_the_runner_and_frees_its_books(
    models_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fail = asyncio.Event()

    async def broken(self: Scheduler, rid: int, rec: Record) -> None:
        await fail.wait()
        raise RuntimeError("boom")

    monkeypatch.setattr(Scheduler, "_wait_exit", broken)
    sched, lease = await leased(models_dir)
    pid = lease.runner.pid
    assert pid is not None
    exits = record_exits(sched, pid)
    lines = stream(lease)
    await anext(lines)
    fail.set()
    await until_broken(lines, 10)  # its request fails
    lease.release()
    for _ in range(100):
        if exits:
            break
        await asyncio.sleep(0.05)
    assert exits == [False]  # the books were freed once, after the process was gone
    assert not sched.view().runners and not sched._runners
    await sched.shutdown()


async def test_a_failing_watchdog_kills_the_runner(
    models_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def broken(self: RunnerAPI, timeout: float) -> int | None:
        raise RuntimeError("boom")

    monkeypatch.setattr(RunnerAPI, "health", broken)
    sched, lease = await leased(models_dir, stall=1.0)
    pid = lease.runner.pid
    assert pid is not None
    exits = record_exits(sched, pid)
    await until_broken(stream(lease), 10)  # at the watchdog's first look
    lease.release()
    for _ in range(100):
        if exits:
            break
        await asyncio.sleep(0.05)
    assert exits == [False] and not sched.view().runners
    await sched.shutdown()


async def test_a_runner_that_cannot_die_yet_still_fails_its_streams(models_dir: Path) -> None:
    """A hung runner that SIGKILL cannot end at once (uninterruptible sleep; simulated: the
    kill does nothing): its streams break anyway, it gets no new requests, and its memory stays
    booked until it is really gone."""
    sched, lease = await leased(models_dir, stall=1.0)
    runner = lease.runner
    pid = runner.pid
    assert pid is not None
    runner.kill_now = lambda: None
    lines = stream(lease)
    await anext(lines)
    os.kill(pid, signal.SIGSTOP)
    try:
        took = await until_broken(lines, 10)
        assert took < 1.0 + 1.0 + 1.5  # stall timeout, a second for the kill, slack
        assert runner.failure_message() == (
            "runner for model 'long' stopped responding for 1s and was killed"
        )
        book = sched.view().runners[0]
        assert book.state == "unloading" and book.size > 0  # booked while the process lives
    finally:
        os.kill(pid, signal.SIGKILL)
    lease.release()
    for _ in range(100):
        if not sched.view().runners:
            break
        await asyncio.sleep(0.05)
    assert not sched.view().runners
    await sched.shutdown()
