"""Idle slots leave a CPU runner's shared cache (runtime/parking), with a stand-in runner API:
which slots are saved and erased, when, and what a failure leaves. The real path (a real
runner, its slot parked and its conversation restored) is tests/test_slots.py's."""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
from helpers import write_slot

from corral.config import Settings
from corral.core.spec import Layout, RunnerSpec
from corral.runtime.affinity import Slots, prompt_pieces
from corral.runtime.hop import Hop, RunnerClient
from corral.runtime.kvcache import KVCache
from corral.runtime.parking import Parker
from corral.server import kv_cache
from corral.testing import synth


class Lease:
    """A request's lease on a slot, its answer ended (`released`) at `released_at`."""

    released, released_at, generated, prompt_tokens = True, 0.0, 0, None


class Busy(Lease):
    released = False


def prompt(text: str) -> tuple[bytes, ...]:
    return prompt_pieces("/completion", {"prompt": text * 500})


def runner_hop(
    tmp_path: Path, cache: KVCache, slots: Slots, calls: list[tuple[int, str]],
    failing: set[int] | None = None, n: int = 3,
) -> SimpleNamespace:  # fmt: skip
    """A hop whose runner API records the slot actions asked of it (a save of a slot in
    `failing` fails), each asked while the slot is held out of the picks."""
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")

    class API:
        closed = False

        async def slot_action(self, slot: int, action: str, filename: str, timeout: float) -> Any:
            calls.append((slot, action))
            assert slots.free().count(slot) == 0  # held while it is parked
            if action == "save" and failing and slot in failing:
                return "HTTP 500: the disk is full"
            if action == "save":
                write_slot(cache.directory / filename, list(range(100 + slot, 400 + slot)))
                return {"n_saved": 300, "n_written": 1000}
            return {"n_erased": 300}

    spec = RunnerSpec(path=str(model), n_ctx=4096, num_parallel=n, kv_unified=True)
    runner = SimpleNamespace(spec=spec, layout=Layout(), name="m", llama_server=None,
                             slot_save_path=cache.slot_save_path, allocation=None)  # fmt: skip
    return SimpleNamespace(runner=runner, restore=None, restoring=False, api=API(),
                           changed=lambda: None, crowded_at=-math.inf, park_watch=None)  # fmt: skip


async def test_parking_saves_then_erases_and_a_failed_save_keeps_the_conversation(
    tmp_path: Path,
) -> None:
    """Each idle slot worth it is held, saved, then erased, and becomes a parked conversation
    the restore step compares prompts with; a slot whose save fails is not erased and keeps
    its place in the picks. A prompt that overwrites another conversation in its own slot has
    that one saved first."""
    cache = KVCache(tmp_path / "kv", 2**30)
    calls: list[tuple[int, str]] = []
    failing = {0}
    slots = Slots(3, 4096)
    hop = runner_hop(tmp_path, cache, slots, calls, failing)
    parker = Parker(cache)
    a, b = slots.claim(Lease(), prompt("a ")), slots.claim(Lease(), prompt("b "))
    keep = slots.pick(Lease(), prompt("c "))
    assert (a, b) == (0, 1) and keep is not None and keep.slot == 2 and keep.replaced == 0
    assert parker.parks(hop)
    await parker.park(hop, slots, keep)
    assert calls == [(0, "save"), (1, "save"), (1, "erase")]
    assert slots.idle(2) == [0]  # the failed save's slot keeps its conversation
    assert sorted(slots.free()) == [0, 1, 2]  # holds released
    st = hop.restore
    assert st is not None and st.parked == set(st.pending) and len(st.parked) == 1
    assert hop.restoring and cache.stats["parks"] == 1
    # More conversations than slots: a new one takes the least recently used slot, whose
    # conversation it overwrites: that one is saved first (not erased: the prompt takes its
    # cells), the idle ones parked as before.
    failing.clear()
    assert slots.claim(Lease(), prompt("d ")) == 1
    calls.clear()
    over = slots.pick(Busy(), prompt("e "))
    assert over is not None and over.slot == 0 and over.replaced > 0 and not over.own
    await parker.park(hop, slots, over)
    assert calls == [(0, "save"), (1, "save"), (1, "erase"), (2, "save"), (2, "erase")]
    assert sorted(slots.free()) == [1, 2]  # the picked slot stays its request's
    assert len(st.parked) == 3 and cache.stats["parks"] == 3
    # Not where a draft model drafts, nor on a GPU, nor with one slot, nor for a sliding-window
    # model.
    model = hop.runner.spec.path
    swa = str(synth.write_swa_model(tmp_path / "swa.gguf", n_layer=6, sliding_window=128))
    for other in (dict(spec=RunnerSpec(path=model, n_ctx=4096, num_parallel=3,
                                       kv_unified=True, draft="d.gguf")),
                  dict(layout=Layout(n_gpu_layers=10)),
                  dict(spec=RunnerSpec(path=model, n_ctx=4096, num_parallel=1)),
                  dict(spec=RunnerSpec(path=swa, n_ctx=4096, num_parallel=3,
                                       kv_unified=True))):  # fmt: skip
        there = SimpleNamespace(**{**vars(hop), "restore": None,
                                   "runner": SimpleNamespace(**{**vars(hop.runner), **other})})
        assert not parker.parks(there)


