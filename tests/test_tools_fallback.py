"""Tools on a model whose chat template has none (corral.api.toolprompt): the tools shown in the
system prompt, a lazy grammar from the `<tool_call>` trigger on, the calls parsed out of the text.

The pure parts (prompt, grammar, scanner, the events of a fake stream) are tested on their own;
the real server (the built-in SmolLM2, whose template knows no tools) takes tools in every API
family, and calls a tool when a few-shot history makes it start with the trigger (greedy, so
the same every run)."""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, cast

import orjson
import pytest

from corral.api.chat import Done, Text, ToolCall
from corral.api.events import FallbackEvents
from corral.api.toolprompt import (
    CLOSE,
    TRIGGER,
    Call,
    CallScanner,
    call_grammar,
    fallback_grammar,
    fallback_messages,
    instructions,
    lit,
    parse_call,
    template_body,
)
from corral.core.gguf import model_capabilities, template_has_tools
from corral.runtime.hop import Lease
from corral.runtime.runner_api import RunnerStream
from corral.testing import synth
from corral.testing.server import CorralServer

SMOL = "smollm2:135m"
PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city"],
}
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Current weather in a city",
                 "parameters": PARAMS},
}  # fmt: skip
NAMES = frozenset({"get_weather"})
# A history that makes SmolLM2 answer the next question with a call (greedy).
FEW_SHOT: list[dict[str, Any]] = [
    {"role": "user", "content": "What is the weather in Rome?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
    {"role": "user", "content": "What is the weather in Paris?"},
]  # fmt: skip
GREEDY = {"temperature": 0, "seed": 1}


# ---- the prompt ------------------------------------------------------------------------------


def test_instructions_list_the_tools_and_the_call_format() -> None:
    text = instructions([WEATHER])
    assert orjson.dumps(WEATHER).decode() in text
    how = f'{TRIGGER}\n{{"name": <function-name>, "arguments": <args-json-object>}}\n{CLOSE}'
    assert how in text


def test_fallback_messages_add_the_tools_to_the_system_prompt() -> None:
    out = fallback_messages([{"role": "user", "content": "hi"}], [WEATHER])
    assert out[0]["role"] == "system" and "get_weather" in out[0]["content"]
    assert out[1] == {"role": "user", "content": "hi"}
    system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    out = fallback_messages(system, [WEATHER])
    assert len(out) == 2 and out[0]["content"].startswith("Be brief.\n\n# Tools")
    assert system[0]["content"] == "Be brief."  # the request's own messages are not changed
    parts = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]}]
    out = fallback_messages(parts, [WEATHER])
    assert out[0]["content"][0]["text"] == "Be brief." and "# Tools" in out[0]["content"][1]["text"]


def test_fallback_messages_turn_calls_and_results_into_text() -> None:
    history: list[dict[str, Any]] = [
        {"role": "user", "content": "Weather in Rome and Oslo?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}},
            {"id": "c2", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}},
        ]},
        {"role": "tool", "tool_call_id": "c1", "content": "21 C"},
        {"role": "tool", "tool_call_id": "c2", "content": [{"type": "text", "text": "3 C"}]},
        {"role": "assistant", "content": "Rome 21 C, Oslo 3 C."},
    ]  # fmt: skip
    out = fallback_messages(history, [])
    assert [m["role"] for m in out] == ["user", "assistant", "user", "assistant"]
    assert "tool_calls" not in out[1]
    assert out[1]["content"] == (
        f'Let me look.\n{TRIGGER}\n{{"name":"get_weather","arguments":{{"city":"Rome"}}}}\n{CLOSE}'
        f'\n{TRIGGER}\n{{"name":"get_weather","arguments":{{"city":"Oslo"}}}}\n{CLOSE}'
    )
    assert out[2]["content"] == (
        "<tool_response>\n21 C\n</tool_response>\n<tool_response>\n3 C\n</tool_response>"
    )


def test_template_body_keeps_native_templates_as_they_are() -> None:
    from corral.api.chat import Chat

    chat = Chat([{"role": "user", "content": "hi"}], [WEATHER])
    assert template_body(chat, False, None) == {"messages": chat.messages, "tools": [WEATHER]}
    none = Chat(chat.messages, [WEATHER], "none")
    assert template_body(none, False, None) == {"messages": chat.messages}
    body = template_body(chat, True, None)
    assert "tools" not in body and "get_weather" in body["messages"][0]["content"]


