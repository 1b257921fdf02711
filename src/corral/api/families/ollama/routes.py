"""Ollama API: /api/generate, /api/chat, /api/embed, /api/embeddings, /api/tags, /api/ps,
/api/show, /api/version, field for field as Ollama's docs give them.

Generation goes through the shared layer (api/events): chat and templated generate become a
neutral `Chat` (the model's chat template applies, tools and thinking included); raw prompts,
a request's own Go `template` (rendered here, core/gotemplate), template-less models and
fill-in-the-middle go to llama.cpp's /completion or /infill. The
events become NDJSON chunks (api/families/ollama/render.py).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import math
import time
from collections.abc import Awaitable
from typing import Any, TypeVar

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

import corral
from corral.api import defaults, embed
from corral.api.activity import note_model
from corral.api.chat import Chat
from corral.api.common import (
    check_options,
    field,
    json_response,
    model_field,
    now_rfc3339,
    read_json,
    rfc3339,
    until_disconnect,
)
from corral.api.families.ollama.render import ns, respond
from corral.api.family import OLLAMA, FamilyRoute
from corral.api.paths import entry_paths, hide_paths
from corral.api.service import Resolved, Service
from corral.config import ConfigError, parse_duration
from corral.core.gguf import read_arrays
from corral.core.gotemplate import TemplateError
from corral.core.gotemplate import render as render_template
from corral.core.options import SAMPLING
from corral.errors import ApiError

T = TypeVar("T")


def keep_alive_field(body: dict[str, Any]) -> float | None:
    value = body.get("keep_alive")
    if value is None:
        return None
    try:
        return parse_duration(value, "'keep_alive'")
    except ConfigError as e:
        raise ApiError(400, str(e), "keep_alive") from None


def sampling(options: dict[str, Any]) -> dict[str, Any]:
    """A request's Ollama options as llama.cpp's sampling parameters."""
    out = {SAMPLING[k]: v for k, v in options.items() if k in SAMPLING}
    if out.get("n_predict") == -2:  # Ollama's "fill the context": llama.cpp's -1 does that
        out["n_predict"] = -1
    return out


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


class Ollama:
    def __init__(self, service: Service) -> None:
        self.svc = service

    def routes(self) -> list[Route]:
        return [
            FamilyRoute(OLLAMA, "/api/generate", self.generate, ["POST"]),
            FamilyRoute(OLLAMA, "/api/chat", self.chat, ["POST"]),
            FamilyRoute(OLLAMA, "/api/embed", self.embed, ["POST"]),
            FamilyRoute(OLLAMA, "/api/embeddings", self.embeddings, ["POST"]),
            FamilyRoute(OLLAMA, "/api/tags", self.tags, ["GET"]),
            FamilyRoute(OLLAMA, "/api/ps", self.ps, ["GET"]),
            FamilyRoute(OLLAMA, "/api/show", self.show, ["POST"]),
            FamilyRoute(OLLAMA, "/api/version", self.version, ["GET"]),
        ]

    # ---- generation ------------------------------------------------------------------------
    async def generate(self, request: Request) -> Response:
        body = await read_json(request)
        name = model_field(body)
        prompt = field(body, "prompt", str, "")
        suffix = field(body, "suffix", str, "")
        system = field(body, "system", str)
        template = field(body, "template", str)
        context = token_list(field(body, "context", list, []))
        raw = field(body, "raw", bool, False)
        stream = field(body, "stream", bool, True)
        images = image_list(body.get("images"), "images")
        think = think_field(body)
        top = logprob_fields(body)
        options = check_options(body.get("options"))
        keep_alive = keep_alive_field(body)
        if raw and (template or system or context):  # as Ollama answers it
            raise ApiError(400, "raw mode does not support template, system, or context", "raw")
        if not prompt and not images and not suffix:
            return await self._load_or_unload(request, name, keep_alive, options, {"response": ""})
        r = self.svc.resolve(name)
        self.svc.require(r, "completion", "generate")
        check_think(r, think)
        if images and "vision" not in r.info.capabilities:
            raise ApiError(400, f"model '{name}' does not support images", "images")
        if template and not raw:
            # The request's own template (Go, as Ollama takes it): rendered here, then
            # completed as a raw prompt.
            if images:
                raise ApiError(400, "'template' with 'images' is not supported", "template")
            own = system if system is not None else r.entry.system
            turns = [{"role": "system", "content": own}] if own else []
            try:
                prompt = render_template(template, [*turns, {"role": "user", "content": prompt}])
            except TemplateError as e:
                raise ApiError(400, f"template: {e}", "template") from None
            raw = True
        stop = options.get("stop")
        start = time.monotonic()
        if suffix or raw or not r.info.chat_template:
            if suffix and "insert" not in r.info.capabilities:
                raise ApiError(400, f"model '{name}' does not support insert", "suffix")
            params = {**sampling(options), **completion_logprobs(top)}
            if suffix:  # fill in the middle
                path, payload = "/infill", {"input_prefix": prompt, "input_suffix": suffix}
            else:
                path, payload = "/completion", {"prompt": [*context, prompt]}
                payload |= format_params(body.get("format"), chat=False)
            gen = await self.svc.complete(
                request, r, path, payload | params, options, keep_alive, stop
            )
            context_of = None
        else:
            messages = [{"role": "system", "content": system}] if system else []
            messages.append(user_message(prompt, images))
            chat = Chat(messages, params=chat_params(body, options, think, top))
            gen = await self.svc.generate(
                request, r, chat, options, keep_alive, stop, prefix=context
            )

            context_of = None
            if "context" in body:
                # Ollama's `context` (deprecated there): the conversation's token ids, for the
                # client to send back. It costs runner calls, so only a client that sends one
                # (`[]` to start) gets it back; the prompt's are counted during generation.
                prompt_ids = background(self.svc.prompt_tokens(gen.lease, chat))

                async def context_of(answer: str) -> list[int]:
                    api = gen.lease.hop.api
                    answer_ids = await api.tokenize(answer) if answer else []
                    return [*context, *await prompt_ids, *answer_ids]

        return await respond(request, stream, gen, r.requested, "response", start, top, context_of)

    async def chat(self, request: Request) -> Response:
        body = await read_json(request)
        name = model_field(body)
        messages = field(body, "messages", list, [])
        stream = field(body, "stream", bool, True)
        tools = field(body, "tools", list, [])
        think = think_field(body)
        top = logprob_fields(body)
        options = check_options(body.get("options"))
        keep_alive = keep_alive_field(body)
        if not messages:
            empty = {"message": {"role": "assistant", "content": ""}}
            return await self._load_or_unload(request, name, keep_alive, options, empty)
        r = self.svc.resolve(name)
        self.svc.require(r, "completion", "chat")
        check_think(r, think)
        if tools and "tools" not in r.info.capabilities:
            raise ApiError(400, f"model '{name}' does not support tools", "tools")
        chat = Chat(
            [to_openai_message(m, i) for i, m in enumerate(messages)],
            tools=[check_tool(t, i) for i, t in enumerate(tools)],
            params=chat_params(body, options, think, top),
        )
        start = time.monotonic()
        gen = await self.svc.generate(request, r, chat, options, keep_alive, options.get("stop"))
        return await respond(request, stream, gen, r.requested, "message", start, top)

    async def _load_or_unload(
        self,
        request: Request,
        name: str,
        keep_alive: float | None,
        options: dict[str, Any],
        empty: dict[str, Any],
    ) -> Response:
        """Ollama's convention: no prompt/messages loads the model; with keep_alive 0, unloads
        (a loaded model whose file has gone too)."""
        start = time.monotonic()
        if keep_alive == 0:
            self.svc.unload(name)
            reason = "unload"
        else:
            r = self.svc.resolve(name)
            async with await self.svc.lease(request, r, options, keep_alive):
                reason = "load"
        return json_response({
            "model": name, "created_at": now_rfc3339(), **empty, "done": True,
            "done_reason": reason, "total_duration": ns(time.monotonic() - start),
        })  # fmt: skip

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
        cut = field(body, "truncate", bool, True)
        options = check_options(body.get("options"))
        keep_alive = keep_alive_field(body)
        r = self.svc.resolve(name)
        self.svc.require(r, "embedding", "embeddings")
        start = time.monotonic()
        async with await self.svc.lease(request, r, options, keep_alive) as lease:
            # in chunks over the runner's slots, the vectors decoded by numpy (api/embed.py)
            fitted = await embed.fit(lease.hop, inputs, cut)
            work = embed.embed(lease.hop, fitted)
            vectors, tokens = await until_disconnect(request, work)
        rows = embed.as_json_numbers(embed.shorten(vectors, dims))
        return json_response({
            "model": r.requested, "embeddings": rows if len(rows) else [],
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
        async with await self.svc.lease(request, r, options, keep_alive) as lease:
            if not prompt:
                return json_response({"embedding": []})
            # Cut to what the runner embeds at once, as /api/embed does by default.
            fitted = await embed.fit(lease.hop, [prompt], True)
            work = embed.embed(lease.hop, fitted)
            vectors, _ = await until_disconnect(request, work)
        return json_response({"embedding": embed.as_json_numbers(vectors)[0]})

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
        now_wall = time.time()
        verbose = request.query_params.get("verbose", "").lower() in ("1", "true", "yes")
        view = self.svc.scheduler.view()
        models = []
        for run in view.runners:
            try:
                r: Resolved | None = self.svc.resolve(run.model)
            except ApiError:  # its file was removed or broken while loaded: still listed
                r = None
            if run.state != "ready":
                expires = math.inf if run.state == "loading" else now_wall
            elif run.inflight:
                expires = now_wall + run.keep_alive
            else:
                expires = now_wall + run.expires_in
            models.append({
                "name": run.model, "model": run.model, "size": run.size,
                "digest": r.digest if r else "", "details": r.info.details() if r else {},
                "expires_at": rfc3339(expires),
                "size_vram": sum(n for d, n in run.devices.items() if d != "cpu"),
                "context_length": run.context_length,
                # corral's own additions
                "state": run.state, "requests_in_flight": run.inflight,
                "queued": view.queued.get(run.model, 0),
                # of those in flight, the ones waiting for room in its shared context
                "waiting_for_room": run.waiting_for_room,
                "speculative": run.speculative,  # its drafter (models.toml), or "off"
                "num_parallel": run.slots, "pid": run.pid,
                # every model it serves: models of one file and runner shape share a runner
                "models": self.svc.registry.sharing(run.model),
                # the effective keep-alive in seconds (-1: forever), after models.toml and
                # CORRAL_KEEP_ALIVE_MAX had their say
                "keep_alive": run.keep_alive if math.isfinite(run.keep_alive) else -1,
                # seconds it is still held for an agent's next turn, its last answer having
                # been a tool call (CORRAL_TOOL_HOLD; -1: until its keep-alive ends)
                "held_for": round(run.held_for, 1) if math.isfinite(run.held_for) else -1,
                "devices": [{"id": d, "bytes": n} for d, n in run.devices.items() if n],
                # what the runner process really holds in system memory (PSS), last measured
                "measured_bytes": run.measured,
                # ... and per device (GPU memory as NVML reports it for the process)
                "measured": [{"id": d, "bytes": n} for d, n in run.measured_devices.items()],
                # generated tokens per second relayed to its clients over the last few seconds
                # (0 when idle), and per slot
                "tokens_per_second": round(run.tokens_per_second, 2),
                "slot_tokens_per_second": [round(x, 2) for x in run.slot_tokens_per_second],
            })  # fmt: skip
            if verbose:
                # What a reload would cost now: the share of the model's file in the OS page
                # cache (measured every 2 s while loaded) and the seconds the cost-aware
                # eviction policy predicts from it and the last load.
                took = run.load_seconds if run.state == "ready" else None
                models[-1]["page_cache"] = {
                    "file_bytes": r.info.file_size if r else None,
                    "resident": run.page_cache,
                    "load_seconds": round(took, 3) if took is not None else None,
                    "reload_seconds": round(run.load_cost, 3) if took is not None else None,
                }
        return json_response({"models": models})

    async def show(self, request: Request) -> Response:
        body = await read_json(request)
        name = field(body, "model", str) or field(body, "name", str)
        if not name:
            raise ApiError(400, "'model' is required", "model")
        note_model(name)
        verbose = field(body, "verbose", bool, False)
        r = self.svc.resolve(name)
        # A created model's own template, system prompt, parameters and messages come first.
        params = {**r.entry.options, **r.entry.parameters}
        out: dict[str, Any] = {
            "modelfile": hide_paths(request, defaults.modelfile(r.entry, params),
                                    entry_paths(r.entry), self.svc.registry.models_dir),
            "parameters": defaults.parameter_text(params),
            "template": r.entry.template or r.info.chat_template or "",
            "details": r.info.details(),
            "model_info": r.info.model_info(), "capabilities": list(r.info.capabilities),
            "modified_at": rfc3339(r.entry.modified_at),
        }  # fmt: skip
        if verbose:  # the arrays (tokens, merges, ...) Ollama leaves null unless asked
            arrays = [k for k, n in r.info.array_lengths.items() if n]
            out["model_info"] |= await asyncio.to_thread(read_arrays, r.entry.path, arrays)
        if r.entry.system is not None:
            out["system"] = r.entry.system
        if r.entry.messages:
            out["messages"] = list(r.entry.messages)
        license_text = r.entry.license or r.info.metadata.get("general.license")
        if isinstance(license_text, str):
            out["license"] = license_text
        return json_response(out)

    async def version(self, request: Request) -> Response:
        return json_response(version())


# The Ollama API version corral implements, which clients read from /api/version to decide what
# they may use (Codex --oss refuses anything older than 0.13.4); corral's own is beside it.
OLLAMA_API_VERSION = "0.23.4"


def version() -> dict[str, str]:
    return {"version": OLLAMA_API_VERSION, "corral": corral.__version__}


# ---- request fields ------------------------------------------------------------------------
def think_field(body: dict[str, Any]) -> bool | str | None:
    think = field(body, "think", (bool, str))
    if isinstance(think, str) and think not in ("low", "medium", "high"):
        raise ApiError(400, "invalid 'think': expected true, false, \"low\", \"medium\" or "
                       "\"high\"", "think")  # fmt: skip
    return think


def check_think(r: Resolved, think: bool | str | None) -> None:
    if think not in (None, False) and "thinking" not in r.info.capabilities:
        raise ApiError(400, f"model '{r.requested}' does not support thinking", "think")


def logprob_fields(body: dict[str, Any]) -> int | None:
    """None without `logprobs`, else how many alternatives per token (`top_logprobs`)."""
    top = field(body, "top_logprobs", int, 0)
    if not 0 <= top <= 20:
        raise ApiError(400, "'top_logprobs' must be between 0 and 20", "top_logprobs")
    return top if field(body, "logprobs", bool, False) else None


def completion_logprobs(top: int | None) -> dict[str, Any]:
    return {} if top is None else {"n_probs": max(top, 1)}


def chat_params(
    body: dict[str, Any], options: dict[str, Any], think: bool | str | None, top: int | None
) -> dict[str, Any]:
    params = {**format_params(body.get("format"), chat=True), **sampling(options)}
    if think is not None:
        kwargs: dict[str, Any] = {"enable_thinking": think is not False}
        if isinstance(think, str):
            kwargs["reasoning_effort"] = think
        params["chat_template_kwargs"] = kwargs
    if top is not None:
        params |= {"logprobs": True, "top_logprobs": max(top, 1)}  # 0 turns them off there
    return params


def token_list(value: list[Any]) -> list[int]:
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
        raise ApiError(400, "invalid 'context': expected an array of token ids", "context")
    return value


def image_list(value: Any, name: str) -> list[str]:
    """Ollama's `images`: base64 strings (checked, not decoded here)."""
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise ApiError(400, f"invalid type for '{name}': expected an array of base64 strings",
                       name)  # fmt: skip
    for v in value:
        try:  # a prefix of whole 4-character groups is enough to tell base64 from a path
            base64.b64decode(v[: min(len(v), 4096) // 4 * 4], validate=True)
        except (binascii.Error, ValueError):
            raise ApiError(400, f"invalid '{name}': not base64-encoded image data", name) from None
    return value


def user_message(text: str, images: list[str]) -> dict[str, Any]:
    if not images:
        return {"role": "user", "content": text}
    parts: list[dict[str, Any]] = [{"type": "text", "text": text}] if text else []
    parts += [{"type": "image_url", "image_url": {"url": f"data:image/*;base64,{b}"}}
              for b in images]  # fmt: skip
    return {"role": "user", "content": parts}


def check_tool(tool: Any, i: int) -> dict[str, Any]:
    if not isinstance(tool, dict) or not isinstance(tool.get("function"), dict):
        raise ApiError(400, f"invalid 'tools[{i}]': expected {{\"type\": \"function\", "
                       "\"function\": {...}}", "tools")  # fmt: skip
    fn = tool["function"]
    at = f"tools[{i}].function."
    if not field(fn, "name", str, prefix=at):
        raise ApiError(400, f"'{at}name' is required", "tools")
    field(fn, "description", str, prefix=at)
    field(fn, "parameters", dict, prefix=at)
    return {"type": "function", "function": fn}


def to_openai_message(m: Any, i: int) -> dict[str, Any]:
    """An Ollama chat message as the OpenAI-style message llama.cpp's templates take."""
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
    out = user_message(content or "", image_list(m.get("images"), f"messages[{i}].images"))
    out["role"] = role
    thinking = field(m, "thinking", str, prefix=f"messages[{i}].")
    if thinking:
        out["reasoning_content"] = thinking
    calls = field(m, "tool_calls", list, prefix=f"messages[{i}].")
    if calls:
        out["tool_calls"] = [tool_call(tc, f"messages[{i}].tool_calls[{j}]", f"call_{i}_{j}")
                             for j, tc in enumerate(calls)]  # fmt: skip
    tool_name = field(m, "tool_name", str, prefix=f"messages[{i}].")
    if role == "tool" and tool_name:
        out["name"] = tool_name
    return out


def tool_call(tc: Any, at: str, call_id: str) -> dict[str, Any]:
    """An Ollama tool call (object arguments) as an OpenAI one (arguments as JSON text)."""
    fn = tc.get("function") if isinstance(tc, dict) else None
    if not isinstance(fn, dict):
        raise ApiError(400, f"invalid '{at}': expected {{\"function\": {{\"name\": ..., "
                       "\"arguments\": {...}}}", "messages")  # fmt: skip
    name = field(fn, "name", str, prefix=f"{at}.function.")
    if not name:
        raise ApiError(400, f"'{at}.function.name' is required", "messages")
    args = field(fn, "arguments", (dict, str), {}, prefix=f"{at}.function.")
    text = args if isinstance(args, str) else orjson.dumps(args).decode()
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": text}}


def background(work: Awaitable[T]) -> asyncio.Future[T]:
    """Start `work` now; a failure nobody awaits (the answer ended first) is not reported."""
    fut = asyncio.ensure_future(work)
    fut.add_done_callback(lambda f: f.cancelled() or f.exception())
    return fut
