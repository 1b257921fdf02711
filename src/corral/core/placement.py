"""Where a model goes: how many layers on which GPUs, and the bytes it books on each device (pure).

The unit of placement is llama.cpp's offload slot: each repeating layer (its weights and its
KV cache, which llama.cpp keeps with the layer) and the output layer (output head and norm), so
a model has n_layer + 1 slots and `-ngl` counts slots. Which slots `-ngl k` offloads
(src/llama-model.cpp, `i_gpu_start`/`act_gpu_layers`):

- llama.cpp since PR #18148 (Dec 2025, "offload output layer to GPU first"), as bundled by
  xllamacpp: the output layer and the last k - 1 repeating layers (`output_first=True`);
- older builds (CORRAL_LLAMA_SERVER may point at one): the last k repeating layers, and the
  output layer only at k = n_layer + 1 (as Ollama's llm/memory.go assumes).

The token embeddings never leave system memory ("very little benefit to offloading the input
layer", `dev_input` is always the CPU), so they belong in `ModelNeed.host`. GPU slots are spread
over the GPUs in index order, contiguously, by `--tensor-split`. Every GPU that runs layers
holds a compute buffer of its own (llama.cpp reserves one per backend in the graph; Ollama's
estimate books its graph size on each GPU too); system memory holds one more when any slot
stays on the CPU.

Rules, in order:
1. the whole model on ONE GPU if one has room: best fit, the GPU with the least free memory
   that still holds it, so that bigger GPUs stay free for bigger models;
2. else on the fewest GPUs of ONE library (never CUDA with ROCm: one runner is one build),
   the ones with the most free memory, slots split in proportion to their free memory;
3. else as many slots as fit on the GPUs of one library, the rest in system memory;
4. else the CPU alone.
`num_gpu` (Ollama's option) overrides the count: 0 is the CPU alone, N is exactly N slots
(clamped to n_layer + 1) by rules 1-2 or no placement; `main_gpu` names the GPU (an index in
its library) that a placement must use: the single-GPU rule tries it alone, splits include it.
No device is ever booked beyond its free budget, and ties are broken by name and index, so the
same inputs always give the same placement.

A model's `devices` (models.toml) limits where it may go: only the GPUs named may take layers,
and the model may spill layers to system memory (rules 3-4) only when "cpu" is named too;
["cpu"] alone keeps it on the CPU. A vision projector goes to the first GPU (lowest index) that
runs layers, as llama.cpp puts it on the first GPU the runner sees, or to system memory when no
layer is on a GPU. Experts kept in system memory (`--n-cpu-moe`) are in `host`, whatever
placement does with their layers; LoRA tensors travel with the layers they change, and a draft
model (speculative decoding) with its target: its layers spread over the target's, started with
as many of its own on GPUs as the target's share (`draft_gpu_layers`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from corral.core.devices import CPU, GPU_CONTEXT_BYTES, GPU_HOST_BYTES, Device
from corral.core.estimate import Estimate
from corral.core.requests import Fit, Placer
from corral.core.spec import Layout


@dataclass(frozen=True)
class ModelNeed:
    """A model's bytes by where they can go, at one context size and KV cache type."""

    layers: tuple[int, ...]  # per repeating layer: weights + its KV cache (same on GPU or CPU)
    output: int = 0  # output layer: output head (or the tied embedding copy) + output norm
    gpu_compute: int = 0  # compute buffer of each GPU that runs slots
    cpu_compute: int = 0  # compute buffer in system memory when any slot runs on the CPU
    host: int = 0  # always in system memory: token embeddings, host buffers, process overhead
    projector: int = 0  # a vision projector (weights and compute): on the first GPU used, or CPU
    # System memory a runner holds once it uses a GPU: the GPU runtime's own (CUDA's host
    # allocations, pinned staging buffers, its libraries' heaps)
    gpu_host: int = 0

    @property
    def n_layer(self) -> int:
        return len(self.layers)

    @property
    def weights(self) -> int:
        return sum(self.layers) + self.output


