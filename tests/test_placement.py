"""Placement of a model's layers on fake GPU sets: the rules, num_gpu and main_gpu, and the
invariants (no device over its budget, every byte booked somewhere) under random inputs."""

from __future__ import annotations

from helpers import fake_devices
from hypothesis import given, settings
from hypothesis import strategies as st

from corral.core.devices import Device
from corral.core.estimate import Estimate
from corral.core.placement import ModelNeed, NoFit, Placement, gpu_share, model_need, place

GiB = 2**30


def need(
    n_layer: int = 10,
    layer: int = GiB,
    output: int = GiB,
    gpu_compute: int = GiB,
    cpu_compute: int = GiB // 2,
    host: int = GiB // 2,
) -> ModelNeed:
    return ModelNeed((layer,) * n_layer, output, gpu_compute, cpu_compute, host)


def run(model: ModelNeed, spec: str, **kw: int | bool | None) -> Placement:
    devs = fake_devices(spec)
    p = place(model, devs, {d.id: d.free for d in devs}, **kw)  # type: ignore[arg-type]
    assert isinstance(p, Placement), p
    check(model, devs, {d.id: d.free for d in devs}, p, kw.get("output_first", True) is not False)
    return p


def check(
    model: ModelNeed,
    devs: list[Device],
    free: dict[str, int],
    p: Placement,
    output_first: bool = True,
) -> None:
    """What every placement must satisfy. The output slot costs its weights on a GPU and
    nothing more in system memory (its weights are in `host`)."""
    gpus = [d for d in devs if d.id in p.devices and d.library != "cpu"]
    for dev, n in p.devices.items():
        assert 0 <= n <= free.get(dev, 0), (dev, n, free)
    assert 0 <= p.n_gpu_layers <= model.n_layer + 1
    on_cpu = p.n_gpu_layers < model.n_layer + 1
    output_on_gpu = p.n_gpu_layers > 0 and (output_first or not on_cpu)
    expected = (
        sum(model.layers)
        + (model.output if output_on_gpu else 0)
        + model.host
        + model.gpu_compute * len(gpus)
        + (model.cpu_compute if on_cpu else 0)
    )
    assert p.size == expected
    assert len({g.library for g in gpus}) <= 1
    if p.n_gpu_layers == 0:
        assert not gpus and p.tensor_split is None and p.main_gpu is None
    else:
        assert gpus and p.tensor_split is not None
        assert sum(p.tensor_split) == p.n_gpu_layers
        assert {i for i, s in enumerate(p.tensor_split) if s} == {g.index for g in gpus}
        assert p.main_gpu in {g.index for g in gpus}
    assert gpu_share(p) == sum(p.devices[g.id] for g in gpus)


# ---- one GPU -----------------------------------------------------------------------------------


def test_one_gpu_that_fits_takes_the_whole_model() -> None:
    m = need()  # 11 slots of 1 GiB + 1 GiB compute = 12 GiB on the GPU
    p = run(m, "cpu=32GiB,cuda=24GiB")
    assert p.n_gpu_layers == 11 and p.full_offload
    assert p.devices == {"cpu": m.host, "cuda:0": 12 * GiB}
    assert p.tensor_split == (11.0,) and p.main_gpu == 0
    assert p.describe() == "100% GPU"
    assert gpu_share(p) == 12 * GiB


def test_one_gpu_too_small_offloads_what_fits_and_keeps_the_rest_in_system_memory() -> None:
    m = need()
    p = run(m, "cpu=32GiB,cuda=8GiB")  # 7 GiB after the compute buffer: 7 slots
    assert p.n_gpu_layers == 7
    assert p.devices["cuda:0"] == 8 * GiB
    # The output layer goes first, so 4 repeating layers stay on the CPU, with a compute buffer.
    assert p.devices["cpu"] == m.host + 4 * GiB + m.cpu_compute
    assert p.describe() == "38%/62% CPU/GPU"  # 5 GiB of 13 in system memory


def test_a_busy_gpu_counts_only_its_free_memory() -> None:
    p = run(need(), "cpu=32GiB,cuda=24GiB/6GiB")
    assert p.n_gpu_layers == 5


