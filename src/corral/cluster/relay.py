"""The entry's connections to the nodes' corrals: a small HTTP/1.1 client for the data path.

Each request the entry relays goes out on a pooled keep-alive connection (one pool per node)
as one write, and its response is parsed with httptools (what uvicorn uses) as it arrives: the
status and headers first, then the body as the node sends it (chunked encoding undone; the
entry's server re-chunks). No client library sits between a token and the client, which
halves the entry's CPU per relayed request against aiohttp's client (see docs/benchmarks.md).

Errors: `Unreachable` when the request got no response at all (connection refused or reset,
or a pooled connection the node had closed: the caller may send it elsewhere), `Broken` when
the response stopped part way (the caller ends the stream with an error in its API's shape).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import AsyncIterator, Iterable
from typing import cast

import httptools

IDLE = 4.0  # seconds a pooled connection may wait (below the node server's 5 s keep-alive)
HIGH_WATER = 1 << 20  # body bytes held for a slow client before reading from the node pauses
CONNECT_TIMEOUT = 5.0


class Unreachable(Exception):
    """No response came: nothing was sent to the client yet."""


class Broken(Exception):
    """The response stopped before its end."""


class Upstream(asyncio.Protocol):
    """One connection to a node's corral, one request at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.error: Exception | None = None
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.got_response = False  # any byte of a response arrived
        self.head_done = False
        self.complete = False
        self.keep_alive = False
        self.chunks: collections.deque[bytes] = collections.deque()
        self.buffered = 0
        self.paused = False
        self.idle_since = 0.0
        self._wake: asyncio.Future[None] | None = None

    # ---- asyncio.Protocol --------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # (uvloop's is not a subclass)

    def data_received(self, data: bytes) -> None:
        self.got_response = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self.error = e
            self._close()
        self._notify()

    def eof_received(self) -> bool | None:
        return False  # close

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.complete and self.error is None:
            self.error = exc or ConnectionResetError("the node closed the connection")
        self._notify()

    # ---- httptools callbacks -----------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.head_done = True

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def on_message_complete(self) -> None:
        self.complete = True
        # (asked here: once the parser has moved past the message it answers for the next)
        self.keep_alive = self.parser.should_keep_alive()

    # ---- use -----------------------------------------------------------------------------------
    def _notify(self) -> None:
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    async def _wait(self) -> None:
        self._wake = asyncio.get_running_loop().create_future()
        try:
            await self._wake
        finally:
            self._wake = None

    def _close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def send(self, request: bytes) -> None:
        assert self.transport is not None
        self.status, self.headers = 0, []
        self.got_response = self.head_done = self.complete = self.keep_alive = False
        self.chunks.clear()
        self.buffered = 0
        self.transport.write(request)

    async def head(self) -> tuple[int, list[tuple[bytes, bytes]]]:
        while not self.head_done:
            if self.error is not None or self.closed:
                raise (Unreachable if not self.got_response else Broken)(str(self.error))
            await self._wait()
        return self.status, self.headers

    async def body(self) -> AsyncIterator[bytes]:
        """The body as it comes, every chunk held at the time of asking in one piece."""
        while True:
            if self.chunks:
                data = b"".join(self.chunks)
                self.chunks.clear()
                self.buffered = 0
                if self.paused and self.transport is not None:
                    self.paused = False
                    self.transport.resume_reading()
                yield data
                continue
            if self.complete:
                return
            if self.error is not None or self.closed:
                raise Broken(str(self.error or "the node closed the connection"))
            await self._wait()

    @property
    def reusable(self) -> bool:
        return self.complete and self.keep_alive and not self.closed


class Pool:
    """Keep-alive connections to one node's corral."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.authority = (f"[{host}]" if ":" in host else host) + f":{port}"
        self.idle: list[Upstream] = []

    async def connect(self) -> Upstream:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(Upstream, self.host, self.port), CONNECT_TIMEOUT
            )
        except (OSError, asyncio.TimeoutError) as e:
            raise Unreachable(f"cannot connect: {e}") from None
        return conn

    def take(self) -> Upstream | None:
        now = time.monotonic()
        while self.idle:
            conn = self.idle.pop()
            if not conn.closed and now - conn.idle_since < IDLE:
                return conn
            conn._close()
        return None

    def give_back(self, conn: Upstream) -> None:
        if conn.reusable:
            conn.idle_since = time.monotonic()
            self.idle.append(conn)
        else:
            conn._close()

    def close(self) -> None:
        for conn in self.idle:
            conn._close()
        self.idle.clear()

    def request_bytes(
        self, method: str, target: str, headers: Iterable[tuple[bytes, bytes]], body: bytes
    ) -> bytes:
        lines = [f"{method} {target} HTTP/1.1\r\nhost: {self.authority}\r\n".encode("latin-1")]
        for k, v in headers:
            lines += [k, b": ", v, b"\r\n"]
        lines.append(b"content-length: %d\r\n\r\n" % len(body))
        lines.append(body)
        return b"".join(lines)

    async def open(self, request: bytes) -> Upstream:
        """Send the request; returns the connection once the response's head arrived. A pooled
        connection the node closed meanwhile is replaced by a new one, once."""
        conn = self.take()
        if conn is not None:
            conn.send(request)
            try:
                await conn.head()
                return conn
            except Unreachable:
                conn._close()  # a stale keep-alive connection: try a fresh one
        conn = await self.connect()
        conn.send(request)
        try:
            await conn.head()
        except BaseException:
            conn._close()
            raise
        return conn


@contextlib.asynccontextmanager
async def exchange(pool: Pool, request: bytes) -> AsyncIterator[Upstream]:
    """A request's response; the connection goes back to the pool only if it ended cleanly."""
    conn = await pool.open(request)
    ok = False
    try:
        yield conn
        ok = True
    finally:
        if ok and conn.reusable:
            pool.give_back(conn)
        else:
            conn._close()
