"""`speculative = "auto"` (pure): whether llama.cpp's n-gram drafting pays on a model's runner,
judged from the counters the runner keeps (its /metrics), and what auto chooses from that.

A drafted token costs its verification: one more row in the runner's next batch, which every
stream decoding in that step waits for (`busy` streams, each `batch_s` a row: the runner's own
prompt speed, where it read prompts alone: `quiet`). An accepted one saves its stream a
decoding step (`step_s`). So drafting pays where the share of drafts accepted is above
`busy * batch_s / step_s`: on a GPU, whose batch rows cost next to nothing, almost always; on
a CPU, whose rows cost what a prompt token does (2 cores, SmolLM2: 3 ms a row against 10 ms a
step), only where a third of the drafts or more are accepted; the more streams share the
steps, the more a rejected draft costs them all.

llama.cpp b11434 lets no request turn drafting off (server-schema.cpp keeps the fields under
`#if 0`), so auto chooses per model and acts on its runner:
- a model starts drafting (llama.cpp's ngram-mod: it drafts only where the context already holds
  the text that follows, as an agent's edit of a file it was shown does, and costs nothing where
  nothing repeats);
- every `MIN_DRAFTED` drafted tokens the runner's window is judged (`verdict`): measured where
  the model has generated enough without drafts at the same load and context (`undrafted`:
  requests that drafted nothing, and its runners while drafting was off), drafting pays if its
  streams were at least as fast; else by the cost above. Two windows in a row that do not pay
  (`Choice.judged`: one alone is often noise near the break-even) turn the model's drafting
  off (the runner is restarted without it when it is idle, runtime/measure) for `RETRY_S`,
  doubling up to `RETRY_MAX_S` while it keeps not paying;
- after that, the model's next load drafts again and is judged again;
- a request for logprobs turns it off the same way (llama.cpp gives accepted drafts no
  probabilities: such a client would get made-up ones);
- what is off stays off across a restart of corral, for the rest of its while (`kept`,
  `restored`): a model known not to pay is not judged again at each start.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import astuple, dataclass, replace
from typing import Any

DRAFTER = "ngram-mod"  # the drafter auto uses: needs no second model
MIN_DRAFTED = 256  # drafted tokens a verdict needs (two or more drafts of ngram-mod's 48-128)
# Steps (tokens not accepted) an estimated verdict needs: with nearly every draft accepted, a
# window is nearly all verification, and the time left over once its rows are priced, over
# its few steps, made a step without drafts 0.6-1.5 tokens/s (SmolLM2's edits on 2 cores,
# about 50 at their context). Past it the estimate still runs low there (2-7 tokens/s): a
# verified row at an edit's context costs about twice a prompt's row, which prices it.
MIN_STEPS = 64
# A drafted row costs more than a prompt token's share of a large batch (a verification batch
# is small, and rejected drafts roll the slot back): calibrated on 2 cores with SmolLM2 with one
# stream, whose story lost 15% at 38% of its drafts accepted against a break-even of 31%
# without it. Streams decoding together verify their drafts in one batch and share that
# overhead, so it is divided among them (`margin`): at 3-4 streams the whole margin judged
# windows not to pay at 76-79% accepted where drafting made 1.08-1.20x the tokens/s of the same
# llama-server without it (the concurrency bench's text, 8 clients on 4 slots).
MARGIN = 1.5
RETRY_S = 600.0  # how long drafting stays off for a model once it did not pay
RETRY_MAX_S = 7200.0  # ... doubling each time it did not pay again, up to this
# Tokens generated without drafts at a load from which a verdict compares measured speeds,
# and past which the older ones count half (a few requests: the speed now, not at the start)
MIN_UNDRAFTED = 128
UNDRAFTED_KEPT = 1024
DEPTH_FLOOR = 256  # contexts up to about this long are one (a step costs about the same)
KEPT_FILE = "drafting.json"  # in corral's state directory: `kept`, read back by `restored`


@dataclass(frozen=True)
class Counters:
    """A runner's counters since it started (llama.cpp's /metrics), or what changed in them
    between two reads (`now - before`)."""

    prompt: int = 0  # prompt tokens evaluated
    prompt_s: float = 0.0  # ... in seconds
    generated: int = 0  # tokens generated (requests that ended)
    generated_s: float = 0.0  # ... in seconds of their streams, summed
    drafted: int = 0
    accepted: int = 0
    decodes: int = 0  # llama_decode calls
    busy: float = 0.0  # slots busy at those calls, summed
    # Not llama.cpp's: corral's count of the requests that ended (runtime/hop), each one's
    # generated tokens times the context they were generated at (its prompt and half its
    # answer), summed, and the generated tokens counted so
    context: float = 0.0
    contexted: int = 0

    @classmethod
    def of(cls, found: Mapping[str, float]) -> Counters | None:
        """From /metrics' values by name; None if it lacks the token counters."""
        prompt = found.get("llamacpp:prompt_tokens_total")
        generated = found.get("llamacpp:tokens_predicted_total")
        if prompt is None or generated is None:
            return None
        decodes = found.get("llamacpp:n_decode_total", 0.0)
        return cls(
            int(prompt), found.get("llamacpp:prompt_seconds_total", 0.0),
            int(generated), found.get("llamacpp:tokens_predicted_seconds_total", 0.0),
            int(found.get("llamacpp:spec_decode_num_draft_tokens_total", 0)),
            int(found.get("llamacpp:spec_decode_num_accepted_tokens_total", 0)),
            int(decodes), found.get("llamacpp:n_busy_slots_per_decode", 0.0) * decodes,
        )  # fmt: skip

    def __add__(self, o: Counters) -> Counters:
        return Counters(*(a + b for a, b in zip(astuple(self), astuple(o), strict=True)))

    def __sub__(self, o: Counters) -> Counters:
        return Counters(*(a - b for a, b in zip(astuple(self), astuple(o), strict=True)))

    @property
    def depth(self) -> float | None:
        """The context a generated token was read with, on average (None: not known)."""
        return self.context / self.contexted if self.contexted > 0 else None

    @property
    def streams(self) -> float:
        """Slots busy at a decode, on average (1 where no decode was counted)."""
        return max(1.0, self.busy / self.decodes) if self.decodes > 0 else 1.0

    @property
    def alone(self) -> bool:
        """Every decode had one slot busy (busy is llama.cpp's average times decodes: 0.5 for
        the float's rounding)."""
        return 0 < self.decodes and self.busy < self.decodes + 0.5

    @property
    def batch_s(self) -> float:
        """Seconds a row of a batch costs: the prompt's evaluation per token (0: not known)."""
        return self.prompt_s / self.prompt if self.prompt >= 64 else 0.0


