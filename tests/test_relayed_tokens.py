"""Tokens per second that are true: corral counts the tokens it relays as they pass, so while a
stream runs its tokens/s (dashboard, /api/ps, /metrics) agree with what the client itself
receives, through the byte pass-through, the events path and llama.cpp's native stream alike.

Nothing here assumes a speed: the server's count is compared with the client's own over the
same stretch of the stream (the tokens the client received between two reads of the server's
figures), and its rate with the client's rate over the same window of the client's own
arrival times."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from corral.runtime.meter import WINDOW
from corral.testing import synth
from corral.testing.server import CorralServer

MODEL = "long:latest"
PROMPT = "once upon a time"


@pytest.fixture(scope="module")
def meter_server(start_server, tmp_path_factory) -> CorralServer:
    # A seeded random model never samples EOS greedily: a stream runs until its context is full.
    # A model of 32 MiB, computed on one thread, gives a few hundred tokens a second: the
    # client and corral keep the other core and read as fast as the tokens come. (A runner of
    # a tiny model on both cores of a 2-core machine made thousands a second and could starve
    # the client, whose count then fell behind what corral had relayed.)
    d = tmp_path_factory.mktemp("meter-models")
    synth.write_llama_model(d / "long.gguf", target_bytes=32 << 20, context_length=32768, seed=2)
    (d / "models.toml").write_text(
        f'[models.long]\nfile = "{d / "long.gguf"}"\nnum_thread = 1\n'
    )
    return start_server(d, CORRAL_CONTEXT_LENGTH="16384", CORRAL_NUM_PARALLEL="2")


def _openai(line: str) -> bool:
    if not line.startswith("data: ") or line == "data: [DONE]":
        return False
    choices = json.loads(line[6:]).get("choices") or [{}]
    return bool((choices[0].get("delta") or {}).get("content"))


def _ollama(line: str) -> bool:
    return bool(line) and not (data := json.loads(line)).get("done") and bool(data["response"])


def _native(line: str) -> bool:
    return line.startswith("data: ") and json.loads(line[6:]).get("stop") is False


# (path, body, whether a line of the answer is a token): the pass-through, the events path
# (Ollama's NDJSON rendered from corral's events) and llama.cpp's own stream.
STREAMS: dict[str, tuple[str, dict[str, Any], Callable[[str], bool]]] = {
    "pass-through": ("/v1/chat/completions", {
        "model": "long", "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 100000, "temperature": 0, "stream": True,
    }, _openai),
    "events": ("/api/generate", {
        "model": "long", "prompt": PROMPT, "raw": True,
        "options": {"num_predict": 100000, "temperature": 0},
    }, _ollama),
    "native": ("/completion", {
        "model": "long", "prompt": PROMPT, "n_predict": 100000, "temperature": 0,
        "stream": True,
    }, _native),
}  # fmt: skip


class Stream:
    """A stream read in a thread of its own, each token's arrival time noted."""

    def __init__(self, s: CorralServer, kind: str) -> None:
        self.path, self.body, self.is_token = STREAMS[kind]
        self.client = httpx.Client(base_url=s.url, timeout=120)
        self.times: list[float] = []
        self.stop = threading.Event()
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            with self.client.stream("POST", self.path, json=self.body) as r:
                assert r.status_code == 200, r.read()
                for line in r.iter_lines():
                    if self.is_token(line):
                        self.times.append(time.monotonic())
                    if self.stop.is_set():
                        return
        except BaseException as e:
            self.error = e
        finally:
            self.done.set()

    def wait_for(self, n: int, s: CorralServer) -> None:
        s.wait_for(lambda: len(self.times) >= n or self.done.is_set(), 120, f"{n} tokens")
        assert not self.done.is_set(), f"the stream ended early: {self.error!r}"

    def received(self, until: float) -> int:
        return sum(1 for t in self.times if t <= until)

    def rate(self, now: float) -> float:
        """The client's own tokens/s at `now`, as the meter defines it: over the last WINDOW
        seconds, or since the first token for a younger stream (its first token starts the
        clock)."""
        first = self.times[0]
        if now - first < WINDOW:
            return (self.received(now) - 1) / (now - first)
        return (self.received(now) - self.received(now - WINDOW)) / WINDOW

    def close(self) -> None:
        self.stop.set()
        self.done.wait(60)
        self.client.close()


class Figures:
    """The server's figures for the model, its state document's entry and its /api/ps entry,
    each with the moment it stands for on the client's clock (the middle of its request)."""

    def __init__(self, s: CorralServer) -> None:
        t0 = time.monotonic()
        state = s.client.get("/api/corral/state", params={"model": MODEL}).json()
        t1 = time.monotonic()
        self.ps = next(m for m in s.ps() if m["model"] == MODEL)
        t2 = time.monotonic()
        (self.state,) = state["models"]
        self.at, self.ps_at = (t0 + t1) / 2, (t1 + t2) / 2


def relayed_total(s: CorralServer) -> float:
    for line in s.client.get("/metrics").text.splitlines():
        if line.startswith(f'corral_relayed_tokens_total{{model="{MODEL}"}}'):
            return float(line.split()[-1])
    return 0.0


def near(got: float, want: float) -> bool:
    return abs(got - want) <= 0.2 * want


