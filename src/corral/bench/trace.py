"""Multi-model request traces and offline simulations of them (pure: seeded, no I/O).

`generate_trace` makes a reproducible, realistic mix: chat sessions on models picked with
Zipf-like popularity, one chat model in a long session that spans the whole trace, an embedding
model hit constantly, and bursts (a batch job hammering one model). `simulate` replays the
order of a trace through the real scheduler core (corral.core.books.Core) one request at a
time with a given eviction policy, or with `belady`: evict the model whose next use is
farthest in the future, which only an offline simulation can know.
"""

from __future__ import annotations

import bisect
import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from corral.core.books import Core
from corral.core.policy import POLICIES, Candidate, Policy, Snapshot
from corral.core.requests import Fail, Grant, Load, Request, Stop
from corral.core.spec import RunnerSpec

CHAT, EMBED = "chat", "embed"
OFFLINE = "belady"


@dataclass(frozen=True)
class TraceEvent:
    t: float  # seconds since the first request (before any compression for replay)
    model: str
    kind: str  # CHAT or EMBED
    session: int  # -1 for embeddings; 0 is the long session
    turn: int  # 0-based turn within the session (or burst)


def zipf_weights(n: int, s: float) -> list[float]:
    """Popularity of ranks 1..n: proportional to 1 / rank^s."""
    return [1.0 / (k**s) for k in range(1, n + 1)]


def generate_trace(
    seed: int,
    n: int,
    models: Sequence[str],
    *,
    embed_model: str | None = None,
    long_session_model: str | None = None,
    zipf_s: float = 1.0,
    embed_share: float = 0.3,
    long_share: float = 0.15,
    burst_share: float = 0.15,
    mean_turns: float = 3.0,
    think_time: float = 8.0,
    burst_size: tuple[int, int] = (3, 8),
    burst_gap: float = 0.2,
) -> list[TraceEvent]:
    """`n` requests over the chat `models` (and `embed_model`), about one per second.

    Shares are of all requests: embeddings (Poisson), turns of the long session on
    `long_session_model` (default: the most popular model), bursts of `burst_size` requests
    `burst_gap` seconds apart on one model; the rest are sessions of geometric length
    (`mean_turns`) with exponential think time. Popularity ranks are a seeded shuffle of
    `models`, so popularity does not follow the order (or size) given.
    """
    chat = [m for m in models if m != embed_model]
    if n <= 0:
        return []
    if not chat:
        raise ValueError("generate_trace needs at least one chat model")
    if embed_model is None:
        embed_share = 0.0
    session_share = 1.0 - embed_share - long_share - burst_share
    if session_share < 0 or min(embed_share, long_share, burst_share) < 0:
        raise ValueError("shares must be >= 0 and sum to at most 1")
    horizon = 1.5 * n
    while True:
        events = _generate(
            random.Random(seed), horizon, chat, embed_model, long_session_model, zipf_s,
            embed_share, long_share, burst_share, session_share, mean_turns, think_time,
            burst_size, burst_gap,
        )  # fmt: skip
        if len(events) >= n:
            break
        horizon *= 2
    events = events[:n]
    t0 = events[0].t
    return [TraceEvent(round(e.t - t0, 6), e.model, e.kind, e.session, e.turn) for e in events]


def _generate(
    rng: random.Random, horizon: float, chat: list[str], embed_model: str | None,
    long_model: str | None, zipf_s: float, embed_share: float, long_share: float,
    burst_share: float, session_share: float, mean_turns: float, think_time: float,
    burst_size: tuple[int, int], burst_gap: float,
) -> list[TraceEvent]:  # fmt: skip
    ranks = list(chat)
    rng.shuffle(ranks)
    weights = zipf_weights(len(ranks), zipf_s)

    def pick() -> str:
        return rng.choices(ranks, weights)[0]

    out: list[TraceEvent] = []
    if embed_model is not None and embed_share > 0:
        t = rng.expovariate(embed_share)
        while t < horizon:
            out.append(TraceEvent(t, embed_model, EMBED, -1, 0))
            t += rng.expovariate(embed_share)
    if long_share > 0:
        model = long_model if long_model is not None else ranks[0]
        t, turn = rng.expovariate(long_share), 0
        while t < horizon:
            out.append(TraceEvent(t, model, CHAT, 0, turn))
            t, turn = t + rng.expovariate(long_share), turn + 1
    session = 1
    if session_share > 0:
        p = 1.0 / max(mean_turns, 1.0)
        start = rng.expovariate(session_share / mean_turns)
        while start < horizon:
            model = pick()
            # geometric number of turns >= 1 with mean 1/p
            turns = 1 + (int(math.log(1.0 - rng.random()) / math.log(1.0 - p)) if p < 1 else 0)
            t = start
            for turn in range(turns):
                if t >= horizon:
                    break
                out.append(TraceEvent(t, model, CHAT, session, turn))
                t += rng.expovariate(1.0 / think_time)
            session += 1
            start += rng.expovariate(session_share / mean_turns)
    if burst_share > 0:
        mean_burst = (burst_size[0] + burst_size[1]) / 2
        start = rng.expovariate(burst_share / mean_burst)
        while start < horizon:
            model = pick()
            t = start
            for turn in range(rng.randint(*burst_size)):
                if t >= horizon:
                    break
                out.append(TraceEvent(t, model, CHAT, session, turn))
                t += rng.expovariate(1.0 / burst_gap)
            session += 1
            start += rng.expovariate(burst_share / mean_burst)
    out.sort(key=lambda e: (e.t, e.model, e.session, e.turn))
    return out