def test_every_chat_model_has_tools_and_only_tool_templates_are_native() -> None:
    assert model_capabilities("llama", None, None) == ("completion", "tools")
    assert model_capabilities("bert", None, None) == ("embedding",)
    assert template_has_tools(synth.TOOLS_TEMPLATE)
    assert not template_has_tools("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert not template_has_tools(None)


# ---- the grammar ---------------------------------------------------------------------------


def test_lit_escapes_what_gbnf_reads_specially() -> None:
    assert lit('a"b\\c\n\t\x01') == '"a\\"b\\\\c\\n\\t\\x01"'


def test_grammar_follows_the_schema() -> None:
    nested = {
        "type": "function",
        "function": {"name": "plan", "parameters": {
            "type": "object",
            "properties": {
                "steps": {"type": "array", "items": {"$ref": "#/$defs/step"}},
                "dry": {"type": ["boolean", "null"]},
                "n": {"type": "integer"},
            },
            "$defs": {"step": {"type": "object", "properties": {"cmd": {"type": "string"}},
                               "required": ["cmd"]}},
        }},
    }  # fmt: skip
    g = call_grammar([WEATHER, nested, {"type": "function", "function": {"name": "ping"}}])
    rules = dict(line.split(" ::= ", 1) for line in g.strip().splitlines())
    assert rules["root"].startswith(f"{lit(TRIGGER)} ws (") and rules["root"].endswith(lit(CLOSE))
    assert '"\\"get_weather\\""' in g and '"\\"plan\\""' in g and '"\\"ping\\""' in g
    assert '( "\\"celsius\\"" | "\\"fahrenheit\\"" )' in g  # the enum
    assert '"\\"cmd\\"" ws ":" ws string' in g  # the $ref followed
    assert "( boolean | null )" in g  # a type list
    # No required properties: any of them may come first, each at most once, in order.
    plan = next(v for k, v in rules.items() if k.startswith("args1") and "steps" in v
                and "|" in v)  # fmt: skip
    assert plan.startswith('"{" ws ( "\\"steps\\""')
    assert ' | "\\"dry\\""' in plan and ' | "\\"n\\""' in plan
    # A tool without parameters takes any object.
    assert rules["call2"].endswith('ws ":" ws object ws "}"')
    # Every rule used is defined.
    for body in rules.values():
        bare = re.sub(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]', " ", body)
        for name in re.findall(r"[a-z][a-z0-9-]*", bare):
            assert name in rules, name


def test_fallback_grammar_is_lazy_on_the_trigger() -> None:
    fields = fallback_grammar([WEATHER])
    assert fields["grammar_lazy"] is True
    assert fields["grammar_triggers"] == [{"type": 1, "value": TRIGGER}]
    assert fields["preserved_tokens"] == [TRIGGER, CLOSE]  # needed where they are one token


# ---- the parser ----------------------------------------------------------------------------


def feed_all(scan: CallScanner, pieces: list[str]) -> list[str | Call]:
    out: list[str | Call] = []
    for piece in pieces:
        out += scan.feed(piece)
    out += scan.finish()
    # adjacent text pieces joined, so results compare whatever the split
    joined: list[str | Call] = []
    for p in out:
        last = joined[-1] if joined else None
        if isinstance(p, str) and isinstance(last, str):
            joined[-1] = last + p
        else:
            joined.append(p)
    return joined


CALL_TEXT = f'{TRIGGER}\n{{"name": "get_weather", "arguments": {{"city": "Paris"}}}}\n{CLOSE}'
PARIS = Call("get_weather", '{"city":"Paris"}')


def test_call_found_in_text() -> None:
    assert feed_all(CallScanner(NAMES), [CALL_TEXT]) == [PARIS]


def test_text_before_the_call_goes_on_first() -> None:
    scan = CallScanner(NAMES)
    assert scan.feed("Let me check. ") == ["Let me check."]
    assert scan.feed(CALL_TEXT + "\n") == [PARIS]
    assert scan.finish() == []  # the whitespace after the call is not an answer


def test_streamed_call_split_across_chunks() -> None:
    text = "Sure." + "\n" + CALL_TEXT
    for size in (1, 2, 3, 7):
        scan = CallScanner(NAMES)
        chunks = [text[i : i + size] for i in range(0, len(text), size)]
        outs = [scan.feed(c) for c in chunks]
        # nothing of the call goes out before its block closes
        assert all(not isinstance(p, str) or TRIGGER[:2] not in p for o in outs for p in o)
        assert feed_all(CallScanner(NAMES), chunks) == ["Sure.", PARIS]


def test_text_that_only_looks_like_a_trigger_stays_text() -> None:
    scan = CallScanner(NAMES)
    assert scan.feed("a <tool") == ["a"]  # held: may be the trigger
    assert scan.feed("s> b") == [" <tools> b"]
    assert scan.finish() == []


def test_malformed_call_stays_text() -> None:
    bad = f'{TRIGGER}{{"name": "get_weather", "arguments": {{"city": }}{CLOSE}'
    assert feed_all(CallScanner(NAMES), ["x ", bad, " y"]) == [f"x {bad} y"]
    unknown = f'{TRIGGER}{{"name": "launch", "arguments": {{}}}}{CLOSE}'
    assert feed_all(CallScanner(NAMES), [unknown]) == [unknown]
    assert feed_all(CallScanner(NAMES), [f'{TRIGGER}{{"name": "get_we']) == [
        f'{TRIGGER}{{"name": "get_we'
    ]  # cut short: the text it was


def test_unclosed_call_with_whole_json_counts() -> None:
    text = f'{TRIGGER}{{"name": "get_weather", "parameters": "{{\\"city\\": \\"Paris\\"}}"}}'
    assert feed_all(CallScanner(NAMES), [text]) == [PARIS]


def test_two_calls_and_text_after() -> None:
    out = feed_all(CallScanner(NAMES), [CALL_TEXT, "\n", CALL_TEXT, "\nDone."])
    assert out == [PARIS, PARIS, "Done."]


def test_parse_call_shapes() -> None:
    assert parse_call('{"name": "f"}') == Call("f", "{}")
    assert parse_call('{"name": "f", "arguments": [1]}') is None
    assert parse_call('["f"]') is None
    assert parse_call('{"name": "", "arguments": {}}') is None


# ---- the events of a fallback generation -----------------------------------------------------


class FakeStream:
    """A runner's /completion SSE stream, in the reads given."""

    def __init__(self, reads: list[bytes]) -> None:
        self.reads = list(reads)

    async def read(self) -> bytes:
        return self.reads.pop(0) if self.reads else b""

    def close(self) -> None:
        pass


class FakeLease:
    tally = None

    def release(self) -> None:
        pass


def sse(*contents: str, end: dict[str, Any] | None = None) -> bytes:
    lines = [b"data: " + orjson.dumps({"content": c, "stop": False}) + b"\n\n" for c in contents]
    if end is not None:
        lines.append(b"data: " + orjson.dumps({"content": "", "stop": True, **end}) + b"\n\n")
    return b"".join(lines)


async def events_of(reads: list[bytes]) -> list[Any]:
    async def explain() -> str:
        return "gone"

    explainer: Callable[[], Awaitable[str]] = explain
    lease, upstream = cast(Lease, FakeLease()), cast(RunnerStream, FakeStream(reads))
    gen = FallbackEvents(lease, upstream, [], explainer, tools=NAMES)
    return [ev async for ev in gen.events()]


END = {"stop_type": "eos", "timings": {"prompt_n": 10, "predicted_n": 20}}


async def test_fallback_events_stream_text_then_the_call() -> None:
    pieces = ["I will", " check.\n", "<tool", "_call>\n{\"name\": \"get_", "weather\", ",
              '"arguments": {"city": "Paris"}}\n</tool', "_call>"]  # fmt: skip
    evs = await events_of([sse(*pieces[:3]), sse(*pieces[3:], end=END)])
    assert [e for e in evs if isinstance(e, Text)] == [Text("I will"), Text(" check.")]
    calls = [e for e in evs if isinstance(e, ToolCall)]
    assert calls[0].name == "get_weather" and calls[0].id.startswith("call_")
    assert json.loads(calls[1].arguments) == {"city": "Paris"}
    assert isinstance(evs[-1], Done) and evs[-1].reason == "tool_calls"
    assert evs[-1].usage.completion_tokens == 20


async def test_fallback_events_without_a_call_are_text() -> None:
    evs = await events_of([sse("Hello", " there", end=END)])
    assert "".join(e.text for e in evs if isinstance(e, Text)) == "Hello there"
    assert isinstance(evs[-1], Done) and evs[-1].reason == "stop"
    cut = await events_of([sse('<tool_call>{"name"', end={**END, "stop_type": "limit"})])
    assert "".join(e.text for e in cut if isinstance(e, Text)) == '<tool_call>{"name"'
    assert isinstance(cut[-1], Done) and cut[-1].reason == "length"


# ---- the real server -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def fserver(start_server: Any, tmp_path_factory: pytest.TempPathFactory) -> CorralServer:
    d: Path = tmp_path_factory.mktemp("fallback-models")
    synth.write_llama_model(d / "tiny.gguf", n_layer=2, context_length=2048)
    synth.write_llama_model(d / "tools.gguf", chat_template=synth.TOOLS_TEMPLATE, seed=3)
    return start_server(d)


def test_show_says_tools_for_every_chat_model(fserver: CorralServer) -> None:
    for model in (SMOL, "tiny", "tools"):
        r = fserver.client.post("/api/show", json={"model": model})
        assert r.status_code == 200 and "tools" in r.json()["capabilities"], model


def test_every_api_takes_tools_on_a_model_without_tool_template(fserver: CorralServer) -> None:
    c = fserver.client
    hi = [{"role": "user", "content": "hi"}]
    for model in (SMOL, "tiny"):
        r = c.post(
            "/api/chat",
            json={
                "model": model,
                "messages": hi,
                "tools": [WEATHER],
                "stream": False,
                "options": {**GREEDY, "num_predict": 8},
            },
        )
        assert r.status_code == 200, r.text
    r = c.post(
        "/v1/chat/completions",
        json={"model": SMOL, "messages": hi, "tools": [WEATHER], "max_tokens": 8, **GREEDY},
    )
    assert r.status_code == 200, r.text
    r = c.post(
        "/v1/messages",
        json={
            "model": SMOL,
            "messages": hi,
            "max_tokens": 8,
            **GREEDY,
            "tools": [{"name": "get_weather", "description": "x", "input_schema": PARAMS}],
        },
    )
    assert r.status_code == 200, r.text
    r = c.post(
        "/v1/responses",
        json={
            "model": SMOL,
            "input": "hi",
            "max_output_tokens": 16,
            **GREEDY,
            "tools": [{"type": "function", "name": "get_weather", "parameters": PARAMS}],
        },
    )
    assert r.status_code == 200, r.text  # fmt: skip


def ollama_call(fserver: CorralServer, stream: bool) -> dict[str, Any]:
    r = fserver.client.post("/api/chat", json={
        "model": SMOL, "messages": FEW_SHOT, "tools": [WEATHER], "stream": stream,
        "options": {**GREEDY, "num_predict": 60},
    })  # fmt: skip
    assert r.status_code == 200, r.text
    if not stream:
        return dict(r.json()["message"])
    lines = [json.loads(line) for line in r.text.splitlines()]
    assert lines[-1]["done"]
    calls = [c for line in lines for c in line["message"].get("tool_calls") or ()]
    content = "".join(line["message"].get("content", "") for line in lines)
    return {"content": content, "tool_calls": calls}


@pytest.mark.parametrize("stream", [False, True])
def test_ollama_auto_call(fserver: CorralServer, stream: bool) -> None:
    message = ollama_call(fserver, stream)
    assert message["content"] == ""
    assert [c["function"] for c in message["tool_calls"]] == [
        {"name": "get_weather", "arguments": {"city": "Paris"}}
    ]


def test_anthropic_auto_call(fserver: CorralServer) -> None:
    r = fserver.client.post("/v1/messages", json={
        "model": SMOL, "max_tokens": 60, **GREEDY,
        "tools": [{"name": "get_weather", "description": "Current weather in a city",
                   "input_schema": PARAMS}],
        "messages": [
            {"role": "user", "content": "What is the weather in Rome?"},
            {"role": "assistant", "content": [
                {"type": "tool_use", "id": "t1", "name": "get_weather",
                 "input": {"city": "Rome"}}]},
            {"role": "user", "content": "What is the weather in Paris?"},
        ],
    })  # fmt: skip
    assert r.status_code == 200, r.text
    body = r.json()
    uses = [b for b in body["content"] if b["type"] == "tool_use"]
    assert [(u["name"], u["input"]) for u in uses] == [("get_weather", {"city": "Paris"})]
    assert body["stop_reason"] == "tool_use"


def test_responses_auto_call(fserver: CorralServer) -> None:
    r = fserver.client.post("/v1/responses", json={
        "model": SMOL, "max_output_tokens": 60, **GREEDY,
        "tools": [{"type": "function", "name": "get_weather",
                   "description": "Current weather in a city", "parameters": PARAMS}],
        "input": [
            {"role": "user", "content": "What is the weather in Rome?"},
            {"type": "function_call", "call_id": "c1", "name": "get_weather",
             "arguments": '{"city": "Rome"}'},
            {"role": "user", "content": "What is the weather in Paris?"},
        ],
    })  # fmt: skip
    assert r.status_code == 200, r.text
    calls = [o for o in r.json()["output"] if o["type"] == "function_call"]
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"})
    ]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_openai_auto_call(fserver: CorralServer, stream: bool) -> None:
    body = {"model": SMOL, "messages": FEW_SHOT, "tools": [WEATHER], "max_tokens": 60, **GREEDY}
    if not stream:
        r = fserver.client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        fn = choice["message"]["tool_calls"][0]["function"]
        name, args = fn["name"], fn["arguments"]
    else:
        r = fserver.client.post("/v1/chat/completions", json={**body, "stream": True})
        assert r.status_code == 200, r.text
        chunks = [json.loads(line[6:]) for line in r.text.splitlines()
                  if line.startswith("data: {")]  # fmt: skip
        deltas = [c["choices"][0] for c in chunks if c["choices"]]
        assert deltas[-1]["finish_reason"] == "tool_calls"
        calls = [t for d in deltas for t in d["delta"].get("tool_calls") or []]
        name = "".join(c["function"].get("name") or "" for c in calls)
        args = "".join(c["function"].get("arguments") or "" for c in calls)
    assert name == "get_weather" and json.loads(args) == {"city": "Paris"}


