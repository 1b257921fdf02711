"""Which devices the runner build can use: asked of the build itself, never assumed.

A llama-server binary answers `--list-devices` (llama.cpp's `common_print_available_devices`:
every backend device that is not the CPU, as `  CUDA0: NVIDIA H200 (143771 MiB, 142500 MiB free)`,
or `  (none)`); xllamacpp (the default runner) answers `get_device_info()`, asked in a child
process because importing it loads llama.cpp's backends, which may be slow or crash. A CPU-only
build lists no GPU, and corral must then not book a GPU for it: the model would run in system
memory while the GPU's books say otherwise (issue 28: the CPU xllamacpp wheel on an H200).

`runner_devices()` never raises: a probe that fails gives `known=False`, which is not the same as
a build that can use no GPU. `gpu_advice()` is pure: the operator's message when GPUs are present
that the runner cannot use.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from corral.core.devices import CPU, Device

MIB = 2**20
GIB = 2**30
# A CUDA build may take seconds to initialise its devices (driver load, a large card).
PROBE_TIMEOUT = 60.0

# ggml's backend device names: "<backend name><index>" (GGML_CUDA_NAME is "ROCm" in a HIP build).
_LIBRARIES = {"cuda": "cuda", "rocm": "rocm", "vulkan": "vulkan", "musa": "musa", "sycl": "sycl"}
BACKEND_NAMES = {"cuda": "CUDA", "rocm": "ROCm", "vulkan": "Vulkan", "cpu": "CPU"}
_NAME = re.compile(r"^([A-Za-z]+)(\d*)$")
_LINE = re.compile(r"^\s+(\S+): (.*) \((\d+) MiB, (\d+) MiB free\)\s*$")

# One CUDA build of llama-server (b11434, one architecture) took 238 s with 16 cores (issue 28).
CUDA_BUILD_CORE_SECONDS = 238 * 16


@dataclass(frozen=True)
class RunnerDevice:
    name: str  # the backend's name for it: "CUDA0", "ROCm1", "Vulkan0"
    library: str | None  # "cuda", "rocm", "vulkan", ...; None for one corral does not know
    index: int | None  # the backend's index ("CUDA0" -> 0)
    description: str  # "NVIDIA H200"
    total: int  # bytes
    free: int  # bytes


@dataclass(frozen=True)
class RunnerDevices:
    """What a runner build can use. `known` False: the probe failed (`error` says why) and
    nothing is known; True with no `libraries`: a CPU-only build."""

    known: bool
    devices: tuple[RunnerDevice, ...] = ()
    error: str | None = None
    source: str = ""  # what was asked: "llama-server --list-devices", "xllamacpp"
    libraries: frozenset[str] = field(init=False)  # GPU libraries: "cuda", "rocm", "vulkan"

    def __post_init__(self) -> None:
        libs = frozenset(d.library for d in self.devices if d.library is not None)
        object.__setattr__(self, "libraries", libs)

    @property
    def cpu_only(self) -> bool:
        return self.known and not self.libraries

    def can_use(self, library: str) -> bool | None:
        """Whether the build can use devices of `library` ("cpu" always); None: unknown."""
        if library == CPU:
            return True
        return library in self.libraries if self.known else None


def device_library(name: str) -> tuple[str | None, int | None]:
    """(library, index) of a ggml device name: "CUDA0" -> ("cuda", 0); (None, None) unknown."""
    m = _NAME.match(name.strip())
    if not m:
        return None, None
    library = _LIBRARIES.get(m.group(1).lower())
    return library, (int(m.group(2)) if m.group(2) and library else None)


def parse_list_devices(text: str) -> list[RunnerDevice] | None:
    """The devices in `llama-server --list-devices` output; None if it is not that output."""
    lines = text.splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == "Available devices:")
    except StopIteration:
        return None
    out = []
    for line in lines[start + 1 :]:
        m = _LINE.match(line)
        if m:
            name, description, total, free = m.groups()
            library, index = device_library(name)
            out.append(
                RunnerDevice(name, library, index, description, int(total) * MIB, int(free) * MIB)
            )
    return out


def parse_device_info(info: Iterable[dict[str, object]]) -> list[RunnerDevice]:
    """The GPUs in xllamacpp's get_device_info() (as the probe prints it): the CPU and
    accelerators (BLAS, AMX) are left out as --list-devices leaves out the CPU."""
    out = []
    for d in info:
        kind = str(d.get("type", "")).upper()
        if not kind.endswith(("_GPU", "_IGPU")) and kind not in ("GPU", "IGPU"):
            continue
        name = str(d.get("name", ""))
        library, index = device_library(name)
        total, free = d.get("memory_total", 0), d.get("memory_free", 0)
        out.append(
            RunnerDevice(
                name, library, index, str(d.get("description", "")),
                int(total) if isinstance(total, int) else 0,
                int(free) if isinstance(free, int) else 0,
            )
        )  # fmt: skip
    return out


# Printed by a child process: the enum's name, not its repr, so the parent needs no xllamacpp.
_XLLAMACPP_PROBE = """
import json, xllamacpp
out = []
for d in xllamacpp.get_device_info():
    t = d.get("type")
    out.append({k: d.get(k) for k in ("name", "description", "memory_total", "memory_free")}
               | {"type": getattr(t, "name", str(t))})