def test_old_llama_cpp_offloads_repeating_layers_before_the_output_layer() -> None:
    m = need(output=2 * GiB)
    p = run(m, "cpu=32GiB,cuda=8GiB", output_first=False)
    assert p.n_gpu_layers == 7  # 7 repeating layers; the 2 GiB output layer stays on the CPU
    # (where `host` holds its weights: nothing more in system memory)
    assert p.devices["cpu"] == m.host + 3 * GiB + m.cpu_compute
    new = run(m, "cpu=32GiB,cuda=8GiB")
    assert new.n_gpu_layers == 6  # the output layer and the last 5 repeating layers


# ---- several GPUs ------------------------------------------------------------------------------


def test_best_fit_picks_the_smallest_gpu_that_holds_the_model() -> None:
    p = run(need(), "cpu=32GiB,cuda=24GiB,cuda=16GiB,cuda=12GiB/11GiB")
    assert list(p.devices) == ["cpu", "cuda:1"]
    assert p.tensor_split == (0.0, 11.0) and p.main_gpu == 1
    big = need(n_layer=18)  # 20 GiB: only the 24 GiB GPU holds it
    assert run(big, "cpu=32GiB,cuda=24GiB,cuda=16GiB").gpus == ("cuda:0",)


def test_a_model_bigger_than_each_gpu_but_not_both_splits_in_proportion() -> None:
    m = need(n_layer=23, output=GiB)  # 24 slots of 1 GiB
    p = run(m, "cpu=32GiB,cuda=17GiB,cuda=9GiB,cuda=4GiB")
    assert p.full_offload and p.describe() == "100% GPU"
    assert p.gpus == ("cuda:0", "cuda:1")  # the two with the most free memory, not the third
    assert p.tensor_split is not None
    a, b = p.tensor_split[:2]
    assert (a, b) == (16.0, 8.0)  # room after compute: 16 and 8 GiB, 2:1
    assert p.devices["cuda:0"] == 17 * GiB and p.devices["cuda:1"] == 9 * GiB


def test_the_split_is_proportional_even_with_room_to_spare() -> None:
    m = need(n_layer=23, output=GiB, gpu_compute=0)  # 24 slots of 1 GiB
    p = run(m, "cpu=32GiB,cuda=20GiB,cuda=10GiB")
    assert p.tensor_split == (16.0, 8.0)


def test_the_fewest_gpus_that_hold_the_model() -> None:
    m = need(n_layer=19, output=GiB)  # 20 slots + compute
    p = run(m, "cpu=32GiB,cuda=9GiB,cuda=9GiB,cuda=9GiB,cuda=9GiB")
    assert len(p.gpus) == 3 and p.full_offload


def test_too_small_gpus_offload_part_of_the_model() -> None:
    m = need(n_layer=30)
    p = run(m, "cpu=64GiB,cuda=4GiB,cuda=4GiB")
    assert 0 < p.n_gpu_layers < m.n_layer
    assert p.n_gpu_layers == 6  # 3 slots on each, after a compute buffer on each
    assert p.devices["cpu"] == m.host + (31 - 6) * GiB + m.cpu_compute
    assert p.tensor_split == (3.0, 3.0)


def test_gpus_of_two_libraries_are_never_mixed() -> None:
    m = need()  # 12 GiB: fits on neither 8 GiB GPU, would fit on both together
    p = run(m, "cpu=32GiB,cuda=8GiB,rocm=8GiB")
    assert len(p.gpus) == 1 and not p.full_offload
    p = run(m, "cpu=32GiB,cuda=8GiB,rocm=8GiB,rocm=8GiB")
    assert p.library == "rocm" and p.gpus == ("rocm:0", "rocm:1") and p.full_offload


def test_a_single_gpu_of_either_library_can_take_the_model() -> None:
    p = run(need(), "cpu=32GiB,cuda=24GiB,rocm=16GiB")
    assert p.gpus == ("rocm:0",) and p.library == "rocm"


# ---- CPU only ----------------------------------------------------------------------------------


