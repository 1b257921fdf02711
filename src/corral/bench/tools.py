"""Generation speed with tools: where the time goes when a request carries tools.

`python -m corral.bench.tools [--reps N] [--tokens N] [--tools N] [--json PATH]`

One corral with SmolLM2 (a template without tools: corral shows them, `api/toolprompt`) and a
synthetic model with a tool template (llama.cpp shows them and parses the calls). For each, the
same question is asked in every variant below, interleaved (each repetition runs every variant,
starting one further along each time), and the decode speed compared with the variant without
tools in the same repetition (a paired ratio, so a machine shared with other work moves both
sides alike):

- direct chat, no tools / with tools: the runner's /v1/chat/completions (with tools a native
  template gets llama.cpp's lazy grammar and call parser; SmolLM2's ignores them);
- direct completion, short prompt: the question alone, rendered, on /completion;
- direct completion, tools prompt: the prompt corral renders with the tools, no grammar;
- direct completion, tools prompt + lazy grammar: the same with corral's call grammar, lazy on
  `<tool_call>` (what corral sends for a template without tools);
- direct completion, same-length prompt without tools: filler text of the tools prompt's length
  before the question (the prompt's length alone);
- corral /api/chat, no tools / with tools: the whole path through corral.

Direct requests ignore the end-of-sequence token so that every variant writes the same number
of tokens; through corral (Ollama's API has no such option) a model may stop earlier: the token
counts are printed. Speeds are the stream's as the client sees it (tokens after the first over
the time from the first to the end) and llama.cpp's own (`predicted_per_second`).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from corral.api.chat import Chat
from corral.api.toolprompt import fallback_grammar, template_body
from corral.bench.common import (
    Http,
    Timed,
    completion_tokens,
    median,
    ndjson_objects,
    runner_url,
    safe_div,
    sse_objects,
)
from corral.core.gguf import template_has_tools
from corral.testing import synth
from corral.testing.server import CorralServer, start_corral

SMOLLM2 = "smollm2:135m"
NATIVE = "bench-tooltpl"  # a synthetic model with a tool-calling template
QUESTION = "Write a long story about a lighthouse keeper, the sea and a storm."
SEED = 42
# Sampled, not greedy: a random model at temperature 0 repeats one token (a newline), which
# llama.cpp's tool-call parser holds back to the end, so its stream would show no speed.
TEMPERATURE = 1.0
FILLER = (
    "The keeper climbed the stairs at dusk, trimmed the wick, wound the clockwork and "
    "wrote the weather in the log before the night came down over the rocks. "
)


def bench_tools(n: int) -> list[dict[str, Any]]:
    """`n` tools shaped like a coding agent's (a description and a few typed parameters)."""
    verbs = ["read", "write", "list", "search", "run", "patch", "fetch", "plan"]
    out = []
    for i in range(n):
        verb = verbs[i % len(verbs)]
        out.append({"type": "function", "function": {
            "name": f"{verb}_{i}",
            "description": f"{verb.capitalize()} things in the workspace (tool {i}): use it when "
                           "the user asks about files, commands or their output, and say why.",
            "parameters": {
                "type": "object",
                "properties": {
                    "path": {"type": "string", "description": "A path inside the workspace"},
                    "pattern": {"type": "string", "description": "What to look for"},
                    "limit": {"type": "integer", "description": "How many results at most"},
                    "recursive": {"type": "boolean", "description": "Descend into folders"},
                    "mode": {"type": "string", "enum": ["fast", "thorough"]},
                },
                "required": ["path"],
            },
        }})  # fmt: skip
    return out


@dataclass(frozen=True)
class Variant:
    name: str
    side: str  # "direct" (the runner) or "corral"
    path: str
    body: dict[str, Any]
    baseline: str  # the variant this one is compared with


@dataclass
class Sample:
    client_rate: float  # tokens/s as the stream arrives
    server_rate: float  # llama.cpp's predicted_per_second (nan if not reported)
    tokens: int
    prompt_tokens: int


@dataclass
class Results:
    model: str
    native: bool
    tools: int
    samples: dict[str, list[Sample]] = field(default_factory=dict)
    baselines: dict[str, str] = field(default_factory=dict)  # variant -> compared with


def _post_json(http: Http, path: str, body: dict[str, Any]) -> Any:
    t = http.post(path, orjson.dumps(body))
    if t.status != 200:
        raise RuntimeError(f"POST {path} answered {t.status}: {t.body[:300]!r}")
    return orjson.loads(t.body)


