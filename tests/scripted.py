"""Scripted models: tiny GGUFs whose answer is known, written in a model family's own format.

For tests of tool-call parsing and agent loops against the real llama.cpp: a scripted model
answers every chat the same way (``Script``): a plain ``reply``; a tool ``call`` in its family's
native format when tools are offered; an ``answer`` once the conversation holds a tool result.
llama.cpp renders the family's real chat template, samples the scripted tokens and parses them
with the parser it picked for that template, exactly as it would a real model's output.

How it works (llama architecture, one layer, SmolLM2's tokenizer as ``synth`` uses it):

* The feed-forward weights are zero and attention only copies the prompt's marker (below), so
  the model is a bigram table: the next token is decided by the current one (and the branch).
* Every chunk of the scripted output is a token of its own, added to the vocabulary (a token's
  text may be long: ``{"name": "Bash", "arguments": {...}}``; a reply or answer is one token),
  so no token repeats within a chain and each has one successor. Each chain token gets its own
  standard basis vector as embedding, and the output row of a token is a large multiple of the
  embedding of the token before it (``_LOGIT``: sampling at any usual temperature is greedy).
  The last token of a chain is followed by the family's end-of-generation token.
* The chat template is a prefix, then the family's real chat template (``tests/families/``,
  as llama.cpp ships them, so llama.cpp picks the family's parser from it). The prefix writes
  one marker token (``<|corral_reply|>``, ``<|corral_call|>``, ``<|corral_answer|>``, control
  tokens) chosen by the script's rule. One attention head (a constant query, a key only on
  markers, in a RoPE pair that barely turns) carries the marker's branch to every later
  position, so the prompt's last token (the family's generation prompt) starts that branch's
  chain. A prompt without a marker (a raw completion) gets the reply.
* The family's special tokens are in the vocabulary (as llama.cpp sees them in a real model of
  the family) and its end-of-generation tokens in the metadata, so llama.cpp stops there.

The file is ~2 MB (SmolLM2's vocabulary cut to 8192 tokens plus the added ones) and written in
well under a second.
"""

from __future__ import annotations

import functools
import itertools
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from corral.testing import ggufwrite, synth

FAMILIES: tuple[str, ...] = (
    "chatml",
    "qwen2.5",
    "qwen3",
    "qwen3-coder",
    "llama3",
    "mistral",
    "gpt-oss",
    "hermes",
    "glm",
)

_TEMPLATES = Path(__file__).parent / "families"
# Logit of the scripted next token; every other token's is at most _VALUE times that.
_LOGIT = 128.0
# Share of a branch's direction in the residual after attention (see _weights).
_VALUE = 0.1
# A marker's attention score above any other token's (query . key / sqrt(n_embd)): it takes all
# the weight in any prompt that fits the context.
_SCORE = 30.0
# The last RoPE pair turns by _ROPE_BASE ** -(1 - 2 / n_embd) per position: ~2e-6 here.
_ROPE_BASE = 1e6
_CONTEXT = 8192
_CONTROL = int(gguf.TokenType.CONTROL)
_USER_DEFINED = int(gguf.TokenType.USER_DEFINED)
MARKERS = {"reply": "<|corral_reply|>", "call": "<|corral_call|>", "answer": "<|corral_answer|>"}


@dataclass(frozen=True)
class Script:
    """What a scripted model writes.

    ``answer`` once any message in the conversation has the role "tool"; else ``call`` (a tool
    name and its arguments, in the family's native tool-call format) when tools are offered and
    ``call`` is set; else ``reply``. Each is followed by the end of generation.

    The call must be valid for the tools offered: llama.cpp constrains a tool call to the offered
    tools' schemas once it starts, so its name must be an offered tool's and its arguments must
    match that tool's parameters (required ones present, in the order of the schema's
    ``properties``), or the model writes garbage from there on.
    """

    reply: str = "Hello from corral."
    call: tuple[str, dict[str, Any]] | None = None
    answer: str = "The tool ran."


# --------------------------------------------------------------------------- families

# A chunk is one token of the output: a special token of the family (by its text, looked up in
# the family's vocabulary) or a new token with that text.
_Chunks = list[str]