def test_cpu_only_machine() -> None:
    m = need()
    p = run(m, "cpu=32GiB")
    assert p.n_gpu_layers == 0 and p.tensor_split is None and p.main_gpu is None
    assert p.devices == {"cpu": sum(m.layers) + m.host + m.cpu_compute}
    assert p.describe() == "100% CPU" and gpu_share(p) == 0


def test_too_big_for_system_memory_is_no_fit() -> None:
    devs = fake_devices("cpu=8GiB,cuda=4GiB")
    r = place(need(), devs, {d.id: d.free for d in devs})
    assert isinstance(r, NoFit)
    assert "system memory" in r.reason and "cuda:0 4.00 GiB" in r.reason


def test_system_memory_must_hold_the_host_part_even_when_the_gpu_holds_the_rest() -> None:
    devs = fake_devices("cpu=32GiB,cuda=24GiB")
    r = place(need(host=2 * GiB), devs, {"cpu": GiB, "cuda:0": 24 * GiB})
    assert isinstance(r, NoFit)


def test_a_device_missing_from_the_free_budgets_gets_nothing() -> None:
    devs = fake_devices("cpu=32GiB,cuda=24GiB")
    p = place(need(), devs, {"cpu": 32 * GiB})
    assert isinstance(p, Placement) and p.n_gpu_layers == 0


# ---- num_gpu and main_gpu ----------------------------------------------------------------------


def test_num_gpu_zero_keeps_the_model_on_the_cpu() -> None:
    p = run(need(), "cpu=32GiB,cuda=24GiB", num_gpu=0)
    assert p.n_gpu_layers == 0 and list(p.devices) == ["cpu"]


def test_num_gpu_n_offloads_exactly_n_layers() -> None:
    m = need()
    p = run(m, "cpu=32GiB,cuda=24GiB,cuda=16GiB", num_gpu=4)
    assert p.n_gpu_layers == 4 and p.gpus == ("cuda:1",)  # best fit for 4 slots + compute
    assert p.devices["cuda:1"] == 4 * GiB + m.gpu_compute
    assert p.devices["cpu"] == m.host + 7 * GiB + m.cpu_compute
    assert run(m, "cpu=32GiB,cuda=24GiB", num_gpu=999).n_gpu_layers == 11  # clamped: all


def test_num_gpu_n_that_does_not_fit_fails_rather_than_offloading_fewer() -> None:
    devs = fake_devices("cpu=32GiB,cuda=8GiB")
    r = place(need(), devs, {d.id: d.free for d in devs}, num_gpu=9)
    assert isinstance(r, NoFit) and "num_gpu 9" in r.reason


def test_num_gpu_may_split_over_gpus() -> None:
    p = run(need(), "cpu=32GiB,cuda=6GiB,cuda=6GiB", num_gpu=8)
    assert p.n_gpu_layers == 8 and len(p.gpus) == 2


def test_num_gpu_and_main_gpu_are_ignored_without_gpus() -> None:
    p = run(need(), "cpu=32GiB", num_gpu=20, main_gpu=1)
    assert p.n_gpu_layers == 0


def test_main_gpu_takes_the_model_over_a_better_fit() -> None:
    p = run(need(), "cpu=32GiB,cuda=24GiB,cuda=16GiB", main_gpu=0)
    assert p.gpus == ("cuda:0",) and p.main_gpu == 0 and p.tensor_split == (11.0,)


def test_main_gpu_is_part_of_a_split() -> None:
    m = need(n_layer=23)  # 25 GiB with compute: needs two of the three
    p = run(m, "cpu=32GiB,cuda=16GiB,cuda=16GiB,cuda=12GiB", main_gpu=2)
    assert "cuda:2" in p.gpus and len(p.gpus) == 2 and p.main_gpu == 2


def test_main_gpu_too_small_for_the_model_is_part_of_a_split_or_partial_offload() -> None:
    p = run(need(), "cpu=32GiB,cuda=24GiB,cuda=4GiB", main_gpu=1)
    assert p.gpus == ("cuda:0", "cuda:1") and p.full_offload and p.main_gpu == 1
    p = run(need(n_layer=30), "cpu=64GiB,cuda=24GiB,cuda=4GiB", main_gpu=1)
    assert p.gpus == ("cuda:0", "cuda:1") and not p.full_offload and p.main_gpu == 1