def quiet(known: Counters, read: Counters) -> Counters:
    """`known` with `read` (what changed between two reads) added where the runner read its
    prompts with no other stream beside them: the prompt speed a batch row really has.
    llama.cpp times a slot's prompt by its whole batch, and beside other slots' steps that
    batch also holds their rows (and their drafts): under many clients a prompt token looked
    several times dearer than one read alone, and drafting that paid was judged not to."""
    return known + read if read.prompt > 0 and read.alone else known


def level(busy: float) -> int:
    """The load a stream's speed is compared at: streams decoding at once, to the nearest
    power of two (0: one alone)."""
    return round(math.log2(max(1.0, busy)))


def deep(tokens: float) -> int:
    """The context a stream's speed is compared at, in steps of a square root of two from
    DEPTH_FLOOR tokens: each step reads its whole context (2 cores, SmolLM2: 110 tokens/s
    with 20 tokens before them, 82 with 1,000, 48 with 3,000), so a short story's speed says
    nothing of an edit's after a long file."""
    return max(0, round(2 * math.log2(max(tokens, DEPTH_FLOOR) / DEPTH_FLOOR)))


Where = tuple[int, int]  # (`level`, `deep`): what a speed without drafts is kept by


def where(c: Counters) -> Where | None:
    """The load and context of a read or window's generation (None: its context or steps are
    not known)."""
    depth = c.depth
    if depth is None or c.decodes <= 0:
        return None
    return level(c.streams), deep(depth)


