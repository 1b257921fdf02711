"""The entry's HTTP/1.1 client for the data path (corral.cluster.relay) against a small
scripted server: bodies with a length and chunked ones, keep-alive reuse, a pooled connection
the server closed, a response cut short, and a server that is not there."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from corral.cluster.relay import Broken, Pool, Unreachable, exchange


async def serve(script: list[bytes | None]) -> tuple[asyncio.Server, int, list[asyncio.Event]]:
    """Answers each request on a connection with the next reply of `script` (None: close the
    connection without answering); one event per connection, set once the server closed it."""
    conns: list[asyncio.Event] = []
    replies = iter(script)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        closed = asyncio.Event()
        conns.append(closed)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                await reader.readexactly(length)
                reply = next(replies)
                if reply is None:
                    break
                writer.write(reply)
                await writer.drain()
                if b"close-after" in reply:
                    break
        except (asyncio.IncompleteReadError, StopIteration, ConnectionError):
            pass
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
        closed.set()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1], conns


async def body_of(pool: Pool, path: str = "/x") -> tuple[int, bytes]:
    req = pool.request_bytes("POST", path, [(b"content-type", b"application/json")], b"{}")
    async with exchange(pool, req) as conn:
        chunks = [c async for c in conn.body()]
        return conn.status, b"".join(chunks)


LENGTH = b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\ncontent-type: text/plain\r\n\r\nhello"
CHUNKED = (
    b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-type: application/x-ndjson\r\n\r\n"
    b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"
)


async def test_length_and_chunked_bodies_on_one_kept_alive_connection() -> None:
    server, port, conns = await serve([LENGTH, CHUNKED, LENGTH])
    pool = Pool("127.0.0.1", port)
    try:
        assert await body_of(pool) == (200, b"hello")
        assert await body_of(pool) == (200, b"abcde")
        assert await body_of(pool) == (200, b"hello")
        assert len(conns) == 1
    finally:
        pool.close()
        server.close()


async def test_a_pooled_connection_the_server_closed_is_replaced() -> None:
    closing = LENGTH.replace(b"text/plain", b"text/close-after")
    server, port, conns = await serve([closing, LENGTH])
    pool = Pool("127.0.0.1", port)
    try:
        assert await body_of(pool) == (200, b"hello")
        await asyncio.wait_for(conns[0].wait(), 10)  # the server has closed it
        assert await body_of(pool) == (200, b"hello")
        assert len(conns) == 2
    finally:
        pool.close()
        server.close()


async def test_no_answer_is_unreachable_and_a_cut_body_is_broken() -> None:
    cut = b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\npartial"
    server, port, _ = await serve([None, cut.replace(b"partial", b"partial-close-after")])
    pool = Pool("127.0.0.1", port)
    try:
        with pytest.raises(Unreachable):
            await body_of(pool)  # closed without a word, on a fresh connection
        with pytest.raises(Broken):
            await body_of(pool)
    finally:
        pool.close()
        server.close()
    await server.wait_closed()
    nobody = Pool("127.0.0.1", port)  # the server is gone
    with pytest.raises(Unreachable):
        await body_of(nobody)


async def test_request_bytes() -> None:
    pool = Pool("::1", 8080)
    req = pool.request_bytes("GET", "/a?b=1", [(b"x-k", b"v")], b"")
    assert req == b"GET /a?b=1 HTTP/1.1\r\nhost: [::1]:8080\r\nx-k: v\r\ncontent-length: 0\r\n\r\n"
