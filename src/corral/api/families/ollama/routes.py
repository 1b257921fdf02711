"""Ollama API: /api/generate, /api/chat, /api/embed, /api/embeddings, /api/tags, /api/ps,
/api/show, /api/version, field for field as Ollama's docs give them.

Generation goes through the shared layer (api/events): chat and templated generate become a
neutral `Chat` (the model's chat template applies, tools and thinking included); raw prompts,
a request's own Go `template` (rendered here, core/gotemplate), template-less models and
fill-in-the-middle go to llama.cpp's /completion or /infill. Requests are checked and
converted in protocol.py; the events become NDJSON chunks in render.py.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

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
from corral.api.families.ollama.protocol import (
    chat_params,
    check_think,
    check_tool,
    check_vocabulary,
    completion_logprobs,
    format_params,
    image_list,
    keep_alive_field,
    logprob_fields,
    sampling,
    think_field,
    to_openai_message,
    token_list,
    user_message,
)
from corral.api.families.ollama.render import ns, respond
from corral.api.family import OLLAMA, FamilyRoute
from corral.api.paths import entry_paths, hide_paths
from corral.api.service import Resolved, Service
from corral.core.gguf import read_arrays
from corral.core.gotemplate import TemplateError
from corral.core.gotemplate import render as render_template
from corral.errors import ApiError
from corral.runtime.registry import runner_model

T = TypeVar("T")
log = logging.getLogger(__name__)


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
        check_vocabulary(context, r.info.n_vocab)
        check_think(r, think)
        if images and "vision" not in r.info.capabilities:
            raise ApiError(400, f"model '{name}' does not support images", "images")
        # Ollama answers with `context` unless the prompt is raw (or fills in the middle,
        # which corral leaves to llama.cpp's /infill)
        with_context = not raw and not suffix
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
        prompt_ids: Awaitable[list[int]] | None = None
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
            if with_context:  # the prompt's ids as llama.cpp reads them (after the context's)
                tokenize = gen.lease.hop.api.tokenize
                prompt_ids = background(tokenize(prompt, special=True, bos=not context))
        else:
            messages = [{"role": "system", "content": system}] if system else []
            messages.append(user_message(prompt, images))
            chat = Chat(messages, params=chat_params(body, options, think, top))
            gen = await self.svc.generate(
                request, r, chat, options, keep_alive, stop, prefix=context
            )
            # the prompt's ids counted while the answer is generated: the chat as the runner
            # renders it (a created model's defaults applied)
            sent, _ = self.svc.prepared(r, chat)
            prompt_ids = background(self.svc.prompt_tokens(gen.lease, sent, bos=not context))
        context_of = None
        if prompt_ids is not None:
            context_of = conversation(gen.lease.hop.api.tokenize, context, prompt_ids)
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
        r = self.svc.embedder(self.svc.resolve(name))
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
        r = self.svc.embedder(self.svc.resolve(name))
        # A generative model's vector as its runner makes it: Ollama normalised /api/embed's
        # vectors, never this legacy route's
        extra = {"embd_normalize": -1} if r.embedding else None
        async with await self.svc.lease(request, r, options, keep_alive) as lease:
            if not prompt:
                return json_response({"embedding": []})
            # Cut to what the runner embeds at once, as /api/embed does by default.
            fitted = await embed.fit(lease.hop, [prompt], True)
            work = embed.embed(lease.hop, fitted, extra)
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
            try:  # (a generative model's embedding runner: its model's details)
                r: Resolved | None = self.svc.resolve(runner_model(run.model))
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
                "speculative": run.speculative,  # its drafter (models.toml, auto), or "off"
                # why auto drafts or not (judged from the runner's counters: core/drafting)
                **({"drafting": str(c)} if (c := view.drafting.get(run.model)) else {}),
                # a generative model's embedding runner, beside the one that generates
                "embedding": run.model != runner_model(run.model),
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


def conversation(
    tokenize: Callable[[str], Awaitable[list[int]]],
    context: list[int],
    prompt_ids: Awaitable[list[int]],
) -> Callable[[str], Awaitable[list[int] | None]]:
    """Ollama's `context` (deprecated there, still read by older clients): the conversation's
    token ids, the request's context, then its prompt and the answer as the model's tokenizer
    gives them, for the client to send back. None (the field left out) if the runner could not
    count them: the answer itself was given."""

    async def context_of(answer: str) -> list[int] | None:
        try:
            answer_ids = await tokenize(answer) if answer else []
            return [*context, *await prompt_ids, *answer_ids]
        except ApiError as e:
            log.warning("no context for an answer: %s", e.message)
            return None

    return context_of


def background(work: Awaitable[T]) -> asyncio.Future[T]:
    """Start `work` now; a failure nobody awaits (the answer ended first) is not reported."""
    fut = asyncio.ensure_future(work)
    fut.add_done_callback(lambda f: f.cancelled() or f.exception())
    return fut
