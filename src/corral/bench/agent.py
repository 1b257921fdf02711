"""An agent session: Claude Code-shaped conversations, two at once, turn by turn.

Each turn is what Claude Code sends on `/v1/messages`, streamed: a system prompt whose first
block is `x-anthropic-billing-header: cc_version=...; cch=...` (different on every request),
tools, the growing history with a system reminder inside `messages` every fifth turn, and a new
user message. Two sessions run at once on one model, corral with its defaults (automatic slots
on a unified KV cache, automatic context). Per turn: time to first token as the client sees
it, and what the stream's closing usage says llama.cpp evaluated (`input_tokens`) and read from
the slot's cache (`cache_read_input_tokens`); a turn "evaluates only its new tokens" when it
evaluated no more than its prompt grew since the session's previous turn.

Cases, interleaved:
- SmolLM2-135M (real text, trained for 8,192 tokens) with a ~2,000-token system prompt and ten
  tools: both sessions' conversations fit its context at once. Twice: as Claude Code sends it
  (corral drops the header block), and with the same first block without its `x-anthropic-`
  prefix, which corral keeps: what every turn cost before corral dropped the header, and what
  any per-request text at the prompt's start costs.
- Claude Code's real size: a ~12,000-token system prompt and tools (instructions and 18 long
  tool schemas), on a synthetic llama trained for 64k tokens (corral.testing.synth; SmolLM2's
  8,192 cannot hold it), as Claude Code sends it. Its random weights write nonsense, which
  changes nothing here (what is measured is the prompt cache and the time to first token), but
  their tokens do not survive detokenizing and tokenizing again, so its sessions send a fixed
  answer back in the history in place of the model's.

- The same with a side request after every turn (a title or a sub-agent's first turn: the same
  instructions, no tools, a message of its own), which shares the first few thousand tokens of
  the sessions' prompts: does a session keep its slot's cache?

`CORRAL_BENCH_AGENT=smollm2,kept,12k,side` (a comma list) runs only those cases.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import orjson

from corral.bench.common import (
    ANTHROPIC_TOKEN,
    MIB,
    Http,
    Say,
    Scale,
    Section,
    Table,
    goal_min,
    interleave,
    median,
    safe_div,
    secs,
    sse_objects,
)
from corral.testing.server import start_corral

TURNS = {"smoke": 3, "quick": 20, "full": 20}
REPS = {"smoke": 1, "quick": 1, "full": 2}
SMOLLM2 = "smollm2:135m"
LONG_MODEL = "agent-ctx64k"
LONG_CONTEXT = 65536
LONG_MB = {"smoke": 0, "quick": 16, "full": 16}  # 0: the smallest synthetic llama
# corral's defaults (stated, so that the environment the bench runs in cannot change them).
ENV = {"CORRAL_CONTEXT_LENGTH": "auto", "CORRAL_NUM_PARALLEL": "auto", "CORRAL_KEEP_ALIVE": "10m",
       "CORRAL_BUILTIN_MODELS": "1"}  # fmt: skip
MAX_TOKENS = 8
SHOWN_TURNS = (1, 2, 3, 5, 10, 20)


@dataclass(frozen=True)
class Case:
    key: str  # its name in CORRAL_BENCH_AGENT
    label: str
    model: str  # corral's name for it
    header: bool  # the first block is Claude Code's billing header (corral drops it)
    instructions: int  # repeats of _INSTRUCTIONS in the system prompt
    tools: int
    tool_text: int  # repeats of each tool's description sentence
    # The history holds the model's own answers (False: a fixed one). A random-weight model
    # writes tokens that do not come back the same through detokenizing and tokenizing again
    # (a real model's text does), so its next prompt would differ from the cache one token
    # early: the cache's business, not a miss of corral's.
    echo: bool = True
    # After every turn, a side request (a title, a sub-agent's first turn) with the same
    # instructions but no tools and its own message, as agents send between turns: a slot
    # chosen by the longest shared prefix would be the session's own, whose cache it cuts.
    side: bool = False


CASES = (
    Case("smollm2", "SmolLM2, ~2k system, header dropped", SMOLLM2, True, 28, 10, 3),
    Case("kept", "SmolLM2, ~2k system, varying first block kept", SMOLLM2, False, 28, 10, 3),
    Case("12k", "~12k system and tools, header dropped", LONG_MODEL, True, 60, 18, 24,
         echo=False),
    Case("side", "~12k, a side request after every turn", LONG_MODEL, True, 60, 18, 24,
         echo=False, side=True),
)  # fmt: skip


def chosen_cases() -> list[Case]:
    """CORRAL_BENCH_AGENT (a comma list of the cases' keys), or every case."""
    raw = os.environ.get("CORRAL_BENCH_AGENT", "")
    chosen = {k.strip() for k in raw.split(",") if k.strip()}
    unknown = chosen - {c.key for c in CASES}
    if unknown:
        raise ValueError(
            f"CORRAL_BENCH_AGENT: unknown {sorted(unknown)}; cases: {[c.key for c in CASES]}"
        )
    return [c for c in CASES if c.key in chosen] or list(CASES)


_INSTRUCTIONS = (
    "You are an interactive CLI tool that helps users with software engineering tasks. Use "
    "the instructions below and the tools available to you to assist the user. Keep answers "
    "short, run commands with the Bash tool, read files before you edit them, and never guess "
    "a file's content. "
)


def _tool(i: int, repeat: int) -> dict[str, Any]:
    return {
        "name": f"Tool{i}", "description": f"Tool number {i}: does step {i} of a task. " * repeat,
        "input_schema": {
            "type": "object",
            "properties": {"path": {"type": "string", "description": "A file path"},
                           "command": {"type": "string", "description": "A shell command"}},
            "required": ["path"],
        },
    }  # fmt: skip


def body(case: Case, session: int, turn: int, history: list[dict[str, Any]], rep: int = 0) -> bytes:
    """Turn `turn`'s request; `rep` and the case start the instructions, so that no case's or
    repetition's first turn finds another's prompt in a slot."""
    header = f"cc_version=2.1.197.{session}; cch={session:02d}{turn:03d};"
    first = ("x-anthropic-billing-header: " if case.header else "billing: ") + header
    instructions = f"Run {rep}, {case.key}. " + _INSTRUCTIONS * case.instructions
    return orjson.dumps({
        "model": case.model, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
        "system": [{"type": "text", "text": first},
                   {"type": "text", "text": instructions,
                    "cache_control": {"type": "ephemeral"}}],
        "tools": [_tool(i, case.tool_text) for i in range(case.tools)], "messages": history,
    })  # fmt: skip


def streamed_turn(raw: bytes) -> tuple[dict[str, int], str]:
    """The closing usage of an Anthropic Messages stream (`message_delta`'s) and its text; an
    error event raises."""
    usage: dict[str, int] = {}
    text: list[str] = []
    for ev in sse_objects(raw):
        kind = ev.get("type")
        if kind == "error":
            raise RuntimeError(f"error event: {ev.get('error')}")
        if kind == "content_block_delta" and ev["delta"].get("type") == "text_delta":
            text.append(ev["delta"]["text"])
        elif kind == "message_delta":
            usage = ev["usage"]
    if "input_tokens" not in usage:
        raise RuntimeError(f"no usage in the stream's message_delta: {raw[-300:]!r}")
    return usage, "".join(text)


def session(
    url: str, case: Case, sid: int, turns: int, out: list[dict[str, Any]], rep: int = 0
) -> None:
    http = Http(url)
    history: list[dict[str, Any]] = []
    previous = 0
    try:
        for turn in range(1, turns + 1):
            history.append({"role": "user", "content": f"Session {sid}, step {turn}: go on."})
            if turn % 5 == 1:
                history.append(
                    {"role": "system", "content": f"<system-reminder>{turn}</system-reminder>"}
                )
            req = body(case, sid, turn, history, rep)
            r = http.post("/v1/messages", req, token=ANTHROPIC_TOKEN)
            if r.status != 200:
                raise RuntimeError(f"turn {turn}: {r.status} {r.body[:300]!r}")
            u, text = streamed_turn(r.body)
            prompt = u["input_tokens"] + u.get("cache_read_input_tokens", 0)
            out.append({
                "turn": turn, "prompt": prompt, "evaluated": u["input_tokens"],
                "reused": u.get("cache_read_input_tokens", 0), "new": prompt - previous,
                "ttft": r.ttft, "seconds": r.latency,
            })  # fmt: skip
            history.append({"role": "assistant", "content": (text if case.echo else "") or "ok"})
            previous = prompt
            if case.side:
                note = [{"role": "user", "content": f"Session {sid}, step {turn}: a title?"}]
                side = replace(case, tools=0)
                r = http.post(
                    "/v1/messages", body(side, sid, turn, note, rep), token=ANTHROPIC_TOKEN
                )
                if r.status != 200:
                    raise RuntimeError(f"side request {turn}: {r.status} {r.body[:300]!r}")
    finally:
        http.close()


# --------------------------------------------------------------------------- figures


def turn_cell(rows: list[dict[str, Any]]) -> str:
    """`prompt / evaluated / reused / TTFT`, each the median over `rows` (one turn's)."""
    if not rows:
        return "n/a"
    return (
        f"{median([r['prompt'] for r in rows]):.0f} / "
        f"{median([r['evaluated'] for r in rows]):.0f} / "
        f"{median([r['reused'] for r in rows]):.0f} / "
        f"{secs(median([r['ttft'] for r in rows]))}"
    )


def turn_table(runs: dict[str, list[dict[str, Any]]], turns: int) -> Table:
    table = Table(
        "Per turn, median over sessions: prompt tokens / evaluated (input_tokens) / reused "
        "(cache_read_input_tokens) / time to first token",
        ["turn", *runs],
    )
    for turn in SHOWN_TURNS:
        if turn <= turns:
            table.add(turn, *(turn_cell([r for r in rs if r["turn"] == turn])
                              for rs in runs.values()))  # fmt: skip
    return table


def case_summary(label: str, rows: list[dict[str, Any]], turns: int) -> tuple[str, float]:
    """A line on the turns after the first, and the share of them that evaluated only their new
    tokens."""
    later = [r for r in rows if r["turn"] > 1]
    only_new = [r for r in later if r["evaluated"] <= r["new"]]
    share = safe_div(len(only_new), len(later))
    evaluated = sum(r["evaluated"] for r in later)
    prompts = sum(r["prompt"] for r in later)
    first = [r for r in rows if r["turn"] == 1]
    line = (
        f"{label}: {len(only_new)} of {len(later)} turns after the first evaluated only their "
        f"new tokens; turns 2-{turns} evaluated {evaluated:,} of {prompts:,} prompt tokens "
        f"({safe_div(evaluated, prompts):.1%}); time to first token: turn 1 "
        f"{secs(median([r['ttft'] for r in first]))}, turns 2-{turns} median "
        f"{secs(median([r['ttft'] for r in later]))}, max "
        f"{secs(max((r['ttft'] for r in later), default=float('nan')))}"
    )
    return line, share


# --------------------------------------------------------------------------- the section


def long_model(models: Path, scale: Scale, say: Say) -> None:
    from corral.testing import synth

    mb = LONG_MB[scale.name]
    path = models / f"{LONG_MODEL}.gguf"
    if not path.exists():
        say(f"agent: writing {path.name} (trained context {LONG_CONTEXT})")
        synth.write_llama_model(path, context_length=LONG_CONTEXT, name=LONG_MODEL,
                                target_bytes=mb * MIB if mb else None)  # fmt: skip


def run(scale: Scale, work: Path, say: Say) -> Section:
    sec = Section("agent", "An agent session: prompt cache across turns")
    models = work / f"agent-models-{scale.name}"
    models.mkdir(parents=True, exist_ok=True)
    long_model(models, scale, say)
    server = start_corral(models, work / "agent.log", ENV)
    turns, reps = TURNS[scale.name], REPS[scale.name]
    cases = chosen_cases()
    runs: dict[str, list[dict[str, Any]]] = {c.label: [] for c in cases}
    loaded: dict[str, str] = {}
    try:
        for i, label in interleave(reps, [c.label for c in cases]):
            case = next(c for c in cases if c.label == label)
            say(f"agent: #{i + 1} {case.label}, two sessions of {turns} turns")
            outs: list[list[dict[str, Any]]] = [[], []]
            threads = [
                threading.Thread(target=session, args=(server.url, case, s, turns, outs[s], i))
                for s in (0, 1)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            for o in outs:
                if len(o) != turns:
                    raise RuntimeError(f"a session ended after {len(o)} of {turns} turns; "
                                       f"log:\n{server.log()[-2000:]}")  # fmt: skip
                runs[case.label] += o
            for m in server.ps():
                loaded[m["name"]] = f"{m['num_parallel']} slots, context {m['context_length']}"
    finally:
        server.stop()
    sec.data = {"runs": runs, "loaded": loaded}
    sec.tables.append(turn_table(runs, turns))
    for case in cases:
        line, share = case_summary(case.label, runs[case.label], turns)
        sec.summary.append(line)
        if case.header:
            sec.goals.append(goal_min(
                f"an agent session ({case.label}, two at once): every turn after the first "
                "evaluates only its new tokens", share, 1.0, lambda x: f"{x:.0%} of turns",
            ))  # fmt: skip
    sec.notes.append(
        "corral's defaults (automatic slots and context): loaded "
        + "; ".join(f"{m}: {v}" for m, v in sorted(loaded.items()))
        + f"; max_tokens {MAX_TOKENS}, temperature 0, streamed; two sessions at once, each its "
        "own conversation; time to first token as the client sees it"
    )
    return sec
