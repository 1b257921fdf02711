"""What llama.cpp really allocated for a runner, read from its load log (pure).

llama.cpp prints every backend buffer it allocates while loading a model, one line each:

    load_tensors:   CPU_Mapped model buffer size =     1.14 MiB
    llama_context:        CPU  output buffer size =     0.03 MiB
    llama_kv_cache:        CPU KV buffer size =     0.12 MiB
    sched_reserve:        CPU compute buffer size =     1.64 MiB

(model weights per buffer type, the logits/embeddings output buffer, the KV cache, possibly
twice for models with sliding-window layers, and the graph's compute buffer per backend). Their
sum is what the model holds. A graph reserved again (after LoRA adapters are applied) reuses its
buffer, so a compute buffer counts once per function and device, at its largest. LoRA adapters
log a `LoRA buffer` (weights), and a vision projector (clip) its weights as `load_hparams: model
size: N MiB` on the backend named by `clip_ctx: CLIP using X backend`, and its graph as
`reserve_compute_meta: X compute buffer size`. These are LLAMA_LOG_INFO lines, which
llama.cpp's common logger maps to verbosity 4 ("trace"), one above the default; runner_child
raises the verbosity for the load only. The per-cache summary `llama_kv_cache: size = ...`
restates the KV buffer line and is not counted again. A draft model (speculative decoding)
logs its own buffers after `loading draft model`: its compute buffer is a new one.

`AllocationParser` is fed the runner's log line by line; `Allocation` is the result, bytes per
kind and per device ("CPU", "CUDA0", ...). Weights mapped from the file (CPU_Mapped) count as
CPU memory: the pages are the model's, whether or not the kernel has read them in yet.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

__all__ = ["LOADED_MARKER", "Allocation", "AllocationParser", "device_of", "parse_line"]

# runner_child prints this on stderr once llama.cpp's load log is flushed, right before READY.
LOADED_MARKER = "corral-runner: load log complete"

KINDS = ("model", "kv", "compute", "output")
# What llama.cpp logs before it loads a draft model (common/speculative.cpp), whose buffers
# follow the target's in the same words
DRAFT_MARKER = "loading draft model"
_MIB = 1024 * 1024

# `%12s model buffer size = %8.2f MiB`, `%10s KV buffer size`, `%10s compute buffer size`,
# `%10s  output buffer size`; recurrent models (mamba, rwkv) have an `RS buffer` instead of KV.
_BUFFER_RE = re.compile(
    r"\b(?P<func>[A-Za-z_]\w*):\s+(?P<buf>\S+)\s+(?P<kind>model|KV|RS|compute|output|LoRA)"
    r" buffer size\s*=\s*(?P<mib>[0-9]+(?:\.[0-9]+)?) MiB"
)
_KIND = {"model": "model", "KV": "kv", "RS": "kv", "compute": "compute", "output": "output",
         "LoRA": "model"}  # fmt: skip
_CLIP_BACKEND_RE = re.compile(r"\bclip_ctx: CLIP using (?P<buf>\S+) backend")
_CLIP_WEIGHTS_RE = re.compile(r"\bload_hparams: model size:\s+(?P<mib>[0-9]+(?:\.[0-9]+)?) MiB")
# Buffer-type suffixes that live in host memory (mmap of the file, repacked weights, pinned
# host buffers of a GPU backend, ...) and device suffixes that do not change the device.
_HOST_SUFFIXES = ("_Mapped", "_REPACK", "_Host", "_host", "_AMX", "_KLEIDIAI", "_Extra")
_HOST_EXACT = {"CPU", "CUDA_Host", "Vulkan_Host", "ROCm_Host", "SYCL_Host", "CANN_Host"}


def device_of(buffer_name: str) -> str:
    """The device a llama.cpp buffer (type) name lives on: "CPU_Mapped" -> "CPU",
    "CUDA_Host" -> "CPU" (pinned host memory), "CUDA0" -> "CUDA0", "CUDA0_Split" -> "CUDA0"."""
    name = buffer_name
    if name in _HOST_EXACT or name.startswith("CPU"):
        return "CPU"
    for suffix in _HOST_SUFFIXES:
        if name.endswith(suffix):
            return "CPU"
    if name.endswith("_Split"):
        return name[: -len("_Split")]
    return name


def _frozen(d: Mapping[str, int] | None = None) -> Mapping[str, int]:
    return MappingProxyType(dict(d or {}))


@dataclass(frozen=True)
class Allocation:
    """Bytes llama.cpp allocated, by kind, each a mapping device -> bytes."""

    model: Mapping[str, int] = field(default_factory=_frozen)
    kv: Mapping[str, int] = field(default_factory=_frozen)
    compute: Mapping[str, int] = field(default_factory=_frozen)
    output: Mapping[str, int] = field(default_factory=_frozen)

    @property
    def model_bytes(self) -> int:
        return sum(self.model.values())

    @property
    def kv_bytes(self) -> int:
        return sum(self.kv.values())

    @property
    def compute_bytes(self) -> int:
        return sum(self.compute.values())

    @property
    def output_bytes(self) -> int:
        return sum(self.output.values())

    @property
    def total(self) -> int:
        return self.model_bytes + self.kv_bytes + self.compute_bytes + self.output_bytes

    def booked(self, known: Collection[str], gpus: Sequence[str] | None = None) -> dict[str, int]:
        """Bytes per corral device id ("cpu", "cuda:0", ...); devices corral does not know
        (e.g. a host-pinned buffer type) count as system memory. `gpus`: the GPUs the runner
        was shown, in its order (its CUDA0 is the first of them), where it was shown only
        some."""
        out: dict[str, int] = {}
        for name, n in self.by_device().items():
            dev = device_id(name)
            if gpus is not None and dev != "cpu" and ":" in dev:
                i = int(dev.rsplit(":", 1)[1])
                dev = gpus[i] if i < len(gpus) else dev
            dev = dev if dev in known else "cpu"
            out[dev] = out.get(dev, 0) + n
        return out

    def by_device(self) -> dict[str, int]:
        """Total bytes per device, e.g. {"CPU": ..., "CUDA0": ...}."""
        out: dict[str, int] = {}
        for kind in KINDS:
            for dev, n in getattr(self, kind).items():
                out[dev] = out.get(dev, 0) + n
        return out


@dataclass
class _State:
    sizes: dict[str, dict[str, int]] = field(default_factory=lambda: {k: {} for k in KINDS})
    # (function, device) -> bytes of each compute buffer, the largest it was reserved at
    compute: dict[tuple[str, str], int] = field(default_factory=dict)
    clip_device: str = "CPU"
    seen: bool = False
    done: bool = False


def parse_line(state: _State, line: str) -> bool:
    """Fold one log line into `state`; True if it was a buffer line. Lines after the
    LOADED_MARKER are not the load's and change nothing."""
    if state.done:
        return False
    if LOADED_MARKER in line:
        state.done = True
        return False
    if "buffer size" not in line:  # cheap reject: nearly every line
        if DRAFT_MARKER in line:  # a second model and context: its compute buffers are new
            state.compute.clear()
        elif "clip_ctx" in line and (c := _CLIP_BACKEND_RE.search(line)):
            state.clip_device = device_of(c["buf"])
        elif "model size:" in line and (c := _CLIP_WEIGHTS_RE.search(line)):
            _add(state, "model", state.clip_device, round(float(c["mib"]) * _MIB))
            return True
        return False
    m = _BUFFER_RE.search(line)
    if m is None:
        return False
    kind = _KIND[m["kind"]]
    dev = device_of(m["buf"])
    n = round(float(m["mib"]) * _MIB)
    if kind == "compute":  # reserved again: the same buffer, grown or not
        key = (m["func"], dev)
        old = state.compute.get(key, 0)
        state.compute[key] = max(old, n)
        n = max(0, n - old)
    _add(state, kind, dev, n)
    return True


