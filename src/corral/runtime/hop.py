"""One ready runner's hop from a granted slot to its llama.cpp server, in one place: the `Hop`
corral keeps per runner (on the scheduler's record, `Record.hop`), the `Lease` that hands it to
each granted request (with a `Ticket` for a request waiting for one), and `RunnerClient`, which
sends a request under its lease through the hop's policies as one named pipeline:

    pick -> park -> restore -> copy -> admit -> send -> continue

- pick: on a runner of several slots, the slot a generation goes to (runtime/affinity);
- park: on a CPU runner whose slots share one cache, the conversations of slots idle for a
  while are saved and erased from it before the prompt is read (runtime/parking: their cells
  would slow every decoding step), and the conversation the prompt overwrites in its own slot
  is saved;
- restore: among a reloaded runner's first requests, or once it parked a conversation, the
  saved conversation a prompt continues (or shares most with) is restored into a free slot,
  and the request pinned there instead (runtime/kvcache);
- copy: a new conversation starts from the idle slot that holds most of its prompt, where
  copying that costs less than evaluating it (runtime/slotcopy; not after a restore, not from
  a slot that was parked: its restore serves instead);
- admit: on a shared cache, a prompt that would not fit beside the running ones waits for room
  (first come first served; every release of a lease wakes those waiting, nothing polls);
- send: the runner's API (runtime/runner_api): a whole answer, or a stream;
- continue: a stream the shared cache fills mid-answer is continued where it stopped
  (runtime/continuation); a request that filled it before answering is sent again alone.

A `Hop` holds:
- `api`: the runner's HTTP API (runtime/runner_api);
- `slots`: with several slots, which a generation goes to and what each holds
  (runtime/affinity);
- `waiting`: the requests waiting for room in its shared KV cache, first come first served;
- `restore`: its saved conversations not restored yet (runtime/kvcache; `restoring` is false
  once none is left to compare, so later requests skip the check);
- `copies`: its figures for copying a slot's state into another (runtime/slotcopy);
- `context`, `contexted`: the context its ended requests generated their tokens at, which the
  measure reads with the runner's counters (core/drafting.where).

A runner's failure or refusal is the client's error (`ApiError`: llama.cpp's refusals of the
request are 4xx with llama.cpp's message; a runner that fails says why, `Runner.why_failed`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, overload

import orjson

from corral.errors import ApiError
from corral.runtime.affinity import (
    GENERATION_PATHS,
    CopyPays,
    Holder,
    Pick,
    Slots,
    parked,
    prompt_pieces,
)
from corral.runtime.continuation import ContinuedStream, Upstream, continuable
from corral.runtime.kvcache import KVCache
from corral.runtime.meter import Tally
from corral.runtime.parking import Parker
from corral.runtime.runner import Runner
from corral.runtime.runner_api import UPSTREAM_ERRORS, RunnerAPI, RunnerStream
from corral.runtime.runner_errors import CacheFull, is_cache_full, stream_error
from corral.runtime.slotcopy import SlotCopier

if TYPE_CHECKING:
    from corral.runtime.kvcache import RestoreState
    from corral.runtime.slotcopy import CopyState

log = logging.getLogger(__name__)

# ---- the hop of one runner -----------------------------------------------------------------


@dataclass(eq=False)
class Hop:
    runner: Runner
    slots: Slots | None = None
    waiting: list[Holder] = field(default_factory=list)
    restore: RestoreState | None = None
    restoring: bool = True  # until runtime/kvcache says no saved conversation is left to check
    copies: CopyState | None = None
    # When one of its requests last ended while others ran (time.monotonic()): until
    # CORRAL_KV_PARK_AFTER has passed since, runtime/parking leaves a slot idle for less where
    # it is; and the watch that parks such slots later
    crowded_at: float = -math.inf
    park_watch: asyncio.Task[None] | None = None
    clock: Callable[[], float] = time.monotonic  # the scheduler's: when a wait for room began
    # Its requests that ended: their generated tokens times the context each was generated
    # at, summed, and those tokens (core/drafting.Counters: auto compares speeds by context)
    context: float = 0.0
    contexted: int = 0
    _changed: asyncio.Event | None = None
    # id(holder) -> (its request's id, when it began to wait for room), while it waits
    _since: dict[int, tuple[int | None, float]] = field(default_factory=dict)

    @classmethod
    def of(cls, runner: Runner, clock: Callable[[], float] = time.monotonic) -> Hop:
        spec = runner.spec
        slots = None
        if spec.num_parallel > 1:
            slots = Slots(spec.num_parallel, spec.n_ctx if spec.kv_unified else None)
        return cls(runner, slots, clock=clock)

    def waiters(self) -> list[tuple[int | None, float]]:
        """Those waiting for room, first come first served: each one's request id (None for
        a holder that is not a scheduler Lease) and when it began to wait."""
        return [self._since.get(id(h), (None, 0.0)) for h in self.waiting]

    @property
    def api(self) -> RunnerAPI:
        api = self.runner.api
        assert api is not None, "a hop is made for a runner that serves"
        return api

    def ended(self, prompt: int | None, generated: int) -> None:
        """A request ended: its `prompt` tokens (None: not known) and `generated` ones; one that
        ends while others hold slots marks the runner crowded (`crowded_at`)."""
        if prompt is not None and generated > 0:
            self.context += generated * (prompt + generated / 2)
            self.contexted += generated
        if self.slots is not None and self.slots.holders():
            self.crowded_at = time.monotonic()

    def changed(self) -> None:
        """A lease of this runner was released, or a request began or ended its wait: those
        waiting for room look again."""
        event, self._changed = self._changed, None
        if event is not None:
            event.set()

    async def until(self, ready: Callable[[], bool]) -> None:
        """Wait until `ready()`, looking again at each `changed()`."""
        while not ready():
            if self._changed is None:
                self._changed = asyncio.Event()
            await self._changed.wait()

    async def turn(self, holder: Holder, ready: Callable[[list[Holder]], bool]) -> None:
        """Wait for `holder`'s turn among the requests waiting for room (first come, first
        served) and for `ready(those waiting)`; requests that wait do not count as running, so
        two never wait for each other."""
        waiting = self.waiting
        waiting.append(holder)
        self._since[id(holder)] = (
            holder.request_id if isinstance(holder, Lease) else None, self.clock()
        )
        self.changed()  # one waiting to run alone may wait only for this one to wait too
        try:
            while not (waiting[0] is holder and ready(waiting)):
                if self._changed is None:
                    self._changed = asyncio.Event()
                await self._changed.wait()
        finally:
            # by identity: leases are dataclasses, equal by their fields
            del waiting[next(i for i, w in enumerate(waiting) if w is holder)]
            self._since.pop(id(holder), None)
            self.changed()


class Leased(Holder, Protocol):
    """What a request is sent under: its slot's lease (a scheduler Lease) and its runner's
    hop."""

    @property
    def hop(self) -> Hop: ...


# ---- a request's hold on a slot ------------------------------------------------------------


class Grants(Protocol):
    """The scheduler, as a lease reaches it."""

    def _release(self, request_id: int, tool_call: bool = False) -> None: ...

    def _runner_failed(self, runner: Runner) -> None: ...


@dataclass
class Ticket:
    id: int
    arrived: float
    fut: asyncio.Future[Hop]


@dataclass
class Lease:
    """A granted request's hold on one runner slot. Release exactly once (idempotent)."""

    scheduler: Grants
    request_id: int
    runner: Runner
    waited: float  # seconds from arrival to grant (queueing + loading)
    loaded: bool  # this request waited for its runner to load
    tally: Tally  # its generated tokens, counted as they are relayed to its client
    hop: Hop  # its runner's hop (runtime/hop): what the request is sent through
    released: bool = False
    released_at: float = 0.0  # when (time.monotonic()): its slot is idle since (affinity)
    # The answer ended in a tool call (set by the API layer as the end passes): the agent will
    # be back with the result, so the runner is held for that turn on release.
    tool_call: bool = False

    @property
    def generated(self) -> int:
        """The tokens relayed to its client so far (runtime/affinity counts their cells)."""
        return self.tally.total

    @property
    def prompt_tokens(self) -> int | None:
        """Its prompt's tokens as llama.cpp counted them at the end (runtime/affinity learns
        bytes per token from them)."""
        return self.tally.prompt

    def release(self) -> None:
        if not self.released:
            self.released, self.released_at = True, time.monotonic()
            self.tally.end()
            self.hop.ended(self.tally.prompt, self.tally.total)
            self.scheduler._release(self.request_id, self.tool_call)
            self.hop.changed()  # a slot, and room in a shared cache, for those waiting

    def runner_failed(self) -> None:
        """Its runner died of running out of memory before answering: it gets no more
        requests, and its model is booked higher from now on (a retry is placed with that)."""
        self.scheduler._runner_failed(self.runner)

    # `async with await service.lease(...) as lease:` returns it however the block ends.
    async def __aenter__(self) -> Lease:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release()


