"""What `corral run` streams with: tokens with word wrap, a spinner, the load's progress bar,
Ollama's --verbose stats."""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator, Mapping
from types import TracebackType
from typing import Any, TextIO
from urllib.parse import quote

from rich.cells import cell_len
from rich.console import Console
from rich.live import Live
from rich.progress import (
    BarColumn,
    Progress,
    SpinnerColumn,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
)
from rich.spinner import Spinner

from corral.cli.client import JSON, Client, CLIError, connect
from corral.cli.display import _int, _isatty, go_duration


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


def keep_alive_value(text: str) -> str | int | float:
    """--keepalive as Ollama's API takes it: numbers (seconds; negative = forever) stay numbers,
    since Go's duration parser rejects unitless strings like "-1"."""
    for kind in (int, float):
        with contextlib.suppress(ValueError):
            return kind(text)
    return text


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


class _LoadProgress:
    """While the model loads: a progress bar on stderr, fed by the server's state document
    (`GET /api/corral/state?model=`, the runner's share of the model in memory), polled from a
    second connection. A pulsing bar until the load reports progress (or on a server without
    the endpoint); off unless stderr is a terminal."""

    POLL = 0.25  # seconds between looks at the state

    def __init__(self, model: str, enabled: bool) -> None:
        self.model = model
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._bar: Progress | None = None
        if enabled:
            self._bar = Progress(
                SpinnerColumn(),
                TextColumn("{task.description}"),
                BarColumn(),
                TaskProgressColumn(),
                TimeElapsedColumn(),
                console=Console(stderr=True),
                transient=True,
            )

    def __enter__(self) -> _LoadProgress:
        if self._bar is not None:
            self._bar.start()
            self._thread = threading.Thread(target=self._follow, daemon=True)
            self._thread.start()
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2 * self.POLL + 1)
        if self._bar is not None:
            self._bar.stop()

    def _follow(self) -> None:
        assert self._bar is not None
        task = self._bar.add_task("", total=None)
        with contextlib.suppress(Exception), connect() as client:
            while not self._stop.wait(self.POLL):
                try:
                    state = client.get(f"/api/corral/state?model={quote(self.model)}")
                except CLIError:
                    return  # an older server, or it went away: the bar keeps pulsing
                model = next(iter(state.get("models") or []), None) or {}
                runner = model.get("runner") or {}
                progress = runner.get("progress")
                if model.get("state") == "loading" and isinstance(progress, (int, float)):
                    what = "warming up" if progress >= 0.99 else f"loading {model.get('name')}"
                    self._bar.update(task, description=what, total=100, completed=progress * 100)
                elif model.get("state") == "loading":
                    self._bar.update(task, description=f"loading {model.get('name')}")


def _read_stdin() -> str:
    try:
        return sys.stdin.read()
    except (OSError, ValueError):  # closed or unreadable stdin: no piped prompt
        return ""


def _ending_lines(chunks: Iterator[JSON], printer: TokenPrinter) -> Iterator[JSON]:
    """The chunks; an error that ends the stream first ends the answer's line, so that its
    message starts on a line of its own."""
    try:
        yield from chunks
    except CLIError:
        printer.end_line()
        raise


def stream_reply(
    client: Client, path: str, body: Mapping[str, Any], printer: TokenPrinter, spin: bool
) -> tuple[str, JSON | None]:
    """Stream a /api/generate or /api/chat reply to the printer; returns (text, final chunk)."""
    parts: list[str] = []
    final: JSON | None = None
    thinking = False
    with _Waiting(spin) as waiting, contextlib.closing(client.stream(path, body)) as chunks:
        for chunk in _ending_lines(chunks, printer):
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


def print_stats(final: JSON | None) -> None:
    for line in format_stats(final or {}):
        print(line, file=sys.stderr)


def load_model(client: Client, model: str, keep_alive: Any = None) -> None:
    """Load a model (a generate request without a prompt), with a progress bar on a terminal;
    CLIError (with the server's status) if it cannot be."""
    body: JSON = {"model": model}
    if keep_alive is not None:
        body["keep_alive"] = keep_alive
    with _LoadProgress(model, _isatty(sys.stderr)):
        for _ in client.stream("/api/generate", body):
            pass