def undrafted(
    known: Mapping[Where, Counters], read: Counters, drafting: bool
) -> dict[Where, Counters]:
    """`known` (a model's generation without drafts, by `where`) with `read` added where the
    requests that ended in it drafted nothing: llama.cpp adds a request's drafts to its
    counters with its tokens, as it ends. On a drafting runner only a read with one stream at
    a time counts: beside other streams a step also verifies their drafts. A place past
    UNDRAFTED_KEPT tokens is halved first, so that what is compared follows the machine's
    speed now."""
    at = where(read)
    if (at is None or read.drafted or read.generated <= 0 or read.generated_s <= 0
            or (drafting and not read.alone)):  # fmt: skip
        return dict(known)
    was = known.get(at, Counters())
    if was.generated > UNDRAFTED_KEPT:
        was = Counters(*(x // 2 if isinstance(x, int) else x / 2 for x in astuple(was)))
    return {**known, at: was + read}


@dataclass(frozen=True)
class Verdict:
    """What drafting did on a runner over a window of its counters."""

    drafted: int
    accepted: int
    busy: float  # streams decoding at once, on average
    break_even: float  # the share of drafts accepted from which drafting pays (`margin`)
    with_tps: float  # a stream's tokens/s, as measured (drafting)
    without_tps: float  # ... without drafting: measured (`measured`), else estimated
    measured: bool = False  # without_tps is the model's own generation without drafts ...
    # ... at the window's load and context (""), else where a stream is faster ("lighter") or
    # slower ("heavier"), which still decides (`compared`)
    at: str = ""

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def pays(self) -> bool:
        if self.measured:
            return self.with_tps >= self.without_tps
        return self.acceptance >= self.break_even

    def __str__(self) -> str:
        share = f"{self.acceptance:.0%}"
        if not self.measured:
            share += f"; it pays from {self.break_even:.0%} here"
        at = f" at a {self.at} load or context" if self.at else ""
        return (
            f"{self.accepted} of {self.drafted} drafted tokens accepted ({share}), "
            f"{self.with_tps:.1f} tokens/s a stream against {self.without_tps:.1f} "
            f"{'measured' if self.measured else 'estimated'} without{at}"
        )


def compared(
    with_tps: float, at: Where | None, without: Mapping[Where, Counters]
) -> tuple[float, str] | None:
    """The model's speed without drafts that a window's `with_tps` at `at` is judged against,
    and where it was measured (Verdict.at): at the same load and context; else, since a stream
    is slower with more streams beside it and a longer context behind it, one measured at no
    more of either ("lighter": faster) that drafting beat, or at no less of either ("heavier":
    slower) that it did not reach: both decide. None: nothing measured decides."""
    if at is None:
        return None
    speeds = {k: c.generated / c.generated_s for k, c in without.items()
              if c.generated >= MIN_UNDRAFTED and c.generated_s > 0}  # fmt: skip
    if at in speeds:
        return speeds[at], ""
    lighter = [v for (n, d), v in speeds.items() if n <= at[0] and d <= at[1]]
    if lighter and with_tps >= min(lighter):
        return min(lighter), "lighter"
    heavier = [v for (n, d), v in speeds.items() if n >= at[0] and d >= at[1]]
    if heavier and with_tps < max(heavier):
        return max(heavier), "heavier"
    return None


def margin(busy: float) -> float:
    """What a drafted row costs over a prompt row, with `busy` streams sharing each
    verification batch (MARGIN)."""
    return 1.0 + (MARGIN - 1.0) / max(1.0, busy)


def verdict(
    window: Counters, batch_s: float, without: Mapping[Where, Counters] | None = None
) -> Verdict | None:
    """Whether drafting paid over `window` (None: too little to say). Measured where the
    model generated MIN_UNDRAFTED tokens or more without drafts at a load and context that
    decides (`without`, from `undrafted`; `compared`): drafting pays if its streams were at
    least as fast. Otherwise estimated from what a drafted row costs, `batch_s`
    (Counters.batch_s of the runner's `quiet` reads, or of its whole life before it read
    enough prompts alone), where the window took MIN_STEPS steps or more."""
    w = window
    if w.drafted < MIN_DRAFTED or w.generated <= w.accepted or w.generated_s <= 0:
        return None
    busy = w.streams
    with_tps = w.generated / w.generated_s
    base = compared(with_tps, where(w), without or {})
    steps = w.generated - w.accepted  # one a token not accepted
    if base is None and (batch_s <= 0 or steps < MIN_STEPS):
        return None
    cost = busy * batch_s  # stream-seconds a drafted token costs
    # generated_s = steps * step_s + drafted * cost
    step_s = max((w.generated_s - w.drafted * cost) / steps, batch_s)
    break_even = min(1.0, margin(busy) * cost / step_s) if batch_s > 0 else 1.0
    without_tps, at = base or (1.0 / step_s, "")
    return Verdict(
        w.drafted, w.accepted, busy, break_even, with_tps, without_tps, base is not None, at
    )


@dataclass(frozen=True)
class Choice:
    """What auto chose for a model's drafting, and why."""

    on: bool = True
    why: str = "not measured yet"
    retry_at: float = -math.inf  # while off: when its next load drafts again
    backoff: float = RETRY_S  # how long the next turn off lasts
    last: Verdict | None = None
    doubted: bool = False  # on, its last window did not pay: the next that does not turns it off

    def __str__(self) -> str:
        return f"{'on' if self.on else 'off'}: {self.why}"

    def judged(self, v: Verdict, now: float) -> Choice:
        """On where `v` pays; off where it is the second window in a row that does not. Near
        the break-even one window is as likely noise as not (under 16 clients, windows a few
        seconds apart said 46% against 50% and then 93% against 54%), and a turn off costs its
        runner a restart."""
        if v.pays:
            return Choice(True, f"pays: {v}", last=v)
        if self.on and not self.doubted:
            return Choice(True, f"judged again: its last window did not pay: {v}",
                          backoff=self.backoff, last=v, doubted=True)  # fmt: skip
        return self.off(f"does not pay: {v}", now, v)

    def off(self, why: str, now: float, v: Verdict | None = None) -> Choice:
        """Off for its backoff (from now), the next one twice as long."""
        if not self.on and now < self.retry_at:  # off already: the reason stays the first
            return self
        return Choice(
            False, why, now + self.backoff, min(2 * self.backoff, RETRY_MAX_S), v or self.last
        )

    def trying(self) -> Choice:
        """A runner drafts again after the backoff: judged again from its first window."""
        return replace(self, on=True, why="trying again: not measured since")


def kept(choices: Mapping[str, Choice], now: float, wall: float) -> dict[str, dict[str, Any]]:
    """The choices worth keeping across a restart, by model: those off, each with the end of
    its while on the wall clock (`now`: the scheduler's clock, `wall`: time.time(), both now).
    One on is not kept: a model drafts until it is judged anyway."""
    return {
        m: {"why": c.why, "retry_at": wall + (c.retry_at - now), "backoff": c.backoff}
        for m, c in choices.items() if not c.on
    }  # fmt: skip


def restored(data: object, now: float, wall: float) -> dict[str, Choice]:
    """`kept`'s record read back on the scheduler's clock. What cannot be read is left out
    (such a model drafts and is judged again), and so is a while that ended longer ago than
    the longest: its model has had its next chance since."""
    out: dict[str, Choice] = {}
    for m, d in (data if isinstance(data, dict) else {}).items():
        if not isinstance(d, dict):
            continue
        why, at, backoff = d.get("why"), d.get("retry_at"), d.get("backoff")
        if not (isinstance(why, str) and isinstance(at, int | float)
                and isinstance(backoff, int | float) and math.isfinite(at + backoff)):  # fmt: skip
            continue
        retry_at = now + (at - wall)
        if retry_at < now - RETRY_MAX_S:
            continue
        backoff = min(max(float(backoff), RETRY_S), RETRY_MAX_S)
        out[str(m)] = Choice(False, why, retry_at, backoff)
    return out
