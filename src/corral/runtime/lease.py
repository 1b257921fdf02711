"""One request's hold on a runner slot (`Lease`), and a request waiting for one (`Ticket`): what
the scheduler hands the rest of corral for a grant."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Protocol

from corral.runtime.hop import Hop
from corral.runtime.meter import Tally
from corral.runtime.runner import Runner


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
            self.released = True
            self.tally.end()
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
