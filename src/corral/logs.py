"""Log output: plain lines for people, or one JSON object per line for log shippers
(CORRAL_LOG_FORMAT=json). A record logged with `extra={"fields": ...}` (a dict, or a function
that returns one: each request's line) has those fields as keys of its JSON object too."""

from __future__ import annotations

import logging
from datetime import datetime, timezone

import orjson

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


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


def setup(level: str, fmt: str) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
