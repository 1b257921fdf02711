"""What shapes a runner process, as plain data: the scheduler core compares specs, the shell
starts runners from them. How a request's options and a model's defaults make one
(`runner_spec`), and what a runner of a spec will hold (`spec_estimate`, cached by `Estimates`).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol

from corral.core.context import AUTO_FLOOR
from corral.core.drafting import DRAFTER
from corral.core.estimate import DRAFT_TOKENS, N_BATCH, Estimate, estimate
from corral.core.gotemplate import is_jinja, to_jinja
from corral.core.options import CLAMPED, OPTIONS, SHAPING

if TYPE_CHECKING:  # for annotations only: the GGUF reader is not needed to build a spec
    from pathlib import Path

    from corral.core.gguf import AdapterInfo, ModelInfo, ProjectorInfo

# The smallest context a runner gets: below it a chat template alone can fill the context.
MIN_CTX = 256
# Slots a runner gets where neither the model nor the server fixes them (CORRAL_NUM_PARALLEL
# auto): this many, or fewer where memory is short (`slot_choices`), as Ollama's scheduler
# tries 4 down to 1 (server/sched.go defaultParallel).
AUTO_PARALLEL = 4
# Slots of an automatic count where the whole model is on GPUs: a GPU decodes dozens of
# sequences in about the time of one, and on a unified cache a slot costs only its sampler and
# output row (~3 MiB with a 49k vocabulary). llama-server `-np 64 --kv-unified` served 64
# clients 1.47x faster than corral's 4 slots on an H200.
GPU_PARALLEL = 64
# Slots an embedding or rerank model gets with an automatic count. llama.cpp makes each input
# of a request a task and puts the inputs of all busy slots into one batch (up to n_ubatch,
# 512 tokens): with 4 slots a batch of short inputs holds some 50 tokens, with 16 some 200.
# A slot costs such a model little: an encoder keeps no KV cache (a causal one shares the
# unified cache), no sampler is made for it; an output row, an HTTP thread's buffers (~1 MiB).
# Measured on a synthetic bert, one thread: CPU per short input 4 slots 420 us, 16 and 32
# 340 us; beyond, an encoder's attention over the whole batch (each input masked from the
# others) costs each input more.
EMBED_PARALLEL = 16
# How a generative model's embedding runner pools: the last token's hidden state, the vector
# Ollama's llama.cpp runner returned for such a model (its context had embeddings on and no
# pooling, and it read the embedding of the sequence's last token). llama.cpp's own default for
# a file without a pooling_type is none, which its /v1/embeddings refuses.
LAST_POOLING = 3  # LLAMA_POOLING_TYPE_LAST


@dataclass(frozen=True)
class Adapter:
    """A LoRA adapter the runner loads with the model, at a scale (llama.cpp --lora-scaled)."""

    path: str
    scale: float = 1.0


@dataclass(frozen=True)
class RunnerSpec:
    """Everything that shapes a runner process. Two requests with equal specs share a runner;
    a different spec for a loaded model means a reload."""

    path: str
    n_ctx: int  # context per request (Ollama's num_ctx)
    num_parallel: int
    # One KV cache of n_ctx cells the slots share (llama.cpp's kv_unified), as with an automatic
    # slot count: each request may use the whole context. Off: n_ctx cells per slot.
    kv_unified: bool = False
    n_gpu_layers: int = 0
    main_gpu: int | None = None
    # Serves embeddings (llama.cpp's --embeddings): an embedding or rerank model's runner, or
    # a generative model's embedding runner, a second runner of its file
    embedding: bool = False
    pooling_type: int | None = None
    threads: int | None = None
    kv_cache_type: str = "f16"  # KV cache type (K and V): f16, q8_0, q4_0, ...
    projector: str | None = None  # the vision projector (mmproj GGUF) loaded with the model
    adapters: tuple[Adapter, ...] = ()  # LoRA adapters, applied in this order
    n_batch: int | None = None  # Ollama's num_batch: llama.cpp's n_batch and n_ubatch
    use_mmap: bool | None = None  # None: llama.cpp decides (mmap where it can)
    use_mlock: bool | None = None
    flash_attn: str = "auto"  # one of core.options.FLASH_ATTN
    n_cpu_moe: int = 0  # keep the experts of the first N layers in system memory
    # The chat template the runner renders with instead of the GGUF's (Jinja): a created
    # model's TEMPLATE, translated from Ollama's Go syntax (core.gotemplate)
    chat_template: str | None = None
    speculative: str = "off"  # llama.cpp's --spec-type: "off", "draft" or an n-gram drafter
    draft: str | None = None  # the draft model's GGUF (with speculative "draft")
    # Tokens a draft model drafts at most (None: llama.cpp's DRAFT_MAX) and at least (None:
    # llama.cpp's 0); for ngram-mod its longest and shortest draft (None: corral's NGRAM_MOD_*)
    draft_max: int | None = None
    draft_min: int | None = None
    # `auto` chose its drafter (core/drafting): measured, and turned off where it does not pay
    speculative_auto: bool = False


@dataclass(frozen=True)
class Layout:
    """Where placement put the model: how the runner must be started to match the books."""

    n_gpu_layers: int = 0
    tensor_split: tuple[float, ...] | None = None  # per visible GPU
    main_gpu: int | None = None  # index among the visible GPUs
    env: tuple[tuple[str, str], ...] = ()  # e.g. CUDA_VISIBLE_DEVICES: only the GPUs booked
    # The draft model's offload slots on the same GPUs (llama.cpp's -ngld); None: as llama.cpp
    # decides (all where the target has any on a GPU)
    draft_gpu_layers: int | None = None


class Model(Protocol):
    """A model as the registry lists it (runtime.registry.ModelEntry): what of it shapes its
    runner."""

    @property
    def path(self) -> Path: ...
    @property
    def options(self) -> Mapping[str, Any]: ...  # its own: models.toml's, a created model's
    @property
    def projector(self) -> Path | None: ...
    @property
    def adapters(self) -> tuple[Adapter, ...]: ...
    @property
    def template(self) -> str | None: ...  # a created model's TEMPLATE (Ollama's Go syntax)
    @property
    def draft(self) -> Path | None: ...  # its `draft` option resolved to a file (registry)


class ServerDefaults(Protocol):
    """What the server's settings give a runner where neither the request nor the model sets
    it (corral.config.Settings)."""

    @property
    def context_length(self) -> int | None: ...  # None: auto (core.context); 0: the trained
    @property
    def num_parallel(self) -> int: ...  # 0: auto
    @property
    def kv_cache_type(self) -> str: ...


def runner_spec(
    model: Model,
    info: ModelInfo,
    options: Mapping[str, Any],
    server: ServerDefaults,
    cores: int,
    embedder: bool = False,
    drafter: str = DRAFTER,
) -> tuple[RunnerSpec, frozenset[str]]:
    """The runner to load for a request's checked `options` on `model` (its file read into
    `info`), and which spec fields the request pinned; TemplateError if the model's own
    template cannot be translated. `cores`: the CPU cores corral may run on. `embedder`: a
    generative model's embedding runner (its GGUF's pooling, else the last token's; no vision
    projector: it embeds text). `drafter`: what `speculative = "auto"` drafts with now
    (core/drafting.Choice)."""
    own = "embedding" in info.capabilities or "rerank" in info.capabilities
    embedding = own or embedder
    pooling = info.pooling_type
    if embedding and not own and not pooling:  # none (0) would leave nothing to return
        pooling = LAST_POOLING
    auto_slots = EMBED_PARALLEL if embedding else AUTO_PARALLEL
    given = model.options
    spec: dict[str, Any] = {
        o.runner: given[o.name] for o in OPTIONS if o.runner is not None and o.name in given
    }
    spec |= {
        "path": str(model.path),
        # auto: the floor here; the service raises it to what memory allows (core.context)
        "n_ctx": spec.get("n_ctx") or _server_ctx(server) or info.context_length,
        # A fixed number of slots (the model's, the server's) keeps a context per slot; an
        # automatic one shares one cache, and slot_choices offers fewer where memory is short.
        "num_parallel": spec.get("num_parallel") or server.num_parallel or auto_slots,
        "kv_unified": not (spec.get("num_parallel") or server.num_parallel),
        "kv_cache_type": spec.get("kv_cache_type") or server.kv_cache_type,
        "flash_attn": spec.get("flash_attn") or "auto",
        "speculative": speculation(
            spec.get("speculative") or "auto", embedding, bool(spec.get("draft")), drafter
        ),
        "speculative_auto": (spec.get("speculative") or "auto") == "auto"
        and not spec.get("draft") and not embedding,
        "n_cpu_moe": spec.get("n_cpu_moe") or 0,
        "embedding": embedding,
        "pooling_type": pooling if embedding else None,
        "projector": str(model.projector) if model.projector and not embedder else None,
        "adapters": tuple(model.adapters),
        "chat_template": jinja_template(model.template) if model.template else None,
    }
    # The draft model's file: as the registry resolved its name (else the option, a path);
    # loaded only where it drafts
    resolved = model.draft if model.draft is not None else spec.get("draft")
    spec["draft"] = str(resolved) if spec["speculative"] == "draft" and resolved else None
    # The model's parts are what the model is: a runner with other ones never serves it.
    explicit = {"projector", "adapters"}
    for name, fld in SHAPING.items():
        if options.get(name) is not None:
            spec[fld] = options[name]
            explicit.add(fld)
    # A runner is shared by every client of the model: values that would starve the others
    # are clamped (threads beyond the cores, a batch too small or too large), as are
    # contexts llama.cpp itself would cap.
    spec["n_ctx"] = clamp_ctx(spec["n_ctx"], info.context_length)
    if spec.get("threads") is not None:
        spec["threads"] = min(spec["threads"], cores) or None  # 0: llama.cpp decides
    for fld, (lo, hi) in CLAMPED.items():
        if spec.get(fld) is not None:
            spec[fld] = max(lo, min(spec[fld], hi))
    # Only a model with experts has any to keep in system memory (no reload for nothing).
    moe_layers = info.n_layer if info.expert_bytes else 0
    spec["n_cpu_moe"] = max(0, min(spec["n_cpu_moe"], moe_layers))
    # llama.cpp cannot verify drafts that a batch splits (#24840): auto drafts only where one
    # batch holds every slot's (n_batch: llama.cpp's 2048 unless set)
    rows = spec["num_parallel"] * (1 + DRAFT_TOKENS.get(spec["speculative"], 0))
    if spec["speculative_auto"] and (spec.get("n_batch") or N_BATCH) < rows:
        spec["speculative"] = "off"
    return RunnerSpec(**spec), frozenset(explicit)


def _server_ctx(server: ServerDefaults) -> int:
    """The server's default context: a fixed one, or auto's floor (0: the trained one)."""
    return AUTO_FLOOR if server.context_length is None else server.context_length


def speculation(choice: str, embedding: bool, draft: bool = False, auto: str = DRAFTER) -> str:
    """The drafter a runner starts with for a model's `speculative` option. `auto` drafts
    with `auto` (what core/drafting chose for the model from measurement: its n-gram drafter
    until it was seen not to pay), or with the model's draft model where it names one (its
    operator chose a drafter of its vocabulary). An embedding model never drafts."""
    if embedding:
        return "off"
    if choice in ("auto", "draft"):
        return "draft" if draft else ("off" if choice == "draft" else auto)
    return choice


def slot_choices(spec: RunnerSpec) -> tuple[RunnerSpec, ...]:
    """The runners the scheduler may load for `spec`, best first: with an automatic slot count
    (a unified cache) its slots down to 1 (`slot_counts`), the first whose memory fits is
    loaded; with a fixed count, only `spec`."""
    if not spec.kv_unified:
        return (spec,)
    return tuple(replace(spec, num_parallel=n) for n in slot_counts(spec.num_parallel))


def slot_counts(most: int) -> tuple[int, ...]:
    """The slot counts tried from `most` down: every count up to AUTO_PARALLEL, halving above
    it (16, 8, 4, 3, 2, 1), so an embedding model's choices stay few."""
    counts = [most]
    while counts[-1] > AUTO_PARALLEL:
        counts.append(max(counts[-1] // 2, AUTO_PARALLEL))
    counts += range(min(counts[-1], AUTO_PARALLEL) - 1, 0, -1)
    return tuple(counts)


@functools.lru_cache(maxsize=256)
def jinja_template(template: str) -> str:
    """A created model's TEMPLATE as the runner's Jinja chat template: Ollama's Go syntax
    translated (TemplateError if it cannot be), a Jinja template as it is."""
    return template if is_jinja(template) else to_jinja(template)


def clamp_ctx(n_ctx: int, trained: int) -> int:
    """A context between MIN_CTX and the model's training context (llama.cpp caps it there
    anyway, so booking more would book memory it never allocates)."""
    if trained > 0:
        return max(min(n_ctx, trained), min(MIN_CTX, trained))
    return max(n_ctx, MIN_CTX)


def spec_estimate(
    info: ModelInfo,
    spec: RunnerSpec,
    projector: ProjectorInfo | None = None,
    adapters: Sequence[AdapterInfo] = (),
    draft: ModelInfo | None = None,
) -> Estimate:
    """What a runner of `spec` will hold, with the model's projector and adapters, and its
    draft model (`draft`: the file `spec.draft` names, read)."""
    return estimate(
        info, spec.n_ctx, spec.num_parallel, spec.kv_cache_type,
        flash_attn=spec.flash_attn != "off", n_batch=spec.n_batch, projector=projector,
        adapters=adapters, n_cpu_moe=spec.n_cpu_moe, unified=spec.kv_unified,
        speculative=spec.speculative, draft=draft if spec.draft else None,
        draft_max=spec.draft_max, embedding=spec.embedding,
    )  # fmt: skip


class Estimates:
    """Runner estimates computed once per model file and runner shape: an estimate walks every
    layer, and every request asks for one."""

    LIMIT = 1024  # specs remembered; then the memo starts afresh

    def __init__(self) -> None:
        # spec -> (the ModelInfo and parts it was computed from, its estimate)
        self._memo: dict[RunnerSpec, tuple[ModelInfo, tuple[Any, ...], Estimate]] = {}

    def get(
        self,
        info: ModelInfo,
        spec: RunnerSpec,
        projector: ProjectorInfo | None = None,
        adapters: Sequence[AdapterInfo] = (),
        draft: ModelInfo | None = None,
    ) -> Estimate:
        parts = (projector, draft, *adapters)
        hit = self._memo.get(spec)
        # read_model_info (and the parts' readers) return a new object when a file changed
        if (
            hit is not None
            and hit[0] is info
            and len(hit[1]) == len(parts)
            and all(a is b for a, b in zip(hit[1], parts, strict=True))
        ):
            return hit[2]
        if len(self._memo) > self.LIMIT:
            self._memo.clear()
        est = spec_estimate(info, spec, projector, adapters, draft)
        self._memo[spec] = (info, parts, est)
        return est
