"""What a GGUF file says about its model: metadata and tensor table, never the weights.

Used for Ollama's /api/tags and /api/show, for memory estimates, and to reject broken files
(truncated downloads, an HTML error page saved as .gguf) with a message a user can act on.
The file itself is parsed by `core/ggufreader.py`. Results are cached by (path, inode, size,
mtime), so listing models repeatedly costs a stat.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import stat
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from gguf.constants import LlamaFileType
from gguf.gguf_reader import GGUFReader, ReaderField, ReaderTensor

from corral.core.ggufreader import GGUFError, metadata, open_reader, scalar_value, string_array

__all__ = [
    "EMBEDDING_ARCHITECTURES",
    "AdapterInfo",
    "GGUFError",
    "ModelInfo",
    "ProjectorInfo",
    "check_adapter",
    "clear_cache",
    "model_capabilities",
    "read_adapter_info",
    "read_model_info",
    "read_projector_info",
    "read_tokens",
    "template_has_tools",
]

# Far above llama.cpp's own limit (LLAMA_MAX_LAYERS = 512); a larger block_count is corrupt and
# would only make per-layer tuples exhaust memory.
_MAX_LAYERS = 4096
_BLOCK_RE = re.compile(r"blk\.(\d+)\.")
# llama.cpp's split file names (gguf-split, llama_split_path): prefix-00001-of-00003.gguf
SPLIT_RE = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$", re.I)
# The expert tensors of a mixture-of-experts layer (what llama.cpp's --n-cpu-moe keeps in system
# memory: common.h's LLM_FFN_EXPS_REGEX).
_EXPERT_RE = re.compile(r"blk\.(\d+)\.ffn_(up|down|gate|gate_up)_(ch|)exps")

# Encoder architectures that llama.cpp only runs for embeddings.
EMBEDDING_ARCHITECTURES = frozenset(
    {
        "bert",
        "eurobert",
        "gemma-embedding",
        "jina-bert-v2",
        "jina-bert-v3",
        "llama-embed",
        "modern-bert",
        "neo-bert",
        "nomic-bert",
        "nomic-bert-moe",
        "t5encoder",
    }
)

# llama.cpp hard-codes the sliding-window layout of these architectures instead of reading
# {arch}.attention.sliding_window_pattern, so their files usually lack the key.
_BUILTIN_SWA_PATTERN = {"gemma2": 2, "gemma3": 6, "gemma-embedding": 6, "cohere2": 4, "gpt-oss": 2}

# Ollama leaves these out of /api/show's model_info: they are returned elsewhere (template).
_NOT_IN_MODEL_INFO = frozenset({"general.name", "tokenizer.chat_template"})


@dataclass(frozen=True)
class ModelInfo:
    """A GGUF model's metadata and tensor layout. Keys named below are `{architecture}.*`."""

    path: Path
    file_size: int
    architecture: str  # general.architecture, e.g. "llama", "bert"
    name: str | None  # general.name
    n_layer: int  # block_count
    n_embd: int  # embedding_length
    n_head: int  # attention.head_count (the largest, if given per layer); 0 if absent
    n_head_kv: tuple[int, ...]  # attention.head_count_kv per layer; defaults to head_count
    head_dim_k: int  # attention.key_length, default n_embd // n_head
    head_dim_v: int  # attention.value_length, default n_embd // n_head
    sliding_window: int | None  # attention.sliding_window; None if absent or 0
    swa_layers: tuple[bool, ...]  # per layer: does it use the sliding window? See _swa_layers
    context_length: int  # context_length (training context); 0 if the file does not say
    n_vocab: int
    file_type: str  # quantization as Ollama prints it: "Q4_1", "F16", "Q4_K_M", ...
    parameter_count: int  # elements over all tensors
    layer_bytes: tuple[int, ...]  # tensor data bytes of each block blk.N.*, N < n_layer
    output_bytes: int  # tensor data bytes outside those blocks (token_embd, output, ...)
    # What llama.cpp's output slot holds on the device it goes to: output.weight and the output
    # norm, or with tied embeddings the copy of token_embd it makes there (TENSOR_DUPLICATED).
    head_bytes: int = 0
    pooling_type: int | None = None  # pooling_type (gguf.PoolingType) if present
    chat_template: str | None = None  # tokenizer.chat_template
    capabilities: tuple[str, ...] = ("completion",)
    # Scalar values and short arrays (as tuples); long arrays are only in array_lengths.
    metadata: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}), hash=False)
    # Length of every array-valued key, parsed or not.
    array_lengths: Mapping[str, int] = field(
        default_factory=lambda: MappingProxyType({}), hash=False
    )
    # Per layer: bytes of its experts (part of layer_bytes); () for a model without experts.
    expert_bytes: tuple[int, ...] = ()
    # A split model (name-00001-of-0000N.gguf, llama.cpp's gguf-split): its other files, whose
    # tensors and bytes are counted here too (`path` is the first, which llama.cpp loads).
    parts: tuple[Path, ...] = ()

    @property
    def files(self) -> tuple[Path, ...]:
        return (self.path, *self.parts)

    @property
    def parameter_size(self) -> str:
        """Ollama's rendering of the parameter count: "134.52M", "1.2B", "7B", "361K"."""
        return _human_number(self.parameter_count)

    @property
    def family(self) -> str:
        return self.architecture

    @property
    def rolls_back(self) -> bool:
        """Whether its KV cache can go back to an earlier token of what it holds (a state
        restored into a slot serves a prompt that leaves it before its end): not with
        sliding-window layers (they hold only the last window) or recurrent ones (one state, at
        the end)."""
        recurrent = any(
            f".{part}." in k for k in self.metadata for part in ("ssm", "wkv", "shortconv")
        )
        return not any(self.swa_layers) and not recurrent

    def details(self) -> dict[str, Any]:
        """Ollama's "details" object, as in /api/tags and /api/show."""
        return {
            "parent_model": "",
            "format": "gguf",
            "family": self.family,
            "families": [self.family],
            "parameter_size": self.parameter_size,
            "quantization_level": self.file_type,
        }

    def model_info(self) -> dict[str, Any]:
        """Ollama's /api/show "model_info" for a non-verbose request: every metadata key, sorted,
        with each array given as [] (Ollama reads no array elements then: its docs' example and
        its servers answer `"tokenizer.ggml.tokens": []`; `verbose` fills them in), and
        general.parameter_count counted from the tensors."""
        out: dict[str, Any] = {
            k: v for k, v in self.metadata.items() if k not in self.array_lengths
        }
        for key in self.array_lengths:
            out[key] = []
        for key in _NOT_IN_MODEL_INFO:
            out.pop(key, None)
        out["general.parameter_count"] = self.parameter_count
        return dict(sorted(out.items()))