@dataclass(frozen=True)
class _Family:
    template: str  # file in tests/families
    # Tokens the family's real vocabulary has as single tokens: control tokens (not printed in
    # the output unless llama.cpp preserves them) and user-defined ones (always printed).
    control: tuple[str, ...] = ()
    user_defined: tuple[str, ...] = ()
    bos: str = "<|im_start|>"
    eos: str = "<|im_end|>"
    eot: str | None = None
    eom: str | None = None
    # The output: text -> chunks for a reply/answer, (name, arguments) -> chunks for a call; and
    # the end-of-generation token after each.
    text: Callable[[str], _Chunks] = lambda s: [s]
    call: Callable[[str, dict[str, Any]], _Chunks] | None = None
    text_end: str = "<|im_end|>"
    call_end: str = "<|im_end|>"
    tools: bool = True


def _dumps(value: Any) -> str:
    # As the templates' tojson writes JSON: ", " and ": " separators, non-ASCII as it is.
    return json.dumps(value, ensure_ascii=False)


def _hermes_call(name: str, args: dict[str, Any]) -> _Chunks:
    # Qwen 2.5 / Qwen 3 / Hermes: <tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>
    return ["<tool_call>", "\n" + _dumps({"name": name, "arguments": args}) + "\n", "</tool_call>"]


def _qwen3_coder_call(name: str, args: dict[str, Any]) -> _Chunks:
    body = f"\n<function={name}>\n"
    for key, value in args.items():
        text = value if isinstance(value, str) else _dumps(value)
        body += f"<parameter={key}>\n{text}\n</parameter>\n"
    return ["<tool_call>", body + "</function>\n", "</tool_call>"]


def _llama3_call(name: str, args: dict[str, Any]) -> _Chunks:
    return [_dumps({"name": name, "parameters": args})]


def _mistral_call(name: str, args: dict[str, Any]) -> _Chunks:
    return ["[TOOL_CALLS]", name, "[ARGS]", _dumps(args)]


def _harmony_text(text: str) -> _Chunks:
    return ["<|channel|>", "final", "<|message|>", text]


def _harmony_call(name: str, args: dict[str, Any]) -> _Chunks:
    return [
        "<|channel|>",
        f"commentary to=functions.{name} ",
        "<|constrain|>",
        "json",
        "<|message|>",
        _dumps(args),
    ]


def _glm_text(text: str) -> _Chunks:
    # No "<think></think>": GLM 4.5 writes it unless the prompt has (enable_thinking false), and
    # llama.cpp takes the answer with or without it.
    return ["\n" + text]


def _glm_call(name: str, args: dict[str, Any]) -> _Chunks:
    body = name
    for key, value in args.items():
        text = value if isinstance(value, str) else _dumps(value)
        body += f"\n<arg_key>{key}</arg_key>\n<arg_value>{text}</arg_value>"
    return ["\n", "<tool_call>", body, "</tool_call>"]


_QWEN_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")

