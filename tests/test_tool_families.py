"""Scripted models (tests/scripted.py) of every tool-calling family through every API
corral serves, streamed and not: the tool call each family writes in its native format is parsed
by the real llama.cpp from generated text (tool_choice auto) and reaches the client as that
API's tool call; the plain reply and the answer after a tool result come back as text. Plus the
writer itself, checked without llama.cpp by running the model's arithmetic in numpy."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import httpx
import numpy as np
import pytest
import scripted
from scripted import FAMILIES, MARKERS, Script, write_scripted_model

from corral.testing.server import CorralServer

CALL = ("Bash", {"command": "echo 'hi there' && ls -la"})
SCRIPT = Script(reply="Hello from corral.", call=CALL, answer="The tool printed hi.")
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"command": {"type": "string", "description": "The shell command to run"}},
    "required": ["command"],
}
DESCRIPTION = "Run a shell command and return its output."
# The tool as Ollama's and OpenAI's chat APIs take it.
CHAT_TOOL = {
    "type": "function",
    "function": {"name": "Bash", "description": DESCRIPTION, "parameters": SCHEMA},
}
# Arguments of several JSON types, a quoted and a multi-line string, an optional one left out.
TYPED_CALL = (
    "Edit",
    {"path": 'src/a "b".py', "text": "line 1\nline 2", "count": 3, "opts": {"dry": True}},
)
TYPED_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "path": {"type": "string"},
        "text": {"type": "string"},
        "count": {"type": "integer"},
        "opts": {"type": "object", "properties": {"dry": {"type": "boolean"}}},
        "backup": {"type": "boolean"},
    },
    "required": ["path", "text"],
}
# Families with tool calls: all but plain ChatML (SmolLM2's own template has no tools).
TOOL_FAMILIES = [f for f in FAMILIES if f != "chatml"]
APIS = ["ollama", "openai", "anthropic", "responses"]


# --------------------------------------------------------------------------- the writer


def _read(path: Path) -> tuple[gguf.GGUFReader, list[str]]:
    reader = gguf.GGUFReader(path)
    field_ = reader.get_field("tokenizer.ggml.tokens")
    assert field_ is not None
    return reader, [str(t) for t in field_.contents()]


def _tensor(reader: gguf.GGUFReader, name: str) -> np.ndarray:
    t = next(t for t in reader.tensors if t.name == name)
    return np.asarray(t.data, dtype=np.float32).reshape([int(d) for d in reversed(t.shape)])


def _greedy(reader: gguf.GGUFReader, prompt: list[int], n: int = 12) -> list[int]:
    """The model's own arithmetic (one layer, no feed-forward; RoPE left out: it barely turns)."""
    embd = _tensor(reader, "token_embd.weight")
    out = _tensor(reader, "output.weight")
    wq, wk, wv = (_tensor(reader, f"blk.0.attn_{x}.weight") for x in "qkv")
    wo = _tensor(reader, "blk.0.attn_output.weight")
    bq, bk, bv = (_tensor(reader, f"blk.0.attn_{x}.bias") for x in "qkv")

    def norm(x: np.ndarray) -> np.ndarray:
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-5)

    tokens = list(prompt)
    for _ in range(n):
        x = embd[tokens]
        h = norm(x)
        q, k, v = h @ wq.T + bq, h @ wk.T + bk, h @ wv.T + bv
        scores = q[-1] @ k.T / np.sqrt(x.shape[1])
        w = np.exp(scores - scores.max())
        last = x[-1] + wo @ (w / w.sum() @ v)
        nxt = int(np.argmax(out @ norm(last)))
        tokens.append(nxt)
        if nxt in _eog(reader):
            break
    return tokens[len(prompt) :]


def _eog(reader: gguf.GGUFReader) -> set[int]:
    keys = ("eos_token_id", "eot_token_id", "eom_token_id")
    return {int(f.contents()) for k in keys if (f := reader.get_field(f"tokenizer.ggml.{k}"))}