def model_capabilities(
    architecture: str,
    pooling_type: int | None,
    causal_attention: bool | None,
    chat_template: str | None = None,
    fim: bool = False,
) -> tuple[str, ...]:
    """What the model can be asked for, in Ollama's words.

    ("rerank",) for a rank-pooling model; ("embedding",) for an encoder architecture, or a
    file that sets {arch}.pooling_type without declaring causal attention (Ollama's own rule
    is "has a pooling_type"; the causal check keeps a generative model whose converter wrote a
    pooling type a completion model, while causal embedding models such as Qwen3-Embedding
    count as embedding models). Otherwise "completion" and "tools" (a template that renders no
    tools gets them from corral: `template_has_tools` tells which way), "thinking" when the
    template knows reasoning (a <think> tag or the enable_thinking / reasoning_content
    variables), and "insert" when the vocabulary names fill-in-the-middle tokens. ("vision"
    comes from a projector, not from this file.)
    """
    if pooling_type == RANK_POOLING:
        return ("rerank",)
    if architecture in EMBEDDING_ARCHITECTURES:
        return ("embedding",)
    if pooling_type is not None and causal_attention is not True:
        return ("embedding",)
    caps = ["completion", "tools"]
    if chat_template and _THINKING_IN_TEMPLATE.search(chat_template):
        caps.append("thinking")
    if fim:
        caps.append("insert")
    return tuple(caps)