def test_main_gpu_without_room_for_a_layer_is_not_swapped_for_another() -> None:
    p = run(need(), "cpu=32GiB,cuda=24GiB,cuda=1536MiB", main_gpu=1)
    assert "cuda:0" not in p.devices


def test_main_gpu_that_does_not_exist_is_no_fit() -> None:
    devs = fake_devices("cpu=32GiB,cuda=24GiB")
    r = place(need(), devs, {d.id: d.free for d in devs}, main_gpu=3)
    assert isinstance(r, NoFit) and "main_gpu 3" in r.reason


def test_placement_does_not_depend_on_the_order_devices_are_listed() -> None:
    m = need(n_layer=40)
    devs = fake_devices("cpu=64GiB,cuda=12GiB,cuda=12GiB,cuda=9GiB,rocm=20GiB")
    free = {d.id: d.free for d in devs}
    assert place(m, devs, free) == place(m, list(reversed(devs)), free)


# ---- properties --------------------------------------------------------------------------------

MiB = 2**20


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[ModelNeed, list[Device], dict[str, int], dict]:
    n_layer = draw(st.integers(1, 40))
    layers = tuple(draw(st.lists(st.integers(0, 900), min_size=n_layer, max_size=n_layer)))
    m = ModelNeed(
        tuple(x * MiB for x in layers),
        draw(st.integers(0, 2000)) * MiB,
        draw(st.integers(0, 1500)) * MiB,
        draw(st.integers(0, 1500)) * MiB,
        draw(st.integers(0, 1000)) * MiB,
    )
    devs = [Device("cpu", "cpu", -1, "cpu", 64 * GiB, 64 * GiB)]
    free = {"cpu": draw(st.integers(0, 40_000)) * MiB}
    counts = {"cuda": 0, "rocm": 0}
    for lib in draw(st.lists(st.sampled_from(["cuda", "rocm"]), max_size=5)):
        i = counts[lib]
        counts[lib] += 1
        devs.append(Device(f"{lib}:{i}", lib, i, lib, 48 * GiB, 48 * GiB))
        free[f"{lib}:{i}"] = draw(st.integers(0, 24_000)) * MiB
    kw = {
        "num_gpu": draw(st.one_of(st.none(), st.integers(-1, n_layer + 3))),
        "main_gpu": draw(st.one_of(st.none(), st.integers(0, 3))),
        "output_first": draw(st.booleans()),
    }
    return m, devs, free, kw


@settings(max_examples=400, deadline=None)
@given(scenarios())
def test_placements_respect_budgets_and_account_every_byte(
    s: tuple[ModelNeed, list[Device], dict[str, int], dict],
) -> None:
    m, devs, free, kw = s
    p = place(m, devs, free, **kw)
    assert p == place(m, list(reversed(devs)), free, **kw)  # deterministic, order-independent
    auto = kw["num_gpu"] is None and kw["main_gpu"] is None
    if isinstance(p, NoFit):
        assert p.reason
        if auto:
            assert best_single_gpu(m, devs, free, kw["output_first"]) is None
        return
    check(m, devs, free, p, kw["output_first"])
    has_gpus = len(devs) > 1
    num_gpu, main_gpu = kw["num_gpu"], kw["main_gpu"]
    if has_gpus and num_gpu is not None and num_gpu >= 0:
        assert p.n_gpu_layers == min(num_gpu, m.n_layer + 1)
    if main_gpu is not None and p.n_gpu_layers:
        assert p.main_gpu == main_gpu
    if auto:
        # Rule 1 is never missed: a GPU that holds everything gets everything.
        whole = m.weights + m.gpu_compute
        if any(free[d.id] >= whole for d in devs[1:]) and free["cpu"] >= m.host:
            assert p.full_offload and len(p.gpus) == 1
        # Nor is a better offload: no single GPU could have taken more layers.
        single = best_single_gpu(m, devs, free, kw["output_first"])
        assert single is None or p.n_gpu_layers >= single