async def test_a_slot_idle_for_less_than_park_after_stays_until_it_has_been_idle_that_long(
    tmp_path: Path,
) -> None:
    """CORRAL_KV_PARK_AFTER: while requests run side by side, a slot whose answer ended a moment
    ago (its client's next turn may be on its way) is neither saved nor erased by another
    prompt's park step, and is watched: once idle that long it is parked beside a request
    running (the watch's park step, no prompt about to be read), not where none runs. The
    conversation a prompt overwrites is saved either way."""
    settings = Settings.load({"CORRAL_MODELS": str(tmp_path), "CORRAL_KV_PARK_AFTER": "1h",
                              "CORRAL_KV_CACHE_DIR": str(tmp_path / "kv")}, {})  # fmt: skip
    cache = kv_cache(settings)
    assert cache is not None and cache.park_after == 3600.0
    calls: list[tuple[int, str]] = []
    slots = Slots(3, 4096)
    hop, parker = runner_hop(tmp_path, cache, slots, calls), Parker(cache)
    just, running, other = Lease(), Busy(), Busy()
    just.released_at = time.monotonic()  # a's answer ended just now
    assert slots.claim(just, prompt("a ")) == 0
    assert slots.claim(running, prompt("r ")) == 1  # answering beside the next one
    pick = slots.pick(other, prompt("b "))
    assert pick is not None and pick.slot == 2
    await parker.park(hop, slots, pick)
    assert calls == [] and cache.stats["parks"] == 0 and slots.idle(2) == [0]
    watch = hop.park_watch
    assert watch is not None and not watch.done()  # a's, for an hour
    # Idle that long (as the watch finds it when it wakes): parked while b runs, not after.
    just.released_at -= 3600.0
    running.released, running.released_at = True, time.monotonic()  # r: idle a moment
    other.released = True
    await parker.park(hop, slots, None)
    assert calls == []
    other.released = False
    await parker.park(hop, slots, None)
    assert calls == [(0, "save"), (0, "erase")] and cache.stats["parks"] == 1
    # More conversations than slots: the one a prompt overwrites is saved though it was
    # answered a moment ago (the prompt takes its cells), and not erased.
    calls.clear()
    assert slots.claim(Lease(), prompt("c ")) == 0
    over = slots.pick(Busy(), prompt("d "))
    assert over is not None and over.slot in (0, 1, 2) and over.replaced > 0
    await parker.park(hop, slots, over)
    assert calls[0] == (over.slot, "save") and (over.slot, "erase") not in calls
    watch.cancel()
    # A negative CORRAL_KV_PARK_AFTER: idle slots are never parked, nor watched, even on a
    # runner that serves one request at a time.
    never = kv_cache(Settings.load({"CORRAL_MODELS": str(tmp_path), "CORRAL_KV_PARK_AFTER": "-1",
                                    "CORRAL_KV_CACHE_DIR": str(tmp_path / "kv")}, {}))  # fmt: skip
    assert never is not None
    calls.clear()
    slots = Slots(2, 4096)
    hop, parker = runner_hop(tmp_path, never, slots, calls, n=2), Parker(never)
    slots.claim(Lease(), prompt("a "))
    pick = slots.pick(Busy(), prompt("b "))
    await parker.park(hop, slots, pick)
    assert calls == [] and hop.park_watch is None


