"""`corral run`: pull the model if it is missing and has a pullable name, load it, then answer
a prompt or open the interactive session (cli/repl.py)."""

from __future__ import annotations

import argparse
import shutil
import sys

from corral.cli.chat import TokenPrinter, keep_alive_value, load_model, print_stats, stream_reply
from corral.cli.client import JSON, Client, CLIError, connect
from corral.cli.display import _isatty
from corral.cli.models import show_progress
from corral.cli.repl import Session, chat_loop


def _read_stdin() -> str:
    try:
        return sys.stdin.read()
    except (OSError, ValueError):  # closed or unreadable stdin: no piped prompt
        return ""


def pull_if_missing(client: Client, model: str, keep_alive: object = None) -> None:
    """Load `model`; one the server does not have is pulled first, with progress, as
    `ollama run` does, when the server can pull its name (corral: `hf.co/{owner}/{repo}`).
    A name it cannot pull is reported as not found (with the original 404's message)."""
    try:
        load_model(client, model, keep_alive)
        return
    except CLIError as missing:
        if missing.status != 404:
            raise
        try:
            show_progress(client.stream("/api/pull", {"model": model, "stream": True}))
        except CLIError as e:
            if e.status == 400:  # not a name the server pulls: it is just not there
                raise missing from None
            raise
    load_model(client, model, keep_alive)


def cmd_run(args: argparse.Namespace) -> int:
    stdin_tty = _isatty(sys.stdin)
    words = list(args.prompt)
    if not stdin_tty and (piped := _read_stdin()):  # piped text comes before the arguments
        words.insert(0, piped)
    prompt = " ".join(words)
    interactive = not words and stdin_tty and _isatty(sys.stdout)
    wrap = None
    if stdin_tty and _isatty(sys.stdout) and not args.nowordwrap:
        wrap = shutil.get_terminal_size().columns

    options: JSON = {}
    keep_alive = None if args.keepalive is None else keep_alive_value(args.keepalive)
    if keep_alive is not None:
        options["keep_alive"] = keep_alive
    with connect() as client:
        # Load first, so an unknown model or a failed load is reported before any prompt.
        pull_if_missing(client, args.model, keep_alive)
        if interactive:
            session = Session(args.model, verbose=args.verbose, wrap=wrap,
                              format=args.format or "", keep_alive=keep_alive)  # fmt: skip
            return chat_loop(client, session)
        if args.format:
            options["format"] = args.format
        if not prompt:
            return 0
        printer = TokenPrinter(sys.stdout, wrap)
        body = {"model": args.model, "prompt": prompt, "stream": True, **options}
        try:
            _, final = stream_reply(client, "/api/generate", body, printer, _isatty(sys.stderr))
        except KeyboardInterrupt:
            printer.end_line()
            return 130
        printer.end_line()
        if args.verbose:
            print_stats(final)
    return 0
