"""Ollama API: /api/generate, /api/chat, /api/embed, /api/embeddings, /api/tags, /api/ps,
/api/show, /api/version, field for field as Ollama's docs give them.

Generation goes to the runner's /v1/chat/completions (the model's chat template applies) or,
for raw prompts and template-less models, /completion; both stream SSE, which becomes NDJSON.
"""

from __future__ import annotations

import math
import time
from collections.abc import AsyncIterator
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

import corral
from corral.api.common import (
    ApiError,
    check_options,
    field,
    model_field,
    now_rfc3339,
    read_json,
    rfc3339,
)
from corral.api.service import Resolved, Service, sse_events, until_disconnect
from corral.api.stream import LeasedStream, json_response
from corral.config import ConfigError, parse_duration
from corral.runtime.scheduler import Lease

# Ollama option -> llama.cpp sampling parameter (both endpoints accept llama.cpp's names).
SAMPLING = {
    "temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
    "typical_p": "typical_p", "seed": "seed", "repeat_penalty": "repeat_penalty",
    "repeat_last_n": "repeat_last_n", "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty", "mirostat": "mirostat",
    "mirostat_tau": "mirostat_tau", "mirostat_eta": "mirostat_eta", "stop": "stop",
    "num_keep": "n_keep", "num_predict": "n_predict",
}  # fmt: skip


def keep_alive_field(body: dict[str, Any]) -> float | None:
    value = body.get("keep_alive")
    if value is None:
        return None
    try:
        return parse_duration(value, "'keep_alive'")
    except ConfigError as e:
        raise ApiError(400, str(e), "keep_alive") from None


def sampling(options: dict[str, Any]) -> dict[str, Any]:
    return {SAMPLING[k]: v for k, v in options.items() if k in SAMPLING}


def format_params(fmt: Any, chat: bool) -> dict[str, Any]:
    """Ollama's `format` ("json" or a JSON schema) as llama.cpp's constrained decoding."""
    if fmt is None or fmt == "":
        return {}
    if fmt == "json":
        return {"response_format": {"type": "json_object"}} if chat else {"json_schema": {}}
    if isinstance(fmt, dict):
        if chat:
            return {"response_format": {"type": "json_schema", "json_schema": {"schema": fmt}}}
        return {"json_schema": fmt}
    raise ApiError(400, "invalid 'format': expected \"json\" or a JSON schema object", "format")


def ns(seconds: float) -> int:
    return int(seconds * 1e9)


