"""`corral bench agentswap`: two models that agents use in turn, under a memory limit that holds
one and a half of them, with and without the hold of a model whose answer ended in a tool call
(`CORRAL_TOOL_HOLD`).

Every request is an agent's turn whose answer is a tool call; the agent then runs the tool (a
short, seeded think time: file tools take milliseconds, a model's reload far longer) and sends
its next turn. Two traces:

- two agents at once: a main agent on model A and a sub-agent on model B working at the same
  time, so that their requests alternate A, B, A, B. Without a hold each turn finds the other
  model idle (its agent is running a tool) and evicts it: about a load per turn. With the hold
  the other load waits for the held model (at most its reload time, never past the core's
  starve_after), and the held model's agent, back within that, is served without a load.
- one agent, two models in turn: one agent alternating A and B (an architect and its editor, a
  main model and a sub-agent it waits for). Only one fits, so every turn loads with or without
  the hold; what the hold costs here is the wait for the held model before each load.

A load waits for a held model only until it has waited the core's starve_after (5 s) in all, so
the hold saves loads only where a turn (prompt, answer and tool) is shorter than that.

Answers are forced tool calls (`tool_choice: "required"`, a tool whose arguments are empty), so
the synthetic models write the call whole and stop, and every answer ends in a tool call.
Loads are counted from corral's log; a turn's time is the agent's request as it sees it. Both
variants run on servers started alike, interleaved.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson

from corral.bench.common import (
    Goal,
    Http,
    Say,
    Scale,
    Section,
    Table,
    interleave,
    logged_loads,
    mib,
    percentile,
    safe_div,
    secs,
)
from corral.core.estimate import RUNNER_CODE_BYTES
from corral.core.gguf import read_model_info
from corral.core.spec import RunnerSpec, spec_estimate
from corral.testing import synth
from corral.testing.server import start_corral

MODELS = ("agent-a", "agent-b")
CTX = 512
TURNS = {"smoke": 3, "quick": 20, "full": 40}  # per agent (the one-agent trace: twice as many)
REPS = {"smoke": 1, "quick": 2, "full": 3}
SIZE_MB = {"smoke": 20, "quick": 100, "full": 200}
THINK = 0.15  # mean seconds a tool runs between an answer and the agent's next turn
VARIANTS = {"no hold": "0", "hold": "30s"}  # CORRAL_TOOL_HOLD
TRACES = ("two agents at once", "one agent, two models in turn")
ENV = {
    "CORRAL_CONTEXT_LENGTH": str(CTX), "CORRAL_NUM_PARALLEL": "1", "CORRAL_KEEP_ALIVE": "1h",
    "CORRAL_BUILTIN_MODELS": "0", "CORRAL_MEMORY_MARGIN": "0", "CORRAL_QUEUE_TIMEOUT": "10m",
}  # fmt: skip
TOOL = {
    "type": "function",
    "function": {
        "name": "read_file", "description": "Read the next file.",
        "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
    },
}  # fmt: skip


def write_models(models: Path, mb: int) -> int:
    """The two models (about `mb` MB each); the bytes one runner books."""
    for i, name in enumerate(MODELS):
        path = models / f"{name}.gguf"
        if not path.exists() or abs(path.stat().st_size - mb * 10**6) > 0.1 * mb * 10**6:
            synth.write_llama_model(path, target_bytes=mb * 10**6, seed=41 + i)
    path = models / f"{MODELS[0]}.gguf"
    est = spec_estimate(read_model_info(path), RunnerSpec(str(path), CTX, 1))
    return est.total + est.process


def body(model: str) -> bytes:
    return orjson.dumps({
        "model": model, "messages": [{"role": "user", "content": "Go on with the task."}],
        "tools": [TOOL], "tool_choice": "required", "max_tokens": 32, "temperature": 0,
    })  # fmt: skip


def agent(
    url: str, models: Sequence[str], turns: int, seed: int, delay: float, out: list[float]
) -> None:
    """`turns` turns on `models` in turn, each a tool call then the tool's think time; each
    turn's seconds appended to `out`."""
    http = Http(url)
    rng = random.Random(seed)
    try:
        time.sleep(delay)
        for k in range(turns):
            r = http.post("/v1/chat/completions", body(models[k % len(models)]))
            if r.status != 200:
                raise RuntimeError(f"turn {k}: {r.status} {r.body[:300]!r}")
            finish = orjson.loads(r.body)["choices"][0]["finish_reason"]
            if finish != "tool_calls":
                raise RuntimeError(f"turn {k} ended with {finish!r}, not a tool call")
            out.append(r.latency)
            time.sleep(min(rng.expovariate(1 / THINK), 4 * THINK))
    finally:
        http.close()


