"""Contexts sized to the machine (core/context.py) and llama.cpp's context refusal as data."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
import pytest

from corral.api.service import Resolved, Service, output_tokens
from corral.config import Settings
from corral.core.context import (
    AUTO_FLOOR,
    DEFAULT_OUTPUT,
    UNKNOWN_TRAINED_CAP,
    auto_context,
    context_grid,
    grown_context,
    next_power_of_two,
)
from corral.core.devices import CPU, Device
from corral.core.gguf import read_model_info
from corral.core.spec import RunnerSpec, spec_estimate
from corral.errors import ApiError
from corral.runtime.journal import Event
from corral.runtime.registry import ModelEntry
from corral.runtime.runner_errors import CacheFull, ContextOverflow, runner_error
from corral.runtime.view import RunnerView, SchedulerView
from corral.testing import synth

GIB = 1 << 30


def kv_fits(budget: int, per_token: int = 128 * 1024) -> Callable[[int], bool]:
    """A model whose runner holds 1 GiB plus `per_token` bytes a token of context."""
    return lambda n_ctx: GIB + n_ctx * per_token <= budget


def test_the_grid_runs_from_the_floor_by_powers_of_two_to_the_trained_context() -> None:
    assert context_grid(32768) == [4096, 8192, 16384, 32768]
    assert context_grid(40960) == [4096, 8192, 16384, 32768, 40960]  # qwen3's 40k
    assert context_grid(2048) == [2048]  # trained below the floor: the trained
    assert context_grid(4096) == [4096]
    assert context_grid(0) == [AUTO_FLOOR]  # the file does not say
    assert context_grid(10000, floor=3000) == [3000, 4096, 8192, 10000]


def test_auto_context_falls_with_memory() -> None:
    trained = 131072
    sizes = [auto_context(trained, kv_fits(budget)) for budget in (40 * GIB, 9 * GIB, 3 * GIB)]
    assert sizes == [131072, 65536, 16384]
    assert sizes == sorted(sizes, reverse=True)


def test_auto_context_is_never_above_the_trained_context() -> None:
    assert auto_context(8192, lambda n: True) == 8192
    assert auto_context(40960, lambda n: True) == 40960
    assert auto_context(2048, lambda n: True) == 2048


def test_auto_context_is_never_below_the_floor_unless_trained_is_smaller() -> None:
    assert auto_context(131072, lambda n: False) == AUTO_FLOOR  # nothing fits: the floor
    assert auto_context(131072, kv_fits(GIB)) == AUTO_FLOOR
    assert auto_context(1024, lambda n: False) == 1024
    assert auto_context(0, lambda n: True) == AUTO_FLOOR


def test_auto_context_stops_at_the_first_size_that_does_not_fit() -> None:
    asked: list[int] = []

    def fits(n: int) -> bool:
        asked.append(n)
        return n <= 16384

    assert auto_context(1 << 20, fits) == 16384
    assert asked == [8192, 16384, 32768]  # the floor is never asked: it is the least


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


# ---- the service's auto context over the scheduler's view -----------------------------------


class FakeScheduler:
    """What Service.auto_ctx reads of the scheduler: view() and listen()."""

    def __init__(self, budgets: dict[str, int], runners: tuple[RunnerView, ...] = ()) -> None:
        self.budgets, self.runners, self.views = budgets, runners, 0
        self.listeners: list[Callable[[Event], None]] = []

    def view(self) -> SchedulerView:
        self.views += 1
        return SchedulerView(
            runners=self.runners, queued={}, budgets=self.budgets, booked={}, reserved={},
            headroom={}, measured={}, devices=(), code=0, tokens={}, raised={},
            disk_seconds_per_byte=0.0, events=(), closing=False, relayed={},
            tokens_per_second={},
        )  # fmt: skip

    def listen(self, fn: Callable[[Event], None]) -> Callable[[], None]:
        self.listeners.append(fn)
        return lambda: None


def runner(model: str, n_ctx: int, held: int = 0, inflight: int = 0) -> RunnerView:
    return RunnerView(
        id=1, model=model, state="ready", draining=False, pid=1, devices={"cpu": held},
        size=held, slots=1, context_length=n_ctx, inflight=inflight, waiting_for_room=0,
        keep_alive=300.0,
        expires_in=300.0, held_for=0.0, pinned=False, priority=0, uses=1, load_cost=1.0,
        progress=None, loading_for=None, load_seconds=1.0, measured=None, measured_devices={},
        page_cache=None, page_cache_at_load=None, tokens_per_second=0.0,
        slot_tokens_per_second=(0.0,),
    )  # fmt: skip


@pytest.fixture(scope="module")
def long_model(tmp_path_factory: pytest.TempPathFactory) -> Resolved:
    path = synth.write_llama_model(
        tmp_path_factory.mktemp("ctx") / "long.gguf", n_layer=2, context_length=32768
    )
    return Resolved("long", ModelEntry("long", path), read_model_info(path), "long")


def size(r: Resolved, n_ctx: int) -> int:
    est = spec_estimate(r.info, RunnerSpec(str(r.entry.path), n_ctx, 1))
    return est.total + est.process


def auto_service(sched: FakeScheduler) -> Service:
    settings = Settings.load(environ={"CORRAL_NUM_PARALLEL": "1"})
    assert settings.context_length is None  # auto is the default
    devices = [Device(CPU, "cpu", -1, "cpu", 64 * GIB, 64 * GIB)]
    return Service(settings, None, sched, devices, None)  # type: ignore[arg-type]


def auto_ctx(svc: Service, r: Resolved) -> int:
    spec, _ = svc.runner_spec(r, {})
    assert spec.n_ctx == AUTO_FLOOR  # the floor, raised by the service
    return svc.auto_ctx(r, spec, {})


def test_auto_takes_the_trained_context_where_memory_allows(long_model: Resolved) -> None:
    assert auto_ctx(auto_service(FakeScheduler({CPU: 64 * GIB})), long_model) == 32768


def test_auto_leaves_busy_models_their_memory_and_takes_idle_models_as_room(
    long_model: Resolved,
) -> None:
    room = (size(long_model, 8192) + size(long_model, 16384)) // 2  # 8,192 fits, 16,384 not
    budget = room + 10 * GIB
    busy = FakeScheduler({CPU: budget}, (runner("other", 4096, 10 * GIB, inflight=1),))
    assert auto_ctx(auto_service(busy), long_model) == 8192
    idle = FakeScheduler({CPU: budget}, (runner("other", 4096, 10 * GIB),))
    assert auto_ctx(auto_service(idle), long_model) == 32768  # an idle model may be evicted
    # no room even at the floor: the floor (the scheduler queues or evicts as for any load)
    full = FakeScheduler({CPU: 10 * GIB}, (runner("other", 4096, 10 * GIB, inflight=1),))
    assert auto_ctx(auto_service(full), long_model) == AUTO_FLOOR


def test_a_loaded_runner_with_at_least_the_floor_is_never_reloaded_for_auto(
    long_model: Resolved,
) -> None:
    sched = FakeScheduler({CPU: 64 * GIB}, (runner("long", 8192),))
    svc = auto_service(sched)
    assert auto_ctx(svc, long_model) == 8192  # not 32,768: no reload nobody asked for
    sched.runners = (runner("long", 1024),)  # a client shrank it: below the floor, auto again
    assert auto_ctx(svc, long_model) == 32768


def test_the_context_an_auto_request_was_served_with_is_remembered_until_a_load_or_stop(
    long_model: Resolved,
) -> None:
    sched = FakeScheduler({CPU: 64 * GIB})
    svc = auto_service(sched)
    svc._served("long", 16384)
    views = sched.views
    assert auto_ctx(svc, long_model) == 16384 and sched.views == views  # no view read
    (listen,) = sched.listeners
    listen(Event("ready", "long", 0.0))
    assert auto_ctx(svc, long_model) == 16384 and sched.views == views
    listen(Event("unload", "long", 0.0))
    assert auto_ctx(svc, long_model) == 32768 and sched.views == views + 1


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
    svc = auto_service(FakeScheduler({CPU: 64 * GIB}))
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
    svc = auto_service(FakeScheduler({CPU: 64 * GIB}))
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
