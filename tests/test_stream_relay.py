"""The streaming relay's pieces: RunnerStream (corral.runtime.runner_api) against a local
server that writes what a test says when it says, and RelayResponse (corral.api.stream) driven
as an ASGI app."""

from __future__ import annotations

import asyncio
import re
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
import pytest

from corral.api.stream import RelayResponse
from corral.runtime import runner_api as relay
from corral.runtime.runner_api import RunnerStream, open_stream

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


def test_closing_a_stream_closes_its_connection() -> None:
    """close() (the client left) must reach the runner at once, whose generation it stops:
    the relay's own descriptor for the socket must not keep the connection open."""
    seen: list[bytes] = []

    def write(conn: socket.socket) -> None:
        conn.sendall(HEAD + chunk(event(0)))
        conn.settimeout(10)
        seen.append(conn.recv(100))  # b"" once corral closed the connection

    async def main() -> None:
        s = await stream_of(write)
        assert await s.read() == event(0)
        assert s.sock is not None
        s.close()
        assert s.sock is None
        for _ in range(1000):
            if seen:
                break
            await asyncio.sleep(0.01)

    asyncio.run(main())
    assert seen == [b""]


def test_an_unreachable_runner_is_an_oserror() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    listener.close()
    with pytest.raises(OSError):
        asyncio.run(open_stream(url, "/completion", b"{}"))