class Ollama:
    def __init__(self, service: Service) -> None:
        self.svc = service

    def routes(self) -> list[Route]:
        return [
            Route("/api/generate", self.generate, methods=["POST"]),
            Route("/api/chat", self.chat, methods=["POST"]),
            Route("/api/embed", self.embed, methods=["POST"]),
            Route("/api/embeddings", self.embeddings, methods=["POST"]),
            Route("/api/tags", self.tags, methods=["GET"]),
            Route("/api/ps", self.ps, methods=["GET"]),
            Route("/api/show", self.show, methods=["POST"]),
            Route("/api/version", self.version, methods=["GET"]),
        ]

    # ---- generation ------------------------------------------------------------------------
    async def generate(self, request: Request) -> Response:
        body = await read_json(request)
        name = model_field(body)
        prompt = field(body, "prompt", str, "")
        system = field(body, "system", str)
        raw = field(body, "raw", bool, False)
        stream = field(body, "stream", bool, True)
        images = field(body, "images", list)
        field(body, "suffix", str)
        options = check_options(body.get("options"))
        keep_alive = keep_alive_field(body)
        r = self.svc.resolve(name)
        if not prompt and not images:
            return await self._load_or_unload(request, r, keep_alive, options, {"response": ""})
        self.svc.require(r, "completion", "generate")
        if images:
            raise ApiError(400, f"model '{name}' does not support images", "images")
        if raw or not r.info.chat_template:
            path = "/completion"
            payload = {"prompt": prompt, **format_params(body.get("format"), chat=False)}
        else:
            path = "/v1/chat/completions"
            messages = ([{"role": "system", "content": system}] if system else []) + [
                {"role": "user", "content": prompt}
            ]
            payload = {"messages": messages, **format_params(body.get("format"), chat=True)}
        payload |= sampling(options) | {"stream": True}
        return await self._run(request, r, path, payload, options, keep_alive, stream, "response")

    async def chat(self, request: Request) -> Response:
        body = await read_json(request)
        name = model_field(body)
        messages = field(body, "messages", list, [])
        stream = field(body, "stream", bool, True)
        tools = field(body, "tools", list)
        think = field(body, "think", (bool, str))
        options = check_options(body.get("options"))
        keep_alive = keep_alive_field(body)
        r = self.svc.resolve(name)
        if not messages:
            return await self._load_or_unload(
                request, r, keep_alive, options, {"message": {"role": "assistant", "content": ""}}
            )
        self.svc.require(r, "completion", "chat")
        payload: dict[str, Any] = {
            "messages": [to_openai_message(m, i) for i, m in enumerate(messages)],
            "stream": True,
            **format_params(body.get("format"), chat=True),
            **sampling(options),
        }
        if tools:
            payload["tools"] = tools
        if think is not None:
            payload["chat_template_kwargs"] = {"enable_thinking": bool(think)}
        return await self._run(
            request, r, "/v1/chat/completions", payload, options, keep_alive, stream, "message"
        )

    async def _load_or_unload(
        self,
        request: Request,
        r: Resolved,
        keep_alive: float | None,
        options: dict[str, Any],
        empty: dict[str, Any],
    ) -> Response:
        """Ollama's convention: no prompt/messages loads the model; with keep_alive 0, unloads."""
        start = time.monotonic()
        if keep_alive == 0:
            self.svc.scheduler.unload(r.name)
            reason = "unload"
        else:
            lease = await self.svc.lease(request, r, options, keep_alive)
            lease.release()
            reason = "load"
        return json_response({
            "model": r.requested, "created_at": now_rfc3339(), **empty, "done": True,
            "done_reason": reason, "total_duration": ns(time.monotonic() - start),
        })  # fmt: skip

    async def _run(
        self,
        request: Request,
        r: Resolved,
        path: str,
        payload: dict[str, Any],
        options: dict[str, Any],
        keep_alive: float | None,
        stream: bool,
        kind: str,
    ) -> Response:
        start = time.monotonic()
        if path.startswith("/v1/"):
            payload["stream_options"] = {"include_usage": True}  # timings ride on the last chunk
        lease = await self.svc.lease(request, r, options, keep_alive)
        try:
            resp = await self.svc.post(lease, path, payload)
        except BaseException:
            lease.release()
            raise
        chunks = translate(r.requested, kind, sse_events(resp, lease.runner), start, lease)
        if stream:
            return LeasedStream(ndjson(chunks), lease, resp, media_type="application/x-ndjson")
        try:
            final = await until_disconnect(request, collect(chunks, kind))
        finally:
            resp.release()
            lease.release()
        return json_response(final)

    # ---- embeddings ------------------------------------------------------------------------
    async def embed(self, request: Request) -> Response:
        body = await read_json(request)
        name = model_field(body)
        inputs = body.get("input")
        if isinstance(inputs, str):
            inputs = [inputs] if inputs else []
        if inputs is None:
            inputs = []
        if not isinstance(inputs, list) or not all(isinstance(s, str) for s in inputs):
            raise ApiError(
                400, "invalid type for 'input': expected a string or array of strings", "input"
            )
        dims = field(body, "dimensions", int)
        if dims is not None and dims < 1:
            raise ApiError(400, "'dimensions' must be positive", "dimensions")
        field(body, "truncate", bool)
        options = check_options(body.get("options"))
        keep_alive = keep_alive_field(body)
        r = self.svc.resolve(name)
        self.svc.require(r, "embedding", "embeddings")
        start = time.monotonic()
        lease = await self.svc.lease(request, r, options, keep_alive)
        try:
            if not inputs:
                vectors: list[list[float]] = []
                tokens = 0
            else:
                data = await until_disconnect(
                    request, self.svc.post_json(lease, "/v1/embeddings", {"input": inputs})
                )
                items = sorted(data["data"], key=lambda d: d["index"])
                vectors = [truncate(d["embedding"], dims) for d in items]
                tokens = data.get("usage", {}).get("prompt_tokens", 0)
        finally:
            lease.release()
        return json_response({
            "model": r.requested, "embeddings": vectors,
            "total_duration": ns(time.monotonic() - start),
            "load_duration": ns(lease.waited) if lease.loaded else 0,
            "prompt_eval_count": tokens,
        })  # fmt: skip

    async def embeddings(self, request: Request) -> Response:
        body = await read_json(request)
        name = model_field(body)
        prompt = field(body, "prompt", str, "")
        options = check_options(body.get("options"))
        keep_alive = keep_alive_field(body)
        r = self.svc.resolve(name)
        self.svc.require(r, "embedding", "embeddings")
        lease = await self.svc.lease(request, r, options, keep_alive)
        try:
            if not prompt:
                return json_response({"embedding": []})
            data = await until_disconnect(
                request, self.svc.post_json(lease, "/v1/embeddings", {"input": [prompt]})
            )
        finally:
            lease.release()
        return json_response({"embedding": data["data"][0]["embedding"]})

    # ---- model listing ---------------------------------------------------------------------
    async def tags(self, request: Request) -> Response:
        models = []
        for entry in self.svc.registry.all():
            item: dict[str, Any] = {
                "name": entry.name, "model": entry.name,
                "modified_at": rfc3339(entry.modified_at), "size": entry.size,
            }  # fmt: skip
            try:
                r = self.svc.resolve(entry.name)
                item |= {"digest": r.digest, "details": r.info.details()}
            except ApiError as e:
                item |= {"digest": "", "details": {}, "error": e.message}
            models.append(item)
        return json_response({"models": models})

    async def ps(self, request: Request) -> Response:
        now_wall, now_mono = time.time(), time.monotonic()
        models = []
        for book, runner in self.svc.scheduler.snapshot():
            r = self.svc.resolve(book.model)
            if book.state != "ready":
                expires = math.inf if book.state == "loading" else now_wall
            elif book.inflight:
                expires = now_wall + book.keep_alive
            else:
                expires = now_wall + (book.expires_at - now_mono)
            models.append({
                "name": book.model, "model": book.model, "size": book.size,
                "digest": r.digest, "details": r.info.details(),
                "expires_at": rfc3339(expires),
                "size_vram": sum(n for d, n in book.devices.items() if d != "cpu"),
                "context_length": book.spec.n_ctx,
                # corral's own additions
                "state": book.state, "requests_in_flight": book.inflight,
                "queued": self.svc.scheduler.queued(book.model),
                "num_parallel": book.spec.num_parallel, "pid": runner.pid,
                "devices": [{"id": d, "bytes": n} for d, n in book.devices.items() if n],
            })  # fmt: skip
        return json_response({"models": models})

    async def show(self, request: Request) -> Response:
        body = await read_json(request)
        name = field(body, "model", str) or field(body, "name", str)
        if not name:
            raise ApiError(400, "'model' is required", "model")
        r = self.svc.resolve(name)
        params = {**r.entry.options}
        param_text = "\n".join(f"{k:<30} {v}" for k, v in params.items())
        modelfile = f"# Modelfile generated by corral\nFROM {r.entry.path}\n" + "".join(
            f"PARAMETER {k} {v}\n" for k, v in params.items()
        )
        out: dict[str, Any] = {
            "modelfile": modelfile, "parameters": param_text,
            "template": r.info.chat_template or "", "details": r.info.details(),
            "model_info": r.info.model_info(), "capabilities": list(r.info.capabilities),
            "modified_at": rfc3339(r.entry.modified_at),
        }  # fmt: skip
        license_text = r.info.metadata.get("general.license")
        if isinstance(license_text, str):
            out["license"] = license_text
        return json_response(out)

    async def version(self, request: Request) -> Response:
        return json_response({"version": corral.__version__})


