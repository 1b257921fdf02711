"""Streamed responses from a runner, relayed at the runner's pace with as little work per token
as the guarantees allow.

What a relayed token costs is mostly fixed per wake-up, read and write (the event loop's turn,
a system call each, the ASGI send through the middleware), not per byte. So:
- the runner's stream is read by a `RunnerStream` (runtime/runner_api.py), which coalesces a fast
  runner's tokens into a few per read;
- `RelayResponse` sends with a plain loop (no task group per response, no wrapper per chunk),
  joining what one read brought into one write, and watches for the client leaving with one
  idle task;
- `LeasedStream` passes the runner's SSE bytes on, cut only at event boundaries, through the
  `Relay` every path of llama.cpp's own bytes goes through.

The endless event streams (the dashboard's, llama.cpp's router's `/models/sse`) take the
scheduler's journal from here too (`journal_events`, `stopping`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Mapping
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from corral.api.activity import note_error
from corral.api.family import OPENAI, Family
from corral.errors import ApiError
from corral.runtime.continuation import Upstream
from corral.runtime.hop import Lease
from corral.runtime.journal import Event
from corral.runtime.meter import count_events, last_timings
from corral.runtime.runner_api import UPSTREAM_ERRORS
from corral.runtime.runner_errors import SSE_ERROR, stream_error

if TYPE_CHECKING:
    from corral.runtime.scheduler import Scheduler

SSE_DONE = b"data: [DONE]"
# llama.cpp's error mid-stream (e.g. a context its parallel requests share has filled): an SSE
# data event holding only an error object
MAX_HELD = 1 << 20  # an "event" longer than this without its blank line passes on as it is
# How llama.cpp's OpenAI chat answer (whole or streamed) says it ended in tool calls; generated
# text cannot hold it (JSON escapes its quotes)
TOOL_CALLS_END = b'"finish_reason":"tool_calls"'


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class RelayResponse(Response):
    """A streamed 200 response whose body is `body_iterator`, sent by a plain loop.

    Starlette's StreamingResponse runs each response in a task group beside a listener for
    the client leaving; this one has a single idle task waiting for the disconnect, which
    cancels the loop (and nothing else), and `close()` runs however the response ends. When
    `more()` says the body has more output ready without waiting (a batch of events read at
    once), the chunks are joined into one write."""

    def __init__(
        self,
        body: AsyncIterator[bytes],
        media_type: str,
        more: Callable[[], bool] | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self.body_iterator = body
        self.status_code = 200
        self.media_type = media_type
        self.background = None
        self.init_headers(headers)
        self.more = more

    async def close(self) -> None:
        """Called once the response is over, whatever ended it."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        task = asyncio.current_task()
        assert task is not None
        state = {"active": True, "gone": False}

        def left(watch: asyncio.Future[None]) -> None:
            if state["active"] and not watch.cancelled() and watch.exception() is None:
                state["gone"] = True
                task.cancel()

        watch = asyncio.ensure_future(_disconnected(receive))
        watch.add_done_callback(left)
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            more = self.more
            parts: list[bytes] = []
            async for chunk in self.body_iterator:
                if more is not None and more():
                    parts.append(chunk)
                    continue
                if parts:
                    parts.append(chunk)
                    chunk = b"".join(parts)
                    parts = []
                message: Message = {"type": "http.response.body", "body": chunk, "more_body": True}
                await send(message)
            if parts:
                await send({"type": "http.response.body", "body": b"".join(parts),
                            "more_body": True})  # fmt: skip
            state["active"] = False
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not state["gone"]:
                raise
            task.uncancel()  # the client left: the response is over, not the server's task
            note_error("client disconnected")
        finally:
            state["active"] = False
            watch.cancel()
            await self.close()


class Relay:
    """What every runner-to-client path of llama.cpp's own bytes does to them as they pass
    (whole events of a stream, or a whole answer): count the generated tokens on the lease's
    tally, notice an answer that ends in tool calls (the agent comes back with the result: its
    runner is held, `Lease.tool_call`), keep llama.cpp's own error line, and give the model
    the name the client asked for (`rename`: replacing the exact `"model":"<alias>"` pair is
    safe, the same bytes inside generated text would be escaped)."""

    def __init__(self, lease: Lease, rename: tuple[bytes, bytes] | None = None) -> None:
        self.lease = lease
        self.rename = rename
        self.error: str | None = None  # llama.cpp's own last error line, if it sent one

    def events(self, out: bytes) -> bytes:
        """Whole events of a stream, as they pass."""
        if self.rename is not None:
            out = out.replace(*self.rename)
        self.error = stream_error(out) or self.error
        count_events(self.lease.tally, out)
        if TOOL_CALLS_END in out:
            self.lease.tool_call = True
        return out

    def whole(self, data: bytes) -> bytes:
        """A whole answer: its tokens at once, from llama.cpp's timings."""
        self.lease.tally.timed(last_timings(data))
        if TOOL_CALLS_END in data:
            self.lease.tool_call = True
        return data.replace(*self.rename) if self.rename is not None else data


