"""Terminal output for the CLI: Ollama's formatting of sizes, times and tables (pure helpers)."""

from __future__ import annotations

import math
import re
import sys
from collections.abc import Sequence
from datetime import datetime, timedelta, timezone

from rich.console import Console
from rich.table import Table


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


def short_id(digest: object) -> str:
    """The ID column: the first 12 hex digits of a digest, with or without "sha256:"."""
    if not isinstance(digest, str):
        return ""
    return digest.removeprefix("sha256:")[:12]


def _number(value: object) -> str:
    """A JSON number as Go's FormatFloat(f, 'f', -1) shows it: no ".0" on whole numbers."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _head(text: str, n: int) -> list[str]:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return [*lines[:n], "..."] if len(lines) > n else lines


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