@functools.lru_cache(maxsize=256)
def template_has_tools(chat_template: str | None) -> bool:
    """Whether a chat template renders a tools list itself (llama.cpp then shows the model
    the tools and parses its calls; otherwise corral does both). Cached: asked on every
    request with tools, of templates up to tens of kilobytes."""
    return bool(chat_template) and _TOOLS_IN_TEMPLATE.search(chat_template or "") is not None


RANK_POOLING = 4  # llama.cpp's LLAMA_POOLING_TYPE_RANK (gguf.PoolingType.RANK)
# `tools` used inside a Jinja tag or expression, as tool-calling templates do.
_TOOLS_IN_TEMPLATE = re.compile(r"\{[{%][^}]*\btools\b")
_THINKING_IN_TEMPLATE = re.compile(r"<think>|enable_thinking|reasoning_content")


def read_arrays(path: str | Path, keys: Iterable[str]) -> dict[str, list[Any]]:
    """The elements of the metadata arrays `keys` (the tokenizer's, for /api/show verbose):
    ModelInfo keeps only their lengths, since they are large and rarely wanted."""
    fields = GGUFReader(path).fields
    return {k: list(fields[k].contents()) for k in keys if k in fields}


def read_tokens(info: ModelInfo) -> tuple[bytes, ...]:
    """The model's vocabulary, each token's text as bytes (to compare a draft model's with its
    target's, as llama.cpp does); () if the file has none. Not cached: it is read once per
    draft model and runner shape."""
    reader = open_reader(info.path, info.path.stat().st_size)
    return string_array(reader, "tokenizer.ggml.tokens") or ()


def read_model_info(path: str | Path) -> ModelInfo:
    """Read a GGUF file's metadata and tensor table.

    Raises FileNotFoundError if there is no such file, GGUFError if it is not a usable GGUF
    model (and other OSErrors, e.g. PermissionError, as they are).
    """
    p = Path(path).absolute()
    st = p.stat()
    if not stat.S_ISREG(st.st_mode):
        raise GGUFError(f"{p} is not a regular file")
    # The other parts of a split model are part of the cache key: one rewritten is read again.
    others = []
    for q in split_parts(p)[1:]:
        try:
            qs = q.stat()
            others.append((q, qs.st_ino, qs.st_size, qs.st_mtime_ns))
        except OSError:
            others.append((q, 0, -1, 0))  # missing: _read says so
    return _read_cached(p, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, tuple(others))


def split_parts(path: str | Path) -> list[Path]:
    """Every file of a split model, from its first part's name (the first part itself for a
    model in one file, or for a part other than the first)."""
    p = Path(path)
    m = SPLIT_RE.match(p.name)
    if m is None or int(m.group("no")) != 1:
        return [p]
    count = int(m.group("count"))
    width = len(m.group("no"))
    return [
        p.with_name(f"{m.group('prefix')}-{i:0{width}d}-of-{m.group('count')}.gguf")
        for i in range(1, count + 1)
    ]


def is_later_split_part(path: str | Path) -> bool:
    """A split model's second or later file (served through the first)."""
    m = SPLIT_RE.match(Path(path).name)
    return m is not None and int(m.group("no")) > 1


def clear_cache() -> None:
    """Forget every file read so far (tests; or after files were rewritten within one mtime
    tick)."""
    _read_cached.cache_clear()
    _projector_cached.cache_clear()
    _adapter_cached.cache_clear()


@functools.lru_cache(maxsize=256)
def _read_cached(
    path: Path, dev: int, ino: int, size: int, mtime_ns: int, others: tuple[Any, ...] = ()
) -> ModelInfo:
    # dev/ino/size/mtime are only the cache key: a replaced or rewritten file is read again.
    return _read(path, size, [(o[0], o[2]) for o in others])


