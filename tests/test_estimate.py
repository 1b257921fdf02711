"""Memory estimates: the parser of llama.cpp's allocation log, the estimate's arithmetic, and
real loads where llama.cpp's own account must satisfy real <= estimate <= 1.10 x real."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from helpers import parse_log

from corral.core.estimate import (
    DRAFT_TOKENS,
    KV_CACHE_TYPES,
    N_BATCH,
    check_kv_cache_type,
    estimate,
    estimate_bytes,
    llama_params,
    process_bytes,
)
from corral.core.gguf import ModelInfo, read_model_info
from corral.core.memreport import LOADED_MARKER, AllocationParser, device_of
from corral.core.spec import LAST_POOLING, RunnerSpec, spec_estimate
from corral.runtime.runner import Runner, RunnerError
from corral.testing import synth

MIB = 2**20

# Real llama.cpp output (verbosity 4) of a runner for synth.write_llama_model() at n_ctx 512.
LLAMA_LOG = """\
0.00.024.543 I load_tensors: loading model tensors, this can take a while... (load_mode = mmap)
0.00.024.849 I load_tensors:   CPU_Mapped model buffer size =     1.14 MiB
0.00.025.392 I llama_context: n_outputs_max_per_seq = 1
0.00.025.401 I llama_context:        CPU  output buffer size =     0.03 MiB
0.00.025.438 I llama_kv_cache:        CPU KV buffer size =     0.12 MiB
0.00.025.449 I llama_kv_cache: size =    0.12 MiB (   512 cells,   2 layers,  1/1 seqs), \
K (f16):    0.06 MiB, V (f16):    0.06 MiB
0.00.025.452 I sched_reserve: reserving ...
0.00.026.196 I sched_reserve:        CPU compute buffer size =     1.64 MiB
0.00.026.206 I sched_reserve: graph: nodes = 71, splits = 1, input objects = 4, input tensors = 9
0.00.028.675 I srv          init: model loaded
"""

# gemma3 with 8 layers (one global, seven sliding-window) at n_ctx 2048 x 2 slots: two caches.
SWA_LOG = """\
0.00.064.995 I load_tensors:   CPU_Mapped model buffer size =     1.57 MiB
0.00.065.797 I llama_context:        CPU  output buffer size =     0.06 MiB
0.00.065.816 I llama_kv_cache_iswa: creating non-SWA KV cache, size = 2048 cells
0.00.065.877 I llama_kv_cache:        CPU KV buffer size =     0.50 MiB
0.00.066.164 I llama_kv_cache: size =    0.50 MiB (  2048 cells,   1 layers,  2/2 seqs), \
K (f16):    0.25 MiB, V (f16):    0.25 MiB
0.00.066.206 I llama_kv_cache_iswa: creating     SWA KV cache, size = 768 cells
0.00.066.243 I llama_kv_cache:        CPU KV buffer size =     1.31 MiB
0.00.066.965 I llama_kv_cache: size =    1.31 MiB (   768 cells,   7 layers,  2/2 seqs), \
K (f16):    0.66 MiB, V (f16):    0.66 MiB
0.00.068.649 I sched_reserve:        CPU compute buffer size =     4.15 MiB
corral-runner: load log complete
"""

# bert (embeddings): no KV cache at all.
BERT_LOG = """\
0.00.028.389 I load_tensors:   CPU_Mapped model buffer size =     1.19 MiB
0.00.029.845 I llama_context:        CPU  output buffer size =     0.06 MiB
0.00.029.859 I sched_reserve: reserving ...
0.00.030.696 I sched_reserve:        CPU compute buffer size =     1.39 MiB
"""


def mib(x: float) -> int:
    return round(x * MIB)


# --------------------------------------------------------------------------- parser


def test_parser_reads_each_buffer_of_a_real_log() -> None:
    a = parse_log(LLAMA_LOG)
    assert a is not None
    assert (a.model_bytes, a.kv_bytes, a.compute_bytes, a.output_bytes) == (
        mib(1.14), mib(0.12), mib(1.64), mib(0.03)
    )  # fmt: skip
    assert a.total == mib(1.14) + mib(0.12) + mib(1.64) + mib(0.03)
    # Mapped weights are CPU memory like the rest.
    assert a.by_device() == {"CPU": a.total}


def test_parser_adds_both_caches_of_a_swa_model_and_skips_the_summaries() -> None:
    p = AllocationParser()
    for line in SWA_LOG.splitlines():
        p.feed(line)
    a = p.allocation
    assert a is not None and p.done
    assert a.kv_bytes == mib(0.50) + mib(1.31)  # not the `size = ...` restatements again
    assert a.total == mib(1.57) + mib(0.06) + mib(0.50) + mib(1.31) + mib(4.15)


def test_parser_without_kv_cache_and_before_any_buffer() -> None:
    a = parse_log(BERT_LOG)
    assert a is not None and a.kv_bytes == 0 and dict(a.kv) == {}
    assert a.total == mib(1.19) + mib(0.06) + mib(1.39)
    p = AllocationParser()
    assert p.allocation is None and not p.done
    assert not p.feed("0.00.001.878 I srv          init: build_info: b0-unknown")
    assert p.allocation is None
    p.feed(LOADED_MARKER)
    assert p.done


def test_parser_splits_gpu_buffers_by_device() -> None:
    # Built from llama.cpp's format strings ("%s: %12s model buffer size = %8.2f MiB", ...):
    # no GPU was at hand to capture a real one.
    log = """\