print(json.dumps(out))
"""


def runner_devices(llama_server: str | None, timeout: float = PROBE_TIMEOUT) -> RunnerDevices:
    """The devices the runner build can use: `<llama_server> --list-devices`, or xllamacpp's
    get_device_info() when `llama_server` is None. Never raises; a failure is `known=False`."""
    if llama_server is None:
        cmd, source = [sys.executable, "-c", _XLLAMACPP_PROBE], "xllamacpp"
    else:
        cmd, source = [llama_server, "--list-devices"], f"{llama_server} --list-devices"
    try:
        done = subprocess.run(
            cmd, capture_output=True, text=True, errors="replace", timeout=timeout,
            stdin=subprocess.DEVNULL,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError) as e:  # missing, not executable, timed out
        return RunnerDevices(False, error=f"{source}: {e}", source=source)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or [""])[-1]
        why = f"exited with {done.returncode}" + (f": {last}" if last else "")
        return RunnerDevices(False, error=f"{source} {why}", source=source)
    if llama_server is None:
        try:
            info = json.loads(done.stdout.strip().splitlines()[-1])
            return RunnerDevices(True, tuple(parse_device_info(info)), source=source)
        except (ValueError, IndexError, TypeError, AttributeError) as e:
            return RunnerDevices(False, error=f"{source}: unreadable answer ({e})", source=source)
    found = parse_list_devices(done.stdout)
    if found is None:
        return RunnerDevices(False, error=f"{source}: no device list in its output", source=source)
    return RunnerDevices(True, tuple(found), source=source)


def usable_gpus(gpus: Sequence[Device], can_use: RunnerDevices) -> list[Device]:
    """The GPUs the runner build can use: those of a library it has devices of. A Vulkan build
    counts for none of them: corral places by the CUDA/ROCm index (NVML, amdsmi), which
    Vulkan's own enumeration does not follow. Unknown: all of them (nothing is withheld on a
    guess)."""
    gpus = [g for g in gpus if g.library != CPU]
    if not can_use.known:
        return gpus
    return [g for g in gpus if g.library in can_use.libraries]


def _gpu_list(gpus: Sequence[Device]) -> str:
    """ "NVIDIA H200, 139 GiB", "2x NVIDIA H200, 139 GiB each", or several such, ';'-joined."""
    counts = Counter((g.name, g.total // GIB) for g in gpus)
    parts = []
    for (name, gib), n in counts.items():
        parts.append(f"{name}, {gib} GiB" if n == 1 else f"{n}x {name}, {gib} GiB each")
    return "; ".join(parts)


def build_minutes(cores: int) -> int:
    """About how long `corral runner build cuda` takes with `cores` cores."""
    return max(1, math.ceil(CUDA_BUILD_CORE_SECONDS / max(1, cores) / 60))


def gpu_advice(
    gpus: Sequence[Device], can_use: RunnerDevices, cores: int | None = None
) -> str | None:
    """The operator's message when GPUs are present that the runner build cannot use (None
    when there are none, or when the build's devices are unknown: no advice on a guess).
    `cores`: this machine's, for the build time (CUDA only: that is what was measured)."""
    gpus = [g for g in gpus if g.library != CPU]
    if not gpus or not can_use.known:
        return None
    unused = [g for g in gpus if g not in usable_gpus(gpus, can_use)]
    if not unused:
        return None
    # Build for the library most of the idle GPUs have (the first seen on a tie).
    library = Counter(g.library for g in unused).most_common(1)[0][0]
    backend = library if library in ("cuda", "rocm") else "vulkan"
    runs = "GPU" if len(unused) == 1 else "GPUs"
    if can_use.libraries:
        kind = " and ".join(BACKEND_NAMES.get(lib, lib) for lib in sorted(can_use.libraries))
        build = f"a {kind} build, which cannot use {BACKEND_NAMES.get(library, library)} devices"
    else:
        build = "a CPU build"
    when = ""
    if backend == "cuda" and cores:
        when = f" (about {build_minutes(cores)} min with {cores} cores)"
    return (
        f"{runs} found ({_gpu_list(unused)}) but the runner is {build}: run "
        f"`corral runner build {backend}`{when} or set CORRAL_LLAMA_SERVER to a "
        f"{BACKEND_NAMES[backend]} llama-server"
    )


@dataclass(frozen=True)
class RunnerChoice:
    """What corral serves with: the llama-server binary (None: xllamacpp), the devices it
    books (the GPUs the build can use, and system memory), and what the operator should do."""

    llama_server: str | None
    devices: list[Device]
    advice: tuple[str, ...] = ()


def choose_runner(
    llama_server: str | None,
    devices: Sequence[Device],
    installed: Callable[[set[str]], str | None],
    probe: Callable[[str | None], RunnerDevices] = runner_devices,
    cores: int | None = None,
) -> RunnerChoice:
    """The runner for this machine: CORRAL_LLAMA_SERVER's binary, else the build `corral runner
    build` installed for it (`installed`: for the GPUs present, or a CPU build where there are
    none), else xllamacpp. The build is asked which devices it can use (a start-up cost of a
    second or two; none where nothing is installed on a machine without GPUs): a GPU it cannot
    use is not booked, and an installed CPU build that does not run here (built on another
    machine's CPU) gives way to the wheel."""
    gpus = [d for d in devices if d.library != CPU]
    if not gpus:
        if llama_server is not None:
            return RunnerChoice(llama_server, list(devices))
        build = installed(set())
        if build is None:
            return RunnerChoice(None, list(devices))
        seen = probe(build)
        if seen.known:
            return RunnerChoice(build, list(devices))
        return RunnerChoice(None, list(devices), (
            f"the CPU runner {build} does not run here ({seen.error}); serving with the "
            "xllamacpp wheel: `corral runner build cpu --force` builds it again for this CPU",
        ))  # fmt: skip
    if llama_server is None:
        llama_server = installed({g.library for g in gpus})
    can_use = probe(llama_server)
    usable = usable_gpus(gpus, can_use)
    advice = gpu_advice(gpus, can_use, cores)
    kept = [d for d in devices if d.library == CPU or d in usable]
    return RunnerChoice(llama_server, kept, (advice,) if advice else ())