async def test_a_runner_serving_one_request_at_a_time_parks_its_idle_slots_at_once(
    tmp_path: Path,
) -> None:
    """One user's agent, turn after turn: once a runner has served one request at a time for
    `park_after`, a new prompt's park step parks the slot idle for a moment too (its return's
    restore has no other prompt ahead of it); a request seen running beside another keeps
    such slots for `park_after` again."""
    cache = KVCache(tmp_path / "kv", 2**30, park_after=3600.0)
    calls: list[tuple[int, str]] = []
    slots = Slots(4, 4096)
    hop, parker = runner_hop(tmp_path, cache, slots, calls, n=4), Parker(cache)
    # A fresh runner has seen nothing side by side.
    a, b, c = Lease(), Busy(), Busy()
    a.released_at = time.monotonic()
    assert slots.claim(a, prompt("a ")) == 0
    pick = slots.pick(b, prompt("b "))
    assert pick is not None and pick.slot == 1
    await parker.park(hop, slots, pick)
    assert calls == [(0, "save"), (0, "erase")] and slots.idle(1) == []
    # c comes while b runs, and b ends while c runs (Hop.ended marks the runner crowded); d
    # comes alone: b's and c's slots, idle a moment, stay for `park_after` since.
    pick = slots.pick(c, prompt("c "))
    assert pick is not None and pick.slot != 1
    await parker.park(hop, slots, pick)
    calls.clear()
    b.released, b.released_at = True, time.monotonic()
    hop.crowded_at = b.released_at
    c.released, c.released_at = True, time.monotonic()
    d = slots.pick(Busy(), prompt("d "))
    assert d is not None and not d.replaced
    await parker.park(hop, slots, d)
    assert calls == [] and len(slots.idle(d.slot)) == 2
    # Once it has served one request at a time that long, they are parked at once (b's own
    # return takes its slot, and the others' leave).
    for h in slots.holders():
        h.released = True
    hop.crowded_at -= 3600.0
    assert hop.park_watch is not None
    hop.park_watch.cancel()
    back = slots.pick(Busy(), prompt("b "))
    assert back is not None and back.own and back.slot == 1
    leaving = slots.idle(1)
    assert len(leaving) == 2 and 1 not in leaving
    await parker.park(hop, slots, back)
    assert calls == [(i, action) for i in leaving for action in ("save", "erase")]
    assert slots.idle(1) == []


def test_a_request_that_ends_while_others_run_marks_its_runner_crowded() -> None:
    """What the park step reads to tell a runner serving one request at a time (Hop.ended, as
    each lease is released): a request that ends while another holds a slot."""
    hop = Hop(cast(Any, SimpleNamespace(name="m")), Slots(2, capacity=4096))
    slots = hop.slots
    assert slots is not None and hop.crowded_at == -math.inf
    running = Busy()
    slots.claim(running, prompt("a "))
    slots.claim(Lease(), prompt("b "))
    hop.ended(None, 0)  # b ended beside a
    assert hop.crowded_at > -math.inf
    hop.crowded_at = -math.inf
    running.released = True
    hop.ended(None, 0)  # a ended alone
    assert hop.crowded_at == -math.inf


async def test_the_watch_parks_a_slot_once_idle_long_enough_beside_a_running_request(
    tmp_path: Path,
) -> None:
    """A slot idle too briefly for the park step is parked by its watch once idle for
    `park_after`, while another request runs (whether the step or the watch parks it depends
    on how long the machine takes: either way it is parked, once)."""
    cache = KVCache(tmp_path / "kv", 2**30, park_after=0.05)
    calls: list[tuple[int, str]] = []
    slots = Slots(2, 4096)
    hop, parker = runner_hop(tmp_path, cache, slots, calls, n=2), Parker(cache)
    just = Lease()
    just.released_at = time.monotonic()
    slots.claim(just, prompt("a "))
    pick = slots.pick(Busy(), prompt("b "))
    assert pick is not None and pick.slot == 1
    await parker.park(hop, slots, pick)
    if hop.park_watch is not None:
        await asyncio.wait_for(hop.park_watch, 60)
    assert calls == [(0, "save"), (0, "erase")] and slots.idle(1) == []


async def test_a_request_granted_while_the_park_step_holds_the_last_free_slot_waits_for_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Corral grants no more requests than slots, but the park step holds a slot while it
    saves and erases it: a request granted meanwhile that finds every slot held waits for
    that hold to end and is pinned to the slot, where before it went unpinned and llama.cpp
    placed it on a slot given to another request (which then waited seconds behind it, its
    cache lost: the edit at 8 clients)."""

    @dataclass(eq=False)
    class Leased:
        hop: Hop
        released: bool = False
        released_at: float = 0.0
        generated: int = 0
        prompt_tokens: int | None = None

    client = RunnerClient()
    hop = Hop(cast(Any, SimpleNamespace(name="m")), Slots(2, capacity=4096))
    slots = hop.slots
    assert slots is not None
    assert slots.claim(Leased(hop), prompt("a ")) == 0  # answering
    parking = slots.hold(1)
    sent: list[dict[str, Any]] = []

    async def send(hop: Hop, path: str, payload: dict[str, Any], streamed: bool,
                   crowded: bool = False) -> Any:  # fmt: skip
        sent.append(payload)
        return b"{}"

    monkeypatch.setattr(client, "_send", send)
    chat = {"messages": [{"role": "user", "content": "b " * 500}]}
    request = asyncio.create_task(client.answer(Leased(hop), "/v1/chat/completions", chat))
    for _ in range(20):
        await asyncio.sleep(0)
    assert sent == [] and not request.done()
    parking.released = True  # the park step's `finally`
    hop.changed()
    await asyncio.wait_for(request, 5)
    assert [p.get("id_slot") for p in sent] == [1]
