"""Connections cannot exhaust corral: the open-files limit raised at start-up, 1,100 idle
connections beside a working generate, idle / slowloris / half-sent-body connections timed
out, header and body sizes capped, 8 concurrent 100 MB uploads kept small in memory, and past
the connection cap the oldest idle connection makes room (503 when every one is serving).
Real `corral serve` processes, raw sockets."""

from __future__ import annotations

import contextlib
import json
import re
import resource
import select
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from corral.testing.server import CorralServer

READ_TIMEOUT = 2.0
IDLE_TIMEOUT = 5.0
GEN = {"model": "tiny", "prompt": "hi", "stream": False, "options": {"num_predict": 2}}


@pytest.fixture(scope="module")
def s(start_server, models_dir: Path) -> CorralServer:
    """A server started with the common default soft limit of 1024 open files."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(1024, hard), hard))
    try:
        return start_server(
            models_dir, CORRAL_READ_TIMEOUT=f"{READ_TIMEOUT}s", CORRAL_BUILTIN_MODELS="0",
            CORRAL_IDLE_TIMEOUT=f"{IDLE_TIMEOUT}s",
        )  # fmt: skip
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.fixture
def many_files() -> Iterator[None]:
    """This test process may open a few thousand sockets."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else 65536
    if want < 1300:
        pytest.skip(f"hard open-files limit {hard} is too low to open 1,100 connections")
    resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def addr(s: CorralServer) -> tuple[str, int]:
    host, port = s.host.rsplit(":", 1)
    return host, int(port)


def closed(sock: socket.socket, timeout: float) -> bool:
    """Whether the server closes `sock` within `timeout` (whatever it sends first)."""
    deadline = time.monotonic() + timeout
    while True:
        left = max(0.0, deadline - time.monotonic())
        if select.select([sock], [], [], left)[0]:
            try:
                if sock.recv(65536) == b"":
                    return True
            except ConnectionError:
                return True
        elif left == 0:
            return False


def closed_or_ready(sock: socket.socket) -> bool:
    return bool(select.select([sock], [], [], 0)[0])


def read_response(sock: socket.socket, timeout: float) -> bytes:
    """Everything the server sends until it closes the connection."""
    sock.settimeout(timeout)
    data = b""
    with contextlib.suppress(ConnectionError, TimeoutError):
        while chunk := sock.recv(65536):
            data += chunk
    return data


def test_open_files_limit_is_raised(s: CorralServer) -> None:
    soft, hard = psutil.Process(s.proc.pid).rlimit(resource.RLIMIT_NOFILE)
    assert soft == hard or soft >= 10240, (soft, hard)


def test_1100_idle_connections_do_not_stop_new_requests(s: CorralServer, many_files) -> None:
    t = time.monotonic()
    assert s.client.post("/api/generate", json=GEN).status_code == 200  # loaded, warm
    alone = time.monotonic() - t
    socks = [socket.create_connection(addr(s)) for _ in range(1100)]
    try:
        time.sleep(0.3)
        t = time.monotonic()
        with httpx.Client(base_url=s.url, timeout=10) as c:
            r = c.post("/api/generate", json=GEN)
            assert r.status_code == 200, r.text
            assert c.get("/api/ps").status_code == 200
        took = time.monotonic() - t
        print(f"generate alone {alone:.2f}s; with 1,100 idle connections open {took:.2f}s")
        assert took < 5
    finally:
        for sock in socks:
            sock.close()


def test_idle_connections_are_closed_after_the_read_timeout(s: CorralServer) -> None:
    socks = [socket.create_connection(addr(s)) for _ in range(50)]
    start = time.monotonic()
    try:
        assert all(closed(sock, READ_TIMEOUT + 3) for sock in socks)
        took = time.monotonic() - start
        assert READ_TIMEOUT - 0.5 < took < READ_TIMEOUT + 3, took
    finally:
        for sock in socks:
            sock.close()


def one_response(sock: socket.socket, timeout: float = 5) -> bytes:
    """One response of a kept-alive connection (headers and its content-length body)."""
    sock.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))  # type: ignore[union-attr]
    while len(body) < length:
        body += sock.recv(65536)
    return head


def test_a_kept_alive_connection_waits_the_idle_timeout(s: CorralServer) -> None:
    """After a response the connection may stay idle longer than the read timeout (clients keep
    theirs for 4-90 s; closing sooner races their next request), then it is closed; once the
    next request starts, its headers are due within the read timeout again."""
    request = b"GET /api/version HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    with socket.create_connection(addr(s)) as sock:
        sock.sendall(request)
        assert one_response(sock).startswith(b"HTTP/1.1 200")
        time.sleep(READ_TIMEOUT + 1)  # idle past the read timeout: still open, still served
        sock.sendall(request)
        assert one_response(sock).startswith(b"HTTP/1.1 200")
        start = time.monotonic()
        assert closed(sock, IDLE_TIMEOUT + 3)
        took = time.monotonic() - start
    assert IDLE_TIMEOUT - 0.5 < took < IDLE_TIMEOUT + 3, took
    with socket.create_connection(addr(s)) as sock:  # a request begun after a response ...
        sock.sendall(request)
        assert one_response(sock).startswith(b"HTTP/1.1 200")
        sock.sendall(b"GET /api/version HTTP/1.1\r\n")  # ... and never finished
        start = time.monotonic()
        assert closed(sock, READ_TIMEOUT + 3)
        took = time.monotonic() - start
    assert READ_TIMEOUT - 0.5 < took < READ_TIMEOUT + 3, took