# --- parts of a model: projectors and adapters -------------------------------------------------


@dataclass(frozen=True)
class ProjectorInfo:
    """A vision projector (llama.cpp's mmproj GGUF, architecture `clip`): the image encoder
    that turns an image into embeddings for the text model. Keys are `clip.vision.*`."""

    path: Path
    file_size: int
    projector_type: str  # clip.projector_type: "mlp" (LLaVA), "gemma3", "idefics3", ...
    n_embd: int  # embedding_length of the vision encoder
    n_ff: int  # feed_forward_length
    n_layer: int  # block_count
    n_head: int  # attention.head_count
    image_size: int  # image_size: the side of the (warm-up) image in pixels
    patch_size: int  # patch_size: the side of one patch in pixels
    weights: int  # tensor data bytes (what llama.cpp loads into one buffer)
    n_tensors: int
    metadata: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}), hash=False)


@dataclass(frozen=True)
class AdapterInfo:
    """A LoRA adapter GGUF (general.type = adapter, adapter.type = lora): pairs of tensors
    `<base tensor>.lora_a` / `.lora_b`, loaded beside the base tensors they change."""

    path: Path
    file_size: int
    architecture: str  # must be the base model's
    alpha: float  # adapter.lora.alpha (0: scale by the user's scale alone)
    # tensor bytes per block N (blk.N.*), only the blocks it changes
    layer_bytes: Mapping[int, int] = field(hash=False)
    other_bytes: int  # tensor bytes outside the blocks (token_embd, output)
    n_tensors: int

    @property
    def weights(self) -> int:
        return sum(self.layer_bytes.values()) + self.other_bytes