# --------------------------------------------------------------------------- offline simulation


@dataclass(frozen=True)
class SimResult:
    policy: str
    requests: int
    loads: int
    evictions: int
    bytes_loaded: int


def belady(sequence: Sequence[str], cursor: list[int]) -> Policy:
    """Evict first the model whose next request (after position cursor[0]) is farthest away,
    never-again first; among equals, the biggest."""
    positions: dict[str, list[int]] = {}
    for i, m in enumerate(sequence):
        positions.setdefault(m, []).append(i)

    def next_use(model: str) -> float:
        uses = positions.get(model, [])
        k = bisect.bisect_right(uses, cursor[0])
        return uses[k] if k < len(uses) else math.inf

    def policy(candidates: Sequence[Candidate], snap: Snapshot) -> list[int]:
        return [c.id for c in sorted(candidates, key=lambda c: (-next_use(c.model), -c.size))]

    return policy


def default_load_seconds(size: int) -> float:
    """A plausible load time for `size` bytes: process start plus ~1 GB/s (the cost policy
    weighs reload time)."""
    return 0.3 + size / 1e9


def simulate(
    sequence: Sequence[str],
    sizes: Mapping[str, int],
    budget: int,
    policy: str,
    *,
    loaded_sizes: Mapping[str, int] | None = None,
    times: Sequence[float] | None = None,
    load_seconds: Callable[[str], float] | None = None,
) -> SimResult:
    """Serve `sequence` (model names) one request at a time through corral's scheduler core
    with `budget` bytes and `policy` (a name in corral.core.policy.POLICIES, or "belady").

    `sizes` is what a request books (the estimate); `loaded_sizes`, if given, replaces it once
    the model is loaded (what the runner really allocated), as the real scheduler does.
    `times` are the arrival times (default: one per second); a load of model m takes
    `load_seconds(m)` (default: `default_load_seconds` of its size).
    Keep-alive never expires: only memory pressure evicts. Loads and evictions are counted by
    the core; bytes loaded are the loaded sizes of every load.
    """
    cursor = [0]
    chosen: Policy = belady(sequence, cursor) if policy == OFFLINE else POLICIES[policy]
    core = Core(
        budgets={"cpu": budget},
        default_keep_alive=math.inf,
        policy=chosen,
        max_queue=len(sequence) + 1,
    )
    specs = {m: RunnerSpec(path=f"/sim/{m}.gguf", n_ctx=1024, num_parallel=1) for m in sizes}
    real = loaded_sizes or sizes
    bytes_loaded = 0
    now = 0.0

    def settle() -> bool:
        """Carry out the core's actions (instantly, or taking load time) until it is quiet."""
        nonlocal now, bytes_loaded
        granted = False
        pending = core.drain()
        while pending:
            a = pending.pop(0)
            if isinstance(a, Stop):
                core.exited(a.runner, now)
            elif isinstance(a, Load):
                now += (load_seconds or (lambda m: default_load_seconds(sizes[m])))(a.model)
                bytes_loaded += real[a.model]
                core.loaded(a.runner, now, {"cpu": real[a.model]})
            elif isinstance(a, Grant):
                granted = True
            elif isinstance(a, Fail):
                raise ValueError(f"simulation: {a.message}")
            pending += core.drain()
        return granted

    for i, model in enumerate(sequence):
        cursor[0] = i
        now = max(now, times[i]) if times is not None else now + 1.0
        core.request(
            Request(id=i + 1, model=model, spec=specs[model], explicit=frozenset(),
                    size=sizes[model], keep_alive=None, arrived=now),
            now,
        )  # fmt: skip
        if not settle():
            raise AssertionError(f"simulation: request {i} for {model} was not granted")
        now += 0.01
        core.release(i + 1, now)
        settle()
    return SimResult(policy, len(sequence), core.loads, core.evictions, bytes_loaded)
