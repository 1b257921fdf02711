"""`corral serve`: the flags, each an override of its CORRAL_* variable."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

from corral.cli.client import CLIError
from corral.config import ConfigError

# `corral serve` flag -> (environment variable, metavar, help). The server reads settings from
# these variables, so a flag is only an override of its variable; this is the one table of them.
SERVE_FLAGS: dict[str, tuple[str, str, str]] = {
    "--host": ("CORRAL_HOST", "HOST", "address to listen on, host:port"),
    "--models": ("CORRAL_MODELS", "DIR", "directory of GGUF models"),
    "--keep-alive": ("CORRAL_KEEP_ALIVE", "DURATION", "how long an idle model stays loaded"),
    "--context-length": ("CORRAL_CONTEXT_LENGTH", "N", "default context length"),
    "--num-parallel": ("CORRAL_NUM_PARALLEL", "N", "requests each model serves at once"),
    "--load-timeout": ("CORRAL_LOAD_TIMEOUT", "DURATION", "give up loading a model after this"),
    "--max-loaded-models": ("CORRAL_MAX_LOADED_MODELS", "N", "most models loaded (0: by memory)"),
    "--max-queue": ("CORRAL_MAX_QUEUE", "N", "most requests waiting for a model"),
    "--stall-timeout": ("CORRAL_RUNNER_STALL_TIMEOUT", "DURATION", "kill a hung runner after this"),
    "--memory-margin": ("CORRAL_MEMORY_MARGIN", "SIZE", "memory to leave free, e.g. 1GiB"),
    "--memory-limit": ("CORRAL_MEMORY_LIMIT", "SIZE", "most memory for loaded models"),
    "--llama-server": ("CORRAL_LLAMA_SERVER", "PATH", "run models with this llama-server binary"),
    "--log-level": ("CORRAL_LOG_LEVEL", "LEVEL", "debug, info, warning or error"),
    # CORRAL_API_KEY has no flag: a key on the command line is visible to every local user
    "--origins": ("CORRAL_ORIGINS", "LIST", "web origins allowed to call, e.g. https://*.my.org"),
    "--shutdown-grace": ("CORRAL_SHUTDOWN_GRACE", "DURATION", "on SIGTERM, time to finish"),
    "--read-timeout": ("CORRAL_READ_TIMEOUT", "DURATION", "close connections slow to send"),
    "--idle-timeout": (
        "CORRAL_IDLE_TIMEOUT",
        "DURATION",
        "close kept-alive connections idle this long",
    ),
    "--max-connections": ("CORRAL_MAX_CONNECTIONS", "N", "most open connections"),
    "--ray": ("CORRAL_RAY_ADDRESS", "ADDRESS", "serve a Ray cluster: 'auto' or the head's address"),
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
