"""What shapes a runner process, as plain data: the scheduler core compares specs, the shell
starts runners from them."""

from __future__ import annotations

from dataclasses import dataclass

FLASH_ATTN = ("auto", "on", "off")  # llama.cpp's -fa values


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
    n_gpu_layers: int = 0
    main_gpu: int | None = None
    embedding: bool = False
    pooling_type: int | None = None
    threads: int | None = None
    kv_cache_type: str = "f16"  # KV cache type (K and V): f16, q8_0, q4_0, ...
    projector: str | None = None  # the vision projector (mmproj GGUF) loaded with the model
    adapters: tuple[Adapter, ...] = ()  # LoRA adapters, applied in this order
    n_batch: int | None = None  # Ollama's num_batch: llama.cpp's n_batch and n_ubatch
    use_mmap: bool | None = None  # None: llama.cpp decides (mmap where it can)
    use_mlock: bool | None = None
    flash_attn: str = "auto"  # one of FLASH_ATTN
    n_cpu_moe: int = 0  # keep the experts of the first N layers in system memory
    # The chat template the runner renders with instead of the GGUF's (Jinja): a created
    # model's TEMPLATE, translated from Ollama's Go syntax (core.gotemplate)
    chat_template: str | None = None


@dataclass(frozen=True)
class Layout:
    """Where placement put the model: how the runner must be started to match the books."""

    n_gpu_layers: int = 0
    tensor_split: tuple[float, ...] | None = None  # per visible GPU
    main_gpu: int | None = None  # index among the visible GPUs
    env: tuple[tuple[str, str], ...] = ()  # e.g. CUDA_VISIBLE_DEVICES: only the GPUs booked
