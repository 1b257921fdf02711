"""Memory estimates (pure): bytes a runner will hold for a model at a context and parallelism.

First-order arithmetic over the GGUF metadata: weights + KV cache (per layer, honouring sliding
windows) + compute buffers + a fixed overhead. It errs high on purpose; the runner's real
allocation replaces it in the books once loaded.
"""

from __future__ import annotations

from corral.gguf_info import ModelInfo

KV_TYPE_BYTES = {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}
N_UBATCH = 512  # llama.cpp's default micro-batch; compute buffers scale with it
OVERHEAD = 48 * 2**20  # runner process, llama.cpp context, HTTP threads


def kv_cache_bytes(info: ModelInfo, n_ctx_total: int, kv_type: str = "f16") -> int:
    per = KV_TYPE_BYTES.get(kv_type, 2.0)
    total = 0.0
    for layer in range(info.n_layer):
        n_kv = info.n_head_kv[layer] if layer < len(info.n_head_kv) else info.n_head
        ctx = n_ctx_total
        if info.sliding_window and layer < len(info.swa_layers) and info.swa_layers[layer]:
            ctx = min(ctx, info.sliding_window)
        total += ctx * n_kv * (info.head_dim_k + info.head_dim_v) * per
    return int(total)


def compute_bytes(info: ModelInfo, n_ctx_total: int) -> int:
    # Logits for a micro-batch, attention scores for it against the whole context, and the
    # feed-forward activations: the three biggest tensors in llama.cpp's compute graph.
    logits = N_UBATCH * info.n_vocab * 4
    scores = N_UBATCH * n_ctx_total * info.n_head * 4
    activations = N_UBATCH * info.n_embd * 4 * 8
    return logits + scores + activations


def estimate_bytes(info: ModelInfo, n_ctx: int, num_parallel: int, kv_type: str = "f16") -> int:
    n_ctx_total = n_ctx * num_parallel
    weights = sum(info.layer_bytes) + info.output_bytes
    return (
        weights
        + kv_cache_bytes(info, n_ctx_total, kv_type)
        + compute_bytes(info, n_ctx_total)
        + OVERHEAD
    )
