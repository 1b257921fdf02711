"""The `corral` command: start the server, or talk to a running one like the `ollama` CLI does.

Client commands use only Ollama's public routes and fields (/api/generate, /api/chat, /api/ps,
/api/tags, /api/show, /api/version), so they work against corral or a real Ollama server. The
formatting helpers are plain functions that mirror Ollama's Go formatting, for unit tests.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shutil
import sys
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from datetime import datetime, timedelta, timezone
from types import TracebackType
from typing import Any, TextIO

import httpx
from rich.cells import cell_len
from rich.console import Console
from rich.live import Live
from rich.spinner import Spinner
from rich.table import Table

from corral import __version__
from corral.config import DEFAULTS, ConfigError

JSON = dict[str, Any]
DEFAULT_HOST = "127.0.0.1:11434"

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
    "--memory-margin": ("CORRAL_MEMORY_MARGIN", "SIZE", "memory to leave free, e.g. 1GiB"),
    "--memory-limit": ("CORRAL_MEMORY_LIMIT", "SIZE", "most memory for loaded models"),
    "--llama-server": ("CORRAL_LLAMA_SERVER", "PATH", "run models with this llama-server binary"),
    "--log-level": ("CORRAL_LOG_LEVEL", "LEVEL", "debug, info, warning or error"),
}

CHAT_HELP = '''Available Commands:
  /clear          Clear session context
  /bye            Exit
  /?, /help       Help for a command

Use """ to begin a multi-line message.'''


class CLIError(Exception):
    """A failure reported as `Error: <message>` with exit status 1, never as a traceback."""


class Unreachable(CLIError):
    def __init__(self, url: str) -> None:
        super().__init__(
            f"could not connect to corral server at {url}; is it running? "
            "(start it with: corral serve)"
        )


# ---------------------------------------------------------------------------------------------
# Pure helpers: addresses, sizes, times, table rows


def base_url(host: str) -> str:
    """Client URL for a CORRAL_HOST value: "host:port", ":port", "host" or "http(s)://host[:port]".

    Follows OLLAMA_HOST: bare values mean http on port 11434, a URL's scheme sets its default
    port, and a path after the address is kept (for servers behind a prefix).
    """
    text = host.strip() or DEFAULT_HOST
    scheme, sep, rest = text.partition("://")
    if sep:
        scheme = scheme.lower()
        default_port = 443 if scheme == "https" else 80
    else:
        scheme, rest, default_port = "http", text, 11434
    hostport, _, path = rest.partition("/")
    if hostport.startswith("["):  # [v6]:port
        name, _, tail = hostport[1:].partition("]")
        if tail and not tail.startswith(":"):
            raise ValueError(f"invalid address {host!r}")
        port_text = tail[1:]
    elif hostport.count(":") == 1:
        name, port_text = hostport.split(":")
    else:  # a bare name, or an IPv6 literal without brackets or port
        name, port_text = hostport, ""
    if port_text and not (port_text.isdigit() and 0 < int(port_text) < 65536):
        raise ValueError(f"invalid port in {host!r}")
    port = int(port_text) if port_text else default_port
    # A server listening on every interface is reached through loopback.
    name = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(name, name)
    netloc = f"[{name}]:{port}" if ":" in name else f"{name}:{port}"
    path = path.strip("/")
    return f"{scheme}://{netloc}" + (f"/{path}" if path else "")


def human_bytes(n: int) -> str:
    """Ollama's format.HumanBytes: decimal units, one decimal below 10 ("98 MB", "1.2 GB")."""
    for unit, scale in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if n >= scale:
            value = n / scale
            if value >= 10 or value == math.trunc(value):
                return f"{int(value)} {unit}"
            return f"{value:.1f} {unit}"
    return f"{n} B"


def human_number(n: int) -> str:
    """Ollama's format.HumanNumber, for parameter counts ("1.2B", "135M")."""
    if n >= 10**9:
        v = n / 10**9
        return f"{v:.0f}B" if v == math.floor(v) else f"{v:.1f}B"
    if n >= 10**6:
        v = n / 10**6
        return f"{v:.0f}M" if v == math.floor(v) else f"{v:.2f}M"
    if n >= 10**3:
        return f"{n / 10**3:.0f}K"
    return str(n)


def _round(x: float) -> int:
    return math.floor(x + 0.5)  # Go's math.Round (half away from zero) for x >= 0


def human_duration(seconds: float) -> str:
    """Ollama's format.HumanDuration ("4 minutes", "About an hour", "3 days")."""
    s = int(seconds)
    if s < 1:
        return "Less than a second"
    if s == 1:
        return "1 second"
    if s < 60:
        return f"{s} seconds"
    minutes = int(seconds / 60)
    if minutes == 1:
        return "About a minute"
    if minutes < 60:
        return f"{minutes} minutes"
    hours = _round(seconds / 3600)
    if hours == 1:
        return "About an hour"
    if hours < 48:
        return f"{hours} hours"
    if hours < 24 * 7 * 2:
        return f"{hours // 24} days"
    if hours < 24 * 30 * 2:
        return f"{hours // 24 // 7} weeks"
    if hours < 24 * 365 * 2:
        return f"{hours // 24 // 30} months"
    return f"{int(seconds / 3600 / 24 / 365)} years"


def human_time(when: datetime | None, now: datetime | None = None, zero: str = "Never") -> str:
    """Ollama's format.HumanTime: "2 hours ago", "4 minutes from now", "Forever" (>20 years)."""
    if when is None:
        return zero
    delta = ((now or datetime.now(timezone.utc)) - when).total_seconds()
    if int(int(delta / 3600) / 24 / 365) < -20:  # Go truncates each integer step toward zero
        return "Forever"
    if delta < 0:
        return human_duration(-delta) + " from now"
    return human_duration(delta) + " ago"


def until_text(expires: datetime | None, now: datetime | None = None) -> str:
    """The UNTIL column of `ps`: when an idle model unloads."""
    if expires is None:  # no expiry at all: kept loaded forever
        return "Forever"
    if expires <= (now or datetime.now(timezone.utc)):
        return "Stopping..."
    return human_time(expires, now)


_TIME = re.compile(
    r"^(\d{4,})-(\d\d)-(\d\d)[Tt ](\d\d):(\d\d):(\d\d)(?:\.(\d+))?\s*([Zz]|[+-]\d\d:?\d\d)?$"
)


def parse_time(value: object) -> datetime | None:
    """An RFC 3339 time as Go writes it (nanoseconds, "Z" or offset); None for absent or Go's
    zero time. Written by hand because Python 3.10's fromisoformat rejects both."""
    m = _TIME.match(value.strip()) if isinstance(value, str) else None
    if not m:
        return None
    year, month, day, hh, mm, ss = (int(g) for g in m.groups()[:6])
    if year <= 1:
        return None
    if year > 9999:  # past datetime's range; only reachable as "never expires"
        return datetime.max.replace(tzinfo=timezone.utc)
    micro = int((m.group(7) or "0")[:6].ljust(6, "0"))
    tz = timezone.utc
    offset = m.group(8)
    if offset and offset not in "Zz":
        sign = -1 if offset[0] == "-" else 1
        digits = offset[1:].replace(":", "")
        tz = timezone(sign * timedelta(hours=int(digits[:2]), minutes=int(digits[2:])))
    return datetime(year, month, day, hh, mm, ss, micro, tzinfo=tz)


def processor(size: int, size_vram: int) -> str:
    """Where a loaded model lives, as `ollama ps` shows it ("100% GPU", "48%/52% CPU/GPU")."""
    if size_vram <= 0:
        return "100% CPU"
    if size_vram == size:
        return "100% GPU"
    if size_vram > size or size <= 0:
        return "Unknown"
    cpu = _round((size - size_vram) / size * 100)
    return f"{cpu}%/{100 - cpu}% CPU/GPU"


def go_duration(ns: int) -> str:
    """Nanoseconds as Go's time.Duration.String() ("1.5s", "12.3ms", "1m30s"), as ollama prints."""
    if ns == 0:
        return "0s"
    sign, u = ("-" if ns < 0 else ""), abs(ns)

    def frac(v: int, digits: int) -> str:
        whole, rest = divmod(v, 10**digits)
        tail = str(rest).rjust(digits, "0").rstrip("0")
        return f"{whole}.{tail}" if tail else str(whole)

    if u < 1_000:
        return f"{sign}{u}ns"
    if u < 1_000_000:
        return f"{sign}{frac(u, 3)}µs"
    if u < 1_000_000_000:
        return f"{sign}{frac(u, 6)}ms"
    hours, rest = divmod(u, 3600 * 10**9)
    minutes, rest = divmod(rest, 60 * 10**9)
    lead = f"{hours}h{minutes}m" if hours else (f"{minutes}m" if minutes else "")
    return f"{sign}{lead}{frac(rest, 9)}s"


def _int(value: object) -> int:
    try:
        return int(value)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        return 0


def format_stats(final: Mapping[str, Any]) -> list[str]:
    """Ollama's `--verbose` summary from the last chunk of a reply (durations in nanoseconds)."""
    total, load = _int(final.get("total_duration")), _int(final.get("load_duration"))
    p_count, p_dur = _int(final.get("prompt_eval_count")), _int(final.get("prompt_eval_duration"))
    count, dur = _int(final.get("eval_count")), _int(final.get("eval_duration"))
    lines: list[str] = []
    if total > 0:
        lines.append(f"total duration:       {go_duration(total)}")
    if load > 0:
        lines.append(f"load duration:        {go_duration(load)}")
    if p_count > 0:
        lines.append(f"prompt eval count:    {p_count} token(s)")
    if p_dur > 0:
        lines.append(f"prompt eval duration: {go_duration(p_dur)}")
        lines.append(f"prompt eval rate:     {p_count / (p_dur / 1e9):.2f} tokens/s")
    if count > 0:
        lines.append(f"eval count:           {count} token(s)")
    if dur > 0:
        lines.append(f"eval duration:        {go_duration(dur)}")
        lines.append(f"eval rate:            {count / (dur / 1e9):.2f} tokens/s")
    return lines


def short_id(digest: object) -> str:
    """The ID column: the first 12 hex digits of a digest, with or without "sha256:"."""
    if not isinstance(digest, str):
        return ""
    return digest.removeprefix("sha256:")[:12]


def ps_rows(models: Sequence[Mapping[str, Any]], now: datetime | None = None) -> list[list[str]]:
    """NAME, ID, SIZE, PROCESSOR, CONTEXT, UNTIL rows from /api/ps models."""
    rows = []
    for m in models:
        size, vram = _int(m.get("size")), _int(m.get("size_vram"))
        context = m.get("context_length")
        rows.append(
            [
                str(m.get("name") or m.get("model") or ""),
                short_id(m.get("digest")),
                human_bytes(size),
                processor(size, vram),
                str(context) if context is not None else "-",
                until_text(parse_time(m.get("expires_at")), now),
            ]
        )
    return rows


def list_rows(models: Sequence[Mapping[str, Any]], now: datetime | None = None) -> list[list[str]]:
    """NAME, ID, SIZE, MODIFIED rows from /api/tags models."""
    return [
        [
            str(m.get("name") or m.get("model") or ""),
            short_id(m.get("digest")),
            human_bytes(_int(m.get("size"))),
            human_time(parse_time(m.get("modified_at")), now),
        ]
        for m in models
    ]


def _number(value: object) -> str:
    """A JSON number as Go's FormatFloat(f, 'f', -1) shows it: no ".0" on whole numbers."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _head(text: str, n: int) -> list[str]:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return [*lines[:n], "..."] if len(lines) > n else lines


def format_show(info: Mapping[str, Any]) -> str:
    """Ollama's `show` summary: Model, Capabilities, Parameters, System and License sections."""
    details: Mapping[str, Any] = info.get("details") or {}
    model_info: Mapping[str, Any] = info.get("model_info") or {}
    model: list[list[str]] = []
    if model_info:
        arch = str(model_info.get("general.architecture") or details.get("family") or "")
        params = details.get("parameter_size") or ""
        if not params and "general.parameter_count" in model_info:
            params = human_number(_int(model_info["general.parameter_count"]))
        model += [["architecture", arch], ["parameters", str(params)]]
        for key, label in (
            ("context_length", "context length"),
            ("embedding_length", "embedding length"),
        ):
            if f"{arch}.{key}" in model_info:
                model.append([label, _number(model_info[f"{arch}.{key}"])])
    else:
        model += [
            ["architecture", str(details.get("family") or "")],
            ["parameters", str(details.get("parameter_size") or "")],
        ]
    model.append(["quantization", str(details.get("quantization_level") or "")])

    sections: list[tuple[str, list[list[str]]]] = [("Model", model)]
    if caps := info.get("capabilities"):
        sections.append(("Capabilities", [[str(c)] for c in caps]))
    if params_text := info.get("parameters"):
        # "stop  "<|im_end|>"" lines: the name, then the value (which may hold spaces)
        rows = [line.split(None, 1) for line in str(params_text).splitlines() if line.strip()]
        sections.append(("Parameters", rows))
    for key, title in (("system", "System"), ("license", "License")):
        if text := info.get(key):
            sections.append((title, [[line] for line in _head(str(text), 2)]))

    out: list[str] = []
    for title, rows in sections:
        out.append(f"  {title}")
        widths: dict[int, int] = {}
        for row in rows:
            for i, cell in enumerate(row[:-1]):
                widths[i] = max(widths.get(i, 0), cell_len(cell))
        for row in rows:
            cells = [c + " " * (widths[i] - cell_len(c)) for i, c in enumerate(row[:-1])]
            out.append("    " + "    ".join([*cells, row[-1]]).rstrip())
        out.append("")
    return "\n".join(out)


def serve_overrides(args: argparse.Namespace) -> dict[str, str]:
    """Environment-variable overrides for the `serve` flags the user actually gave."""
    return {
        env: str(value)
        for env, _, _ in SERVE_FLAGS.values()
        if (value := getattr(args, env, None)) is not None
    }


def keep_alive_value(text: str) -> str | int | float:
    """--keepalive as Ollama's API takes it: numbers (seconds; negative = forever) stay numbers,
    since Go's duration parser rejects unitless strings like "-1"."""
    for kind in (int, float):
        with contextlib.suppress(ValueError):
            return kind(text)
    return text


def error_message(status: int, reason: str, body: str) -> str:
    """The message of an HTTP error answer: its JSON "error", else its text, else the status."""
    with contextlib.suppress(ValueError):
        data = json.loads(body)
        if isinstance(data, dict) and data.get("error"):
            return str(data["error"])
    text = body.strip()
    return text[:500] if text else f"{status} {reason}".strip()


# ---------------------------------------------------------------------------------------------
# Terminal output


class TokenPrinter:
    """Writes streamed text as it arrives; with a width, wraps at word boundaries like ollama:
    a word that would overflow is erased and rewritten on the next line."""

    def __init__(self, out: TextIO, width: int | None = None) -> None:
        self.out = out
        # Never use the last column: the terminal's pending-wrap state would misplace the cursor.
        self.limit = width - 1 if width else 0
        self.col = 0
        self.word = ""
        self.at_line_start = True

    def write(self, text: str) -> None:
        if not text:
            return
        if self.limit > 0:
            text = self._wrap(text)
        self.out.write(text)
        self.out.flush()
        self.at_line_start = text.endswith("\n")

    def end_line(self) -> None:
        if not self.at_line_start:
            self.write("\n")

    def _wrap(self, text: str) -> str:
        parts: list[str] = []
        for ch in text:
            if ch == "\n":
                parts.append(ch)
                self.col, self.word = 0, ""
                continue
            w = cell_len(ch)
            if self.col + w > self.limit:
                if ch.isspace():  # the break itself replaces the space
                    parts.append("\n")
                    self.col, self.word = 0, ""
                    continue
                word_w = cell_len(self.word)
                if 0 < word_w < self.col:  # back up over the partial word, clear, rewrite below
                    parts.append(f"\x1b[{word_w}D\x1b[K\n{self.word}")
                    self.col = word_w
                else:  # the word alone fills the line: hard break
                    parts.append("\n")
                    self.col, self.word = 0, ""
            parts.append(ch)
            self.col += w
            self.word = "" if ch.isspace() else self.word + ch
        return "".join(parts)


class _Waiting:
    """A spinner on stderr while nothing has arrived yet; off unless stderr is a terminal."""

    def __init__(self, enabled: bool) -> None:
        self._live: Live | None = None
        if enabled:
            # No stdout redirection: tokens are written to the real stdout once this stops.
            self._live = Live(
                Spinner("dots"),
                console=Console(stderr=True),
                transient=True,
                redirect_stdout=False,
                redirect_stderr=False,
                refresh_per_second=12,
            )

    def __enter__(self) -> _Waiting:
        if self._live:
            self._live.start()
        return self

    def stop(self) -> None:
        if self._live:
            self._live.stop()

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def _isatty(stream: object) -> bool:
    try:
        return bool(stream.isatty())  # type: ignore[attr-defined]
    except (AttributeError, ValueError, OSError):
        return False


def print_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """A borderless table like ollama's, at its natural width (never wrapped or cut to 80
    columns when piped), with trailing padding removed."""
    out = sys.stdout
    tty = _isatty(out)
    table = Table(box=None, pad_edge=False, padding=(0, 2), header_style="bold" if tty else "")
    for h in headers:
        table.add_column(h, no_wrap=True)
    for row in rows:
        table.add_row(*row)
    console = Console(width=100_000, force_terminal=tty, no_color=not tty, highlight=False)
    with console.capture() as cap:
        console.print(table)
    out.write("\n".join(line.rstrip() for line in cap.get().splitlines()) + "\n")


# ---------------------------------------------------------------------------------------------
# HTTP client


class Client:
    """Synchronous client for the Ollama API that turns transport and API failures into CLIError."""

    def __init__(self, url: str) -> None:
        self.url = url
        # Loads and generations can take minutes, so only connecting is time-limited. Proxy
        # variables are ignored: the server is almost always local.
        self._http = httpx.Client(
            base_url=url, timeout=httpx.Timeout(None, connect=10.0), trust_env=False
        )

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self._http.close()

    @contextlib.contextmanager
    def _errors(self) -> Iterator[None]:
        try:
            yield
        except (httpx.ConnectError, httpx.ConnectTimeout):
            raise Unreachable(self.url) from None
        except httpx.TimeoutException:
            raise CLIError(f"timed out talking to corral server at {self.url}") from None
        except httpx.TransportError as e:
            raise CLIError(f"lost connection to corral server at {self.url}: {e}") from None
        except httpx.HTTPError as e:
            raise CLIError(str(e)) from None

    def get(self, path: str) -> JSON:
        with self._errors():
            resp = self._http.get(path)
        return _decode(_checked(resp).text)

    def post(self, path: str, body: Mapping[str, Any]) -> JSON:
        with self._errors():
            resp = self._http.post(path, json=body)
        return _decode(_checked(resp).text)

    def stream(self, path: str, body: Mapping[str, Any]) -> Generator[JSON, None, None]:
        """POST and yield NDJSON objects as they arrive; an {"error"} line raises CLIError."""
        with self._errors(), self._http.stream("POST", path, json=body) as resp:
            if resp.status_code >= 400:
                resp.read()
                _checked(resp)
            # A plain JSON answer (e.g. to a load request) is a one-line stream.
            for line in resp.iter_lines():
                if not line.strip():
                    continue
                chunk = _decode(line)
                if "error" in chunk:
                    raise CLIError(str(chunk["error"]))
                yield chunk


def _checked(resp: httpx.Response) -> httpx.Response:
    if resp.status_code >= 400:
        raise CLIError(error_message(resp.status_code, resp.reason_phrase, resp.text))
    return resp


def _decode(text: str) -> JSON:
    try:
        data = json.loads(text)
    except ValueError:
        data = None
    if not isinstance(data, dict):
        raise CLIError(f"unexpected response from server: {text[:200]!r}")
    if "error" in data and len(data) == 1:
        raise CLIError(str(data["error"]))
    return data


def connect() -> Client:
    host = os.environ.get("CORRAL_HOST", "")
    try:
        return Client(base_url(host))
    except ValueError as e:
        raise CLIError(f"CORRAL_HOST: {e}") from None


# ---------------------------------------------------------------------------------------------
# Commands


def cmd_serve(args: argparse.Namespace) -> int:
    from corral.server import serve  # imported late: it pulls in the whole server stack

    try:
        serve(serve_overrides(args))
    except ConfigError as e:
        raise CLIError(str(e)) from None
    except SystemExit as e:  # the server may exit with its own message; main() still returns
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
            return 1
        return e.code or 0
    return 0


def cmd_ps(args: argparse.Namespace) -> int:
    with connect() as client:
        data = client.get("/api/ps")
    headers = ["NAME", "ID", "SIZE", "PROCESSOR", "CONTEXT", "UNTIL"]
    print_table(headers, ps_rows(data.get("models") or []))
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    with connect() as client:
        data = client.get("/api/tags")
    print_table(["NAME", "ID", "SIZE", "MODIFIED"], list_rows(data.get("models") or []))
    return 0


def cmd_stop(args: argparse.Namespace) -> int:
    with connect() as client:
        for _ in client.stream("/api/generate", {"model": args.model, "keep_alive": 0}):
            pass
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    with connect() as client:
        info = client.post("/api/show", {"model": args.model})
    if args.field:
        text = str(info.get(args.field) or "")
        sys.stdout.write(text if text.endswith("\n") or not text else text + "\n")
    else:
        sys.stdout.write(format_show(info) + "\n")
    return 0


def cmd_version(args: argparse.Namespace) -> int:
    print(f"corral client version {__version__}")
    try:
        with connect() as client:
            server = client.get("/api/version").get("version", "unknown")
    except Unreachable as e:
        print(f"Warning: {e}", file=sys.stderr)
    except CLIError as e:
        print(f"Warning: could not get the server version: {e}", file=sys.stderr)
    else:
        print(f"corral server version {server}")
    return 0


def _read_stdin() -> str:
    try:
        return sys.stdin.read()
    except (OSError, ValueError):  # closed or unreadable stdin: no piped prompt
        return ""


def stream_reply(
    client: Client, path: str, body: Mapping[str, Any], printer: TokenPrinter, spin: bool
) -> tuple[str, JSON | None]:
    """Stream a /api/generate or /api/chat reply to the printer; returns (text, final chunk)."""
    parts: list[str] = []
    final: JSON | None = None
    thinking = False
    with _Waiting(spin) as waiting, contextlib.closing(client.stream(path, body)) as chunks:
        for chunk in chunks:
            waiting.stop()
            source = (chunk.get("message") or {}) if path == "/api/chat" else chunk
            think, content = source.get("thinking"), source.get("content", source.get("response"))
            if think:
                if not thinking:
                    printer.write("Thinking...\n")
                    thinking = True
                printer.write(str(think))
            if content:
                if thinking:
                    printer.end_line()
                    printer.write("...done thinking.\n\n")
                    thinking = False
                printer.write(str(content))
                parts.append(str(content))
            if chunk.get("done"):
                final = chunk
    return "".join(parts), final


def _print_stats(final: JSON | None) -> None:
    for line in format_stats(final or {}):
        print(line, file=sys.stderr)


def read_message(read: Callable[[str], str]) -> str:
    """One user message; text between triple quotes may span lines, as in ollama."""
    line = read(">>> ")
    if not line.startswith('"""'):
        return line
    first = line[3:]
    if first.rstrip().endswith('"""'):
        return first.rstrip()[:-3]
    parts = [first]
    while True:
        nxt = read("... ")
        if nxt.rstrip().endswith('"""'):
            parts.append(nxt.rstrip()[:-3])
            return "\n".join(parts).strip("\n")
        parts.append(nxt)


def chat_loop(client: Client, args: argparse.Namespace, options: JSON, wrap: int | None) -> int:
    with contextlib.suppress(ImportError):
        import readline  # noqa: F401  (line editing and history for input())
    messages: list[JSON] = []
    printer = TokenPrinter(sys.stdout, wrap)
    spin = _isatty(sys.stderr)
    while True:
        try:
            text = read_message(input)
        except EOFError:
            print()
            return 0
        except KeyboardInterrupt:
            print("\nUse Ctrl + d or /bye to exit.")
            continue
        if not text.strip():
            continue
        if text.startswith("/"):
            command = text.split()[0]
            if command in ("/bye", "/exit"):
                return 0
            if command == "/clear":
                messages.clear()
                print("Cleared session context")
            elif command in ("/?", "/help"):
                print(CHAT_HELP)
            else:
                print(f"Unknown command '{command}'. Type /? for help")
            continue
        messages.append({"role": "user", "content": text})
        body = {"model": args.model, "messages": messages, "stream": True, **options}
        try:
            reply, final = stream_reply(client, "/api/chat", body, printer, spin)
        except KeyboardInterrupt:  # stop this answer; forget the unanswered question
            messages.pop()
            printer.end_line()
            print()
            continue
        except Unreachable:
            raise
        except CLIError as e:  # keep the session; the server may accept the next message
            messages.pop()
            printer.end_line()
            print(f"Error: {e}", file=sys.stderr)
            continue
        messages.append({"role": "assistant", "content": reply})
        printer.end_line()
        print()
        if args.verbose:
            _print_stats(final)


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
    if args.keepalive is not None:
        options["keep_alive"] = keep_alive_value(args.keepalive)
    with connect() as client:
        # Load first, so an unknown model or a failed load is reported before any prompt.
        with _Waiting(_isatty(sys.stderr)):
            for _ in client.stream("/api/generate", {"model": args.model, **options}):
                pass
        if args.format:
            options["format"] = args.format
        if interactive:
            return chat_loop(client, args, options, wrap)
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
            _print_stats(final)
    return 0


# ---------------------------------------------------------------------------------------------
# Entry point


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="corral",
        description="Serve GGUF models through the Ollama and OpenAI APIs, and talk to the server."
        " Client commands reach the server at CORRAL_HOST (default 127.0.0.1:11434).",
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

    p = sub.add_parser("version", help="show client and server versions")
    p.set_defaults(func=cmd_version)

    # Listed for --help only: main() hands `corral bench ...` to corral.bench's own parser.
    sub.add_parser("bench", help="run the benchmarks (corral bench --help)", add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    args_in = sys.argv[1:] if argv is None else argv
    if args_in[:1] == ["bench"]:
        from corral.bench import main as bench_main

        return bench_main(args_in[1:])
    parser = build_parser()
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
