"""Embeddings in bulk: one request of many short inputs (RAG indexing), inputs per second
through corral's two routes against llama.cpp's own `llama-server`, on the same GGUF.

Each side is started once with its defaults: corral with no settings (`CORRAL_NUM_PARALLEL`
auto), `llama-server -m MODEL --embeddings` (its automatic slots, -np -1). A round sends the
same list of inputs to every variant (corral `/api/embed`, corral `/v1/embeddings`,
llama-server `/v1/embeddings`, and corral `/v1/embeddings` with that llama-server binary as its
runner (`CORRAL_LLAMA_SERVER`), which tells corral's share of a difference from the build's),
the order rotating from round to round (`interleave`); the
first, smaller request to each is a warm-up. inputs/s = inputs over the request's wall time,
from sending it to the last byte of the answer; "paired" is the median of corral over
llama-server within each round.

The model: a synthetic bert (corral.testing.synth), and a real embedding GGUF where
`CORRAL_BENCH_EMBED_MODEL` names one. llama-server is found as for the swap benchmark
(`corral.bench.llama_build.find_llama_server`); without one corral is measured alone.

`CORRAL_BENCH_EMBED_THREADS=N` runs both sides with N compute threads (models.toml
`num_thread`, llama-server `-t N`) instead of their defaults: on a machine other work keeps
busy, llama.cpp's threads spin at their barriers while the one they wait for is off the CPU,
and a round's figures swing by 5-10x; with one thread they hold still.
"""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

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
    ratio,
    safe_div,
    summary,
)
from corral.bench.llama_build import serving
from corral.testing import synth
from corral.testing.server import start_corral

SYNTH = "bench-embed"
ENV_MODEL = "CORRAL_BENCH_EMBED_MODEL"  # a real embedding GGUF to measure too
ENV_THREADS = "CORRAL_BENCH_EMBED_THREADS"  # both sides with this many threads (default: theirs)
INPUTS = {"smoke": 200, "quick": 2000, "full": 10_000}  # inputs per request
ROUNDS = {"smoke": 1, "quick": 3, "full": 5}
WARMUP = 64  # inputs in each side's first, unmeasured request
WORDS = (
    "river stone light market garden winter paper signal harbor engine forest letter bridge "
    "copper window valley thread orbit lantern meadow census ledger quartz canyon"
).split()


def texts(n: int, seed: int = 7) -> list[str]:
    """`n` distinct short passages (6-14 words), the same for a seed."""
    rng = random.Random(seed)
    return [f"{i}: " + " ".join(rng.choices(WORDS, k=rng.randint(6, 14))) for i in range(n)]


@dataclass(frozen=True)
class Variant:
    name: str  # as the table shows it
    side: str  # "corral" or "llama-server"
    path: str
    ollama: bool  # the answer is Ollama's {"embeddings": [...]}


BASE = "llama-server /v1/embeddings"
# corral with the very llama-server binary as its runner (CORRAL_LLAMA_SERVER): what is left of
# the difference is corral's, not the build's (its runners are xllamacpp's wheel otherwise).
SAME_BUILD = "corral-llama"
VARIANTS = (
    Variant("corral /api/embed", "corral", "/api/embed", True),
    Variant("corral /v1/embeddings", "corral", "/v1/embeddings", False),
    Variant("corral /v1/embeddings, llama-server as its runner", SAME_BUILD, "/v1/embeddings",
            False),
    Variant(BASE, "llama-server", "/v1/embeddings", False),
)


def send(http: Http, v: Variant, model: str, inputs: list[str]) -> float:
    """One request of `inputs`; its wall time. RuntimeError unless every vector came back."""
    body = orjson.dumps({"model": model, "input": inputs})
    t = http.post(v.path, body)
    if t.status != 200:
        raise RuntimeError(f"{v.name} answered {t.status}: {t.body[:300]!r}")
    data = orjson.loads(t.body)
    got = len(data["embeddings"] if v.ollama else data["data"])
    if got != len(inputs):
        raise RuntimeError(f"{v.name} answered {got} of {len(inputs)} vectors")
    return t.latency


@contextlib.contextmanager
def llama_server(binary: Path, model: Path, log: Path, threads: int = 0) -> Iterator[str]:
    """`llama-server` with its defaults and embeddings on, serving `model` (with `threads`
    compute threads, if given); its URL."""
    args = ["-m", str(model), "--embeddings", "--no-webui"]
    if threads:
        args += ["-t", str(threads)]
    with serving(binary, args, log) as (_, url):
        yield url


def slots_of(http: Http, v: Variant, model: str) -> int | None:
    """The slots the side serves the model with (corral's /api/ps, llama-server's /props)."""
    with contextlib.suppress(Exception):
        if v.side != "llama-server":
            ps = http.get_json("/api/ps")["models"]
            return next(
                int(m["num_parallel"]) for m in ps if m["name"] in (model, model + ":latest")
            )
        return int(http.get_json("/props")["total_slots"])
    return None


