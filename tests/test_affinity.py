"""Conversations keep their slot (runtime/affinity): which of a runner's slots a prompt goes to."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given
from hypothesis import strategies as st

from corral.runtime.affinity import BYTES_PER_TOKEN, Slots, prompt_pieces, shared_length


@dataclass
class Lease:
    released: bool = False


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


def common_start(a: bytes, b: bytes) -> int:
    differ = (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    return next(differ, min(len(a), len(b)))


@given(st.text(max_size=60), st.text(max_size=60))
def test_the_shared_length_is_the_common_start_in_bytes(x: str, y: str) -> None:
    a, b = x.encode(), y.encode()
    assert shared_length((a,), (b,)) == common_start(a, b)
    # Whole equal pieces count in full, then the common start of the first that differ.
    assert shared_length((b"head", a), (b"head", b)) == 4 + common_start(a, b)