def variants(
    direct: Http, model: str, tools: list[dict[str, Any]], tokens: int
) -> tuple[list[Variant], bool]:
    """The variants for `model` (see the module's doc), and whether its template is native."""
    props = direct.get_json("/props")
    native = template_has_tools(props.get("chat_template"))
    messages = [{"role": "user", "content": QUESTION}]
    chat = Chat(messages, tools)
    short = _post_json(direct, "/apply-template", {"messages": messages})["prompt"]
    with_tools = _post_json(
        direct, "/apply-template", template_body(chat, not native, None)
    )["prompt"]  # fmt: skip
    n_short = len(_post_json(direct, "/tokenize", {"content": short})["tokens"])
    n_tools = len(_post_json(direct, "/tokenize", {"content": with_tools})["tokens"])
    filler_ids: list[int] = []
    while len(filler_ids) < n_tools - n_short:
        filler_ids += _post_json(direct, "/tokenize", {"content": FILLER})["tokens"]
    filler_ids = filler_ids[: max(n_tools - n_short, 0)]
    gen = {"temperature": TEMPERATURE, "seed": SEED, "stream": True, "ignore_eos": True}
    comp = {**gen, "n_predict": tokens}
    chat_body = {**gen, "messages": messages, "max_tokens": tokens,
                 "stream_options": {"include_usage": True}}  # fmt: skip
    options = {"temperature": TEMPERATURE, "seed": SEED, "num_predict": tokens}
    ollama = {"model": model, "messages": messages, "stream": True, "options": options}
    base, chat_base = "direct completion, short prompt", "direct chat, no tools"
    # In cycles of one prompt (rotated each round, so a prompt's variants mostly follow each
    # other and its tokens are read once).
    out = [
        Variant("direct chat, no tools", "direct", "/v1/chat/completions", chat_body, chat_base),
        Variant(base, "direct", "/completion", {**comp, "prompt": short}, base),
        Variant("corral /api/chat, no tools", "corral", "/api/chat", ollama,
                "corral /api/chat, no tools"),
        Variant("direct completion, same-length prompt without tools", "direct", "/completion",
                {**comp, "prompt": [*filler_ids, short]}, base),
        Variant("direct completion, tools prompt", "direct", "/completion",
                {**comp, "prompt": with_tools}, base),
        Variant("direct completion, tools prompt + lazy grammar", "direct", "/completion",
                {**comp, "prompt": with_tools, **fallback_grammar(tools)},
                "direct completion, tools prompt"),
        Variant("corral /api/chat, tools", "corral", "/api/chat", {**ollama, "tools": tools},
                "corral /api/chat, no tools"),
        Variant("direct chat, tools", "direct", "/v1/chat/completions",
                {**chat_body, "tools": tools}, chat_base),
    ]  # fmt: skip
    return out, native


def sample(t: Timed) -> Sample:
    # llama.cpp sends SSE comment lines (":") while a long prompt is read
    body = b"\n".join(line for line in t.body.split(b"\n") if not line.startswith(b":"))
    n = completion_tokens(body)
    client = safe_div(n - 1, t.end - t.first) if n > 1 else float("nan")
    server, prompt = float("nan"), 0
    objs = sse_objects(body) if body.lstrip().startswith(b"data:") else ndjson_objects(body)
    for o in reversed(objs):
        timings = o.get("timings")
        if isinstance(timings, dict) and "predicted_per_second" in timings:
            server = float(timings["predicted_per_second"])
            prompt = int(timings.get("prompt_n", 0)) + int(timings.get("cache_n", 0))
            break
        if "eval_duration" in o and o.get("eval_count"):
            server = o["eval_count"] / (o["eval_duration"] / 1e9)
            prompt = int(o.get("prompt_eval_count", 0))
            break
    return Sample(client, server, n, prompt)


def measure(
    server: CorralServer, model: str, tools: list[dict[str, Any]], reps: int, tokens: int,
    say: Callable[[str], None],
) -> Results:  # fmt: skip
    r = server.client.post("/api/generate", json={"model": model}, timeout=300)
    r.raise_for_status()
    pid = next(m["pid"] for m in server.ps() if m["name"] == model)
    direct, corral = Http(runner_url(pid)), Http(server.url)
    try:
        vs, native = variants(direct, model, tools, tokens)
        res = Results(model, native, len(tools))
        res.samples = {v.name: [] for v in vs}
        res.baselines = {v.name: v.baseline for v in vs}
        for i in range(reps + 1):  # the first round warms up
            say(f"tools bench: {model}: round {i}/{reps}")
            k = i % len(vs)
            for v in vs[k:] + vs[:k]:
                http = direct if v.side == "direct" else corral
                t = http.post(v.path, orjson.dumps(v.body), close=v.side == "direct")
                if t.status != 200:
                    raise RuntimeError(f"{v.name}: {t.status} {t.body[:300]!r}")
                if i:
                    try:
                        res.samples[v.name].append(sample(t))
                    except ValueError:
                        raise RuntimeError(f"{v.name}: cannot read {t.body[:300]!r}") from None
        return res
    finally:
        direct.close()
        corral.close()


