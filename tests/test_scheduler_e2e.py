"""The scheduler end to end, with real runners under memory pressure: eviction, waiting for busy
models, coalesced and first-come-first-served loads, the queue limit, clients that leave, reloads
with new options, a warm model's latency while another loads, models that can never fit, and an
embedding model among chat models.

Sizes are learned, not hard-coded: a module fixture loads every model on an unlimited server and
reads what the scheduler books for each from /api/ps. The servers under pressure then get a
CORRAL_MEMORY_LIMIT that holds any two of the chat models a, b, c, d but never three.

Every model has a 32k training context and the servers default to a 4096-token context, so a
greedy stream (temperature 0 on random weights never samples EOS) runs for thousands of tokens:
a "busy" model stays busy until the test closes its stream. Nothing here asserts a duration;
timings are printed (pytest -s).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from corral.core.estimate import RUNNER_CODE_BYTES
from corral.testing import synth
from corral.testing.server import CorralServer

MiB = 2**20
CTX = 4096  # every server's default context: long enough for streams that outlast a test step
CHAT = ("a", "b", "c", "d")
BASE_ENV = {
    "CORRAL_CONTEXT_LENGTH": str(CTX),
    "CORRAL_NUM_PARALLEL": "1",
    "CORRAL_KEEP_ALIVE": "10m",
    "CORRAL_EVICTION_POLICY": "lru",
    "CORRAL_BUILTIN_MODELS": "0",
}
BUSY = "server busy, please try again.  maximum pending requests exceeded"


def name(model: str) -> str:
    return f"{model}:latest"


# --------------------------------------------------------------------------- models and sizes


@pytest.fixture(scope="module")
def e2e_models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("e2e_models")
    # ~40/50/60 MB chat models (d is b's size with other weights: close enough in size that
    # any two fit where three do not, with a wide margin) and a ~250 MB one that takes a moment
    # to load; all with a 32k training context so streams can run long.
    for model, mb, seed in (("a", 40, 21), ("b", 50, 22), ("c", 60, 23), ("d", 50, 24)):
        synth.write_llama_model(
            d / f"{model}.gguf", target_bytes=mb * 10**6, context_length=32768, seed=seed
        )
    synth.write_llama_model(d / "big.gguf", target_bytes=250 * 10**6, context_length=32768, seed=25)
    # An embedding model about as big as the chat models, so it takes part in the pressure.
    synth.write_bert_model(d / "embed.gguf", n_layer=8, n_embd=512, n_head=8, n_ff=2048)
    return d


@dataclass(frozen=True)
class Sizes:
    booked: dict[str, int]  # what /api/ps showed for each loaded model on an unlimited server
    limit: int  # holds any two of a, b, c, d but not three


def slack(n: int) -> int:
    """A memory limit that surely admits what was booked as n bytes once loaded (and the
    runners' shared code, booked once for all of them)."""
    return int(n * 1.1) + 8 * MiB + RUNNER_CODE_BYTES


@pytest.fixture(scope="module")
def sizes(start_server, e2e_models: Path) -> Sizes:
    s = start_server(e2e_models, **BASE_ENV)
    try:
        bg = Background()
        for m in CHAT:
            bg.post(s, m, "/api/generate", {"model": m})  # load only
        bg.post(s, "embed", "/api/embed", {"model": "embed", "input": []})  # loads it
        done = bg.join(s)
        assert all(status == 200 for _, status, _ in done), done
        booked = {e["model"].removesuffix(":latest"): int(e["size"]) for e in s.ps()}
    finally:
        s.stop_and_check()
    assert set(booked) == {*CHAT, "embed"}, booked
    pairs = [booked[x] + booked[y] for x, y in itertools.combinations(CHAT, 2)]
    triples = [sum(booked[m] for m in t) for t in itertools.combinations(CHAT, 3)]
    # Once loaded, a runner's real allocation may replace its estimate in the books (the estimate
    # errs high, by up to ~10%): leave room for a second model's estimate beside a real size.
    limit = slack(max(pairs))
    print(
        "\nbooked sizes (MiB):", {m: round(v / MiB, 1) for m, v in booked.items()},
        f"limit {limit / MiB:.1f} MiB",
    )  # fmt: skip
    room = limit - RUNNER_CODE_BYTES  # for the runners themselves
    assert min(triples) > room, f"models too close in size for a two-but-not-three limit: {booked}"
    # test_embedding_model_...: embed fits beside any one chat model, not beside b and c.
    assert max(booked["embed"] + booked[m] for m in CHAT) <= room
    assert booked["b"] + booked["c"] + booked["embed"] > room
    return Sizes(booked, limit)


# --------------------------------------------------------------------------- servers


@pytest.fixture
def serve(start_server, e2e_models: Path) -> Iterator[Callable[..., CorralServer]]:
    """Start servers on the e2e models for one test; they are stopped when it ends."""
    started: list[CorralServer] = []

    def start(**env: str) -> CorralServer:
        s = start_server(e2e_models, **{**BASE_ENV, **env})
        started.append(s)
        return s

    yield start
    for s in started:
        s.stop_and_check()


@pytest.fixture
def pressure(serve, sizes: Sizes) -> CorralServer:
    """A server whose memory holds any two chat models but not three."""
    return serve(CORRAL_MEMORY_LIMIT=str(sizes.limit))


# --------------------------------------------------------------------------- helpers


def gen(s: CorralServer, model: str, client: httpx.Client | None = None, **body) -> httpx.Response:
    """A short non-streamed generate."""
    return (client or s.client).post(
        "/api/generate",
        json={"model": model, "prompt": "hi", "stream": False, "options": {"num_predict": 2}}
        | body,
    )


def load(s: CorralServer, model: str, **body) -> httpx.Response:
    """Ollama's load-only request (no prompt)."""
    return s.client.post("/api/generate", json={"model": model, **body})


def loaded(s: CorralServer) -> dict[str, dict[str, Any]]:
    """Models with a runner that is loading or serving (not one on its way out)."""
    return {m["model"]: m for m in s.ps() if m["state"] != "unloading"}


def queued(s: CorralServer, model: str) -> int:
    """Requests for the model waiting in the scheduler's queue."""
    doc = s.client.get("/api/corral/state", params={"model": model}).json()
    return sum(int(m["queued"]) for m in doc["models"] if m["name"] == name(model))


def settled(s: CorralServer) -> bool:
    return all(
        m["state"] == "ready" and m["requests_in_flight"] == 0 and m["queued"] == 0 for m in s.ps()
    )


def assert_no_leak(s: CorralServer) -> list[dict[str, Any]]:
    """Once nothing is loading, unloading or waiting: one runner process per /api/ps entry and
    at most one runner per model."""
    s.wait_for(lambda: settled(s), timeout=30, what="the scheduler to settle")
    ps = s.ps()
    names = [m["model"] for m in ps]
    assert len(names) == len(set(names)), f"two runners for one model: {ps}"
    pids = s.runners()
    assert len(pids) == len(ps), f"runner processes {pids} but /api/ps has {ps}"
    assert {m["pid"] for m in ps} == pids
    return ps


def lines_with(s: CorralServer, *needles: str) -> list[str]:
    return [ln for ln in s.log().splitlines() if all(n in ln for n in needles)]


def loads_of(s: CorralServer, model: str) -> int:
    return len(re.findall(rf"\bloading model '{re.escape(name(model))}'", s.log()))


def evictions(s: CorralServer, victim: str, beneficiary: str) -> list[str]:
    return lines_with(s, f"'{name(victim)}'", f"evicted to make room for '{name(beneficiary)}'")


def first_load(s: CorralServer, model: str) -> int:
    """The log line number where the model's first load started."""
    for i, ln in enumerate(s.log().splitlines()):
        if re.search(rf"\bloading model '{re.escape(name(model))}'", ln):
            return i
    raise AssertionError(f"{model} never loaded:\n{s.log()[-3000:]}")


class Stream:
    """A long greedy generation holding one runner slot until close(). Its first chunk has
    arrived when the constructor returns, so the slot is granted and the runner generating."""

    def __init__(self, s: CorralServer, model: str) -> None:
        self.client = httpx.Client(base_url=s.url, timeout=60)
        body = {
            "model": model,
            "prompt": "once upon a time",
            "raw": True,
            # One thread: two busy streams then leave the loads and requests under test some CPU
            # on a 2-core machine (num_thread shapes the runner; requests that do not set it
            # share that runner).
            "options": {"num_predict": 100000, "temperature": 0, "num_thread": 1},
        }
        self._cm = self.client.stream("POST", "/api/generate", json=body)
        try:
            self.response = self._cm.__enter__()
            assert self.response.status_code == 200, self.response.read()
            self.lines = self.response.iter_lines()  # keep it: a dropped iterator closes the stream
            self.more(1)
        except BaseException:
            self.close()
            raise

    def more(self, n: int = 3) -> None:
        """Read n more chunks: the stream is still generating."""
        for _ in range(n):
            chunk = json.loads(next(self.lines))
            assert "error" not in chunk and not chunk["done"], chunk

    def close(self) -> None:
        """Disconnect: the server releases the slot."""
        with contextlib.suppress(Exception):
            self._cm.__exit__(None, None, None)
        self.client.close()


@contextlib.contextmanager
def streams(s: CorralServer, *models: str) -> Iterator[dict[str, Stream]]:
    out: dict[str, Stream] = {}
    try:
        for m in models:
            out[m] = Stream(s, m)
        yield out
    finally:
        for st in out.values():
            st.close()


def raw_request(s: CorralServer, path: str, body: dict[str, Any]) -> socket.socket:
    """Send a request on a bare socket, so the test decides when the client disconnects."""
    data = json.dumps(body).encode()
    host, port = s.host.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)))
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {s.host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n"
    )
    sock.sendall(head.encode() + data)
    return sock