load_tensors:        CUDA0 model buffer size =  4699.90 MiB
load_tensors:   CPU_Mapped model buffer size =   308.23 MiB
llama_kv_cache:      CUDA0 KV buffer size =   512.00 MiB
llama_context:  CUDA_Host  output buffer size =     0.77 MiB
llama_context:      CUDA0 compute buffer size =   985.20 MiB
llama_context:  CUDA_Host compute buffer size =    58.33 MiB
"""
    a = parse_log(log)
    assert a is not None
    assert a.by_device() == {
        "CUDA0": mib(4699.90) + mib(512.00) + mib(985.20),
        "CPU": mib(308.23) + mib(0.77) + mib(58.33),
    }
    assert device_of("CPU_REPACK") == "CPU" and device_of("Vulkan0") == "Vulkan0"
    # The debug line that compares a compute buffer with its expectation is not a buffer.
    assert parse_log("x: compute buffer size is   1.0000 MiB, matches expectation") is None


# --------------------------------------------------------------------------- arithmetic


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, ModelInfo]:
    d = tmp_path_factory.mktemp("estimate-models")
    paths = {
        "llama": synth.write_llama_model(d / "llama.gguf"),
        # head_dim 64: quantized KV caches need heads divisible by their 32-value blocks
        "llama64": synth.write_llama_model(d / "llama64.gguf", n_embd=128, n_head=2, n_head_kv=1),
        "swa": synth.write_swa_model(d / "swa.gguf"),
        "swa8": synth.write_swa_model(d / "swa8.gguf", n_layer=8),
        "bert": synth.write_bert_model(d / "bert.gguf"),
    }
    return {k: read_model_info(p) for k, p in paths.items()}


def test_kv_cache_grows_linearly_with_context_and_parallel(models: dict[str, ModelInfo]) -> None:
    info = models["llama"]

    def kv(n_ctx: int, par: int) -> int:
        return sum(estimate(info, n_ctx, par).kv_per_layer)

    assert kv(1024, 1) == 2 * kv(512, 1)
    assert kv(4096, 1) == 8 * kv(512, 1)
    assert kv(1024, 4) == 4 * kv(1024, 1)
    # llama.cpp pads the context to 256 cells
    assert kv(300, 1) == kv(512, 1)
    # 2 KV heads of 16 dims, K and V, f16: 128 bytes per cell and layer
    assert estimate(info, 512, 1).kv_per_layer == (512 * 128,) * 2


def test_context_layout_follows_llama_context(models: dict[str, ModelInfo]) -> None:
    # Values read from llama.cpp's own log lines (n_ctx, n_ctx_seq, cells) for these specs.
    p = llama_params(models["llama"], 333, 3)
    assert (p.n_ctx, p.n_ctx_seq) == (1536, 512)  # PAD(PAD(999, 256) / 3, 256) = 512 per slot
    p = llama_params(models["swa8"], 100, 3)
    assert (p.n_ctx, p.n_ctx_seq, p.n_ctx_swa, p.n_ubatch) == (768, 256, 256, 300)
    assert llama_params(models["llama"], 277, 5).n_ubatch == 515  # 512 split 5 ways: 5 x 103
    assert llama_params(models["bert"], 128, 1).n_ubatch == 256  # the whole (padded) context
    assert llama_params(models["bert"], 128, 1).has_kv is False


def test_swa_layers_hold_only_their_window(models: dict[str, ModelInfo]) -> None:
    info = models["swa8"]  # layer 5 is global, the others slide over 128 tokens
    at_2k, at_8k = estimate(info, 2048, 1).kv_per_layer, estimate(info, 8192, 1).kv_per_layer
    assert at_8k[5] == 4 * at_2k[5]
    for layer in (0, 1, 2, 3, 4, 6, 7):
        # window + micro-batch, padded to 256: 128 + 512 -> 768 cells, whatever the context
        assert at_2k[layer] == at_8k[layer] == 768 * 128
    assert llama_params(info, 8192, 1).n_ctx_swa == 768


def test_quantized_kv_cache_is_smaller(models: dict[str, ModelInfo]) -> None:
    info = models["llama64"]
    f16, q8, q4 = (sum(estimate(info, 2048, 2, kv).kv_per_layer) for kv in ("f16", "q8_0", "q4_0"))
    assert q4 < q8 < f16
    assert q8 == f16 * 34 // 64  # 32 values in 34 bytes instead of 64
    check_kv_cache_type(info, "q4_0")
    with pytest.raises(ValueError, match="divisible by 32"):
        check_kv_cache_type(models["llama"], "q8_0")  # 16-dim heads
    with pytest.raises(ValueError, match="unsupported kv_cache_type"):
        check_kv_cache_type(info, "q3_k")
    assert set(KV_CACHE_TYPES) >= {"f16", "q8_0", "q4_0"}


def test_breakdown_adds_up_and_encoders_have_no_kv(models: dict[str, ModelInfo]) -> None:
    info = models["llama"]
    e = estimate(info, 2048, 2)
    assert len(e.weights_per_layer) == len(e.kv_per_layer) == info.n_layer
    assert e.total == (
        sum(e.weights_per_layer) + sum(e.kv_per_layer) + e.non_layer + e.compute + e.overhead
    )
    assert estimate_bytes(info, 2048, 2) == e.total
    assert sum(e.weights_per_layer) >= sum(info.layer_bytes)
    assert e.non_layer >= info.output_bytes
    assert sum(estimate(models["bert"], 512, 2).kv_per_layer) == 0
    # more context: a bigger attention mask in the compute buffer
    assert estimate(info, 8192, 1).compute > estimate(info, 512, 1).compute


# --------------------------------------------------------------------------- real loads


async def load(
    info: ModelInfo, n_ctx: int, par: int, kv: str = "f16", unified: bool = False,
    speculative: str = "off",
) -> tuple[int, int]:
    """(estimate, llama.cpp's allocation at load). With a drafter, llama.cpp's output buffer
    starts at one row a slot and grows as verification batches need more rows, up to
    min(n_batch, slots x (1 + n_draft)) (server_output_limits): that growth counts as real."""
    embedding = "embedding" in info.capabilities
    spec = RunnerSpec(
        path=str(info.path), n_ctx=n_ctx, num_parallel=par, embedding=embedding, kv_cache_type=kv,
        kv_unified=unified, speculative=speculative,
    )
    runner = Runner(Path(info.path).stem, spec)
    await runner.start(60)
    try:
        alloc = runner.allocation  # complete as soon as start() returns
    finally:
        await runner.stop()
    assert alloc is not None, runner.log_tail(40)
    assert alloc.model_bytes and alloc.compute_bytes and alloc.output_bytes
    est = estimate(info, n_ctx, par, kv, unified=unified, speculative=speculative)
    rows = min(N_BATCH, par * (1 + DRAFT_TOKENS[speculative])) if speculative != "off" else par
    grown = max(0, rows - par) * info.n_vocab * 4
    return est.total, alloc.total + grown


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("model", "n_ctx", "par", "kv", "unified", "speculative"),
    [
        ("llama", 512, 1, "f16", False, "off"),
        ("llama", 2048, 2, "f16", False, "off"),
        ("llama64", 1024, 4, "q8_0", False, "off"),
        ("swa", 512, 1, "f16", False, "off"),
        ("swa8", 2048, 2, "f16", False, "off"),
        ("bert", 512, 1, "f16", False, "off"),
        ("bert", 512, 4, "f16", False, "off"),
        # slots sharing one KV cache (CORRAL_NUM_PARALLEL auto)
        ("llama", 2048, 4, "f16", True, "off"),
        ("llama64", 1024, 4, "q8_0", True, "off"),
        ("swa8", 2048, 4, "f16", True, "off"),
        ("bert", 512, 4, "f16", True, "off"),
        # an n-gram drafter (`speculative: auto`): logits for its verification batches (with
        # 1-2 slots of these tiny models the logits fit in space the activations freed, and
        # the estimate is up to 2 MB over: 1.3x of a 7 MB runner)
        ("llama", 2048, 4, "f16", True, "ngram-mod"),
        ("llama", 1024, 4, "f16", False, "ngram-simple"),
        ("swa8", 2048, 4, "f16", True, "ngram-mod"),
    ],
)
async def test_estimate_covers_the_real_allocation(
    models: dict[str, ModelInfo], model: str, n_ctx: int, par: int, kv: str, unified: bool,
    speculative: str,
) -> None:
    est, real = await load(models[model], n_ctx, par, kv, unified, speculative)
    assert real <= est <= 1.10 * real, f"estimate {est} vs real {real} ({est / real:.3f})"


@pytest.mark.e2e
@pytest.mark.parametrize(("n_ctx", "par", "unified"), [(512, 1, False), (2048, 4, True)])
async def test_estimate_covers_a_chat_models_embedding_runner(
    models: dict[str, ModelInfo], n_ctx: int, par: int, unified: bool
) -> None:
    info = models["llama"]
    spec = RunnerSpec(path=str(info.path), n_ctx=n_ctx, num_parallel=par, kv_unified=unified,
                      embedding=True, pooling_type=LAST_POOLING)  # fmt: skip
    runner = Runner("llama", spec)
    await runner.start(60)
    try:
        real = runner.allocation
    finally:
        await runner.stop()
    assert real is not None
    # its output buffer, a row a slot at load, grows to a micro-batch of outputs (every token
    # of an input is one) with the first input that long
    grown = (min(n_ctx, 512) - par) * (info.n_vocab + info.n_embd) * 4
    est = spec_estimate(info, spec).total
    assert real.total + grown <= est <= 1.10 * (real.total + grown), f"{est} vs {real.total}"


@pytest.mark.e2e
async def test_unusable_kv_cache_type_fails_clearly(models: dict[str, ModelInfo]) -> None:
    info = models["llama"]
    runner = Runner("llama", RunnerSpec(path=str(info.path), n_ctx=512, num_parallel=1,
                                        kv_cache_type="q4_0"))  # fmt: skip
    with pytest.raises(RunnerError, match="needs head dimensions divisible by 32"):
        await runner.start(60)


# ---- runner options and a model's parts ---------------------------------------------------------


def test_num_batch_sizes_the_micro_batch(models: dict[str, ModelInfo]) -> None:
    info = models["llama"]
    default = estimate(info, 4096)
    small, large = estimate(info, 4096, n_batch=64), estimate(info, 4096, n_batch=2048)
    assert small.compute < default.compute < large.compute
    assert small.kv_per_layer == default.kv_per_layer == large.kv_per_layer


def test_flash_attention_off_costs_compute(models: dict[str, ModelInfo]) -> None:
    info = models["llama"]
    assert estimate(info, 4096, flash_attn=False).compute > estimate(info, 4096).compute


def test_experts_are_counted_per_layer(tmp_path: Path) -> None:
    info = read_model_info(synth.write_moe_model(tmp_path / "moe.gguf", n_layer=3, n_expert=4))
    assert len(info.expert_bytes) == 3 and all(info.expert_bytes)
    assert all(x < w for x, w in zip(info.expert_bytes, info.layer_bytes, strict=True))
    est = estimate(info, 512, n_cpu_moe=2)
    assert est.cpu_experts_per_layer == info.expert_bytes[:2]
    assert est.total == estimate(info, 512).total  # only where they are booked changes
    assert estimate(info, 512).cpu_experts_per_layer == ()


def test_projector_compute_grows_with_its_image(tmp_path: Path) -> None:
    from corral.core.estimate import projector_bytes
    from corral.core.gguf import read_projector_info

    small = read_projector_info(synth.write_projector(tmp_path / "a.gguf", 64))
    big = read_projector_info(
        synth.write_projector(tmp_path / "b.gguf", 64, image_size=224, patch_size=14)
    )
    (w_small, c_small), (w_big, c_big) = projector_bytes(small), projector_bytes(big)
    assert w_small >= small.weights and w_big >= big.weights
    assert c_big > c_small > 0
    # Without flash attention the scores (n_head x n_pos^2) are held too.
    assert projector_bytes(big, flash_attn=False)[1] >= c_big


def test_the_runner_process_is_booked_beside_the_buffers(models: dict[str, ModelInfo]) -> None:
    """What the process costs by itself grows with the vocabulary and the slots, and is not in
    `total` (llama.cpp's own account, which the allocation replaces once loaded)."""
    info = models["llama"]
    one, four = estimate(info, 1024, 1), estimate(info, 1024, 4)
    assert one.process == process_bytes(info, 1) > 16 * 2**20
    assert four.process > one.process
    assert one.total == sum(
        (sum(one.weights_per_layer), sum(one.kv_per_layer), one.non_layer, one.compute,
         one.overhead)
    )  # fmt: skip
    big_vocab = dataclasses.replace(info, n_vocab=152_064)  # Qwen's
    assert process_bytes(big_vocab, 1) - process_bytes(info, 1) > 50 * 2**20
