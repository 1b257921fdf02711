"""`speculative = "auto"` decides from measurement (core/drafting): a window of a runner's
counters says whether drafting paid, the model's choice follows it (off for a while, back on at
a later load), and a runner that drafts when its model should not is restarted once idle."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from corral.core.books import Core
from corral.core.drafting import (
    DEPTH_FLOOR,
    DRAFTER,
    KEPT_FILE,
    MARGIN,
    MIN_DRAFTED,
    MIN_STEPS,
    MIN_UNDRAFTED,
    RETRY_MAX_S,
    RETRY_S,
    Choice,
    Counters,
    deep,
    kept,
    margin,
    quiet,
    restored,
    undrafted,
    verdict,
)
from corral.core.requests import Grant, Load, Request, Stop
from corral.core.spec import RunnerSpec
from corral.runtime.measure import Measure, Record

# 2 cores, SmolLM2: a prompt token costs ~3 ms in a large batch, a decoding step ~10 ms
BATCH_S = 1 / 320


def window(generated: int, drafted: int, accepted: int, step_s: float = 0.010,
           busy: float = 1.0, depth: float = 100.0) -> Counters:  # fmt: skip
    """A window in which each step not saved took `step_s` and each draft its rows, `busy`
    streams decoding at once, each token generated after `depth` tokens of context."""
    seconds = (generated - accepted) * step_s + drafted * busy * BATCH_S
    return Counters(generated=generated, generated_s=seconds, drafted=drafted,
                    accepted=accepted, decodes=100, busy=100 * busy,
                    context=generated * depth, contexted=generated)  # fmt: skip


def test_counters_come_from_llama_cpps_metrics() -> None:
    found = {
        "llamacpp:prompt_tokens_total": 640.0, "llamacpp:prompt_seconds_total": 2.0,
        "llamacpp:tokens_predicted_total": 300.0, "llamacpp:tokens_predicted_seconds_total": 3.0,
        "llamacpp:spec_decode_num_draft_tokens_total": 128.0,
        "llamacpp:spec_decode_num_accepted_tokens_total": 100.0,
        "llamacpp:n_decode_total": 50.0, "llamacpp:n_busy_slots_per_decode": 2.0,
    }  # fmt: skip
    c = Counters.of(found)
    assert c == Counters(640, 2.0, 300, 3.0, 128, 100, 50, 100.0)
    assert c.batch_s == pytest.approx(2.0 / 640)
    assert (c - Counters(prompt=40, prompt_s=1.0)).prompt == 600
    assert Counters.of({}) is None  # a runner started without metrics says nothing
    assert Counters(prompt=10, prompt_s=1.0).batch_s == 0.0  # too few prompt tokens to say


def test_an_edit_pays_and_a_story_that_repeats_a_little_does_not() -> None:
    edit = verdict(window(1500, 1200, 1190), BATCH_S)
    assert edit is not None and edit.pays and edit.acceptance > 0.99
    # the step estimated without drafting is the one the window was built with
    assert edit.without_tps == pytest.approx(100.0, rel=0.35)
    assert edit.with_tps > edit.without_tps
    # what the bench measured: 38% of a story's drafts accepted lost 15% on 2 cores
    story = verdict(window(300, 300, 114), BATCH_S)
    assert story is not None and not story.pays
    assert 0.31 < story.break_even < 0.6 and "114 of 300" in str(story)
    assert verdict(window(300, MIN_DRAFTED - 1, 0), BATCH_S) is None  # too few drafts to say
    assert verdict(window(300, 300, 114), 0.0) is None  # the batch's cost is not known yet


def test_drafts_cost_more_where_more_streams_share_the_steps_and_little_on_a_gpu() -> None:
    alone = verdict(window(1000, 400, 160), BATCH_S)
    crowded = verdict(window(1000, 400, 160, step_s=0.012, busy=8), BATCH_S)
    assert alone is not None and crowded is not None
    assert crowded.busy == 8 and crowded.break_even > alone.break_even
    # a GPU's batch rows cost next to nothing against a step: a third accepted pays well
    gpu = verdict(window(1000, 600, 200, step_s=0.004), 1 / 20000)
    assert gpu is not None and gpu.pays and gpu.break_even < 0.05


def test_streams_verifying_together_share_a_drafts_overhead() -> None:
    """The margin over a prompt row's cost was calibrated with one stream. Streams decoding
    together verify their drafts in one batch and share it: judged with all of it, 8 clients on
    SmolLM2's 4 slots (3.4 streams a step, 79% of the drafts accepted) did not pay, where
    drafting made 1.08-1.20x the tokens/s of the same llama-server without it, and drafting was
    turned off (a restart) where it paid."""
    crowded = window(1300, 1153, 909, step_s=0.0187, busy=3.4)
    v = verdict(crowded, BATCH_S)
    assert v is not None and v.pays and v.with_tps > v.without_tps
    whole = MARGIN * 3.4 * BATCH_S * v.without_tps  # the break-even with all of the margin
    assert v.acceptance < whole < 1.0 and v.break_even < v.acceptance
    assert margin(1.0) == MARGIN and margin(4.0) == pytest.approx(1.125)


def test_a_row_costs_what_a_prompt_read_alone_costs() -> None:
    """A batch row's cost comes from the reads in which one stream at a time was decoding:
    a prompt read beside other slots' steps is timed by a batch that holds their rows too
    (five times dearer here). With that lifetime figure, 4 streams with 84% of their drafts
    accepted were judged not to pay (the break-even at its 100% cap); with the quiet one they
    pay, as the bench measured (edit at 4 clients: 1.24x of corral without drafts)."""
    alone = Counters(prompt=40, prompt_s=40 * BATCH_S, generated=64, decodes=70, busy=70.0)
    beside = Counters(prompt=160, prompt_s=160 * 5 * BATCH_S, generated=256, decodes=300,
                      busy=1200.0)  # fmt: skip
    known = Counters()
    for read in (alone, beside, alone, beside):
        known = quiet(known, read)
    assert known == alone + alone and known.batch_s == pytest.approx(BATCH_S)
    assert quiet(known, Counters(decodes=9, busy=9.0)) == known  # no prompt read: nothing learned
    lifetime = (alone + beside + alone + beside).batch_s
    crowded = window(1200, 1000, 840, step_s=0.030, busy=4)
    was, now = verdict(crowded, lifetime), verdict(crowded, known.batch_s)
    assert was is not None and now is not None
    assert not was.pays and was.break_even == 1.0
    assert now.pays and now.break_even < 0.7
    assert now.without_tps == pytest.approx(1 / 0.030)  # the step the window was built with


def plain(generated: int, tps: float, busy: float = 1.0, depth: float = 100.0) -> Counters:
    """A read in which the requests that ended drafted nothing, at `tps` a stream, each
    token generated after `depth` tokens of context."""
    return Counters(generated=generated, generated_s=generated / tps, decodes=100,
                    busy=100 * busy, context=generated * depth,
                    contexted=generated)  # fmt: skip


def test_the_speed_without_drafts_is_kept_by_load_and_context_from_requests_that_drafted_nothing(
) -> None:  # fmt: skip
    known = undrafted({}, plain(64, 100.0), drafting=True)  # a story alone: nothing drafted
    assert known == {(0, 0): plain(64, 100.0)}
    # a read with drafts in it, or beside other streams on a drafting runner, says nothing
    assert undrafted(known, window(300, 300, 114), drafting=True) == known
    assert undrafted(known, plain(64, 50.0, busy=4), drafting=True) == known
    assert undrafted(known, Counters(decodes=5, busy=5.0), drafting=True) == known
    # ... nor one whose context corral did not count (its requests' ends not in yet)
    assert undrafted(known, replace(plain(64, 50.0), contexted=0), drafting=True) == known
    # a runner that does not draft tells its speed at every load, by the nearest power of two
    crowded = undrafted(known, plain(64, 40.0, busy=3.7), drafting=False)
    assert crowded == {(0, 0): plain(64, 100.0), (2, 0): plain(64, 40.0, busy=3.7)}
    # a long context is kept apart, by steps of a square root of two: each step reads it all
    assert [deep(n) for n in (20, DEPTH_FLOOR, 350, 512, 1000, 3000)] == [0, 0, 1, 2, 4, 7]
    deeper = undrafted(known, plain(64, 50.0, depth=3000), drafting=True)
    assert deeper == {(0, 0): plain(64, 100.0), (0, 7): plain(64, 50.0, depth=3000)}
    # the older tokens count half past UNDRAFTED_KEPT: the speed follows the machine's now
    for _ in range(40):
        known = undrafted(known, plain(64, 100.0), drafting=False)
    slower = known
    for _ in range(40):
        slower = undrafted(slower, plain(64, 50.0), drafting=False)
    kept_tps = slower[(0, 0)].generated / slower[(0, 0)].generated_s
    assert slower[(0, 0)].generated < 2 * 1024 + 64 and kept_tps < 55.0


def test_a_verdict_compares_with_the_speed_measured_without_drafts_at_the_same_load() -> None:
    """Where the model generated enough without drafts at the window's load and context,
    drafting pays if its streams were at least as fast: the cost model's guess is not needed
    there. A story whose acceptance the cost model would pass but whose streams were slower
    turns it off; an edit measured faster stays on, even where no prompt was read to price a
    row. A short story's speed is not an edit's after a long file."""
    story = window(300, 300, 165)  # 55% accepted: above the estimate's break-even
    guessed = verdict(story, BATCH_S)
    assert guessed is not None and guessed.pays and not guessed.measured
    fast = {(0, 0): plain(MIN_UNDRAFTED, 1.2 * guessed.with_tps)}
    measured = verdict(story, BATCH_S, fast)
    assert measured is not None and measured.measured and not measured.pays
    assert measured.without_tps == pytest.approx(1.2 * guessed.with_tps)
    assert str(measured).endswith(" measured without") and "pays from" not in str(measured)
    edit = verdict(window(1500, 1200, 1190), 0.0, {(0, 0): plain(MIN_UNDRAFTED, 100.0)})
    assert edit is not None and edit.measured and edit.pays
    # too little of it, or only at another load or context: estimated as before
    few = verdict(story, BATCH_S, {(0, 0): plain(MIN_UNDRAFTED - 1, 1000.0)})
    other = verdict(story, BATCH_S, {(3, 0): plain(MIN_UNDRAFTED, 1.0, busy=8)})
    assert few == guessed and other == guessed
    assert verdict(window(1500, 1200, 1190), 0.0, {(3, 0): plain(512, 1.0)}) is None
    # an edit after a 3,000-token file, 1.5x as fast as without drafts there (20 ms a step),
    # is slower than a short story without them: judged against the file's depth only
    long_edit = window(1500, 1000, 500, step_s=0.020, depth=3000)
    short = {(0, 0): plain(MIN_UNDRAFTED, 110.0)}
    assert long_edit.generated / long_edit.generated_s < 110.0
    guess = verdict(long_edit, BATCH_S, short)
    assert guess is not None and not guess.measured and guess.pays
    deep_known = {**short, (0, deep(3000)): plain(MIN_UNDRAFTED, 50.0, depth=3000)}
    judged = verdict(long_edit, BATCH_S, deep_known)
    assert judged is not None and judged.measured and judged.pays
    assert judged.without_tps == pytest.approx(50.0)


def test_a_speed_measured_at_another_load_or_context_decides_where_it_can() -> None:
    """A stream is slower with more streams beside it and a longer context behind it: drafting
    that beat a speed measured at a lighter load or context pays, and drafting that did not
    reach one measured at a heavier one does not. Neither: the estimate, as before."""
    edit = window(1500, 1000, 500, step_s=0.020, busy=2, depth=1400)  # at (1, 5)
    with_tps = edit.generated / edit.generated_s
    lighter = {(0, 5): plain(MIN_UNDRAFTED, 0.9 * with_tps, depth=1400),
               (1, 0): plain(MIN_UNDRAFTED, 0.8 * with_tps, busy=2)}  # fmt: skip
    beat = verdict(edit, BATCH_S, lighter)
    assert beat is not None and beat.measured and beat.pays and beat.at == "lighter"
    assert beat.without_tps == pytest.approx(0.8 * with_tps)  # the tightest that decides
    assert str(beat).endswith(" measured without at a lighter load or context")
    heavier = {(2, 5): plain(MIN_UNDRAFTED, 1.1 * with_tps, busy=4, depth=1400)}
    lost = verdict(edit, BATCH_S, heavier)
    assert lost is not None and lost.measured and not lost.pays and lost.at == "heavier"
    # a faster speed at a lighter place, a slower one at a heavier place: nothing decided
    neither = {(0, 0): plain(MIN_UNDRAFTED, 2 * with_tps),
               (3, 7): plain(MIN_UNDRAFTED, 0.5 * with_tps, busy=8, depth=3000)}  # fmt: skip
    guessed = verdict(edit, BATCH_S, neither)
    assert guessed == verdict(edit, BATCH_S) and guessed is not None and not guessed.measured
    # neither lighter nor heavier (more streams, a shorter context): not compared
    across = {(2, 0): plain(MIN_UNDRAFTED, 10 * with_tps, busy=4)}
    assert verdict(edit, BATCH_S, across) == guessed


def test_a_window_of_nearly_all_accepted_drafts_is_not_priced_by_its_few_steps() -> None:
    """600 tokens of which 592 were accepted drafts: 8 steps, too few to price a step without
    drafts (the time left once the drafts' rows are priced, over 8 steps, made 0.6-1.5
    tokens/s where SmolLM2 makes about 50). Not judged by estimate until MIN_STEPS steps;
    a measured speed still judges it."""
    few = window(600, 592, 592, step_s=0.010)
    assert verdict(few, BATCH_S) is None
    measured = verdict(few, BATCH_S, {(0, 0): plain(MIN_UNDRAFTED, 100.0)})
    assert measured is not None and measured.measured and measured.pays
    enough = window(600 + MIN_STEPS, 592, 592, step_s=0.010)
    judged = verdict(enough, BATCH_S)
    assert judged is not None and judged.without_tps == pytest.approx(100.0, rel=0.35)


def test_the_choice_turns_off_for_a_while_doubling_and_back_on_at_a_later_load() -> None:
    bad = verdict(window(300, 300, 30), BATCH_S)
    good = verdict(window(1500, 1200, 1190), BATCH_S)
    assert bad is not None and good is not None
    c = Choice()
    assert c.on and c.why == "not measured yet"  # a model drafts until it is judged
    # one window that does not pay is judged again; one that pays between clears the doubt
    doubt = c.judged(bad, 90.0)
    assert doubt.on and doubt.doubted and doubt.last == bad
    assert str(doubt).startswith("on: judged again: its last window did not pay: 30 of 300")
    assert not doubt.judged(good, 95.0).doubted and doubt.judged(good, 95.0).judged(bad, 99.0).on
    c = doubt.judged(bad, 100.0)  # the second in a row
    assert not c.on and c.retry_at == 100.0 + RETRY_S  # its next load after the while drafts
    assert str(c).startswith("off: does not pay: 30 of 300")
    c = c.trying().judged(bad, 100.0 + RETRY_S).judged(bad, 100.0 + RETRY_S)
    assert not c.on and c.retry_at == 100.0 + 3 * RETRY_S  # twice as long this time
    for _ in range(10):
        c = c.trying().judged(bad, 0.0).judged(bad, 0.0)
    assert c.backoff == RETRY_MAX_S  # ... up to the most
    c = c.trying().judged(good, 0.0)
    assert c.on and c.backoff == RETRY_S and c.last == good and "pays" in str(c)


def test_logprobs_turn_it_off_and_a_second_reason_does_not_extend_the_while() -> None:
    c = Choice().off("a client asked for logprobs", 10.0)
    assert not c.on and c.why == "a client asked for logprobs" and c.retry_at == 10 + RETRY_S
    again = c.off("a client asked for logprobs", 20.0)
    assert again is c


def test_what_is_off_is_kept_across_a_restart_for_the_rest_of_its_while() -> None:
    """Kept with the end of its while on the wall clock, read back on a new clock: the same
    time left, its backoff doubling on. One on, or unreadable, or long over, is not kept."""
    off = Choice().off("does not pay: 30 of 300", 50.0).trying().off("again", 700.0)
    choices = {"a": off, "b": Choice(), "c": Choice().off("logprobs", 0.0)}
    record = kept(choices, now=1000.0, wall=1_700_000_000.0)
    assert set(record) == {"a", "c"}  # "b" drafts, as any model not judged yet
    back = restored(record, now=5.0, wall=1_700_000_100.0)  # 100 s later, a new process
    a = back["a"]
    assert not a.on and a.why == "again" and a.backoff == 4 * RETRY_S
    assert a.retry_at == pytest.approx(5.0 + (700.0 + 2 * RETRY_S - 1000.0) - 100.0)
    assert back["c"].retry_at < 5.0  # its while is over: it drafts again, judged again
    assert restored({**record, "bad": {"why": 1}, "odd": [], "inf": {
        "why": "x", "retry_at": math.inf, "backoff": RETRY_S}}, 5.0, 1_700_000_100.0
    ).keys() == {"a", "c"}  # fmt: skip
    long_over = restored(record, now=5.0, wall=1_700_000_000.0 + 2 * RETRY_MAX_S)
    assert long_over == {}
    assert restored(None, 0.0, 0.0) == {} and restored("x", 0.0, 0.0) == {}


def _request(rid: int, now: float) -> Request:
    spec = RunnerSpec("/m/a.gguf", 1024, 1, speculative=DRAFTER, speculative_auto=True)
    return Request(id=rid, model="a", spec=spec, explicit=frozenset(), size=100,
                   keep_alive=None, arrived=now, deadline=math.inf)  # fmt: skip


def test_a_runner_restarts_only_once_idle_with_nothing_waiting() -> None:
    core = Core(budgets={"cpu": 10**9})
    core.request(_request(1, 0.0), 0.0)
    (load,) = [a for a in core.drain() if isinstance(a, Load)]
    core.loaded(load.runner, 1.0)
    assert any(isinstance(a, Grant) for a in core.drain())
    assert not core.restart(load.runner, "drafting off", 2.0)  # it serves request 1
    core.request(_request(2, 2.0), 2.0)  # one slot: request 2 waits for it
    core.release(1, 3.0)
    assert any(isinstance(a, Grant) and a.request == 2 for a in core.drain())
    core.request(_request(3, 3.0), 3.0)
    core.release(2, 4.0)
    core.drain()
    assert not core.restart(load.runner, "drafting off", 4.0)  # request 3 has it now
    core.release(3, 5.0)
    core.drain()
    assert core.restart(load.runner, "drafting off", 5.0)
    (stop,) = core.drain()
    assert isinstance(stop, Stop) and stop.kind == "options_change" and "drafting" in stop.reason
    assert not core.restart(load.runner, "drafting off", 6.0)  # stopping already


def _measured(tmp_path: Path, *reads: Counters) -> tuple[Core, Load, Record, Measure]:
    """A Measure over one idle runner of model "a" (drafting, auto) whose counters read
    `reads` in turn."""
    from types import SimpleNamespace

    from corral.runtime.journal import Journal

    core = Core(budgets={"cpu": 10**9})
    core.request(_request(1, 0.0), 0.0)
    (load,) = [a for a in core.drain() if isinstance(a, Load)]
    core.loaded(load.runner, 1.0)
    core.release(1, 1.5)
    core.drain()
    it = iter(reads)
    hop = SimpleNamespace(context=0.0, contexted=0)

    class API:
        """llama.cpp's counters; the context of `reads` is corral's own count (its hop's)."""

        async def token_counts(self) -> Counters:
            c = next(it)
            hop.context, hop.contexted = c.context, c.contexted
            return replace(c, context=0.0, contexted=0)

    runner = SimpleNamespace(name="a", spec=load.spec, api=API())
    rec = Record(runner=runner, hop=hop)
    measure = Measure(
        core, {load.runner: rec}, Journal(), devices=[], refresh=None, margin=0,
        interval=math.inf, read_ahead=False, clock=lambda: 0.0, apply=lambda: None,
        spawn=lambda c: c.close(), state_dir=tmp_path,
    )  # fmt: skip
    return core, load, rec, measure


async def test_a_runner_judged_not_to_pay_is_restarted_without_drafting_once_idle(
    tmp_path: Path,
) -> None:
    """The measure reads a drafting runner's counters; two windows in a row that do not pay
    turn its model's drafting off and the idle runner is stopped (its next load does not
    draft). The choice is kept across a restart of corral."""
    from corral.runtime.journal import Journal

    core, load, rec, measure = _measured(
        tmp_path,
        Counters(prompt=640, prompt_s=2.0, decodes=1, busy=1.0),  # read alone: 3.1 ms a row
        Counters(640, 2.0, 300, 2.8, 300, 30, 100, 100.0),  # 10% of the drafts accepted
        Counters(640, 2.0, 600, 5.6, 600, 60, 200, 200.0),  # ... and again
    )
    runner = rec.runner
    assert measure.drafting == {}  # drafting until judged
    await measure.count_tokens(rec)
    assert "a" not in measure.drafting  # too few drafts to say
    assert rec.quiet.batch_s == pytest.approx(2.0 / 640)  # a row's cost, for the verdict
    await measure.count_tokens(rec)  # the request ended: 300 drafted tokens
    assert measure.drafting["a"].on and measure.drafting["a"].doubted  # judged again
    assert not [a for a in core.drain() if isinstance(a, Stop)]
    await measure.count_tokens(rec)  # another 300, and not paying either
    choice = measure.drafting["a"]
    assert not choice.on and choice.retry_at == RETRY_S  # its loads do not draft for a while
    assert str(measure.drafting["a"]).startswith("off: does not pay")
    (stop,) = [a for a in core.drain() if isinstance(a, Stop)]  # served nothing: stopped
    assert stop.runner == load.runner and stop.kind == "options_change"
    assert measure.tokens["a"] == [640, 600, 600, 60]  # the counts the dashboard adds up
    # corral restarts (a new clock): its new measure has the model off for the time left
    again = Measure(
        Core(budgets={"cpu": 10**9}), {}, Journal(), devices=[], refresh=None, margin=0,
        interval=math.inf, read_ahead=False, clock=lambda: 107.0, apply=lambda: None,
        spawn=lambda c: c.close(), state_dir=tmp_path,
    )  # fmt: skip
    back = again.drafting["a"]
    assert not back.on and back.why == choice.why
    assert back.retry_at == pytest.approx(107.0 + RETRY_S, abs=5.0)  # the wall clock's seconds
    # after its while it drafts again and pays: nothing of it is kept any more
    later = Measure(
        Core(budgets={"cpu": 10**9}), {}, Journal(), devices=[], refresh=None, margin=0,
        interval=math.inf, read_ahead=False, clock=lambda: 107.0 + 2 * RETRY_S,
        apply=lambda: None, spawn=lambda c: c.close(), state_dir=tmp_path,
    )  # fmt: skip
    pays = Counters(640, 2.0, 1500, 6.85, 1200, 1190, 100, 100.0)  # 99% of the drafts accepted
    later._judge_drafting(Record(runner=runner), pays)
    assert later.drafting["a"].on
    assert json.loads((tmp_path / KEPT_FILE).read_text()) == {}


async def test_a_measure_judges_drafting_against_its_models_speed_without_drafts(
    tmp_path: Path,
) -> None:
    """A story that drafted nothing, then drafts whose acceptance the estimate would pass:
    its streams were slower than the story's, measured, so drafting turns off."""
    core, _, rec, measure = _measured(
        tmp_path,
        # alone, no drafts: 100 tokens/s, each token after 150 of context
        Counters(640, 2.0, 256, 2.56, 0, 0, 300, 300.0, 256 * 150.0, 256),
        # 55% accepted, 75 tokens/s, at the same context
        Counters(640, 2.0, 556, 6.56, 300, 165, 700, 700.0, 556 * 150.0, 556),
        # ... and again, 66.7 tokens/s
        Counters(640, 2.0, 856, 11.06, 600, 330, 1100, 1100.0, 856 * 150.0, 856),
    )
    await measure.count_tokens(rec)
    story = Counters(640, 2.0, 256, 2.56, 0, 0, 300, 300.0, 256 * 150.0, 256)
    assert measure.undrafted["a"] == {(0, 0): story}
    assert "a" not in measure.drafting
    await measure.count_tokens(rec)
    first = measure.drafting["a"]
    assert first.on and first.doubted and first.last is not None and first.last.measured
    # the window holds every stream since the last verdict, the story's too: 556 in 6.56 s
    assert str(first).endswith("84.8 tokens/s a stream against 100.0 measured without")
    await measure.count_tokens(rec)
    choice = measure.drafting["a"]
    assert not choice.on and choice.last is not None and choice.last.measured
    assert str(choice).endswith("66.7 tokens/s a stream against 100.0 measured without")
    assert [a for a in core.drain() if isinstance(a, Stop)]  # restarted without drafting


def test_a_lease_that_ends_tells_its_hop_the_context_its_tokens_were_generated_at() -> None:
    """What the measure pairs with llama.cpp's counters (core/drafting.where): each ended
    request's generated tokens at its prompt and half its answer, from llama.cpp's timings."""
    from types import SimpleNamespace
    from typing import Any, cast

    from corral.runtime.hop import Hop, Lease
    from corral.runtime.meter import Meter

    meter = Meter(clock=lambda: 0.0)
    hop = Hop(cast(Any, SimpleNamespace(spec=None)))
    released: list[int] = []
    grants = cast(Any, SimpleNamespace(_release=lambda rid, tool_call: released.append(rid)))

    def lease(rid: int) -> Lease:
        return Lease(grants, rid, hop.runner, 0.0, False, meter.tally("r", "a"), hop)

    answered = lease(1)
    answered.tally.timed({"predicted_n": 200, "prompt_n": 100, "cache_n": 1300})
    answered.release()
    answered.release()  # once only
    failed = lease(2)  # ended before llama.cpp said its prompt: nothing to count
    failed.tally.add(5)
    failed.release()
    assert released == [1, 2]
    assert (hop.context, hop.contexted) == (200 * (1400 + 100), 200)
    c = Counters(generated=200, decodes=200, busy=200.0, context=hop.context,
                 contexted=hop.contexted)  # fmt: skip
    assert c.depth == 1500 and Counters().depth is None


async def test_turning_off_is_said_once_while_the_runner_drafts_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A busy runner drafts on until it is idle for its restart, and its windows are judged
    on: one that does not pay again leaves the choice as it was, and is not said again (the
    bench's log said the same "drafting off" every 2-4 s under 16 clients)."""
    _, _, rec, measure = _measured(
        tmp_path,
        Counters(prompt=640, prompt_s=2.0, decodes=1, busy=1.0),  # read alone: 3.1 ms a row
        Counters(640, 2.0, 300, 2.8, 300, 30, 100, 100.0),  # 10% of the drafts accepted
        Counters(640, 2.0, 600, 5.6, 600, 60, 200, 200.0),  # ... and again: off
        Counters(640, 2.0, 900, 8.4, 900, 90, 300, 300.0),  # ... and again
    )
    with caplog.at_level("INFO", logger="corral.runtime.measure"):
        for _ in range(4):
            await measure.count_tokens(rec)
    choice = measure.drafting["a"]
    assert not choice.on
    said = [r.getMessage() for r in caplog.records if "drafting off" in r.getMessage()]
    assert len(said) == 1 and said[0].endswith(f"({choice.why})")