@pytest.mark.parametrize("family", FAMILIES)
def test_writer_chains(tmp_path: Path, family: str) -> None:
    path = write_scripted_model(tmp_path / "m.gguf", family, SCRIPT)
    assert path.stat().st_size < 4_000_000
    reader, tokens = _read(path)
    ids = {t: i for i, t in enumerate(tokens)}
    template = reader.get_field("tokenizer.chat_template")
    assert template is not None
    assert scripted.family_template(family) in str(template.contents())
    some_prompt = [ids["<|im_start|>"], 300, 400]  # any tokens, then where the marker is
    for branch, expected in [("reply", SCRIPT.reply), ("answer", SCRIPT.answer)]:
        for prompt in ([*some_prompt, ids[MARKERS[branch]]], [ids[MARKERS[branch]], *some_prompt]):
            out = _greedy(reader, prompt)
            assert out[-1] in _eog(reader) or tokens[out[-1]] in ("<|user|>", "<|return|>")
            assert expected in "".join(tokens[t] for t in out[:-1])
    # No marker at all: the reply.
    assert SCRIPT.reply in "".join(tokens[t] for t in _greedy(reader, some_prompt)[:-1])
    if family != "chatml":
        out = _greedy(reader, [*some_prompt, ids[MARKERS["call"]]])
        text = "".join(tokens[t] for t in out)
        assert CALL[0] in text and "echo 'hi there'" in text


def test_writer_rejects() -> None:
    with pytest.raises(ValueError, match="unknown family"):
        write_scripted_model(Path("/nonexistent/m.gguf"), "gpt-5")
    # A reply whose text is a token of the call would need two successors: refused.
    with pytest.raises(ValueError, match="repeats the token"):
        write_scripted_model(
            Path("/nonexistent/m.gguf"), "qwen2.5", Script(reply="<tool_call>", call=CALL)
        )


def test_templates_are_the_families() -> None:
    # llama.cpp picks its parser from the template source: the markers of each format are there.
    signs = {
        "qwen2.5": '<tool_call>\\n{\\"name\\": <function-name>',
        "qwen3": "<think>",
        "qwen3-coder": "<function=",
        "llama3": '"parameters": ',
        "mistral": "[TOOL_CALLS]",
        "gpt-oss": "<|channel|>",
        "hermes": "<tool_call>",
        "glm": "<arg_key>",
    }
    for family, sign in signs.items():
        assert sign in scripted.family_template(family), family


# --------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def families_server(start_server: Any, tmp_path_factory: pytest.TempPathFactory) -> CorralServer:
    models = tmp_path_factory.mktemp("scripted")
    for family in FAMILIES:
        write_scripted_model(models / f"{family}.gguf", family, SCRIPT)
        write_scripted_model(models / f"{family}-typed.gguf", family, Script(call=TYPED_CALL))
    write_scripted_model(models / "nocall.gguf", "qwen2.5", Script(reply="No tools needed."))
    # Devstral's default system prompt alone is ~1,600 tokens of SmolLM2's cut vocabulary.
    return start_server(models, CORRAL_CONTEXT_LENGTH="4096")


@pytest.fixture(scope="module")
def http(families_server: CorralServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=families_server.url, timeout=120) as client:
        yield client


@dataclass
class Answer:
    text: str = ""
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    stop: str | None = None


def _sse(response: httpx.Response) -> Iterator[dict[str, Any]]:
    assert response.status_code == 200, response.read()
    for line in response.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[6:])


def _ollama(
    http: httpx.Client, model: str, messages: list[Any], tools: bool, stream: bool
) -> Answer:
    body: dict[str, Any] = {"model": model, "messages": messages, "stream": stream}
    if tools:
        body["tools"] = [CHAT_TOOL]
    answer = Answer()
    with http.stream("POST", "/api/chat", json=body) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line:
                continue
            chunk = json.loads(line)
            assert "error" not in chunk, chunk
            msg = chunk.get("message", {})
            answer.text += msg.get("content", "")
            for call in msg.get("tool_calls") or []:
                assert isinstance(call["function"]["arguments"], dict)  # objects, not strings
                answer.calls.append((call["function"]["name"], call["function"]["arguments"]))
            if chunk.get("done"):
                answer.stop = chunk.get("done_reason")
    return answer