_FAMILIES: dict[str, _Family] = {
    "chatml": _Family("chatml.jinja", tools=False),
    "qwen2.5": _Family(
        "qwen2.5.jinja", control=("<|endoftext|>",), user_defined=_QWEN_TOKENS, call=_hermes_call
    ),
    "qwen3": _Family(
        "qwen3.jinja",
        user_defined=(*_QWEN_TOKENS, "<think>", "</think>"),
        call=_hermes_call,
    ),
    "qwen3-coder": _Family(
        "qwen3-coder.jinja",
        user_defined=_QWEN_TOKENS,
        call=_qwen3_coder_call,
    ),
    "hermes": _Family(
        "hermes.jinja",
        user_defined=(*_QWEN_TOKENS, "<tools>", "</tools>"),
        call=_hermes_call,
    ),
    "llama3": _Family(
        "llama3.jinja",
        control=(
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
            "<|eom_id|>",
            "<|python_tag|>",
        ),
        bos="<|begin_of_text|>",
        eos="<|eot_id|>",
        eot="<|eot_id|>",
        eom="<|eom_id|>",
        call=_llama3_call,
        text_end="<|eot_id|>",
        call_end="<|eot_id|>",
    ),
    "mistral": _Family(
        "mistral.jinja",
        control=(
            "<s>",
            "</s>",
            "[INST]",
            "[/INST]",
            "[SYSTEM_PROMPT]",
            "[/SYSTEM_PROMPT]",
            "[AVAILABLE_TOOLS]",
            "[/AVAILABLE_TOOLS]",
            "[TOOL_CALLS]",
            "[ARGS]",
            "[TOOL_RESULTS]",
            "[/TOOL_RESULTS]",
        ),
        bos="<s>",
        eos="</s>",
        call=_mistral_call,
        text_end="</s>",
        call_end="</s>",
    ),
    "gpt-oss": _Family(
        "gpt-oss.jinja",
        control=(
            "<|start|>",
            "<|end|>",
            "<|message|>",
            "<|channel|>",
            "<|constrain|>",
            "<|return|>",
            "<|call|>",
        ),
        bos="<|startoftext|>",
        eos="<|return|>",
        text=_harmony_text,
        call=_harmony_call,
        text_end="<|return|>",
        call_end="<|call|>",
    ),
    "glm": _Family(
        "glm.jinja",
        control=("[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"),
        user_defined=(
            *_QWEN_TOKENS,
            "<think>",
            "</think>",
            "<arg_key>",
            "</arg_key>",
            "<arg_value>",
            "</arg_value>",
        ),
        bos="[gMASK]",
        eos="<|endoftext|>",
        eot="<|user|>",
        eom="<|observation|>",
        text=_glm_text,
        call=_glm_call,
        text_end="<|user|>",
        call_end="<|observation|>",
    ),
}


@functools.cache
def family_template(family: str) -> str:
    """The family's real chat template, as corral ships it (without the script's suffix)."""
    return (_TEMPLATES / _family(family).template).read_text()


def _family(family: str) -> _Family:
    try:
        return _FAMILIES[family]
    except KeyError:
        raise ValueError(f"unknown family {family!r}; use one of {', '.join(FAMILIES)}") from None


def _marker(call: bool) -> str:
    """Jinja that writes the marker of the script's branch. It goes before the whole prompt,
    the same with or without a generation prompt: llama.cpp parses a generation prompt
    together with the output (the difference a generation prompt makes to the rendered text),
    and a marker there would end up in the content, or trip parsers that expect the
    family's own generation prompt (gpt-oss, Qwen3-Coder; Qwen 3 and GLM with thinking off)."""
    tools_marker = MARKERS["call"] if call else MARKERS["reply"]
    return (
        "{%- set corral_ns = namespace(tool_result=false) -%}"
        "{%- for corral_m in messages -%}"
        "{%- if corral_m.role == 'tool' -%}{%- set corral_ns.tool_result = true -%}{%- endif -%}"
        "{%- endfor -%}"
        f"{{%- if corral_ns.tool_result -%}}{{{{- '{MARKERS['answer']}' -}}}}"
        f"{{%- elif tools -%}}{{{{- '{tools_marker}' -}}}}"
        f"{{%- else -%}}{{{{- '{MARKERS['reply']}' -}}}}"
        "{%- endif -%}"
    )


def chat_template(family: str, script: Script = Script()) -> str:
    """The chat template a scripted model of ``family`` carries: the marker, then the family's."""
    fam = _family(family)
    call = script.call is not None and fam.tools and fam.call is not None
    return _marker(call) + family_template(family)


# --------------------------------------------------------------------------- writer


@dataclass
class _Plan:
    """The vocabulary additions and the chains (token ids) of one scripted model."""

    tokens: list[str]
    types: list[int]
    ids: dict[str, int]
    chains: list[list[int]] = field(default_factory=list)

    def token(self, text: str, kind: int) -> int:
        found = self.ids.get(text)
        if found is not None:
            return found
        self.ids[text] = len(self.tokens)
        self.tokens.append(text)
        self.types.append(kind)
        return self.ids[text]


