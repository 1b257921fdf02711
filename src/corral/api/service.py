"""The one object the API adapters talk to: resolve a model, lease a runner, call it.

Adapters stay thin: they translate wire formats; everything about which file, which runner
shape, how much memory and what a runner's failure means lives here.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hashlib
import logging
import os
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp
import orjson
from starlette.requests import Request
from starlette.responses import Response

from corral.api import defaults
from corral.api.common import ApiError, runner_error
from corral.api.events import Chat, Generation, forced_schema, tool_name
from corral.api.metrics import note_model
from corral.api.stream import LeasedStream, RunnerStream, open_stream
from corral.api.toolprompt import CLOSE, TRIGGER, call_grammar, fallback_messages
from corral.config import Settings
from corral.core.books import Fit, Placer
from corral.core.devices import GPU_CONTEXT_BYTES, Device
from corral.core.estimate import (
    KV_CACHE_TYPES,
    Estimate,
    check_kv_cache_type,
    estimate,
)
from corral.core.gguf import (
    GGUFError,
    ModelInfo,
    check_adapter,
    read_adapter_info,
    read_model_info,
    read_projector_info,
    template_has_tools,
)
from corral.core.gotemplate import TemplateError, is_jinja, to_jinja
from corral.core.placement import Placement, model_need, place
from corral.core.roles import has_later_system, place_system, renders_later_system
from corral.core.spec import Layout, RunnerSpec
from corral.runtime.kvcache import GENERATION_PATHS, KVCache
from corral.runtime.registry import ModelEntry, Registry, canonical_name
from corral.runtime.runner import Runner
from corral.runtime.scheduler import Lease, Scheduler, SchedulerError

log = logging.getLogger(__name__)
T = TypeVar("T")

# Ollama option -> RunnerSpec field: options that shape the runner process (a change reloads).
# models.toml may set each of them as a model's default, and flash_attn and n_cpu_moe besides.
SHAPING = {"num_ctx": "n_ctx", "num_gpu": "n_gpu_layers", "main_gpu": "main_gpu",
           "num_thread": "threads", "num_batch": "n_batch", "use_mmap": "use_mmap",
           "use_mlock": "use_mlock", "flash_attn": "flash_attn",
           "n_cpu_moe": "n_cpu_moe"}  # fmt: skip
# A batch below this slows every client's prompts on a shared runner; above it, the compute
# buffer grows for little gain (llama.cpp's default is 2048 / micro-batch 512).
NUM_BATCH_RANGE = (32, 4096)


@dataclass(frozen=True)
class Resolved:
    requested: str  # the name as the client wrote it (echoed back, as Ollama does)
    entry: ModelEntry
    info: ModelInfo

    @property
    def name(self) -> str:
        return self.entry.name

    @property
    def digest(self) -> str:
        # An identity for the file (path, size, mtime), not a content hash: hashing gigabytes
        # on every listing would be too slow.
        st = self.entry.path.stat()
        key = f"{self.entry.path}:{st.st_size}:{st.st_mtime_ns}"
        return hashlib.sha256(key.encode()).hexdigest()


class Service:
    def __init__(
        self, settings: Settings, registry: Registry, scheduler: Scheduler, devices: list[Device]
    ) -> None:
        self.settings = settings
        self.registry = registry
        self.scheduler = scheduler
        self.devices = devices
        # runner spec -> (the ModelInfo and parts it was computed from, its estimate)
        self._estimates: dict[RunnerSpec, tuple[ModelInfo, tuple[Any, ...], Estimate]] = {}
        self._vision: dict[Any, tuple[ModelInfo, ModelInfo]] = {}
        # Saved conversations restored into a reloaded runner's slots (server.kv_cache).
        self.kvcache: KVCache | None = None

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
            raise ApiError(500, f"model '{name}' cannot be loaded: {e}") from None
        if entry.projector is not None:  # its projector reads images: "vision"
            info = self._with_vision(info)
        return Resolved(name, entry, info)

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

    def parts(self, r: Resolved) -> tuple[Any, tuple[Any, ...]]:
        """The model's projector and adapters as read from their files (ProjectorInfo or None,
        AdapterInfos); 500 with the reason if one is missing or unusable."""
        what = "projector"
        try:
            proj = read_projector_info(r.entry.projector) if r.entry.projector else None
            adapters = []
            for a in r.entry.adapters:
                what = f"adapter {a.path}"
                adapters.append(read_adapter_info(a.path))
                check_adapter(r.info, adapters[-1])
        except OSError as e:
            raise ApiError(
                500, f"model '{r.requested}' cannot be loaded: its {what} is missing ({e})"
            ) from None
        except GGUFError as e:
            raise ApiError(
                500, f"model '{r.requested}' cannot be loaded: its {what}: {e}"
            ) from None
        return proj, tuple(adapters)

    def unload(self, name: str) -> bool:
        """Unload a model by name: a model on disk, or a loaded one whose file is gone (the
        scheduler still knows it). False if it was not loaded; 404 if it is neither."""
        loaded = {canonical_name(r.model): r.model for r in self.scheduler.view().runners}
        model = loaded.get(canonical_name(name))
        if model is None:
            model = self.entry(name).name
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
        defaults = r.entry.options
        embedding = "embedding" in r.info.capabilities or "rerank" in r.info.capabilities
        n_ctx = defaults.get("num_ctx") or self.settings.context_length or r.info.context_length
        spec = {
            "path": str(r.entry.path),
            "n_ctx": clamp_ctx(n_ctx, r.info.context_length),
            "num_parallel": defaults.get("num_parallel") or self.settings.num_parallel,
            "n_gpu_layers": defaults.get("num_gpu", 0),
            "main_gpu": defaults.get("main_gpu"),
            "embedding": embedding,
            "pooling_type": r.info.pooling_type if embedding else None,
            "threads": defaults.get("num_thread"),
            "kv_cache_type": defaults.get("kv_cache_type") or self.settings.kv_cache_type,
            "projector": str(r.entry.projector) if r.entry.projector else None,
            "adapters": tuple(r.entry.adapters),
            "n_batch": defaults.get("num_batch"),
            "use_mmap": defaults.get("use_mmap"),
            "use_mlock": defaults.get("use_mlock"),
            "flash_attn": defaults.get("flash_attn") or "auto",
            "n_cpu_moe": defaults.get("n_cpu_moe") or 0,
            "chat_template": chat_template(r),
        }
        # The model's parts are what the model is: a runner with other ones never serves it.
        explicit = {"projector", "adapters"}
        for opt, fld in SHAPING.items():
            if options.get(opt) is not None:
                spec[fld] = options[opt]
                explicit.add(fld)
        # A runner is shared by every client of the model: values that would starve the others
        # are clamped (threads beyond the cores, a batch too small or too large), as are
        # contexts llama.cpp itself would cap.
        spec["n_ctx"] = clamp_ctx(spec["n_ctx"], r.info.context_length)
        if spec["threads"] is not None:
            spec["threads"] = min(spec["threads"], cpu_cores()) or None  # 0: llama.cpp decides
        if spec["n_batch"] is not None:
            lo, hi = NUM_BATCH_RANGE
            spec["n_batch"] = max(lo, min(spec["n_batch"], hi))
        # Only a model with experts has any to keep in system memory (no reload for nothing).
        moe_layers = r.info.n_layer if r.info.expert_bytes else 0
        spec["n_cpu_moe"] = max(0, min(spec["n_cpu_moe"], moe_layers))
        return RunnerSpec(**spec), frozenset(explicit)

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
        note_model(request.scope, r.name)  # labels the request's metrics
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
        est = self.estimate(r.info, spec, r)
        try:
            ticket = self.scheduler.submit(
                r.name, spec, explicit=explicit, size=est.total + est.process,
                keep_alive=self.keep_alive(r.entry, keep_alive),
                pinned=r.entry.pinned, priority=r.entry.priority,
                place=self.placer(est, {**r.entry.options, **options}, r.entry.devices),
                process=est.process,
            )  # fmt: skip
            if ticket.fut.done():  # a warm runner had a free slot: no need to watch the client
                return await self.scheduler.wait(ticket)
            return await until_disconnect(request, self.scheduler.wait(ticket))
        except SchedulerError as e:
            raise ApiError(e.status, e.message, retry_after=e.retry_after) from None

    def estimate(self, info: ModelInfo, spec: RunnerSpec, r: Resolved | None = None) -> Estimate:
        """The runner's memory estimate, computed once per model file and runner shape (it
        walks every layer, and every request asks for it), with the model's projector and
        adapters (`r`'s entry)."""
        proj, adapters = self.parts(r) if r is not None else (None, ())
        parts = (proj, *adapters)
        hit = self._estimates.get(spec)
        # read_model_info (and the parts' readers) return a new object when a file changed
        if (
            hit is not None
            and hit[0] is info
            and len(hit[1]) == len(parts)
            and all(a is b for a, b in zip(hit[1], parts, strict=True))
        ):
            return hit[2]
        if len(self._estimates) > 1024:
            self._estimates.clear()
        est = estimate(
            info, spec.n_ctx, spec.num_parallel, spec.kv_cache_type,
            flash_attn=spec.flash_attn != "off", n_batch=spec.n_batch, projector=proj,
            adapters=adapters, n_cpu_moe=spec.n_cpu_moe,
        )  # fmt: skip
        self._estimates[spec] = (info, parts, est)
        return est

    def placer(
        self, est: Estimate, options: Mapping[str, Any], allowed: tuple[str, ...] | None = None
    ) -> Placer:
        """The pure function the scheduler asks where this runner would fit (`options`: the
        model's and the request's; `allowed`: the model's devices)."""
        # The runner process itself is booked with every model (as once it loads), and its
        # CUDA context on every GPU it uses.
        need = model_need(est, GPU_CONTEXT_BYTES)
        num_gpu, main_gpu = options.get("num_gpu"), options.get("main_gpu")
        devices = self.devices

        def fit(free: Mapping[str, int]) -> Fit | None:
            p = place(need, devices, free, num_gpu=num_gpu, main_gpu=main_gpu, allowed=allowed)
            return Fit(p.devices, launch_layout(p, devices)) if isinstance(p, Placement) else None

        return fit

    # ---- talking to a runner -----------------------------------------------------------------
    async def post(
        self, lease: Lease, path: str, payload: dict[str, Any]
    ) -> aiohttp.ClientResponse | RunnerStream:
        """POST to the runner; a non-200 answer becomes an ApiError with llama.cpp's message.
        A streamed request (`"stream": true`) gets a RunnerStream (see `stream`)."""
        runner = lease.runner
        assert runner.session is not None
        if self.kvcache is not None and path in GENERATION_PATHS and self.kvcache.wants(runner):
            # Among a runner's first requests: restore the saved conversation this prompt
            # continues, if any, and pin the request to its slot.
            payload = await self.kvcache.prepare(runner, path, payload)
        if payload.get("stream"):
            return await self._open_stream(runner, path, payload)
        headers = {"Content-Type": "application/json"}
        try:
            resp = await runner.session.post(path, data=orjson.dumps(payload), headers=headers)
        except (aiohttp.ClientError, OSError):
            raise ApiError(500, await runner.why_failed()) from None
        if resp.status != 200:
            try:
                body = await resp.read()
            except (aiohttp.ClientError, OSError):
                raise ApiError(500, await runner.why_failed()) from None
            finally:
                resp.release()
            raise runner_error(body, resp.status)
        return resp

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
        lease = await self.lease(request, r, {}, None)
        try:
            resp = await self.post(lease, path, body)
        except BaseException:
            lease.release()
            raise
        # llama.cpp names the model by the runner's alias (the registry name); clients expect
        # the name they sent. Replacing the exact `"model":"<alias>"` pair is safe: the same
        # bytes inside generated text would be escaped (`\"model\":...`), so cannot match.
        old, new = b'"model":' + orjson.dumps(r.name), b'"model":' + orjson.dumps(r.requested)
        if stream:
            assert isinstance(resp, RunnerStream)
            return relay(resp, lease, resp, "text/event-stream",
                         rename=(old, new) if old != new else None)  # fmt: skip
        assert not isinstance(resp, RunnerStream)
        try:
            data = await until_disconnect(request, resp.read())
        finally:
            resp.release()
            lease.release()
        return Response(data.replace(old, new), media_type="application/json")

    async def stream(self, lease: Lease, path: str, payload: dict[str, Any]) -> RunnerStream:
        """POST a streamed request to the runner: its answer comes on a connection of its own
        (llama.cpp closes it after a streamed answer), read by corral's RunnerStream, which
        relays a fast runner's tokens a few at a time."""
        resp = await self.post(lease, path, {**payload, "stream": True})
        assert isinstance(resp, RunnerStream)
        return resp

    async def _open_stream(
        self, runner: Runner, path: str, payload: dict[str, Any]
    ) -> RunnerStream:
        try:
            resp = await open_stream(runner.base_url, path, orjson.dumps(payload))
        except OSError:
            raise ApiError(500, await runner.why_failed()) from None
        if resp.status != 200:
            try:
                body = await resp.read_all()
            except OSError:
                raise ApiError(500, await runner.why_failed()) from None
            finally:
                resp.close()
            raise runner_error(body, resp.status)
        return resp

    async def post_json(self, lease: Lease, path: str, payload: dict[str, Any]) -> Any:
        resp = await self.post(lease, path, payload)
        try:
            return orjson.loads(await resp.read())
        except (aiohttp.ClientError, OSError):
            raise ApiError(500, await lease.runner.why_failed()) from None
        finally:
            resp.release()

    async def fit_embedding_inputs(
        self, lease: Lease, inputs: list[str], truncate: bool
    ) -> list[str | list[int]]:
        """Inputs an embedding runner can take whole: llama.cpp embeds one input in one
        physical batch and fails on longer ones, so those are cut to it (as token ids) or, with
        `truncate` false, refused. Only inputs with more bytes than the limit are tokenized:
        a token is never shorter than a byte."""
        limit = min(lease.runner.spec.n_ctx, EMBED_BATCH)
        out: list[str | list[int]] = []
        for i, text in enumerate(inputs):
            if len(text.encode()) + 2 <= limit:  # + the specials the model adds ([CLS], [SEP])
                out.append(text)
                continue
            toks = (await self.post_json(
                lease, "/tokenize", {"content": text, "add_special": True}
            ))["tokens"]  # fmt: skip
            if len(toks) <= limit:
                out.append(text)
            elif truncate:
                out.append(toks[:limit])
            else:
                raise ApiError(
                    400, f"input {i} is {len(toks)} tokens, more than the {limit} this model "
                    "embeds at once; send \"truncate\": true to cut it",
                    "input",
                )  # fmt: skip
        return out

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
        lease = await self.lease(request, r, options, keep_alive)
        try:
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
            tmpl = await self.post_json(
                lease, "/apply-template", {**template_body(chat, fallback, forced),
                                           "chat_template_kwargs": kwargs},
            )  # fmt: skip
            payload = {k: v for k, v in chat.params.items() if k in COMPLETION_PARAMS}
            payload["prompt"] = [*(prefix or []), tmpl["prompt"]]
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
        except BaseException:
            lease.release()
            raise

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
        tmpl = await self.post_json(lease, "/apply-template", payload)
        return await self.tokenize(lease, tmpl["prompt"], special=True)

    async def tokenize(self, lease: Lease, text: str, special: bool = False) -> list[int]:
        toks = await self.post_json(lease, "/tokenize", {
            "content": text, "add_special": special, "parse_special": special,
        })  # fmt: skip
        return list(toks["tokens"])

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
        lease = await self.lease(request, r, options, keep_alive)
        try:
            return await self._start(lease, path, payload, "completion", stop)
        except BaseException:
            lease.release()
            raise

    async def _start(
        self,
        lease: Lease,
        path: str,
        payload: dict[str, Any],
        mode: str,
        stop: list[str] | None,
        tools: frozenset[str] | None = None,
    ) -> Generation:
        resp = await self.stream(lease, path, payload)
        explain = lease.runner.why_failed
        return Generation(lease, resp, mode, stop or [], explain, tools)


# The smallest context a runner gets: below it a chat template alone can fill the context.
MIN_CTX = 256


@functools.lru_cache(maxsize=256)
def jinja_template(template: str) -> str:
    """A created model's TEMPLATE as the runner's Jinja chat template: Ollama's Go syntax
    translated, a Jinja template as it is."""
    return template if is_jinja(template) else to_jinja(template)


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
        raise ApiError(
            500, f"model '{r.requested}' has a template corral cannot use: {e}"
        ) from None


def clamp_ctx(n_ctx: int, trained: int) -> int:
    """A context between MIN_CTX and the model's training context (llama.cpp caps it there
    anyway, so booking more would book memory it never allocates)."""
    if trained > 0:
        return max(min(n_ctx, trained), min(MIN_CTX, trained))
    return max(n_ctx, MIN_CTX)


def cpu_cores() -> int:
    """The cores this process may run on (its affinity mask, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


# llama.cpp's default physical batch (n_ubatch): the most tokens one embedding input may have.
EMBED_BATCH = 512

# llama.cpp /completion parameters a chat request may carry (forced tool calls go there).
COMPLETION_PARAMS = frozenset({
    "max_tokens", "n_predict", "temperature", "top_p", "top_k", "min_p", "seed",
    "repeat_penalty", "repeat_last_n", "presence_penalty", "frequency_penalty", "typical_p",
    "mirostat", "mirostat_tau", "mirostat_eta", "n_keep", "n_probs", "json_schema",
})  # fmt: skip


JSON_FORMATS = ("json_object", "json_schema")


def template_body(
    chat: Chat, fallback: bool, forced: list[dict[str, Any]] | None
) -> dict[str, Any]:
    """What /apply-template renders `chat` from: its messages and tools as they are, or, for a
    template without tools (`fallback`), the messages with the tools (the forced ones, when the
    call is forced) shown by corral and earlier calls and results as text."""
    if fallback:
        return {"messages": fallback_messages(chat.messages, forced or chat.tools)}
    body: dict[str, Any] = {"messages": chat.messages}
    if chat.tools and chat.tool_choice != "none":
        body["tools"] = chat.tools
    return body


def fallback_grammar(tools: list[dict[str, Any]]) -> dict[str, Any]:
    """/completion's fields for a call that a template without tools may start: free text
    until the model writes the trigger, then one call to one of `tools` (a lazy grammar)."""
    return {
        "grammar": call_grammar(tools),
        "grammar_lazy": True,
        # llama.cpp's COMMON_GRAMMAR_TRIGGER_TYPE_WORD: the trigger anywhere in the text
        "grammar_triggers": [{"type": 1, "value": TRIGGER}],
        # Where the tags are special tokens of the vocabulary, llama.cpp wants a trigger among
        # these, and then writes them as text (a tag of several tokens is ignored here).
        "preserved_tokens": [TRIGGER, CLOSE],
    }


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


def launch_layout(p: Placement, devices: list[Device]) -> Layout:
    """How to start a runner so that it uses exactly the devices placement booked: only those
    GPUs visible (llama.cpp would otherwise open a context, and for large batches compute, on
    every GPU it sees), the split and main GPU renumbered among them."""
    by_id = {d.id: d for d in devices}
    used = [by_id[g] for g in p.gpus if g in by_id]
    has_gpus = any(d.library != "cpu" for d in devices)
    env: list[tuple[str, str]] = []
    if has_gpus:
        cuda = [d.uuid or str(d.index) for d in used if d.library == "cuda"]
        rocm = [str(d.index) for d in used if d.library == "rocm"]
        env = [("CUDA_DEVICE_ORDER", "PCI_BUS_ID"), ("CUDA_VISIBLE_DEVICES", ",".join(cuda)),
               ("HIP_VISIBLE_DEVICES", ",".join(rocm))]  # fmt: skip
    split = None
    if p.tensor_split and len(used) > 1:
        split = tuple(p.tensor_split[d.index] for d in used)
    main = None
    if p.main_gpu is not None:
        main = next((i for i, d in enumerate(used) if d.index == p.main_gpu), 0)
    return Layout(p.n_gpu_layers, split, main, tuple(env))


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Run `work`, cancelling it if the client goes away first (frees the runner slot at once)."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        raise ApiError(499, "client disconnected")
    return task.result()
