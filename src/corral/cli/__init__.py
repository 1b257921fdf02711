"""The `corral` command: start the server, or talk to a running one like the `ollama` CLI does.

Client commands use only Ollama's public routes and fields (/api/generate, /api/chat, /api/ps,
/api/tags, /api/show, /api/version), so they work against corral or a real Ollama server. The
formatting helpers are plain functions that mirror Ollama's Go formatting, for unit tests.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
from collections.abc import Callable

from corral.cli.client import CLIError, connect
from corral.cli.models import (
    cmd_cp,
    cmd_create,
    cmd_list,
    cmd_ps,
    cmd_pull,
    cmd_rm,
    cmd_show,
    cmd_stop,
    cmd_version,
)
from corral.cli.run import cmd_run
from corral.cli.runner import add_runner_parser
from corral.cli.serve import SERVE_FLAGS, cmd_serve
from corral.cli.suggest import close_models, close_words, did_you_mean
from corral.config import DEFAULTS


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="corral",
        description="Serve GGUF models through the Ollama and OpenAI APIs, and talk to the server."
        " Client commands reach the server at CORRAL_HOST (else OLLAMA_HOST; default"
        " 127.0.0.1:11434).",
    )
    parser.add_argument("--version", action="store_true", help="show client and server versions")
    sub = parser.add_subparsers(title="commands", metavar="COMMAND")

    p = sub.add_parser("serve", help="start the server")
    for flag, (env, metavar, text) in SERVE_FLAGS.items():
        default = DEFAULTS.get(env)
        suffix = f" (env {env}" + (f", default {default})" if default else ")")
        p.add_argument(flag, dest=env, metavar=metavar, help=text + suffix)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("run", help="run a model: answer a prompt, or chat")
    p.add_argument("model")
    p.add_argument("prompt", nargs="*", help="prompt (default: stdin if piped, else chat)")
    p.add_argument("--verbose", action="store_true", help="show timings after the answer")
    p.add_argument("--keepalive", metavar="DURATION", help="how long the model stays loaded")
    p.add_argument("--format", choices=["json"], help="response format")
    p.add_argument("--nowordwrap", action="store_true", help="don't wrap words")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("ps", help="list running models")
    p.add_argument("--verbose", action="store_true",
                   help="also say how each model drafts (speculative decoding) and why")
    p.set_defaults(func=cmd_ps)

    p = sub.add_parser("stop", help="unload a running model")
    p.add_argument("model")
    p.set_defaults(func=cmd_stop)

    p = sub.add_parser("list", aliases=["ls"], help="list models")
    p.set_defaults(func=cmd_list)

    p = sub.add_parser("show", help="show information about a model")
    p.add_argument("model")
    only = p.add_mutually_exclusive_group()
    for name in ("modelfile", "template", "parameters", "system", "license"):
        only.add_argument(
            f"--{name}",
            dest="field",
            action="store_const",
            const=name,
            help=f"show only the {name}",
        )
    p.set_defaults(func=cmd_show, field=None)

    p = sub.add_parser("pull", help="pull a model from Hugging Face (hf.co/{owner}/{repo}:{quant})")
    p.add_argument("model")
    p.set_defaults(func=cmd_pull)

    p = sub.add_parser("create", help="create a model from a Modelfile")
    p.add_argument("model")
    p.add_argument("-f", "--file", metavar="FILE", help="the Modelfile (default: ./Modelfile)")
    p.add_argument("-q", "--quantize", metavar="TYPE", help="not supported by corral")
    p.set_defaults(func=cmd_create)

    p = sub.add_parser("cp", help="copy a model")
    p.add_argument("source")
    p.add_argument("destination")
    p.set_defaults(func=cmd_cp)

    p = sub.add_parser("rm", help="remove models corral pulled or created (never your files)")
    p.add_argument("models", nargs="+", metavar="model")
    p.set_defaults(func=cmd_rm)

    p = sub.add_parser("version", help="show client and server versions")
    p.set_defaults(func=cmd_version)

    add_runner_parser(sub)  # `corral runner build|list`: local, no server

    # Listed for --help only: main() hands `corral bench ...` to corral.bench's own parser.
    sub.add_parser("bench", help="run the benchmarks (corral bench --help)", add_help=False)
    return parser


def _commands(parser: argparse.ArgumentParser) -> list[str]:
    """The command names (aliases too) the parser knows."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return list(action.choices)
    return []


def unknown_command(word: str, commands: list[str]) -> str:
    """Cobra's answer to a mistyped command, as `ollama lst` prints it."""
    return (
        f'Error: unknown command "{word}" for "corral"\n'
        + did_you_mean(close_words(word, commands))
        + "\nRun 'corral --help' for usage.\n"
    )


NOT_FOUND = re.compile(r"^model '(.+)' not found$")


def suggest_models(message: str) -> str:
    """For a "model 'x' not found" error, the names the server has that are closest to x."""
    m = NOT_FOUND.match(message)
    if not m:
        return ""
    try:
        with connect() as client:
            listed = client.get("/api/tags").get("models") or []
    except CLIError:
        return ""
    names = [str(x.get("name") or x.get("model") or "") for x in listed if isinstance(x, dict)]
    return did_you_mean(close_models(m.group(1), [n for n in names if n]))


def main(argv: list[str] | None = None) -> int:
    args_in = sys.argv[1:] if argv is None else argv
    if args_in[:1] == ["bench"]:
        from corral.bench import main as bench_main

        return bench_main(args_in[1:])
    parser = build_parser()
    commands = _commands(parser)
    if args_in[:1] == ["help"]:  # as `ollama help`
        parser.print_help()
        return 0
    if args_in and not args_in[0].startswith("-") and args_in[0] not in [*commands, "bench"]:
        sys.stderr.write(unknown_command(args_in[0], [*commands, "bench"]))
        return 1
    try:
        args, extra = parser.parse_known_args(argv)
        # argparse stops filling PROMPT at the first option (`run m --verbose hi`); ollama
        # takes prompt words anywhere, so take the leftovers back.
        if getattr(args, "func", None) is cmd_run and not any(a.startswith("-") for a in extra):
            args.prompt = [*args.prompt, *extra]
        elif extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    except SystemExit as e:  # --help, or a usage error argparse has already printed
        return e.code if isinstance(e.code, int) else 0 if e.code is None else 2

    func: Callable[[argparse.Namespace], int] | None = (
        cmd_version if args.version else getattr(args, "func", None)
    )
    if func is None:
        parser.print_help()
        return 0
    try:
        return func(args)
    except CLIError as e:
        print(f"Error: {e}", file=sys.stderr)
        if hint := suggest_models(str(e)):
            sys.stderr.write(hint)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `corral run m hi | head -1`
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