def raw_status(sock: socket.socket, timeout: float) -> int | str:
    """The HTTP status of the response to a raw_request (read to the end), or "timeout"."""
    sock.settimeout(timeout)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except TimeoutError:
        return "timeout"
    return int(data.split(b" ", 2)[1])


class Background:
    """Requests in threads, recording status and completion order."""

    def __init__(self, timeout: float = 120) -> None:
        self.timeout = timeout  # each request's client timeout
        self.threads: list[threading.Thread] = []
        self.done: list[tuple[str, int, Any]] = []  # (label, status, body) in completion order
        self.errors: list[BaseException] = []
        self._lock = threading.Lock()

    def post(self, s: CorralServer, label: str, path: str, body: dict[str, Any]) -> None:
        def run() -> None:
            try:
                with httpx.Client(base_url=s.url, timeout=self.timeout) as c:
                    r = c.post(path, json=body)
                with self._lock:
                    self.done.append((label, r.status_code, r.json()))
            except BaseException as e:  # surfaced by join()
                self.errors.append(e)

        t = threading.Thread(target=run, daemon=True)
        t.start()
        self.threads.append(t)

    def gen(self, s: CorralServer, label: str, model: str) -> None:
        body = {"model": model, "prompt": "hi", "stream": False, "options": {"num_predict": 2}}
        self.post(s, label, "/api/generate", body)

    def alive(self) -> int:
        return sum(t.is_alive() for t in self.threads)

    def join(self, s: CorralServer, timeout: float = 60) -> list[tuple[str, int, Any]]:
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        log = s.log()[-3000:]
        assert not self.errors, f"{self.errors}; finished: {self.done}; server log:\n{log}"
        assert not self.alive(), f"requests did not finish; finished: {self.done}; log:\n{log}"
        return self.done


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]


