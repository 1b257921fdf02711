"""Contexts sized to the machine (core/context.py) and llama.cpp's context refusal as data."""

from __future__ import annotations

import orjson
import pytest

from corral.core.context import (
    AUTO_FLOOR,
    UNKNOWN_TRAINED_CAP,
    auto_context,
    context_grid,
    grown_context,
    next_power_of_two,
)
from corral.runtime.client import ContextOverflow, runner_error

GIB = 1 << 30


def kv_fits(budget: int, per_token: int = 128 * 1024) -> object:
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
