"""Log output: plain lines for people, or one JSON object per line for log shippers
(CORRAL_LOG_FORMAT=json). A record logged with `extra={"fields": ...}` (a dict, or a function
that returns one: each request's line) has those fields as keys of its JSON object too.

`RING` keeps the last log lines in memory for the dashboard's log pane (pushed to the page as
`event: log` on /api/corral/events); `setup` installs it beside the output handler."""

from __future__ import annotations

import itertools
import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import orjson

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
LOG_KEEP = 1000  # lines the ring holds


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = getattr(record, "fields", None)  # a request's (api/activity.py): keys of its own
        if callable(fields):  # built only when a JSON line is written
            fields = fields()
        if isinstance(fields, dict):
            out.update((k, v) for k, v in fields.items() if k not in out)
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(out).decode()


@dataclass(frozen=True)
class Line:
    """One log line as the dashboard's log pane shows it."""

    id: int
    time: float  # seconds since the epoch
    level: str  # "info", "warning", ...
    logger: str
    message: str  # with its exception's traceback, if any

    def json(self) -> dict[str, Any]:
        return {"id": self.id, "time": round(self.time, 3), "level": self.level,
                "logger": self.logger, "message": self.message}  # fmt: skip


LineListener = Callable[[Line], None]


class LogRing(logging.Handler):
    """The last `keep` log lines (a ring); listeners hear each new one. `emit` runs under the
    handler's lock on whatever thread logged, so a listener must be quick, must not block and
    must not log (it would hear itself)."""

    def __init__(self, keep: int = LOG_KEEP) -> None:
        super().__init__(logging.NOTSET)
        self.lines: deque[Line] = deque(maxlen=keep)
        self._ids = itertools.count(1)
        self._listeners: tuple[LineListener, ...] = ()  # replaced whole: safe to iterate
        self._guard = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            # The output handler (installed first) has already formatted the message; reuse it.
            message = getattr(record, "message", None) or record.getMessage()
            if record.exc_info and not record.exc_text:
                record.exc_text = logging.Formatter().formatException(record.exc_info)
            if record.exc_text:
                message = f"{message}\n{record.exc_text}"
            line = Line(next(self._ids), record.created, record.levelname.lower(), record.name,
                        message)  # fmt: skip
            self.lines.append(line)
        except Exception:
            self.handleError(record)
            return
        for fn in self._listeners:
            try:
                fn(line)
            except Exception:  # said on stderr as logging does (logging it would recurse)
                self.handleError(record)

    def listen(self, fn: LineListener) -> Callable[[], None]:
        """Call fn with every line logged from now on; returns the function that stops it."""
        with self._guard:
            self._listeners = (*self._listeners, fn)

        def stop() -> None:
            with self._guard:
                self._listeners = tuple(f for f in self._listeners if f is not fn)

        return stop

    def recent(self, n: int = LOG_KEEP) -> list[Line]:
        """The last n lines, oldest first."""
        lines = list(self.lines)  # a copy first: another thread may append meanwhile
        return lines[-n:] if n > 0 else []


RING = LogRing()  # the server's log lines, for the dashboard


def keep_lines_of(logger: logging.Logger) -> None:
    """Also keep the lines of a logger that does not pass them to the root's handlers
    (uvicorn's, with its own log config)."""
    if not logger.propagate and RING not in logger.handlers:
        logger.addHandler(RING)


def setup(level: str, fmt: str) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    # the ring after the output: it reuses the message the output's formatter made
    logging.basicConfig(level=level.upper(), handlers=[handler, RING], force=True)