def replay(url: str, trace: str, turns: int, seed: int) -> list[float]:
    """One trace against a server; every turn's seconds."""
    outs: list[list[float]] = [[], []]
    args: list[tuple[str, Sequence[str], int, int, float, list[float]]]
    if trace == TRACES[0]:  # B's agent starts half a tool's run later: the requests alternate
        args = [(url, [MODELS[i]], turns, seed + i, i * THINK / 2, outs[i]) for i in (0, 1)]
    else:
        args = [(url, MODELS, 2 * turns, seed, 0.0, outs[0])]
    errors: list[BaseException] = []

    def run(*a: Any) -> None:
        try:
            agent(*a)
        except BaseException as e:  # reported once the others are done
            errors.append(e)

    threads = [threading.Thread(target=run, args=a) for a in args]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return outs[0] + outs[1]


def run(scale: Scale, work: Path, say: Say) -> Section:
    sec = Section("agentswap", "Two models used in turn by agents: the hold after a tool call")
    models = work / "agentswap-models"
    models.mkdir(parents=True, exist_ok=True)
    one = write_models(models, SIZE_MB[scale.name])
    limit = RUNNER_CODE_BYTES + int(1.5 * one)
    turns, reps = TURNS[scale.name], REPS[scale.name]
    results: dict[str, dict[str, dict[str, list[float]]]] = {
        t: {v: {"loads": [], "turns": [], "wall": []} for v in VARIANTS} for t in TRACES
    }
    for trace in TRACES:
        for i, variant in interleave(reps, list(VARIANTS)):
            log = work / f"agentswap-{TRACES.index(trace)}-{variant.replace(' ', '-')}-{i}.log"
            env = {**ENV, "CORRAL_MEMORY_LIMIT": str(limit), "CORRAL_TOOL_HOLD": VARIANTS[variant]}
            server = start_corral(models, log, env)
            try:
                t0 = time.perf_counter()
                times = replay(server.url, trace, turns, seed=1000 * i)
                wall = time.perf_counter() - t0
                loads = len(logged_loads(server.log()))
            finally:
                server.stop()
            r = results[trace][variant]
            r["loads"].append(loads)
            r["turns"] += times
            r["wall"].append(wall)
            say(f"agentswap: {trace}, {variant} #{i + 1}: {loads} loads in {len(times)} turns, "
                f"{wall:.1f} s")  # fmt: skip
    table = Table(
        f"Loads per turn and turn times (every answer a tool call; tools take {THINK:g} s on "
        f"average; a memory limit of {mib(limit)} holds one and a half models of "
        f"{mib(one)}; {reps} run(s) each, interleaved)",
        ["trace", "hold", "turns", "loads", "loads per turn", "turn p50", "turn p95", "wall"],
    )
    per_turn: dict[tuple[str, str], float] = {}
    for trace in TRACES:
        for variant in VARIANTS:
            r = results[trace][variant]
            n, loads = len(r["turns"]), int(sum(r["loads"]))
            per_turn[trace, variant] = safe_div(loads, n)
            table.add(
                trace, variant, n, loads, f"{per_turn[trace, variant]:.2f}",
                secs(percentile(r["turns"], 50)), secs(percentile(r["turns"], 95)),
                secs(safe_div(sum(r["wall"]), len(r["wall"]))),
            )  # fmt: skip
    sec.tables.append(table)
    sec.data = {"limit": limit, "booked": one, "think": THINK, "results": results}
    off, on = per_turn[TRACES[0], "no hold"], per_turn[TRACES[0], "hold"]
    sec.goals.append(Goal(
        "two agents at once on two models that do not both fit: fewer loads per turn with the "
        "hold", f"{off:.2f} -> {on:.2f} loads per turn", on < off,
    ))  # fmt: skip
    sec.notes.append(
        "With one agent alternating two models that do not both fit, every turn loads with or "
        "without the hold: the hold can only cost there (each load first waits for the held "
        "model, at most its reload time); compare its turn times."
    )
    return sec
