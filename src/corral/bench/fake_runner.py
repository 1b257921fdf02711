"""An instant stand-in for llama-server: answers every request at once with a fixed reply.

Plugged into a real `corral serve` as its runner binary (CORRAL_LLAMA_SERVER), so the
scheduler-throughput benchmark measures corral's API + scheduler path alone: no model runs.
It takes llama-server's command line (`--port`, `--alias`, the rest ignored) and speaks just
enough HTTP/1.1 (keep-alive, Content-Length bodies) for corral's aiohttp session.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import sys
from typing import Any, cast

_REPLY = (
    b'{"id":"chatcmpl-fake","object":"chat.completion","created":0,"model":"fake",'
    b'"choices":[{"index":0,"finish_reason":"length","message":{"role":"assistant",'
    b'"content":"ok"}}],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}'
)
_HEALTH = b'{"status":"ok"}'


def _response(body: bytes, close: bool) -> bytes:
    head = (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
        + b"Content-Length: "
        + str(len(body)).encode()
        + (b"\r\nConnection: close" if close else b"\r\nKeep-Alive: timeout=5")
        + b"\r\n\r\n"
    )
    return head + body


class _Protocol(asyncio.Protocol):
    def __init__(self) -> None:
        self.buf = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while self.transport is not None:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            lines = self.buf[:end].split(b"\r\n")
            length, close = 0, False
            for line in lines[1:]:
                key, _, value = line.partition(b":")
                key = key.strip().lower()
                if key == b"content-length":
                    length = int(value)
                elif key == b"connection" and value.strip().lower() == b"close":
                    close = True
            if len(self.buf) < end + 4 + length:
                return
            path = lines[0].split(b" ")[1] if b" " in lines[0] else b"/"
            self.buf = self.buf[end + 4 + length :]
            self.transport.write(_response(_HEALTH if path == b"/health" else _REPLY, close))
            if close:
                self.transport.close()
                return


async def serve(host: str, port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(_Protocol, host, port, backlog=1024)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    host, port = "127.0.0.1", 8080
    for flag, value in itertools.pairwise(args):
        if flag == "--port":
            port = int(value)
        elif flag == "--host":
            host = value
    run: Any = asyncio.run
    with contextlib.suppress(ImportError):
        import uvloop

        run = uvloop.run
    with contextlib.suppress(KeyboardInterrupt):
        run(serve(host, port))
    return 0


SCRIPT = """#!{python}
import sys
from corral.bench.fake_runner import main
sys.exit(main())
"""


if __name__ == "__main__":
    raise SystemExit(main())
