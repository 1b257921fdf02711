"""An agent session: Claude Code-shaped conversations, two at once, turn by turn.

Each turn is what Claude Code sends on `/v1/messages`: a ~2,000-token system prompt whose first
block is `x-anthropic-billing-header: cc_version=...; cch=...` (different on every request),
ten tools, the growing history with a system reminder inside `messages` every fifth turn, and
a new user message. Two sessions run at once on one model with two slots. Every turn's usage
says what llama.cpp evaluated (`input_tokens`) and what it read from the slot's cache
(`cache_read_input_tokens`); a turn "evaluates only its new tokens" when it evaluated no more
than its prompt grew since the session's previous turn.

Two variants, interleaved: as Claude Code sends it (corral drops the header block), and the
same first block without its `x-anthropic-` prefix, which corral keeps: what every turn cost
before corral dropped the header, and what any per-request text at the prompt's start costs.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import orjson

from corral.bench.common import (
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
)
from corral.testing.server import start_corral

TURNS = {"smoke": 3, "quick": 20, "full": 20}
REPS = {"smoke": 1, "quick": 1, "full": 2}
MODEL = "smollm2:135m"
ENV = {"CORRAL_CONTEXT_LENGTH": "8192", "CORRAL_NUM_PARALLEL": "2", "CORRAL_KEEP_ALIVE": "10m"}
VARIANTS = ("header dropped", "varying first block kept")
SHOWN_TURNS = (1, 2, 3, 5, 10, 20)

_INSTRUCTIONS = (
    "You are an interactive CLI tool that helps users with software engineering tasks. Use "
    "the instructions below and the tools available to you to assist the user. Keep answers "
    "short, run commands with the Bash tool, read files before you edit them, and never guess "
    "a file's content. "
)


def _tool(i: int) -> dict[str, Any]:
    return {
        "name": f"Tool{i}", "description": f"Tool number {i}: does step {i} of a task. " * 3,
        "input_schema": {
            "type": "object",
            "properties": {"path": {"type": "string", "description": "A file path"},
                           "command": {"type": "string", "description": "A shell command"}},
            "required": ["path"],
        },
    }  # fmt: skip


TOOLS = [_tool(i) for i in range(10)]


def body(variant: str, session: int, turn: int, history: list[dict[str, Any]]) -> bytes:
    header = f"cc_version=2.1.197.{session}; cch={session:02d}{turn:03d};"
    first = ("x-anthropic-billing-header: " if variant == VARIANTS[0] else "billing: ") + header
    return orjson.dumps({
        "model": MODEL, "max_tokens": 8, "temperature": 0,
        "system": [{"type": "text", "text": first},
                   {"type": "text", "text": _INSTRUCTIONS * 28,
                    "cache_control": {"type": "ephemeral"}}],
        "tools": TOOLS, "messages": history,
    })  # fmt: skip


def session(url: str, variant: str, sid: int, turns: int, out: list[dict[str, Any]]) -> None:
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
            r = http.post("/v1/messages", body(variant, sid, turn, history))
            if r.status != 200:
                raise RuntimeError(f"turn {turn}: {r.status} {r.body[:300]!r}")
            msg = orjson.loads(r.body)
            u = msg["usage"]
            prompt = u["input_tokens"] + u["cache_read_input_tokens"]
            out.append({
                "turn": turn, "prompt": prompt, "evaluated": u["input_tokens"],
                "reused": u["cache_read_input_tokens"], "new": prompt - previous,
                "seconds": r.latency,
            })  # fmt: skip
            text = "".join(b.get("text", "") for b in msg["content"] if b["type"] == "text")
            history.append({"role": "assistant", "content": text or "ok"})
            previous = prompt
    finally:
        http.close()


def run(scale: Scale, work: Path, say: Say) -> Section:
    sec = Section("agent", "An agent session: prompt cache across turns")
    models = work / "agent-models"
    models.mkdir(parents=True, exist_ok=True)
    server = start_corral(models, work / "agent.log", ENV)
    turns, reps = TURNS[scale.name], REPS[scale.name]
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    try:
        for i, variant in interleave(reps, list(VARIANTS)):
            say(f"agent: #{i + 1} {variant}, two sessions of {turns} turns")
            outs: list[list[dict[str, Any]]] = [[], []]
            threads = [
                threading.Thread(target=session, args=(server.url, variant, s, turns, outs[s]))
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
                runs[variant] += o
    finally:
        server.stop()
    sec.data = {"runs": runs}
    table = Table(
        "Per turn, median over sessions: prompt tokens, evaluated (input_tokens), reused "
        "(cache_read_input_tokens), request time",
        ["turn", *(f"{v}: prompt / evaluated / reused / time" for v in VARIANTS)],
    )
    for turn in SHOWN_TURNS:
        if turn > turns:
            continue
        cells = []
        for v in VARIANTS:
            rows = [r for r in runs[v] if r["turn"] == turn]
            cells.append(
                f"{median([r['prompt'] for r in rows]):.0f} / "
                f"{median([r['evaluated'] for r in rows]):.0f} / "
                f"{median([r['reused'] for r in rows]):.0f} / "
                f"{secs(median([r['seconds'] for r in rows]))}"
            )
        table.add(turn, *cells)
    sec.tables.append(table)
    for v in VARIANTS:
        later = [r for r in runs[v] if r["turn"] > 1]
        only_new = [r for r in later if r["evaluated"] <= r["new"]]
        share = safe_div(len(only_new), len(later))
        evaluated = sum(r["evaluated"] for r in later)
        prompts = sum(r["prompt"] for r in later)
        line = (
            f"{v}: {len(only_new)} of {len(later)} turns after the first evaluated only their "
            f"new tokens; turns 2-{turns} evaluated {evaluated:,} of {prompts:,} prompt tokens "
            f"({safe_div(evaluated, prompts):.1%}); median turn "
            f"{secs(median([r['seconds'] for r in later]))}"
        )
        sec.summary.append(line)
        if v == VARIANTS[0]:
            sec.goals.append(goal_min(
                "an agent session (Claude Code-shaped, two at once): every turn after the first "
                "evaluates only its new tokens", share, 1.0, lambda x: f"{x:.0%} of turns",
            ))  # fmt: skip
    sec.notes.append(
        f"{MODEL}, {ENV['CORRAL_NUM_PARALLEL']} slots, context {ENV['CORRAL_CONTEXT_LENGTH']}, "
        "max_tokens 8, temperature 0; two sessions at once, each its own conversation"
    )
    return sec
