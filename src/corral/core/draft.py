"""Whether a model can draft for another (pure): llama.cpp's speculative decoding verifies the
draft model's tokens with the target model, token id for token id, so the two must share their
vocabulary. The rules are llama.cpp's own (common/speculative.cpp,
`common_speculative_are_compatible`, b11434), checked before a runner is started so that a
wrong pair is a clear error at /api/create and at load, not a runner that fails to start:

- the same tokenizer type (tokenizer.ggml.model);
- the same beginning- and end-of-sequence handling: whether each is added, and its id where it is;
- vocabulary sizes within SPEC_VOCAB_MAX_SIZE_DIFFERENCE tokens of each other;
- the same text for every token from id SPEC_VOCAB_CHECK_START_TOKEN_ID up to the smaller size.

Where a file leaves out a key llama.cpp would default, the key is not compared (llama.cpp
itself still checks what it loads).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from corral.core.gguf import ModelInfo

SPEC_VOCAB_MAX_SIZE_DIFFERENCE = 128
SPEC_VOCAB_CHECK_START_TOKEN_ID = 5
_TOKENIZER = "tokenizer.ggml."


def draft_problem(
    target: ModelInfo,
    draft: ModelInfo,
    target_tokens: Sequence[bytes],
    draft_tokens: Sequence[bytes],
) -> str | None:
    """Why `draft` cannot draft for `target` (their tokens' texts given: core.gguf.read_tokens),
    as a sentence naming what differs; None if llama.cpp would take the pair."""
    if "completion" not in draft.capabilities:
        return "it is not a model that generates text"
    t, d = target.metadata, draft.metadata
    kind_t, kind_d = t.get(_TOKENIZER + "model"), d.get(_TOKENIZER + "model")
    if kind_t != kind_d:
        return f"its tokenizer is {kind_d!r}, the model's {kind_t!r}"
    for what, name in (("bos", "beginning"), ("eos", "end")):
        add = f"{_TOKENIZER}add_{what}_token"
        add_t, add_d = t.get(add), d.get(add)
        if add_t is not None and add_d is not None and add_t != add_d:
            return (f"it {'adds' if add_d else 'does not add'} a {name}-of-sequence token, "
                    f"the model {'does' if add_t else 'does not'}")  # fmt: skip
        key = f"{_TOKENIZER}{what}_token_id"
        id_t, id_d = t.get(key), d.get(key)
        if add_t and id_t is not None and id_d is not None and id_t != id_d:
            return f"its {name}-of-sequence token is {id_d}, the model's {id_t}"
    n_t, n_d = len(target_tokens), len(draft_tokens)
    if abs(n_t - n_d) > SPEC_VOCAB_MAX_SIZE_DIFFERENCE:
        return f"its vocabulary has {n_d:,} tokens, the model's {n_t:,}"
    for i in range(SPEC_VOCAB_CHECK_START_TOKEN_ID, min(n_t, n_d)):
        if target_tokens[i] != draft_tokens[i]:
            show_t = target_tokens[i].decode(errors="replace")
            show_d = draft_tokens[i].decode(errors="replace")
            return f"its token {i} is {show_d!r}, the model's {show_t!r}"
    return None
