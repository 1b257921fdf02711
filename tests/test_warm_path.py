"""The modules a warm streamed chat crosses, from its route to the runner and back (issue 27:
the hop from a granted slot to the client has one design, not a module per feature).

A real server runs under a profile hook (tests/warm_path_server.py) that records which of
corral's modules each asyncio task enters; a warm streamed chat's request task must enter
exactly the modules listed here. A module added to the path, or taken off it, fails this test
until the list (and docs/architecture.md's flow) says so. The ASGI middlewares' modules, which
wrap every route before and after it, are not counted."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from corral.testing.server import CorralServer, start_corral

MIDDLEWARES = {"server", "logs", "api.guard", "api.activity", "api.metrics"}

# A warm streamed Ollama chat: the family (route and protocol, its chunks, the shared events
# and chat types, the service and the relay), the admission and the core's books, the hop's
# pipeline and its policies (on this CPU runner of several slots, the park step's and the copy
# step's: a short idle conversation is copied, not parked; a GPU's runner would not park), the
# runner's API.
OLLAMA_CHAT = {
    "api.families.ollama.routes", "api.families.ollama.protocol", "api.families.ollama.render",
    "api.common", "api.service", "api.chat", "api.events", "api.stream",
    "runtime.registry", "core.gguf", "core.roles", "runtime.admission", "core.spec",
    "runtime.scheduler", "core.books", "core.requests",
    "runtime.hop", "runtime.affinity", "runtime.parking", "runtime.kvcache", "runtime.slotcopy",
    "runtime.runner_api", "runtime.continuation", "runtime.meter",
}  # fmt: skip
# The same chat through OpenAI's API, whose stream is llama.cpp's own, relayed as it is (its
# error lines read as llama.cpp writes them)
OPENAI_CHAT = (
    OLLAMA_CHAT
    - {"api.families.ollama.routes", "api.families.ollama.protocol", "api.families.ollama.render",
       "api.events", "api.chat", "core.roles"}
) | {"api.families.openai.routes", "api.families.openai.protocol", "runtime.runner_errors"}


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory, models_dir: Path) -> Iterator[CorralServer]:
    tmp = tmp_path_factory.mktemp("warm-path")
    server = start_corral(
        models_dir, tmp / "server.log", {"CORRAL_TRACE_OUT": str(tmp / "trace.json")},
        command=(str(Path(__file__).with_name("warm_path_server.py")),),
    )  # fmt: skip
    try:
        yield server
    finally:
        server.stop()


def _request_modules(server: CorralServer, send: list[tuple[str, dict[str, object]]]) -> set[str]:
    """The modules the last of `send`'s requests entered (the earlier ones warm the model)."""
    for path, body in send:
        with server.client.stream("POST", path, json=body) as r:
            assert r.status_code == 200, r.read()
            for _ in r.iter_lines():
                pass
    out = Path(server.log_path.parent / "trace.json")
    out.unlink(missing_ok=True)
    server.proc.send_signal(signal.SIGUSR2)
    server.wait_for(out.exists, what="the trace")
    tasks = [t for t in json.loads(out.read_text()) if t["task"] == "RequestResponseCycle.run_asgi"]
    mods = {m.removeprefix("corral.") for m in tasks[-1]["modules"]}
    return mods - MIDDLEWARES


def test_a_warm_streamed_ollama_chat(traced: CorralServer) -> None:
    chat = {"model": "smollm2:135m", "messages": [{"role": "user", "content": "hi"}],
            "options": {"num_predict": 4}}  # fmt: skip
    later = {**chat, "messages": [{"role": "user", "content": "hello there"}]}
    mods = _request_modules(traced, [("/api/chat", chat), ("/api/chat", later)])
    assert mods == OLLAMA_CHAT, (sorted(mods - OLLAMA_CHAT), sorted(OLLAMA_CHAT - mods))
    assert len(mods) == 24


def test_a_warm_streamed_openai_chat(traced: CorralServer) -> None:
    chat = {"model": "smollm2:135m", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4, "stream": True}  # fmt: skip
    later = {**chat, "messages": [{"role": "user", "content": "hello again"}]}
    mods = _request_modules(traced, [("/v1/chat/completions", chat),
                                     ("/v1/chat/completions", later)])  # fmt: skip
    assert mods == OPENAI_CHAT, (sorted(mods - OPENAI_CHAT), sorted(OPENAI_CHAT - mods))
    assert len(mods) == 21