def _add(state: _State, kind: str, dev: str, n: int) -> None:
    per_dev = state.sizes[kind]
    per_dev[dev] = per_dev.get(dev, 0) + n
    state.seen = True


class AllocationParser:
    """Feed a runner's log lines; `allocation` is None until a buffer line was seen. `done`
    turns true on runner_child's LOADED_MARKER (everything llama.cpp logged while loading has
    been read by then)."""

    def __init__(self) -> None:
        self._state = _State()

    def feed(self, line: str) -> bool:
        return parse_line(self._state, line)

    @property
    def done(self) -> bool:
        return self._state.done

    @property
    def allocation(self) -> Allocation | None:
        s = self._state
        if not s.seen:
            return None
        return Allocation(**{k: _frozen(v) for k, v in s.sizes.items()})


def device_id(name: str) -> str:
    """llama.cpp's backend device name ("CPU", "CUDA0", "ROCm1") as a corral device id."""
    m = re.fullmatch(r"(CUDA|ROCm|HIP|Vulkan|Metal|SYCL)(\d+)", name)
    if m is None:
        return "cpu" if name.upper().startswith("CPU") else name.lower()
    lib = {"CUDA": "cuda", "ROCm": "rocm", "HIP": "rocm"}.get(m.group(1), m.group(1).lower())
    return f"{lib}:{m.group(2)}"