def test_fast_tokens_are_coalesced_and_the_end_is_not_late() -> None:
    """With a 100 ms window (long, so that a busy machine's scheduling delays stay well within
    its halves): the first two tokens are not held; then tokens 0.2 ms apart go out a window's
    worth per read; the end (the runner closing the connection after [DONE]) is read at once,
    not when the window is over."""
    n, window = 80, 0.1
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
    # 20 tokens/s: far slower than the few-ms window, and than a busy machine's hiccups
    def write(conn: socket.socket) -> None:
        conn.sendall(HEAD)
        for i in range(5):
            conn.sendall(chunk(event(i)))
            time.sleep(0.05)
        conn.sendall(chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")

    async def main() -> None:
        s = await stream_of(write)
        reads = []
        while data := await s.read():
            reads.append(data)
        assert [r.count(b"data: ") for r in reads] == [1, 1, 1, 1, 1, 1]
        s.close()

    asyncio.run(main())


def test_a_read_that_brings_the_end_does_not_wait() -> None:
    """The stream's last events (a finish reason) go out at once even when they come in the
    first half of a window (a 1 s one here) and the runner keeps the connection open: the end is
    looked for before a wait begins, not only while one passes."""
    window = 1.0
    second, third, ended = threading.Event(), threading.Event(), threading.Event()
    last = b'data: {"choices":[{"finish_reason":"stop","delta":{}}]}\n\n'

    def write(conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.sendall(HEAD + chunk(event(0)))
        second.wait(10)
        conn.sendall(chunk(event(1)))
        third.wait(10)
        conn.sendall(chunk(last))
        ended.wait(10)  # the connection stays open until the test has read the end
        conn.sendall(chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")

    async def main() -> None:
        s = await open_stream(serve(write), "/v1/chat/completions", b"{}", window=window)
        reads = [await s.read()]
        second.set()
        reads.append(await s.read())
        third.set()
        t = time.perf_counter()
        reads.append(await s.read())
        took = time.perf_counter() - t
        ended.set()
        while data := await s.read():
            reads.append(data)
        assert reads[2] == last and took < window / 2, (reads, took)
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


# ---- the Ollama stream's plain tokens ---------------------------------------------------------
REST = (
    b',"created":1795418651,"id":"chatcmpl-M26F","model":"m","system_fingerprint":"b0-unknown",'
    b'"object":"chat.completion.chunk"}'
)
DELTA = b'data: {"choices":[{"finish_reason":null,"index":0,"delta":%s}]' + REST + b"\n\n"
# JSON string literals as llama.cpp (nlohmann::json) writes them, some of which orjson writes
# otherwise (\u escapes, an escaped slash): those must take the parsed way.
LITERALS = [
    b'"Hello"', b'" world"', b'"\\n"', b'"\\t\\r\\b\\f"', b'"say \\"hi\\""', b'"a\\\\b"',
    "\u00e9t\u00e9 \U0001f600 \u2028".encode().join([b'"', b'"']), b'"\x7f"', b'"\\u0001"',
    b'"\\u00e9"', b'"a\\/b"', b'""', b'"\\"}}],\\"created\\":1"', b'"x\\\\"',
]  # fmt: skip


def sse_body(literals: list[bytes]) -> list[bytes]:
    """A chat stream's reads: the role, content deltas, odd ones, the end (a read per 3)."""
    events = [DELTA % b'{"role":"assistant","content":null}']
    events += [DELTA % (b'{"content":%s}' % lit) for lit in literals]
    events += [
        DELTA % b'{"reasoning_content":"hmm"}',
        # the same delta with more after it (logprobs): parsed
        b'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":"lp"}}]'
        + REST[:-1] + b',"timings":{"predicted_n":1}}\n\n',
        DELTA.replace(b"null", b'"length"') % b"{}",
        b'data: {"choices":[],"usage":{"completion_tokens":9,"prompt_tokens":3},'
        b'"timings":{"prompt_n":3,"predicted_n":9,"prompt_ms":1.5,"predicted_ms":2.5}}\n\n',
        b"data: [DONE]\n\n",
    ]  # fmt: skip
    return [b"".join(events[i : i + 3]) for i in range(0, len(events), 3)]


class Reads:
    def __init__(self, reads: list[bytes]) -> None:
        self.reads = list(reads)

    async def read(self) -> bytes:
        return self.reads.pop(0) if self.reads else b""

    def close(self) -> None:
        pass


class Lease:
    waited = 0.0
    loaded = False
    tally = None

    def release(self) -> None:
        pass


async def _explain() -> str:
    return "gone"


def _generation(reads: list[bytes]) -> Any:
    from corral.api.events import ChatEvents

    return ChatEvents(Lease(), Reads(reads), [], _explain)  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", ["response", "message"])
def test_plain_tokens_are_written_as_the_parsed_way_writes_them(kind: str) -> None:
    """Ollama's stream puts a plain token's JSON string as it came into its chunk: the same
    bytes, line for line, as parsing every event and writing every chunk with orjson."""
    import orjson

    from corral.api.families.ollama.render import OllamaChunks, ollama_ndjson

    reads = sse_body(LITERALS)

    async def plain() -> list[bytes]:
        gen = _generation(reads)
        return [b async for b in ollama_ndjson(OllamaChunks(gen, 'm"1', kind, 0.0, None))]

    async def parsed() -> list[bytes]:
        gen = _generation(reads)
        chunks = OllamaChunks(gen, 'm"1', kind, 0.0, None).of(gen.events())
        return [orjson.dumps(c) + b"\n" async for c in chunks]

    def normal(lines: list[bytes]) -> list[bytes]:
        """The lines less the two values that differ run to run, byte for byte otherwise."""
        joined = b"".join(lines)
        assert all(orjson.loads(line) for line in joined.splitlines())
        return re.sub(rb'"created_at":"[^"]*"|"total_duration":\d+', b"", joined).splitlines()

    fast, slow = asyncio.run(plain()), asyncio.run(parsed())
    assert normal(fast) == normal(slow)
    assert len(fast) == len(reads)  # what one read brought goes out in one piece
    # every literal but the empty one is a chunk, and the thinking, "lp" and the last
    assert len(normal(fast)) == len(LITERALS) - 1 + 3


def test_plain_tokens_still_give_the_context_its_answer() -> None:
    """Ollama's generate needs the answer's text for `context`: the plain path keeps the
    literals it writes and decodes them at the end, to the text the parsed way joins."""
    from corral.api.families.ollama.render import OllamaChunks, ollama_ndjson

    reads = sse_body(LITERALS)

    async def answer(plain: bool) -> str:
        seen: list[str] = []

        async def context_of(text: str) -> list[int]:
            seen.append(text)
            return [len(text)]

        gen = _generation(reads)
        render = OllamaChunks(gen, "m", "response", 0.0, None, context_of)
        if plain:
            lines = b"".join([b async for b in ollama_ndjson(render)]).splitlines()
        else:
            lines = [orjson.dumps(c) async for c in render.of(gen.events())]
        assert orjson.loads(lines[-1])["context"] == [len(seen[0])]
        return seen[0]

    fast, slow = asyncio.run(answer(True)), asyncio.run(answer(False))
    assert fast == slow and "Hello world" in fast and fast.endswith("lp")


def test_only_plain_deltas_skip_the_parser() -> None:
    from corral.api.events import SSE

    sse = SSE(Reads([]), _explain)  # type: ignore[arg-type]
    sse.plain = True
    taken = {lit for lit in LITERALS if sse._plain((DELTA % (b'{"content":%s}' % lit))[:-2])}
    assert taken == {
        b'"Hello"', b'" world"', b'"\\n"', b'"\\t\\r\\b\\f"', b'"say \\"hi\\""', b'"a\\\\b"',
        "\u00e9t\u00e9 \U0001f600 \u2028".encode().join([b'"', b'"']), b'"\x7f"',
        b'"\\"}}],\\"created\\":1"', b'"x\\\\"',
    }  # fmt: skip


def test_events_of_one_read_are_said_to_be_ready() -> None:
    """A family rendering events one by one (OpenAI chunks, Anthropic, Responses) joins what
    one read brought into one write: `buffered()` holds until the read's last event."""
    from corral.api.chat import Text

    reads = [DELTA % b'{"content":"a"}' + DELTA % b'{"content":"b"}' + DELTA % b'{"content":"c"}',
             DELTA % b'{"content":"d"}', b"data: [DONE]\n\n"]  # fmt: skip

    async def main() -> list[tuple[str, bool]]:
        gen = _generation(reads)
        return [(ev.text, gen.buffered()) async for ev in gen.events() if isinstance(ev, Text)]

    assert asyncio.run(main()) == [("a", True), ("b", True), ("c", False), ("d", False)]


def test_data_after_the_reader_was_cancelled_is_only_kept() -> None:
    """A reader cancelled (its client left) while tokens still come: the data that arrives
    before the cancelled reader has run again must not wake its finished waiter (the event
    loop reported an InvalidStateError from data_received, as a soak run found)."""

    async def main() -> None:
        s = RunnerStream()
        reader = asyncio.ensure_future(s._wait())
        await asyncio.sleep(0)  # the reader waits
        assert s.waiter is not None
        reader.cancel()  # its waiter is cancelled now; the reader runs again on a later turn
        s.data_received(b"more")
        with pytest.raises(asyncio.CancelledError):
            await reader
        assert s.raw == [b"more"] and s.waiter is None

    asyncio.run(main())


def test_an_event_that_is_not_json_ends_the_stream_with_why() -> None:
    """A runner that sends something not JSON mid-stream (not llama.cpp's own): the events
    so far, then the family's error (an ApiError), never an exception out of the app."""
    from corral.api.chat import Text
    from corral.errors import ApiError

    reads = [DELTA % b'{"content":"a"}', b"data: {not json\n\n", DELTA % b'{"content":"b"}']

    async def main() -> tuple[list[str], ApiError | None]:
        gen = _generation(reads)
        texts: list[str] = []
        try:
            async for ev in gen.events():
                if isinstance(ev, Text):
                    texts.append(ev.text)
        except ApiError as e:
            return texts, e
        return texts, None

    texts, err = asyncio.run(main())
    assert texts == ["a"]
    assert err is not None and err.status == 500
    assert "the runner sent an event corral cannot read" in err.message
