"""Conversations keep their slot: which of a runner's slots a generation is sent to.

A runner of several slots keeps each slot's last prompt in its KV cache, and evaluates only what
a new prompt adds to the cache of the slot it lands on. llama.cpp picks a slot itself by prompt
similarity, but among the slots that hold something only: with a conversation in one slot and
three empty ones, a second conversation that shares the first's system prompt lands on the
first's slot and replaces its history, and the two then take turns re-reading their own (agents
run side by side with one system prompt and one set of tools). So corral picks, and pins the
request to its pick (`id_slot`):

- a slot whose content the prompt continues (the conversation's own slot; all but a few bytes
  at its end) destroys nothing: the one with most of the prompt wins;
- else an empty slot, rather than destroy a conversation that may come back, where the cache
  the slots share (llama.cpp's unified KV cache) holds one more;
- else the slot where what the prompt reuses outweighs what it destroys, and failing that the
  least recently used (llama.cpp, short of cells, would clear the first idle slot, whichever
  that is; agents sharing a system prompt would otherwise give up a live session's slot for
  a stale one's); where a copy pays (below), the least recently used in any case, with a
  copy of what the prompt shares with the other.

What a slot holds is known from what corral sent there: the prompt's pieces (each message, the
tools after the system message, or a raw prompt), in characters, a stand-in for tokens that
needs no tokenizing. A slot is busy while the lease that claimed it is not released, so two
requests are never pinned to one slot (which would make one wait for the other).

A conversation that lands on an empty slot (or on one that holds less of its prompt than
another) would read again what it shares with another slot's content: a shared system prompt
and tools, the chat template's preamble. So the pick also names a source (`Pick.source`): the
idle slot (its lease released: llama.cpp would save a generating slot only once it is done)
that holds most of the prompt, when that is more than the chosen slot holds, its copy fits the
shared cache, and copying pays (`copy_pays`, with the runner's figures): the source's whole
content is written and read back, which on a CPU costs about a hundredth of evaluating what it
spares, on a GPU maybe more than that. runtime/slotcopy copies the source's KV state into the
chosen slot first (llama.cpp's slot save and restore); the request then reuses the prefix.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import orjson

# A slot is a conversation's own when the prompt continues all it holds but this many bytes at
# its end: a template may render the last turn's end differently once it is answered (e.g. an
# empty thinking block). Small, so that another conversation sharing a long system prompt is
# not taken for it.
OWN_SLACK = 32
# Prompt bytes per token, low (English is about 4, code 3), so a cache is thought full early
# rather than late: a slot shared wrongly re-reads a conversation, a cache overfilled makes
# llama.cpp clear an idle slot, whichever comes first.
BYTES_PER_TOKEN = 3
# Room in a shared cache is counted at the prompt bytes per token a runner's own requests
# showed (llama.cpp counts their tokens as they end), from prompts of at least this many bytes
# (a short one is mostly its template's tokens), within these bounds.
LEARN_MIN_BYTES = 1024
BYTES_PER_TOKEN_RANGE = (1.5, 6.0)
# The runner paths that read a prompt into a slot's cache.
GENERATION_PATHS = frozenset({"/v1/chat/completions", "/completion", "/v1/completions"})
# A slot holding fewer prompt bytes than this (about 256 tokens) is not parked: its cells cost
# the other slots' steps less than its save and erase (two tasks in the runner's queue) do.
PARK_MIN_BYTES = 256 * BYTES_PER_TOKEN


def parked(size: int) -> bool:
    """Whether a conversation of `size` prompt bytes is worth moving out of a shared cache
    (runtime/parking parks it) where it would stay idle."""
    return size >= PARK_MIN_BYTES


# What a copy between slots costs besides its bytes: two requests to the runner, each a task
# in its queue (seconds).
COPY_OVERHEAD_S = 0.002


# Whether copying a slot's state into another pays: (prompt bytes it spares, bytes it copies).
CopyPays = Callable[[int, int], bool]


class Holder(Protocol):
    """What claims a slot (a scheduler Lease): the slot is free again once it is released."""

    released: bool
    released_at: float  # when it was released (time.monotonic()): its slot is idle since

    @property
    def generated(self) -> int:
        """The tokens it has answered so far: they hold cells of a shared cache too."""
        ...

    @property
    def prompt_tokens(self) -> int | None:
        """Its prompt's tokens as llama.cpp counted them, once it has ended (else None)."""
        ...


