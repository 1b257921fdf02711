"""Contexts sized to the machine (core/context.py) and llama.cpp's context refusal as data."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
import pytest
from helpers import NothingLearned

from corral.api.service import Service
from corral.config import Settings
from corral.core.books import Core
from corral.core.context import (
    AUTO_FLOOR,
    DEFAULT_OUTPUT,
    UNKNOWN_TRAINED_CAP,
    context_grid,
    grown_context,
    next_power_of_two,
)
from corral.core.devices import CPU, Device
from corral.core.gguf import read_model_info
from corral.core.requests import Grant, Load, Request, Sizing, Stop
from corral.core.spec import (
    AUTO_PARALLEL,
    GPU_PARALLEL,
    RunnerSpec,
    spec_estimate,
)
from corral.errors import ApiError
from corral.runtime.admission import Resolved, output_tokens
from corral.runtime.registry import ModelEntry
from corral.runtime.runner_errors import CacheFull, ContextOverflow, runner_error
from corral.testing import synth

GIB = 1 << 30


def test_the_grid_runs_from_the_floor_by_powers_of_two_to_the_trained_context() -> None:
    assert context_grid(32768) == [4096, 8192, 16384, 32768]
    assert context_grid(40960) == [4096, 8192, 16384, 32768, 40960]  # qwen3's 40k
    assert context_grid(2048) == [2048]  # trained below the floor: the trained
    assert context_grid(4096) == [4096]
    assert context_grid(0) == [AUTO_FLOOR]  # the file does not say
    assert context_grid(10000, floor=3000) == [3000, 4096, 8192, 10000]


def test_a_prompt_grows_the_context_to_the_next_power_of_two_up_to_the_trained() -> None:
    assert [next_power_of_two(n) for n in (0, 1, 2, 3, 4096, 4097)] == [1, 1, 2, 4, 4096, 8192]
    assert grown_context(9312, 1024, 32768) == 16384
    assert grown_context(9312, 100, 131072) == 16384
    assert grown_context(7000, 1024, 8192) == 8192  # prompt + output = 8024
    assert grown_context(8000, 1024, 8192) == 8192  # capped at the trained: it may stop early
    assert grown_context(8192, 1024, 8192) is None  # the prompt alone fills the trained
    assert grown_context(20000, 1, 8192) is None
    assert grown_context(20000, 1, 0) == 32768  # unknown trained: up to a cap
    assert grown_context(UNKNOWN_TRAINED_CAP, 1, 0) is None


def test_llama_cpp_refusing_a_long_prompt_carries_its_numbers() -> None:
    body = orjson.dumps({"error": {
        "code": 400, "type": "exceed_context_size_error", "n_prompt_tokens": 9312, "n_ctx": 8192,
        "message": "request (9312 tokens) exceeds the available context size (8192 tokens), "
                   "try increasing it",
    }})  # fmt: skip
    err = runner_error(body, 400)
    assert isinstance(err, ContextOverflow)
    assert (err.status, err.prompt_tokens, err.n_ctx) == (400, 9312, 8192)
    assert "exceeds the available context size" in err.message


@pytest.mark.parametrize("status", [400, 500])
def test_other_refusals_are_plain_errors(status: int) -> None:
    body = orjson.dumps({"error": {"code": status, "type": "invalid_request_error",
                                   "message": "bad grammar"}})  # fmt: skip
    err = runner_error(body, status)
    assert not isinstance(err, ContextOverflow) and err.status == 400
    # the context refusal without its numbers (an older llama.cpp): still a 400 as it was
    old = orjson.dumps({"error": {"type": "exceed_context_size_error", "message": "too long"}})
    err = runner_error(old, status)
    assert not isinstance(err, ContextOverflow) and err.status == 400


@pytest.mark.parametrize("status", [400, 500])
def test_a_shared_cache_that_filled_up_is_the_servers_503_not_the_clients_400(status: int) -> None:
    """llama.cpp's "Context size has been exceeded." fails every slot processing when the
    requests running at once outgrow the cache their slots share: none of them is at fault."""
    for body in (
        orjson.dumps({"error": {"code": 500, "type": "server_error",
                                "message": "Context size has been exceeded."}}),
        b'{"error":"Context size has been exceeded."}',
    ):  # fmt: skip
        err = runner_error(body, status)
        assert isinstance(err, CacheFull) and err.status == 503
        assert "Context size has been exceeded" in err.message and "try again" in err.message


# ---- the automatic context: the admission's candidates, chosen by the core's room rule --------


@pytest.fixture(scope="module")
def long_model(tmp_path_factory: pytest.TempPathFactory) -> Resolved:
    path = synth.write_llama_model(
        tmp_path_factory.mktemp("ctx") / "long.gguf", n_layer=2, context_length=32768
    )
    return Resolved("long", ModelEntry("long", path), read_model_info(path), "long")


def size(r: Resolved, n_ctx: int) -> int:
    est = spec_estimate(r.info, RunnerSpec(str(r.entry.path), n_ctx, 1))
    return est.total + est.process


def auto_service(sched: Any = None) -> Service:
    sched = sched if sched is not None else NothingLearned()
    settings = Settings.load(environ={"CORRAL_NUM_PARALLEL": "1"})
    assert settings.context_length is None  # auto is the default
    devices = [Device(CPU, "cpu", -1, "cpu", 64 * GIB, 64 * GIB)]
    return Service(settings, None, sched, devices, None)  # type: ignore[arg-type]


class Books:
    """The core with other models' runners booked (busy or idle), asked for `long` as the
    admission offers it: its candidates, best first."""

    def __init__(self, budget: int, *others: tuple[str, int, bool]) -> None:
        self.core = Core(budgets={CPU: budget})
        self.ids = itertools.count(1)
        for model, held, busy in others:
            self.loaded(model, RunnerSpec(f"/m/{model}.gguf", 4096, 1), held, busy)

    def loaded(self, model: str, spec: RunnerSpec, size: int, busy: bool) -> None:
        """A runner of `model` loaded for a request, which it still serves if `busy`."""
        rid = self.request(model, spec, size)
        (load,) = [a for a in self.core.drain() if isinstance(a, Load)]
        self.core.loaded(load.runner, 0.0)
        self.core.drain()
        if not busy:
            self.core.release(rid, 0.0)

    def request(self, model: str, spec: RunnerSpec, size: int, *smaller: Sizing) -> int:
        rid = next(self.ids)
        self.core.request(Request(
            id=rid, model=model, spec=spec, explicit=frozenset(), size=size, keep_alive=None,
            arrived=0.0,
        ).offering(smaller), 0.0)  # fmt: skip
        return rid

    def ask(self, r: Resolved) -> list[Any]:
        svc = auto_service()
        spec, _ = svc.admission.runner_spec(r, {})
        assert spec.n_ctx == AUTO_FLOOR  # the floor: the context asked for at the least
        best, *rest = svc.admission.sizings(r, spec, {}, auto=True)
        self.request(r.runner, best.spec, best.size, *rest)
        return self.core.drain()


def loaded_ctx(actions: list[Any]) -> int | None:
    loads = [a for a in actions if isinstance(a, Load)]
    return loads[0].spec.n_ctx if loads else None


def test_auto_takes_the_trained_context_where_memory_allows(long_model: Resolved) -> None:
    assert loaded_ctx(Books(64 * GIB).ask(long_model)) == 32768


def test_auto_takes_the_longest_context_that_fits_beside_the_other_models(
    long_model: Resolved,
) -> None:
    """The core's one room rule: the first candidate that fits free memory (beside busy and
    idle models alike); only when even the floor does not fit are idle models evicted, for
    the longest context that fits once they are gone."""
    room = (size(long_model, 8192) + size(long_model, 16384)) // 2  # 8,192 fits, 16,384 not
    budget = room + 10 * GIB
    assert loaded_ctx(Books(budget, ("other", 10 * GIB, True)).ask(long_model)) == 8192
    assert loaded_ctx(Books(budget, ("other", 10 * GIB, False)).ask(long_model)) == 8192
    evicting = Books(10 * GIB + size(long_model, 2048), ("other", 10 * GIB, False))
    actions = evicting.ask(long_model)
    assert [a.kind for a in actions if isinstance(a, Stop)] == ["memory"]
    (stopped,) = [r for r in evicting.core.runners.values() if r.state == "unloading"]
    evicting.core.exited(stopped.id, 1.0)
    assert loaded_ctx(evicting.core.drain()) == 32768
    # busy models leave no room even at the floor: the load waits, as any load does
    full = Books(10 * GIB, ("other", 10 * GIB, True))
    assert full.ask(long_model) == [] and len(full.core.queue) == 1


def test_a_loaded_runner_with_at_least_the_floor_is_never_reloaded_for_auto(
    long_model: Resolved,
) -> None:
    books = Books(64 * GIB, ("long", size(long_model, 8192), False))
    actions = books.ask(long_model)
    assert [type(a) for a in actions] == [Grant]  # not a reload at 32,768 nobody asked for
    shrunk = Books(64 * GIB)  # a client shrank it below the floor: auto loads it again
    shrunk.loaded("long", RunnerSpec(str(long_model.entry.path), 1024, 1), 2**20, busy=False)
    actions = shrunk.ask(long_model)
    assert [a.kind for a in actions if isinstance(a, Stop)] == ["options_change"]


# ---- Service.leased: the one retry, over a fake lease ----------------------------------------


class FakeLease:
    def __init__(self, n_ctx: int) -> None:
        self.n_ctx, self.released = n_ctx, False

    def release(self) -> None:
        self.released = True


def leasing(svc: Service, refuse: ApiError | None = None) -> list[tuple[dict[str, Any], Any]]:
    """Replace svc.lease: each call leases a FakeLease at the options' num_ctx (1,024 without);
    `refuse` is raised for a second lease instead."""
    leases: list[tuple[dict[str, Any], Any]] = []

    async def lease(request: Any, r: Any, options: dict[str, Any], keep_alive: Any) -> Any:
        if leases and refuse is not None:
            raise refuse
        leases.append((options, FakeLease(options.get("num_ctx", 1024))))
        return leases[-1][1]

    svc.lease = lease  # type: ignore[method-assign]
    return leases


def overflow_below(n_prompt: int) -> Callable[[Any], Awaitable[str]]:
    async def start(lease: Any) -> str:
        if lease.n_ctx <= n_prompt:
            raise ContextOverflow("too long", n_prompt, lease.n_ctx)
        return f"served at {lease.n_ctx}"

    return start


def test_an_overflowing_prompt_is_sent_again_after_a_reload_with_room_for_it(
    long_model: Resolved,
) -> None:
    svc = auto_service()
    leases = leasing(svc)
    out = asyncio.run(svc.leased(None, long_model, {"temperature": 0}, None,  # type: ignore[arg-type]
                                 {"max_tokens": 100}, overflow_below(9312)))  # fmt: skip
    assert out == "served at 16384"  # 9,312 + 100 -> the next power of two
    (first, a), (second, b) = leases
    assert first == {"temperature": 0} and second == {"temperature": 0, "num_ctx": 16384}
    assert a.released and not b.released  # the answer owns the second lease


def test_a_prompt_beyond_the_trained_context_or_memory_is_a_400_that_says_so(
    long_model: Resolved,
) -> None:
    svc = auto_service()
    leases = leasing(svc)
    with pytest.raises(ApiError) as e:
        asyncio.run(svc.leased(None, long_model, {}, None, {},  # type: ignore[arg-type]
                               overflow_below(40000)))  # fmt: skip
    assert e.value.status == 400 and e.value.message == (
        "the prompt is 40,000 tokens; model 'long' takes at most 32,768 (its trained context): "
        "shorten the prompt or use a model with a longer context"
    )
    assert len(leases) == 1 and leases[0][1].released
    never = ApiError(507, "model requires more memory than corral has")
    leasing(svc, refuse=never)
    with pytest.raises(ApiError) as e:
        asyncio.run(svc.leased(None, long_model, {}, None, {},  # type: ignore[arg-type]
                               overflow_below(9312)))  # fmt: skip
    assert e.value.status == 400
    assert e.value.message.startswith(
        "the prompt is 9,312 tokens; model 'long' would need a context of 16,384 tokens"
    )
    assert "shorten the prompt or use a smaller model" in e.value.message
    busy = ApiError(503, "server busy")  # any other refusal of the reload is as it was
    leasing(svc, refuse=busy)
    with pytest.raises(ApiError) as e:
        asyncio.run(svc.leased(None, long_model, {}, None, {},  # type: ignore[arg-type]
                               overflow_below(9312)))  # fmt: skip
    assert e.value is busy


def test_the_output_a_request_asks_for_is_read_from_any_family_s_field() -> None:
    assert output_tokens({"max_tokens": 7}) == 7
    assert output_tokens({"n_predict": 5, "max_tokens": 7}) == 5
    assert output_tokens({"max_completion_tokens": 9}) == 9
    assert output_tokens({"n_predict": -1}) == DEFAULT_OUTPUT  # no limit: the default room
    assert output_tokens({"max_tokens": True}) == DEFAULT_OUTPUT
    assert output_tokens({}) == DEFAULT_OUTPUT


# ---- a GPU's slots ------------------------------------------------------------------------------


def gpu_load(r: Resolved, gpu: int) -> Load:
    """What the core loads for an automatic request on a machine with a GPU of `gpu` bytes."""
    devices = [
        Device(CPU, "cpu", -1, "cpu", 64 * GIB, 64 * GIB),
        Device("cuda:0", "cuda", 0, "Fake GPU", gpu, gpu),
    ]
    svc = Service(
        Settings.load(environ={}), None, NothingLearned(), devices, None  # type: ignore[arg-type]
    )
    spec, _ = svc.admission.runner_spec(r, {})
    best, *rest = svc.admission.sizings(r, spec, {}, auto=True)
    core = Core(budgets={CPU: 64 * GIB, "cuda:0": gpu})
    core.request(Request(
        id=1, model=r.runner, spec=best.spec, explicit=frozenset(), size=best.size,
        keep_alive=None, arrived=0.0, place=best.place, process=best.process,
    ).offering(rest), 0.0)  # fmt: skip
    (load,) = [a for a in core.drain() if isinstance(a, Load)]
    return load


def test_an_automatic_slot_count_starts_at_a_gpus_where_the_model_goes_wholly_on_gpus(
    long_model: Resolved,
) -> None:
    load = gpu_load(long_model, 80 * GIB)
    assert load.spec.num_parallel == GPU_PARALLEL and load.spec.kv_unified
    assert load.spec.n_ctx == 32768  # and the trained context, as on the CPU
    assert load.fit.layout.n_gpu_layers == long_model.info.n_layer + 1
    # A card too small for the whole model: the CPU's count, as many layers as fit
    small = size(long_model, AUTO_FLOOR) // 2
    load = gpu_load(long_model, small)
    assert load.spec.num_parallel == AUTO_PARALLEL
    assert load.fit.layout.n_gpu_layers < long_model.info.n_layer + 1