def _plan(family: str, script: Script, n_vocab: int) -> tuple[_Plan, ggufwrite.Vocab, _Family]:
    fam = _family(family)
    base = ggufwrite.smollm2_vocab(n_vocab)
    plan = _Plan(list(base.tokens), list(base.token_types), {})
    for i, text in enumerate(base.tokens):
        plan.ids.setdefault(text, i)
    for text in fam.control:
        plan.token(text, _CONTROL)
    for text in fam.user_defined:
        plan.token(text, _USER_DEFINED)
    for end in (fam.bos, fam.eos, fam.eot, fam.eom, fam.text_end, fam.call_end):
        if end is not None:
            plan.token(end, _CONTROL)
    markers = {branch: plan.token(text, _CONTROL) for branch, text in MARKERS.items()}
    special = {*fam.control, *fam.user_defined}

    def chain(marker: int, chunks: Sequence[str], end: str) -> None:
        ids = [marker]
        for chunk in chunks:
            if not chunk:
                continue
            # A family token stays that token; any other chunk is a new token with that text.
            ids.append(
                plan.ids[chunk]
                if chunk in special or chunk in MARKERS.values()
                else plan.token(chunk, _USER_DEFINED)
            )
        ids.append(plan.ids[end])
        plan.chains.append(ids)

    # A reply or answer is one token, whatever special tokens its text holds (the parser reads
    # text): the family's structural tokens then appear in one chain only, where each can have
    # one successor. A call keeps them as tokens, since llama.cpp may trigger on them.
    chain(markers["reply"], ["".join(fam.text(script.reply))], fam.text_end)
    chain(markers["answer"], ["".join(fam.text(script.answer))], fam.text_end)
    if script.call is not None and fam.call is not None and fam.tools:
        name, args = script.call
        chain(markers["call"], fam.call(name, args), fam.call_end)
    return plan, base, fam


@dataclass(frozen=True)
class _Weights:
    n_embd: int
    arrays: list[tuple[str, np.ndarray]]


