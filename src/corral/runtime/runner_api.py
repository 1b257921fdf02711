"""Everything corral asks of a runner's llama.cpp server, through one typed class per runner
(as Ollama's `LlamaServer`): a request's answer, streamed or whole, with the runner's refusals
and failures as the client's errors; tokenizing and rendering a prompt; and the probes that
must never fail a request (health, `/metrics`, `/slots`, slot save and restore), which answer
None or a string saying what went wrong. No other module talks HTTP to a runner
(tests/test_runner_api.py).

A streamed answer comes on a connection of its own, read by runtime/runner_stream; the rest
share one pooled aiohttp session per runner.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import aiohttp
import orjson

from corral.errors import ApiError
from corral.runtime.runner_errors import runner_error
from corral.runtime.runner_stream import RunnerStream, open_stream

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

    async def tokenize(self, text: str, special: bool = False) -> list[int]:
        """`text` as the model's token ids (`special`: with its BOS, and special tokens written
        in the text parsed as such)."""
        toks = await self.post_json("/tokenize", {
            "content": text, "add_special": special, "parse_special": special,
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

    async def token_counts(self, timeout: float = 1.0) -> tuple[int, int, int, int] | None:
        """(prompt tokens, generated tokens, drafted tokens, drafts accepted) the runner has
        processed since it started (the drafts: speculative decoding's, 0 without); None if
        it does not say."""
        found = await self.metrics(timeout)
        prompt = found.get("llamacpp:prompt_tokens_total")
        generated = found.get("llamacpp:tokens_predicted_total")
        if prompt is None or generated is None:
            return None
        drafted = found.get("llamacpp:spec_decode_num_draft_tokens_total", 0)
        accepted = found.get("llamacpp:spec_decode_num_accepted_tokens_total", 0)
        return int(prompt), int(generated), int(drafted), int(accepted)

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
