"""Every API family renders every event: a new event type in api/chat.py's `Event` fails the
type check in each renderer that does not handle it (each dispatches with one `match` ending in
`unhandled`), shown by type-checking a copy of corral with one event added."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import corral

RENDERERS = {
    "api/families/ollama/render.py",  # Ollama's NDJSON chunks
    "api/families/openai/render.py",  # OpenAI's chat completion chunks
    "api/families/anthropic/render.py",  # Anthropic's content-block events
    "api/families/responses/render.py",  # OpenAI Responses' output items and events
    "api/events.py",  # Generation.collect: a whole answer
}


def test_an_event_no_renderer_knows_fails_the_type_check_in_every_renderer(
    tmp_path: Path,
) -> None:
    copy = tmp_path / "corral"
    shutil.copytree(Path(corral.__file__).parent, copy,
                    ignore=shutil.ignore_patterns("__pycache__", "ui"))  # fmt: skip
    chat = copy / "api" / "chat.py"
    source = chat.read_text()
    union = "Event = Text | Thinking | ToolCall | Done\n"
    assert union in source
    chat.write_text(source.replace(union, (
        "@dataclass(frozen=True)\nclass Citation:\n    url: str\n\n\n"
        "Event = Text | Thinking | ToolCall | Done | Citation\n"
    )))  # fmt: skip
    out = subprocess.run(
        [sys.executable, "-m", "mypy", "--no-incremental", "--ignore-missing-imports",
         "--disallow-untyped-defs", "--python-version", "3.11", "--no-error-summary",
         "corral/api"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    unhandled = re.compile(r'^corral/(\S+?):\d+: error: .*"unhandled".*"Citation"', re.M)
    found = {m.group(1) for m in unhandled.finditer(out.stdout)}
    assert found == RENDERERS, out.stdout + out.stderr
