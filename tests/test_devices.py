"""Device discovery on this (GPU-less) machine, NVML missing or failing, a fake NVML with GPUs,
fake device specs, budgets and the live headroom check."""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from helpers import fake_devices

from corral.config import ConfigError
from corral.core.devices import Device, budgets, live_headroom
from corral.runtime import devices

GiB = 2**30


@pytest.fixture(autouse=True)
def fresh_nvml() -> Iterator[None]:
    devices._reset_nvml()
    yield
    devices._reset_nvml()


# ---- a fake pynvml -----------------------------------------------------------------------------


class NVMLError(Exception):
    pass


class NVMLError_NotSupported(NVMLError):  # pynvml's name
    pass


def fake_nvml(gpus: list[dict[str, Any]], init_error: Exception | None = None) -> Any:
    """A pynvml with these GPUs: dicts of uuid, name, total, free, cc; "memory_error" makes
    the memory query raise it. `gpus` is read on every call, so tests can change free."""
    nv: Any = types.ModuleType("pynvml")
    nv.NVMLError = NVMLError
    nv.NVMLError_NotSupported = NVMLError_NotSupported
    nv.inits = 0

    def init() -> None:
        nv.inits += 1
        if init_error is not None:
            raise init_error

    def memory(h: dict[str, Any]) -> Any:
        if h.get("memory_error"):
            raise h["memory_error"]
        return types.SimpleNamespace(total=h["total"], free=h["free"], used=h["total"] - h["free"])

    def by_uuid(uuid: str) -> dict[str, Any]:
        for g in gpus:
            if g["uuid"] == uuid:
                return g
        raise NVMLError("not found")

    nv.nvmlInit = init
    nv.nvmlDeviceGetCount = lambda: len(gpus)
    nv.nvmlDeviceGetHandleByIndex = lambda i: gpus[i]
    nv.nvmlDeviceGetHandleByUUID = by_uuid
    nv.nvmlDeviceGetUUID = lambda h: h["uuid"]
    nv.nvmlDeviceGetName = lambda h: h["name"].encode()  # older pynvml returns bytes
    nv.nvmlDeviceGetCudaComputeCapability = lambda h: h["cc"]
    nv.nvmlDeviceGetMemoryInfo = memory
    return nv


GPUS = [
    {"uuid": "GPU-aaaa-1111", "name": "NVIDIA H100", "total": 80 * GiB, "free": 79 * GiB,
     "cc": (9, 0)},
    {"uuid": "GPU-bbbb-2222", "name": "NVIDIA L4", "total": 24 * GiB, "free": 20 * GiB,
     "cc": (8, 9)},
]  # fmt: skip


def install(monkeypatch: pytest.MonkeyPatch, module: Any) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", module)
    monkeypatch.setitem(sys.modules, "amdsmi", None)  # no AMD library either
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


# ---- discovery ---------------------------------------------------------------------------------


def test_discover_reports_system_memory_first_with_sane_numbers() -> None:
    found = devices.discover()
    cpu = found[0]
    assert (cpu.id, cpu.library, cpu.index) == ("cpu", "cpu", -1)
    assert 0 < cpu.free <= cpu.total <= psutil.virtual_memory().total
    assert cpu.free_reliable and cpu.name
    for d in found[1:]:  # whatever GPUs the machine has (none here) are sane too
        assert d.library in ("cuda", "rocm") and d.id == f"{d.library}:{d.index}"
        assert 0 <= d.free <= d.total


def test_without_nvml_there_are_no_nvidia_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    install(monkeypatch, None)  # import pynvml raises ImportError
    found = devices.discover()
    assert [d.id for d in found] == ["cpu"]


@pytest.mark.parametrize("error", [NVMLError("NVML Shared Library Not Found"), OSError("x")])
def test_a_failing_nvml_init_means_no_nvidia_gpus(
    monkeypatch: pytest.MonkeyPatch, error: Exception
) -> None:
    nv = fake_nvml(GPUS, init_error=error)
    install(monkeypatch, nv)
    assert [d.id for d in devices.discover()] == ["cpu"]
    assert [d.id for d in devices.discover()] == ["cpu"]
    assert nv.inits == 1  # tried once, not on every discover()


