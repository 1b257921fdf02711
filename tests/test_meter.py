"""The relayed-token meter alone (runtime/meter.py), on a clock the test moves: what llama.cpp's
streams carry in tokens, each request's tally, and the rates per model, runner and slot over
the recent window, falling to 0 once idle."""

from __future__ import annotations

import pytest

from corral.runtime.meter import (
    WINDOW,
    Meter,
    count_events,
    predicted_tokens,
    token_events,
    whole_tokens,
)

# What llama.cpp's server streams, as captured from a runner (ids and times shortened).
CHAT_ROLE = (b'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"role":"assistant",'
             b'"content":null}}],"created":1,"id":"c","model":"m","object":"chat.completion.chunk"}'
             b"\n\n")
CHAT_TOKEN = (b'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":" so"}}],'
              b'"created":1,"id":"c","model":"m","object":"chat.completion.chunk"}\n\n')
CHAT_THINK = (b'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"reasoning_content"'
              b':"hm"}}],"created":1,"id":"c","model":"m","object":"chat.completion.chunk"}\n\n')
CHAT_END = (b'data: {"choices":[{"finish_reason":"length","index":0,"delta":{}}],"created":1,'
            b'"id":"c","model":"m","object":"chat.completion.chunk","timings":{"cache_n":0,'
            b'"prompt_n":37,"predicted_n":7,"predicted_ms":3.3}}\n\n')
CHAT_USAGE = (b'data: {"choices":[],"created":1,"id":"c","model":"m","usage":{"completion_tokens"'
              b':7,"prompt_tokens":37},"timings":{"prompt_n":1,"predicted_n":7}}\n\n')
DONE = b"data: [DONE]\n\n"
NATIVE_TOKEN = (b'data: {"index":0,"content":"akers","tokens":[4797],"stop":false,"id_slot":-1,'
                b'"tokens_predicted":2,"tokens_evaluated":1}\n\n')
NATIVE_END = (b'data: {"index":0,"content":"","tokens":[],"id_slot":0,"stop":true,"model":"m",'
              b'"tokens_predicted":4,"generation_settings":{"stop":[]},"timings":{"prompt_n":1,'
              b'"predicted_n":4,"predicted_ms":2.79}}\n\n')
LEGACY_TOKEN = (b'data: {"choices":[{"text":" case","index":0,"logprobs":null,"finish_reason":'
                b'null}],"created":1,"model":"m","object":"text_completion","id":"c"}\n\n')
LEGACY_END = (b'data: {"choices":[{"text":"","index":0,"logprobs":null,"finish_reason":"length"}]'
              b',"usage":{"completion_tokens":4},"timings":{"predicted_n":4}}\n\n')


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


# ---- what the streams carry -----------------------------------------------------------------
def test_one_token_per_event_but_the_opening_and_the_end() -> None:
    assert token_events(CHAT_ROLE) == 0
    assert token_events(CHAT_TOKEN) == token_events(CHAT_THINK) == 1
    assert token_events(CHAT_END + CHAT_USAGE + DONE) == 0
    assert token_events(CHAT_ROLE + CHAT_TOKEN * 5 + CHAT_THINK + CHAT_END + DONE) == 6
    assert token_events(NATIVE_TOKEN * 3 + NATIVE_END) == 3
    assert token_events(LEGACY_TOKEN * 4 + LEGACY_END + DONE) == 4
    assert token_events(b"") == token_events(b": ping\n\n") == 0


def test_text_that_looks_like_a_marker_is_still_a_token() -> None:
    # Quotes in generated text are escaped, so a marker inside text never matches.
    tricky = CHAT_TOKEN.replace(b'" so"', b'"\\"stop\\":true \\"finish_reason\\":\\"x"')
    assert token_events(tricky) == 1


def test_llamacpps_own_count_from_the_timings() -> None:
    assert predicted_tokens(CHAT_END + DONE) == 7
    assert predicted_tokens(NATIVE_END) == 4
    assert predicted_tokens(CHAT_TOKEN) is None
    assert predicted_tokens(b'{"timings":{"predicted_n":') is None
    assert whole_tokens({"usage": {"completion_tokens": 9}, "timings": {"predicted_n": 8}}) == 9
    assert whole_tokens({"timings": {"predicted_n": 8}}) == 8
    assert whole_tokens({"tokens_predicted": 3}) == 3
    assert whole_tokens({"data": []}) is None