class LeasedStream(RelayResponse):
    """Streams from a runner; releases the slot at once when the stream ends, fails, or the
    client disconnects, and also when the body is never started at all.

    An SSE stream (the OpenAI pass-through) always ends with `data: [DONE]` or an error event:
    when the runner dies mid-stream, or ends it without [DONE], the client gets a final
    `data: {"error": {...}}` (what OpenAI sends, and its SDK raises as an APIError) saying why,
    never a bare close. What passes goes through the `Relay` a whole event at a time (so a
    renamed pair is never split)."""

    family: Family = OPENAI  # whose error event ends a stream the runner cut short

    def __init__(
        self,
        body: AsyncIterator[bytes],
        lease: Lease,
        upstream: Upstream | None,
        media_type: str,
        rename: tuple[bytes, bytes] | None = None,
    ) -> None:
        self.relay = Relay(lease, rename)
        if media_type == "text/event-stream":
            body = self._ended(body)
        super().__init__(body, media_type)
        self.lease = lease
        self.upstream = upstream

    def _ended_well(self, tail: bytes) -> bool:
        """Whether the stream ended as its family's streams end, by its last events (`tail`):
        OpenAI's with [DONE] or the runner's own error event."""
        last = tail.rstrip().rsplit(b"\n", 1)[-1].strip()  # the last line with any text
        return last == SSE_DONE or last.startswith(SSE_ERROR)

    async def _ended(self, body: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        held = b""  # an event not yet complete: passed on whole, or not at all
        tail = b""  # the last piece passed on that had any text: its last line is the last
        between = True  # what was passed on ends between events
        relay = self.relay
        try:
            async for chunk in body:
                if not held and chunk.endswith(b"\n\n"):  # whole events: the common case
                    out = chunk
                else:
                    held += chunk
                    cut = held.rfind(b"\n\n") + 2
                    if cut >= 2:
                        out, held = held[:cut], held[cut:]
                    elif len(held) >= MAX_HELD:
                        cut = held.rfind(b"\n") + 1 or len(held)  # a rename never splits a line
                        out, held = held[:cut], held[cut:]
                    else:
                        continue
                out = relay.events(out)
                between = out.endswith(b"\n\n")
                if not out.isspace():
                    tail = out
                yield out
        except UPSTREAM_ERRORS:
            failed = True
        else:
            failed = False
            if held:
                held = relay.events(held)
                between = held.endswith(b"\n\n")
                if not held.isspace():
                    tail = held
                yield held
        if not failed and self._ended_well(tail):
            return
        message = (relay.error if not failed else None) or await self.lease.runner.why_failed()
        # A cut event was never passed on (unless huge), so this one starts on its own.
        yield (b"" if between else b"\n\n") + self.family.event(ApiError(500, message))

    async def close(self) -> None:
        # Closing the upstream connection makes llama.cpp stop generating for this slot.
        if self.upstream is not None:
            self.upstream.close()
        self.lease.release()


# ---- endless event streams (the dashboard's, llama.cpp's router's) -------------------------

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def stopping(request: Request, scheduler: Scheduler) -> bool:
    """Whether the server is on its way down: an endless stream ends."""
    gate = getattr(request.app.state, "gate", None)
    return scheduler.view().closing or bool(getattr(gate, "draining", False))


@contextlib.asynccontextmanager
async def journal_events(scheduler: Scheduler) -> AsyncIterator[asyncio.Queue[Event]]:
    """Journal events from now on, in a queue (listeners must not block)."""
    q: asyncio.Queue[Event] = asyncio.Queue(maxsize=1000)

    def put(ev: Event) -> None:
        with contextlib.suppress(asyncio.QueueFull):
            q.put_nowait(ev)

    stop: Callable[[], Any] = scheduler.listen(put)
    try:
        yield q
    finally:
        stop()