# ---- translation helpers (pure where possible) -------------------------------------------------
def to_openai_message(m: Any, i: int) -> dict[str, Any]:
    if not isinstance(m, dict):
        raise ApiError(400, f"invalid type for 'messages[{i}]': expected an object", "messages")
    role = m.get("role")
    if not isinstance(role, str) or not role:
        raise ApiError(400, f"'messages[{i}].role' is required", "messages")
    content = m.get("content", "")
    if content is not None and not isinstance(content, str):
        raise ApiError(
            400, f"invalid type for 'messages[{i}].content': expected a string", "messages"
        )
    if m.get("images"):
        raise ApiError(400, "this model does not support images", "messages")
    out: dict[str, Any] = {"role": role, "content": content or ""}
    if m.get("tool_calls"):
        out["tool_calls"] = [
            {"id": f"call_{i}_{j}", "type": "function",
             "function": {"name": tc.get("function", {}).get("name", ""),
                          "arguments": orjson.dumps(tc.get("function", {}).get("arguments", {}))
                          .decode()}}
            for j, tc in enumerate(m["tool_calls"])
        ]  # fmt: skip
    if role == "tool" and m.get("tool_name"):
        out["name"] = m["tool_name"]
    return out


def truncate(vec: list[float], dims: int | None) -> list[float]:
    if not dims or dims >= len(vec):
        return vec
    cut = vec[:dims]
    norm = math.sqrt(sum(x * x for x in cut)) or 1.0
    return [x / norm for x in cut]