def _openai(
    http: httpx.Client, model: str, messages: list[Any], tools: bool, stream: bool
) -> Answer:
    body: dict[str, Any] = {"model": model, "messages": messages, "stream": stream}
    if tools:
        body["tools"] = [CHAT_TOOL]
    answer = Answer()
    if not stream:
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        answer.text = choice["message"].get("content") or ""
        for call in choice["message"].get("tool_calls") or []:
            assert call["type"] == "function" and call["id"]
            answer.calls.append(
                (call["function"]["name"], json.loads(call["function"]["arguments"]))
            )
        answer.stop = choice["finish_reason"]
        return answer
    parts: dict[int, dict[str, str]] = {}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        for chunk in _sse(r):
            for choice in chunk.get("choices", []):
                delta = choice.get("delta", {})
                answer.text += delta.get("content") or ""
                for call in delta.get("tool_calls") or []:
                    part = parts.setdefault(call["index"], {"name": "", "arguments": ""})
                    fn = call.get("function", {})
                    part["name"] += fn.get("name") or ""
                    part["arguments"] += fn.get("arguments") or ""
                answer.stop = choice.get("finish_reason") or answer.stop
    answer.calls = [(p["name"], json.loads(p["arguments"])) for _, p in sorted(parts.items())]
    return answer


def _anthropic(
    http: httpx.Client, model: str, messages: list[Any], tools: bool, stream: bool
) -> Answer:
    body: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": 256}
    body["stream"] = stream
    if tools:
        body["tools"] = [{"name": "Bash", "description": DESCRIPTION, "input_schema": SCHEMA}]
    headers = {"anthropic-version": "2023-06-01", "x-api-key": "x"}
    answer = Answer()
    if not stream:
        r = http.post("/v1/messages", json=body, headers=headers)
        assert r.status_code == 200, r.text
        for block in r.json()["content"]:
            if block["type"] == "text":
                answer.text += block["text"]
            elif block["type"] == "tool_use":
                assert block["id"]
                answer.calls.append((block["name"], block["input"]))
        answer.stop = r.json()["stop_reason"]
        return answer
    blocks: dict[int, dict[str, Any]] = {}
    with http.stream("POST", "/v1/messages", json=body, headers=headers) as r:
        for event in _sse(r):
            kind = event["type"]
            if kind == "content_block_start":
                blocks[event["index"]] = {**event["content_block"], "json": ""}
            elif kind == "content_block_delta":
                delta, block = event["delta"], blocks[event["index"]]
                if delta["type"] == "text_delta":
                    answer.text += delta["text"]
                elif delta["type"] == "input_json_delta":
                    block["json"] += delta["partial_json"]
            elif kind == "message_delta":
                answer.stop = event["delta"].get("stop_reason")
            assert kind != "error", event
    for _, block in sorted(blocks.items()):
        if block["type"] == "tool_use":
            answer.calls.append((block["name"], json.loads(block["json"] or "{}")))
    return answer


def _responses(
    http: httpx.Client, model: str, messages: list[Any], tools: bool, stream: bool
) -> Answer:
    body: dict[str, Any] = {"model": model, "input": messages, "stream": stream}
    if tools:
        body["tools"] = [
            {"type": "function", "name": "Bash", "description": DESCRIPTION, "parameters": SCHEMA}
        ]
    if not stream:
        r = http.post("/v1/responses", json=body)
        assert r.status_code == 200, r.text
        response = r.json()
    else:
        response, added = {}, []
        with http.stream("POST", "/v1/responses", json=body) as r:
            for event in _sse(r):
                assert event["type"] not in ("error", "response.failed"), event
                if event["type"] == "response.output_item.added":
                    added.append(event["item"]["type"])
                if event["type"] == "response.completed":
                    response = event["response"]
        assert added == [item["type"] for item in response["output"]]
    answer = Answer(stop=response["status"])
    for item in response["output"]:
        if item["type"] == "message":
            answer.text += "".join(c["text"] for c in item["content"] if c["type"] == "output_text")
        elif item["type"] == "function_call":
            assert item["call_id"]
            answer.calls.append((item["name"], json.loads(item["arguments"])))
    return answer


CLIENTS = {"ollama": _ollama, "openai": _openai, "anthropic": _anthropic, "responses": _responses}
USER = "List the files, please."


def _after_tool(api: str) -> list[Any]:
    """The conversation after the scripted call ran: each API's own tool-result shape."""
    name, args = CALL
    if api == "ollama":
        return [
            {"role": "user", "content": USER},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"function": {"name": name, "arguments": args}}],
            },
            {"role": "tool", "content": "hi there\n", "tool_name": name},
        ]
    if api == "openai":
        return [
            {"role": "user", "content": USER},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": name, "arguments": json.dumps(args)},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "hi there\n"},
        ]
    if api == "anthropic":
        return [
            {"role": "user", "content": USER},
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "toolu_1", "name": name, "input": args}],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "hi there\n"}
                ],
            },
        ]
    return [
        {"role": "user", "content": USER},
        {"type": "function_call", "call_id": "call_1", "name": name, "arguments": json.dumps(args)},
        {"type": "function_call_output", "call_id": "call_1", "output": "hi there\n"},
    ]


