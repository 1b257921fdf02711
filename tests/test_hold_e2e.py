"""An agent's turn keeps its model, end to end with real runners: an answer that ends in a
tool call holds its model (CORRAL_TOOL_HOLD), so another model's load under memory pressure
takes another idle victim rather than the model the agent is about to come back to.

Three scripted models (tests/scripted.py: a tool call whenever tools are offered, a plain
reply otherwise) under a memory limit that holds two of them but not three, with the LRU policy
so that the victim without a hold is known. The load that waits for a held model when it is
the only victim, and its bound, are the core's (tests/test_hold.py, with the core's clock).
"""

from __future__ import annotations

from typing import Any

import httpx
import orjson
import pytest
from scripted import Script, write_scripted_model

from corral.core.drafting import DRAFTER
from corral.core.estimate import RUNNER_CODE_BYTES
from corral.core.gguf import read_model_info
from corral.core.spec import RunnerSpec, spec_estimate
from corral.testing.server import CorralServer

CTX = 2048
CALL = ("Bash", {"command": "ls"})
TOOL = {
    "type": "function",
    "function": {
        "name": "Bash", "description": "Run a shell command.",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}},
                       "required": ["command"]},
    },
}  # fmt: skip


@pytest.fixture(scope="module")
def server(start_server: Any, tmp_path_factory: pytest.TempPathFactory) -> CorralServer:
    models = tmp_path_factory.mktemp("hold")
    for m in ("x", "y", "z"):
        write_scripted_model(models / f"{m}.gguf", "qwen2.5", Script(call=CALL))
    path = models / "x.gguf"
    # a runner of the model's defaults: auto's drafter until it is judged
    est = spec_estimate(read_model_info(path), RunnerSpec(str(path), CTX, 1, speculative=DRAFTER))
    one = est.total + est.process
    # Two runners fit (their real allocations may be up to ~10% under the estimate, or
    # measured a little over it), three never do.
    limit = RUNNER_CODE_BYTES + int(2.5 * one)
    return start_server(
        models, CORRAL_MEMORY_LIMIT=str(limit), CORRAL_MEMORY_MARGIN="0",
        CORRAL_CONTEXT_LENGTH=str(CTX), CORRAL_EVICTION_POLICY="lru", CORRAL_TOOL_HOLD="10m",
        CORRAL_BUILTIN_MODELS="0",
    )  # fmt: skip


def loaded(s: CorralServer) -> dict[str, dict[str, Any]]:
    return {m["name"].removesuffix(":latest"): m for m in s.ps()}


def settled(s: CorralServer) -> dict[str, dict[str, Any]]:
    """/api/ps once every answer's lease is back and no runner is on its way out."""

    def idle() -> bool:
        return all(m["requests_in_flight"] == 0 and m["state"] == "ready" for m in s.ps())

    s.wait_for(idle, 60, "every runner idle")
    return loaded(s)


def chat(s: CorralServer, model: str, tools: bool = False, result: bool = False) -> dict[str, Any]:
    """A streamed OpenAI chat (the pass-through): a tool call if `tools`, else the reply; with
    `result`, the conversation holds the tool's result (the agent's next turn)."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": "List the files."}]
    if result:
        messages += [
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": "call_1", "type": "function",
                "function": {"name": "Bash", "arguments": '{"command": "ls"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "a.py"},
        ]  # fmt: skip
    body: dict[str, Any] = {"model": model, "messages": messages, "stream": True}
    if tools:
        body["tools"] = [TOOL]
    finish = None
    with httpx.stream("POST", f"{s.url}/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for choice in orjson.loads(line[6:]).get("choices") or ():
                    finish = choice.get("finish_reason") or finish
    return {"finish": finish}


def test_a_load_takes_another_victim_than_the_model_an_agent_comes_back_to(
    server: CorralServer,
) -> None:
    s = server
    chat(s, "x")
    chat(s, "y")
    # Without a hold, LRU evicts the least recently used model: x.
    chat(s, "z")
    assert set(settled(s)) == {"y", "z"}, "the limit should hold two models, not three"
    # x answers with a tool call (its load evicts y, the least recently used): x is held.
    assert chat(s, "x", tools=True)["finish"] == "tool_calls"
    ps = settled(s)
    assert set(ps) == {"z", "x"} and ps["x"]["held_for"] > 0 and ps["z"]["held_for"] == 0
    pid = ps["x"]["pid"]
    chat(s, "z")  # z is now the most recently used; x the least
    # y's load must evict one: LRU would take x, but the agent is coming back to x.
    chat(s, "y")
    ps = settled(s)
    assert set(ps) == {"x", "y"}, ps
    # The tool's result: the turn x was held for is served by the same runner, and ends the
    # hold (the answer is no tool call).
    assert chat(s, "x", tools=True, result=True)["finish"] == "stop"
    ps = settled(s)
    assert ps["x"]["pid"] == pid and ps["x"]["held_for"] == 0