def report(res: Results) -> list[str]:
    kind = "template with tools (llama.cpp's own)" if res.native else "template without tools"
    lines = [f"\n{res.model}: {kind}, {res.tools} tools",
             f"{'variant':54} {'prompt':>6} {'tokens':>6} {'tok/s':>7} {'llama.cpp':>9} "
             f"{'vs':>24} {'ratio p50':>9} {'ratio min-max':>13}"]  # fmt: skip
    for name, ss in res.samples.items():
        base = res.baselines[name]
        pairs = zip(ss, res.samples[base], strict=True)
        paired = [a.client_rate / b.client_rate for a, b in pairs if b.client_rate > 0]
        vs = "-" if base == name else base.replace("direct ", "").replace("corral ", "")[:24]
        ratio = f"{median(paired):.2f}" if base != name else ""
        spread = f"{min(paired):.2f}-{max(paired):.2f}" if base != name else ""
        lines.append(
            f"{name:54} {ss[0].prompt_tokens:>6} {median([s.tokens for s in ss]):>6.0f} "
            f"{median([s.client_rate for s in ss]):>7.1f} "
            f"{median([s.server_rate for s in ss]):>9.1f} {vs:>24} {ratio:>9} {spread:>13}"
        )
    # corral's own path with tools: against the runner given the same prompt and fields
    same = "direct chat, tools" if res.native else "direct completion, tools prompt + lazy grammar"
    pairs = zip(res.samples["corral /api/chat, tools"], res.samples[same], strict=True)
    paired = [a.client_rate / b.client_rate for a, b in pairs if b.client_rate > 0]
    if paired:
        lines.append(
            f"corral /api/chat, tools against {same} (the same prompt): paired p50 "
            f"{median(paired):.2f}, min-max {min(paired):.2f}-{max(paired):.2f}"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m corral.bench.tools", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--reps", type=int, default=5, help="measured rounds (default 5)")
    ap.add_argument("--tokens", type=int, default=128, help="tokens per request (default 128)")
    ap.add_argument("--tools", type=int, default=24, help="tools per request (default 24)")
    ap.add_argument("--json", type=Path, help="write the samples here")
    ap.add_argument("--models", default=f"{SMOLLM2},{NATIVE}", help="comma list")
    args = ap.parse_args(argv)

    def say(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    tools = bench_tools(args.tools)
    with tempfile.TemporaryDirectory(prefix="corral-bench-tools-") as tmp:
        work = Path(tmp)
        models = work / "models"
        synth.write_llama_model(models / f"{NATIVE}.gguf", n_layer=2, context_length=8192,
                                chat_template=synth.TOOLS_TEMPLATE)  # fmt: skip
        server = start_corral(models, work / "corral.log", {
            "CORRAL_CONTEXT_LENGTH": "8192", "CORRAL_NUM_PARALLEL": "1",
            "CORRAL_KEEP_ALIVE": "-1",
        })  # fmt: skip
        results: list[Results] = []
        t0 = time.monotonic()
        load0 = os.getloadavg()[0]
        try:
            for model in [m.strip() for m in args.models.split(",") if m.strip()]:
                name = model if ":" in model else f"{model}:latest"
                results.append(measure(server, name, tools, args.reps, args.tokens, say))
        finally:
            server.stop()
        load1 = os.getloadavg()[0]
    print(f"Generation with and without tools ({args.reps} interleaved rounds, {args.tokens} "
          f"tokens, temperature {TEMPERATURE}, seed {SEED}; {time.monotonic() - t0:.0f} s, "
          f"load average {load0:.2f} -> {load1:.2f}, {os.cpu_count()} CPUs)")  # fmt: skip
    for res in results:
        print("\n".join(report(res)))
    if args.json:
        args.json.write_bytes(orjson.dumps([
            {"model": r.model, "native": r.native, "tools": r.tools,
             "samples": {k: [s.__dict__ for s in v] for k, v in r.samples.items()}}
            for r in results
        ], option=orjson.OPT_INDENT_2))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
