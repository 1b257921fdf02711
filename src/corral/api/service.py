"""The one object the API adapters talk to: resolve a model, lease a runner, generate.

Adapters stay thin: they translate wire formats. Which runner a request needs and its lease
are decided below the API (runtime/admission, `Service.admission`); the runner is called
through the hop's pipeline (runtime/hop, `Service.client`) or its API (`Lease.hop.api`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import orjson
from starlette.requests import Request
from starlette.responses import Response

from corral.api import defaults
from corral.api.activity import note_embedded, note_lease, note_model
from corral.api.chat import Chat, tool_name
from corral.api.common import until_disconnect
from corral.api.events import (
    ChatEvents,
    CompletionEvents,
    FallbackEvents,
    ForcedToolEvents,
    Generation,
    forced_schema,
)
from corral.api.stream import LeasedStream, Relay
from corral.api.toolprompt import fallback_grammar, template_body
from corral.config import Settings
from corral.core.devices import Device
from corral.core.gguf import (
    GGUFError,
    ModelInfo,
    read_model_info,
    template_has_tools,
)
from corral.core.gotemplate import TemplateError
from corral.core.options import SAMPLING
from corral.core.roles import has_later_system, place_system, renders_later_system
from corral.core.spec import jinja_template
from corral.errors import ApiError
from corral.runtime.admission import Admission, Resolved, unusable_template
from corral.runtime.continuation import Upstream
from corral.runtime.hop import Lease, RunnerClient
from corral.runtime.meter import last_object
from corral.runtime.registry import ModelEntry, Registry, canonical_name, embedding_runner
from corral.runtime.scheduler import Scheduler

T = TypeVar("T")
log = logging.getLogger(__name__)


class Service:
    def __init__(
        self,
        settings: Settings,
        registry: Registry,
        scheduler: Scheduler,
        devices: list[Device],
        client: RunnerClient,
    ) -> None:
        self.settings = settings
        self.registry = registry
        self.scheduler = scheduler
        self.devices = devices
        self.admission = Admission(settings, scheduler, devices)  # which runner, and a lease
        self._vision: dict[Any, tuple[ModelInfo, ModelInfo]] = {}
        self._unusable: set[tuple[Path, float]] = set()  # broken files logged, by modification
        self.client = client  # the hop to the runners
        # What the operator should do about this machine (a GPU the runner build cannot use),
        # said at start-up and on the dashboard
        self.advice: tuple[str, ...] = ()

    # ---- models ----------------------------------------------------------------------------
    def entry(self, name: str) -> ModelEntry:
        entry = self.registry.get(name)
        if entry is None:
            raise ApiError(404, f"model '{name}' not found", "model")
        return entry

    def resolve(self, name: str) -> Resolved:
        entry = self.entry(name)
        try:
            info = read_model_info(entry.path)
        except FileNotFoundError:
            raise ApiError(
                404, f"model '{name}' not found: {entry.path} is missing", "model"
            ) from None
        except GGUFError as e:
            self._log_unusable(entry, str(e))
            raise ApiError(500, f"model '{name}' cannot be loaded: {e}") from None
        if entry.projector is not None:  # its projector reads images: "vision"
            info = self._with_vision(info)
        return Resolved(name, entry, info, self.registry.runner_name(entry.name))

    def _log_unusable(self, entry: ModelEntry, why: str) -> None:
        """A broken file is logged once, when first found (per file and modification)."""
        key = (entry.path, entry.modified_at)
        if key not in self._unusable:
            self._unusable.add(key)
            log.warning("model '%s' is unusable: %s (%s)", entry.name, why, entry.path)

    def _with_vision(self, info: ModelInfo) -> ModelInfo:
        """`info` with the "vision" capability, the same object for the same `info` (the
        estimate cache compares ModelInfo by identity)."""
        hit = self._vision.get(info.path)
        if hit is not None and hit[0] is info:
            return hit[1]
        caps = info.capabilities
        caps = caps if "vision" in caps else (*caps, "vision")
        out = dataclasses.replace(info, capabilities=caps)
        if len(self._vision) > 1024:
            self._vision.clear()
        self._vision[info.path] = (info, out)
        return out

    def unload(self, name: str) -> bool:
        """Unload a model by name: a model on disk, or a loaded one whose file is gone (the
        scheduler still knows it), with its embedding runner; or that runner alone, by its
        name. False if it was not loaded; 404 if it is neither."""
        loaded = {canonical_name(r.model): r.model for r in self.scheduler.view().runners}
        model = loaded.get(canonical_name(name))
        if model is None:
            model = self.registry.runner_name(self.entry(name).name)
        stopped = self.scheduler.unload(model)
        # a generative model's embedding runner goes with it
        embedder = embedding_runner(model)
        if embedder in loaded.values():
            stopped = self.scheduler.unload(embedder) or stopped
        return stopped

    def native_tools(self, r: Resolved) -> bool:
        """Whether the model's chat template (a created model's own, else the GGUF's) renders
        tools, so that llama.cpp's chat endpoint shows them to the model and parses its calls.
        Other models get tools from corral (`corral.api.toolprompt`)."""
        return template_has_tools(effective_template(r))

    def require(self, r: Resolved, capability: str, what: str) -> None:
        if capability not in r.info.capabilities:
            raise ApiError(400, f"model '{r.requested}' does not support {what}", "model")

    def embedder(self, r: Resolved) -> Resolved:
        """The model as it embeds: an embedding model by its runner; a generative model, as
        Ollama embeds with any model, by a second runner of its file in embedding mode (the
        last token's hidden state: core/spec.LAST_POOLING), booked, kept alive and unloaded
        as any runner, under its own name (registry.embedding_runner). A rerank model: 400."""
        if "embedding" in r.info.capabilities:
            return r
        self.require(r, "completion", "embeddings")
        return dataclasses.replace(r, runner=embedding_runner(r.runner), embedding=True)

    # ---- leases ----------------------------------------------------------------------------
    async def lease(
        self, request: Request, r: Resolved, options: dict[str, Any], keep_alive: float | None
    ) -> Lease:
        """Wait for a runner slot (runtime/admission). A client that leaves while waiting
        (queued, or while its model loads) takes its queue entry with it."""
        note_model(r.name)  # the request's model (its log line, its metrics): the one resolved

        def watch(granted: Awaitable[Lease]) -> Awaitable[Lease]:
            return until_disconnect(request, granted, Lease.release)

        lease = await self.admission.lease(r, options, keep_alive, watch)
        note_lease(lease.tally)  # the request log's tokens and timings
        return lease

    async def leased(
        self,
        request: Request,
        r: Resolved,
        options: dict[str, Any],
        keep_alive: float | None,
        payload: Mapping[str, Any],
        start: Callable[[Lease], Awaitable[T]],
    ) -> T:
        """`start(lease)` on a leased slot, sent once more after a reload with a larger context
        if the prompt did not fit (`Admission.leased`)."""

        def lease(opts: dict[str, Any]) -> Awaitable[Lease]:
            return self.lease(request, r, opts, keep_alive)

        return await self.admission.leased(r, options, keep_alive, payload, start, lease)

    # ---- talking to a runner -----------------------------------------------------------------
    async def pass_through(
        self,
        request: Request,
        r: Resolved,
        path: str,
        body: dict[str, Any],
        stream: bool,
        relay: type[LeasedStream] = LeasedStream,
    ) -> Response:
        """The runner's answer to `body` on `path` as it is (`relay` streams it), with the
        model renamed to the one the client asked for."""

        if stream:
            async def send(lease: Lease) -> tuple[Lease, Upstream]:
                return lease, await self.client.stream(lease, path, body)

            lease, resp = await self.leased(request, r, {}, None, body, send)
            return relay(resp, lease, resp, "text/event-stream", rename=_renamed(lease, r))

        async def whole(lease: Lease) -> tuple[Lease, bytes]:
            # a client that leaves closes the connection: llama.cpp stops generating
            return lease, await until_disconnect(request, self.client.answer(lease, path, body))

        lease, data = await self.leased(request, r, {}, None, body, whole)
        try:
            if path == "/v1/embeddings":  # the prompt tokens it read, from its usage
                usage = last_object(data, b"usage") or {}
                note_embedded(int(usage.get("prompt_tokens") or 0))
            data = Relay(lease, _renamed(lease, r)).whole(data)
        finally:
            lease.release()
        return Response(data, media_type="application/json")

    # ---- generating ------------------------------------------------------------------------
    def check_chat(self, r: Resolved, messages: list[dict[str, Any]]) -> None:
        """400 unless the model can take these messages: it chats, and sees images if sent."""
        self.require(r, "completion", "chat")
        if "vision" not in r.info.capabilities and has_images(messages):
            raise ApiError(400, f"model '{r.requested}' does not support images", "messages")

    async def generate(
        self,
        request: Request,
        r: Resolved,
        chat: Chat,
        options: dict[str, Any],
        keep_alive: float | None,
        stop: list[str] | None = None,
        prefix: list[int] | None = None,
    ) -> Generation:
        """Lease a slot and start the runner on `chat`; the events come from the Generation.

        `stop` sequences are found by corral (not llama.cpp) so that the one that ended the
        text can be reported. `prefix` (token ids, Ollama's `context`) goes before the rendered
        prompt. Every check the client can fail comes before the lease."""
        self.check_chat(r, chat.messages)
        chat, stop = self.prepared(r, chat, stop)
        forced = chat.forced_tools
        if forced is not None and not forced:
            raise ApiError(
                400, f"tool_choice names '{chat.tool_choice}', which is not among the tools",
                "tool_choice",
            )  # fmt: skip
        # A template without tools: corral shows the model the tools and finds its calls.
        fallback = bool(chat.tools) and chat.tool_choice != "none" and not self.native_tools(r)
        return await self.leased(
            request, r, options, keep_alive, chat.params,
            lambda lease: self._generate(lease, chat, stop, prefix, forced, fallback),
        )  # fmt: skip

    def prepared(
        self, r: Resolved, chat: Chat, stop: list[str] | None = None
    ) -> tuple[Chat, list[str] | None]:
        """`chat` as the runner gets it: a created model's system prompt, messages and
        parameters applied, a later system message placed where the template renders it."""
        if r.entry.has_defaults:  # a created model's system, parameters
            chat, stop = defaults.chat(r.entry, chat, stop)
        if has_later_system(chat.messages):  # e.g. Codex's developer messages, Claude Code's
            template = effective_template(r)
            placed = place_system(chat.messages, renders_later_system(template))
            chat = dataclasses.replace(chat, messages=placed)
        return chat, stop

    async def _generate(
        self,
        lease: Lease,
        chat: Chat,
        stop: list[str] | None,
        prefix: list[int] | None,
        forced: list[dict[str, Any]] | None,
        fallback: bool,
    ) -> Generation:
        if forced is None and not prefix and not fallback:
            payload = {"messages": chat.messages, **chat.params,
                       "stream_options": {"include_usage": True}}  # fmt: skip
            if chat.tools and chat.tool_choice != "none":
                payload["tools"] = chat.tools
            return await self._start(lease, "/v1/chat/completions", payload, ChatEvents, stop)
        # Rendered here, then completed as raw text: a forced call is constrained by a
        # schema, which llama.cpp refuses alongside tools on its chat endpoint, and a
        # fallback call by a lazy grammar, which its chat endpoint does not take.
        kwargs = chat.params.get("chat_template_kwargs") or {}
        if forced is not None:
            kwargs = {**kwargs, "enable_thinking": False}
        prompt = await lease.hop.api.apply_template(
            {**template_body(chat, fallback, forced), "chat_template_kwargs": kwargs}
        )
        payload = {k: v for k, v in chat.params.items() if k in COMPLETION_PARAMS}
        payload["prompt"] = [*(prefix or []), prompt]
        if forced is not None:
            payload["json_schema"] = forced_schema(forced)
            return await self._start(lease, "/completion", payload, ForcedToolEvents, stop)
        if (fmt := chat.params.get("response_format") or {}).get("type") in JSON_FORMATS:
            payload["json_schema"] = response_schema(fmt)
        if not fallback:
            return await self._start(lease, "/completion", payload, CompletionEvents, stop)
        if "json_schema" not in payload:  # a JSON answer was asked for: no calls then
            payload |= fallback_grammar(chat.tools)
        names = frozenset(tool_name(t) for t in chat.tools)
        fallback_events = functools.partial(FallbackEvents, tools=names)
        return await self._start(lease, "/completion", payload, fallback_events, stop)

    async def prompt_tokens(self, lease: Lease, chat: Chat, bos: bool = True) -> list[int]:
        """The token ids of `chat`'s prompt as the runner renders it: its own chat template
        (with the tools, as generate sends them), then its tokenizer, as for generation
        (`bos` false: as llama.cpp reads it after token ids, Ollama's `context`). Image tokens
        are not counted."""
        spec = lease.runner.spec
        template = spec.chat_template or read_model_info(spec.path).chat_template
        fallback = bool(chat.tools) and chat.tool_choice != "none"
        payload = template_body(chat, fallback and not template_has_tools(template),
                                chat.forced_tools)  # fmt: skip
        if "chat_template_kwargs" in chat.params:
            payload["chat_template_kwargs"] = chat.params["chat_template_kwargs"]
        api = lease.hop.api
        return await api.tokenize(await api.apply_template(payload), special=True, bos=bos)

    async def complete(
        self,
        request: Request,
        r: Resolved,
        path: str,
        payload: dict[str, Any],
        options: dict[str, Any],
        keep_alive: float | None,
        stop: list[str] | None = None,
    ) -> Generation:
        """Lease a slot and start a raw completion (llama.cpp's /completion or /infill)."""
        self.require(r, "completion", "generate")
        if r.entry.has_defaults:  # a created model's parameters
            payload = defaults.sampling(r.entry, payload, "n_predict")
            stop = defaults.stop(r.entry, stop)
        return await self.leased(
            request, r, options, keep_alive, payload,
            lambda lease: self._start(lease, path, payload, CompletionEvents, stop),
        )  # fmt: skip

    async def _start(
        self,
        lease: Lease,
        path: str,
        payload: dict[str, Any],
        kind: Callable[[Lease, Upstream, list[str], Callable[[], Awaitable[str]]], Generation],
        stop: list[str] | None,
    ) -> Generation:
        resp = await self.client.stream(lease, path, payload)
        return kind(lease, resp, stop or [], lease.runner.why_failed)


def _renamed(lease: Lease, r: Resolved) -> tuple[bytes, bytes] | None:
    """llama.cpp names the model by the runner's alias (the name the runner is known by, shared
    by every model of its files); clients expect the name they sent (None: the same)."""
    if lease.runner.name == r.requested:
        return None
    return b'"model":' + orjson.dumps(lease.runner.name), b'"model":' + orjson.dumps(r.requested)


def effective_template(r: Resolved) -> str | None:
    """The chat template a runner of this model renders with: a created model's own, else the
    GGUF's (None: llama.cpp's ChatML fallback)."""
    return chat_template(r) or r.info.chat_template


def chat_template(r: Resolved) -> str | None:
    """The chat template a runner of this model renders with; None: the GGUF's own."""
    if not r.entry.template:
        return None
    try:
        return jinja_template(r.entry.template)
    except TemplateError as e:  # /api/create refuses these: a manifest from elsewhere
        raise unusable_template(r, e) from None


# llama.cpp /completion parameters a chat request may carry (forced tool calls go there): the
# sampling parameters of the options table, and these.
COMPLETION_PARAMS = frozenset({*SAMPLING.values(), "max_tokens", "n_probs", "json_schema"})


JSON_FORMATS = ("json_object", "json_schema")


def response_schema(fmt: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI JSON response_format as the JSON schema llama.cpp's /completion takes ({}:
    any JSON)."""
    if fmt.get("type") == "json_schema":
        return dict((fmt.get("json_schema") or {}).get("schema") or {})
    return {}


def has_images(messages: list[dict[str, Any]]) -> bool:
    return any(
        isinstance(part, dict) and part.get("type") in ("image_url", "input_image", "image")
        for m in messages if isinstance(m.get("content"), list)
        for part in m["content"]
    )  # fmt: skip
