"""What shapes a runner process, as plain data: the scheduler core compares specs, the shell
starts runners from them."""

from __future__ import annotations

from dataclasses import dataclass


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


@dataclass(frozen=True)
class Layout:
    """Where placement put the model: how the runner must be started to match the books."""

    n_gpu_layers: int = 0
    tensor_split: tuple[float, ...] | None = None  # per visible GPU
    main_gpu: int | None = None  # index among the visible GPUs
    env: tuple[tuple[str, str], ...] = ()  # e.g. CUDA_VISIBLE_DEVICES: only the GPUs booked
