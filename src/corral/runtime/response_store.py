"""Stored OpenAI Responses (`store`, `previous_response_id`, `GET`/`DELETE /v1/responses/{id}`):
kept in memory, bounded by count, age and bytes, and journaled to a JSON-lines file under the
models directory's `.corral/` so that they outlive a restart.

A stored response holds the whole conversation it answered (its input items: the input and
output items of the response it continued, then its own) as references to that response's item
objects, so a long chain holds each item once. The journal writes each response's own items
with a link to the response it continued (`base`), so the file grows with the items too, not
with the square of the conversation's length; a response whose base is no longer kept is
written whole when the file is compacted (rewritten with only the responses kept). Deleting a
response compacts at once, so its items leave the disk, except as part of the conversations of
the responses that continued it (as OpenAI keeps them).

One process owns the file: two servers on one models directory each keep their own responses
(and may drop the other's on compaction). A journal that cannot be written leaves the store
in memory only, with one warning.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from corral.runtime.store import STORE_DIR

log = logging.getLogger(__name__)

MAX_RESPONSES = 1000  # the most responses kept; the oldest go first
MAX_AGE = 24 * 3600.0  # seconds a response is kept
# The most bytes of items kept, each response counted with its whole conversation (the items
# it shares with the response it continued count again): a bound on memory, not a measure.
MAX_BYTES = 256 * 2**20
FILE = "responses.jsonl"


def journal_path(models_dir: Path) -> Path:
    return models_dir / STORE_DIR / FILE


@dataclass(frozen=True)
class Stored:
    """One stored response and the conversation it answered. Never changed once stored: its
    dicts are shared with the responses that continue it."""

    id: str
    response: dict[str, Any]  # the response object, as the request returned it
    inputs: list[dict[str, Any]]  # the whole conversation before its output
    own: list[dict[str, Any]]  # the request's own input items (the tail of `inputs`)
    base: str | None  # the stored response it continued
    at: float  # when it was stored (wall clock)
    size: int  # bytes of its items and response as JSON, with its base's (the bytes bound)

    @property
    def output(self) -> list[dict[str, Any]]:
        out = self.response.get("output")
        return out if isinstance(out, list) else []

    def conversation(self) -> list[dict[str, Any]]:
        """The items a response continuing this one starts from."""
        return [*self.inputs, *self.output]


class ResponseStore:
    """Stored responses by id, oldest first; `path` None keeps them in memory only."""

    def __init__(
        self,
        path: Path | None,
        *,
        max_count: int = MAX_RESPONSES,
        max_age: float = MAX_AGE,
        max_bytes: int = MAX_BYTES,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.path = path
        self.max_count = max_count
        self.max_age = max_age
        self.max_bytes = max_bytes
        self.clock = clock
        self.records: OrderedDict[str, Stored] = OrderedDict()
        self.bytes = 0
        # The journal's lines and bytes: past twice the responses or the bytes bound, it is
        # compacted (responses dropped from memory leave it then).
        self.lines = 0
        self.file_bytes = 0
        if path is not None:
            self._load(path)

    def __len__(self) -> int:
        return len(self.records)

    def get(self, response_id: str) -> Stored | None:
        self._evict()
        return self.records.get(response_id)

    def put(
        self, response: dict[str, Any], own: list[dict[str, Any]], base: Stored | None = None
    ) -> Stored:
        """Keep `response`, which answered the conversation of `base` (if any) and `own`."""
        at = self.clock()
        rid = str(response["id"])
        line = _line(rid, at, base.id if base else None, own, response)
        inputs = [*base.inputs, *base.output, *own] if base else list(own)
        size = len(line) + (base.size if base else 0)
        rec = Stored(rid, response, inputs, list(own), base.id if base else None, at, size)
        if base is not None and base.id not in self.records:
            # Its base went meanwhile: the journal must hold this one whole.
            line = _line(rid, at, None, inputs, response)
        self._add(rec)
        self._append(line)
        self._evict()
        return rec

    def delete(self, response_id: str) -> bool:
        rec = self.records.pop(response_id, None)
        if rec is None:
            return False
        self.bytes -= rec.size
        self._compact()  # its items leave the disk now
        return True

    # ---- memory ----------------------------------------------------------------------------
    def _add(self, rec: Stored) -> None:
        old = self.records.pop(rec.id, None)
        if old is not None:
            self.bytes -= old.size
        self.records[rec.id] = rec
        self.bytes += rec.size

    def _evict(self) -> None:
        """The oldest go while too many, too old, or too large (the newest always stays)."""
        oldest = self.clock() - self.max_age
        while self.records:
            first = next(iter(self.records.values()))
            over = len(self.records) > self.max_count or (
                self.bytes > self.max_bytes and len(self.records) > 1
            )
            if not over and first.at >= oldest:
                break
            self.records.popitem(last=False)
            self.bytes -= first.size

    # ---- the journal -----------------------------------------------------------------------
    def _load(self, path: Path) -> None:
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return
        except OSError as e:
            self._lost(e)
            return
        skipped = 0
        self.file_bytes = len(data)
        for raw in data.splitlines():
            self.lines += 1
            try:
                d = orjson.loads(raw)
                base = self.records[d["base"]] if d.get("base") else None
                own = d["items"]
                response = d["response"]
                if not isinstance(own, list) or not isinstance(response, dict):
                    raise TypeError("not a stored response")
                rid, at = str(d["id"]), float(d["at"])
            except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
                skipped += 1  # a line cut short by a crash, or its base lost with one
                continue
            inputs = [*base.inputs, *base.output, *own] if base else own
            size = len(raw) + (base.size if base else 0)
            self._add(Stored(rid, response, inputs, own, base.id if base else None, at, size))
        if skipped:
            log.warning("%s: %d stored responses could not be read", path, skipped)
        self._evict()
        if self.lines > len(self.records):
            self._compact()

    def _append(self, line: bytes) -> None:
        if self.path is None:
            return
        if self.lines > 2 * len(self.records) + 100 or self.file_bytes > 2 * self.max_bytes:
            self._compact()  # writes the line's response too: it is kept already
            return
        try:
            _write(self.path, "ab", line + b"\n")
        except OSError as e:
            self._lost(e)
            return
        self.lines += 1
        self.file_bytes += len(line) + 1

    def _compact(self) -> None:
        """Rewrite the journal with the responses kept: each with its own items where its base
        is written before it, else whole."""
        if self.path is None:
            return
        written: set[str] = set()
        lines = []
        for rec in self.records.values():
            if rec.base is not None and rec.base in written:
                lines.append(_line(rec.id, rec.at, rec.base, rec.own, rec.response))
            else:
                lines.append(_line(rec.id, rec.at, None, rec.inputs, rec.response))
            written.add(rec.id)
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        data = b"".join(line + b"\n" for line in lines)
        try:
            _write(tmp, "wb", data)
            os.replace(tmp, self.path)
        except OSError as e:
            with contextlib.suppress(OSError):
                tmp.unlink()
            self._lost(e)
            return
        self.lines = len(lines)
        self.file_bytes = len(data)

    def _lost(self, e: OSError) -> None:
        log.warning("stored responses are kept in memory only: %s", e)
        self.path = None


def _write(path: Path, mode: str, data: bytes) -> None:
    """Write to a file only its owner may read: it holds conversations."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, mode, opener=lambda p, flags: os.open(p, flags, 0o600)) as f:
        f.write(data)


def _line(
    rid: str, at: float, base: str | None, items: list[dict[str, Any]], response: dict[str, Any]
) -> bytes:
    return orjson.dumps({"id": rid, "at": at, "base": base, "items": items, "response": response})