@pytest.mark.parametrize("kind", list(STREAMS))
def test_relayed_tokens_per_second_match_the_clients_own_while_a_stream_runs(
    meter_server: CorralServer, kind: str
) -> None:
    s = meter_server
    stream = Stream(s, kind)
    try:
        stream.wait_for(20, s)
        one = Figures(s)
        k1 = stream.received(one.at)
        stream.wait_for(k1 + 1000, s)
        two = Figures(s)
        k2 = stream.received(two.at)
        # The tokens the server relayed between its two reads are those the client received.
        relayed = two.state["tokens"]["relayed"] - one.state["tokens"]["relayed"]
        assert near(relayed, k2 - k1), (relayed, k2 - k1)
        # Its rate is the client's own over the same window (the model's, the runner's, the
        # stream's slot's and /api/ps's alike: one stream runs).
        mine = stream.rate(two.at)
        state2, ps2 = two.state, two.ps
        runner = state2["runner"]
        assert state2["state"] == "ready" and runner["in_use"] == 1
        for name, got in (
            ("model", state2["tokens_per_second"]["generated"]),
            ("runner", runner["tokens_per_second"]),
            ("slot", runner["slot_tokens_per_second"][0]),
        ):
            assert near(got, mine), (name, got, mine)
        assert near(ps2["tokens_per_second"], stream.rate(two.ps_at))
        assert runner["slot_tokens_per_second"][1:] == [0.0]
        assert ps2["slot_tokens_per_second"][0] > 0 and len(ps2["slot_tokens_per_second"]) == 2
        assert relayed_total(s) >= state2["tokens"]["relayed"]
    finally:
        stream.close()
    # Once idle, the rate falls to 0 (llama.cpp's counters would show the last request's).
    s.wait_for(
        lambda: next(m for m in s.ps() if m["model"] == MODEL)["tokens_per_second"] == 0,
        60, "the rate to fall to 0 once idle",
    )  # fmt: skip
    (idle,) = s.client.get("/api/corral/state", params={"model": MODEL}).json()["models"]
    assert idle["tokens_per_second"]["generated"] == 0
    assert idle["runner"]["slot_tokens_per_second"] == [0.0, 0.0]
    assert idle["tokens"]["relayed"] >= k2


def test_each_slot_has_its_streams_rate(meter_server: CorralServer) -> None:
    """Two streams at once on a runner with two slots: each slot's rate is its own client's,
    and the runner's and the model's are their sum."""
    s = meter_server
    s.wait_for(lambda: all(m["requests_in_flight"] == 0 for m in s.ps()), 60, "no request")
    first = Stream(s, "pass-through")
    second: Stream | None = None
    try:
        first.wait_for(20, s)  # the first stream's first tokens took slot 0
        second = Stream(s, "events")
        second.wait_for(500, s)
        first.wait_for(1, s)  # still running
        now = Figures(s)
        runner = now.state["runner"]
        assert runner["in_use"] == 2
        slots = runner["slot_tokens_per_second"]
        mine = [first.rate(now.at), second.rate(now.at)]
        assert near(slots[0], mine[0]) and near(slots[1], mine[1]), (slots, mine)
        assert runner["tokens_per_second"] == pytest.approx(sum(slots), abs=0.05)
        assert near(now.state["tokens_per_second"]["generated"], sum(mine))
        assert near(now.ps["tokens_per_second"], first.rate(now.ps_at) + second.rate(now.ps_at))
    finally:
        first.close()
        if second is not None:
            second.close()


def _sse_data(text: str) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]  # fmt: skip


# (path, body, the answer's own count of generated tokens): every way an answer is relayed
ANSWERS: dict[str, tuple[str, dict[str, Any], Callable[[httpx.Response], int]]] = {
    "openai stream": ("/v1/chat/completions", {
        "model": "long", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 6,
        "stream": True, "stream_options": {"include_usage": True},
    }, lambda r: _sse_data(r.text)[-1]["usage"]["completion_tokens"]),
    "openai whole": ("/v1/chat/completions", {
        "model": "long", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 6,
    }, lambda r: r.json()["usage"]["completion_tokens"]),
    "openai n=2": ("/v1/chat/completions", {
        "model": "long", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 6,
        "n": 2,
    }, lambda r: r.json()["usage"]["completion_tokens"]),
    "legacy stream": ("/v1/completions", {
        "model": "long", "prompt": PROMPT, "max_tokens": 6, "stream": True,
    }, lambda r: _sse_data(r.text)[-1]["usage"]["completion_tokens"]),
    "ollama stream": ("/api/chat", {
        "model": "long", "messages": [{"role": "user", "content": PROMPT}],
        "options": {"num_predict": 6},
    }, lambda r: json.loads(r.text.splitlines()[-1])["eval_count"]),
    "ollama whole": ("/api/generate", {
        "model": "long", "prompt": PROMPT, "stream": False, "options": {"num_predict": 6},
    }, lambda r: r.json()["eval_count"]),
    "native stream": ("/completion", {
        "model": "long", "prompt": PROMPT, "n_predict": 6, "stream": True,
    }, lambda r: _sse_data(r.text)[-1]["tokens_predicted"]),
    "native whole": ("/completion", {"model": "long", "prompt": PROMPT, "n_predict": 6},
                     lambda r: r.json()["tokens_predicted"]),
}  # fmt: skip


@pytest.mark.parametrize("kind", list(ANSWERS))
def test_every_answer_counts_exactly_its_tokens(meter_server: CorralServer, kind: str) -> None:
    s = meter_server
    path, body, own = ANSWERS[kind]

    def relayed() -> int:
        (model,) = s.client.get("/api/corral/state", params={"model": MODEL}).json()["models"]
        return int((model["tokens"] or {}).get("relayed") or 0)

    # An earlier test's streams, closed by their clients, end on their own time: their last
    # tokens must be counted before this answer's window opens.
    s.wait_for(lambda: all(m["requests_in_flight"] == 0 for m in s.ps()), 60, "no request")
    before = relayed()
    r = s.client.post(path, json=body)
    assert r.status_code == 200, r.text
    assert own(r) > 0
    assert relayed() - before == own(r)
