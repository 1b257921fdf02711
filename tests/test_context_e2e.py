"""Prompts that never hit a wall, on real runners: a prompt longer than the loaded context
reloads the model with a larger one and succeeds, on every family's generating route; one
longer than the model's trained context gets a 400 in the family's shape with the prompt's
tokens and the limit; with CORRAL_CONTEXT_LENGTH=auto a model loads with the largest context
its memory allows."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from corral.core.drafting import DRAFTER
from corral.core.estimate import RUNNER_CODE_BYTES
from corral.core.gguf import read_model_info
from corral.core.spec import RunnerSpec, spec_estimate
from corral.testing.server import CorralServer

pytestmark = pytest.mark.e2e
StartServer = Callable[..., CorralServer]  # conftest's start_server

LONG = "long"  # trained for 32,768 tokens
TINY = "tiny"  # trained for 2,048
WORDS = "apple " * 700  # ~1,400 tokens: more than the server's 1,024, less than 2,048
TOO_LONG = "apple " * 1500  # ~3,000 tokens: more than tiny's 2,048


@pytest.fixture(scope="module")
def server(start_server: StartServer, models_dir: Path) -> CorralServer:
    # CORRAL_CONTEXT_LENGTH=1024 (start_server's): every model loads at 1,024 tokens
    return start_server(models_dir, CORRAL_NUM_PARALLEL="1")


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


# Each generating route: (path, body for a prompt on a model) and how its answer says it worked.
ROUTES: dict[str, Callable[[str, str], tuple[str, dict[str, Any]]]] = {
    "openai chat": lambda m, p: ("/v1/chat/completions",
                                 {"model": m, "messages": user(p), "max_tokens": 2}),
    "openai chat stream": lambda m, p: ("/v1/chat/completions", {
        "model": m, "messages": user(p), "max_tokens": 2, "stream": True}),
    "openai completions": lambda m, p: ("/v1/completions",
                                        {"model": m, "prompt": p, "max_tokens": 2}),
    "ollama chat": lambda m, p: ("/api/chat", {"model": m, "messages": user(p), "stream": False,
                                               "options": {"num_predict": 2}}),
    "ollama generate": lambda m, p: ("/api/generate", {
        "model": m, "prompt": p, "stream": False, "options": {"num_predict": 2}}),
    "ollama generate raw": lambda m, p: ("/api/generate", {
        "model": m, "prompt": p, "raw": True, "stream": False, "options": {"num_predict": 2}}),
    "anthropic": lambda m, p: ("/v1/messages",
                               {"model": m, "messages": user(p), "max_tokens": 2}),
    "responses": lambda m, p: ("/v1/responses",
                               {"model": m, "input": p, "max_output_tokens": 16}),
    "llama.cpp completion": lambda m, p: ("/completion",
                                          {"model": m, "prompt": p, "n_predict": 2}),
    # corral's own renderings: choices fanned out, legacy logprobs
    "openai chat n=2": lambda m, p: ("/v1/chat/completions",
                                     {"model": m, "messages": user(p), "max_tokens": 2, "n": 2}),
    "openai chat n=2 stream": lambda m, p: ("/v1/chat/completions", {
        "model": m, "messages": user(p), "max_tokens": 2, "n": 2, "stream": True}),
    "openai completions logprobs": lambda m, p: ("/v1/completions",
                                                 {"model": m, "prompt": p, "max_tokens": 2,
                                                  "logprobs": 1}),
}  # fmt: skip


def context_of(s: CorralServer, model: str) -> list[int]:
    return [m["context_length"] for m in s.ps() if m["name"].split(":")[0] == model]


def unload(s: CorralServer, model: str) -> None:
    s.client.post("/api/generate", json={"model": model, "keep_alive": 0})
    s.wait_for(lambda: not context_of(s, model), what=f"{model} to unload")


@pytest.mark.parametrize("route", list(ROUTES))
def test_a_prompt_longer_than_the_loaded_context_reloads_bigger_and_succeeds(
    server: CorralServer, route: str
) -> None:
    unload(server, LONG)
    path, body = ROUTES[route](LONG, "hi")
    r = server.client.post(path, json=body)
    assert r.status_code == 200, r.text
    assert context_of(server, LONG) == [1024]
    path, body = ROUTES[route](LONG, WORDS)
    r = server.client.post(path, json=body)
    assert r.status_code == 200, r.text
    if route == "openai chat":
        assert r.json()["usage"]["prompt_tokens"] > 1024
    # the next power of two that holds the prompt and its output (2,048), or with the output
    # a route leaves to the default, 4,096
    assert context_of(server, LONG)[-1] in (2048, 4096), server.ps()
    assert "at 1024: reloading it with a context of" in server.log()
    # the larger runner serves the next default request as it is: no reload back down
    path, body = ROUTES[route](LONG, "hi")
    assert server.client.post(path, json=body).status_code == 200
    assert context_of(server, LONG)[-1] in (2048, 4096)


def error_message(route: str, r: httpx.Response) -> str:
    data = r.json()
    if route.startswith("ollama"):
        return str(data["error"])
    if route == "anthropic":
        assert data["type"] == "error"
    return str(data["error"]["message"])


@pytest.mark.parametrize("route", list(ROUTES))
def test_a_prompt_longer_than_the_trained_context_is_a_400_with_the_numbers(
    server: CorralServer, route: str
) -> None:
    path, body = ROUTES[route](TINY, TOO_LONG)
    r = server.client.post(path, json=body)
    assert r.status_code == 400, r.text
    msg = error_message(route, r)
    assert re.search(r"the prompt is [23],\d\d\d tokens", msg), msg
    assert "'tiny' takes at most 2,048 (its trained context)" in msg, msg
    assert "shorten the prompt or use a model with a longer context" in msg, msg
    # and the model still serves
    path, body = ROUTES[route](TINY, "hi")
    assert server.client.post(path, json=body).status_code == 200


def test_auto_sizes_each_model_to_its_trained_context_where_memory_allows(
    start_server: StartServer, models_dir: Path
) -> None:
    s = start_server(models_dir, CORRAL_CONTEXT_LENGTH="auto", CORRAL_NUM_PARALLEL="1")
    for model, trained in ((LONG, 32768), (TINY, 2048)):
        r = s.client.post("/api/generate", json={"model": model, "prompt": "hi",
                                                 "stream": False, "options": {"num_predict": 1}})
        assert r.status_code == 200, r.text
        assert context_of(s, model) == [trained]
    # a client's own num_ctx still sets it
    r = s.client.post("/api/generate", json={"model": LONG, "prompt": "hi", "stream": False,
                                             "options": {"num_predict": 1, "num_ctx": 8192}})
    assert r.status_code == 200 and context_of(s, LONG) == [8192], r.text


def test_auto_gives_a_smaller_context_with_less_memory_but_never_below_the_floor(
    start_server: StartServer, models_dir: Path
) -> None:
    # Room for the long model's runner at 8,192 tokens, not at 16,384.
    info = read_model_info(models_dir / "long.gguf")

    def size(n_ctx: int) -> int:
        spec = RunnerSpec(str(models_dir / "long.gguf"), n_ctx, 1, speculative=DRAFTER)
        est = spec_estimate(info, spec)  # the model's defaults: auto's drafter, not judged yet
        return est.total + est.process

    limit = RUNNER_CODE_BYTES + (size(8192) + size(16384)) // 2
    s = start_server(models_dir, CORRAL_CONTEXT_LENGTH="auto", CORRAL_NUM_PARALLEL="1",
                     CORRAL_MEMORY_LIMIT=str(limit), CORRAL_MEMORY_MARGIN="0")  # fmt: skip
    r = s.client.post("/api/generate", json={"model": LONG, "prompt": "hi", "stream": False,
                                             "options": {"num_predict": 1}})  # fmt: skip
    assert r.status_code == 200, r.text
    (n_ctx,) = context_of(s, LONG)
    assert 4096 <= n_ctx < 32768 and n_ctx & (n_ctx - 1) == 0, n_ctx
    if not any(d != "cpu" for m in s.ps() for d in (x["id"] for x in m["devices"])):
        assert n_ctx == 8192  # on system memory, as the estimate books it
