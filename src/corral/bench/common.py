"""What every benchmark section shares: sizes of a run, statistics, tables, the machine, HTTP.

Figures are printed, not judged: a section returns a `Section` of tables, notes and goals
(met, missed, or not measured), and the caller prints it, writes JSON, or renders the docs.
"""

from __future__ import annotations

import contextlib
import http.client
import importlib.metadata
import math
import os
import platform
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import psutil

Say = Callable[[str], None]
MIB = 2**20
# The sampling seed and the short prompt of the benchmarks' requests.
SEED = 42
PROMPT_SHORT = "Hi"

# The scheduler's log lines for a load and an eviction. A load's pattern must not match the
# unload line ("unloading model 'x' (runner 3)" contains "loading model 'x' (runner 3)").
LOAD_LINE = re.compile(r"(?<!un)loading model '([^']+)' \(runner \d+\)")
EVICT_LINE = re.compile(r"unloading model '([^']+)' \(runner \d+\): evicted")


def logged_loads(log: str) -> list[str]:
    """The models a corral log says it loaded, in order, without ':latest'."""
    return [m.removesuffix(":latest") for m in LOAD_LINE.findall(log)]


# --------------------------------------------------------------------------- run sizes


@dataclass(frozen=True)
class Scale:
    """How big a run is. `smoke` is for CI (seconds, figures meaningless), `quick` takes a few
    minutes, `full` is what docs/benchmarks.md reports."""

    name: str
    # proxy overhead
    latency_reps: int  # measured request pairs per route and model
    stream_reps: int
    stream_tokens: int
    proxy_smollm2: bool  # also measure on the real SmolLM2 (besides the tiny synthetic model)
    load_seconds: float  # scheduler throughput: seconds of load per target
    load_clients: int
    core_cycles: int
    # cold start
    cold_reps: int
    cold_smollm2: bool
    cold_big_mb: int  # also a synthetic model of this size (0: none)
    # swap traces
    swap_sizes_mb: tuple[int, ...]  # chat models (synthetic llama GGUFs)
    swap_requests: int
    swap_seconds: float  # the trace is compressed to about this long
    swap_policies: tuple[str, ...] = ("lru", "ollama", "cost")


SCALES: dict[str, Scale] = {
    "smoke": Scale(
        name="smoke", latency_reps=6, stream_reps=2, stream_tokens=16, proxy_smollm2=False,
        load_seconds=0.6, load_clients=8, core_cycles=2000, cold_reps=1, cold_smollm2=False,
        cold_big_mb=0, swap_sizes_mb=(2, 3), swap_requests=12, swap_seconds=3.0,
        swap_policies=("lru",),
    ),
    "quick": Scale(
        name="quick", latency_reps=40, stream_reps=4, stream_tokens=100, proxy_smollm2=True,
        load_seconds=3.0, load_clients=32, core_cycles=20000, cold_reps=3, cold_smollm2=True,
        cold_big_mb=0, swap_sizes_mb=(4, 8, 16, 32, 64), swap_requests=120, swap_seconds=40.0,
    ),
    "full": Scale(
        name="full", latency_reps=200, stream_reps=10, stream_tokens=200, proxy_smollm2=True,
        load_seconds=10.0, load_clients=64, core_cycles=100000, cold_reps=7, cold_smollm2=True,
        cold_big_mb=256, swap_sizes_mb=(8, 16, 32, 64, 128, 256), swap_requests=300,
        swap_seconds=120.0,
    ),
}  # fmt: skip


# --------------------------------------------------------------------------- statistics