def dist(xs: list[float]) -> str:
    ms = [x * 1000 for x in xs]
    return f"n={len(ms)} p50={pct(ms, 50):.1f}ms p99={pct(ms, 99):.1f}ms max={max(ms):.1f}ms"


# --------------------------------------------------------------------------- tests


def test_eviction_makes_room_for_a_new_model_least_recently_used_first(pressure) -> None:
    s = pressure
    assert load(s, "a").status_code == 200
    assert load(s, "b").status_code == 200
    assert gen(s, "a").status_code == 200  # a is now more recently used than b
    assert set(loaded(s)) == {name("a"), name("b")}
    r = gen(s, "c")
    assert r.status_code == 200 and r.json()["done"], r.text
    ps = assert_no_leak(s)
    assert {m["model"] for m in ps} == {name("a"), name("c")}
    assert len(evictions(s, "b", "c")) == 1, s.log()[-3000:]
    assert not evictions(s, "a", "c")


def test_request_waits_for_a_busy_model_and_evicts_it_when_its_stream_ends(pressure) -> None:
    s = pressure
    bg = Background()
    with streams(s, "a", "b") as st:
        pids = {m: loaded(s)[name(m)]["pid"] for m in ("a", "b")}
        t = time.monotonic()
        bg.gen(s, "c", "c")
        # c is waiting: memory is full of busy models
        s.wait_for(lambda: queued(s, "c") == 1, timeout=30, what="c's request queued")
        st["a"].more()
        st["b"].more()
        assert bg.alive() == 1 and not bg.done
        now = loaded(s)
        assert set(now) == {name("a"), name("b")}, now
        assert all(now[name(m)]["requests_in_flight"] == 1 for m in ("a", "b"))
        assert {m: now[name(m)]["pid"] for m in ("a", "b")} == pids
        assert "evicted" not in s.log() and loads_of(s, "c") == 0
        st["a"].close()  # a's stream ends: a is idle, so it can go
        done = bg.join(s)
        print(f"\nc served {time.monotonic() - t:.2f}s after it was requested")
        assert [(label, status) for label, status, _ in done] == [("c", 200)], done
        st["b"].more()  # b kept streaming throughout
        assert set(loaded(s)) == {name("b"), name("c")}
        assert len(evictions(s, "a", "c")) == 1
        assert not evictions(s, "b", "c")
    assert_no_leak(s)