CALL_STOP = {
    "ollama": "stop",
    "openai": "tool_calls",
    "anthropic": "tool_use",
    "responses": "completed",
}
TEXT_STOP = {"ollama": "stop", "openai": "stop", "anthropic": "end_turn", "responses": "completed"}


def _cases(families: Sequence[str]) -> list[Any]:
    """Every (family, api) pair."""
    return [pytest.param(f, api, id=f"{f}-{api}") for f in families for api in APIS]


def _held_for(server: CorralServer, model: str) -> float:
    """Seconds /api/ps says `model` is held for an agent's turn, once its answer's lease is
    back (released just after the client has the answer)."""

    def idle() -> dict[str, Any] | None:
        for m in server.ps():
            if m["name"].removesuffix(":latest") == model and m["requests_in_flight"] == 0:
                return m
        return None

    server.wait_for(lambda: idle() is not None, 30, f"{model} idle")
    m = idle()
    assert m is not None
    return float(m["held_for"])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize(("family", "api"), _cases(TOOL_FAMILIES))
def test_auto_tool_call(
    http: httpx.Client, families_server: CorralServer, family: str, api: str, stream: bool
) -> None:
    answer = CLIENTS[api](http, family, [{"role": "user", "content": USER}], True, stream)
    assert answer.calls == [CALL], answer
    assert answer.text.strip() == ""
    assert answer.stop == CALL_STOP[api]
    # The agent will be back with the tool's result: every API holds the model for it.
    assert _held_for(families_server, family) > 0


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_several_choices_ending_in_tool_calls_hold_the_model(
    http: httpx.Client, families_server: CorralServer, stream: bool
) -> None:
    """OpenAI's n > 1 (each choice a generation of its own) holds the model as one does."""
    family = TOOL_FAMILIES[0]
    body = {"model": family, "messages": [{"role": "user", "content": USER}], "n": 2,
            "tools": [CHAT_TOOL], "stream": stream}  # fmt: skip
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    if stream:
        reasons = [c["finish_reason"] for line in r.text.splitlines()
                   if line.startswith("data: {") for c in json.loads(line[6:])["choices"]
                   if c.get("finish_reason")]  # fmt: skip
    else:
        reasons = [c["finish_reason"] for c in r.json()["choices"]]
    assert reasons == ["tool_calls", "tool_calls"]
    assert _held_for(families_server, family) > 0


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize(("family", "api"), _cases(FAMILIES))
def test_reply_without_tools(
    http: httpx.Client, families_server: CorralServer, family: str, api: str, stream: bool
) -> None:
    answer = CLIENTS[api](http, family, [{"role": "user", "content": USER}], False, stream)
    assert (answer.text, answer.calls, answer.stop) == (SCRIPT.reply, [], TEXT_STOP[api])
    assert _held_for(families_server, family) == 0  # a hold from an earlier call ends too


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize(("family", "api"), _cases(FAMILIES))
def test_answer_after_tool_result(http: httpx.Client, family: str, api: str, stream: bool) -> None:
    tools = family != "chatml"
    answer = CLIENTS[api](http, family, _after_tool(api), tools, stream)
    assert (answer.text, answer.calls, answer.stop) == (SCRIPT.answer, [], TEXT_STOP[api])


@pytest.mark.parametrize("family", TOOL_FAMILIES)
def test_typed_arguments(http: httpx.Client, family: str) -> None:
    tools = [{"type": "function", "function": {"name": "Edit", "parameters": TYPED_SCHEMA}}]
    body = {"model": f"{family}-typed", "messages": [{"role": "user", "content": USER}]}
    r = http.post("/v1/chat/completions", json={**body, "tools": tools})
    assert r.status_code == 200, r.text
    (call,) = r.json()["choices"][0]["message"]["tool_calls"]
    assert (call["function"]["name"], json.loads(call["function"]["arguments"])) == TYPED_CALL


def test_no_call_scripted_replies_with_tools(http: httpx.Client) -> None:
    # A script without a call replies even when tools are offered.
    messages = [{"role": "user", "content": USER}]
    answer = _openai(http, "nocall", messages, tools=True, stream=False)
    assert (answer.text, answer.calls, answer.stop) == ("No tools needed.", [], "stop")
