"""One ready runner's hop from a granted slot to its llama.cpp server: what corral keeps per
runner between the scheduler's grant and the runner's answer, in one object on the scheduler's
record (`Record.hop`), handed to each request with its lease (`Lease.hop`).

- `api`: the runner's HTTP API (runtime/runner_api);
- `slots`: with several slots, which a generation goes to and what each holds
  (runtime/affinity);
- `waiting`: the requests waiting for room in its shared KV cache, first come first served;
  every release of one of its leases (`changed`) wakes them, nothing polls;
- `restore`: its saved conversations not restored yet (runtime/kvcache);
- `copies`: its figures for copying a slot's state into another (runtime/slotcopy).

runtime/client runs the hop's policies over it, in this order: pick -> restore -> copy ->
admit -> send -> continue.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from corral.runtime.affinity import Holder, Slots

if TYPE_CHECKING:
    from corral.runtime.kvcache import RestoreState
    from corral.runtime.runner import Runner
    from corral.runtime.runner_api import RunnerAPI
    from corral.runtime.slotcopy import CopyState


@dataclass(eq=False)
class Hop:
    runner: Runner
    slots: Slots | None = None
    waiting: list[Holder] = field(default_factory=list)
    restore: RestoreState | None = None
    copies: CopyState | None = None
    _changed: asyncio.Event | None = None

    @classmethod
    def of(cls, runner: Runner) -> Hop:
        spec = runner.spec
        slots = None
        if spec.num_parallel > 1:
            slots = Slots(spec.num_parallel, spec.n_ctx if spec.kv_unified else None)
        return cls(runner, slots)

    @property
    def api(self) -> RunnerAPI:
        api = self.runner.api
        assert api is not None, "a hop is made for a runner that serves"
        return api

    def changed(self) -> None:
        """A lease of this runner was released, or a request began or ended its wait: those
        waiting for room look again."""
        event, self._changed = self._changed, None
        if event is not None:
            event.set()

    async def turn(self, holder: Holder, ready: Callable[[list[Holder]], bool]) -> None:
        """Wait for `holder`'s turn among the requests waiting for room (first come, first
        served) and for `ready(those waiting)`; requests that wait do not count as running, so
        two never wait for each other."""
        waiting = self.waiting
        waiting.append(holder)
        self.changed()  # one waiting to run alone may wait only for this one to wait too
        try:
            while not (waiting[0] is holder and ready(waiting)):
                if self._changed is None:
                    self._changed = asyncio.Event()
                await self._changed.wait()
        finally:
            # by identity: leases are dataclasses, equal by their fields
            del waiting[next(i for i, w in enumerate(waiting) if w is holder)]
            self.changed()


class Leased(Holder, Protocol):
    """What a request is sent under: its slot's lease (a scheduler Lease) and its runner's
    hop."""

    @property
    def hop(self) -> Hop: ...
