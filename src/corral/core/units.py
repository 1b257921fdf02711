"""Durations and sizes as people write them ("5m", "1h30m", "512MiB"), parsed; pure, so that
both the settings (config.py) and core/ (device budgets) use them."""

from __future__ import annotations

import math
import re

FOREVER = math.inf  # keep-alive that never expires


class ConfigError(ValueError):
    """A setting or request field that cannot be parsed; the message names it."""


_DURATION_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")


def parse_duration(value: object, field: str = "duration") -> float:
    """Seconds from Go-style durations ("5m", "1h30m", "-1s"), numbers (seconds) or numeric strings.

    Negative values mean "forever" (returned as math.inf), as in Ollama's keep_alive.
    """
    if isinstance(value, bool):
        raise ConfigError(f"{field}: expected a duration like '5m' or a number of seconds")
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str):
        text = value.strip()
        try:
            seconds = float(text)
        except ValueError:
            sign = -1.0 if text.startswith("-") else 1.0
            body = text.lstrip("+-")
            pos, total = 0, 0.0
            for m in _DURATION_PART.finditer(body):
                if m.start() != pos:
                    break
                total += float(m.group(1)) * _DURATION_UNITS[m.group(2)]
                pos = m.end()
            if not body or pos != len(body):
                raise ConfigError(
                    f"{field}: invalid duration {value!r} (use e.g. '30s', '5m', '1h', or seconds)"
                ) from None
            seconds = sign * total
    else:
        raise ConfigError(f"{field}: expected a duration like '5m' or a number of seconds")
    if math.isnan(seconds):
        raise ConfigError(f"{field}: invalid duration {value!r}")
    return FOREVER if seconds < 0 else seconds


_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
    "t": 2**40,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")


def parse_size(value: object, field: str = "size") -> int:
    """Bytes from "512MiB", "2GiB", "500MB", "1.5G" (binary) or plain bytes."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    m = _SIZE.match(str(value)) if isinstance(value, str) else None
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise ConfigError(f"{field}: invalid size {value!r} (use e.g. '512MiB', '2GiB', '500MB')")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])


__all__ = ["FOREVER", "ConfigError", "parse_duration", "parse_size"]
