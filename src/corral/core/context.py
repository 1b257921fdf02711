"""How long a context a runner gets when nobody fixed one, and how long one a prompt needs.

`context_grid`: with `CORRAL_CONTEXT_LENGTH=auto` (the default) and no `num_ctx` from the model
or the request, the contexts a runner may get: a grid of powers of two (plus the trained length
itself) between a floor and the model's trained context. The admission offers the scheduler
each, longest first (runtime/admission), and the core loads the first that fits by its room
rule (core/books). `grown_context`: the context a prompt that did not fit needs (the next power
of two holding it and its output, up to the trained context). Pure: no memory is measured here.
"""

from __future__ import annotations

# The least an automatic context gives (or the trained context, if smaller): what corral gave
# every model before it sized contexts to the machine, so no model gets less than it used to.
AUTO_FLOOR = 4096
# The most a context grows to for a model whose file does not say what it was trained for.
UNKNOWN_TRAINED_CAP = 1 << 17
# A request that does not say how many tokens it generates gets room for this many.
DEFAULT_OUTPUT = 1024


def context_grid(trained: int, floor: int = AUTO_FLOOR) -> list[int]:
    """The contexts an automatic context may be, ascending: the floor (capped at `trained`), every
    power of two above it below `trained`, and `trained`. `trained` 0: the floor alone."""
    if trained <= 0:
        return [floor]
    lo = min(floor, trained)
    grid = [lo]
    size = 1 << lo.bit_length()  # the next power of two above lo
    while size < trained:
        grid.append(size)
        size *= 2
    if trained > lo:
        grid.append(trained)
    return grid


def next_power_of_two(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def grown_context(prompt_tokens: int, output_tokens: int, trained: int) -> int | None:
    """The context for a prompt of `prompt_tokens` and up to `output_tokens` generated: the
    next power of two that holds both, capped at the trained context; None if the prompt alone
    does not fit the trained context (llama.cpp needs at least one position after it)."""
    cap = trained if trained > 0 else UNKNOWN_TRAINED_CAP
    if prompt_tokens >= cap:
        return None
    return min(next_power_of_two(prompt_tokens + max(output_tokens, 1)), cap)
