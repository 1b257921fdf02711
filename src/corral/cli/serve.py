"""`corral serve`: the flags, each an override of its CORRAL_* variable."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

from corral.cli.client import CLIError
from corral.config import SETTINGS, ConfigError

# `corral serve` flag -> (environment variable, metavar, help), from the one table of settings.
# The server reads settings from these variables, so a flag is only an override of its variable.
SERVE_FLAGS: dict[str, tuple[str, str, str]] = {
    s.flag: (s.variable, s.metavar, s.help) for s in SETTINGS if s.flag
}


def serve_overrides(args: argparse.Namespace) -> dict[str, str]:
    """Environment-variable overrides for the `serve` flags the user actually gave."""
    return {
        env: str(value)
        for env, _, _ in SERVE_FLAGS.values()
        if (value := getattr(args, env, None)) is not None
    }


def cmd_serve(args: argparse.Namespace) -> int:
    overrides = serve_overrides(args)
    ray = overrides.get("CORRAL_RAY_ADDRESS", os.environ.get("CORRAL_RAY_ADDRESS", ""))
    if ray.strip():  # cluster mode: only it imports Ray
        return serve_cluster(overrides)
    from corral.server import serve  # imported late: it pulls in the whole server stack

    try:
        serve(overrides)
    except ConfigError as e:
        raise CLIError(str(e)) from None
    except SystemExit as e:  # the server may exit with its own message; main() still returns
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
            return 1
        return e.code or 0
    return 0


def serve_cluster(overrides: dict[str, str]) -> int:
    """`corral serve --ray ADDRESS`: the entry process of a Ray cluster (corral.cluster)."""
    from corral.config import Settings

    if importlib.util.find_spec("ray") is None:
        raise CLIError("cluster mode needs Ray: pip install 'corral[ray]'")
    try:
        settings = Settings.load(overrides)
    except ConfigError as e:
        raise CLIError(str(e)) from None
    from corral.cluster.entry import serve_cluster as serve

    serve(settings)
    return 0