def percentile(xs: Sequence[float], p: float) -> float:
    """The p-th percentile (0-100), linear between closest ranks (numpy's default)."""
    if not xs:
        return math.nan
    s = sorted(xs)
    k = (len(s) - 1) * p / 100.0
    lo = math.floor(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def median(xs: Sequence[float]) -> float:
    return percentile(xs, 50)


def summary(xs: Sequence[float]) -> dict[str, float]:
    return {
        "n": len(xs),
        "p50": median(xs),
        "p95": percentile(xs, 95),
        "p99": percentile(xs, 99),
        "min": min(xs) if xs else math.nan,
        "max": max(xs) if xs else math.nan,
        "mean": sum(xs) / len(xs) if xs else math.nan,
    }


def ms(seconds: float, digits: int = 2) -> str:
    return "n/a" if math.isnan(seconds) else f"{seconds * 1e3:.{digits}f} ms"


def secs(seconds: float) -> str:
    return "n/a" if math.isnan(seconds) else f"{seconds:.2f} s"


def ratio(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{x:.3f}x"


def mib(n: float) -> str:
    return f"{n / MIB:.0f} MiB" if n >= 10 * MIB else f"{n / MIB:.1f} MiB"


def safe_div(a: float, b: float) -> float:
    return a / b if b else math.nan


# --------------------------------------------------------------------------- results


@dataclass
class Table:
    title: str
    headers: list[str]
    rows: list[list[str]] = field(default_factory=list)

    def add(self, *cells: object) -> None:
        self.rows.append([str(c) for c in cells])

    def text(self) -> str:
        widths = [len(h) for h in self.headers]
        for row in self.rows:
            widths = [max(w, len(c)) for w, c in zip(widths, row, strict=False)]

        def line(cells: Sequence[str]) -> str:
            return "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=False)).rstrip()

        out = [self.title, line(self.headers), line(["-" * w for w in widths])]
        out += [line(r) for r in self.rows]
        return "\n".join(out)

    def markdown(self) -> str:
        def esc(c: str) -> str:
            return c.replace("|", "\\|")

        out = [f"**{self.title}**", "", "| " + " | ".join(map(esc, self.headers)) + " |"]
        out.append("|" + "|".join("---" for _ in self.headers) + "|")
        out += ["| " + " | ".join(map(esc, r)) + " |" for r in self.rows]
        return "\n".join(out)


@dataclass
class Goal:
    goal: str  # what we aim for, e.g. "added latency at p50 < 1 ms (OpenAI chat, tiny)"
    measured: str
    met: bool | None  # None: not measured
    detail: str = ""  # e.g. "missed by 0.31 ms"

    def verdict(self) -> str:
        if self.met is None:
            return "not measured"
        return "met" if self.met else "MISSED"


@dataclass
class Section:
    name: str
    title: str
    tables: list[Table] = field(default_factory=list)
    blocks: list[tuple[str, str]] = field(default_factory=list)  # (title, preformatted text)
    notes: list[str] = field(default_factory=list)
    goals: list[Goal] = field(default_factory=list)
    summary: list[str] = field(default_factory=list)  # lines for "goals vs measured"
    data: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    error: str | None = None

    def text(self) -> str:
        out = [f"== {self.title} ({self.seconds:.0f} s) =="]
        if self.error:
            out.append(f"ERROR: {self.error}")
        for t in self.tables:
            out += ["", t.text()]
        for title, text in self.blocks:
            out += ["", title, text.rstrip()]
        if self.goals:
            out += ["", "goals:"]
            for g in self.goals:
                extra = f" ({g.detail})" if g.detail else ""
                out.append(f"  [{g.verdict()}] {g.goal}: {g.measured}{extra}")
        if self.summary:
            out += ["", "summary:", *(f"  {line}" for line in self.summary)]
        for n in self.notes:
            out += [f"note: {n}"]
        return "\n".join(out)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Section:
        """The section `to_json` wrote (its data too, as plain JSON)."""
        return cls(
            name=d["name"], title=d["title"],
            tables=[Table(t["title"], t["headers"], t["rows"]) for t in d.get("tables", [])],
            blocks=[(b["title"], b["text"]) for b in d.get("blocks", [])],
            notes=list(d.get("notes", [])),
            goals=[Goal(g["goal"], g["measured"], g["met"], g.get("detail", ""))
                   for g in d.get("goals", [])],
            summary=list(d.get("summary", [])), data=dict(d.get("data", {})),
            seconds=float(d.get("seconds", 0.0)), error=d.get("error"),
        )  # fmt: skip

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "title": self.title,
            "seconds": self.seconds,
            "error": self.error,
            "notes": self.notes,
            "goals": [asdict(g) | {"verdict": g.verdict()} for g in self.goals],
            "summary": self.summary,
            "tables": [asdict(t) for t in self.tables],
            "blocks": [{"title": t, "text": x} for t, x in self.blocks],
            "data": self.data,
        }


def goal_max(
    goal: str, value: float, limit: float, fmt: Callable[[float], str],
    gap: Callable[[float], str] | None = None,
) -> Goal:  # fmt: skip
    """A goal `value < limit`; the detail says by how much it is missed (`gap` formats that
    difference; default `fmt`)."""
    if math.isnan(value):
        return Goal(goal, "n/a", None)
    met = value < limit
    detail = "" if met else f"missed by {(gap or fmt)(value - limit)}"
    return Goal(goal, fmt(value), met, detail)


def goal_min(
    goal: str, value: float, floor: float, fmt: Callable[[float], str],
    gap: Callable[[float], str] | None = None,
) -> Goal:  # fmt: skip
    """A goal `value >= floor`."""
    if math.isnan(value):
        return Goal(goal, "n/a", None)
    met = value >= floor
    detail = "" if met else f"missed by {(gap or fmt)(floor - value)}"
    return Goal(goal, fmt(value), met, detail)


# --------------------------------------------------------------------------- the machine


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _os_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/etc/os-release").read_text().splitlines():
            if line.startswith("PRETTY_NAME="):
                return f"{line.split('=', 1)[1].strip(chr(34))} (kernel {platform.release()})"
    return platform.platform()


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _git_commit() -> str:
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(
            ["git", "describe", "--always", "--dirty"], cwd=here, capture_output=True,
            text=True, timeout=5, check=False,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() or "unknown"


def machine() -> dict[str, Any]:
    """Where the figures came from."""
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        usable = os.cpu_count() or 0
    import corral

    return {
        "cpu": _cpu_model(),
        "logical_cores": os.cpu_count(),
        "physical_cores": psutil.cpu_count(logical=False),
        "usable_cores": usable,
        "ram_bytes": psutil.virtual_memory().total,
        "os": _os_name(),
        "python": f"{platform.python_version()} ({platform.python_implementation()})",
        "xllamacpp": _version("xllamacpp"),
        "corral": f"{corral.__version__} (git {_git_commit()})",
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def machine_line(m: dict[str, Any]) -> str:
    return (
        f"{m['cpu']}, {m['usable_cores']} usable cores ({m['logical_cores']} logical), "
        f"{m['ram_bytes'] / 2**30:.0f} GiB RAM, {m['os']}, Python {m['python']}, "
        f"xllamacpp {m['xllamacpp']}, corral {m['corral']}"
    )


# --------------------------------------------------------------------------- HTTP with timing

# The start of a non-empty generated text in an SSE or NDJSON chunk (OpenAI delta content,
# llama.cpp /completion content, Ollama response or message content).
_TOKEN = re.compile(rb'"(?:content|response)":"(?:[^"\\]|\\.)')
# ... and in an Anthropic Messages stream: a text, thinking or tool-input delta.
ANTHROPIC_TOKEN = re.compile(rb'"(?:text|thinking|partial_json)":"(?:[^"\\]|\\.)')


@dataclass
class Timed:
    status: int
    body: bytes
    start: float  # time.perf_counter() when the request was sent
    first: float  # when the first generated text arrived (streams), else when headers did
    end: float  # when the body was complete

    @property
    def latency(self) -> float:
        return self.end - self.start

    @property
    def ttft(self) -> float:
        return self.first - self.start


class Http:
    """One HTTP/1.1 keep-alive connection, timed (synchronous: no event loop in the figures).

    Streamed responses are read as they arrive so time to first token is real; `close=True`
    sends `Connection: close` (what corral does for streams to llama.cpp, which drops the
    connection after a streamed response anyway)."""

    def __init__(self, url: str, timeout: float = 300.0) -> None:
        u = urlsplit(url)
        self.host = u.hostname or "127.0.0.1"
        self.port = u.port or 80
        self.timeout = timeout
        self.conn: http.client.HTTPConnection | None = None

    def _conn(self) -> http.client.HTTPConnection:
        if self.conn is None:
            self.conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        return self.conn

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    def post(
        self, path: str, body: bytes, *, close: bool = False, token: re.Pattern[bytes] = _TOKEN
    ) -> Timed:
        """`token`: what the first generated text looks like in the stream (its arrival is
        `Timed.first`)."""
        for attempt in (0, 1):
            try:
                return self._post(path, body, close, token)
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                # The server closed an idle keep-alive connection: retry once on a new one.
                self.close()
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def _post(self, path: str, body: bytes, close: bool, token: re.Pattern[bytes]) -> Timed:
        conn = self._conn()
        headers = {"Content-Type": "application/json"}
        if close:
            headers["Connection"] = "close"
        start = time.perf_counter()
        conn.request("POST", path, body, headers)
        resp = conn.getresponse()
        first = math.nan
        chunks: list[bytes] = []
        tail = b""
        while True:
            data = resp.read1(65536)
            if not data:
                break
            if math.isnan(first):
                window = tail + data
                if token.search(window):
                    first = time.perf_counter()
                tail = window[-64:]
            chunks.append(data)
        chunks.append(resp.read())  # b"", but marks the response done so the connection is reused
        end = time.perf_counter()
        if math.isnan(first):
            first = end
        if close or resp.will_close:
            self.close()
        return Timed(resp.status, b"".join(chunks), start, first, end)

    def get_json(self, path: str) -> Any:
        import orjson

        conn = self._conn()
        conn.request("GET", path)
        resp = conn.getresponse()
        data = resp.read()
        if resp.will_close:
            self.close()
        return orjson.loads(data)


def sse_objects(body: bytes) -> list[dict[str, Any]]:
    """The JSON objects of an SSE body (`data: {...}` lines; [DONE] skipped)."""
    import orjson

    out: list[dict[str, Any]] = []
    for line in body.splitlines():
        if line.startswith(b"data: ") and line[6:].strip() != b"[DONE]":
            with contextlib.suppress(orjson.JSONDecodeError):
                out.append(orjson.loads(line[6:]))
    return out


def ndjson_objects(body: bytes) -> list[dict[str, Any]]:
    import orjson

    return [orjson.loads(line) for line in body.splitlines() if line.strip()]


def completion_tokens(body: bytes) -> int:
    """Generated tokens of a streamed or whole OpenAI, llama.cpp or Ollama response."""
    import orjson

    objs: list[dict[str, Any]]
    if body.lstrip().startswith(b"data:"):
        objs = sse_objects(body)
    else:
        try:
            objs = [orjson.loads(body)]
        except orjson.JSONDecodeError:
            objs = ndjson_objects(body)
    for o in reversed(objs):
        usage = o.get("usage")
        if isinstance(usage, dict) and "completion_tokens" in usage:
            return int(usage["completion_tokens"])
        if "eval_count" in o:
            return int(o["eval_count"])
        timings = o.get("timings")
        if isinstance(timings, dict) and "predicted_n" in timings:
            return int(timings["predicted_n"])
    return 0


def runner_url(pid: int) -> str:
    """The loopback URL a runner process listens on (from its listening socket)."""
    proc = psutil.Process(pid)
    get = getattr(proc, "net_connections", None) or proc.connections
    for c in get(kind="tcp"):
        if c.status == psutil.CONN_LISTEN and c.laddr:
            host = c.laddr.ip if c.laddr.ip not in ("0.0.0.0", "::") else "127.0.0.1"
            return f"http://{host}:{c.laddr.port}"
    raise RuntimeError(f"runner pid {pid} listens on no TCP port")


def at_once(
    url: str, clients: int, work: Callable[[Http, int], list[Timed]]
) -> tuple[float, list[Timed]]:
    """`work(http, i)` in `clients` threads, each on a connection of its own to `url`, from a
    common start: the wall time from that start to the last one's end, and every response
    (the first error any of them raised is raised here)."""
    results: list[Timed] = []
    errors: list[BaseException] = []
    start = threading.Barrier(clients + 1)

    def client(i: int) -> None:
        http = Http(url)
        try:
            start.wait()
            results.extend(work(http, i))  # list.extend is atomic under the GIL
        except BaseException as e:  # raised in the caller
            errors.append(e)
        finally:
            http.close()

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return wall, results


def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}")


def python() -> str:
    return sys.executable


def interleave(n: int, variants: Sequence[str]) -> Iterable[tuple[int, str]]:
    """(repetition, variant) in an order that rotates which variant goes first, so neither
    side of a comparison always runs right after the other (caches, CPU frequency)."""
    k = len(variants)
    for i in range(n):
        for j in range(k):
            yield i, variants[(i + j) % k]


def jsonable(x: Any) -> Any:
    """Plain JSON data (NaN and infinities become null)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [jsonable(v) for v in x]
    if isinstance(x, str | int | float | bool) or x is None:
        return x
    if hasattr(x, "__dataclass_fields__"):
        from dataclasses import asdict

        return jsonable(asdict(x))
    return str(x)