def test_nvml_errors_after_init_are_contained(monkeypatch: pytest.MonkeyPatch) -> None:
    nv = fake_nvml(GPUS)

    def broken() -> int:
        raise NVMLError("Unknown Error")

    nv.nvmlDeviceGetCount = broken
    install(monkeypatch, nv)
    assert [d.id for d in devices.discover()] == ["cpu"]
    nv.nvmlDeviceGetCount = lambda: 1 / 0  # not even an NVMLError: still no exception
    assert [d.id for d in devices.discover()] == ["cpu"]


def test_nvidia_gpus_from_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    install(monkeypatch, fake_nvml(GPUS))
    _, h100, l4 = devices.discover()
    assert h100 == Device(
        "cuda:0", "cuda", 0, "NVIDIA H100", 80 * GiB, 79 * GiB, True, "9.0", "GPU-aaaa-1111"
    )
    assert (l4.id, l4.name, l4.free, l4.compute_capability) == (
        "cuda:1",
        "NVIDIA L4",
        20 * GiB,
        "8.9",
    )


def test_a_gpu_without_memory_figures_is_unreliable(monkeypatch: pytest.MonkeyPatch) -> None:
    unified = {**GPUS[0], "memory_error": NVMLError_NotSupported("Not Supported")}
    install(monkeypatch, fake_nvml([unified]))
    gpu = devices.discover()[1]
    assert not gpu.free_reliable
    assert gpu.total == psutil.virtual_memory().total  # unified memory: system memory


@pytest.mark.parametrize(
    ("visible", "uuids"),
    [
        ("1", ["GPU-bbbb-2222"]),
        ("1,0", ["GPU-bbbb-2222", "GPU-aaaa-1111"]),
        ("GPU-aaaa", ["GPU-aaaa-1111"]),
        ("bbbb-2222,0", ["GPU-bbbb-2222", "GPU-aaaa-1111"]),
        ("0,7,1", ["GPU-aaaa-1111"]),  # CUDA stops at the first entry naming no device
        ("GPU-", []),  # ambiguous prefix
        ("", []),
        ("-1", []),
    ],
)
def test_cuda_visible_devices_selects_and_renumbers(
    monkeypatch: pytest.MonkeyPatch, visible: str, uuids: list[str]
) -> None:
    install(monkeypatch, fake_nvml(GPUS))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    gpus = devices.discover()[1:]
    assert [g.uuid for g in gpus] == uuids
    assert [g.id for g in gpus] == [f"cuda:{i}" for i in range(len(uuids))]


def test_refresh_rereads_free_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    gpus = [dict(g) for g in GPUS]
    install(monkeypatch, fake_nvml(gpus))
    found = devices.discover()
    gpus[1]["free"] = 23 * GiB  # a runner exited and the driver gave its memory back
    again = devices.refresh(found)
    assert [d.id for d in again] == [d.id for d in found]
    assert again[2].free == 23 * GiB and again[1].free == 79 * GiB
    assert again[0].total == found[0].total and again[0].free > 0
    gpus[0]["memory_error"] = NVMLError("GPU is lost")
    lost = devices.refresh(found)[1]
    assert not lost.free_reliable and lost.free == 79 * GiB
    assert [d.id for d in devices.discover()] == ["cpu", "cuda:1"]  # a lost GPU is left out


def test_refresh_leaves_fake_devices_alone() -> None:
    fakes = fake_devices("cpu=24GiB/3GiB,cuda=8GiB/1GiB")
    assert devices.refresh(fakes) == fakes


# ---- cgroups -----------------------------------------------------------------------------------


def write(root: Path, rel: str, text: str) -> None:
    p = root / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)


def test_cgroup_v2_limit_and_working_set(tmp_path: Path) -> None:
    write(tmp_path, "proc/self/cgroup", "0::/app/worker\n")
    write(tmp_path, "sys/fs/cgroup/app/memory.max", f"{8 * GiB}\n")
    write(tmp_path, "sys/fs/cgroup/app/memory.current", f"{6 * GiB}\n")
    write(tmp_path, "sys/fs/cgroup/app/memory.stat", f"anon 1\ninactive_file {GiB}\n")
    write(tmp_path, "sys/fs/cgroup/app/worker/memory.max", "max\n")
    assert devices.cgroup_memory(str(tmp_path)) == (8 * GiB, 3 * GiB)


def test_cgroup_parent_with_less_available_than_the_child(tmp_path: Path) -> None:
    write(tmp_path, "proc/self/cgroup", "garbage\n0::/app/worker\n")
    write(tmp_path, "sys/fs/cgroup/app/memory.max", f"{16 * GiB}\n")
    write(tmp_path, "sys/fs/cgroup/app/memory.current", f"{15 * GiB}\n")  # siblings use it
    write(tmp_path, "sys/fs/cgroup/app/worker/memory.max", f"{8 * GiB}\n")
    write(tmp_path, "sys/fs/cgroup/app/worker/memory.current", f"{2 * GiB}\n")
    assert devices.cgroup_memory(str(tmp_path)) == (8 * GiB, GiB)