async def translate(
    model: str, kind: str, events: AsyncIterator[dict[str, Any]], start: float, lease: Lease
) -> AsyncIterator[dict[str, Any]]:
    """llama.cpp stream events -> Ollama chunks; the last one carries done and the timings."""
    timings: dict[str, Any] = {}
    reason = "stop"
    tool_calls: dict[int, dict[str, Any]] = {}
    async for ev in events:
        timings = ev.get("timings") or timings
        if "choices" in ev:  # /v1/chat/completions
            for choice in ev["choices"]:
                delta = choice.get("delta") or {}
                for tc in delta.get("tool_calls") or []:
                    slot = tool_calls.setdefault(tc.get("index", 0), {"name": "", "arguments": ""})
                    fn = tc.get("function") or {}
                    slot["name"] += fn.get("name") or ""
                    slot["arguments"] += fn.get("arguments") or ""
                text, thinking = delta.get("content"), delta.get("reasoning_content")
                if text or thinking:
                    yield _chunk(model, kind, text or "", thinking)
                if choice.get("finish_reason"):
                    reason = "length" if choice["finish_reason"] == "length" else "stop"
        else:  # /completion
            text = ev.get("content", "")
            if text:
                yield _chunk(model, kind, text, None)
            if ev.get("stop"):
                reason = "length" if ev.get("stop_type") == "limit" else "stop"
    last: Any = "" if kind == "response" else {"role": "assistant", "content": ""}
    if tool_calls and kind == "message":
        last["tool_calls"] = [
            {"function": {"name": t["name"], "arguments": _json_or_str(t["arguments"])}}
            for _, t in sorted(tool_calls.items())
        ]
    yield {
        "model": model, "created_at": now_rfc3339(), kind: last, "done": True,
        "done_reason": reason, "total_duration": ns(time.monotonic() - start),
        "load_duration": ns(lease.waited) if lease.loaded else 0,
        "prompt_eval_count": int(timings.get("prompt_n", 0)),
        "prompt_eval_duration": int(timings.get("prompt_ms", 0) * 1e6),
        "eval_count": int(timings.get("predicted_n", 0)),
        "eval_duration": int(timings.get("predicted_ms", 0) * 1e6),
    }  # fmt: skip


def _chunk(model: str, kind: str, text: str, thinking: str | None) -> dict[str, Any]:
    """One streamed Ollama chunk: generate has `response` (+ `thinking`), chat a `message`."""
    out: dict[str, Any] = {"model": model, "created_at": now_rfc3339()}
    if kind == "response":
        out["response"] = text
        if thinking:
            out["thinking"] = thinking
    else:
        out["message"] = {"role": "assistant", "content": text}
        if thinking:
            out["message"]["thinking"] = thinking
    out["done"] = False
    return out


def _json_or_str(text: str) -> Any:
    try:
        return orjson.loads(text) if text else {}
    except orjson.JSONDecodeError:
        return text


async def collect(chunks: AsyncIterator[dict[str, Any]], kind: str) -> dict[str, Any]:
    """A whole non-streamed answer from the chunks of a streamed one."""
    parts: list[str] = []
    thinking: list[str] = []
    final: dict[str, Any] = {}
    async for c in chunks:
        if c["done"]:
            final = c
            break
        if kind == "response":
            parts.append(c["response"])
            thinking.append(c.get("thinking", ""))
        else:
            parts.append(c["message"]["content"])
            thinking.append(c["message"].get("thinking", ""))
    if kind == "response":
        final["response"] = "".join(parts)
        if any(thinking):
            final["thinking"] = "".join(thinking)
    else:
        final["message"]["content"] = "".join(parts)
        if any(thinking):
            final["message"]["thinking"] = "".join(thinking)
    return final


async def ndjson(chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
    try:
        async for c in chunks:
            yield orjson.dumps(c) + b"\n"
    except ApiError as e:  # mid-stream failure: Ollama reports it as a final error line
        yield orjson.dumps({"error": e.message}) + b"\n"