def _weights(plan: _Plan) -> _Weights:
    """The tensors: the chains as a bigram table, and one attention head that carries the
    prompt's marker to every later position (so a marker need not be the last prompt token)."""
    successor: dict[int, int] = {}
    for ids in plan.chains:
        for prev, nxt in itertools.pairwise(ids):
            if successor.setdefault(prev, nxt) != nxt:
                raise ValueError(
                    f"the script repeats the token {plan.tokens[prev]!r} with different "
                    "continuations; make the reply, answer and call texts differ"
                )
    # Residual directions: one per token with a successor (markers and chain tokens), then one
    # per branch (what attention copies from the marker).
    directions = {tok: i for i, tok in enumerate(successor)}
    markers = {branch: plan.ids[text] for branch, text in MARKERS.items()}
    branch_dir = {branch: len(directions) + i for i, branch in enumerate(markers)}
    n_embd = max(64, -(-(len(directions) + len(branch_dir)) // 64) * 64)
    n, root = n_embd, float(np.sqrt(n_embd))
    n_tokens = len(plan.tokens)
    # Every other token embeds as zero: it writes nothing and attends to the marker, if any.
    embd = np.zeros((n_tokens, n), dtype=np.float32)
    for tok, d in directions.items():
        embd[tok, d] = 1.0
    # Attention (one head of width n): the query is a constant (bias); only markers have a key,
    # in the last RoPE pair, which barely turns at this frequency base (_ROPE_BASE), so a marker
    # takes all the weight wherever it is. A marker's value is its branch direction; any other
    # token's value (the bias) is the reply's, so a prompt without a marker gets the reply.
    # attn_norm turns a basis vector e into sqrt(n) e, hence the 1 / root below.
    qk, qk_size = n - 2, float(np.sqrt(_SCORE * root))
    wq = np.zeros((n, n), dtype=np.float32)
    bq = np.zeros(n, dtype=np.float32)
    bq[qk] = qk_size
    wk = np.zeros((n, n), dtype=np.float32)
    wv = np.zeros((n, n), dtype=np.float32)
    bv = np.zeros(n, dtype=np.float32)
    bv[branch_dir["reply"]] = _VALUE
    for branch, tok in markers.items():
        if tok not in directions:
            continue
        wk[qk, directions[tok]] = qk_size / root
        wv[branch_dir[branch], directions[tok]] += _VALUE / root
        wv[branch_dir["reply"], directions[tok]] -= _VALUE / root
    wo = np.eye(n, dtype=np.float32)
    # Output: token u's row points at the direction of the token before it; a chain's first
    # token also at its branch's direction, reached from the marker or through attention. The
    # residual is d_t + _VALUE c_branch, RMS-normed: the scripted successor's logit is ~_LOGIT,
    # the branch's first token's ~_VALUE * _LOGIT.
    out = np.zeros((n_tokens, n), dtype=np.float32)
    scale = _LOGIT / root
    for prev, nxt in successor.items():
        out[nxt, directions[prev]] = scale
    for ids in plan.chains:
        branch = next(b for b, tok in markers.items() if tok == ids[0])
        out[ids[1], branch_dir[branch]] = scale
    ff = 32
    ones = np.ones(n, dtype=np.float32)
    f16 = np.float16
    arrays: list[tuple[str, np.ndarray]] = [
        ("token_embd.weight", embd.astype(f16)),
        ("output_norm.weight", ones),
        ("output.weight", out.astype(f16)),
        ("blk.0.attn_norm.weight", ones),
        ("blk.0.attn_q.weight", wq.astype(f16)),
        ("blk.0.attn_q.bias", bq),
        ("blk.0.attn_k.weight", wk.astype(f16)),
        ("blk.0.attn_k.bias", np.zeros(n, dtype=np.float32)),
        ("blk.0.attn_v.weight", wv.astype(f16)),
        ("blk.0.attn_v.bias", bv),
        ("blk.0.attn_output.weight", wo.astype(f16)),
        ("blk.0.ffn_norm.weight", ones),
        ("blk.0.ffn_gate.weight", np.zeros((ff, n), dtype=f16)),
        ("blk.0.ffn_up.weight", np.zeros((ff, n), dtype=f16)),
        ("blk.0.ffn_down.weight", np.zeros((n, ff), dtype=f16)),
    ]
    return _Weights(n, arrays)


def write_scripted_model(
    path: Path, family: str = "qwen2.5", script: Script = Script(), context_length: int = _CONTEXT
) -> Path:
    """Write a scripted model of ``family`` (one of ``FAMILIES``) to ``path``; see ``Script``.
    `context_length`: the trained context it declares (agents' prompts need tens of thousands
    of tokens; the one-layer cache costs ~256 bytes a token)."""
    plan, base, fam = _plan(family, script, synth.DEFAULT_N_VOCAB)
    weights = _weights(plan)
    n_embd = weights.n_embd
    vocab = replace(
        base,
        tokens=plan.tokens,
        token_types=plan.types,
        bos_id=plan.ids[fam.bos],
        eos_id=plan.ids[fam.eos],
        chat_template=chat_template(family, script),
    )
    writer = gguf.GGUFWriter(None, "llama")
    writer.add_type("model")
    writer.add_name(f"corral-scripted-{family}")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_vocab_size(len(plan.tokens))
    writer.add_context_length(context_length)
    writer.add_embedding_length(n_embd)
    writer.add_block_count(1)
    writer.add_feed_forward_length(32)
    writer.add_head_count(1)
    writer.add_head_count_kv(1)
    writer.add_key_length(n_embd)
    writer.add_value_length(n_embd)
    writer.add_rope_dimension_count(n_embd)
    writer.add_rope_freq_base(_ROPE_BASE)
    writer.add_layer_norm_rms_eps(1e-5)
    ggufwrite.write_vocab(writer, vocab, add_bos=False)
    if fam.eot is not None:
        writer.add_eot_token_id(plan.ids[fam.eot])
    if fam.eom is not None:
        writer.add_eom_token_id(plan.ids[fam.eom])
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)

    def body(partial: Path) -> None:
        for name, array in weights.arrays:
            writer.add_tensor(name, array)
        writer.write_header_to_file(partial)
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()

    return ggufwrite.write_atomically(writer, path, body)


__all__ = [
    "FAMILIES",
    "MARKERS",
    "Script",
    "chat_template",
    "family_template",
    "write_scripted_model",
]
