"""Which runner a request needs, and a lease on one: the one call below the API that turns a
resolved model and a request's options into a granted slot.

`Admission.lease` builds the runner spec (the request's options over the model's over the
server's, core/spec), checks what llama.cpp would refuse to load, and offers the scheduler the
runners that would serve the request, best first, each with its booking and placer
(`sizings`): with an automatic context (`CORRAL_CONTEXT_LENGTH=auto` and no `num_ctx`), every
context of the grid from the trained length down to the floor (core/context), then, at the
floor, fewer slots where the slot count is automatic. The core picks among them by its one room
rule (core/books: the first that fits free memory, else the first that fits once idle runners
are evicted) and serves the request from a loaded runner of at least the floor as it is.

`Admission.leased` runs a call on a leased slot, and sends it once more after a reload with a
context that holds the prompt if llama.cpp refused it as too long (`ContextOverflow`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from corral.config import Settings
from corral.core.context import DEFAULT_OUTPUT, UNKNOWN_TRAINED_CAP, context_grid, grown_context
from corral.core.devices import GPU_CONTEXT_BYTES, Device, gpu_context
from corral.core.draft import draft_problem
from corral.core.estimate import KV_CACHE_TYPES, check_kv_cache_type
from corral.core.gguf import (
    AdapterInfo,
    GGUFError,
    ModelInfo,
    ProjectorInfo,
    read_model_info,
    read_parts,
    read_tokens,
)
from corral.core.gotemplate import TemplateError
from corral.core.placement import no_fewer_gpu_layers, placer, whole_on_gpus
from corral.core.requests import Sizing
from corral.core.spec import GPU_PARALLEL, Estimates, RunnerSpec, runner_spec, slot_choices
from corral.errors import ApiError
from corral.runtime.devices import cpu_cores
from corral.runtime.hop import Lease
from corral.runtime.registry import ModelEntry
from corral.runtime.runner_errors import ContextOverflow
from corral.runtime.scheduler import Scheduler, SchedulerError

T = TypeVar("T")
Sizings = tuple[Sizing, ...]
# How the API waits for a grant: it watches its client meanwhile (a client that leaves takes
# its queue entry with it).
Watch = Callable[[Awaitable[Lease]], Awaitable[Lease]]
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Resolved:
    requested: str  # the name as the client wrote it (echoed back, as Ollama does)
    entry: ModelEntry
    info: ModelInfo
    # The name its runner is known by: models of one file and runner shape share one runner
    # (runtime.registry.runner_names), the first of them made names it.
    runner: str
    # Served by the model's embedding runner (a generative model asked for embeddings: a
    # second runner of its file, `runner` its name, registry.embedding_runner)
    embedding: bool = False

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


class Admission:
    def __init__(self, settings: Settings, scheduler: Scheduler, devices: list[Device]) -> None:
        self.settings = settings
        self.scheduler = scheduler
        self.devices = devices
        self._estimates = Estimates()
        self._cores = cpu_cores()  # what a runner's threads default to
        # (spec, auto, num_gpu, main_gpu, devices) -> (model info, parts, the runners it may load)
        self._sizings: dict[tuple[Any, ...], tuple[ModelInfo, tuple[Any, ...], Sizings]] = {}

    def parts(self, r: Resolved) -> tuple[ProjectorInfo | None, tuple[AdapterInfo, ...]]:
        """The model's projector and adapters as read from their files; 500 with the reason
        if one is missing or unusable."""
        try:
            return read_parts(r.info, r.entry.projector, r.entry.adapters)
        except GGUFError as e:
            raise ApiError(500, f"model '{r.requested}' cannot be loaded: {e}") from None

    def draft(self, r: Resolved, spec: RunnerSpec) -> ModelInfo | None:
        """The draft model `spec` loads, read and checked against the model's vocabulary
        (llama.cpp's rules: core/draft); 500 naming it if it is missing or cannot draft for
        this model: the model's own settings are wrong, not the request."""
        if spec.draft is None:
            return None
        name = r.entry.options.get("draft", spec.draft)
        why = f"model '{r.requested}' cannot be loaded: its draft model '{name}'"
        if r.entry.draft is None:
            raise ApiError(500, f"{why} is not found (no model of that name, no GGUF file "
                           "at that path)")  # fmt: skip
        try:
            info = read_model_info(spec.draft)
            problem = draft_problem(r.info, info, read_tokens(r.info), read_tokens(info))
        except FileNotFoundError:
            raise ApiError(500, f"{why} is not found: {spec.draft} is missing") from None
        except (GGUFError, OSError) as e:
            raise ApiError(500, f"{why} is unusable: {e}") from None
        if problem:
            raise ApiError(500, f"{why} cannot draft for it: {problem}")
        return info

    def runner_spec(
        self, r: Resolved, options: dict[str, Any]
    ) -> tuple[RunnerSpec, frozenset[str]]:
        """The runner to load for these options, and which spec fields the request pinned.
        A request for logprobs (`EXACT_PROBS`) pins auto's drafting, off."""
        try:
            spec, explicit = runner_spec(
                r.entry, r.info, options, self.settings, self._cores, embedder=r.embedding,
                drafter=self.scheduler.drafter(r.runner),
            )  # fmt: skip
        except TemplateError as e:  # /api/create refuses these: a manifest from elsewhere
            raise unusable_template(r, e) from None
        if options.get(EXACT_PROBS) and spec.speculative_auto:
            # this request, and the model's next ones for a while (so that its runner does not
            # flip back and forth), are served by a runner that does not draft
            self.scheduler.no_drafts(r.runner, "a client asked for logprobs")
            spec = dataclasses.replace(spec, speculative="off")
            explicit |= {"speculative"}
        return spec, explicit

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
        self, r: Resolved, options: dict[str, Any], keep_alive: float | None, watch: Watch
    ) -> Lease:
        """Wait for a runner slot (through `watch` unless a warm runner grants one at once)."""
        spec, explicit = self.runner_spec(r, options)
        chosen = {**r.entry.options, **options}  # the request's options over the model's
        auto = (
            self.settings.context_length is None
            and "n_ctx" not in explicit
            and "num_ctx" not in r.entry.options
        )
        sizes = self.sizings(r, spec, chosen, auto)
        best = sizes[0]
        try:
            ticket = self.scheduler.submit(
                r.runner, best.spec, explicit=explicit, size=best.size,
                keep_alive=self.keep_alive(r.entry, keep_alive),
                # a pinned model keeps its own runner, not one it loads for embeddings
                pinned=r.entry.pinned and not r.embedding, priority=r.entry.priority,
                place=best.place, process=best.process, smaller=sizes[1:],
            )  # fmt: skip
            if ticket.fut.done():  # a warm runner had a free slot: no need to watch the client
                return await self.scheduler.wait(ticket)
            return await watch(self.scheduler.wait(ticket))
        except SchedulerError as e:
            raise ApiError(e.status, e.message, retry_after=e.retry_after) from None

    def sizings(
        self, r: Resolved, spec: RunnerSpec, chosen: Mapping[str, Any], auto: bool = False
    ) -> Sizings:
        """The runners the scheduler may load for `spec`, best first, each with its booking
        and placer. `auto` (`spec` holds the floor): every context of the grid from the
        trained length down (one that would put fewer layers on GPUs than the floor would in
        the same memory is not offered there), then the floor's fewer slots. With GPUs and an
        automatic slot count, all of that with a GPU's slots (GPU_PARALLEL) comes first, each
        offered only where the whole model goes on GPUs. Built once per model file and runner
        shape: every request asks, warm ones too."""
        parts = self.parts(r)
        if spec.projector is None:  # a vision model's embedding runner loads none
            parts = (None, parts[1])
        # What a runner holds on a GPU beyond its buffers, as measured on these cards so far
        # (the largest where cards differ)
        gpus = [d for d in self.devices if d.library != "cpu"]
        learned = self.scheduler.gpu_contexts() if gpus else {}
        context = max((gpu_context(d, learned) for d in gpus), default=GPU_CONTEXT_BYTES)
        # A GPU's many slots draft only if the model asks (below): a drafter, or a draft model
        asked = "speculative" in r.entry.options or spec.draft is not None
        drafter = spec.speculative if asked else "off"
        key = (spec, auto, chosen.get("num_gpu"), chosen.get("main_gpu"), r.entry.devices, context,
               drafter)  # fmt: skip
        hit = self._sizings.get(key)
        # read_model_info (and the parts' readers) return a new object when a file changed
        if (
            hit is not None
            and hit[0] is r.info
            and all(a is b for a, b in zip(hit[1], (*parts, _draft_now(spec)), strict=True))
        ):
            return hit[2]
        draft = self.draft(r, spec)  # checked once per shape and file, as below
        try:  # what llama.cpp would refuse to load (checked once per shape: then cached)
            check_kv_cache_type(r.info, spec.kv_cache_type)
        except ValueError as e:
            raise ApiError(500, f"model '{r.requested}' cannot be loaded: {e}") from None
        if spec.flash_attn == "off" and KV_CACHE_TYPES[spec.kv_cache_type][0] > 1:
            raise ApiError(
                400, f"model '{r.requested}': a quantized KV cache ({spec.kv_cache_type}) "
                "needs flash attention; set flash_attn to on or auto",
            )  # fmt: skip

        def sizing(s: RunnerSpec) -> Sizing:
            est = self._estimates.get(r.info, s, *parts, draft=draft)
            place = placer(est, self.devices, chosen.get("num_gpu"), chosen.get("main_gpu"),
                           r.entry.devices, context)  # fmt: skip
            return Sizing(s, est.total + est.process, place, est.process)

        floor = [sizing(s) for s in slot_choices(spec)]
        grid = context_grid(r.info.context_length, spec.n_ctx)[1:] if auto else []
        contexts = tuple(reversed(grid))  # the longest first
        longer = []
        for n_ctx in contexts:
            z = sizing(dataclasses.replace(spec, n_ctx=n_ctx))
            assert z.place is not None and floor[0].place is not None
            longer.append(dataclasses.replace(
                z, place=no_fewer_gpu_layers(z.place, floor[0].place)
            ))  # fmt: skip
        # Where the whole model goes on GPUs, an automatic slot count starts at a GPU's (each
        # context of the grid, then the floor's fewer slots down to the CPU's count).
        wide = []
        if gpus and spec.kv_unified and not spec.embedding:
            # (no drafter unless the model asks for one: verifying drafts for a GPU's slots
            # reserves logits for n_batch rows, and its slots are busy when they pay least)
            many = dataclasses.replace(spec, num_parallel=GPU_PARALLEL, speculative=drafter)
            for s in (*(dataclasses.replace(many, n_ctx=n) for n in contexts),
                      *slot_choices(many)):  # fmt: skip
                if s.num_parallel > spec.num_parallel:
                    z = sizing(s)
                    assert z.place is not None
                    wide.append(dataclasses.replace(
                        z, place=whole_on_gpus(z.place, r.info.n_layer + 1)
                    ))  # fmt: skip
        sizes = (*wide, *longer, *floor)
        if len(self._sizings) > Estimates.LIMIT:
            self._sizings.clear()
        self._sizings[key] = (r.info, (*parts, draft), sizes)
        return sizes

    async def leased(
        self,
        r: Resolved,
        options: dict[str, Any],
        keep_alive: float | None,
        payload: Mapping[str, Any],
        start: Callable[[Lease], Awaitable[T]],
        lease: Callable[[dict[str, Any]], Awaitable[Lease]],
    ) -> T:
        """`start(lease)` on a slot leased by `lease(options)`; the lease is released if it
        fails (else whatever `start` returns owns it). A prompt longer than the runner's
        context is sent once more after a reload with a context that holds it and its output
        (`payload`'s max tokens, or DEFAULT_OUTPUT): the request pins that num_ctx, so the
        scheduler drains the runner and reloads it larger, as for any change of options. A
        prompt the model's trained context cannot hold, or that memory cannot, is a 400
        saying its tokens, the limit and what to do."""
        if wants_probs(payload):  # llama.cpp gives accepted drafts no probabilities
            options = {**options, EXACT_PROBS: True}
        first = await lease(options)
        try:
            return await _owned(first, start)
        except ContextOverflow as e:
            overflow = e
        except ApiError:
            if first.runner.out_of_memory is None:
                raise
            # Its runner ran out of memory before answering: placed again, once, with the
            # model booked higher (another runner's room, fewer GPU layers, system memory).
            log.warning("'%s' ran out of memory before answering: sending it again", r.name)
            first.runner_failed()
            return await _owned(await lease(options), start)
        n_ctx = grown_context(overflow.prompt_tokens, output_tokens(payload),
                              r.info.context_length)  # fmt: skip
        if n_ctx is None or n_ctx <= overflow.n_ctx:
            raise too_long(r, overflow.prompt_tokens) from None
        log.info(
            "a prompt of %d tokens does not fit '%s' at %d: reloading it with a context of %d",
            overflow.prompt_tokens, r.name, overflow.n_ctx, n_ctx,
        )  # fmt: skip
        try:
            second = await lease({**options, "num_ctx": n_ctx})
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
            return await _owned(second, start)
        except ContextOverflow as e:
            raise too_long(r, e.prompt_tokens, e.n_ctx) from None


def _draft_now(spec: RunnerSpec) -> ModelInfo | None:
    """The draft model's file as it is now (a new object once it changed), None if none or
    unreadable."""
    if spec.draft is None:
        return None
    try:
        return read_model_info(spec.draft)
    except (OSError, GGUFError):
        return None


def unusable_template(r: Resolved, e: TemplateError) -> ApiError:
    return ApiError(500, f"model '{r.requested}' has a template corral cannot use: {e}")


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


# An internal option: the request wants every token's probability (no drafting may serve it)
EXACT_PROBS = "_exact_probs"


def wants_probs(payload: Mapping[str, Any]) -> bool:
    """Whether a runner-bound body asks for tokens' probabilities (OpenAI's logprobs and
    top_logprobs, llama.cpp's n_probs)."""
    return any(payload.get(k) for k in ("logprobs", "top_logprobs", "n_probs"))
