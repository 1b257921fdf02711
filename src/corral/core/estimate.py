"""Memory estimates (pure): bytes a runner will hold for a model at a context and parallelism.

Arithmetic over the GGUF metadata (ModelInfo) that reproduces the buffers llama.cpp allocates
when it loads the model (the `... buffer size = N MiB` lines that corral.core.memreport reads):

- weights: the tensor data, per layer and outside the layers (token embedding, output, norms);
- KV cache: per layer, cells x streams x (K row + V row), sliding-window layers holding only
  their window; with a unified cache (kv_unified) one stream of n_ctx cells the slots share;
- compute: the graph allocator's peak for one micro-batch (activations and the attention mask);
- overhead: the output buffer (logits/embeddings of one token per sequence) and slack for the
  log's rounding and buffer alignment.

Calibrated against llama.cpp (xllamacpp 2026.10, CPU backend, flash attention auto = on) for
llama, gemma3 (SWA) and bert models: estimate >= real and <= 1.10 x real over the models the
test suite makes or ships (see corral.bench.estimates). The runner's real allocation replaces
the estimate in the books once it has loaded.

A model's parts are in the estimate too: LoRA adapters (their tensors sit beside the layers they
change) and a vision projector (its weights in one buffer and its own graph's compute buffer,
sized for a warm-up image; calibrated on synthetic LLaVA-style projectors only).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from corral.core.options import DRAFT_MAX, NGRAM_MOD_MAX, ngram_mod_lengths

if TYPE_CHECKING:  # runner_child imports this module and must not pay for the GGUF reader
    from corral.core.gguf import AdapterInfo, ModelInfo, ProjectorInfo

__all__ = [
    "KV_CACHE_TYPES",
    "RUNNER_CODE_BYTES",
    "Estimate",
    "LlamaParams",
    "check_kv_cache_type",
    "draft_estimate",
    "estimate",
    "estimate_bytes",
    "llama_params",
    "process_bytes",
    "projector_bytes",
]

# The KV cache types llama.cpp accepts (common/arg.cpp kv_cache_types): (block size, bytes per
# block), as in ggml's type traits.
KV_CACHE_TYPES = {
    "f32": (1, 4), "f16": (1, 2), "bf16": (1, 2), "q8_0": (32, 34), "q4_0": (32, 18),
    "q4_1": (32, 20), "iq4_nl": (32, 18), "q5_0": (32, 22), "q5_1": (32, 24),
}  # fmt: skip

N_BATCH = 2048  # common_params.n_batch (llama-server default)
N_UBATCH = 512  # common_params.n_ubatch: the micro-batch the compute graph is reserved for
N_CTX_PAD = 256  # llama_context pads n_ctx to a multiple of 256
SWA_PAD = 256  # llama_kv_cache_iswa pads the SWA cache to 256 cells (issue #17037)
F32 = 4
F16 = 2
# Activations per token that are not a multiple of n_embd or n_ff: token ids, positions,
# output ids and KV-cache row indices (int32/int64), alignment of each tensor to 32-64 bytes.
PER_TOKEN_EXTRA = 24 * F32
# With a quantized KV cache the graph holds a little more per token and cache (observed: 64 B).
PER_TOKEN_QUANT_KV = 128
# The log prints MiB with 2 decimals (up to 5 KiB off per buffer) and buffers are aligned.
SLACK = 32 * 1024
# Not in llama.cpp's account (the books hold what llama.cpp allocated once a runner is loaded),
# so booked beside it: what a runner process costs by itself. Measured as proportional set size
# beyond llama.cpp's buffers on CPU (xllamacpp 2026.10), idle and while as many clients as slots
# generate after a 600-token prompt:
# - its own memory (`Estimate.process`): the interpreter's heap, the vocabulary's tables, the
#   slots' samplers and token buffers, HTTP threads. With an 8,192-token vocabulary 9.4 MiB
#   idle, 16.4 MiB busy with 1 slot, 18.6 MiB with 4; with SmolLM2's 49,152 tokens 19.6 MiB
#   idle, 32.4 MiB busy with 1 slot, 36.6 MiB with 4;
# - the shared code (xllamacpp's library, libpython, libstdc++), mapped by every runner but
#   resident once: 16-26 MiB in all, whatever the number of runners. Booked once per machine
#   (`RUNNER_CODE_BYTES`), not once per runner (the scheduler raises it if it measures more).
PROCESS_BASE = 16 * 2**20
PROCESS_PER_SLOT = 2**19
PROCESS_PER_TOKEN = 416  # bytes per vocabulary token (tokens, merges, lookup tables) ...
PROCESS_PER_TOKEN_SLOT = 48  # ... and per token and slot (each slot's sampler candidates)
# An embedding or rerank model's slot: no sampler is made for it (llama.cpp makes one only for
# a task that samples), but a runner with more slots has more HTTP threads (slots + 2), and each
# keeps the memory (its malloc arena) of the requests it parsed and answered. Measured on a
# synthetic bert (n_embd 64, 8,192 tokens) after requests of 3,000 inputs in chunks: 22.7 MiB
# beyond llama.cpp's buffers with 1 slot, 25.4 with 4, 38.5 with 16 (idle: 30 KiB a slot).
PROCESS_PER_EMBED_SLOT = 5 * 2**18
RUNNER_CODE_BYTES = 28 * 2**20
GGUF_ALIGNMENT = 32  # general.alignment default: each tensor's data may be padded to it
# Architectures whose feed-forward is not gated (up -> act -> down): one n_ff activation, not
# three (gate, up, gate*up). Unknown architectures count as gated, which errs high.
UNGATED_FFN = frozenset({"bert", "gpt2", "gptneox", "starcoder", "phi2", "bloom", "falcon"})


def check_kv_cache_type(info: ModelInfo, kv_type: str) -> None:
    """ValueError with a message for users if this model cannot use this KV cache type."""
    if kv_type not in KV_CACHE_TYPES:
        raise ValueError(
            f"unsupported kv_cache_type {kv_type!r}; use one of {', '.join(KV_CACHE_TYPES)}"
        )
    block = KV_CACHE_TYPES[kv_type][0]
    # llama_init_from_model refuses a quantized cache whose blocks straddle attention heads.
    for what, dim in (("key", info.head_dim_k), ("value", info.head_dim_v)):
        if dim % block:
            raise ValueError(
                f"kv_cache_type {kv_type!r} needs head dimensions divisible by {block}, but "
                f"this model's {what} heads have {dim}; use f16 (or f32, bf16)"
            )


def _pad(n: int, to: int) -> int:
    return -(-n // to) * to


def _row_bytes(kv_type: str, n: int) -> int:
    block, size = KV_CACHE_TYPES[kv_type]
    return -(-n // block) * size


@dataclass(frozen=True)
class LlamaParams:
    """The context llama.cpp sets up for a runner spec (llama_context's constructor)."""

    n_ctx: int  # all slots together, padded to N_CTX_PAD
    n_seq: int  # KV streams: the slots, or 1 with a unified cache the slots share
    n_ctx_seq: int  # KV cells per stream for full-attention layers
    n_ctx_swa: int  # KV cells per stream for sliding-window layers
    n_ubatch: int  # tokens in the micro-batch the compute graph is reserved for
    has_kv: bool  # encoders (bert, ...) keep no KV cache
    n_seq_max: int = 0  # parallel sequences (slots): one output row each; 0: n_seq
    # Output rows with speculative decoding: each slot verifies its drafts in one batch, so
    # llama.cpp reserves 1 + n_draft rows a slot (at most n_batch); 0: none
    n_outputs_draft: int = 0
    # Rows of logits the compute graph is reserved with, and the output buffer grows to: the
    # drafts' rows, or where a generative model embeds, every token of the micro-batch
    # (llama.cpp makes each one an output, and its graph still ends in the output head)
    n_logits: int = 0

    @property
    def n_outputs(self) -> int:
        return self.n_logits or self.n_seq_max or self.n_seq


def llama_params(
    info: ModelInfo,
    n_ctx: int,
    num_parallel: int,
    n_batch: int | None = None,
    unified: bool = False,
    n_draft: int = 0,
    embedding: bool = False,
) -> LlamaParams:
    """`n_batch`: Ollama's num_batch, which sets llama.cpp's n_batch and n_ubatch both.
    `unified`: llama.cpp's kv_unified, one KV cache of `n_ctx` cells the slots share.
    `n_draft`: the most tokens a speculative drafter proposes at once (DRAFT_TOKENS).
    `embedding`: the runner embeds (llama.cpp's --embeddings)."""
    n_seq_max = max(1, num_parallel)
    n_seq = 1 if unified else n_seq_max  # llama_kv_cache: n_stream = unified ? 1 : n_seq_max
    # runner_child passes n_ctx * num_parallel for separate caches, n_ctx for a unified one
    requested = max(1, n_ctx) * n_seq
    # llama_context: n_ctx = PAD(n_ctx, 256); unified: n_ctx_seq = n_ctx; else n_ctx_seq =
    # PAD(n_ctx / n_seq_max, 256) and n_ctx = n_ctx_seq * n_seq_max. Nothing caps it at the
    # training context (llama.cpp only warns), so neither does this.
    n_ctx_seq = _pad(_pad(requested, N_CTX_PAD) // n_seq, N_CTX_PAD)
    total = n_ctx_seq * n_seq
    from corral.core.gguf import EMBEDDING_ARCHITECTURES  # loaded already: `info` is from it

    has_kv = info.architecture not in EMBEDDING_ARCHITECTURES
    causal = info.metadata.get(f"{info.architecture}.attention.causal", has_kv) is not False
    # Causal models: n_batch = min(n_ctx, n_batch) with the unpadded n_ctx, n_ubatch <= n_batch.
    # Non-causal ones keep n_batch (the server sets n_batch = n_ubatch for embeddings).
    ubatch = n_batch if n_batch and n_batch > 0 else N_UBATCH
    batch = n_batch if n_batch and n_batch > 0 else N_BATCH
    n_ubatch = min(ubatch, batch, requested) if causal else ubatch
    n_swa = info.sliding_window or 0
    # llama_kv_cache_iswa: GGML_PAD(min(size_base, n_swa * (unified ? n_seq_max : 1) +
    # n_ubatch), 256) per stream: a unified SWA cache holds every slot's window.
    window = n_swa * (n_seq_max if unified else 1)
    n_ctx_swa = _pad(min(n_ctx_seq, window + n_ubatch), SWA_PAD)
    # sched_reserve sizes the graph for min(n_ctx, n_ubatch) tokens, split equally over the
    # sequences (rounded up: 512 tokens over 5 sequences are 5 x 103); one with kv_unified.
    n_tokens = _pad(min(n_ubatch, total), n_seq)
    # server_output_limits: min(n_batch, n_parallel * (1 + n_draft)) rows
    drafts = min(batch, n_seq_max * (1 + n_draft)) if n_draft > 0 else 0
    # A generative model's embedding runner: measured on SmolLM2 (pooling last), its compute
    # buffer is 18.6 -> 105.6 MiB at n_ubatch 512, 9.3 -> 52.8 at 256, 0.91 x the logits of
    # n_ubatch rows each time; its output buffer, 3 MiB at load with 16 slots, grows with its
    # first long input to 512 rows of logits and embedding (+97 MiB resident). (Causal
    # embedding models were not measured: left as they were.)
    logits = n_tokens if embedding and causal and has_kv and not is_embedder(info) else drafts
    return LlamaParams(
        total, n_seq, n_ctx_seq, n_ctx_swa, n_tokens, has_kv, n_seq_max, drafts, logits
    )


def _is_swa(info: ModelInfo, layer: int) -> bool:
    return bool(info.sliding_window) and layer < len(info.swa_layers) and info.swa_layers[layer]


def _meta_int(info: ModelInfo, key: str) -> int | None:
    """An integer key of the architecture, the largest if given per layer."""
    value = info.metadata.get(f"{info.architecture}.{key}")
    if isinstance(value, tuple):
        value = max((v for v in value if isinstance(v, int)), default=None)
    return value if isinstance(value, int) and value > 0 else None


def _n_ff(info: ModelInfo) -> int:
    """Feed-forward activations per token: n_ff, or for a mixture of experts the experts
    used per token (build_moe_ffn: [n_ff_exp, n_expert_used, n_tokens]; not calibrated, no
    MoE model is in the test suite)."""
    n_ff = _meta_int(info, "feed_forward_length") or 4 * info.n_embd  # 4x: when unsaid
    n_used = _meta_int(info, "expert_used_count")
    if n_used:
        n_ff = (_meta_int(info, "expert_feed_forward_length") or n_ff) * n_used + (
            _meta_int(info, "expert_shared_feed_forward_length") or 0
        )
    return n_ff


def kv_per_layer(info: ModelInfo, p: LlamaParams, kv_type: str = "f16") -> tuple[int, ...]:
    """llama_kv_cache: per layer a K tensor [n_embd_k_gqa, cells, streams] and a V tensor
    likewise (transposed without flash attention: same size)."""
    if not p.has_kv:
        return (0,) * info.n_layer
    out = []
    for layer in range(info.n_layer):
        n_kv = info.n_head_kv[layer] if layer < len(info.n_head_kv) else info.n_head
        cells = p.n_ctx_swa if _is_swa(info, layer) else p.n_ctx_seq
        row = _row_bytes(kv_type, n_kv * info.head_dim_k) + _row_bytes(
            kv_type, n_kv * info.head_dim_v
        )
        out.append(cells * p.n_seq * row)
    return tuple(out)


def compute_bytes(
    info: ModelInfo, p: LlamaParams, kv_type: str = "f16", flash_attn: bool = True
) -> int:
    """Peak of ggml-alloc's graph allocator for one micro-batch of n_ubatch tokens.

    Activations are f32 per token; the allocator reuses freed tensors best-fit, and what stays
    live at the peak was measured (over n_embd 64-1024, n_ff 0.25-16 x n_embd, 1-30 layers):
    - attention: the residual stream, the normed input, Q, K, V and the attention output:
      up to 7 x n_embd;
    - gated feed-forward: gate, up and gate*up (3 x n_ff) beside up to 5 x n_embd of residual
      and freed-but-fragmented blocks, once n_ff > n_embd (below, n_ff-sized blocks fit in
      the attention stage's holes); with two layers the fragmentation is smaller (3.5 x n_embd
      while n_ff <= 2 n_embd); the last layer runs its feed-forward only on the output rows
      (inp_out_ids), so a one-layer model has no full-batch feed-forward;
    - ungated feed-forward (bert): one n_ff activation beside 5 x n_embd.
    The attention mask is one f16 [n_kv, n_ubatch] per KV cache (full, SWA) with flash
    attention; without it the mask is f32 and the scores [n_kv, n_ubatch, n_head] f32 join in.
    """
    e, ff, t = info.n_embd, _n_ff(info), p.n_ubatch
    if info.architecture in UNGATED_FFN:
        ffn = ff + 5 * e  # up (+bias, activation in place) beside the residuals
    elif (info.n_layer == 1 and p.has_kv) or ff <= e:
        ffn = 0  # the attention stage (7 x n_embd) is the peak
    elif info.n_layer == 2 and ff <= 2 * e:
        ffn = 3 * ff + 7 * e // 2
    else:
        ffn = 3 * ff + 5 * e
    width = max(7 * e, ffn)
    activations = t * (width * F32 + PER_TOKEN_EXTRA)
    # Masks: one per KV cache kind present (graph inputs, live for the whole graph); an encoder
    # attends over the micro-batch itself.
    if p.has_kv:
        kinds = {_is_swa(info, i) for i in range(info.n_layer)}
        kv_lens = [p.n_ctx_swa if swa else p.n_ctx_seq for swa in kinds]
    else:
        kinds, kv_lens = set(), [t]
    mask = sum(t * n_kv * (F16 if flash_attn else F32) for n_kv in kv_lens)
    scores = 0 if flash_attn else t * max(kv_lens) * max(info.n_head, 1) * F32
    quant = len(kinds) * t * PER_TOKEN_QUANT_KV if KV_CACHE_TYPES[kv_type][0] > 1 else 0
    # Verifying drafts: the graph is reserved with the logits of every output row, beside what
    # is live at the output (measured on SmolLM2 with ngram-mod: 22.6 MiB without; 25.8, 38.0,
    # 62.4, 109.6 MiB with 1, 2, 4, 8 slots = the logits + 13.6 MiB; this books the logits +
    # the activations' peak, 22.6 MiB)
    logits = p.n_logits * info.n_vocab * F32
    return activations + mask + scores + quant + logits


def output_bytes(info: ModelInfo, p: LlamaParams, embedding: bool | None = None) -> int:
    """llama_context's output buffer: f32 logits of one token per sequence (n_outputs_max),
    plus its embeddings where the runner embeds (None: where the model is an embedding
    model)."""
    if embedding is None:
        embedding = "embedding" in info.capabilities
    per_row = info.n_vocab + (info.n_embd if embedding else 0)
    return p.n_outputs * per_row * F32


def is_embedder(info: ModelInfo) -> bool:
    """Whether the model's own runner embeds: an embedding or rerank model."""
    return bool({"embedding", "rerank"} & set(info.capabilities))


# A projector's graph: the image input (3 x side^2 f32) stays allocated throughout; beside it the
# patch embedding's im2col (f16), then per encoder block the feed-forward activation and up to
# 3 rows of n_embd (residual, normed input, attention output; measured 1-3 with fragmentation),
# or without flash attention the scores (n_head x n_pos^2 f32) beside 5 rows of n_embd.
PROJECTOR_SLACK = 64 * 1024
# The image side a projector is reserved for when its file does not say (dynamic-resolution
# encoders): llama.cpp warms such models up with images of about this size.
PROJECTOR_WARMUP_SIDE = 448


def projector_bytes(proj: ProjectorInfo, flash_attn: bool = True) -> tuple[int, int]:
    """(weights, compute) of a vision projector: its tensors in one buffer, and the compute
    buffer its encoder's graph is reserved with (one warm-up image)."""
    side = proj.image_size or PROJECTOR_WARMUP_SIDE
    patch = max(1, proj.patch_size)
    n_pos = (side // patch) ** 2 + 1  # + a class embedding, where the encoder has one
    e, ff = proj.n_embd, proj.n_ff or 4 * proj.n_embd
    image = 3 * side * side * F32
    im2col = n_pos * 3 * patch * patch * F16 + n_pos * e * F32
    block = n_pos * (ff + 3 * e) * F32
    if not flash_attn:
        block = max(block, n_pos * n_pos * max(1, proj.n_head) * F32 + 5 * n_pos * e * F32)
    align = GGUF_ALIGNMENT * proj.n_tensors  # each tensor aligned in the buffer
    return proj.weights + align, image + max(im2col, block) + PROJECTOR_SLACK


@dataclass(frozen=True)
class Estimate:
    """Bytes a runner will hold, broken down for placing layers on devices."""

    weights_per_layer: tuple[int, ...]  # tensor data of blk.N.*
    kv_per_layer: tuple[int, ...]  # KV cache of layer N (all streams)
    non_layer: int  # weights outside the layers: token embedding, output, norms
    compute: int  # graph compute buffer, on the device that runs the graph
    overhead: int  # output buffer (host memory) and slack
    # LoRA adapters: their tensors of layer N (on the device of layer N), and the rest
    adapters_per_layer: tuple[int, ...] = ()
    adapters_other: int = 0
    # The vision projector: weights and its graph's compute buffer (on the first GPU of the
    # runner, or in system memory)
    projector_weights: int = 0
    projector_compute: int = 0
    # Per layer: expert weights kept in system memory (--n-cpu-moe), part of weights_per_layer
    cpu_experts_per_layer: tuple[int, ...] = ()
    # The runner process's own memory beyond llama.cpp's buffers (process_bytes): not in
    # `total` (llama.cpp does not count it), booked in system memory beside it
    process: int = 0
    # The output slot's weights where it goes to a GPU (output head and norm, or the copy of
    # tied embeddings llama.cpp makes there): not in `total`, which counts them once, in
    # `non_layer` (system memory)
    head: int = 0
    # The draft model's own buffers (speculative "draft"): its weights, its KV cache of the
    # target's context, its compute and output buffers; in `total`. Its process memory is in
    # this estimate's `process`, not in its own.
    draft: Estimate | None = None

    @property
    def projector(self) -> int:
        return self.projector_weights + self.projector_compute

    @property
    def total(self) -> int:
        return (
            sum(self.weights_per_layer)
            + sum(self.kv_per_layer)
            + self.non_layer
            + self.compute
            + self.overhead
            + sum(self.adapters_per_layer)
            + self.adapters_other
            + self.projector
            + (self.draft.total if self.draft is not None else 0)
        )


# Tokens each of llama.cpp's drafters proposes at most (common_speculative_n_max, b11434
# defaults; ngram-mod's as corral starts it; a draft model's and ngram-mod's are the model's
# draft_max where set), and what an n-gram drafter's tables hold in the runner process
# (ngram-mod: 4M 4-byte entries; the others are taken to hold no more).
DRAFT_TOKENS = {"off": 0, "draft": DRAFT_MAX, "ngram-mod": NGRAM_MOD_MAX, "ngram-simple": 48,
                "ngram-map-k": 48, "ngram-map-k4v": 48, "ngram-cache": 8}  # fmt: skip
DRAFTER_BYTES = 16 * 2**20


def estimate(
    info: ModelInfo,
    n_ctx: int,
    num_parallel: int = 1,
    kv_type: str = "f16",
    *,
    flash_attn: bool = True,
    n_batch: int | None = None,
    projector: ProjectorInfo | None = None,
    adapters: Sequence[AdapterInfo] = (),
    n_cpu_moe: int = 0,
    unified: bool = False,
    speculative: str = "off",
    draft: ModelInfo | None = None,
    draft_max: int | None = None,
    embedding: bool | None = None,
) -> Estimate:
    """What llama.cpp will allocate for `info` at `n_ctx` tokens per request and
    `num_parallel` slots (ValueError for an unknown kv_type), with the model's `projector` and
    LoRA `adapters`; `n_batch` is Ollama's num_batch, `n_cpu_moe` the layers whose experts
    stay in system memory; `unified`: one KV cache of `n_ctx` cells the slots share
    (llama.cpp's kv_unified) instead of `n_ctx` cells per slot; `speculative`: the drafter
    (DRAFT_TOKENS), whose verification batches need more output rows; `draft`: the draft
    model of speculative "draft", drafting `draft_max` tokens at most (`draft_estimate`);
    `embedding`: the runner embeds (None: as the model's own runner does, an embedding model's;
    True for a generative model's embedding runner)."""
    if kv_type not in KV_CACHE_TYPES:
        raise ValueError(f"unsupported kv_cache_type {kv_type!r}")
    n_draft = DRAFT_TOKENS.get(speculative, 0)
    drafter = DRAFTER_BYTES if n_draft and speculative != "draft" else 0
    if speculative == "ngram-mod":
        n_draft = ngram_mod_lengths(draft_max, None)[2]
    own: Estimate | None = None
    if speculative == "draft" and draft is not None:
        n_draft = DRAFT_MAX if draft_max is None else draft_max
        own = draft_estimate(draft, n_ctx, num_parallel, flash_attn, n_batch, unified)
        drafter = own.process
    embeds = is_embedder(info) if embedding is None else embedding
    p = llama_params(info, n_ctx, num_parallel, n_batch, unified, n_draft, embeds)
    # The mapped weights span the tensors with their padding to the file's alignment: up to
    # 32 tensors per layer (llama has 9, gemma3 13, bert 16), 8 outside the layers.
    align = _alignment(info)
    lora = [0] * info.n_layer
    lora_other = 0
    for a in adapters:  # mapped from the adapter's file like the model's weights
        for layer, n in a.layer_bytes.items():
            if layer < info.n_layer:
                lora[layer] += n + 4 * GGUF_ALIGNMENT
        lora_other += a.other_bytes + 4 * GGUF_ALIGNMENT
    proj_weights, proj_compute = projector_bytes(projector, flash_attn) if projector else (0, 0)
    experts = info.expert_bytes[: max(0, n_cpu_moe)]
    return Estimate(
        weights_per_layer=tuple(b + 32 * align for b in info.layer_bytes),
        kv_per_layer=kv_per_layer(info, p, kv_type),
        non_layer=info.output_bytes + 8 * align,
        head=info.head_bytes + 2 * align if info.head_bytes else 0,
        compute=compute_bytes(info, p, kv_type, flash_attn),
        overhead=output_bytes(info, p, embedding) + SLACK,
        adapters_per_layer=tuple(lora) if adapters else (),
        adapters_other=lora_other,
        projector_weights=proj_weights,
        projector_compute=proj_compute,
        cpu_experts_per_layer=tuple(experts) if any(experts) else (),
        process=process_bytes(info, num_parallel, embeds) + drafter,
        draft=own,
    )


def draft_estimate(
    draft: ModelInfo,
    n_ctx: int,
    num_parallel: int,
    flash_attn: bool = True,
    n_batch: int | None = None,
    unified: bool = False,
) -> Estimate:
    """What a draft model adds to its target's runner. llama.cpp makes its context from the
    target's parameters (common_base_params_to_speculative, common_speculative_init_result):
    the target's cells (llama_n_ctx of the target), slots, unified cache, batch and flash
    attention; its own KV cache type (f16 unless told) and one output row a slot. Its process
    memory is its vocabulary's tables and one sampler a slot (`process_bytes` less the base)."""
    p = llama_params(draft, n_ctx, num_parallel, n_batch, unified)
    align = _alignment(draft)
    return Estimate(
        weights_per_layer=tuple(b + 32 * align for b in draft.layer_bytes),
        kv_per_layer=kv_per_layer(draft, p),
        non_layer=draft.output_bytes + 8 * align,
        head=draft.head_bytes + 2 * align if draft.head_bytes else 0,
        compute=compute_bytes(draft, p, "f16", flash_attn),
        overhead=output_bytes(draft, p) + SLACK,
        process=process_bytes(draft, num_parallel) - PROCESS_BASE,
    )


def _alignment(info: ModelInfo) -> int:
    align = info.metadata.get("general.alignment", GGUF_ALIGNMENT)
    return align if isinstance(align, int) and align > 0 else GGUF_ALIGNMENT


def process_bytes(info: ModelInfo, num_parallel: int = 1, embedding: bool | None = None) -> int:
    """A runner process's own memory beyond llama.cpp's buffers (see PROCESS_BASE); an
    embedding runner's (None: the model's own runner's kind) makes no sampler."""
    slots = max(1, num_parallel)
    vocab = max(0, info.n_vocab)
    if is_embedder(info) if embedding is None else embedding:  # no sampler in any slot
        return PROCESS_BASE + PROCESS_PER_EMBED_SLOT * slots + vocab * PROCESS_PER_TOKEN
    per_token = PROCESS_PER_TOKEN + PROCESS_PER_TOKEN_SLOT * slots
    return PROCESS_BASE + PROCESS_PER_SLOT * slots + vocab * per_token


def estimate_bytes(info: ModelInfo, n_ctx: int, num_parallel: int, kv_type: str = "f16") -> int:
    """The estimate's total in bytes (what the scheduler books before a load)."""
    return estimate(info, n_ctx, num_parallel, kv_type).total