def best_single_gpu(
    m: ModelNeed, devs: list[Device], free: dict[str, int], output_first: bool
) -> int | None:
    """The most slots any one GPU takes (llama.cpp's -ngl order, system memory holding the
    rest), written out independently of placement.py; None if not even the CPU fits."""
    seq, n = [*m.layers, m.output], m.n_layer
    best = None
    for k in range(n + 2):
        if k == n + 1:
            gpu, cpu = seq, []
        elif output_first:
            gpu, cpu = seq[n + 1 - k :], seq[: n + 1 - k]
        else:
            gpu, cpu = seq[n - k : n], [*m.layers[: n - k], m.output]
        if m.host + sum(cpu) + (m.cpu_compute if cpu else 0) > free["cpu"]:
            continue
        if k == 0 or any(sum(gpu) + m.gpu_compute <= free[d.id] for d in devs[1:]):
            best = k
    return best


# ---- a model's parts and devices ---------------------------------------------------------------


def with_projector(m: ModelNeed, projector: int) -> ModelNeed:
    return ModelNeed(m.layers, m.output, m.gpu_compute, m.cpu_compute, m.host, projector)


def booked(m: ModelNeed, p: Placement, output_first: bool = True) -> int:
    """Every byte of the model, with its projector, booked once (and the output slot's
    weights on a GPU, where it goes to one, beside `host`)."""
    on_cpu = p.n_gpu_layers < m.n_layer + 1
    output_on_gpu = p.n_gpu_layers > 0 and (output_first or not on_cpu)
    gpus = len(p.gpus)
    return (
        sum(m.layers) + (m.output if output_on_gpu else 0) + m.host + m.projector
        + m.gpu_compute * gpus + (m.cpu_compute if on_cpu else 0)
    )  # fmt: skip


def test_projector_goes_to_the_gpu_with_the_model() -> None:
    m = with_projector(need(), 2 * GiB)
    p = place(m, fake_devices("cpu=32GiB,cuda=24GiB"), {"cpu": 32 * GiB, "cuda:0": 24 * GiB})
    assert isinstance(p, Placement) and p.full_offload
    assert p.devices == {"cpu": m.host, "cuda:0": 14 * GiB}
    assert p.size == booked(m, p)


def test_projector_on_the_cpu_when_no_layer_is_on_a_gpu() -> None:
    m = with_projector(need(), 2 * GiB)
    p = place(m, fake_devices("cpu=32GiB"), {"cpu": 32 * GiB})
    assert isinstance(p, Placement) and p.n_gpu_layers == 0
    assert p.devices == {"cpu": m.host + sum(m.layers) + m.cpu_compute + 2 * GiB}
    p = place(m, fake_devices("cpu=32GiB,cuda=24GiB"), {"cpu": 32 * GiB, "cuda:0": 24 * GiB},
              num_gpu=0)  # fmt: skip
    assert (
        isinstance(p, Placement)
        and p.devices["cpu"] == m.host + sum(m.layers) + m.cpu_compute + m.projector
    )


def test_projector_takes_room_on_the_first_gpu_of_a_split() -> None:
    m = with_projector(need(), 3 * GiB)
    devs = fake_devices("cpu=32GiB,cuda=8GiB,cuda=8GiB")
    p = place(m, devs, {d.id: d.free for d in devs})
    assert isinstance(p, Placement), p
    assert all(n <= 8 * GiB for d, n in p.devices.items() if d != "cpu")
    assert p.size == booked(m, p)
    # The first GPU holds the projector, so it holds fewer layers than the second.
    assert p.tensor_split is not None and p.tensor_split[0] < p.tensor_split[1]


def test_projector_that_leaves_no_room_pushes_layers_off_the_gpu() -> None:
    m = with_projector(need(), 5 * GiB)
    p = place(m, fake_devices("cpu=32GiB,cuda=12GiB"), {"cpu": 32 * GiB, "cuda:0": 12 * GiB})
    assert isinstance(p, Placement) and p.n_gpu_layers == 6  # 12 - 1 compute - 5 projector
    assert p.devices["cuda:0"] == 12 * GiB and p.size == booked(m, p)


