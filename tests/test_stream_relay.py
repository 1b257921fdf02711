"""The streaming relay's pieces (corral.api.stream): RunnerStream against a local server that
writes what a test says when it says, and RelayResponse driven as an ASGI app."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from corral.api import stream as relay
from corral.api.stream import RelayResponse, RunnerStream, open_stream

Writer = Callable[[socket.socket], None]


def serve(write: Writer) -> str:
    """A runner stand-in on a thread of its own: it reads one request, then `write` answers on
    the blocking socket (and the connection is closed after it)."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def main() -> None:
        with listener:
            conn, _ = listener.accept()
        with conn:
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(65536)
            head, _, body = data.partition(b"\r\n\r\n")
            length = next(
                int(line.split(b":")[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length:")
            )
            while len(body) < length:
                body += conn.recv(65536)
            write(conn)

    threading.Thread(target=main, daemon=True).start()
    return f"http://127.0.0.1:{port}"


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


def event(i: int) -> bytes:
    return b'data: {"choices":[{"finish_reason":null,"delta":{"content":"t%d"}}]}\n\n' % i


async def stream_of(write: Writer) -> RunnerStream:
    return await open_stream(serve(write), "/v1/chat/completions", b'{"stream":true}')


def pause(seconds: float) -> None:
    """Sleep with sub-millisecond precision (a runner's pace at thousands of tokens/s)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_a_chunked_body_split_anywhere_reads_whole() -> None:
    body = b"".join(event(i) for i in range(20)) + b"data: [DONE]\n\n"
    wire = HEAD + b"".join(chunk(event(i)) for i in range(20)) + chunk(b"data: [DONE]\n\n")
    wire += b"0\r\n\r\n"

    async def main() -> None:
        for step in (1, 2, 3, 7, 50, len(wire)):

            def write(conn: socket.socket, step: int = step) -> None:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                for i in range(0, len(wire), step):
                    conn.sendall(wire[i : i + step])
                    pause(0.00002)

            s = await stream_of(write)
            assert s.status == 200
            assert s.headers["content-type"] == "text/event-stream"
            assert await s.read_all() == body, step
            s.close()

    asyncio.run(main())


def test_a_body_with_a_length_and_a_refusal() -> None:
    def write(conn: socket.socket) -> None:
        conn.sendall(b'HTTP/1.1 400 Bad Request\r\nContent-Length: 13\r\n\r\n{"error":"x"}')

    async def main() -> None:
        s = await stream_of(write)
        assert s.status == 400
        assert await s.read_all() == b'{"error":"x"}'
        s.close()

    asyncio.run(main())


def test_a_stream_cut_short_raises() -> None:
    def write(conn: socket.socket) -> None:
        conn.sendall(HEAD + chunk(event(0)) + b"40\r\ndata: {")  # the runner dies mid-chunk

    async def main() -> None:
        s = await stream_of(write)
        got = b""
        with pytest.raises(ConnectionError):
            while data := await s.read():
                got += data
        assert got.startswith(event(0))
        s.close()

    asyncio.run(main())


def test_an_unreachable_runner_is_an_oserror() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    listener.close()
    with pytest.raises(OSError):
        asyncio.run(open_stream(url, "/completion", b"{}"))


def test_fast_tokens_are_coalesced_and_the_end_is_not_late() -> None:
    """With a 50 ms window: the first two tokens are not held; then tokens 0.2 ms apart go out
    a window's worth per read; the end (the runner closing the connection after [DONE]) is
    read at once, not when the window is over."""
    n, window = 80, 0.05
    closed: list[float] = []
    first = threading.Event()

    def write(conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.sendall(HEAD + chunk(event(0)))
        first.wait(10)
        for i in range(1, n):
            conn.sendall(chunk(event(i)))
            pause(0.0002)
        closed.append(time.perf_counter())
        conn.sendall(chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        conn.shutdown(socket.SHUT_WR)

    async def main() -> None:
        streams = relay._streams[0]
        s = await open_stream(serve(write), "/v1/chat/completions", b"{}", window=window)
        assert relay._streams[0] == streams + 1
        reads = [await s.read()]
        first.set()
        t = time.perf_counter()
        reads.append(await s.read())
        second = time.perf_counter() - t
        while data := await s.read():
            reads.append(data)
        ended = time.perf_counter()
        counts = [r.count(b"data: ") for r in reads]
        assert sum(counts) == n + 1
        assert counts[0] == 1 and second < window / 2, (counts, second)
        assert len(reads) <= 6, counts
        assert ended - closed[0] < window / 2, ended - closed[0]
        assert relay._streams[0] == streams  # its end took it off the count

    asyncio.run(main())


def test_tokens_at_a_normal_pace_go_out_one_by_one() -> None:
    def write(conn: socket.socket) -> None:
        conn.sendall(HEAD)
        for i in range(5):
            conn.sendall(chunk(event(i)))
            time.sleep(0.01)
        conn.sendall(chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")

    async def main() -> None:
        s = await stream_of(write)
        reads = []
        while data := await s.read():
            reads.append(data)
        assert [r.count(b"data: ") for r in reads] == [1, 1, 1, 1, 1, 1]
        s.close()

    asyncio.run(main())


# ---- RelayResponse ----------------------------------------------------------------------------


class Relay(RelayResponse):
    closed = 0

    async def close(self) -> None:
        Relay.closed += 1


async def drive(resp: RelayResponse, leave_after: int | None = None) -> list[dict[str, Any]]:
    """Run `resp` as an ASGI app; the client leaves after `leave_after` body messages."""
    sent: list[dict[str, Any]] = []
    left = asyncio.Event()

    async def receive() -> dict[str, Any]:
        await left.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        body = [m for m in sent if m["type"] == "http.response.body"]
        if leave_after is not None and len(body) >= leave_after:
            left.set()

    await resp({"type": "http", "asgi": {"spec_version": "2.3"}}, receive, send)
    return sent


def test_what_is_ready_goes_out_in_one_write() -> None:
    ready = [True, True, False, False]

    async def body() -> AsyncIterator[bytes]:
        for part in (b"a", b"b", b"c", b"d"):
            yield part

    def more() -> bool:
        return ready.pop(0)

    Relay.closed = 0
    sent = asyncio.run(drive(Relay(body(), "application/x-ndjson", more=more)))
    assert sent[0]["type"] == "http.response.start"
    assert (b"content-type", b"application/x-ndjson") in sent[0]["headers"]
    assert [m["body"] for m in sent[1:]] == [b"abc", b"d", b""]
    assert sent[-1]["more_body"] is False
    assert Relay.closed == 1


def test_a_client_that_leaves_ends_the_response_quietly() -> None:
    async def body() -> AsyncIterator[bytes]:
        yield b"first"
        await asyncio.sleep(30)  # the runner is slow: the client does not wait
        yield b"never"

    async def main() -> list[dict[str, Any]]:
        return await asyncio.wait_for(drive(Relay(body(), "text/event-stream"), 1), 5)

    Relay.closed = 0
    sent = asyncio.run(main())
    assert [m.get("body") for m in sent[1:]] == [b"first"]
    assert Relay.closed == 1