def test_concurrent_requests_for_an_unloaded_model_share_one_load_and_one_eviction(
    pressure,
) -> None:
    s = pressure
    assert load(s, "a").status_code == 200
    assert load(s, "b").status_code == 200
    bg = Background()
    for i in range(6):
        bg.gen(s, f"c{i}", "c")
    done = bg.join(s)
    assert sorted(status for _, status, _ in done) == [200] * 6, done
    assert loads_of(s, "c") == 1, s.log()[-3000:]
    assert len(evictions(s, "a", "c")) == 1 and not evictions(s, "b", "c")
    assert {m["model"] for m in assert_no_leak(s)} == {name("b"), name("c")}


def test_waiting_loads_start_first_come_first_served(pressure) -> None:
    s = pressure
    bg = Background()
    with streams(s, "a", "b") as st:
        bg.gen(s, "c", "c")
        # c's request is queued first (a busy CI machine once got d's there sooner) ...
        s.wait_for(lambda: queued(s, "c") == 1, timeout=30, what="c's request queued")
        bg.gen(s, "d", "d")  # ...then d's; both wait for memory
        s.wait_for(lambda: queued(s, "d") == 1, timeout=30, what="d's request queued")
        st["a"].more()
        st["b"].more()
        assert bg.alive() == 2 and loads_of(s, "c") == loads_of(s, "d") == 0
        st["a"].close()  # room for one load: c's, since it came first
        done = bg.join(s)
        print(f"\ncompletion order: {[label for label, _, _ in done]}")
        assert sorted((label, status) for label, status, _ in done) == [("c", 200), ("d", 200)]
        assert first_load(s, "c") < first_load(s, "d")
        # c took a's place; d then took c's once c was idle (b was streaming all along).
        assert len(evictions(s, "a", "c")) == 1 and len(evictions(s, "c", "d")) == 1
        assert not lines_with(s, "'b:latest'", "evicted")
        st["b"].more()
        assert set(loaded(s)) == {name("b"), name("d")}
    assert_no_leak(s)


