"""A runner is started to use exactly the devices its placement booked."""

from __future__ import annotations

from helpers import fake_devices

from corral.core.placement import ModelNeed, Placement, launch_layout, place

MiB = 2**20
NEED = ModelNeed(
    layers=(100 * MiB,) * 10,
    output=50 * MiB,
    gpu_compute=64 * MiB,
    cpu_compute=64 * MiB,
    host=80 * MiB,
)


def placed(spec: str, **kw) -> tuple[Placement, list]:
    devices = fake_devices(spec)
    p = place(NEED, devices, {d.id: d.free for d in devices}, **kw)
    assert isinstance(p, Placement)
    return p, devices


def test_one_gpu_of_two_is_the_only_visible_one() -> None:
    p, devices = placed("cpu=64GiB,cuda=24GiB,cuda=1GiB")  # only cuda:0 has room
    layout = launch_layout(p, devices)
    env = dict(layout.env)
    assert env["CUDA_VISIBLE_DEVICES"] == "0" and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert layout.n_gpu_layers == 11 and layout.tensor_split is None and layout.main_gpu == 0


def test_split_over_two_gpus_renumbers_the_split() -> None:
    p, devices = placed("cpu=64GiB,cuda=700MiB,cuda=700MiB,cuda=100MiB")
    assert len(p.gpus) == 2
    layout = launch_layout(p, devices)
    assert dict(layout.env)["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert layout.tensor_split is not None and len(layout.tensor_split) == 2
    assert sum(layout.tensor_split) == layout.n_gpu_layers


def test_cpu_placement_on_a_gpu_machine_hides_the_gpus() -> None:
    p, devices = placed("cpu=64GiB,cuda=24GiB", num_gpu=0)
    layout = launch_layout(p, devices)
    assert layout.n_gpu_layers == 0 and dict(layout.env)["CUDA_VISIBLE_DEVICES"] == ""


def test_cpu_only_machine_sets_no_environment() -> None:
    p, devices = placed("cpu=64GiB")
    assert launch_layout(p, devices).env == ()
