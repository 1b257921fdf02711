"""Load progress: what a runner has brought into memory (runtime/loadwatch), llama.cpp's router
stream `GET /models/sse` with its progress events during a real load, and the state document
`corral run` follows."""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import pty
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from corral.runtime.loadwatch import file_bytes, loaded_bytes
from corral.testing import synth

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

MiB = 2**20


def _drop_from_page_cache(path: Path) -> None:
    """Make the next read of `path` come from disk (no root needed: the file's own clean pages)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@contextlib.contextmanager
def _slowed(path: Path, share: float = 0.2) -> Iterator[None]:
    """Run any process with `path` in its command line (the runner) only `share` of the
    time, stopping and continuing it in slices: a load as slow as from a slow disk, whatever
    the machine (a CI machine read the 600 MB model in under a second from its page cache)."""
    done = threading.Event()

    def runners() -> list[int]:
        pids = []
        for d in os.listdir("/proc"):
            if d.isdigit():
                with contextlib.suppress(OSError):
                    with open(f"/proc/{d}/cmdline", "rb") as f:
                        if str(path).encode() in f.read():
                            pids.append(int(d))
        return pids

    def signal_all(pids: list[int], sig: int) -> None:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def throttle() -> None:
        while not done.is_set():
            pids = runners()
            signal_all(pids, signal.SIGSTOP)
            time.sleep(0.05 * (1 - share) / share)
            signal_all(pids, signal.SIGCONT)
            time.sleep(0.05)

    t = threading.Thread(target=throttle, daemon=True)
    t.start()
    try:
        yield
    finally:
        done.set()
        t.join(5)
        signal_all(runners(), signal.SIGCONT)


def _child(code: str) -> subprocess.Popen[str]:
    """A Python child that runs `code`, then prints "done" and waits for stdin to close."""
    script = code + "\nprint('done', flush=True)\nimport sys; sys.stdin.read()\n"
    return subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )


@pytest.mark.parametrize("how", ["mmap", "read"])
def test_loaded_bytes_counts_what_the_process_brought_in(tmp_path: Path, how: str) -> None:
    path = tmp_path / "weights.bin"
    size = 96 * MiB
    with open(path, "wb") as f:
        f.write(os.urandom(size))
    if how == "mmap":  # llama.cpp's default: touched pages of a mapping
        code = (
            "import mmap\n"
            f"f = open({str(path)!r}, 'rb'); m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)\n"
            f"s = sum(m[i] for i in range(0, {size // 2}, {mmap.PAGESIZE}))\n"
        )
    else:  # use_mmap off: read() into buffers
        code = f"f = open({str(path)!r}, 'rb'); b = f.read({size // 4})\n"
    child = _child(code)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "done"
        n = loaded_bytes(child.pid, [str(path)])
        assert n is not None
        want = size // 2 if how == "mmap" else size // 4
        # Python's own start-up reads a few MiB; nothing else of the file was touched.
        assert want <= n < want + 16 * MiB, (n, want)
        assert file_bytes([str(path), str(tmp_path / "missing")]) == size
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(10)


def test_loaded_bytes_of_a_process_that_is_gone() -> None:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    assert loaded_bytes(p.pid, ["/nonexistent"]) is None


# ---- a real load ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def big_models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model big enough that loading it from disk takes a second or more."""
    d = tmp_path_factory.mktemp("bigmodels")
    synth.write_llama_model(d / "big.gguf", target_bytes=600 * 10**6, context_length=512)
    synth.write_llama_model(d / "tiny.gguf")
    return d


def _router_events(url: str, out: list[dict[str, Any]], stop: threading.Event) -> None:
    with httpx.stream("GET", url + "/models/sse", timeout=httpx.Timeout(5, read=300)) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                out.append({**json.loads(line[6:]), "t": time.monotonic()})
            if stop.is_set():
                return