@dataclass
class _Held:
    """A slot held by corral itself (while it is parked), not by a request."""

    released: bool = False
    released_at: float = 0.0
    generated: int = 0
    prompt_tokens: int | None = None


@dataclass(frozen=True)
class Pick:
    """Where a prompt goes: `slot`; and `source`, an idle slot that holds more of the prompt
    than `slot` does (None if none): it shares `shared` bytes with the prompt, `slot` shares
    `held`, so its state copied into `slot` first spares evaluating `spared` bytes, and copies
    all `source_size` bytes it holds. `own`: `slot` holds the conversation the prompt continues
    (no saved state can give it more). `replaced`: bytes of another conversation in `slot` that
    the prompt does not share and overwrites."""

    slot: int
    source: int | None = None
    shared: int = 0
    held: int = 0
    source_size: int = 0
    own: bool = False
    replaced: int = 0

    @property
    def spared(self) -> int:
        return self.shared - self.held


def copy_pays(
    shared: int, source_size: int, kv_bytes_per_token: float, io_bps: float,
    prompt_tps: float | None,
) -> bool:  # fmt: skip
    """Whether copying a slot's state costs less than evaluating what it spares: the source's
    whole content (`source_size` prompt bytes, each token `kv_bytes_per_token` of state) is
    written and read back at `io_bps` bytes/s, against `shared` prompt bytes at the runner's
    `prompt_tps` tokens/s. False when a figure is unknown."""
    if not prompt_tps or prompt_tps <= 0 or kv_bytes_per_token <= 0 or io_bps <= 0:
        return False
    copy_s = COPY_OVERHEAD_S + 2 * source_size / BYTES_PER_TOKEN * kv_bytes_per_token / io_bps
    return shared / BYTES_PER_TOKEN / prompt_tps > copy_s


def has_media(payload: dict[str, Any]) -> bool:
    """Images or audio in the request: their chunks are not text tokens corral can match."""
    for m in payload.get("messages") or ():
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list) and any(
            isinstance(p, dict) and p.get("type") not in (None, "text") for p in content
        ):
            return True
    prompt = payload.get("prompt")
    return isinstance(prompt, dict) or (
        isinstance(prompt, list) and any(isinstance(p, dict) for p in prompt)
    )


def prompt_pieces(path: str, payload: Mapping[str, Any]) -> tuple[bytes, ...]:
    """The prompt of a request to a runner, as pieces in the order its template renders them
    (near enough): a chat's system message, its tools, then each other message; a raw prompt
    whole (strings and token ids alike)."""
    if path == "/v1/chat/completions":
        messages = payload.get("messages") or ()
        out = [orjson.dumps(m) for m in messages]
        if payload.get("tools"):
            at = 1 if messages and isinstance(messages[0], dict) and messages[0].get(
                "role") in ("system", "developer") else 0  # fmt: skip
            out.insert(at, orjson.dumps(payload["tools"]))
        return tuple(out)
    prompt = payload.get("prompt")
    parts = prompt if isinstance(prompt, list) else () if prompt is None else [prompt]
    # Text as its bytes, with no JSON around it: the next turn's prompt continues this one's
    # text, and a closing quote would stand in the way.
    return tuple(p.encode() if isinstance(p, str) else orjson.dumps(p) for p in parts)


