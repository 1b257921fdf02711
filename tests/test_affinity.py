"""Conversations keep their slot (runtime/affinity): which of a runner's slots a prompt goes to."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given
from hypothesis import strategies as st

from corral.runtime.affinity import (
    BYTES_PER_TOKEN,
    Pick,
    Slots,
    copy_pays,
    prompt_pieces,
    shared_length,
)


@dataclass
class Lease:
    released: bool = False
    released_at: float = 0.0
    generated: int = 0
    prompt_tokens: int | None = None


SYSTEM = {"role": "system", "content": "You are a coding agent. " * 200}
TOOLS = [{"type": "function", "function": {"name": "read", "parameters": {}}}]


def chat(*turns: str) -> tuple[bytes, ...]:
    messages = [SYSTEM]
    for i, text in enumerate(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
    return prompt_pieces("/v1/chat/completions", {"messages": messages, "tools": TOOLS})


def claim(slots: Slots, pieces: tuple[bytes, ...]) -> int:
    slot = slots.claim(Lease(released=True), pieces)  # released at once: the turn ended
    assert slot is not None
    return slot


def test_a_conversations_next_turn_goes_back_to_its_slot() -> None:
    slots = Slots(4)
    first_a, first_b = "fix the bug in a.py where it reads the file", "write tests for b.py, all"
    a = claim(slots, chat(first_a))
    b = claim(slots, chat(first_b))  # shares the system prompt and tools with a
    assert b != a  # an empty slot, not a's: a's history stays where it is
    assert claim(slots, chat(first_b, "done", "now run them")) == b
    assert claim(slots, chat(first_a, "fixed", "and the other one")) == a
    # A short request of another kind (a title) takes an empty slot too.
    title = prompt_pieces("/v1/chat/completions", {"messages": [
        {"role": "user", "content": "a title for this conversation"}]})  # fmt: skip
    assert claim(slots, title) not in (a, b)



def test_idle_slots_worth_parking_and_a_parked_slot_is_empty_once_done() -> None:
    """`idle`: the slots but the request's own that no lease holds and that hold a prompt worth
    moving out of a shared cache, fullest first; one held while it is parked is picked by no
    one, and once emptied takes a new conversation like any empty slot."""

    def ask(text: str) -> tuple[bytes, ...]:
        return prompt_pieces("/v1/chat/completions", {"messages": [
            {"role": "user", "content": text}]})  # fmt: skip

    slots = Slots(4, 100_000)
    a = claim(slots, ask("fix the bug in a.py " * 50))
    b = claim(slots, ask("write tests for b.py " * 80))
    busy = slots.claim(Lease(), ask("write the docs " * 60))
    hi = claim(slots, ask("hi"))
    assert busy is not None and len({a, b, busy, hi}) == 4
    assert slots.idle(keep=a) == [b]  # not the request's own, the busy one, nor a short one
    assert slots.idle(keep=busy) == [b, a]  # fullest first
    held = slots.hold(a)
    assert a not in slots.free() and slots.claim(Lease(), ask("fix the bug in a.py " * 51)) != a
    slots.emptied(a)
    held.released = True
    assert slots.idle(keep=busy) == [b] and a in slots.free()
    assert slots.claim(Lease(), ask("a new one")) == a  # an empty slot again


def test_a_slot_is_idle_for_parking_only_once_released_before_the_time_given() -> None:
    """`idle(keep, since)`: a slot whose lease was released after `since` (its client's next
    turn may be on its way) stays; one released before, or never held by a lease, goes."""
    slots = Slots(4, 100_000)
    early, late = Lease(released=True, released_at=10.0), Lease(released=True, released_at=20.0)
    a = slots.claim(early, chat("fix the bug in a.py " * 50))
    b = slots.claim(late, chat("write tests for b.py " * 80))
    keep = slots.claim(Lease(), chat("hi"))
    assert a is not None and b is not None and keep is not None
    assert slots.idle(keep) == [b, a]  # no time given: every idle one
    assert slots.idle(keep, since=15.0) == [a]
    assert slots.idle(keep, since=20.0) == [b, a]  # released at `since`: idle long enough
    assert slots.idle(keep, since=5.0) == []
    p = slots.pick(Lease(), chat("a new conversation " * 90))
    assert p is not None and p.slot not in (a, b, keep)
    assert slots.leaving(p, since=15.0) == [(a, True)]


def test_a_busy_slot_is_never_claimed_twice_and_a_released_one_is_free_again() -> None:
    slots = Slots(2)
    first, second = Lease(), Lease()
    a = slots.claim(first, chat("one"))
    b = slots.claim(second, chat("one"))  # the same prompt: its slot is busy, so the other
    assert {a, b} == {0, 1}
    assert slots.claim(Lease(), chat("one")) is None  # every slot held: llama.cpp picks
    first.released = True
    assert slots.claim(Lease(), chat("one", "ok", "two")) == a
    # The holder's own slot is free to it: a lease that sends again keeps its slot.
    assert slots.claim(second, chat("one", "ok", "three")) == b


def test_a_prompt_crowds_a_shared_cache_only_beside_running_prompts_it_would_outgrow() -> None:
    """`crowds`: whether a claimed prompt and those of the other running requests outgrow the
    cache they share (at BYTES_PER_TOKEN); released and skipped holders (requests waiting
    too) do not count, nor does a cache per slot."""
    slots = Slots(4, capacity=1000)
    half = (b"x" * (600 * BYTES_PER_TOKEN),)  # 600 tokens: one fits, two do not
    a, b, c = Lease(), Lease(), Lease()
    slots.claim(a, half)
    assert not slots.crowds(a)  # alone: llama.cpp refuses one too long before it starts
    slots.claim(b, (b"y" * (600 * BYTES_PER_TOKEN),))
    assert slots.crowds(b) and slots.crowds(a)
    assert not slots.crowds(b, skip=[a])  # a waits too: it is not running
    a.released = True
    assert not slots.crowds(b)
    slots.claim(c, (b"z" * (300 * BYTES_PER_TOKEN),))
    assert not slots.crowds(c)  # 600 + 300 fit
    b.generated = 101  # b's answer holds cells too: 600 + 101 + 300 do not fit
    assert slots.crowds(c)
    b.generated = 0
    assert {id(h) for h in slots.holders()} == {id(b), id(c)}
    per_slot = Slots(2)
    d, e = Lease(), Lease()
    per_slot.claim(d, half)
    per_slot.claim(e, half)
    assert not per_slot.crowds(e)


def test_room_is_counted_at_the_bytes_per_token_the_runners_requests_showed() -> None:
    """Two agents' prompts that fit together, though at the guessed 3 bytes a token they would
    not: once a request has ended with llama.cpp's count of its prompt (here 4.5 bytes a
    token), room is counted at that, and they run at once."""
    slots = Slots(4, capacity=1000)
    prompt = (b"p" * 1800,)  # 600 tokens at the guess, 400 at 4.5
    first = Lease()
    slots.claim(first, prompt)
    first.released, first.prompt_tokens = True, 400  # it ended: llama.cpp read 400 tokens
    a, b = Lease(), Lease()
    slots.claim(a, prompt)
    slots.claim(b, prompt)
    assert slots.bytes_per_token == 4.5
    assert not slots.crowds(b)  # 400 + 400 fit 1,000
    c = Lease()
    slots.claim(c, prompt)
    assert slots.crowds(c)  # a third does not
    # a short prompt is mostly its template's tokens: it teaches nothing
    d, e = Slots(2, capacity=1000), Lease()
    d.claim(e, (b"hi",))
    e.released, e.prompt_tokens = True, 30
    d.claim(Lease(), (b"x" * 2000,))
    assert d.bytes_per_token == 3


def test_a_full_shared_cache_gives_up_the_slot_whose_loss_costs_least() -> None:
    one = chat("x" * 3000)
    size = sum(len(p) for p in one)
    # The shared cache holds about two such conversations: a third would make llama.cpp clear
    # an idle slot, whichever comes first; corral gives up the one the new prompt reuses most.
    slots = Slots(4, capacity=int(2.5 * size / BYTES_PER_TOKEN))
    a = claim(slots, one)
    other = prompt_pieces("/v1/chat/completions", {"messages": [
        {"role": "user", "content": "y" * size}]})  # fmt: skip
    b = claim(slots, other)
    c = claim(slots, chat("z" * 3000))  # shares the system prompt with a, nothing with b
    assert b != a and c == a
    # With each slot's cache its own, an empty slot is always taken.
    slots = Slots(4, capacity=None)
    a = claim(slots, one)
    claim(slots, other)
    assert claim(slots, chat("z" * 3000)) not in (a,)


def test_a_raw_prompt_continued_goes_back_to_its_slot() -> None:
    """A prompt rendered by corral (a template without tools, Ollama's context) is one text
    that the next turn continues, give or take the end of the last turn."""
    slots = Slots(4)
    system = "<|im_start|>system\nYou are a coding agent." + " Use the tools." * 300

    def raw(text: str) -> tuple[bytes, ...]:
        return prompt_pieces("/completion", {"prompt": [system + text]})

    a = claim(slots, raw("<|im_start|>user\nfix a.py<|im_end|>\n<|im_start|>assistant\n"))
    b = claim(slots, raw("<|im_start|>user\ntest b.py<|im_end|>\n<|im_start|>assistant\n"))
    assert a != b
    later = raw("<|im_start|>user\nfix a.py<|im_end|>\n<|im_start|>assistant\n<think>\n\n"
                "</think>\nDone.<|im_end|>\n<|im_start|>user\nthanks<|im_end|>\n")  # fmt: skip
    assert claim(slots, later) == a
    # Ollama's context: token ids before the text, each a piece of its own.
    assert prompt_pieces("/completion", {"prompt": [1, 2, "hi"]}) == (b"1", b"2", b"hi")


def test_with_no_slot_to_spare_a_side_request_takes_the_least_recently_used() -> None:
    """Two agents' sessions in slots used just now, two older conversations in the others, and
    a side request (a title) sharing nothing: it gives up an old conversation's slot, not a
    live session's, however their sizes compare."""
    slots = Slots(4)
    old = [claim(slots, chat(f"an old conversation, number {i}, long done" + "x" * 2000))
           for i in range(2)]  # fmt: skip
    live = [claim(slots, chat(f"session {i}: an agent at work on its task")) for i in range(2)]
    title = prompt_pieces("/v1/chat/completions", {"messages": [
        {"role": "user", "content": "a title for this conversation, please"}]})  # fmt: skip
    assert claim(slots, title) == old[0]
    assert claim(slots, chat("session 0: an agent at work on its task", "ok", "go")) == live[0]


def test_the_prompt_is_its_messages_with_the_tools_after_the_system_message() -> None:
    msgs = [SYSTEM, {"role": "user", "content": "hi"}]
    pieces = prompt_pieces("/v1/chat/completions", {"messages": msgs, "tools": TOOLS})
    assert [p[:20] for p in pieces] == [
        b'{"role":"system","co', b'[{"type":"function",', b'{"role":"user","cont'
    ]
    assert prompt_pieces("/completion", {"prompt": "text"}) == (b"text",)
    assert prompt_pieces("/completion", {}) == ()


# ---- a new conversation starts from another slot's state -------------------------------------


def pick(slots: Slots, pieces: tuple[bytes, ...], holder: Lease | None = None) -> Pick:
    p = slots.pick(holder or Lease(released=True), pieces)
    assert p is not None
    return p


def test_a_new_conversation_on_an_empty_slot_names_the_idle_slot_sharing_most_of_it() -> None:
    slots = Slots(4)
    first_a = "fix the bug in a.py where it reads the file twice over"
    a = pick(slots, chat(first_a))
    assert a.source is None  # nothing to start from
    b = chat("write tests for b.py, all of them, and run them")
    p = pick(slots, b)
    assert p.slot != a.slot and p.source == a.slot  # its own slot, started from a's state
    shared = shared_length(chat(first_a), b)
    assert shared > len(chat()[0]) and (p.shared, p.held, p.spared) == (shared, 0, shared)
    assert p.source_size == sum(len(x) for x in chat(first_a))
    # A's next turn goes back to its own slot and needs no copy.
    back = pick(slots, chat(first_a, "ok", "go"))
    assert back == Pick(a.slot, held=sum(len(x) for x in chat(first_a)), own=True)
    # A third conversation starts from the one that shares most and, of those, holds least:
    # a and b share the system prompt and tools, and a now holds its second turn too.
    c = pick(slots, chat("document the module c.py for its new readers"))
    assert c.slot not in (a.slot, p.slot) and c.source == p.slot


def test_a_busy_slot_is_never_a_source() -> None:
    """llama.cpp would defer the save of a slot that is generating until it is done."""
    slots = Slots(3)
    busy = Lease()
    a = pick(slots, chat("the first conversation, still generating its answer"), busy)
    p = pick(slots, chat("a second conversation that shares the system prompt"), Lease())
    assert p.slot != a.slot and p.source is None
    busy.released = True  # a is answered, p still generating
    q = pick(slots, chat("and a third one once the first is answered"))
    assert q.slot not in (a.slot, p.slot) and q.source == a.slot


def test_a_slot_that_holds_less_of_the_prompt_than_another_idle_one_gets_its_state() -> None:
    """No empty slot: the least recently used gives way, and starts from the slot that shares
    the system prompt (only what it holds beyond what the slot itself shares is spared)."""
    slots = Slots(2)
    history = ("an agent's session at work on its task " * 200,)
    a = pick(slots, chat(*history))
    old = pick(slots, prompt_pieces("/v1/chat/completions", {"messages": [
        {"role": "user", "content": "a title for this conversation, please"}]}))  # fmt: skip
    pick(slots, chat(*history, "ok", "go on"))  # a used last
    p = pick(slots, chat("another session of the agent"))
    assert (p.slot, p.source) == (old.slot, a.slot)
    assert 0 < p.held < p.shared and p.spared == p.shared - p.held


def test_where_a_copy_pays_the_least_recently_used_gives_way_not_a_live_conversation() -> None:
    """No empty slot, and a new session that shares the system prompt and tools with a live
    one (more than that one holds besides): without copies it takes the live session's slot
    (it reuses more than it destroys); where a copy pays, the least recently used slot takes
    it, with a copy of the live session's state, and the live session keeps its slot."""
    for pays, taken in ((None, "live"), (lambda spared, size: True, "old")):
        slots = Slots(2)
        old = pick(slots, prompt_pieces("/v1/chat/completions", {"messages": [
            {"role": "user", "content": "a title for this conversation, please"}]}))  # fmt: skip
        live = pick(slots, chat("an agent's session at work on its task"))
        p = slots.pick(Lease(released=True), chat("another session of the agent"), pays)
        assert p is not None
        assert p.slot == {"live": live.slot, "old": old.slot}[taken]
        assert p.source == (live.slot if taken == "old" else None)
    # Where it does not pay, the pick is as without copies.
    slots = Slots(2)
    pick(slots, chat("an agent's session at work on its task"))
    pick(slots, chat("x" * 20))
    p = slots.pick(Lease(released=True), chat("another session"), lambda spared, size: False)
    assert p is not None and p.source is None


def test_no_source_whose_state_would_not_fit_in_a_full_shared_cache() -> None:
    one = chat("x" * 3000)
    size = sum(len(x) for x in one)
    # Room for the source twice over but not for its copy beside a third conversation.
    slots = Slots(4, capacity=int(2.2 * size / BYTES_PER_TOKEN))
    a = pick(slots, one)
    assert pick(slots, chat("y" * 100)).source == a.slot  # a's copy fits beside it
    pick(slots, prompt_pieces("/v1/chat/completions", {"messages": [
        {"role": "user", "content": "z" * size}]}))  # fmt: skip
    assert pick(slots, chat("w" * 100)).source is None


def test_a_copy_pays_where_its_bytes_cost_less_than_evaluating_what_it_spares() -> None:
    shared = source = 12_000 * BYTES_PER_TOKEN  # a 12k-token agent prompt
    # A small model on a CPU: 23 KB of state per token, 700 tokens/s, a disk at 1 GB/s.
    assert copy_pays(shared, source, 23_040, 1e9, 700)
    # A large model on a GPU evaluates 10k tokens/s; its state is 160 KB per token.
    assert not copy_pays(shared, source, 160_000, 1e9, 10_000)
    # A few tokens spared do not pay for the round trips; a long slot copied for a short
    # prefix does not pay either.
    assert not copy_pays(BYTES_PER_TOKEN, BYTES_PER_TOKEN, 23_040, 1e9, 700)
    assert not copy_pays(100 * BYTES_PER_TOKEN, 100_000 * BYTES_PER_TOKEN, 23_040, 1e9, 700)
    # Unknown figures: no copy.
    assert not copy_pays(shared, source, 23_040, 1e9, None)
    assert not copy_pays(shared, source, 0.0, 1e9, 700)


def common_start(a: bytes, b: bytes) -> int:
    differ = (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    return next(differ, min(len(a), len(b)))


@given(st.text(max_size=60), st.text(max_size=60))
def test_the_shared_length_is_the_common_start_in_bytes(x: str, y: str) -> None:
    a, b = x.encode(), y.encode()
    assert shared_length((a,), (b,)) == common_start(a, b)
    # Whole equal pieces count in full, then the common start of the first that differ.
    assert shared_length((b"head", a), (b"head", b)) == 4 + common_start(a, b)
