"""The runner's HTTP API has one face: everything corral asks of a runner's llama.cpp server goes
through runtime/runner_api.RunnerAPI (as Ollama's LlamaServer). No other module of the product
imports an HTTP client for it, opens a runner stream, or reaches the API's session. (cluster/,
cli/ and bench/ talk HTTP to corral servers and nodes, never to a runner; testing/ drives
servers for the tests.)"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import corral

ROOT = Path(corral.__file__).parent
FACE = "runtime/runner_api.py"
# Packages whose HTTP goes to corral servers or nodes, not to runners.
OTHER_PEERS = ("cluster/", "cli/", "bench/", "testing/")


def _misuses(tree: ast.AST) -> Iterator[tuple[int, str]]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, a.name) for a in node.names if a.name.startswith("aiohttp"))
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module.startswith("aiohttp"):
                yield node.lineno, node.module
            elif node.module == "corral.runtime.runner_api":
                yield from ((node.lineno, a.name) for a in node.names if a.name == "open_stream")
        elif isinstance(node, ast.Attribute) and node.attr == "_session":
            yield node.lineno, "._session"


def test_only_the_runner_api_talks_http_to_a_runner() -> None:
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel == FACE or rel.startswith(OTHER_PEERS):
            continue
        found += [f"{rel}:{n}: {what}" for n, what in _misuses(ast.parse(path.read_text()))]
    assert not found, "\n".join(found)


def test_the_check_sees_a_second_way_to_a_runner() -> None:
    tree = ast.parse(
        "import aiohttp\n"
        "from corral.runtime.runner_api import open_stream, RunnerStream\n"
        "x = runner.api._session.get('/metrics')\n"
        "from corral.runtime.runner_api import RunnerAPI\n"
    )
    assert [what for _, what in sorted(_misuses(tree))] == ["aiohttp", "open_stream", "._session"]