def shared_length(a: Sequence[bytes], b: Sequence[bytes]) -> int:
    """Bytes at the start of two prompts' pieces that are the same: whole equal pieces, then
    the common start of the first pieces that differ."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x == y:
            n += len(x)
            continue
        lo, hi = 0, min(len(x), len(y))  # the longest common start, by halving
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if x[:mid] == y[:mid]:
                lo = mid
            else:
                hi = mid - 1
        return n + lo
    return n


class Slots:
    """One runner's slots as corral hands them out: who holds each, and what each last read.
    `capacity`: the tokens all slots share (a unified KV cache), None when each has its own."""

    def __init__(self, n: int, capacity: int | None = None) -> None:
        self.capacity = capacity
        self._holders: list[Holder | None] = [None] * n
        self._held: list[tuple[bytes, ...]] = [()] * n  # each slot's last prompt
        self._sizes = [0] * n  # its bytes
        self._used = [0] * n  # when each was last claimed (a counter, for least recent use)
        self._clock = itertools.count(1)
        # Prompt bytes per token in a shared cache, as this runner's ended requests showed.
        self.bytes_per_token = float(BYTES_PER_TOKEN)
        self._taught = [True] * n  # whether a slot's last prompt has taught it
        self._learned = False

    def free(self, holder: Holder | None = None) -> list[int]:
        """The slots no unreleased lease holds (but `holder`, whose next prompt replaces its
        last)."""
        return [i for i, h in enumerate(self._holders) if h is None or h.released or h is holder]

    def holders(self) -> list[Holder]:
        """The unreleased leases that hold slots."""
        return [h for h in self._holders if h is not None and not h.released]

    def crowds(self, holder: Holder, skip: Collection[Holder] = ()) -> bool:
        """Whether `holder`'s prompt (in the slot it claimed) would not fit the shared cache
        beside the prompts and answers so far of the slots other unreleased holders (but those
        in `skip`) are reading or answering: llama.cpp would fail them all once the cache is
        full."""
        if self.capacity is None:
            return False
        self._learn()
        per_token = self.bytes_per_token
        mine = others = 0.0
        skipped = {id(h) for h in skip}  # leases compare by identity
        for h, size in zip(self._holders, self._sizes, strict=True):
            if h is holder:
                mine += size / per_token
            elif h is not None and not h.released and id(h) not in skipped:
                others += size / per_token + h.generated
        return others > 0 and mine + others > self.capacity

    def _learn(self) -> None:
        """Take the prompt bytes per token of the requests that ended since: the first measure
        replaces the guess, later ones move it halfway."""
        low, high = BYTES_PER_TOKEN_RANGE
        for i, h in enumerate(self._holders):
            if self._taught[i] or h is None or not h.released:
                continue
            self._taught[i] = True
            tokens = h.prompt_tokens
            if tokens and self._sizes[i] >= LEARN_MIN_BYTES:
                seen = min(max(self._sizes[i] / tokens, low), high)
                was = self.bytes_per_token if self._learned else seen
                self.bytes_per_token, self._learned = (was + seen) / 2, True

    def claim(self, holder: Holder, pieces: tuple[bytes, ...]) -> int | None:
        """The slot for a prompt (see the module's rules), now `holder`'s; None when every slot
        is held (corral grants no more requests than slots, and runtime/hop waits out the park
        step's holds: only a request sent twice under one lease meets that, and llama.cpp then
        picks)."""
        pick = self.pick(holder, pieces)
        return None if pick is None else pick.slot

    def pick(
        self, holder: Holder, pieces: tuple[bytes, ...], pays: CopyPays | None = None
    ) -> Pick | None:
        """`claim`, with the idle slot to copy into the slot first, if any (see `Pick`).
        `pays(spared, source_size)`: whether a copy pays on this runner (`copy_pays` with its
        figures); given, a source is named only where it does, and with no empty slot the least
        recently used takes the prompt, a copy of what it shares with another slot's content
        in front of it, rather than destroy that other conversation."""
        free = self.free(holder)
        if not free:
            return None
        size = sum(len(p) for p in pieces)
        shared = {i: shared_length(self._held[i], pieces) if self._sizes[i] else 0 for i in free}
        own = [i for i in free if self._sizes[i] and self._sizes[i] - shared[i] <= OWN_SLACK]
        empty = [i for i in free if not self._sizes[i]]
        if own:
            slot = max(own, key=lambda i: (shared[i], -self._used[i]))
        elif empty and self._fits(size):
            slot = empty[0]
        else:
            # No empty slot, or a shared cache too full for one more conversation (llama.cpp
            # would clear the first idle slot, whichever that is): the slot the prompt reuses
            # more of than it destroys, else the least recently used, the conversation least
            # likely to come back.
            pool = [i for i in free if self._sizes[i]] or free
            gain = {i: 2 * shared[i] - self._sizes[i] for i in pool}
            lru = min(pool, key=lambda i: self._used[i])
            slot = lru
            if max(gain.values()) > 0:
                slot = max(pool, key=lambda i: (gain[i], -self._used[i]))
                # Where a copy pays, the least recently used gives way instead and gets what
                # the prompt shares copied: both conversations are kept.
                if pays is not None and self._source(lru, free, shared, pays) is not None:
                    slot = lru
        source = self._source(slot, free, shared, pays)
        replaced = 0 if slot in own else self._sizes[slot] - shared[slot]
        pick = Pick(slot, held=shared[slot], own=slot in own, replaced=replaced)
        if source is not None:
            pick = Pick(slot, source, shared[source], shared[slot], self._sizes[source],
                        replaced=replaced)  # fmt: skip
        self._learn()  # before the slot's last prompt is replaced
        self._holders[slot] = holder
        self._held[slot] = pieces
        self._sizes[slot] = size
        self._taught[slot] = False
        self._used[slot] = next(self._clock)
        return pick

    def _source(
        self, slot: int, free: list[int], shared: dict[int, int], pays: CopyPays | None
    ) -> int | None:
        """The idle slot that holds most of the prompt, if more than `slot` holds (the one
        that holds least besides, the cheapest to copy), where its copy fits beside what the
        others hold (for a moment `slot` holds all of it) and pays."""
        idle = [
            i for i in free if i != slot and self._sizes[i] and shared[i] > shared[slot]
            and ((h := self._holders[i]) is None or h.released)  # not the holder's own, busy
        ]  # fmt: skip
        if not idle:
            return None
        source = max(idle, key=lambda i: (shared[i], -self._sizes[i], self._used[i]))
        if self.capacity is not None:
            after = sum(self._sizes) - self._sizes[slot] + self._sizes[source]
            if after / BYTES_PER_TOKEN > self.capacity:
                return None
        if pays is not None and not pays(shared[source] - shared[slot], self._sizes[source]):
            return None
        return source

    def idle(self, keep: int, since: float = math.inf) -> list[int]:
        """The slots but `keep` that no lease has held since `since` (a time.monotonic()) and
        that hold a prompt worth moving out of a shared cache (runtime/parking parks them),
        fullest first."""
        return sorted((
            i for i, h in enumerate(self._holders)
            if i != keep and parked(self._sizes[i])
            and (h is None or (h.released and h.released_at <= since))
        ), key=lambda i: -self._sizes[i])  # fmt: skip

    def leaving(self, pick: Pick | None, since: float = math.inf) -> list[tuple[int, bool]]:
        """The slots whose conversations leave a shared cache before `pick`'s prompt is read
        (runtime/parking parks them; no pick: while others run), each with whether it is
        erased: first the picked slot, where the prompt overwrites a conversation worth keeping
        that it does not continue (saved only: the prompt takes its cells; with more clients
        than slots, the one whose answer just ended), then those idle since `since` (`idle`)."""
        if pick is None:
            return [(i, True) for i in self.idle(-1, since)]
        replaced = [(pick.slot, False)] if parked(pick.replaced) else []
        return replaced + [(i, True) for i in self.idle(pick.slot, since)]

    def next_idle(self, since: float) -> float | None:
        """The earliest release after `since` of a slot still idle and worth parking (the next
        to have been idle long enough, runtime/parking), or None."""
        return min((
            h.released_at for i, h in enumerate(self._holders)
            if h is not None and h.released and h.released_at > since and parked(self._sizes[i])
        ), default=None)  # fmt: skip

    def hold(self, slot: int) -> Holder:
        """`slot` held, out of the picks, until the holder returned is released."""
        holder = _Held()
        self._learn()  # before its last prompt may be forgotten
        self._holders[slot] = holder
        return holder

    def emptied(self, slot: int) -> None:
        """What `slot` held is gone from the runner's cache (parked)."""
        self._held[slot], self._sizes[slot] = (), 0

    def _fits(self, size: int) -> bool:
        """Whether a prompt of `size` bytes fits beside what every slot holds."""
        if self.capacity is None:
            return True
        return (sum(self._sizes) + size) / BYTES_PER_TOKEN <= self.capacity
