"""Generated tokens counted as corral relays them to clients: the tokens per second that are
true while a stream runs (llama.cpp's own counters move only when a request ends).

Each lease carries a `Tally`; the API layer adds to it as it passes a runner's chunks on (the
byte pass-through counts SSE events, `token_events`; the events path counts the events it
parses) and settles it with llama.cpp's own count at the end. The `Meter` (owned by the
scheduler, read only through its `view()`) sums the tallies per model, per runner and per slot:
a rate is the tokens relayed over the last `window` seconds, so it falls to 0 once a model is
idle. A slot here is corral's numbering of the streams a runner serves at once (the lowest
free index when a stream's first token passes), not llama.cpp's slot id.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson

WINDOW = 5.0  # seconds of relayed tokens a rate spans

# A token's event in llama.cpp's streams: a chat or OpenAI completion chunk before the last
# (`"finish_reason":null`; the chat stream's opening role delta has it too, and comes first),
# or a /completion event before the last (`"stop":false`). The last events (a finish reason,
# the usage, `[DONE]`, `"stop":true`) carry none. Generated text cannot hold these (JSON
# escapes its quotes), so they are counted, not parsed: one pass over the bytes.
_TOKEN = b'"finish_reason":null'
_NATIVE_TOKEN = b'"stop":false'
ROLE_EVENT = b'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"role"'


def token_events(events: bytes) -> int:
    """How many generated tokens these whole SSE events of llama.cpp's carry: one per event
    but those that carry none (a token whose text is held back, e.g. half a UTF-8 character,
    comes with the next; `Tally.settle` makes the total exact at the end)."""
    n = events.count(_TOKEN)
    if n == 0:
        return events.count(_NATIVE_TOKEN)
    return n - 1 if events.startswith(ROLE_EVENT) else n


def count_events(tally: Tally, events: bytes) -> None:
    """Count the tokens of whole SSE events of llama.cpp's as they are relayed; the stream's
    last events (which carry its timings) settle the count with llama.cpp's own."""
    tally.add(token_events(events))
    if b'"timings":{' in events:  # only the last events: one scan of the others
        tally.timed(last_timings(events))


def last_object(data: bytes, key: bytes) -> dict[str, Any] | None:
    """The last `"<key>":{...}` object in `data` of llama.cpp's that hold numbers only (its
    timings, its usage), so that the object ends at the first closing brace; None if there is
    none."""
    head = b'"' + key + b'":{'
    i = data.rfind(head)
    j = data.find(b"}", i)
    if i < 0 or j < 0:
        return None
    try:
        out = orjson.loads(data[i + len(head) - 1 : j + 1])
    except orjson.JSONDecodeError:
        return None
    return out if isinstance(out, dict) else None


def last_timings(data: bytes) -> dict[str, Any] | None:
    """The last timings object of llama.cpp's in `data` (a whole answer, or whole events of a
    stream); None if there is none."""
    return last_object(data, b"timings")


def predicted_tokens(data: bytes) -> int | None:
    """llama.cpp's count of the tokens it generated, from the last timings in `data` (a whole
    answer, or a stream's last events): None if there are none."""
    i = data.rfind(b'"predicted_n":')
    return _number(data, i + 14) if i >= 0 else None


def _number(data: bytes, i: int) -> int | None:
    j = i
    while j < len(data) and 48 <= data[j] <= 57:
        j += 1
    return int(data[i:j]) if j > i else None


def whole_tokens(data: Mapping[str, object]) -> int | None:
    """The generated tokens of a whole (non-streamed) answer of llama.cpp's: its usage, else
    its timings, else /completion's `tokens_predicted`."""
    usage = data.get("usage")
    if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
        return int(usage["completion_tokens"])
    timings = data.get("timings")
    if isinstance(timings, dict) and isinstance(timings.get("predicted_n"), int):
        return int(timings["predicted_n"])
    n = data.get("tokens_predicted")
    return n if isinstance(n, int) else None


def settle_whole(tally: Tally, data: Mapping[str, Any]) -> None:
    """Settle a tally with a whole (non-streamed) answer of llama.cpp's: its generated tokens,
    and its timings or usage for the request log."""
    tally.settle(whole_tokens(data))
    tally.timed(data.get("timings"))
    usage = data.get("usage")
    if tally.prompt is None and isinstance(usage, dict):
        n = usage.get("prompt_tokens")
        tally.prompt = n if isinstance(n, int) and not isinstance(n, bool) else None


def _int(x: object) -> int | None:
    return x if isinstance(x, int) and not isinstance(x, bool) else None


def _ms(x: object) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