# ---- the pipeline ---------------------------------------------------------------------------


def _parked_or(pays: CopyPays | None) -> CopyPays:
    """Whether a new conversation starts from an idle slot's state where idle slots are parked:
    one long enough to be parked is saved anyway, and its start restored from that, as if a
    copy always paid; a shorter one stays where it is and is copied where that pays (else a
    new conversation would evaluate the system prompt it shares with it again: llama.cpp alone
    reuses it in that slot)."""
    return lambda spared, size: parked(size) or (pays is not None and pays(spared, size))


class RunnerClient:
    """Requests sent under a lease, through the hop's pipeline (see the module). With a KV
    cache (server.kv_cache), a reloaded runner's first requests get the saved conversation
    they continue restored first, and a new conversation gets the state of the idle slot that
    holds most of its prompt copied into its own."""

    def __init__(self, kvcache: KVCache | None = None) -> None:
        self.kvcache = kvcache
        self.copier = SlotCopier(kvcache) if kvcache is not None else None
        self.parker = Parker(kvcache) if kvcache is not None else None

    async def answer(self, lease: Leased, path: str, payload: dict[str, Any]) -> bytes:
        """The runner's whole answer to `payload` on `path`."""
        return await self._hop(lease, path, payload, False)

    async def stream(self, lease: Leased, path: str, payload: dict[str, Any]) -> Upstream:
        """The runner's streamed answer, read by a RunnerStream (which relays a fast runner's
        tokens a few at a time), continued should a shared cache fill mid-answer."""
        return await self._hop(lease, path, {**payload, "stream": True}, True)

    async def post_json(self, lease: Leased, path: str, payload: dict[str, Any]) -> Any:
        """The runner's whole answer, one JSON document, parsed."""
        return orjson.loads(await self.answer(lease, path, payload))

    @overload
    async def _hop(
        self, lease: Leased, path: str, payload: dict[str, Any], streamed: Literal[True]
    ) -> Upstream: ...

    @overload
    async def _hop(
        self, lease: Leased, path: str, payload: dict[str, Any], streamed: Literal[False]
    ) -> bytes: ...

    async def _hop(
        self, lease: Leased, path: str, payload: dict[str, Any], streamed: bool
    ) -> Upstream | bytes:
        hop = lease.hop
        if path not in GENERATION_PATHS:
            return await self._send(hop, path, payload, streamed)
        pick, copier, held = None, None, 0
        kvcache = self.kvcache
        parker = self.parker
        if hop.slots is None or parker is None or not parker.parks(hop):
            parker = None  # this runner parks nothing
        if hop.slots is not None:  # pick
            # Every slot held, one by the park step (corral grants no more requests than
            # slots): wait for it (its save and erase take milliseconds). Sent unpinned, the
            # request would land where llama.cpp likes, on a slot another request was given.
            slots = hop.slots
            await hop.until(lambda: bool(slots.free(lease)))
            if self.copier is not None and self.copier.wants(hop, path, payload):
                copier = self.copier
                await copier.refresh(hop)
            pays = copier.pays(hop) if copier is not None else None
            if parker is not None:
                pays = _parked_or(pays)
            payload, pick = self._pick(hop.slots, path, payload, lease, pays)
            if pick is not None:
                held = int(pick.held / hop.slots.bytes_per_token)
                if parker is not None:  # park
                    # The idle slots' conversations leave the shared cache before this
                    # prompt is read (it then takes the cells they held), and the one it
                    # overwrites in its slot is saved.
                    await parker.park(hop, hop.slots, pick)
        own = pick is not None and pick.own
        if kvcache is not None and hop.restoring and not own and kvcache.wants(hop):  # restore
            # Among a runner's first requests, or a conversation it parked: restore the saved
            # conversation this prompt continues, if any, and pin the request to its slot (not
            # for a conversation back in its own slot: nothing saved holds more of it).
            prepared = await kvcache.prepare(hop, path, payload, held)
            if prepared is not payload:  # restored (a new payload, pinned to its slot)
                pick = None
            payload = prepared
        if (pick is not None and pick.source is not None and copier is not None
                and not (parker is not None and parked(pick.source_size))):  # copy  # fmt: skip
            # A new conversation on a slot of its own: start it from the idle slot that holds
            # most of its prompt (copying that costs less than evaluating it).
            await copier.copy(hop, pick)
        if hop.slots is None or "id_slot" not in payload:
            return await self._send(hop, path, payload, streamed)
        return await self._admitted(hop, hop.slots, path, payload, lease, streamed)

    def _pick(
        self, slots: Slots, path: str, payload: dict[str, Any], lease: Holder,
        pays: CopyPays | None,
    ) -> tuple[dict[str, Any], Pick | None]:  # fmt: skip
        pick = slots.pick(lease, prompt_pieces(path, payload), pays)
        if pick is None:
            return payload, None
        return {**payload, "id_slot": pick.slot}, pick

    async def _admitted(
        self, hop: Hop, slots: Slots, path: str, payload: dict[str, Any], lease: Holder,
        streamed: bool,
    ) -> Upstream | bytes:  # fmt: skip
        """admit -> send -> continue, for a request pinned to a slot. Requests running at once
        on one shared cache (kv_unified) fail together when their prompts outgrow it: llama.cpp
        fails every slot then processing, though each fits alone (a prompt longer than the
        context is refused before it starts)."""
        crowded = any(h is not lease for h in slots.holders())
        if crowded and (slots.crowds(lease) or hop.waiting):
            # Its prompt would not fit beside the others' (as estimated), or requests wait for
            # room already (one waiting to run alone would wait for ever behind newcomers that
            # fit): it waits, first come first served, until they leave room for it.
            log.info("the shared context of '%s' is full: a request waits for room",
                     hop.runner.name)  # fmt: skip
            await hop.turn(lease, lambda waiting: not slots.crowds(lease, waiting))
        resp: Upstream | bytes
        try:
            resp = await self._send(hop, path, payload, streamed, crowded)
        except CacheFull:  # an answer, or a stream's first event (nothing relayed yet)
            # The estimate was short and the cache filled up: sent once more, alone.
            log.info("the shared context of '%s' filled up: a request waits for the others "
                     "to end", hop.runner.name)  # fmt: skip
            resp = await self._alone(hop, slots, path, payload, lease, streamed)
        if (
            slots.capacity is not None
            and not isinstance(resp, bytes)
            and continuable(path, payload)
        ):
            # A stream the shared cache fills mid-answer is continued where it stopped.
            async def again(more: dict[str, Any]) -> Upstream:
                stream = await self._alone(hop, slots, path, more, lease, True)
                assert not isinstance(stream, bytes)
                return stream

            async def count(text: str) -> int:
                try:
                    return len(await hop.api.tokenize(text))
                except (ApiError, *UPSTREAM_ERRORS, KeyError, TypeError):
                    return 0  # the counts then include the prefill

            return ContinuedStream(resp, path, payload, again, count)
        return resp

    async def _alone(
        self, hop: Hop, slots: Slots, path: str, payload: dict[str, Any], lease: Holder,
        streamed: bool,
    ) -> Upstream | bytes:  # fmt: skip
        """`_send` once no other request runs beside this one on the shared cache, one such
        request at a time."""
        await hop.turn(lease, lambda waiting: all(
            h is lease or any(h is w for w in waiting) for h in slots.holders()
        ))  # fmt: skip
        return await self._send(hop, path, payload, streamed)

    async def _send(
        self, hop: Hop, path: str, payload: dict[str, Any], streamed: bool, crowded: bool = False
    ) -> RunnerStream | bytes:
        """The runner's answer; CacheFull if it says its shared cache filled up (`crowded`: a
        stream's first event is read first, as llama.cpp says so in the stream)."""
        if not streamed:
            return await hop.api.answer(path, payload)
        stream = await hop.api.stream(path, payload)
        if crowded:
            try:
                first = await stream.peek()
            except UPSTREAM_ERRORS:
                first = b""  # the relay reports it, as for any stream cut short
            error = stream_error(first)
            if error is not None and is_cache_full(error):
                stream.close()
                raise CacheFull(error)
        return stream
