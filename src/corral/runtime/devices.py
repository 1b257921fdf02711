"""The memory corral may place models in: system memory and GPUs, with their free bytes.

`discover()` lists the CPU (system memory, within the cgroup's limit when there is one) and the
GPUs the management libraries report: NVIDIA through NVML (`pynvml`, from the optional
`nvidia-ml-py`), AMD through `amdsmi` (shipped with ROCm). Neither library creates a CUDA or HIP
context, so the daemon itself holds no GPU memory. Anything missing or failing (no module, no
driver, an error from the library) just means no GPUs of that kind; discover() never raises.

GPU indices follow the management library's enumeration (PCI bus order for NVML), restricted
and renumbered by CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES as the runtimes do. llama.cpp
numbers CUDA devices in the CUDA runtime's order, which is fastest-first unless
CUDA_DEVICE_ORDER=PCI_BUS_ID: runners must set that (or pick devices by UUID) for an index here
to mean the same GPU there.

The Device type and budgets are pure: `corral.core.devices`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterable, Sequence
from dataclasses import replace
from pathlib import Path
from types import ModuleType
from typing import Any

import psutil

from corral.core.devices import CPU, Device

log = logging.getLogger(__name__)


# ---- discovery ---------------------------------------------------------------------------------


def discover() -> list[Device]:
    """The CPU first, then NVIDIA and AMD GPUs. Fast (no GPU context) and never raises."""
    out = [_cpu_device()]
    for probe in (_nvidia_devices, _amd_devices):
        try:
            out.extend(probe())
        except Exception as e:  # a library misbehaving must not take the daemon down
            log.debug("GPU discovery (%s) failed: %s", probe.__name__, e)
    return out


def refresh(devices: Iterable[Device]) -> list[Device]:
    """The same devices with `free` read again (after a runner exited, to see whether the
    driver has given its memory back). Devices without a uuid (fakes) come back unchanged;
    one whose read fails keeps its old figure, marked unreliable. Never raises."""
    out = []
    for d in devices:
        try:
            if d.library == "cpu" and d.uuid is not None:
                out.append(replace(d, free=_cpu_device().free))
            elif d.library == "cuda" and d.uuid is not None:
                out.append(_nvidia_refresh(d))
            elif d.library == "rocm" and d.uuid is not None:
                out.append(_amd_refresh(d))
            else:
                out.append(d)
        except Exception as e:
            log.debug("could not re-read free memory of %s: %s", d.id, e)
            out.append(replace(d, free_reliable=False))
    return out


# ---- CPU ---------------------------------------------------------------------------------------

_CGROUP_UNLIMITED = 1 << 60  # v1 reports "no limit" as a huge page-aligned number


def cpu_cores() -> int:
    """The cores this process may run on (its affinity mask, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _cpu_device() -> Device:
    vm = psutil.virtual_memory()
    total, free = int(vm.total), int(vm.available)
    try:
        cg = cgroup_memory()
    except Exception as e:  # odd /proc or /sys contents must not stop discovery
        log.debug("cgroup memory limit unreadable: %s", e)
        cg = None
    if cg is not None:  # in a container, the cgroup's limit is what the OOM killer enforces
        limit, available = cg
        total, free = min(total, limit), min(free, available)
    # "host" marks it as the real machine (refresh re-reads it); fakes have no uuid.
    return Device(CPU, "cpu", -1, _cpu_name(), total, free, True, None, "host")


def _cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "CPU"


def cgroup_memory(root: str = "/") -> tuple[int, int] | None:
    """(limit, available) bytes of this process's memory cgroup and its ancestors (v2 or v1),
    or None if there is no limit. Available = limit - usage + inactive file pages, the pages
    the kernel reclaims before it OOM-kills (as container runtimes count a working set)."""
    base = Path(root)
    try:
        lines = (base / "proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    limits: list[tuple[int, int]] = []
    for line in lines:
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        _, controllers, path = fields
        if controllers == "":  # v2: 0::/path
            mount = base / "sys/fs/cgroup"
            files = ("memory.max", "memory.current", "inactive_file")
        elif "memory" in controllers.split(","):
            mount = base / "sys/fs/cgroup/memory"
            files = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
        else:
            continue
        # From the process's own group up to the root: every level's limit applies. Inside a
        # cgroup namespace the path is "/" and the mount is the group itself.
        parts = [p for p in path.strip().split("/") if p]
        for depth in range(len(parts), -1, -1):
            found = _cgroup_level(mount.joinpath(*parts[:depth]), *files)
            if found is not None:
                limits.append(found)
    if not limits:
        return None
    return min(lim for lim, _ in limits), min(avail for _, avail in limits)


def _cgroup_level(
    d: Path, max_file: str, usage_file: str, inactive_key: str
) -> tuple[int, int] | None:
    try:
        text = (d / max_file).read_text().strip()
    except OSError:
        return None
    if not text.isdigit() or int(text) >= _CGROUP_UNLIMITED:  # "max" in v2
        return None
    limit = int(text)
    try:
        usage = int((d / usage_file).read_text().strip())
    except (OSError, ValueError):
        return limit, limit
    inactive = 0
    with contextlib.suppress(OSError, ValueError):
        for line in (d / "memory.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == inactive_key:
                inactive = int(value)
    return limit, max(0, min(limit, limit - usage + inactive))


# ---- NVIDIA (NVML) -----------------------------------------------------------------------------

_nvml_lock = threading.Lock()
_nvml: ModuleType | None = None
_nvml_tried = False


def _nvml_module() -> ModuleType | None:
    """pynvml, initialised once for the life of the process; None without module or driver."""
    global _nvml, _nvml_tried
    with _nvml_lock:
        if not _nvml_tried:
            _nvml_tried = True
            try:
                import pynvml

                pynvml.nvmlInit()
                _nvml = pynvml
            except Exception as e:  # ImportError, NVMLError_LibraryNotFound, DriverNotLoaded
                log.debug("no NVIDIA GPUs: %s", e)
        return _nvml


def _reset_nvml() -> None:
    """Forget the NVML state, so that the next discover() tries again (tests)."""
    global _nvml, _nvml_tried
    with _nvml_lock:
        _nvml, _nvml_tried = None, False


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _nvidia_devices() -> list[Device]:
    nv = _nvml_module()
    if nv is None:
        return []
    try:
        count = nv.nvmlDeviceGetCount()
    except nv.NVMLError as e:
        log.debug("NVML device count failed: %s", e)
        return []
    found = []  # (NVML index, uuid, handle)
    for i in range(count):
        try:
            h = nv.nvmlDeviceGetHandleByIndex(i)
            found.append((i, _text(nv.nvmlDeviceGetUUID(h)), h))
        except nv.NVMLError as e:  # e.g. a GPU that fell off the bus: skip it
            log.debug("NVML device %d unusable: %s", i, e)
    visible = visible_order([(i, u) for i, u, _ in found], os.environ.get("CUDA_VISIBLE_DEVICES"))
    out = []
    for index, pos in enumerate(visible):
        _, uuid, h = found[pos]
        try:
            out.append(_nvidia_device(nv, h, index, uuid))
        except nv.NVMLError as e:  # its index stays taken: CUDA would still number it
            log.debug("NVML device %s unusable: %s", uuid, e)
    return out


def _nvidia_device(nv: ModuleType, h: Any, index: int, uuid: str) -> Device:
    name = "NVIDIA GPU"
    with contextlib.suppress(nv.NVMLError):
        name = _text(nv.nvmlDeviceGetName(h))
    cc = None
    with contextlib.suppress(nv.NVMLError):
        major, minor = nv.nvmlDeviceGetCudaComputeCapability(h)
        cc = f"{major}.{minor}"
    total, free, reliable = _nvidia_memory(nv, h)
    return Device(f"cuda:{index}", "cuda", index, name, total, free, reliable, cc, uuid)


def _nvidia_memory(nv: ModuleType, h: Any) -> tuple[int, int, bool]:
    """(total, free, reliable). Errors other than "not supported" propagate: the caller skips
    the GPU (discover) or keeps its old figures (refresh)."""
    not_supported = getattr(nv, "NVMLError_NotSupported", ())
    try:
        mem = nv.nvmlDeviceGetMemoryInfo(h)
        return int(mem.total), int(mem.free), True
    except not_supported as e:
        # Unified-memory parts (GB10, Jetson) report no memory of their own: the GPU allocates
        # from system memory, so that is its only honest figure.
        log.debug("NVML memory info not supported (%s): using system memory", e)
        vm = psutil.virtual_memory()
        return int(vm.total), int(vm.available), False


def _nvidia_refresh(d: Device) -> Device:
    nv = _nvml_module()
    if nv is None:
        return replace(d, free_reliable=False)
    total, free, reliable = _nvidia_memory(nv, nv.nvmlDeviceGetHandleByUUID(d.uuid))
    return replace(d, total=total, free=free, free_reliable=reliable)


def gpu_process_memory(devices: Iterable[Device]) -> dict[int, dict[str, int]]:
    """GPU memory each process holds (pid -> device id -> bytes) as NVML reports it: its CUDA
    context and every allocation, which llama.cpp's own account leaves out. Empty without
    NVML; a process in another pid namespace (corral in a container) matches no runner.
    Never raises."""
    nv = _nvml_module()
    out: dict[int, dict[str, int]] = {}
    if nv is None:
        return out
    for d in devices:
        if d.library != "cuda" or d.uuid is None:
            continue
        try:
            procs = nv.nvmlDeviceGetComputeRunningProcesses(nv.nvmlDeviceGetHandleByUUID(d.uuid))
        except Exception as e:  # NVMLError, or a binding without the call
            log.debug("NVML processes of %s unreadable: %s", d.id, e)
            continue
        for p in procs:
            used = getattr(p, "usedGpuMemory", None)
            if isinstance(used, int) and used > 0:  # None: not available (e.g. Windows WDDM)
                by_dev = out.setdefault(int(p.pid), {})
                by_dev[d.id] = by_dev.get(d.id, 0) + used
    return out


def visible_order(found: Sequence[tuple[int, str]], env: str | None) -> list[int]:
    """Positions in `found` ((index, uuid) per GPU, in enumeration order) that a
    CUDA_VISIBLE_DEVICES-style value makes visible, in the order the runtime numbers them.

    As CUDA parses it: comma-separated indices or UUIDs (a unique prefix will do); parsing stops
    at the first entry that names no device, so "-1" or "" hides every GPU. Unset: all. MIG
    instances are not supported here: a MIG entry ends the list like any unknown one.
    """
    if env is None:
        return list(range(len(found)))
    out: list[int] = []
    for raw in env.split(","):
        entry = raw.strip()
        if entry.isdigit():
            pos = next((p for p, (i, _) in enumerate(found) if i == int(entry)), None)
        else:
            key = _bare_uuid(entry)
            hits = [p for p, (_, u) in enumerate(found) if key and _bare_uuid(u).startswith(key)]
            pos = hits[0] if len(hits) == 1 else None
        if pos is None or pos in out:
            break
        out.append(pos)
    return out


def _bare_uuid(text: str) -> str:
    """ "GPU-8e1f..." and "8e1f..." name the same device (HIP takes either form)."""
    text = text.strip().lower()
    return text[4:] if text.startswith("gpu-") else text


# ---- AMD (amdsmi) ------------------------------------------------------------------------------

_amd_lock = threading.Lock()
_amd: ModuleType | None = None
_amd_tried = False


def _amd_module() -> ModuleType | None:
    global _amd, _amd_tried
    with _amd_lock:
        if not _amd_tried:
            _amd_tried = True
            try:
                import amdsmi  # type: ignore[import-not-found,unused-ignore]

                amdsmi.amdsmi_init()
                _amd = amdsmi
            except Exception as e:
                log.debug("no AMD GPUs: %s", e)
        return _amd


def _amd_devices() -> list[Device]:
    amd = _amd_module()
    if amd is None:
        return []
    found = []
    for i, h in enumerate(amd.amdsmi_get_processor_handles()):
        try:
            found.append((i, str(amd.amdsmi_get_gpu_device_uuid(h)), h))
        except Exception as e:
            log.debug("amdsmi device %d unusable: %s", i, e)
    env = os.environ.get("HIP_VISIBLE_DEVICES", os.environ.get("ROCR_VISIBLE_DEVICES"))
    out = []
    for index, pos in enumerate(visible_order([(i, u) for i, u, _ in found], env)):
        _, uuid, h = found[pos]
        name, target = "AMD GPU", None
        with contextlib.suppress(Exception):
            asic = amd.amdsmi_get_gpu_asic_info(h)
            name = str(asic.get("market_name") or name)
            target = asic.get("target_graphics_version") or None
        total, free, reliable = _amd_memory(amd, h)
        out.append(Device(f"rocm:{index}", "rocm", index, name, total, free, reliable,
                          str(target) if target else None, uuid))  # fmt: skip
    return out


def _amd_memory(amd: ModuleType, h: Any) -> tuple[int, int, bool]:
    try:
        vram = amd.AmdSmiMemoryType.VRAM
        total = int(amd.amdsmi_get_gpu_memory_total(h, vram))
        used = int(amd.amdsmi_get_gpu_memory_usage(h, vram))
        return total, max(0, total - used), True
    except Exception as e:
        log.debug("amdsmi memory info unavailable (%s): using system memory", e)
        vm = psutil.virtual_memory()
        return int(vm.total), int(vm.available), False


def _amd_refresh(d: Device) -> Device:
    amd = _amd_module()
    if amd is None:
        return replace(d, free_reliable=False)
    for h in amd.amdsmi_get_processor_handles():
        if str(amd.amdsmi_get_gpu_device_uuid(h)) == d.uuid:
            total, free, reliable = _amd_memory(amd, h)
            return replace(d, total=total, free=free, free_reliable=reliable)
    return replace(d, free_reliable=False)