class Tally:
    """One request's generated tokens as they pass to its client."""

    __slots__ = ("_meter", "ended", "held", "model", "n0", "predicted_ms", "prompt", "prompt_ms",
                 "runner", "slot", "t0", "times", "total")  # fmt: skip

    def __init__(self, meter: Meter, runner: Hashable, model: str) -> None:
        self._meter = meter
        self.runner = runner
        self.model = model
        self.slot = -1  # corral's index of the stream among its runner's, from its first token
        self.total = 0
        self.t0 = 0.0  # when its first tokens passed (n0 of them)
        self.n0 = 0
        self.times: deque[tuple[float, int]] = deque()  # (when, tokens) within the window
        self.held = 0  # tokens in `times`
        self.ended = False
        # From llama.cpp's timings at the end (the request log's figures): the prompt's
        # tokens (read now or taken from its cache), the time it took to read them and the
        # time spent generating.
        self.prompt: int | None = None
        self.prompt_ms: float | None = None
        self.predicted_ms: float | None = None

    def add(self, n: int) -> None:
        """`n` more tokens went to the client now."""
        if n <= 0:
            return
        meter = self._meter
        now = meter.clock()
        if self.slot < 0 and not self.ended:
            meter._start(self, now, n)
        self.total += n
        if self.ended:  # counted after its lease went back (its totals were taken)
            meter._done[self.model] = meter._done.get(self.model, 0) + n
        times = self.times
        times.append((now, n))
        self.held += n
        if times[0][0] <= now - meter.window:  # one out per one in: `times` stays the window
            self.held -= times.popleft()[1]

    def settle(self, total: int | None) -> None:
        """llama.cpp's own count of the tokens it generated for this request, at its end:
        those not counted as they passed are added now."""
        if total is not None and total > self.total:
            self.add(total - self.total)

    def timed(self, timings: object) -> None:
        """llama.cpp's timings at the end of the request (`prompt_n`, `cache_n`, `prompt_ms`,
        `predicted_n`, `predicted_ms`): the count settled with its own, the rest kept."""
        if not isinstance(timings, dict):
            return
        self.settle(_int(timings.get("predicted_n")))
        read = _int(timings.get("prompt_n"))
        if read is not None:
            self.prompt = read + (_int(timings.get("cache_n")) or 0)
        self.prompt_ms = _ms(timings.get("prompt_ms"))
        self.predicted_ms = _ms(timings.get("predicted_ms"))

    def since_first(self) -> float | None:
        """Seconds since its first tokens passed to the client; None if none has."""
        return self._meter.clock() - self.t0 if self.slot >= 0 else None

    def end(self) -> None:
        """The request is over (its lease went back)."""
        if not self.ended:
            self.ended = True
            self._meter._end(self)

    def rate(self, now: float) -> float:
        """Tokens per second over the last `window` seconds; over the time since its first
        tokens for a stream younger than that (those first tokens start the clock)."""
        start = now - self._meter.window
        times = self.times
        while times and times[0][0] <= start:
            self.held -= times.popleft()[1]
        if not times:
            return 0.0
        if self.t0 > start:
            span = now - self.t0
            return (self.held - self.n0) / span if span > 0 else 0.0
        return self.held / self._meter.window


@dataclass(frozen=True)
class Readings:
    relayed: dict[str, int]  # model -> generated tokens relayed to clients, all along
    rates: dict[str, float]  # model -> tokens per second over the last window
    runner_rates: dict[Hashable, float]  # runner -> tokens per second over the last window
    slot_rates: dict[Hashable, tuple[float, ...]]  # runner -> ... per slot (corral's numbering)


class Meter:
    """Every lease's tally, summed per model, runner and slot when read."""

    def __init__(self, clock: Callable[[], float], window: float = WINDOW) -> None:
        self.clock = clock
        self.window = window
        self._streams: dict[Hashable, list[Tally | None]] = {}  # runner -> its slots' tallies
        self._recent: deque[Tally] = deque()  # ended tallies with tokens within the window
        self._done: dict[str, int] = {}  # model -> tokens of the ended tallies

    def tally(self, runner: Hashable, model: str) -> Tally:
        return Tally(self, runner, model)

    def _start(self, t: Tally, now: float, n: int) -> None:
        slots = self._streams.setdefault(t.runner, [])
        free = next((i for i, s in enumerate(slots) if s is None), len(slots))
        if free == len(slots):
            slots.append(t)
        else:
            slots[free] = t
        t.slot, t.t0, t.n0 = free, now, n

    def _end(self, t: Tally) -> None:
        self._done[t.model] = self._done.get(t.model, 0) + t.total
        slots = self._streams.get(t.runner)
        if slots is not None and 0 <= t.slot < len(slots) and slots[t.slot] is t:
            slots[t.slot] = None
            while slots and slots[-1] is None:
                slots.pop()
            if not slots:
                del self._streams[t.runner]
        recent = self._recent  # ended in that order: the oldest first, gone after a window
        old = self.clock() - self.window
        while recent and (not recent[0].times or recent[0].times[-1][0] <= old):
            recent.popleft()
        if t.times:
            recent.append(t)

    def read(self) -> Readings:
        now = self.clock()
        relayed = dict(self._done)
        rates: dict[str, float] = {}
        runner_rates: dict[Hashable, float] = {}
        slot_rates: dict[Hashable, tuple[float, ...]] = {}
        for runner, slots in self._streams.items():
            per_slot = []
            for t in slots:
                r = t.rate(now) if t is not None else 0.0
                per_slot.append(r)
                if t is not None:
                    relayed[t.model] = relayed.get(t.model, 0) + t.total
                    rates[t.model] = rates.get(t.model, 0.0) + r
            slot_rates[runner] = tuple(per_slot)
            runner_rates[runner] = sum(per_slot)
        recent: deque[Tally] = deque()
        for t in self._recent:
            r = t.rate(now)
            if t.times:
                recent.append(t)
                rates[t.model] = rates.get(t.model, 0.0) + r
                runner_rates[t.runner] = runner_rates.get(t.runner, 0.0) + r
        self._recent = recent
        for m in relayed:
            rates.setdefault(m, 0.0)
        return Readings(relayed, rates, runner_rates, slot_rates)