def test_devices_limit_the_gpus_a_model_may_use() -> None:
    m = need()
    devs = fake_devices("cpu=32GiB,cuda=24GiB,cuda=16GiB")
    free = {d.id: d.free for d in devs}
    p = place(m, devs, free, allowed=["cuda:0"])  # best fit would be cuda:1
    assert isinstance(p, Placement) and p.gpus == ("cuda:0",) and p.full_offload
    p = place(m, devs, free, allowed=["cpu"])
    assert isinstance(p, Placement) and p.n_gpu_layers == 0
    p = place(m, devs, free, allowed=["cuda:7"])
    assert isinstance(p, NoFit) and "no such device cuda:7" in p.reason


def test_devices_without_cpu_never_spill_layers_to_system_memory() -> None:
    m = need()
    devs = fake_devices("cpu=32GiB,cuda=8GiB")
    free = {d.id: d.free for d in devs}
    p = place(m, devs, free, allowed=["cuda:0"])
    assert isinstance(p, NoFit) and "does not fit on its devices cuda:0" in p.reason
    p = place(m, devs, free, allowed=["cuda:0", "cpu"])
    assert isinstance(p, Placement) and p.n_gpu_layers == 7
    p = place(m, devs, free, allowed=["cuda:0"], num_gpu=3)
    assert isinstance(p, NoFit) and "leaves layers in system memory" in p.reason


def test_model_need_keeps_cpu_experts_in_system_memory() -> None:
    est = Estimate(
        weights_per_layer=(10 * MiB, 10 * MiB, 10 * MiB), kv_per_layer=(MiB, MiB, MiB),
        non_layer=4 * MiB, compute=2 * MiB, overhead=MiB,
        adapters_per_layer=(MiB // 2,) * 3, adapters_other=MiB // 4,
        projector_weights=3 * MiB, projector_compute=MiB,
        cpu_experts_per_layer=(8 * MiB, 8 * MiB), process=5 * MiB,
    )  # fmt: skip
    m = model_need(est)
    assert m.layers == (3 * MiB + MiB // 2, 3 * MiB + MiB // 2, 11 * MiB + MiB // 2)
    assert m.host == 4 * MiB + MiB + MiB // 4 + 16 * MiB + 5 * MiB
    assert m.projector == 4 * MiB
    # Everything booked once: the estimate's total plus the process (and the output slot's
    # weights on a GPU, a copy of those `host` holds).
    assert sum(m.layers) + m.host + m.projector + m.gpu_compute == est.total + 5 * MiB
    assert m.output == est.head
    p = place(m, fake_devices("cpu=1GiB,cuda=1GiB"), {"cpu": GiB, "cuda:0": GiB})
    assert isinstance(p, Placement) and p.full_offload and p.devices["cpu"] == m.host


DEVICE_IDS = st.sampled_from(["cpu", "cuda:0", "cuda:1", "rocm:0"])


@settings(max_examples=200, deadline=None)
@given(scenarios(), st.integers(0, 3000), st.lists(DEVICE_IDS, max_size=3))
def test_placements_with_projector_and_devices_respect_budgets(
    s: tuple[ModelNeed, list[Device], dict[str, int], dict], projector: int, allowed: list[str]
) -> None:
    m, devs, free, kw = s
    m = with_projector(m, projector * MiB)
    known = {d.id for d in devs}
    allowed = [a for a in allowed if a in known] or None  # type: ignore[assignment]
    p = place(m, devs, free, allowed=allowed, **kw)
    if isinstance(p, NoFit):
        return
    for dev, n in p.devices.items():
        assert 0 <= n <= free.get(dev, 0), (dev, n, free)
    assert p.size == booked(m, p, kw["output_first"])
    if allowed is not None:
        assert set(p.gpus) <= set(allowed)
        if "cpu" not in allowed and any(a != "cpu" for a in allowed):
            assert p.full_offload