@dataclass(frozen=True)
class Placement:
    n_gpu_layers: int  # llama.cpp's -ngl: offload slots on GPUs, 0..n_layer + 1
    n_layer: int
    # llama.cpp's --tensor-split: slot counts per GPU index of `library` (0 where unused), so
    # that only the GPUs chosen get layers. None: CPU only.
    tensor_split: tuple[float, ...] | None
    main_gpu: int | None  # the requested main GPU, else the lowest used index; None: CPU only
    devices: dict[str, int] = field(hash=False)  # device id -> bytes booked, CPU included
    library: str = "cpu"  # the library of the GPUs used

    @property
    def full_offload(self) -> bool:
        return self.n_gpu_layers == self.n_layer + 1

    @property
    def gpus(self) -> tuple[str, ...]:
        """Ids of the GPUs used, in index order (for CUDA_VISIBLE_DEVICES and the like)."""
        return tuple(d for d in self.devices if d != CPU)

    @property
    def size(self) -> int:
        return sum(self.devices.values())

    def describe(self) -> str:
        """Like Ollama's ps: "100% GPU", "100% CPU", "48%/52% CPU/GPU". A fully offloaded
        model is 100% GPU although its token embeddings and buffers stay in system memory:
        Ollama does not count those either."""
        if self.n_gpu_layers == 0:
            return "100% CPU"
        if self.full_offload:
            return "100% GPU"
        total = self.size
        cpu = round(100 * (total - gpu_share(self)) / total) if total else 50
        cpu = min(99, max(1, cpu))  # a partial offload never reads as all on one side
        return f"{cpu}%/{100 - cpu}% CPU/GPU"


@dataclass(frozen=True)
class NoFit:
    """No placement: the message says what was needed and what was free."""

    reason: str


def gpu_share(placement: Placement) -> int:
    """Bytes on GPUs, for /api/ps's size_vram. (Ollama clients print "100% GPU" only when
    size_vram == size, so report size = size_vram for a `full_offload` placement.)"""
    return sum(n for d, n in placement.devices.items() if d != CPU)