def test_llama_cpp_takes_the_grammar(fserver: CorralServer) -> None:
    """The grammar as llama.cpp's GBNF parser reads it, forced from the first token (not lazy):
    whatever the model writes is a call the scanner parses."""
    nested = {"type": "function", "function": {"name": "plan", "parameters": {
        "type": "object", "properties": {
            "steps": {"type": "array", "items": {"type": "string"}}, "n": {"type": "integer"}},
        "required": ["steps"]}}}  # fmt: skip
    tools = [WEATHER, nested]
    prompt = fserver.client.post(
        "/apply-template", json={"model": SMOL, "messages": fallback_messages(FEW_SHOT, tools)}
    ).json()["prompt"]
    r = fserver.client.post("/completion", json={
        "model": SMOL, "prompt": prompt, "n_predict": 80, **GREEDY,
        "grammar": call_grammar(tools)})  # fmt: skip
    assert r.status_code == 200, r.text
    content = r.json()["content"]
    assert r.json()["stop_type"] == "eos", content  # the grammar ended, not the token limit
    assert [p for p in feed_all(CallScanner(frozenset({"get_weather", "plan"})), [content])
            if isinstance(p, Call)], content  # fmt: skip


def test_native_tool_templates_keep_llama_cpp_parsing(fserver: CorralServer) -> None:
    # The synthetic tool template's model goes to llama.cpp's chat endpoint with the tools:
    # its prompt holds the template's own tools section, not corral's.
    r = fserver.client.post("/api/chat", json={
        "model": "tools", "messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER],
        "stream": False, "options": {**GREEDY, "num_predict": 2},
    })  # fmt: skip
    assert r.status_code == 200, r.text
    rendered = fserver.client.post("/apply-template", json={
        "model": "tools", "messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER],
    }).json()["prompt"]  # fmt: skip
    assert rendered.count('"get_weather"') == 1  # the template's tools, not corral's too
    tokens = fserver.client.post("/tokenize", json={
        "model": "tools", "content": rendered, "add_special": True, "parse_special": True,
    }).json()["tokens"]  # fmt: skip
    assert r.json()["prompt_eval_count"] == len(tokens)