def test_cgroup_v1_limit(tmp_path: Path) -> None:
    write(tmp_path, "proc/self/cgroup", "4:memory:/docker/abc\n1:cpu:/\n")
    write(tmp_path, "sys/fs/cgroup/memory/docker/abc/memory.limit_in_bytes", f"{4 * GiB}\n")
    write(tmp_path, "sys/fs/cgroup/memory/docker/abc/memory.usage_in_bytes", f"{GiB}\n")
    assert devices.cgroup_memory(str(tmp_path)) == (4 * GiB, 3 * GiB)


def test_no_cgroup_limit(tmp_path: Path) -> None:
    write(tmp_path, "proc/self/cgroup", "4:memory:/\n")
    write(tmp_path, "sys/fs/cgroup/memory/memory.limit_in_bytes", "9223372036854771712\n")
    assert devices.cgroup_memory(str(tmp_path)) is None
    assert devices.cgroup_memory(str(tmp_path / "nowhere")) is None


# ---- fake devices ------------------------------------------------------------------------------


def test_fake_devices() -> None:
    cpu, a, b, r = fake_devices("cuda=24GiB, cpu=32GiB, rocm=16GiB, cuda=8GiB/6GiB")
    assert (cpu.id, cpu.total, cpu.free) == ("cpu", 32 * GiB, 32 * GiB)
    assert (a.id, a.index, a.total, a.free) == ("cuda:0", 0, 24 * GiB, 24 * GiB)
    assert (b.id, b.index, b.total, b.free) == ("cuda:1", 1, 8 * GiB, 6 * GiB)
    assert (r.id, r.library, r.index) == ("rocm:0", "rocm", 0)
    assert all(d.uuid is None and d.free_reliable for d in (cpu, a, b, r))


@pytest.mark.parametrize(
    "spec",
    ["cuda=8GiB", "cpu=1GiB,cpu=2GiB", "cpu=lots", "cpu=8GiB,tpu=8GiB", "cpu=1GiB/2GiB", ""],
)
def test_bad_fake_device_specs(spec: str) -> None:
    with pytest.raises(ConfigError):
        fake_devices(spec)


# ---- budgets -----------------------------------------------------------------------------------


def test_budgets_keep_a_margin_and_honour_the_limit() -> None:
    devs = fake_devices("cpu=32GiB,cuda=24GiB,cuda=512MiB")
    assert budgets(devs, GiB) == {"cpu": 31 * GiB, "cuda:0": 23 * GiB, "cuda:1": 0}
    assert budgets(devs, GiB, 16 * GiB) == {"cpu": 16 * GiB, "cuda:0": 16 * GiB, "cuda:1": 0}
    assert budgets(devs, 0, None)["cuda:1"] == 512 * 2**20


def test_budgets_ignore_what_is_free_now() -> None:
    devs = fake_devices("cpu=32GiB/2GiB")  # a busy machine: the budget is still about total
    assert budgets(devs, GiB) == {"cpu": 31 * GiB}


def test_live_headroom() -> None:
    gpu = fake_devices("cpu=1GiB,cuda=24GiB/10GiB")[1]  # 14 GiB in use: 8 by our runners
    assert live_headroom(gpu, 8 * GiB) == 18 * GiB  # others use 6 GiB
    assert live_headroom(gpu, 8 * GiB, margin=GiB) == 17 * GiB
    # A runner still loading has booked 8 GiB but allocated only 2: the 6 GiB it will take are
    # still in the free figure, so only what it holds is added back.
    assert live_headroom(gpu, 8 * GiB, in_use_by_us=2 * GiB) == 12 * GiB
    # One that took more than it booked holds that, but the books only count the booking.
    assert live_headroom(gpu, 8 * GiB, in_use_by_us=9 * GiB) == 18 * GiB
    assert live_headroom(gpu, 0, margin=20 * GiB) == 0


def test_live_headroom_of_an_unreliable_device_is_its_total() -> None:
    d = Device("cuda:0", "cuda", 0, "GB10", 128 * GiB, 3 * GiB, free_reliable=False)
    assert live_headroom(d, 0) == 128 * GiB
