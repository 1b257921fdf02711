"""The one object the API adapters talk to: resolve a model, lease a runner, generate.

Adapters stay thin: they translate wire formats; which file, which runner shape and how much
memory are decided here (with the pure core: core/spec, core/placement), and the runner is
called through the runner client (runtime/client, `Service.client`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import orjson
from starlette.requests import Request
from starlette.responses import Response

from corral.api import defaults
from corral.api.activity import note_embedded, note_lease, note_model
from corral.api.common import until_disconnect
from corral.api.events import Chat, Generation, forced_schema, tool_name
from corral.api.stream import TOOL_CALLS_END, LeasedStream
from corral.api.toolprompt import fallback_grammar, template_body
from corral.config import Settings
from corral.core.context import DEFAULT_OUTPUT, UNKNOWN_TRAINED_CAP, auto_context, grown_context
from corral.core.devices import Device
from corral.core.estimate import KV_CACHE_TYPES, check_kv_cache_type
from corral.core.gguf import (
    AdapterInfo,
    GGUFError,
    ModelInfo,
    ProjectorInfo,
    read_model_info,
    read_parts,
    template_has_tools,
)
from corral.core.gotemplate import TemplateError
from corral.core.placement import placer
from corral.core.requests import Fit, Sizing, scaled_placer
from corral.core.roles import has_later_system, place_system, renders_later_system
from corral.core.spec import Estimates, RunnerSpec, jinja_template, runner_spec, slot_choices
from corral.errors import ApiError
from corral.runtime.client import RunnerClient
from corral.runtime.continuation import Upstream
from corral.runtime.devices import cpu_cores
from corral.runtime.journal import Event
from corral.runtime.meter import last_object, last_timings
from corral.runtime.registry import ModelEntry, Registry, canonical_name
from corral.runtime.runner_errors import ContextOverflow
from corral.runtime.scheduler import Lease, Scheduler, SchedulerError
from corral.runtime.view import SchedulerView

T = TypeVar("T")
Sizings = tuple[Sizing, ...]
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Resolved:
    requested: str  # the name as the client wrote it (echoed back, as Ollama does)
    entry: ModelEntry
    info: ModelInfo
    # The name its runner is known by: models of one file and runner shape share one runner
    # (runtime.registry.runner_names), the first of them made names it.
    runner: str

    @property
    def name(self) -> str:
        return self.entry.name

    @property
    def digest(self) -> str:
        # A model corral made (pull, create, cp) is its manifest, as Ollama's ID is: two names
        # made from one file differ. Another is its file's identity (path, size, mtime), not a
        # content hash: hashing gigabytes on every listing would be too slow.
        if self.entry.manifest is not None:
            with contextlib.suppress(OSError):
                return hashlib.sha256(self.entry.manifest.read_bytes()).hexdigest()
        st = self.entry.path.stat()
        key = f"{self.entry.path}:{st.st_size}:{st.st_mtime_ns}"
        return hashlib.sha256(key.encode()).hexdigest()


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
        self._estimates = Estimates()
        # (spec at the floor, model info, room per device, booking factor) -> auto context
        self._auto: dict[tuple[Any, ...], tuple[ModelInfo, int]] = {}
        # (spec, num_gpu, main_gpu, devices) -> (model info, parts, the runners it may load)
        self._sizings: dict[tuple[Any, ...], tuple[ModelInfo, tuple[Any, ...], Sizings]] = {}
        # model -> the context its runner served an auto request with, until the journal says
        # a runner of it loads or stops: auto's answer without a view of the scheduler
        self._served_ctx: dict[str, int] = {}
        self._listening = False
        self._vision: dict[Any, tuple[ModelInfo, ModelInfo]] = {}
        self._unusable: set[tuple[Path, float]] = set()  # broken files logged, by modification
        self.client = client  # the hop to the runners

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

    def parts(self, r: Resolved) -> tuple[ProjectorInfo | None, tuple[AdapterInfo, ...]]:
        """The model's projector and adapters as read from their files; 500 with the reason
        if one is missing or unusable."""
        try:
            return read_parts(r.info, r.entry.projector, r.entry.adapters)
        except GGUFError as e:
            raise ApiError(500, f"model '{r.requested}' cannot be loaded: {e}") from None

    def unload(self, name: str) -> bool:
        """Unload a model by name: a model on disk, or a loaded one whose file is gone (the
        scheduler still knows it). False if it was not loaded; 404 if it is neither."""
        loaded = {canonical_name(r.model): r.model for r in self.scheduler.view().runners}
        model = loaded.get(canonical_name(name))
        if model is None:
            model = self.registry.runner_name(self.entry(name).name)
        return self.scheduler.unload(model)

    def native_tools(self, r: Resolved) -> bool:
        """Whether the model's chat template (a created model's own, else the GGUF's) renders
        tools, so that llama.cpp's chat endpoint shows them to the model and parses its calls.
        Other models get tools from corral (`corral.api.toolprompt`)."""
        return template_has_tools(effective_template(r))

    def require(self, r: Resolved, capability: str, what: str) -> None:
        if capability not in r.info.capabilities:
            raise ApiError(400, f"model '{r.requested}' does not support {what}", "model")

    def runner_spec(
        self, r: Resolved, options: dict[str, Any]
    ) -> tuple[RunnerSpec, frozenset[str]]:
        """The runner to load for these options, and which spec fields the request pinned."""
        try:
            return runner_spec(r.entry, r.info, options, self.settings, cpu_cores())
        except TemplateError as e:  # /api/create refuses these: a manifest from elsewhere
            raise unusable_template(r, e) from None

    # ---- leases ----------------------------------------------------------------------------
    def keep_alive(self, entry: ModelEntry, asked: float | None) -> float | None:
        """The keep-alive a request gets: the model's own (models.toml) unless the client
        asked for one, the model's always if it is fixed there, and never more than
        CORRAL_KEEP_ALIVE_MAX. None: the runner keeps what it has."""
        ka = asked
        if entry.keep_alive is not None and (ka is None or entry.keep_alive_fixed):
            ka = entry.keep_alive
        elif entry.keep_alive_fixed:
            ka = None  # fixed at the server's default
        cap = self.settings.keep_alive_max
        if ka is not None and cap is not None and ka > cap:
            ka = cap
        return ka

    async def lease(
        self, request: Request, r: Resolved, options: dict[str, Any], keep_alive: float | None
    ) -> Lease:
        """Wait for a runner slot. A client that leaves while waiting (queued, or while its
        model loads) takes its queue entry with it."""
        note_model(r.name)  # the request's model (its log line, its metrics): the one resolved
        spec, explicit = self.runner_spec(r, options)
        try:
            check_kv_cache_type(r.info, spec.kv_cache_type)
        except ValueError as e:
            raise ApiError(500, f"model '{r.requested}' cannot be loaded: {e}") from None
        if spec.flash_attn == "off" and KV_CACHE_TYPES[spec.kv_cache_type][0] > 1:
            raise ApiError(
                400, f"model '{r.requested}': a quantized KV cache ({spec.kv_cache_type}) "
                "needs flash attention; set flash_attn to on or auto",
            )  # fmt: skip
        chosen = {**r.entry.options, **options}  # the request's options over the model's
        auto = (
            self.settings.context_length is None
            and "n_ctx" not in explicit
            and "num_ctx" not in r.entry.options
        )
        if auto:
            spec = dataclasses.replace(spec, n_ctx=self.auto_ctx(r, spec, chosen))
        sizes = self.sizings(r, spec, chosen)
        best = sizes[0]
        try:
            ticket = self.scheduler.submit(
                r.runner, spec, explicit=explicit, size=best.size,
                keep_alive=self.keep_alive(r.entry, keep_alive),
                pinned=r.entry.pinned, priority=r.entry.priority,
                place=best.place, process=best.process, smaller=sizes[1:],
            )  # fmt: skip
            if ticket.fut.done():  # a warm runner had a free slot: no need to watch the client
                lease = await self.scheduler.wait(ticket)
            else:
                lease = await until_disconnect(request, self.scheduler.wait(ticket), Lease.release)
        except SchedulerError as e:
            raise ApiError(e.status, e.message, retry_after=e.retry_after) from None
        note_lease(lease.tally)  # the request log's tokens and timings
        if auto:
            self._served(lease.runner.name, lease.runner.spec.n_ctx)
        return lease

    def sizings(
        self, r: Resolved, spec: RunnerSpec, chosen: Mapping[str, Any]
    ) -> tuple[Sizing, ...]:
        """The runners the scheduler may load for `spec`, best first, each with its booking
        and placer: with an automatic slot count, fewer slots where memory is short (the first
        that fits is loaded). Built once per model file and runner shape: every request asks,
        warm ones too."""
        parts = self.parts(r)
        key = (spec, chosen.get("num_gpu"), chosen.get("main_gpu"), r.entry.devices)
        hit = self._sizings.get(key)
        # read_model_info (and the parts' readers) return a new object when a file changed
        if hit is not None and hit[0] is r.info and all(
            a is b for a, b in zip(hit[1], parts, strict=True)
        ):
            return hit[2]
        sizes = []
        for s in slot_choices(spec):
            est = self._estimates.get(r.info, s, *parts)
            sizes.append(Sizing(
                s, est.total + est.process, process=est.process,
                place=placer(est, self.devices, chosen.get("num_gpu"), chosen.get("main_gpu"),
                             r.entry.devices),
            ))  # fmt: skip
        if len(self._sizings) > Estimates.LIMIT:
            self._sizings.clear()
        self._sizings[key] = (r.info, parts, tuple(sizes))
        return tuple(sizes)

    def _served(self, model: str, n_ctx: int) -> None:
        if not self._listening:
            self._listening = True
            self.scheduler.listen(self._forget_served)
        self._served_ctx[model] = n_ctx

    def _forget_served(self, event: Event) -> None:
        if event.kind not in ("ready", "refused"):  # a runner of it loads, stops or failed
            self._served_ctx.pop(event.model, None)

    def auto_ctx(self, r: Resolved, spec: RunnerSpec, chosen: Mapping[str, Any]) -> int:
        """The context a request that sets none gets with CORRAL_CONTEXT_LENGTH=auto (`spec`
        holds auto's floor): a loaded runner's, if it has at least the floor (a runner is never
        reloaded for a larger context nobody asked for; the one that last served such a request
        is remembered until a runner of the model loads or stops, so a warm request reads no
        view); else the largest context
        (core.context.auto_context) whose runner fits the memory that busy, loading and pinned
        runners of other models leave, with as many layers on GPUs as at the floor. So a load
        evicts only idle models, as any load may."""
        runner = r.runner
        served = self._served_ctx.get(runner)
        if served is not None and served >= spec.n_ctx:
            return served
        view = self.scheduler.view()
        loaded = [v.context_length for v in view.runners if v.model == runner
                  and v.state != "unloading" and not v.draining]  # fmt: skip
        if loaded and max(loaded) >= spec.n_ctx:
            return max(loaded)
        room = _room(view, runner)
        factor = view.raised.get(runner, 1.0)  # raised after the model ran out of memory
        key = (spec, tuple(sorted(room.items())), factor)
        hit = self._auto.get(key)
        if hit is not None and hit[0] is r.info:
            return hit[1]
        parts = self.parts(r)

        def place(n_ctx: int) -> Fit | None:
            est = self._estimates.get(r.info, dataclasses.replace(spec, n_ctx=n_ctx), *parts)
            fit = placer(est, self.devices, chosen.get("num_gpu"), chosen.get("main_gpu"),
                         r.entry.devices)  # fmt: skip
            return (scaled_placer(fit, factor) if factor > 1 else fit)(room)

        first = place(spec.n_ctx)
        n_ctx = spec.n_ctx
        if first is not None:
            layers = _gpu_layers(first)

            def fits(n: int) -> bool:
                fit = place(n)
                return fit is not None and _gpu_layers(fit) >= layers

            n_ctx = auto_context(r.info.context_length, fits, spec.n_ctx)
        if len(self._auto) > 256:
            self._auto.clear()
        self._auto[key] = (r.info, n_ctx)
        return n_ctx

    async def leased(
        self,
        request: Request,
        r: Resolved,
        options: dict[str, Any],
        keep_alive: float | None,
        payload: Mapping[str, Any],
        start: Callable[[Lease], Awaitable[T]],
    ) -> T:
        """`start(lease)` on a leased slot; the lease is released if it fails (else whatever
        `start` returns owns it). A prompt longer than the runner's context is sent once more
        after a reload with a context that holds it and its output (`payload`'s max tokens, or
        DEFAULT_OUTPUT): the request pins that num_ctx, so the scheduler drains the runner and
        reloads it larger, as for any change of options. A prompt the model's trained context
        cannot hold, or that memory cannot, is a 400 saying its tokens, the limit and what to
        do."""
        lease = await self.lease(request, r, options, keep_alive)
        try:
            return await _owned(lease, start)
        except ContextOverflow as e:
            overflow = e
        n_ctx = grown_context(overflow.prompt_tokens, output_tokens(payload),
                              r.info.context_length)  # fmt: skip
        if n_ctx is None or n_ctx <= overflow.n_ctx:
            raise too_long(r, overflow.prompt_tokens) from None
        log.info(
            "a prompt of %d tokens does not fit '%s' at %d: reloading it with a context of %d",
            overflow.prompt_tokens, r.name, overflow.n_ctx, n_ctx,
        )  # fmt: skip
        try:
            lease = await self.lease(request, r, {**options, "num_ctx": n_ctx}, keep_alive)
        except ApiError as e:
            if e.status != 507:
                raise
            raise ApiError(
                400, f"the prompt is {overflow.prompt_tokens:,} tokens; model "
                f"'{r.requested}' would need a context of {n_ctx:,} tokens for it, more than "
                f"the memory for models holds ({e.message}): shorten the prompt or use a "
                "smaller model",
            ) from None  # fmt: skip
        try:
            return await _owned(lease, start)
        except ContextOverflow as e:
            raise too_long(r, e.prompt_tokens, e.n_ctx) from None

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
            old, new = _renamed(lease, r)
            return relay(resp, lease, resp, "text/event-stream",
                         rename=(old, new) if old != new else None)  # fmt: skip

        async def whole(lease: Lease) -> tuple[Lease, bytes]:
            # a client that leaves closes the connection: llama.cpp stops generating
            return lease, await until_disconnect(request, self.client.answer(lease, path, body))

        lease, data = await self.leased(request, r, {}, None, body, whole)
        old, new = _renamed(lease, r)
        try:
            lease.tally.timed(last_timings(data))  # a whole answer's tokens, at once
            if path == "/v1/embeddings":  # the prompt tokens it read, from its usage
                usage = last_object(data, b"usage") or {}
                note_embedded(int(usage.get("prompt_tokens") or 0))
            lease.tool_call = TOOL_CALLS_END in data  # the agent comes back: hold its runner
        finally:
            lease.release()
        return Response(data.replace(old, new), media_type="application/json")

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
        chat, stop = defaults.chat(r.entry, chat, stop)  # a created model's system, parameters
        if has_later_system(chat.messages):  # e.g. Codex's developer messages, Claude Code's
            template = effective_template(r)
            placed = place_system(chat.messages, renders_later_system(template))
            chat = dataclasses.replace(chat, messages=placed)
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
            return await self._start(lease, "/v1/chat/completions", payload, "chat", stop)
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
        mode = "completion"
        if forced is not None:
            payload["json_schema"] = forced_schema(forced)
            mode = "tool"
        elif (fmt := chat.params.get("response_format") or {}).get("type") in JSON_FORMATS:
            payload["json_schema"] = response_schema(fmt)
        if fallback and forced is None:
            mode = "fallback"
            if "json_schema" not in payload:  # a JSON answer was asked for: no calls then
                payload |= fallback_grammar(chat.tools)
        names = frozenset(tool_name(t) for t in chat.tools) if fallback else None
        return await self._start(lease, "/completion", payload, mode, stop, names)

    async def prompt_tokens(self, lease: Lease, chat: Chat) -> list[int]:
        """The token ids of `chat`'s prompt as the runner renders it: its own chat template
        (with the tools, as generate sends them), then its tokenizer, as for generation.
        Image tokens are not counted."""
        spec = lease.runner.spec
        template = spec.chat_template or read_model_info(spec.path).chat_template
        fallback = bool(chat.tools) and chat.tool_choice != "none"
        payload = template_body(chat, fallback and not template_has_tools(template),
                                chat.forced_tools)  # fmt: skip
        if "chat_template_kwargs" in chat.params:
            payload["chat_template_kwargs"] = chat.params["chat_template_kwargs"]
        api = lease.hop.api
        return await api.tokenize(await api.apply_template(payload), special=True)

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
        payload = defaults.sampling(r.entry, payload, "n_predict")  # a created model's parameters
        stop = defaults.stop(r.entry, stop)
        return await self.leased(
            request, r, options, keep_alive, payload,
            lambda lease: self._start(lease, path, payload, "completion", stop),
        )  # fmt: skip

    async def _start(
        self,
        lease: Lease,
        path: str,
        payload: dict[str, Any],
        mode: str,
        stop: list[str] | None,
        tools: frozenset[str] | None = None,
    ) -> Generation:
        resp = await self.client.stream(lease, path, payload)
        explain = lease.runner.why_failed
        return Generation(lease, resp, mode, stop or [], explain, tools)


def _renamed(lease: Lease, r: Resolved) -> tuple[bytes, bytes]:
    """llama.cpp names the model by the runner's alias (the name the runner is known by, shared
    by every model of its files); clients expect the name they sent. Replacing the exact
    `"model":"<alias>"` pair is safe: the same bytes inside generated text would be escaped
    (`\\"model\\":...`), so cannot match."""
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


def unusable_template(r: Resolved, e: TemplateError) -> ApiError:
    return ApiError(500, f"model '{r.requested}' has a template corral cannot use: {e}")


def _room(view: SchedulerView, model: str) -> dict[str, int]:
    """Bytes per device a runner of `model` may take without stopping a runner that serves,
    loads or is pinned (idle runners, and `model`'s own, count as free: a load may evict
    those)."""
    held = [v for v in view.runners if v.model != model
            and (v.inflight > 0 or v.state != "ready" or v.pinned)]  # fmt: skip
    room = {}
    for dev, budget in view.budgets.items():
        cap = min(budget, view.headroom.get(dev, budget)) - view.reserved.get(dev, 0)
        room[dev] = max(0, cap - sum(v.devices.get(dev, 0) for v in held))
    return room


def _gpu_layers(fit: Fit) -> int:
    return int(getattr(fit.layout, "n_gpu_layers", 0) or 0)


# The fields by which each API says how many tokens to generate (the first one set counts).
OUTPUT_FIELDS = ("n_predict", "max_tokens", "max_completion_tokens", "max_output_tokens",
                 "num_predict")  # fmt: skip


def output_tokens(payload: Mapping[str, Any]) -> int:
    """The most tokens a request generates, as its payload says; DEFAULT_OUTPUT if it does not
    (or asks for no limit)."""
    for name in OUTPUT_FIELDS:
        n = payload.get(name)
        if isinstance(n, int) and not isinstance(n, bool) and n > 0:
            return n
    return DEFAULT_OUTPUT


async def _owned(lease: Lease, start: Callable[[Lease], Awaitable[T]]) -> T:
    """`start(lease)`, which owns the lease once it returns; the lease is given back if it
    fails."""
    try:
        return await start(lease)
    except BaseException:
        lease.release()
        raise


def too_long(r: Resolved, tokens: int, limit: int | None = None) -> ApiError:
    """The 400 for a prompt no context of the model holds: its tokens, the limit, what to do."""
    trained = r.info.context_length
    if limit is None:
        limit = trained or UNKNOWN_TRAINED_CAP
    why = ("its trained context" if limit == trained
           else "the most corral gives it" if not trained else "its context")  # fmt: skip
    return ApiError(
        400, f"the prompt is {tokens:,} tokens; model '{r.requested}' takes at most {limit:,} "
        f"({why}): shorten the prompt or use a model with a longer context",
    )  # fmt: skip


# llama.cpp /completion parameters a chat request may carry (forced tool calls go there).
COMPLETION_PARAMS = frozenset({
    "max_tokens", "n_predict", "temperature", "top_p", "top_k", "min_p", "seed",
    "repeat_penalty", "repeat_last_n", "presence_penalty", "frequency_penalty", "typical_p",
    "mirostat", "mirostat_tau", "mirostat_eta", "n_keep", "n_probs", "json_schema",
})  # fmt: skip


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