def read_projector_info(path: str | Path) -> ProjectorInfo:
    """Read a projector (mmproj) GGUF's metadata and tensor table; GGUFError if it is not one
    (or broken), FileNotFoundError if it is missing."""
    p, st = _stat(path)
    return _projector_cached(p, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def read_adapter_info(path: str | Path) -> AdapterInfo:
    """Read a LoRA adapter GGUF's metadata and tensor table; GGUFError if it is not one (or
    broken), FileNotFoundError if it is missing."""
    p, st = _stat(path)
    return _adapter_cached(p, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def check_adapter(info: ModelInfo, adapter: AdapterInfo) -> None:
    """GGUFError unless llama.cpp can apply `adapter` to this model (it refuses an adapter
    made for another architecture, and one for a block the model does not have)."""
    if adapter.architecture != info.architecture:
        raise GGUFError(
            f"adapter {adapter.path.name} is for architecture '{adapter.architecture}', but "
            f"the model is '{info.architecture}'"
        )
    beyond = [n for n in adapter.layer_bytes if n >= info.n_layer]
    if beyond:
        raise GGUFError(
            f"adapter {adapter.path.name} changes block {max(beyond)}, but the model has "
            f"{info.n_layer} blocks"
        )


def read_parts(
    info: ModelInfo, projector: str | Path | None, adapters: Iterable[Any]
) -> tuple[ProjectorInfo | None, tuple[AdapterInfo, ...]]:
    """A model's projector and LoRA adapters (each with a `path`) as read from their files,
    each adapter checked against the model; GGUFError naming the part that is missing or
    unusable."""
    what = "projector"
    try:
        proj = read_projector_info(projector) if projector else None
        out = []
        for a in adapters:
            what = f"adapter {a.path}"
            out.append(read_adapter_info(a.path))
            check_adapter(info, out[-1])
    except OSError as e:
        raise GGUFError(f"its {what} is missing ({e})") from None
    except GGUFError as e:
        raise GGUFError(f"its {what}: {e}") from None
    return proj, tuple(out)


def _stat(path: str | Path) -> tuple[Path, Any]:
    p = Path(path).absolute()
    st = p.stat()
    if not stat.S_ISREG(st.st_mode):
        raise GGUFError(f"{p} is not a regular file")
    return p, st


@functools.lru_cache(maxsize=64)
def _projector_cached(path: Path, dev: int, ino: int, size: int, mtime_ns: int) -> ProjectorInfo:
    reader = open_reader(path, size)
    meta, _ = metadata(reader.fields.items())
    arch = meta.get("general.architecture")
    if arch != "clip":
        raise GGUFError(
            f"not a projector (mmproj) file: its general.architecture is {arch!r}, not 'clip'"
        )
    if meta.get("clip.has_vision_encoder") is not True:
        raise GGUFError("the projector has no vision encoder (clip.has_vision_encoder)")
    kind = meta.get("clip.projector_type") or meta.get("clip.vision.projector_type")

    def num(key: str, required: bool = True) -> int:
        value = _int(meta, f"clip.vision.{key}")
        if value is None and required:
            raise GGUFError(f"missing required metadata key 'clip.vision.{key}'")
        return value or 0

    return ProjectorInfo(
        path=path,
        file_size=size,
        projector_type=kind if isinstance(kind, str) else "unknown",
        n_embd=num("embedding_length"),
        n_ff=num("feed_forward_length", False),
        n_layer=num("block_count"),
        n_head=num("attention.head_count", False),
        image_size=num("image_size", False),
        patch_size=num("patch_size"),
        weights=sum(int(t.n_bytes) for t in reader.tensors),
        n_tensors=len(reader.tensors),
        metadata=MappingProxyType(meta),
    )


@functools.lru_cache(maxsize=64)
def _adapter_cached(path: Path, dev: int, ino: int, size: int, mtime_ns: int) -> AdapterInfo:
    reader = open_reader(path, size)
    meta, _ = metadata(reader.fields.items())
    if meta.get("general.type") != "adapter":
        raise GGUFError(
            f"not an adapter: its general.type is {meta.get('general.type')!r}, not 'adapter'"
        )
    if meta.get("adapter.type") != "lora":
        raise GGUFError(f"unsupported adapter type {meta.get('adapter.type')!r} (only 'lora')")
    arch = meta.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise GGUFError("missing required metadata key 'general.architecture'")
    layers: dict[int, int] = {}
    other = 0
    for t in reader.tensors:
        if not t.name.endswith((".lora_a", ".lora_b")):
            raise GGUFError(f"tensor {t.name!r} is not a LoRA tensor (.lora_a or .lora_b)")
        m = _BLOCK_RE.match(t.name)
        if m:
            n = int(m.group(1))
            layers[n] = layers.get(n, 0) + int(t.n_bytes)
        else:
            other += int(t.n_bytes)
    alpha = meta.get("adapter.lora.alpha", 0.0)
    return AdapterInfo(
        path=path,
        file_size=size,
        architecture=arch,
        alpha=float(alpha) if isinstance(alpha, (int, float)) else 0.0,
        layer_bytes=MappingProxyType(dict(sorted(layers.items()))),
        other_bytes=other,
        n_tensors=len(reader.tensors),
    )


def _read(path: Path, size: int, others: list[tuple[Path, int]] | None = None) -> ModelInfo:
    reader = open_reader(path, size)
    tensors = list(reader.tensors)
    count_field = reader.fields.get("split.count")
    count = int(scalar_value(count_field)) if count_field is not None else 1
    parts: list[Path] = []
    if count > 1:
        # llama.cpp loads every part given the first; the tensors and bytes are all of them.
        others = others if others is not None else [(q, q.stat().st_size if q.exists() else -1)
                                                    for q in split_parts(path)[1:]]  # fmt: skip
        if len(others) != count - 1:
            raise GGUFError(
                f"a split model in {count} files must be named like name-00001-of-"
                f"{count:05d}.gguf (llama.cpp finds the other parts by name)"
            )
        for q, qsize in others:
            if qsize < 0:
                raise GGUFError(f"part {q.name} of this split model is missing")
            try:
                tensors += open_reader(q, qsize).tensors
            except GGUFError as e:
                raise GGUFError(f"part {q.name} of this split model: {e}") from None
            size += qsize
            parts.append(q)
    info = _model_info(path, size, reader.fields.items(), tensors)
    return dataclasses.replace(info, parts=tuple(parts)) if parts else info


def _model_info(
    path: Path,
    size: int,
    fields: Iterable[tuple[str, ReaderField]],
    tensors: list[ReaderTensor],
) -> ModelInfo:
    meta, array_lengths = metadata(fields)

    arch = meta.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise GGUFError("missing required metadata key 'general.architecture'")
    by_name = {t.name: t for t in tensors}
    token_embd = by_name.get("token_embd.weight")

    n_layer = _int(meta, f"{arch}.block_count")
    if n_layer is None:
        raise GGUFError(f"missing required metadata key '{arch}.block_count'")
    if not 0 < n_layer <= _MAX_LAYERS:
        raise GGUFError(f"implausible metadata: '{arch}.block_count' is {n_layer}")
    n_embd = _int(meta, f"{arch}.embedding_length")
    if n_embd is None:
        if token_embd is None:
            raise GGUFError(f"missing required metadata key '{arch}.embedding_length'")
        n_embd = int(token_embd.shape[0])

    head_counts = _per_layer(meta, array_lengths, f"{arch}.attention.head_count", n_layer)
    n_head = max(head_counts, default=0)
    n_head_kv = (
        _per_layer(meta, array_lengths, f"{arch}.attention.head_count_kv", n_layer)
        or head_counts
        or (0,) * n_layer
    )
    head_dim = n_embd // n_head if n_head else 0
    sliding_window = _int(meta, f"{arch}.attention.sliding_window") or None

    n_vocab = _int(meta, f"{arch}.vocab_size")
    if n_vocab is None:
        if "tokenizer.ggml.tokens" in array_lengths:
            n_vocab = array_lengths["tokenizer.ggml.tokens"]
        else:
            n_vocab = int(token_embd.shape[1]) if token_embd is not None else 0

    layer_bytes = [0] * n_layer
    expert_bytes = [0] * n_layer
    output_bytes = 0
    for t in tensors:
        m = _BLOCK_RE.match(t.name)
        if m and int(m.group(1)) < n_layer:
            layer_bytes[int(m.group(1))] += int(t.n_bytes)
            if _EXPERT_RE.match(t.name):
                expert_bytes[int(m.group(1))] += int(t.n_bytes)
        else:  # includes blocks past block_count, which llama.cpp would not load as layers
            output_bytes += int(t.n_bytes)
    head = by_name.get("output.weight") or token_embd
    norm = by_name.get("output_norm.weight")
    head_bytes = sum(int(t.n_bytes) for t in (head, norm) if t is not None)

    pooling_type = _int(meta, f"{arch}.pooling_type")
    causal = meta.get(f"{arch}.attention.causal")
    chat_template = meta.get("tokenizer.chat_template")
    name = meta.get("general.name")
    return ModelInfo(
        path=path,
        file_size=size,
        architecture=arch,
        name=name if isinstance(name, str) else None,
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim_k=_int(meta, f"{arch}.attention.key_length") or head_dim,
        head_dim_v=_int(meta, f"{arch}.attention.value_length") or head_dim,
        sliding_window=sliding_window,
        swa_layers=_swa_layers(
            arch, n_layer, sliding_window, meta.get(f"{arch}.attention.sliding_window_pattern")
        ),
        context_length=_int(meta, f"{arch}.context_length") or 0,
        n_vocab=n_vocab,
        file_type=_file_type(meta.get("general.file_type"), tensors),
        parameter_count=sum(int(t.n_elements) for t in tensors),
        layer_bytes=tuple(layer_bytes),
        output_bytes=output_bytes,
        head_bytes=head_bytes,
        pooling_type=pooling_type,
        chat_template=chat_template if isinstance(chat_template, str) else None,
        capabilities=model_capabilities(
            arch,
            pooling_type,
            causal if isinstance(causal, bool) else None,
            chat_template if isinstance(chat_template, str) else None,
            fim="tokenizer.ggml.fim_pre_token_id" in meta
            and "tokenizer.ggml.fim_suf_token_id" in meta,
        ),
        metadata=MappingProxyType(meta),
        array_lengths=MappingProxyType(array_lengths),
        expert_bytes=tuple(expert_bytes) if any(expert_bytes) else (),
    )


def _int(meta: Mapping[str, Any], key: str) -> int | None:
    value = meta.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise GGUFError(f"metadata key {key!r} should be an integer, not {value!r}")
    return value


def _per_layer(
    meta: Mapping[str, Any], array_lengths: Mapping[str, int], key: str, n_layer: int
) -> tuple[int, ...]:
    """A value the file may give once or once per layer; () if absent."""
    if key in array_lengths:
        values = meta.get(key)
        if values is None or len(values) != n_layer:
            raise GGUFError(
                f"metadata key {key!r} has {array_lengths[key]} entries but the model has "
                f"{n_layer} layers"
            )
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            raise GGUFError(f"metadata key {key!r} should hold integers")
        return tuple(values)
    value = _int(meta, key)
    return () if value is None else (value,) * n_layer


def _swa_layers(
    arch: str, n_layer: int, sliding_window: int | None, pattern: Any
) -> tuple[bool, ...]:
    """Which layers attend through the sliding window, as llama.cpp decides it.

    No sliding window: none. Otherwise {arch}.attention.sliding_window_pattern, which is either
    a bool per layer or a period n (every n-th layer is full attention, the rest slide; n == 0:
    all slide). Without that key, the period llama.cpp hard-codes for a few architectures
    (gemma2/3, cohere2, gpt-oss), else none: memory estimates then assume full attention,
    which errs on the large side.
    """
    if not sliding_window:
        return (False,) * n_layer
    if isinstance(pattern, tuple):
        if len(pattern) != n_layer:
            raise GGUFError(
                f"metadata key '{arch}.attention.sliding_window_pattern' has {len(pattern)} "
                f"entries but the model has {n_layer} layers"
            )
        return tuple(bool(v) for v in pattern)
    period = pattern if isinstance(pattern, int) else _BUILTIN_SWA_PATTERN.get(arch)
    if period is None:
        return (False,) * n_layer
    return tuple(period == 0 or il % period < period - 1 for il in range(n_layer))


def _file_type(value: Any, tensors: list[ReaderTensor]) -> str:
    """general.file_type's name without the MOSTLY_/ALL_ prefix ("Q4_K_M", "F16"), or else the
    type holding most elements among the weight matrices (1-D norms stay F32 in every
    quantization, so they do not count)."""
    if isinstance(value, int) and not isinstance(value, bool):
        try:
            name = LlamaFileType(value & ~LlamaFileType.GUESSED).name
        except ValueError:
            pass
        else:
            return name.removeprefix("MOSTLY_").removeprefix("ALL_")
    counts: Counter[str] = Counter()
    for t in tensors:
        if len(t.shape) > 1:
            counts[t.tensor_type.name] += int(t.n_elements)
    if not counts:
        for t in tensors:
            counts[t.tensor_type.name] += int(t.n_elements)
    return counts.most_common(1)[0][0] if counts else "unknown"


def _human_number(n: int) -> str:
    """Ollama's format.HumanNumber."""
    for scale, suffix, decimals in ((10**9, "B", 1), (10**6, "M", 2)):
        if n >= scale:
            value = n / scale
            return f"{value:.0f}{suffix}" if value.is_integer() else f"{value:.{decimals}f}{suffix}"
    if n >= 1000:
        return f"{n / 1000:.0f}K"
    return str(n)
