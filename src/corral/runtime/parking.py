"""Idle slots leave a CPU runner's shared cache: parking (the hop's park step).

Every decoding step attends over every used cell of the cache the slots share (llama.cpp's
unified KV cache), idle slots' cells included: on 2 cores with SmolLM2 an answer beside a
3,500-token idle slot made 53 tokens/s, 77 without. So, on a runner of several slots on one
cache, on the CPU, with a KV cache directory and no draft model (its cache is not in the files),
a slot idle for `KVCache.park_after` seconds (CORRAL_KV_PARK_AFTER) is parked: saved as a
conversation (runtime/kvcache's files) and erased (`POST /slots/{id}?action=erase`), held
meanwhile so that no request is pinned there; its conversation's return is restored by the
restore step. A prompt that overwrites another conversation in its own slot has that one saved
first (not erased: the prompt takes its cells).

A slot idle for less is left where it is while requests run side by side: a client back sooner
(a loop's next turn, an agent's quick tool) would find its conversation erased and wait for its
restore, queued in llama.cpp behind the other slots' prompts (6-14 s for an edit at 4 and 8
clients on 2 cores, when every idle slot was parked at once). The park step runs with each
request's pick; a slot left for being idle too briefly is parked once it has been idle long
enough, if requests run beside it then (else the next request's park step sees to it).

A runner that has served one request at a time for `park_after` (one user's agent, turn after
turn) parks every idle slot at once: a return's restore has no other prompt ahead of it, and the
new request runs without the idle cells (a search/replace right after a 2,048-token edit made
55 tokens/s beside them against llama-server's 77, on SmolLM2 on 2 cores).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Protocol

from corral.runtime.affinity import Pick, Slots
from corral.runtime.kvcache import HTTP_TIMEOUT, KVCache, RunnerHop

log = logging.getLogger(__name__)


class ParkingHop(RunnerHop, Protocol):
    """What the park step needs of a runner's hop (runtime/hop.Hop): the restore step's, when
    its requests last ran side by side, and its watch."""

    crowded_at: float  # time.monotonic(): a request ended while others ran (never: -inf)
    park_watch: asyncio.Task[None] | None  # of its slots idle too briefly (`Parker._watch`)


class Parker:
    """The park step of runners whose conversations `kvcache` saves."""

    def __init__(self, kvcache: KVCache) -> None:
        self.kvcache = kvcache

    def parks(self, hop: RunnerHop) -> bool:
        """Whether the runner parks its idle slots: several slots on one shared cache, on the
        CPU, whose conversations are saved (not with a draft model: its cache is not in the
        files), of a model whose cache can go back (`ModelInfo.rolls_back`). Not a sliding-window
        model's: only its few full-attention layers read the idle cells (one in six of Gemma
        3's), and a parked conversation would come back only for a prompt that continues it
        (with llama-server b11434 for none), where left in its slot llama.cpp resumes it from
        its context checkpoints. On a GPU parking is not measured yet: its slots stay as they
        are."""
        runner, spec = hop.runner, hop.runner.spec
        if not (spec.kv_unified and spec.num_parallel > 1 and runner.slot_save_path):
            return False
        if runner.layout.n_gpu_layers or spec.draft:
            return False
        st = self.kvcache.state(hop)
        return bool(st.key) and st.back and st.key not in self.kvcache.no_reuse

    async def park(self, hop: ParkingHop, slots: Slots, pick: Pick | None) -> None:
        """Move the conversations of the slots idle for `park_after` (all idle ones where the
        runner serves one request at a time) out of its shared cache before a prompt is read
        into `pick.slot` (no pick: beside the requests running): saved (a prompt that continues
        one gets it restored), then erased; the one the prompt overwrites there is saved only
        (`Slots.leaving`). A slot whose save fails keeps its conversation. Those idle for less
        are watched (`_watch`)."""
        running = len(slots.holders())
        if pick is None and not running:
            return  # nothing runs beside them: the next request's park step sees to them
        cache, now, after = self.kvcache, time.monotonic(), self.kvcache.park_after
        alone = (pick is not None and running == 1 and not math.isinf(after)
                 and now - hop.crowded_at >= after)  # fmt: skip
        st, saved_any = cache.state(hop), False
        for slot, erase in slots.leaving(pick, now if alone else now - after):
            if erase and slot not in slots.idle(-1):
                continue  # taken meanwhile (a request, the other park step)
            held = slots.hold(slot) if erase else None  # the picked one: the request's lease
            try:
                saved, entry = await cache.save_slot(hop, st.key, slot)
                if not saved:
                    continue
                saved_any = True
                if erase:
                    res = await hop.api.slot_action(slot, "erase", "", HTTP_TIMEOUT)
                    if not isinstance(res, dict) or "n_erased" not in res:
                        log.warning("kv cache: erasing slot %d of '%s' failed: %s",
                                    slot, hop.runner.name, res)  # fmt: skip
                        continue
                    slots.emptied(slot)
                    cache.stats["parks"] += 1
                    log.info("kv cache: parked slot %d of '%s' (%d cells freed)",
                             slot, hop.runner.name, int(res["n_erased"]))  # fmt: skip
                if entry is not None:  # else too short to keep: read again if it returns
                    st.pending[entry.name] = entry.path
                    st.parked.add(entry.name)
                    hop.restoring = True
            finally:
                if held is not None:
                    held.released = True
                hop.changed()
        if saved_any:  # most requests park nothing: no walk of the directory for them
            await asyncio.to_thread(cache.enforce_cap)
        self._watch(hop, slots)

    def _watch(self, hop: ParkingHop, slots: Slots) -> None:
        """Park the slots left for being idle too briefly once they have been idle long
        enough, while requests run beside them (one watch per runner)."""
        watch = hop.park_watch
        if math.isinf(self.kvcache.park_after) or (watch is not None and not watch.done()):
            return  # never parked (a negative CORRAL_KV_PARK_AFTER), or watched already
        if slots.next_idle(time.monotonic() - self.kvcache.park_after) is None:
            return
        # Held by the hop, as long as it lives
        hop.park_watch = asyncio.get_running_loop().create_task(self._later(hop, slots))

    async def _later(self, hop: ParkingHop, slots: Slots) -> None:
        after = self.kvcache.park_after
        while (first := slots.next_idle(time.monotonic() - after)) is not None:
            await asyncio.sleep(first + after - time.monotonic())
            if hop.api.closed:
                return
            try:
                await self.park(hop, slots, None)
            except Exception:  # an optimisation: the next request's park step tries again
                log.exception("kv cache: parking idle slots of '%s' failed", hop.runner.name)
                return
