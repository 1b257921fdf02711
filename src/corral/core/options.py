"""The one table of model options (Ollama's names): what a request's `options` may carry, what
a model's own defaults may set (models.toml, a created model's parameters), which of them shape
the runner process and which are llama.cpp sampling parameters.

Every check, mapping and runner parameter of an option is derived from its row here: the
request check (api/common.check_options, /api/create's parameters), the models.toml check and
the split of a created model's parameters (runtime/registry), the runner spec
(core/spec.runner_spec) and the sampling names (api/families/ollama, api/defaults). Adding an
option is one row, plus, when it shapes the runner, a RunnerSpec field and its llama.cpp parameter
(runtime/runner_child; llama-server's flag in runtime/runner), which tests/test_options.py
checks every runner option reaches.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

FLASH_ATTN = ("auto", "on", "off")  # llama.cpp's -fa values
# Speculative decoding (llama.cpp's --spec-type), as a model's runner option: `auto` (the
# default: the draft model where the model names one, else no drafting yet, core/spec.speculation
# says why), `off`, `draft` (a small model of the same vocabulary drafts: the `draft` option), or
# one of llama.cpp's n-gram drafters, which need no second model and draft tokens that repeat
# what the context already holds (an agent's edit of a file it was shown).
SPECULATIVE = ("auto", "off", "draft", "ngram-mod", "ngram-simple", "ngram-map-k",
               "ngram-map-k4v", "ngram-cache")  # fmt: skip
# llama.cpp's --spec-draft-n-max default (common_params_speculative_draft.n_max, b11434)
DRAFT_MAX = 3
# corral's lengths for llama.cpp's ngram-mod drafter (llama.cpp's: a 24-token lookup, drafts of
# 48 to 64): a longer lookup drafts only where more of the context repeats, and a longer draft
# carries more of an edit's copied lines through one verification. Measured with llama-server
# itself on 2 cores, a 2,048-token edit at 1 client: SmolLM2 88 -> 100-103 tokens/s, Gemma 3
# 270M 179 -> 210, and Gemma's search/replace 56 -> 81 (64 without drafting). A model's
# draft_max and draft_min set the draft lengths.
NGRAM_MOD_MATCH = 32
NGRAM_MOD_MIN = 48
NGRAM_MOD_MAX = 128


def ngram_mod_lengths(draft_max: int | None, draft_min: int | None) -> tuple[int, int, int]:
    """ngram-mod's lookup, shortest and longest draft in tokens: corral's, or the model's
    draft_min and draft_max."""
    most = NGRAM_MOD_MAX if draft_max is None else draft_max
    return NGRAM_MOD_MATCH, min(NGRAM_MOD_MIN if draft_min is None else draft_min, most), most


def spec_type(choice: str) -> str:
    """llama.cpp's --spec-type for a `speculative` choice: a draft model is its "draft-simple"
    (a model of its own, greedy drafts), the n-gram drafters their own names."""
    return "draft-simple" if choice == "draft" else choice
JsonType = type | tuple[type, ...]


@dataclass(frozen=True)
class Option:
    """One option: its JSON type, the values refused, where it goes."""

    name: str  # as Ollama (and models.toml) names it
    type: JsonType  # its JSON type(s); an int is a number too
    range: tuple[float, float] = (-math.inf, math.inf)  # absurd values are refused up front
    request: bool = True  # a request's `options` may carry it
    # A model's own default for its runner: models.toml may set it, and a created model's
    # parameters carry it to the runner (its other parameters are request defaults).
    model: bool = False
    runner: str | None = None  # the RunnerSpec field it sets: a change reloads the runner
    # Values a shared runner takes, others clamped to them (not refused): a value that suits one
    # client would slow every other client of the runner.
    clamp: tuple[int, int] | None = None
    sampling: str | None = None  # llama.cpp's sampling parameter (both of its endpoints)
    negative: bool = False  # models.toml may give a negative value (num_gpu -1: every layer)
    choices: tuple[str, ...] = ()  # the strings models.toml may give, if only some


# The one table of options. A request's options are checked in this order (the first wrong one
# is reported); options no row names are ignored, as Ollama does.
OPTIONS: tuple[Option, ...] = (
    Option("num_ctx", int, (1, 2**21), model=True, runner="n_ctx"),
    # A batch below 32 slows every client's prompts on a shared runner; above 4096 the compute
    # buffer grows for little gain (llama.cpp's default is 2048 / micro-batch 512).
    Option("num_batch", int, (1, 2**16), model=True, runner="n_batch", clamp=(32, 4096)),
    Option("num_gpu", int, (-1, 4096), model=True, runner="n_gpu_layers", negative=True),
    Option("main_gpu", int, (0, 255), model=True, runner="main_gpu", negative=True),
    Option("num_thread", int, (0, 1024), model=True, runner="threads"),
    Option("num_keep", int, sampling="n_keep"),
    Option("num_predict", int, (-2, 2**24), sampling="n_predict"),
    Option("seed", int, sampling="seed"),
    Option("top_k", int, (0, 2**20), sampling="top_k"),
    Option("top_p", float, sampling="top_p"),
    Option("min_p", float, sampling="min_p"),
    Option("typical_p", float, sampling="typical_p"),
    Option("temperature", float, (0, 1000), sampling="temperature"),
    Option("repeat_penalty", float, sampling="repeat_penalty"),
    Option("repeat_last_n", int, (-1, 2**21), sampling="repeat_last_n"),
    Option("presence_penalty", float, sampling="presence_penalty"),
    Option("frequency_penalty", float, sampling="frequency_penalty"),
    Option("mirostat", int, sampling="mirostat"),
    Option("mirostat_tau", float, sampling="mirostat_tau"),
    Option("mirostat_eta", float, sampling="mirostat_eta"),
    Option("stop", (list, str)),  # stop sequences: found by corral, not llama.cpp
    # Accepted for Ollama's clients, with no effect on llama.cpp.
    Option("penalize_newline", bool),
    Option("use_mmap", bool, model=True, runner="use_mmap"),
    Option("use_mlock", bool, model=True, runner="use_mlock"),
    Option("numa", bool),
    Option("low_vram", bool),
    Option("tfs_z", float),
    # A model's own only (models.toml): the server's settings give their defaults.
    Option("num_parallel", int, request=False, model=True, runner="num_parallel"),
    Option("flash_attn", str, request=False, model=True, runner="flash_attn", choices=FLASH_ATTN),
    Option(
        "speculative", str, request=False, model=True, runner="speculative", choices=SPECULATIVE
    ),
    # The draft model (a model name the registry resolves, or a GGUF path) and how many tokens
    # it drafts at most and at least (llama.cpp's --spec-draft-n-max/-n-min; n_max >= 0)
    Option("draft", str, request=False, model=True, runner="draft"),
    Option("draft_max", int, (0, 2**16), request=False, model=True, runner="draft_max"),
    Option("draft_min", int, (0, 2**16), request=False, model=True, runner="draft_min"),
    Option("n_cpu_moe", int, request=False, model=True, runner="n_cpu_moe"),
    Option("kv_cache_type", str, request=False, model=True, runner="kv_cache_type"),
)  # fmt: skip

# Derived views, by name.
REQUEST_OPTIONS: dict[str, Option] = {o.name: o for o in OPTIONS if o.request}
MODEL_OPTIONS: dict[str, Option] = {o.name: o for o in OPTIONS if o.model}
# A request's options that shape the runner -> their RunnerSpec fields (the others a model's
# defaults and the server's settings set).
SHAPING: dict[str, str] = {o.name: o.runner for o in OPTIONS if o.request and o.runner}
# RunnerSpec field -> the values a shared runner takes (others are clamped to them).
CLAMPED: dict[str, tuple[int, int]] = {
    o.runner: o.clamp for o in OPTIONS if o.runner is not None and o.clamp is not None
}
SAMPLING: dict[str, str] = {o.name: o.sampling for o in OPTIONS if o.sampling}


def speculation_problem(options: Mapping[str, Any]) -> str | None:
    """What is wrong with a model's speculative options together (each alone is checked by its
    row), or None: a draft model drafts only with `speculative` auto, draft or off."""
    choice, draft = options.get("speculative"), options.get("draft")
    if choice == "draft" and not draft:
        return 'speculative "draft" needs a draft model: set draft to a model name or GGUF path'
    if draft and choice not in (None, "auto", "draft", "off"):
        return (f'draft names a draft model, but speculative is "{choice}", an n-gram drafter '
                'that takes none: set speculative to "draft" (or auto)')  # fmt: skip
    return None