def test_queue_limit_answers_server_busy_in_both_api_shapes(serve) -> None:
    s = serve(CORRAL_MAX_QUEUE="2")
    bg = Background()
    with streams(s, "a") as st:  # a's only slot is busy
        bg.gen(s, "q1", "a")
        bg.gen(s, "q2", "a")
        s.wait_for(lambda: loaded(s)[name("a")]["queued"] == 2, timeout=10, what="2 queued")
        r = gen(s, "a")
        assert r.status_code == 503
        assert r.json() == {"error": BUSY}
        assert int(r.headers["retry-after"]) >= 1  # when a slot is likely free again
        r = s.client.post(
            "/v1/chat/completions",
            json={"model": "a", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        )
        assert r.status_code == 503
        err = r.json()["error"]
        assert err["message"] == BUSY and isinstance(err["type"], str) and "param" in err, err
        assert int(r.headers["retry-after"]) >= 1  # the OpenAI SDK retries after it
        assert loaded(s)[name("a")]["queued"] == 2  # refused requests leave no queue entry
        st["a"].more()
    done = bg.join(s)
    assert sorted((label, status) for label, status, _ in done) == [("q1", 200), ("q2", 200)]
    r = gen(s, "a")
    assert r.status_code == 200 and r.json()["done"]
    assert_no_leak(s)


def test_a_request_queued_behind_a_busy_runner_is_listed_until_it_is_served(serve) -> None:
    """The dashboard's state and /api/corral/books list a request waiting for a's only slot:
    place 1 of 1, why it waits, for how long; once the slot frees it is served and gone."""
    s = serve()

    def waiting(path: str = "/api/corral/state") -> list[dict[str, Any]]:
        return list(s.client.get(path).json()["waiting"])

    bg = Background()
    with streams(s, "a") as st:  # a's only slot is busy until the stream closes
        assert waiting() == []
        bg.gen(s, "q", "a")
        s.wait_for(lambda: bool(waiting()), timeout=10, what="the request listed")
        (w,) = waiting()
        assert (w["model"], w["place"], w["of"], w["position"]) == (name("a"), 1, 1, 1)
        assert w["why"] == "busy" and w["reason"] == "every slot of its model is busy"
        doc = s.client.get("/api/corral/state", params={"model": "a"}).json()
        assert w["waited"] >= 0 and w["runner"] == doc["models"][0]["runner"]["id"]
        assert [x["request"] for x in waiting("/api/corral/books")] == [w["request"]]
        assert loaded(s)[name("a")]["queued"] == 1
        st["a"].more()
    (done,) = bg.join(s)
    assert done[1] == 200
    assert waiting() == [] and waiting("/api/corral/books") == []
    assert_no_leak(s)


def test_client_leaving_while_its_model_loads_leaves_no_queue_entry_or_runner(serve) -> None:
    s = serve()
    body = {"model": "big", "prompt": "hi", "stream": False, "options": {"num_predict": 2}}
    saw_loading = False
    for attempt in range(3):
        sock = raw_request(s, "/api/generate", body)
        try:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                state = loaded(s).get(name("big"), {}).get("state")
                if state == "loading":
                    saw_loading = True
                    break
                if state == "ready":
                    break  # it loaded before we looked: try again
                time.sleep(0.005)
        finally:
            sock.close()  # the client leaves while the model is loading
        if saw_loading:
            break
        print(f"\nattempt {attempt}: big loaded before a poll saw it loading; retrying")
        assert load(s, "big", keep_alive=0).status_code == 200
        s.wait_for(lambda: name("big") not in {m["model"] for m in s.ps()}, what="unload")
    assert saw_loading, "never caught the 250 MB model loading"
    ps = assert_no_leak(s)  # its load finished or was abandoned; either way nothing is left over
    kept = [m["model"] for m in ps] == [name("big")]
    assert kept or not ps, ps
    n = loads_of(s, "big")
    r = gen(s, "big")  # the model still serves, from the runner that stayed if one did
    assert r.status_code == 200 and r.json()["done"], r.text
    assert loads_of(s, "big") == n + (0 if kept else 1)
    assert_no_leak(s)


def test_client_leaving_while_queued_for_memory_leaves_nothing_behind(pressure) -> None:
    s = pressure
    with streams(s, "a", "b") as st:
        body = {"model": "c", "prompt": "hi", "stream": False, "options": {"num_predict": 2}}
        sock = raw_request(s, "/api/generate", body)
        # c waits for memory...
        s.wait_for(lambda: queued(s, "c") == 1, timeout=30, what="c's request queued")
        sock.close()  # ...and its client gives up
        s.wait_for(lambda: queued(s, "c") == 0, timeout=30, what="c's request gone from the queue")
        st["a"].close()  # memory could be freed now: a stale queue entry would evict a for c
        s.wait_for(
            lambda: loaded(s)[name("a")]["requests_in_flight"] == 0, timeout=10, what="a idle"
        )
        st["b"].more()
    ps = assert_no_leak(s)
    assert {m["model"] for m in ps} == {name("a"), name("b")}
    assert loads_of(s, "c") == 0 and "evicted" not in s.log(), s.log()[-3000:]
    assert gen(s, "a").status_code == 200  # a was not disturbed


def test_client_leaving_while_waiting_for_a_reload_leaves_the_runner_alone(serve) -> None:
    """A request with another num_ctx waits for the busy runner to drain; if its client leaves,
    nothing is waiting for new options any more, so the runner must stay as it is."""
    s = serve()
    with streams(s, "a") as st:
        pid = loaded(s)[name("a")]["pid"]
        body = {"model": "a", "prompt": "hi", "stream": False,
                "options": {"num_predict": 2, "num_ctx": 2048}}  # fmt: skip
        sock = raw_request(s, "/api/generate", body)
        s.wait_for(lambda: loaded(s)[name("a")]["queued"] == 1, timeout=10, what="queued")
        sock.close()
        s.wait_for(lambda: loaded(s)[name("a")]["queued"] == 0, timeout=10, what="queue entry gone")
        st["a"].more()
    ps = assert_no_leak(s)
    assert not lines_with(s, "reloading with new options"), s.log()[-2000:]
    assert [(m["model"], m["pid"], m["context_length"]) for m in ps] == [(name("a"), pid, CTX)]
    r = gen(s, "a")  # served by the same runner, at once
    assert r.status_code == 200 and loaded(s)[name("a")]["pid"] == pid


def test_waiting_requests_with_alternating_num_ctx_are_all_served(pressure) -> None:
    """num_ctx 1024, 2048, 1024 arrive in that order while the model loads for the first: each
    is served (the first by that runner, then one reload each way), and no runner is stopped
    before the request it was loaded for has run."""
    s = pressure
    t = time.monotonic()
    socks = []
    for ctx in (1024, 2048, 1024):
        body = {"model": "a", "prompt": "hi", "stream": False,
                "options": {"num_predict": 2, "num_ctx": ctx}}  # fmt: skip
        socks.append(raw_request(s, "/api/generate", body))
    try:
        deadline = time.monotonic() + 30
        statuses = [raw_status(sock, max(0.1, deadline - time.monotonic())) for sock in socks]
    finally:
        for sock in socks:
            sock.close()
    print(f"\n{loads_of(s, 'a')} loads of a in {time.monotonic() - t:.2f}s")
    assert statuses == [200, 200, 200], f"{statuses}; {loads_of(s, 'a')} loads; {s.log()[-3000:]}"
    assert loads_of(s, "a") <= 3
    assert_no_leak(s)


def test_rapid_reloads_with_alternating_num_ctx_and_clients_leaving(pressure) -> None:
    s = pressure
    results: list[tuple[int, int, Any]] = []
    errors: list[BaseException] = []
    abandoned = 0
    lock = threading.Lock()

    def client(i: int) -> None:
        nonlocal abandoned
        try:
            with httpx.Client(base_url=s.url, timeout=30) as c:
                for j in range(3):
                    ctx = (1024, 2048)[(i + j) % 2]
                    body = {
                        "model": "a", "prompt": "hi", "stream": False,
                        "options": {"num_predict": 3, "num_ctx": ctx},
                    }  # fmt: skip
                    if (i + j) % 3 == 2:  # this one leaves early: queued, loading or generating
                        sock = raw_request(s, "/api/generate", body)
                        time.sleep(0.05 * (i % 4))
                        sock.close()
                        with lock:
                            abandoned += 1
                    else:
                        r = c.post("/api/generate", json=body)
                        with lock:
                            results.append((ctx, r.status_code, r.json()))
        except BaseException as e:
            errors.append(e)

    t = time.monotonic()
    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not errors, f"{errors}; {loads_of(s, 'a')} loads of a; log:\n{s.log()[-3000:]}"
    assert not any(th.is_alive() for th in threads)
    print(
        f"\n{len(results)} completed, {abandoned} abandoned, {loads_of(s, 'a')} loads of a "
        f"in {time.monotonic() - t:.2f}s"
    )
    assert len(results) == 8 and abandoned == 4
    bad = [r for r in results if r[1] != 200 or not r[2].get("done")]
    assert not bad, bad
    ps = assert_no_leak(s)
    assert [m["model"] for m in ps] == [name("a")]
    for ctx in (2048, 1024):  # both shapes still serve
        r = gen(s, "a", options={"num_predict": 2, "num_ctx": ctx})
        assert r.status_code == 200, r.text
        assert loaded(s)[name("a")]["context_length"] == ctx
    assert_no_leak(s)


def test_warm_model_is_served_while_another_model_loads(serve) -> None:
    s = serve()
    warm = httpx.Client(base_url=s.url, timeout=60)
    try:
        assert gen(s, "a", warm).status_code == 200

        def timed() -> tuple[float, float]:
            t0 = time.perf_counter()
            r = gen(s, "a", warm, options={"num_predict": 1})
            t1 = time.perf_counter()
            assert r.status_code == 200, r.text
            return t0, t1

        alone = [timed() for _ in range(50)]

        windows: list[tuple[float, float]] = []  # big's load-only requests: its load in progress
        failures: list[Any] = []
        done = threading.Event()

        def cycle_big_loads() -> None:
            try:
                with httpx.Client(base_url=s.url, timeout=120) as c:
                    for _ in range(2):
                        t0 = time.perf_counter()
                        r = c.post("/api/generate", json={"model": "big"})
                        windows.append((t0, time.perf_counter()))
                        if r.status_code != 200:
                            failures.append(r.text)
                            return
                        c.post("/api/generate", json={"model": "big", "keep_alive": 0})
                        while name("big") in {m["model"] for m in s.ps()}:
                            time.sleep(0.01)
            except BaseException as e:
                failures.append(e)
            finally:
                done.set()

        th = threading.Thread(target=cycle_big_loads, daemon=True)
        th.start()
        during: list[tuple[float, float]] = []
        while not done.is_set():
            during.append(timed())
        th.join(60)
        assert not failures, failures
    finally:
        warm.close()

    inside = [(a, b) for a, b in during if any(w0 <= a and b <= w1 for w0, w1 in windows)]
    big_loads = re.findall(r"model 'big:latest' ready in ([0-9.]+)s", s.log())
    print(f"\nwarm model alone:                  {dist([b - a for a, b in alone])}")
    print(f"warm model during big load cycles: {dist([b - a for a, b in during])}")
    if inside:
        print(f"  of which inside a big load:      {dist([b - a for a, b in inside])}")
    print(f"big load requests: {[round(w1 - w0, 2) for w0, w1 in windows]} s, log: {big_loads} s")
    # A warm request started and finished while the big model's load was in progress: warm
    # requests do not wait behind another model's load.
    assert inside, f"no warm request completed inside a load window: {windows} {during}"
    assert_no_leak(s)


def test_model_that_can_never_fit_fails_at_once_with_507(serve, sizes: Sizes) -> None:
    booked = sizes.booked
    limit = slack(booked["a"])
    assert booked["c"] > limit - RUNNER_CODE_BYTES
    s = serve(CORRAL_MEMORY_LIMIT=str(limit))
    with streams(s, "a") as st:  # a is busy: a request that waited for memory would hang here
        r = gen(s, "c")
        assert r.status_code == 507, r.text
        msg = r.json()["error"]
        r = s.client.post(
            "/v1/chat/completions",
            json={"model": "c", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        )
        assert r.status_code == 507
        assert r.json()["error"]["message"] == msg
        st["a"].more()
    print(f"\n507: {msg}")
    assert "c:latest" in msg or "'c'" in msg, msg
    units = {"MiB": MiB, "GiB": 2**30, "MB": 10**6, "GB": 10**9}
    named = [float(n) * units[u] for n, u in re.findall(r"(\d+(?:\.\d+)?) ?(MiB|GiB|MB|GB)\b", msg)]

    def names(n: int, high: float = 0.0) -> bool:
        """Whether the message names n, or up to `high` more of it."""
        return any(-max(n * 0.01, MiB) <= x - n <= max(n * (0.01 + high), MiB) for x in named)

    # c's estimate, which may err high of what its runner was measured to hold once loaded
    # (booked): a drafter's table, its rows for drafts
    assert names(booked["c"], high=0.1) and names(limit), f"sizes not named in: {msg}"
    assert loads_of(s, "c") == 0
    assert gen(s, "a").status_code == 200  # other models keep working
    assert gen(s, "c").status_code == 507
    assert [m["model"] for m in assert_no_leak(s)] == [name("a")]


def test_embedding_model_is_evicted_and_reloaded_like_any_other(pressure) -> None:
    s = pressure

    def embed() -> list[float]:
        r = s.client.post("/api/embed", json={"model": "embed", "input": ["hello world"]})
        assert r.status_code == 200, r.text
        (vec,) = r.json()["embeddings"]
        assert len(vec) > 0
        return vec

    def now() -> set[str]:
        return {m["model"].removesuffix(":latest") for m in assert_no_leak(s)}

    assert load(s, "b").status_code == 200
    assert load(s, "c").status_code == 200
    first = embed()  # no room: b, the least recently used, goes
    assert now() == {"c", "embed"} and len(evictions(s, "b", "embed")) == 1
    assert gen(s, "b").status_code == 200  # the embedding model is a candidate like any other
    assert now() == {"embed", "b"} and len(evictions(s, "c", "b")) == 1
    assert gen(s, "c").status_code == 200
    assert now() == {"b", "c"} and len(evictions(s, "embed", "c")) == 1
    again = embed()  # reloaded, and the same model gives the same vector
    assert now() == {"c", "embed"} and loads_of(s, "embed") == 2
    assert again == pytest.approx(first, abs=1e-4)
    r = s.client.post("/v1/embeddings", json={"model": "embed", "input": "hello world"})
    assert r.status_code == 200, r.text
    assert r.json()["data"][0]["embedding"] == pytest.approx(first, abs=1e-4)
