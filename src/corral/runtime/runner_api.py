"""Everything corral asks of a runner's llama.cpp server, through one typed class per runner
(as Ollama's `LlamaServer`): a request's answer, streamed or whole, with the runner's refusals
and failures as the client's errors; tokenizing and rendering a prompt; and the probes that
must never fail a request (health, `/metrics`, `/slots`, slot save and restore), which answer
None or a string saying what went wrong. No other module talks HTTP to a runner
(tests/test_runner_api.py).

A streamed answer comes on a connection of its own (`open_stream`), read without an HTTP client
library (`RunnerStream`, below); the rest share one pooled aiohttp session per runner.

## The stream reader

What a relayed token costs is mostly fixed per wake-up, read and write (the event loop's turn, a
system call each, the ASGI send), not per byte. So the reader coalesces: a read in the first
half of a window after the previous one waits out the window (the tokens wait in the kernel
meanwhile) and takes everything that came, so a fast runner's tokens go out a few at a time,
while the first tokens, a token after a pause (any at a normal model's pace) and the stream's
end go out at once; with several streams their waits end on the ticks of one clock, so one
wake-up serves them all. The window is `COALESCE_S` (2 ms), longer while many streams are
relayed at once (`STREAM_SHARE_S` each, at most `MAX_WINDOW_S`, 16 ms): no token waits longer
than that.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, cast
from urllib.parse import urlsplit

import aiohttp
import orjson

from corral.core.drafting import Counters
from corral.errors import ApiError
from corral.runtime.continuation import Reader
from corral.runtime.runner_errors import runner_error

# What a runner failing mid-answer raises: RunnerStream raises OSErrors (ConnectionError);
# aiohttp's errors, and its bare RuntimeError ("Connection closed.") for a session closed under
# a body being read.
UPSTREAM_ERRORS = (aiohttp.ClientError, OSError, asyncio.IncompleteReadError, RuntimeError)
PROBE_ERRORS = (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError)
PROBE_TIMEOUT = 5.0


class RunnerAPI:
    """One runner's llama.cpp server at `base_url`. `failed` is the client's error for a
    runner that stopped answering (its exit and last log lines: a 500, or a 503 where it ran
    out of memory, which a retry may cure)."""

    def __init__(self, base_url: str, failed: Callable[[], Awaitable[ApiError]]) -> None:
        self.base_url = base_url
        self._failed = failed
        self._session = aiohttp.ClientSession(
            base_url=base_url,
            # llama.cpp closes idle connections after 5 s; drop ours first so none is reused dead.
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=4),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
            auto_decompress=False,
        )

    @property
    def closed(self) -> bool:
        return self._session.closed

    async def close(self) -> None:
        await self._session.close()

    # ---- a request's answer: the runner's refusals and failures as the client's errors ---------
    async def stream(self, path: str, payload: Mapping[str, Any]) -> RunnerStream:
        """POST a streamed request: its answer comes on a connection of its own (llama.cpp
        closes it after a streamed answer), read by a RunnerStream once its head is in."""
        try:
            resp = await open_stream(self.base_url, path, orjson.dumps(payload))
        except OSError:
            raise await self._failed() from None
        if resp.status != 200:
            try:
                body = await resp.read_all()
            except OSError:
                raise await self._failed() from None
            finally:
                resp.close()
            raise runner_error(body, resp.status)
        return resp

    async def answer(self, path: str, payload: Mapping[str, Any]) -> bytes:
        """POST a request and return its whole answer (a non-200 answer raises llama.cpp's
        refusal as the client's error). A caller that stops waiting closes the connection,
        which makes llama.cpp stop generating."""
        headers = {"Content-Type": "application/json"}
        try:
            async with self._session.post(path, data=orjson.dumps(payload), headers=headers) as r:
                body = await r.read()
        except (aiohttp.ClientError, OSError):
            raise await self._failed() from None
        if r.status != 200:
            raise runner_error(body, r.status)
        return body

    async def post_json(self, path: str, payload: Mapping[str, Any]) -> Any:
        """POST a request whose answer is one JSON document, parsed."""
        return orjson.loads(await self.answer(path, payload))

    async def tokenize(
        self, text: str, special: bool = False, bos: bool | None = None
    ) -> list[int]:
        """`text` as the model's token ids (`special`: with its BOS, and special tokens written
        in the text parsed as such; `bos` overrides the first: text llama.cpp reads after token
        ids gets no BOS)."""
        toks = await self.post_json("/tokenize", {
            "content": text, "add_special": special if bos is None else bos,
            "parse_special": special,
        })  # fmt: skip
        return list(toks["tokens"])

    async def apply_template(self, body: Mapping[str, Any]) -> str:
        """The prompt the runner's chat template renders from `body` (messages, tools, ...)."""
        return str((await self.post_json("/apply-template", body))["prompt"])

    async def props(self) -> tuple[int, bytes]:
        """llama.cpp's `/props` as it answers it (status, body)."""
        try:
            async with self._session.get("/props") as r:
                return r.status, await r.read()
        except (aiohttp.ClientError, OSError):
            raise await self._failed() from None

    # ---- probes: never an exception ----------------------------------------------------------
    async def health(self, timeout: float) -> int | None:
        """The status the runner's /health answers within `timeout` seconds; None if none.
        llama.cpp answers /health on its HTTP threads without waiting for the inference loop,
        so a long prompt being processed does not delay it; a frozen, swapped-out or wedged
        process does."""
        if self._session.closed:
            return None
        try:
            async with self._session.get(
                "/health", timeout=aiohttp.ClientTimeout(total=timeout)
            ) as r:
                await r.read()
                return r.status
        except PROBE_ERRORS:
            return None

    async def metrics(self, timeout: float = PROBE_TIMEOUT) -> dict[str, float]:
        """llama.cpp's `/metrics` counters by name (`llamacpp:prompt_tokens_total`, ...); empty
        if it does not answer (or was started without metrics)."""
        if self._session.closed:
            return {}
        try:
            async with self._session.get(
                "/metrics", timeout=aiohttp.ClientTimeout(total=timeout)
            ) as r:
                text = await r.text() if r.status == 200 else ""
        except (*PROBE_ERRORS, UnicodeDecodeError):
            return {}
        found: dict[str, float] = {}
        for line in text.splitlines():
            name, _, value = line.partition(" ")
            if name and not name.startswith("#"):
                with contextlib.suppress(ValueError):
                    found[name] = float(value)
        return found

    async def token_counts(self, timeout: float = 1.0) -> Counters | None:
        """What the runner has processed since it started (prompt and generated tokens, the
        drafts of speculative decoding, the slots busy at each decode); None if it does not
        say."""
        return Counters.of(await self.metrics(timeout))

    async def get_json(self, path: str, timeout: float = PROBE_TIMEOUT) -> Any:
        """The runner's JSON answer to a GET (e.g. `/slots`); None if it gives none."""
        if self._session.closed:
            return None
        try:
            async with self._session.get(
                path, timeout=aiohttp.ClientTimeout(total=timeout)
            ) as r:
                return await r.json(content_type=None) if r.status == 200 else None
        except PROBE_ERRORS:
            return None

    async def try_post(self, path: str, body: Mapping[str, Any], timeout: float) -> Any:
        """The runner's JSON answer to a POST; what went wrong as a string otherwise (an error
        status with its error object, or the failure)."""
        if self._session.closed:
            return "the runner is gone"
        try:
            async with self._session.post(
                path, json=body, timeout=aiohttp.ClientTimeout(total=timeout)
            ) as r:
                data = await r.json(content_type=None)
                return data if r.status == 200 else f"HTTP {r.status}: {data}"
        except PROBE_ERRORS as e:
            return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__

    async def slot_action(self, slot: int, action: str, filename: str, timeout: float) -> Any:
        """llama.cpp's slot save or restore (`action`) of `filename` in its slot save path: its
        JSON answer, or what went wrong as a string."""
        return await self.try_post(f"/slots/{slot}?action={action}", {"filename": filename},
                                   timeout)  # fmt: skip

    def break_connections(self) -> None:
        """End the pooled connections to the runner from our side with shutdown(2), for a
        runner that cannot even be killed yet (stuck in uninterruptible sleep): their readers
        see a cut-off response, as if it had died. Not close(): aiohttp would leave a reader
        waiting on a closed connection without waking it."""
        for proto in list(getattr(self._session.connector, "_acquired", ())):
            transport = getattr(proto, "transport", None)
            sock = transport.get_extra_info("socket") if transport is not None else None
            if sock is None:
                continue
            with contextlib.suppress(OSError, ValueError):
                # A duplicate descriptor: shutdown acts on the socket, whatever the loop's
                # wrapper object allows.
                with socket.socket(fileno=os.dup(sock.fileno())) as dup:
                    dup.shutdown(socket.SHUT_RDWR)