def test_models_sse_reports_progress_of_a_real_load(start_server, big_models: Path) -> None:
    s = start_server(big_models, CORRAL_CONTEXT_LENGTH="512")
    _drop_from_page_cache(big_models / "big.gguf")
    events: list[dict[str, Any]] = []
    stop = threading.Event()
    reader = threading.Thread(target=_router_events, args=(s.url, events, stop), daemon=True)
    reader.start()
    time.sleep(0.5)  # the stream is open before the load starts
    # Meanwhile, the state document shows the same load with its progress.
    seen_in_state: list[float] = []

    def follow_state() -> None:
        with httpx.Client(base_url=s.url, timeout=10) as c:
            while not stop.is_set():
                doc = c.get("/api/corral/state", params={"model": "big"}).json()
                assert [m["name"] for m in doc["models"]] == ["big:latest"]
                r = doc["models"][0]["runner"]
                if doc["models"][0]["state"] == "loading" and r["progress"] is not None:
                    seen_in_state.append(r["progress"])
                time.sleep(0.1)

    poller = threading.Thread(target=follow_state, daemon=True)
    poller.start()
    with _slowed(big_models / "big.gguf"):
        r = s.client.post("/api/generate", json={"model": "big"}, timeout=300)
    assert r.status_code == 200, r.text
    s.wait_for(
        lambda: any(e["model"] == "big:latest" and e["data"].get("status") == "loaded"
                    for e in events),
        timeout=10, what="the loaded event",
    )  # fmt: skip
    s.client.post("/models/unload", json={"model": "big"})
    s.wait_for(
        lambda: any(e["data"].get("status") == "unloaded" for e in events),
        timeout=30, what="the unloaded event",
    )  # fmt: skip
    stop.set()
    poller.join(5)
    mine = [e for e in events if e["model"] == "big:latest"]
    kinds = [(e["event"], e["data"].get("status")) for e in mine]
    # llama.cpp's router shape: model_status when the load starts, status_change with
    # {"stages", "current", "value"} while it loads, then loaded, then unloaded with exit_code.
    assert kinds[0] == ("model_status", "loading"), kinds
    progress = [e["data"]["progress"] for e in mine if e["data"].get("progress") is not None]
    assert len(progress) >= 2, kinds
    for p in progress:
        assert set(p) == {"stages", "current", "value"} and p["current"] in p["stages"]
    values = [p["value"] for p in progress]
    assert all(0.0 <= v <= 1.0 for v in values), values
    assert values == sorted(values) and values[-1] > values[0], values
    # It follows the weights into memory: all of them before the model serves.
    assert values[-1] >= 0.9, values
    loaded = kinds.index(("status_change", "loaded"))
    assert all(k == ("status_change", "loading") for k in kinds[1:loaded]), kinds
    assert kinds[-1] == ("status_change", "unloaded")
    assert mine[-1]["data"]["exit_code"] == 0
    assert seen_in_state and all(0.0 <= v <= 1.0 for v in seen_in_state), seen_in_state
    # Once it serves, the state shows it ready, loaded in about the time the client waited.
    doc = s.client.get("/api/corral/state", params={"model": "big"}).json()
    assert doc["models"][0]["state"] in ("not_loaded", "unloading")


def test_models_sse_reports_a_crash(start_server, big_models: Path) -> None:
    s = start_server(big_models)
    events: list[dict[str, Any]] = []
    stop = threading.Event()
    reader = threading.Thread(target=_router_events, args=(s.url, events, stop), daemon=True)
    reader.start()
    time.sleep(0.5)
    assert s.client.post("/api/generate", json={"model": "tiny"}).status_code == 200
    s.wait_for(lambda: any(e["data"].get("status") == "loaded" for e in events), timeout=10)
    (pid,) = [m["pid"] for m in s.ps()]
    os.kill(pid, signal.SIGKILL)
    s.wait_for(
        lambda: any(e["data"].get("exit_code") == 1 for e in events),
        timeout=30, what="the crash reported",
    )  # fmt: skip
    stop.set()
    ends = [e for e in events if e["data"].get("status") == "unloaded"]
    assert len(ends) == 1, ends  # one event, once the process is gone, with its exit code
    end = ends[0]
    assert end["model"] == "tiny:latest" and end["data"]["exit_code"] == 1
    assert end["event"] == "status_change" and end["data"]["status"] == "unloaded"


def test_corral_run_shows_a_progress_bar_while_the_model_loads(
    start_server, big_models: Path
) -> None:
    s = start_server(big_models, CORRAL_CONTEXT_LENGTH="512")
    _drop_from_page_cache(big_models / "big.gguf")
    leader, follower = pty.openpty()  # stderr is a terminal: the bar is on
    env = {**os.environ, "CORRAL_HOST": s.host, "COLUMNS": "100", "TERM": "xterm"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "corral", "run", "big"],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=follower, env=env,
    )  # fmt: skip
    os.close(follower)
    shown = b""
    with _slowed(big_models / "big.gguf"), contextlib.suppress(OSError):
        while chunk := os.read(leader, 65536):  # until EIO: the process closed the terminal
            shown += chunk
    os.close(leader)
    assert proc.wait(300) == 0
    text = shown.decode(errors="replace")
    assert "loading big:latest" in text, text[-2000:]
    percents = {int(p) for p in re.findall(r"(\d+)%", text)}
    assert len(percents) >= 2 and max(percents) >= 90, sorted(percents)
    assert [m["name"] for m in s.ps()] == ["big:latest"]
