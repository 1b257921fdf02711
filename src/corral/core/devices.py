"""The memory corral may place models in, as plain data: devices and budgets.

Discovery (psutil, NVML, amdsmi) is the shell's (`corral.runtime.devices`); everything here is
pure. Budgets (how much corral may book per device) come from `budgets()`; `live_headroom()`
computes what a device really has free right now, so that other programs' use is respected.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

CPU = "cpu"  # the id of system memory in device lists, budgets and bookings

# What a runner process holds on each GPU it uses beyond llama.cpp's buffers: the CUDA (or HIP)
# context, cuBLAS workspaces. It scales with the GPU's SM count (llama.cpp #20595, #23604:
# 107 MiB on an RTX 4060 Ti, 555 MiB on an RTX PRO 6000); this is Ollama's allowance
# (cudaMinimumMemory). Booked with every load; NVML's per-process figure then corrects it
# upwards where a GPU needs more.
GPU_CONTEXT_BYTES = 457 * 2**20
# On one NVIDIA H200 (driver 580, CUDA 13, llama.cpp b11434) a runner held 693 MiB beyond its
# buffers with a 1 GB model and up to 1,157 MiB with an 8 GB one: large cards get more before
# their first runner is measured (about 1/112 of the card, at most 1.25 GiB); from then on the
# figure measured on that card (`gpu_context`).
GPU_CONTEXT_SHARE = 112
GPU_CONTEXT_MAX = 5 * 2**28
# System memory a runner holds for its GPUs beyond llama.cpp's buffers and its own process (the
# CUDA runtime's host allocations, pinned staging buffers): 150-505 MiB on the H200.
GPU_HOST_BYTES = 512 * 2**20


@dataclass(frozen=True)
class Device:
    id: str  # "cpu", "cuda:0", "rocm:1": the key of budgets and bookings
    library: str  # "cpu", "cuda" or "rocm"
    index: int  # the runtime's device index; -1 for the CPU
    name: str
    total: int  # bytes
    free: int  # bytes free now, as the driver (or the kernel) reports it
    # False where the free figure cannot be trusted: unified-memory GPUs (NVML reports no
    # memory of their own; system memory stands in), or a read that failed.
    free_reliable: bool = True
    compute_capability: str | None = None  # "9.0" (CUDA); the gfx target for AMD ("gfx90a")
    uuid: str | None = None  # the driver's stable id; refresh() re-reads only devices with one


@dataclass(frozen=True)
class Memory:
    """A device's memory as the operator reads it: what corral's runners hold, what other
    programs hold, what is free (bytes)."""

    total: int
    ours: int
    others: int
    free: int

    def describe(self) -> str:
        return (
            f"{_gib(self.total)} total, {_gib(self.ours)} held by corral, "
            f"{_gib(self.others)} by other programs, {_gib(self.free)} free"
        )


def device_memory(d: Device, ours: int) -> Memory:
    """`d`'s memory given what corral's runners hold there (`ours`, as measured): the rest of
    what is in use belongs to others."""
    used = max(0, d.total - d.free)
    return Memory(d.total, min(ours, used), max(0, used - ours), d.free)


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def budgets(devices: Iterable[Device], margin: int, limit: int | None = None) -> dict[str, int]:
    """Bytes corral's runners may book on each device: total - margin, capped by limit
    (CORRAL_MEMORY_LIMIT, "the most that corral's models may use on any one device"); never
    negative.

    For the CPU this is system memory (or the cgroup limit) less the margin, on purpose not the
    memory available at start-up: that would shrink the budget by whatever the page cache held
    then. The OS and other processes use memory too: the margin covers them, and before each
    load the scheduler also checks `live_headroom()`, what they really leave free.
    """
    out = {}
    for d in devices:
        b = d.total - margin
        if limit is not None:
            b = min(b, limit)
        out[d.id] = max(0, b)
    return out


def live_headroom(
    device: Device, booked_by_us: int, *, in_use_by_us: int | None = None, margin: int = 0
) -> int:
    """The most corral's runners may have booked on this device in all, given what other
    processes use right now: free + what our own runners already hold, less the margin.

    The scheduler keeps `booked + new <= min(budget, live_headroom(...))` for every load
    (Core.headroom). The device's free
    figure leaves out what our runners hold (they are using it), so that is added back; the
    rest of its used memory belongs to others (another CUDA program, the desktop, the page
    cache a database pins) and is not ours to take.

    What our runners hold is `in_use_by_us` when measured (runner RSS, NVML's per-process
    memory), else assumed to be what they booked, which holds once they are loaded. Only the
    smaller of booked and in use is added back: a runner still loading has booked memory it
    has not allocated yet (the free figure still counts it, so adding it back would let a
    second load take it too), and one that allocated more than booked really has it.

    For the CPU, pass our runners' anonymous memory (RssAnon: KV cache, buffers) as
    `in_use_by_us`: weights llama.cpp maps from the file are page cache, which the kernel's
    "available" figure already counts as free, so booking them again would count them twice.

    Where the free figure is unreliable (`free_reliable` false) there is no live check: the
    device's total is returned and the budget alone applies.
    """
    if not device.free_reliable:
        return device.total
    held = booked_by_us if in_use_by_us is None else min(booked_by_us, in_use_by_us)
    return max(0, device.free + held - margin)


def gpu_context(device: Device, learned: Mapping[str, int]) -> int:
    """What a runner holds on `device` beyond llama.cpp's buffers: the figure measured on a
    card of its name (`learned`, the most measured there), else the allowance for its size."""
    if device.name in learned:
        return learned[device.name]
    return max(GPU_CONTEXT_BYTES, min(GPU_CONTEXT_MAX, device.total // GPU_CONTEXT_SHARE))