def test_a_stream_counted_as_it_passes_settles_with_llamacpps_count() -> None:
    meter = Meter(Clock())
    t = meter.tally("r", "m")
    count_events(t, CHAT_ROLE + CHAT_TOKEN * 2)
    assert t.total == 2
    count_events(t, CHAT_TOKEN * 3)
    assert t.total == 5
    count_events(t, CHAT_END + DONE)  # 7 generated: two had no chunk of their own
    assert t.total == 7
    t.settle(6)  # never less than what passed
    assert t.total == 7


# ---- rates ----------------------------------------------------------------------------------
def test_a_stream_rate_over_the_window_then_zero_once_idle() -> None:
    clock = Clock()
    meter = Meter(clock)
    t = meter.tally("r", "m")
    assert meter.read().rates == {}
    t.add(1)  # the first token starts the clock
    assert meter.read().rates == {"m": 0.0}
    for _ in range(40):  # 10 tokens a second for 4 s
        clock.t += 0.1
        t.add(1)
    r = meter.read()
    assert r.rates["m"] == pytest.approx(10.0)
    assert r.runner_rates["r"] == pytest.approx(10.0)
    assert r.slot_rates["r"] == pytest.approx((10.0,))
    for _ in range(60):  # 20 a second for 6 s: the window forgets the slower start
        clock.t += 0.05
        t.add(1)
        clock.t += 0.05
        t.add(1)
    assert meter.read().rates["m"] == pytest.approx(20.0, rel=0.02)
    t.end()  # the request is over: the slot is free, the rate falls as its tokens age ...
    r = meter.read()
    assert r.slot_rates == {} and r.rates["m"] == pytest.approx(20.0, rel=0.02)
    clock.t += WINDOW / 2
    assert meter.read().rates["m"] == pytest.approx(10.0, rel=0.05)
    clock.t += WINDOW / 2 + 0.01  # ... to nothing once idle for the window
    r = meter.read()
    assert r.rates == {"m": 0.0} and r.runner_rates == {}
    assert r.relayed == {"m": 1 + 40 + 120}


def test_rates_add_up_per_runner_and_model_and_slots_are_reused() -> None:
    clock = Clock()
    meter = Meter(clock)
    a, b, c = meter.tally("r1", "m"), meter.tally("r1", "m"), meter.tally("r2", "m")
    other = meter.tally("r3", "n")
    for t in (a, b, c, other):
        t.add(1)
    for _ in range(10):
        clock.t += 0.1
        a.add(1)
        b.add(2)
        c.add(3)
        other.add(1)
    r = meter.read()
    assert r.slot_rates["r1"] == pytest.approx((10.0, 20.0))
    assert r.runner_rates["r1"] == pytest.approx(30.0)
    assert r.runner_rates["r2"] == pytest.approx(30.0)
    assert r.rates == pytest.approx({"m": 60.0, "n": 10.0})
    assert r.relayed == {"m": 3 + 10 + 20 + 30, "n": 11}
    a.end()
    d = meter.tally("r1", "m")
    assert meter.read().slot_rates["r1"] == pytest.approx((0.0, 20.0))  # a's slot is free
    d.add(1)  # the first stream that starts takes the free slot
    assert d.slot == 0
    b.end()
    d.end()
    c.end()
    other.end()
    assert meter.read().slot_rates == {}


def test_a_request_without_tokens_leaves_no_trace() -> None:
    meter = Meter(Clock())
    t = meter.tally("r", "m")
    t.add(0)
    t.end()
    t.end()
    r = meter.read()
    assert r.relayed == {"m": 0} and r.slot_rates == {} and r.runner_rates == {}


def test_tokens_counted_after_the_lease_went_back_still_count() -> None:
    meter = Meter(Clock())
    t = meter.tally("r", "m")
    t.add(2)
    t.end()
    t.settle(5)
    assert meter.read().relayed == {"m": 5}


def test_ended_requests_are_forgotten_even_if_nobody_reads() -> None:
    clock = Clock()
    meter = Meter(clock)
    for _ in range(1000):
        t = meter.tally("r", "m")
        t.add(3)
        t.end()
        clock.t += 1.0
    assert len(meter._recent) <= WINDOW + 1
    assert meter.read().relayed == {"m": 3000}