def measure(
    model_path: Path, label: str, scale: Scale, work: Path, say: Say, sec: Section,
    binary: Path | None,
) -> None:  # fmt: skip
    """Every variant on one model, interleaved rounds; a table row per variant."""
    n, rounds = INPUTS[scale.name], ROUNDS[scale.name]
    inputs = texts(n)
    threads = threads_setting()
    models_dir = work / f"embed-models-{label}"
    (models_dir / "files").mkdir(parents=True, exist_ok=True)
    link = models_dir / "files" / f"{label}.gguf"
    if not link.exists():
        link.symlink_to(model_path.resolve())
    model = label
    toml = f'[models."{label}"]\nfile = "files/{label}.gguf"\n'
    (models_dir / "models.toml").write_text(toml + (f"num_thread = {threads}\n" if threads else ""))
    server = start_corral(
        models_dir, work / f"embed-corral-{label}.log",
        {"CORRAL_KEEP_ALIVE": "-1", "CORRAL_BUILTIN_MODELS": "0"},
    )  # fmt: skip
    variants = [v for v in VARIANTS if binary is not None or v.side == "corral"]
    times: dict[str, list[float]] = {v.name: [] for v in variants}
    slots: dict[str, int | None] = {}
    load0 = os.getloadavg()[0]
    try:
        with contextlib.ExitStack() as stack:
            urls = {"corral": server.url}
            if binary is not None:
                log = work / f"embed-llama-server-{label}.log"
                urls["llama-server"] = stack.enter_context(llama_server(binary, link, log, threads))
                same = start_corral(
                    models_dir, work / f"embed-corral-llama-{label}.log",
                    {"CORRAL_KEEP_ALIVE": "-1", "CORRAL_BUILTIN_MODELS": "0",
                     "CORRAL_LLAMA_SERVER": str(binary)},
                )  # fmt: skip
                stack.callback(same.stop)
                urls[SAME_BUILD] = same.url
            clients = {side: Http(url, timeout=1800) for side, url in urls.items()}
            for c in clients.values():
                stack.callback(c.close)
            by_name = {v.name: v for v in variants}
            for v in variants:  # loads the model, warms each side up
                send(clients[v.side], v, model, inputs[:WARMUP])
                slots[v.side] = slots_of(clients[v.side], v, model)
            say(f"embed: {label}: {rounds} rounds of {n} inputs on {len(variants)} variants")
            for _, name in interleave(rounds, [v.name for v in variants]):
                v = by_name[name]
                times[name].append(send(clients[v.side], v, model, inputs))
    finally:
        server.stop()
    load = (load0, os.getloadavg()[0])
    table = Table(
        f"{label}: one request of {n:,} short inputs (6-14 words), {rounds} interleaved "
        "rounds",
        ["variant", "slots", "inputs/s p50", "inputs/s min", "inputs/s max", "vs llama-server",
         "paired vs llama-server", "load average"],
    )  # fmt: skip
    rates = {name: [n / t for t in ts] for name, ts in times.items()}
    base = BASE if binary is not None else None
    for v in variants:
        r = rates[v.name]
        vs = paired = float("nan")
        if base is not None:
            vs = safe_div(median(r), median(rates[base]))
            paired = median([a / b for a, b in zip(r, rates[base], strict=True)])
        table.add(v.name, slots.get(v.side) or "?", f"{median(r):,.0f}", f"{min(r):,.0f}",
                  f"{max(r):,.0f}", ratio(vs), ratio(paired),
                  f"{load[0]:.2f} -> {load[1]:.2f}")  # fmt: skip
        sec.data[f"{label}/{v.name}"] = {
            "inputs": n, "slots": slots.get(v.side), "inputs_per_s": summary(r),
            "vs_llama_server": vs, "paired": paired, "load_average": load,
        }  # fmt: skip
        if base is not None and v.side == "corral":  # corral as users run it
            sec.goals.append(goal_min(
                f"inputs/s >= llama-server's ({v.name}, {label}, {n:,} inputs)", vs, 1.0,
                ratio, lambda x: f"{x:.3f}",
            ))  # fmt: skip
    sec.tables.append(table)


def threads_setting() -> int:
    """CORRAL_BENCH_EMBED_THREADS, or 0: each side's default."""
    text = os.environ.get(ENV_THREADS, "").strip()
    if not text:
        return 0
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"{ENV_THREADS}={text!r}: expected a number of threads")
    return int(text)


def run(scale: Scale, work: Path, say: Say) -> Section:
    from corral.bench.llama_build import find_llama_server

    sec = Section("embed", "Embeddings in bulk")
    binary, where = find_llama_server()
    if binary is None:
        sec.notes.append(f"no llama-server ({where}): corral measured alone")
    else:
        sec.notes.append(f"llama-server: {where}")
    models = [(synth.write_bert_model(work / "embed-src" / f"{SYNTH}.gguf"), SYNTH)]
    real = os.environ.get(ENV_MODEL)
    if real:
        path = Path(real).expanduser()
        if path.is_file():
            models.append((path, "real-" + path.stem.lower().replace(".", "-")[:40]))
        else:
            sec.notes.append(f"{ENV_MODEL}={real} is not a file: synthetic model only")
    else:
        sec.notes.append(f"synthetic model only ({ENV_MODEL} names a real embedding GGUF)")
    for path, label in models:
        measure(path, label, scale, work, say, sec, binary)
    if threads_setting():
        sec.notes.append(f"both sides with {threads_setting()} compute threads ({ENV_THREADS})")
    sec.notes.append(
        "inputs/s: inputs over the wall time of one request holding them all, from sending it "
        "to the last byte of the answer (every vector counted); 'paired' is the median over "
        "rounds of corral / llama-server in the same round; both sides run with their "
        "defaults (corral: no settings; llama-server: -m MODEL --embeddings), the synthetic "
        "model is a 2-layer bert (n_embd 64) with SmolLM2's vocabulary"
    )
    return sec