def model_need(est: Estimate, gpu_context: int = 0, gpu_host: int = 0) -> ModelNeed:
    """A runner's estimate as placement needs it: the runner process's own memory
    (`est.process`) is booked in system memory with every model, `gpu_context` is what the
    process holds on each GPU it uses besides llama.cpp's buffers (its CUDA context), and
    `gpu_host` what it holds in system memory for its GPUs."""
    n = len(est.weights_per_layer)
    lora = est.adapters_per_layer or (0,) * n
    moe = (*est.cpu_experts_per_layer, *(0,) * n)[:n]
    # A draft model follows its target (`draft_gpu_layers`): its layers, spread evenly over
    # the target's, go where the target's go, its head with the target's output slot, the
    # rest with the target's (its process memory is in est.process already).
    d = est.draft
    spread = -(-(sum(d.weights_per_layer) + sum(d.kv_per_layer)) // max(n, 1)) if d else 0
    return ModelNeed(
        layers=tuple(
            w + kv + a - x + spread
            for w, kv, a, x in zip(est.weights_per_layer, est.kv_per_layer, lora, moe, strict=True)
        ),
        # The output slot: on a GPU, its head (a copy, with tied embeddings); in system memory
        # nothing beyond `host`, which holds every weight outside the layers.
        output=est.head + (d.head if d else 0),
        gpu_compute=est.compute + gpu_context + (d.compute if d else 0),
        cpu_compute=est.compute + (d.compute if d else 0),
        host=est.non_layer + est.overhead + est.adapters_other + sum(moe) + est.process
        + (d.non_layer + d.overhead if d else 0),
        projector=est.projector,
        gpu_host=gpu_host,
    )


def draft_gpu_layers(n_gpu_layers: int, n_layer: int, draft: Estimate | None) -> int | None:
    """The draft model's offload slots for a target with `n_gpu_layers` of its `n_layer` + 1
    on GPUs, in the same share (as `model_need` books it): none with none, all with all, else
    its output slot and its layers in proportion. None without a draft model."""
    if draft is None:
        return None
    slots = len(draft.weights_per_layer) + 1
    if n_gpu_layers <= 0 or n_gpu_layers >= n_layer + 1:
        return 0 if n_gpu_layers <= 0 else slots
    return 1 + round((slots - 1) * (n_gpu_layers - 1) / max(n_layer, 1))


def place(
    need: ModelNeed,
    devices: Iterable[Device],
    free: Mapping[str, int],
    *,
    num_gpu: int | None = None,
    main_gpu: int | None = None,
    output_first: bool = True,
    allowed: Sequence[str] | None = None,
) -> Placement | NoFit:
    """Where the model goes, given each device's free budget (bytes it may still book: budget
    less what is booked; a device missing from `free` has none). `num_gpu`: None or negative =
    automatic. On a machine without GPUs, num_gpu and main_gpu are ignored, as in Ollama.
    `allowed`: the model's own device ids (models.toml `devices`), None for any."""
    devices = list(devices)
    gpus = sorted((d for d in devices if d.library != "cpu"), key=lambda d: (d.library, d.index))
    spill = True
    if allowed is not None:
        unknown = [a for a in allowed if a != CPU and a not in {g.id for g in gpus}]
        if unknown:
            have = ", ".join(d.id for d in sorted(devices, key=lambda d: d.id))
            return NoFit(f"devices: no such device {', '.join(unknown)} (have {have})")
        gpus = [g for g in gpus if g.id in allowed]
        spill = CPU in allowed or not gpus
    p = _Planner(need, gpus, free, main_gpu, output_first)
    if not gpus or num_gpu == 0:
        if not spill:
            return NoFit(f"num_gpu 0, but the model's devices are {', '.join(allowed or ())}")
        return p.cpu_only()
    if main_gpu is not None and not any(g.index == main_gpu for g in gpus):
        return NoFit(f"main_gpu {main_gpu}: no such GPU (have {', '.join(g.id for g in gpus)})")
    slots = need.n_layer + 1
    if num_gpu is not None and num_gpu > 0:
        k = min(num_gpu, slots)
        if k < slots and not spill:
            return NoFit(
                f"num_gpu {num_gpu} leaves layers in system memory, but the model's devices "
                f"are {', '.join(allowed or ())}"
            )
        return p.offload(k) or NoFit(
            f"num_gpu {num_gpu}: {k} of {slots} layers on GPUs (the rest in system memory) "
            f"do not fit ({p.summary()})"
        )
    if not spill:
        return p.offload(slots) or NoFit(
            f"the model does not fit on its devices {', '.join(allowed or ())} ({p.summary()})"
        )
    return p.offload(slots) or p.partial() or p.cpu_only()


def placer(
    est: Estimate,
    devices: list[Device],
    num_gpu: int | None = None,
    main_gpu: int | None = None,
    allowed: tuple[str, ...] | None = None,
    gpu_context: int = GPU_CONTEXT_BYTES,
) -> Placer:
    """The pure function the scheduler asks where a runner of `est` would fit (`num_gpu`,
    `main_gpu`: Ollama's options, the model's or the request's; `allowed`: the model's
    devices), with the layout to start it with; `gpu_context`: what a runner holds on each
    GPU beyond llama.cpp's buffers (devices.gpu_context)."""
    # The runner process itself is booked with every model (as once it loads), and its
    # CUDA context on every GPU it uses, and the GPU runtime's host side with it.
    need = model_need(est, gpu_context, GPU_HOST_BYTES)

    def fit(free: Mapping[str, int]) -> Fit | None:
        p = place(need, devices, free, num_gpu=num_gpu, main_gpu=main_gpu, allowed=allowed)
        if not isinstance(p, Placement):
            return None
        layout = launch_layout(p, devices)
        draft = draft_gpu_layers(p.n_gpu_layers, p.n_layer, est.draft)
        return Fit(p.devices, replace(layout, draft_gpu_layers=draft))

    return fit


def no_fewer_gpu_layers(place: Placer, base: Placer) -> Placer:
    """`place`, refused where it would put fewer layers on GPUs than `base` would in the same
    memory: an automatic context longer than the floor is not worth layers moved to the CPU."""

    def guarded(free: Mapping[str, int]) -> Fit | None:
        fit = place(free)
        if fit is None:
            return None
        floor = base(free)
        return fit if floor is None or _gpu_layers(fit) >= _gpu_layers(floor) else None

    return guarded


def whole_on_gpus(place: Placer, slots: int) -> Placer:
    """`place`, refused where it would leave any of the model's `slots` (n_layer + 1) in system
    memory: what a runner with a GPU's many slots needs (on the CPU they would only share its
    cores)."""

    def guarded(free: Mapping[str, int]) -> Fit | None:
        fit = place(free)
        return fit if fit is not None and _gpu_layers(fit) >= slots else None

    return guarded


def _gpu_layers(fit: Fit) -> int:
    return int(getattr(fit.layout, "n_gpu_layers", 0) or 0)


def launch_layout(p: Placement, devices: list[Device]) -> Layout:
    """How to start a runner so that it uses exactly the devices placement booked: only those
    GPUs visible (llama.cpp would otherwise open a context, and for large batches compute, on
    every GPU it sees), the split and main GPU renumbered among them."""
    by_id = {d.id: d for d in devices}
    used = [by_id[g] for g in p.gpus if g in by_id]
    has_gpus = any(d.library != "cpu" for d in devices)
    env: list[tuple[str, str]] = []
    if has_gpus:
        cuda = [d.uuid or str(d.index) for d in used if d.library == "cuda"]
        rocm = [str(d.index) for d in used if d.library == "rocm"]
        env = [("CUDA_DEVICE_ORDER", "PCI_BUS_ID"), ("CUDA_VISIBLE_DEVICES", ",".join(cuda)),
               ("HIP_VISIBLE_DEVICES", ",".join(rocm))]  # fmt: skip
    split = None
    if p.tensor_split and len(used) > 1:
        split = tuple(p.tensor_split[d.index] for d in used)
    main = None
    if p.main_gpu is not None:
        main = next((i for i, d in enumerate(used) if d.index == p.main_gpu), 0)
    return Layout(p.n_gpu_layers, split, main, tuple(env))


class _Planner:
    def __init__(
        self,
        need: ModelNeed,
        gpus: list[Device],
        free: Mapping[str, int],
        main_gpu: int | None,
        output_first: bool,
    ) -> None:
        self.need, self.gpus = need, gpus
        self.free = {g.id: free.get(g.id, 0) for g in gpus}
        self.cpu_free = free.get(CPU, 0)
        self.main, self.output_first = main_gpu, output_first
        self.libraries: dict[str, list[Device]] = {}
        for g in gpus:  # sorted by (library, index): groups and their members in order
            self.libraries.setdefault(g.library, []).append(g)

    # ---- slots --------------------------------------------------------------------------------
    def split(self, k: int) -> tuple[list[int], list[int]]:
        """(GPU slots in llama.cpp's order, CPU slots) for -ngl k. The output slot costs
        nothing more in system memory (its weights are in `host`)."""
        n, layers = self.need.n_layer, list(self.need.layers)
        if k >= n + 1:
            return [*layers, self.need.output], []
        if k <= 0:
            return [], [*layers, 0]
        if self.output_first:
            return [*layers[n + 1 - k :], self.need.output], layers[: n + 1 - k]
        return layers[n - k : n], [*layers[: n - k], 0]

    def cpu_need(self, cpu_slots: Sequence[int], on_gpu: bool = True) -> int:
        """System memory with these slots on the CPU; the projector too when no slot is on a
        GPU (`on_gpu` false)."""
        return (
            self.need.host
            + sum(cpu_slots)
            + (self.need.cpu_compute if cpu_slots else 0)
            + (self.need.gpu_host if on_gpu else self.need.projector)
        )

    # ---- rules --------------------------------------------------------------------------------
    def offload(self, k: int) -> Placement | None:
        """Exactly k slots on GPUs: one GPU (best fit), else the fewest GPUs of one library."""
        gpu_slots, cpu_slots = self.split(k)
        cpu = self.cpu_need(cpu_slots)
        if cpu > self.cpu_free:
            return None
        want = sum(gpu_slots) + self.need.gpu_compute + self.need.projector
        singles = [g for g in self.gpus if self._main_ok(g) and self.free[g.id] >= want]
        if singles:
            best = min(singles, key=lambda g: (self.free[g.id], g.library, g.index))
            return self._placement(k, [(best, len(gpu_slots), sum(gpu_slots))], cpu)
        for m in range(2, max(len(group) for group in self.libraries.values()) + 1):
            found = []
            for lib, group in self.libraries.items():
                subset = self._most_free(group, m)
                if subset is None:
                    continue
                must = next((i for i, g in enumerate(subset) if g.index == self.main), None)
                room = self._rooms(subset)
                counts = _assign(room, gpu_slots, must)
                # The first GPU holds the projector: it must run layers too (else the projector
                # would go to another, which kept no room for it).
                if counts is not None and (counts[0] or not self.need.projector):
                    found.append((sum(self.free[g.id] for g in subset), lib, subset, counts))
            if found:
                _, _, subset, counts = min(found, key=lambda f: (f[0], f[1]))
                return self._placement(k, _layout(subset, counts, gpu_slots), cpu)
        return None

    def _rooms(self, gpus: list[Device]) -> list[int]:
        """What each GPU (in index order) has for slots: free less its compute buffer, and less
        the projector on the first."""
        room = [self.free[g.id] - self.need.gpu_compute for g in gpus]
        if room:
            room[0] -= self.need.projector
        return room

    def partial(self) -> Placement | None:
        """As many slots as fit on the GPUs of one library (greedily, in index order), the
        rest on the CPU. None if no GPU takes a slot or system memory cannot hold the rest."""
        best: tuple[int, int, str, list[Device], list[int]] | None = None
        for lib, group in self.libraries.items():
            if self.main is not None:
                if not any(g.index == self.main for g in group):
                    continue
                k, counts = self._most_slots(group)
                on_main = [c for g, c in zip(group, counts, strict=True) if g.index == self.main]
                if on_main[0] == 0:  # the others took the slots: use the main GPU alone
                    group = [g for g in group if g.index == self.main]
                    k, counts = self._most_slots(group)
            else:
                k, counts = self._most_slots(group)
            used = sum(1 for c in counts if c)
            if k and (best is None or (-k, used, lib) < (-best[0], best[1], best[2])):
                best = (k, used, lib, group, counts)
        if best is None:
            return None
        k, _, _, group, counts = best
        gpu_slots, cpu_slots = self.split(k)
        cpu = self.cpu_need(cpu_slots)
        if cpu > self.cpu_free:  # fewer GPU slots would only need more system memory
            return None
        return self._placement(k, _layout(group, counts, gpu_slots), cpu)

    def cpu_only(self) -> Placement | NoFit:
        _, cpu_slots = self.split(0)
        cpu = self.cpu_need(cpu_slots, on_gpu=False)
        if cpu > self.cpu_free:
            gpus = "fits on no GPU and " if self.gpus else ""
            return NoFit(
                f"the model {gpus}needs {_gib(cpu)} of system memory on the CPU alone "
                f"({self.summary()})"
            )
        return Placement(0, self.need.n_layer, None, None, {CPU: cpu})

    # ---- helpers ------------------------------------------------------------------------------
    def _main_ok(self, g: Device) -> bool:
        return self.main is None or g.index == self.main

    def _most_free(self, group: list[Device], m: int) -> list[Device] | None:
        """The m GPUs of a library with the most free memory (the main GPU among them), in
        index order; None if the library has fewer or lacks the main GPU."""
        if len(group) < m:
            return None
        ranked = sorted(group, key=lambda g: (not self._main_ok(g), -self.free[g.id], g.index))
        if self.main is not None and not self._main_ok(ranked[0]):
            return None
        return sorted(ranked[:m], key=lambda g: g.index)

    def _most_slots(self, group: list[Device]) -> tuple[int, list[int]]:
        """The most slots (below all of them) these GPUs hold, and the count on each. The
        projector goes to the first GPU that takes a slot, which keeps room for it."""
        for skip in range(len(group)):
            k, counts = self._most_slots_from(group[skip:])
            if counts[0] or not self.need.projector or not k:
                return k, [0] * skip + counts
        return 0, [0] * len(group)

    def _most_slots_from(self, group: list[Device]) -> tuple[int, list[int]]:
        room = self._rooms(group)
        lo, hi = 0, self.need.n_layer  # feasibility shrinks as k grows: binary search
        best = [0] * len(group)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            counts = _greedy(room, self.split(mid)[0])
            if counts is None:
                hi = mid - 1
            else:
                lo, best = mid, counts
        return lo, best

    def _placement(self, k: int, used: list[tuple[Device, int, int]], cpu: int) -> Placement:
        books = {CPU: cpu}
        split = [0.0] * (max(g.index for g, _, _ in used) + 1)
        for i, (g, count, nbytes) in enumerate(used):
            books[g.id] = nbytes + self.need.gpu_compute + (self.need.projector if i == 0 else 0)
            split[g.index] = float(count)
        main = self.main if self.main is not None else min(g.index for g, _, _ in used)
        return Placement(k, self.need.n_layer, tuple(split), main, books, used[0][0].library)

    def summary(self) -> str:
        parts = [f"{g.id} {_gib(self.free[g.id])}" for g in self.gpus]
        return "free: " + ", ".join([*parts, f"{CPU} {_gib(self.cpu_free)}"])


def _assign(room: list[int], slots: list[int], must: int | None = None) -> list[int] | None:
    """Slot counts per GPU (contiguous, in order) that fit each GPU's room (free less its
    compute buffer): in proportion to the rooms, as llama.cpp's default split is; failing that,
    as many as fit on each in turn. None if they cannot fit, or GPU `must` gets none."""
    weights = [max(0, r) for r in room]
    total_w, total = sum(weights), sum(slots)
    if total_w == 0:
        return None
    counts = [0] * len(room)
    cum = [0] * len(room)
    acc = 0
    for i, w in enumerate(weights):
        acc += w
        cum[i] = acc
    prefix, dev = 0, 0
    for s in slots:
        # The slot goes where its middle byte falls among the GPUs' shares (exact integers).
        mid2 = 2 * prefix + s
        while dev < len(room) - 1 and mid2 * total_w >= 2 * total * cum[dev]:
            dev += 1
        counts[dev] += 1
        prefix += s
    found: list[int] | None = counts
    if not _fits(counts, room, slots) or (must is not None and not counts[must]):
        found = _greedy(room, slots)
    return None if found is None or (must is not None and not found[must]) else found


def _fits(counts: list[int], room: list[int], slots: list[int]) -> bool:
    start = 0
    for c, r in zip(counts, room, strict=True):
        if c and sum(slots[start : start + c]) > r:
            return False
        start += c
    return True


def _greedy(room: list[int], slots: list[int]) -> list[int] | None:
    """Fill each GPU in turn with the next slots while they fit; None if some are left over.
    Contiguous in a fixed order, this covers the most slots any split can."""
    counts, j = [0] * len(room), 0
    for i, r in enumerate(room):
        used = 0
        while j < len(slots) and used + slots[j] <= r:
            used += slots[j]
            counts[i] += 1
            j += 1
    return counts if j == len(slots) else None


def _layout(
    subset: list[Device], counts: list[int], slots: list[int]
) -> list[tuple[Device, int, int]]:
    """(GPU, slot count, slot bytes) for the GPUs that got slots."""
    out, start = [], 0
    for g, c in zip(subset, counts, strict=True):
        if c:
            out.append((g, c, sum(slots[start : start + c])))
        start += c
    return out


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"