def test_slowloris_is_cut_off(s: CorralServer) -> None:
    """Headers a byte at a time: each byte arrives well within any idle timeout, the request
    never completes; the server closes the connection once the read timeout has passed."""
    request = b"GET /api/version HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 200
    with socket.create_connection(addr(s)) as sock:
        start = time.monotonic()
        for byte in request:
            try:
                sock.send(bytes([byte]))
            except OSError:
                break
            if closed(sock, 0.2):
                break
        took = time.monotonic() - start
    print(f"slowloris cut off after {took:.2f}s")
    assert READ_TIMEOUT - 0.5 < took < READ_TIMEOUT + 3, took


def test_half_sent_body_times_out(s: CorralServer) -> None:
    with socket.create_connection(addr(s)) as sock:
        sock.sendall(
            b"POST /api/generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000\r\n\r\n" + b'{"model": "ti'
        )
        start = time.monotonic()
        data = read_response(sock, READ_TIMEOUT + 5)
        took = time.monotonic() - start
    print(f"half-sent body answered after {took:.2f}s")
    assert data.startswith(b"HTTP/1.1 408"), data[:200]
    assert b"connection: close" in data.lower()
    assert json.loads(data.split(b"\r\n\r\n", 1)[1]) == {"error": "request body arrived too slowly"}
    assert READ_TIMEOUT - 0.5 < took < READ_TIMEOUT + 3, took


def test_oversized_headers_are_refused(s: CorralServer) -> None:
    with socket.create_connection(addr(s)) as sock:
        sock.sendall(b"GET /api/version HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 200_000)
        data = read_response(sock, 5)
    assert data.startswith(b"HTTP/1.1 431"), data[:200]


def test_a_body_over_the_limit_is_refused_before_it_is_read(s: CorralServer) -> None:
    with socket.create_connection(addr(s)) as sock:
        sock.sendall(b"POST /api/chat HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Length: 100000000\r\n\r\n")  # fmt: skip
        start = time.monotonic()
        data = read_response(sock, 5)
    assert data.startswith(b"HTTP/1.1 413"), data[:200]
    assert b"connection: close" in data.lower() and time.monotonic() - start < 1


def test_concurrent_big_uploads_stay_small_in_memory(s: CorralServer) -> None:
    """8 clients each upload 100 MB at once, half with Content-Length, half chunked: each is
    refused (413 past the per-request limit, 503 past the bytes in flight across clients)
    and the server's memory grows by far less than what they send."""
    proc = psutil.Process(s.proc.pid)
    base = peak = proc.memory_info().rss
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, proc.memory_info().rss)
            time.sleep(0.01)

    def chunks() -> Iterator[bytes]:
        block = b"x" * 2**20
        for _ in range(100):
            yield block

    answers: list[int | str] = []

    def upload(chunked: bool) -> None:
        try:
            body = chunks() if chunked else b"x" * 100_000_000
            r = httpx.post(f"{s.url}/api/chat", content=body, timeout=60)
            answers.append(r.status_code)
        except httpx.HTTPError as e:
            answers.append(type(e).__name__)

    sampler = threading.Thread(target=sample)
    sampler.start()
    threads = [threading.Thread(target=upload, args=(i % 2 == 0,)) for i in range(8)]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    took = time.monotonic() - start
    done.set()
    sampler.join()
    grew = (peak - base) / 2**20
    print(f"8 x 100 MB uploads: {sorted(map(str, answers))} in {took:.1f}s; "
          f"server RSS {base / 2**20:.0f} MiB, peak +{grew:.0f} MiB")  # fmt: skip
    assert all(a in (413, 503) for a in answers), answers
    assert grew < 160, grew
    assert s.client.post("/api/generate", json=GEN).status_code == 200


def test_past_the_connection_cap_the_oldest_idle_one_makes_room(
    start_server, models_dir: Path
) -> None:
    s = start_server(
        models_dir, CORRAL_MAX_CONNECTIONS="16", CORRAL_READ_TIMEOUT=f"{READ_TIMEOUT}s",
        CORRAL_BUILTIN_MODELS="0",
    )  # fmt: skip
    idle = [socket.create_connection(addr(s)) for _ in range(40)]
    try:
        # the oldest went to make room for the newest: at most 16 stay open
        s.wait_for(
            lambda: sum(closed(sock, 0) for sock in idle) >= 40 - 16, timeout=10,
            what="the oldest idle connections closed",
        )  # fmt: skip
        gone = [closed(sock, 0) for sock in idle]
        assert sum(gone) >= 40 - 16, gone
        assert not any(gone[-8:]), gone
        with httpx.Client(base_url=s.url, timeout=30) as c:
            assert c.post("/api/generate", json=GEN).status_code == 200
    finally:
        for sock in idle:
            sock.close()
    # Every connection serving (a body on its way): a new one is told to come back later.
    busy = []
    try:
        for _ in range(20):
            sock = socket.create_connection(addr(s))
            sock.sendall(b"POST /api/generate HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                         b"Content-Length: 100\r\n\r\n{")  # fmt: skip
            busy.append(sock)
            time.sleep(0.03)  # its headers are in before the next one connects
        time.sleep(0.2)
        answers = [sock.recv(4096) if closed_or_ready(sock) else b"" for sock in busy]
        refused = [a for a in answers if a]
        assert not any(answers[:12]), answers
        assert len(refused) >= 3, answers
        for a in refused:
            assert a.startswith(b"HTTP/1.1 503"), a
            assert b"retry-after: 1" in a.lower() and b"too many connections" in a
    finally:
        for sock in busy:
            sock.close()
    with httpx.Client(base_url=s.url, timeout=30) as c:
        assert c.post("/api/generate", json=GEN).status_code == 200