# ---- a streamed answer, read without an HTTP client library ------------------------------

# A read in the first half of this window after the previous one waits out the rest of it, so
# that what the runner sends meanwhile goes out with it: at most this much added delay for a
# token, and only for tokens that come at least two a window (slower ones would cost a wait
# for less than one more token).
COALESCE_S = 0.002
# With many streams relayed at once the window is this times their number, up to MAX_WINDOW_S:
# a token is never held longer than that. A runner's batch of n slots gives each stream a token
# every n decode steps (16 slots of a small model: one every 4-6 ms), which a window under twice
# that never holds: every token would be a read, a write and a wake-up of its client, and on a
# small machine that CPU is taken from the runner. 16 ms is under a 60 Hz display's frame.
STREAM_SHARE_S = 0.001
MAX_WINDOW_S = 0.016
HIGH_WATER = 1 << 20  # received bytes the client has not taken: reading stops until it does
HOLD_LOWAT = 1 << 16  # the socket's receive low-water mark while a window passes


class RunnerStream(Reader, asyncio.Protocol):
    """A streamed POST to a runner, on a connection of its own (llama.cpp closes it after a
    streamed answer anyway), read without an HTTP client library in between: what arrives is
    only appended here, and the reader is woken when it should read.

    `read()` returns the body's bytes that came since the last read (b"" at the end). A read
    less than half a window after the previous one lets the window pass (with other streams,
    up to the last tick within it of a clock that all streams share, half a window apart, so
    their waits end in one turn of the loop) and takes everything that came meanwhile, so a
    fast runner's tokens go out a few at a time (one wake, one write for several), while the
    first tokens, a token after a pause (any at a normal model's pace) and the stream's end go
    out at once. While the window passes, the socket's receive low-water mark (SO_RCVLOWAT) is
    raised, so the tokens wait in the kernel and wake nobody, yet the connection's end
    (llama.cpp closes it right after `[DONE]`) or failure still does at once; at the window's
    end, one read takes them all.

    `status`, `read_all()` (a whole non-streamed answer, e.g. an error) and `close()` (which
    makes llama.cpp stop generating) stand for what aiohttp's response offered."""

    def __init__(self, window: float = COALESCE_S) -> None:
        self.window = window
        self.transport: asyncio.Transport | None = None
        self.raw: list[bytes] = []  # received, not yet parsed
        self.size = 0  # bytes in raw
        self.buf = b""  # parsed up to here: a head or chunk header not yet complete
        self.status = 0
        self.headers: dict[str, str] = {}
        self.chunked = False
        self.left = -1  # body bytes left: of the current chunk (chunked) or of the body
        self.crlf = False  # a chunk's data is in; its CRLF is not yet
        self.done = False  # the whole body is in
        self.eof = False  # the connection is closed
        self.exc: BaseException | None = None
        self.paused = False
        self.waiter: asyncio.Future[None] | None = None
        self.holding = False  # the reader lets a window pass: only the end wakes it early
        self.ending = False  # the stream's last events came: nothing waits from now on
        self.reads = 0
        self.peeked = b""  # read by `peek`, not yet returned by `read`
        self.last = -window  # when the last read returned
        self.loop = asyncio.get_running_loop()
        # The connection's socket, on a file descriptor of our own (a dup), to set its
        # low-water mark and ask what waits in it with one system call each (uvloop's stand-in
        # makes a socket object for every call); closed with the connection.
        self.sock: socket.socket | None = None
        self.counted = False  # in _streams

    # ---- the protocol: called by the event loop ----------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        try:
            self.sock = socket.socket(fileno=os.dup(transport.get_extra_info("socket").fileno()))
            self.sock.setblocking(False)  # as the loop's is (the flag is the socket's)
        except (OSError, AttributeError):  # no socket to be had: wake as data comes
            self.sock = None

    def data_received(self, data: bytes) -> None:
        self.raw.append(data)
        self.size += len(data)
        if self.holding:  # only a window's wait looks for the end (`read` looks before one)
            self._see_end(data)
        if self.size > HIGH_WATER and self.transport is not None and not self.paused:
            self.paused = True  # the client reads slower than the runner writes
            self.transport.pause_reading()
        if self.waiter is not None and (not self.holding or self.ending or self.paused):
            self._wake()

    def eof_received(self) -> bool | None:
        return None  # close the connection: connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.eof = True
        self._gone()
        self._drop_sock()
        if exc is not None and self.exc is None:
            self.exc = exc
        self._wake()

    def _see_end(self, data: bytes) -> None:
        """Note whether `data` says the stream is ending (a finish reason, /completion's last
        event, [DONE], llama.cpp's error line): from then on nothing waits, so the end is never
        late. Generated text cannot hold the quoted ones (JSON escapes quotes) nor start a line;
        a false match would only cost the coalescing. Looked for only where a wait would begin
        or while one passes: five scans of every read cost more than the rest of its parsing."""
        if not self.ending and (b'"finish_reason":"' in data or b'"stop":true' in data
                                or b"data: [DONE]" in data or b"\nerror: " in data
                                or data.startswith(b"error: ")):  # fmt: skip
            self.ending = True

    def _wake(self) -> None:
        # The waiter may be done already and its reader not yet resumed: woken by the window's
        # timer, or cancelled (the client left) while data still comes.
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            if not waiter.done():
                waiter.set_result(None)

    async def _wait(self, timeout: float | None = None) -> None:
        waiter = self.waiter = self.loop.create_future()
        timer = None
        if timeout is not None:
            timer = self.loop.call_later(timeout, self._wake)
        try:
            await waiter
        finally:
            self.waiter = None
            if timer is not None:
                timer.cancel()

    # ---- parsing -----------------------------------------------------------------------------
    def _input(self) -> bytes:
        data = b"".join(self.raw) if len(self.raw) != 1 else self.raw[0]
        self.raw.clear()
        self.size = 0
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()
        return self.buf + data if self.buf else data

    def _head(self) -> bool:
        """Parse the status line and headers, once they are all in."""
        data = self._input()
        end = data.find(b"\r\n\r\n")
        if end < 0:
            self.buf = data
            return False
        lines = data[:end].decode("latin-1").split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
            raise ConnectionError(f"the runner answered {lines[0]!r}")
        self.status = int(parts[1])
        for line in lines[1:]:
            key, _, value = line.partition(":")
            self.headers[key.strip().lower()] = value.strip()
        self.chunked = "chunked" in self.headers.get("transfer-encoding", "").lower()
        length = self.headers.get("content-length", "")
        self.left = 0 if self.chunked else int(length) if length.isdigit() else -1
        self.done = not self.chunked and self.left == 0
        self.buf = data[end + 4 :]
        return True

    def _take(self) -> bytes:
        """The body bytes received and not taken yet, less the chunked encoding's framing."""
        if not self.raw and not self.buf:
            return b""
        data = self._input()
        self.buf = b""
        if not self.chunked:
            if self.left >= 0:  # Content-Length (what follows it is not ours)
                data = data[: self.left]
                self.left -= len(data)
                self.done = self.left == 0
            return data
        out: list[bytes] = []
        pos, n = 0, len(data)
        while pos < n and not self.done:
            if self.left > 0:  # inside a chunk
                piece = data[pos : pos + self.left]
                out.append(piece)
                pos += len(piece)
                self.left -= len(piece)
                self.crlf = self.left == 0
                continue
            if self.crlf:  # the CRLF after a chunk's data
                if n - pos < 2:
                    break
                pos += 2
                self.crlf = False
                continue
            nl = data.find(b"\r\n", pos)
            if nl < 0:
                break
            try:
                size = int(data[pos:nl].split(b";", 1)[0], 16)
            except ValueError:
                raise ConnectionError("the runner's answer is not valid HTTP") from None
            pos = nl + 2
            if size == 0:  # the last chunk (trailers, if any, are not read)
                self.done = True
                break
            self.left = size
        self.buf = data[pos:] if pos < n and not self.done else b""
        return out[0] if len(out) == 1 else b"".join(out)

    # ---- what the response offers --------------------------------------------------------------
    async def start(self, request: bytes) -> None:
        assert self.transport is not None
        self.transport.write(request)
        while not self._head():
            if self.eof:
                raise self.exc or ConnectionResetError("the runner closed the connection")
            await self._wait()

    async def peek(self) -> bytes:
        """The body's first bytes, read now, and returned again by the next `read()`."""
        self.peeked = await self.read()
        return self.peeked

    async def read(self) -> bytes:
        if self.peeked:
            data, self.peeked = self.peeked, b""
            return data
        while True:
            data = self._take()
            if data:
                break
            if self.done or (self.eof and not self.chunked and self.left < 0):
                self._gone()
                return b""  # all of it (a body without a length ends with the connection)
            if self.eof:
                raise self.exc or ConnectionResetError("the runner closed the stream")
            await self._wait()
        self.reads += 1
        window = max(self.window, min(_streams[0] * STREAM_SHARE_S, MAX_WINDOW_S))
        now = time.monotonic()
        wait = self.last + window - now
        # The first reads (the role event, then the first token) never wait, nor the end, nor a
        # read in the second half of its window.
        if wait > window / 2 and self.reads > 2 and not (self.done or self.eof):
            self._see_end(data)
            # With other streams, the wait ends on a tick of a clock of half windows that every
            # stream shares, so that their waits end together (one turn of the loop for all of
            # them); not under a millisecond (the loop's timers count milliseconds).
            if _streams[0] > 1:
                tick = window / 2
                wait = (self.last + window) // tick * tick - now
            if not self.ending and wait >= 0.001:
                await self._hold(wait)
                data += self._take()
        self.last = time.monotonic()
        return data

    async def _hold(self, seconds: float) -> None:
        """Let `seconds` pass, woken early only by the stream's end or failure, then take what
        came meanwhile."""
        self.holding = True
        held = self._lowat(HOLD_LOWAT)
        try:
            await self._wait(seconds)
        finally:
            self.holding = False
            if held:
                self._lowat(1)  # the kernel now says the socket is readable, if anything came
        if held and not self.eof and not self.paused:
            self._recv()

    def _lowat(self, n: int) -> bool:
        if self.sock is None:
            return False
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, n)
            return True
        except OSError:  # closed, or no such option here: wake as data comes
            return False

    def _recv(self) -> None:
        """Take what waits in the socket now, without a turn of the event loop: everything the
        loop read before is in `raw` already (it reads in this thread), and what it reads after
        comes after this. The end of the connection, or its failure, is left to the loop."""
        assert self.sock is not None
        try:
            data = self.sock.recv(1 << 20)
        except OSError:  # nothing yet (EAGAIN), or a failure the loop reports
            return
        if data:
            self._see_end(data)
            self.data_received(data)

    def close(self) -> None:
        self._drop_sock()  # first: while our descriptor is open, the connection stays open
        if self.transport is not None:
            self.transport.close()
        self._gone()

    def _drop_sock(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    release = close

    def _gone(self) -> None:
        if self.counted:
            self.counted = False
            _streams[0] -= 1


_streams = [0]  # RunnerStreams open (counted from their head to their end or close)


async def open_stream(
    base_url: str, path: str, body: bytes, window: float = COALESCE_S, connect_timeout: float = 10
) -> RunnerStream:
    """POST `body` (JSON) to the runner at `base_url` and return once its answer's head is in;
    OSError (ConnectionError) if the runner cannot be reached or closes the connection."""
    url = urlsplit(base_url)
    host, port = url.hostname or "127.0.0.1", url.port or 80
    loop = asyncio.get_running_loop()
    stream = RunnerStream(window)
    async with asyncio.timeout(connect_timeout):
        await loop.create_connection(lambda: stream, host, port)
    try:
        if stream.sock is not None:
            stream.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        await stream.start(
            b"POST %s HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\nConnection: close\r\n\r\n"
            % (path.encode(), host.encode(), port, len(body))
            + body
        )
    except BaseException:
        stream.close()
        raise
    if not stream.eof:
        stream.counted = True
        _streams[0] += 1
    return stream
