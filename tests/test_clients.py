"""Client compatibility: the frameworks and SDKs people point at a local server, against the
session's real corral server, through every API family corral speaks.

- LangChain: `langchain_ollama` (ChatOllama, OllamaEmbeddings) on the Ollama API and
  `langchain_openai` (ChatOpenAI, OpenAIEmbeddings) on OpenAI Chat, Embeddings and Responses.
- LiteLLM: the `ollama`, `ollama_chat`, `openai` and `anthropic` providers with `api_base`
  pointed at corral (the cost map read locally: no network).
- ollama-js: `tests/js/ollama_client.mjs` run by node with CORRAL_URL; it prints a JSON
  summary of each scenario that the tests here assert on.

Models: "smollm2:135m" (real SmolLM2) for real text; "tools" (random weights, Hermes-style
tool template: forced calls come back well-formed when the schema bounds every string, with
tool_choice auto it answers text, often whitespace); "think" (random weights, a template that
opens <think>, so everything is reasoning unless thinking is off); "embed" (synthetic bert,
64 dimensions). Greedy decoding (seeded sampling on "think": greedy random weights think only
in whitespace) and few tokens (4-16 of SmolLM2 text, 32 for its structured JSON, which stops
early; up to 40 for the tiny random models' forced calls): the suite runs on two cores.

Coverage (client x call; "forced" = tool_choice required or named):

| client            | call                                         | model  | corral API        |
|-------------------|----------------------------------------------|--------|-------------------|
| ChatOllama        | invoke, stream                               | smollm2| /api/chat         |
| ChatOllama        | bind_tools (auto; no tool_choice in Ollama)  | tools  | /api/chat         |
| ChatOllama        | tool-call history (AIMessage + ToolMessage)  | tools  | /api/chat         |
| ChatOllama        | with_structured_output json_schema           | smollm2| /api/chat format  |
| ChatOllama        | reasoning=True / False                       | think  | /api/chat think   |
| OllamaEmbeddings  | embed_query, embed_documents                 | embed  | /api/embed        |
| ChatOpenAI        | invoke, stream (usage)                       | smollm2| /v1/chat          |
| ChatOpenAI        | bind_tools forced (required, name), streamed | tools  | /v1/chat          |
| ChatOpenAI        | with_structured_output function_calling      | tools  | /v1/chat          |
| ChatOpenAI        | with_structured_output json_schema           | smollm2| /v1/chat          |
| ChatOpenAI        | use_responses_api invoke, stream             | smollm2| /v1/responses     |
| ChatOpenAI        | use_responses_api bind_tools forced          | tools  | /v1/responses     |
| ChatOpenAI        | use_responses_api reasoning effort low/none  | think  | /v1/responses     |
| ChatOpenAI        | forced call cut by max_tokens                | tools  | /v1/chat, /v1/resp… |
| OpenAIEmbeddings  | embed_query, embed_documents, dimensions     | embed  | /v1/embeddings    |
| litellm ollama_chat | completion, stream                         | smollm2| /api/chat         |
| litellm ollama_chat | tools + tool_choice (dropped by litellm)   | tools  | /api/chat         |
| litellm ollama_chat | reasoning_effort -> reasoning_content      | think  | /api/chat think   |
| litellm ollama    | completion                                   | smollm2| /api/generate     |
| litellm openai    | completion, stream (usage)                   | smollm2| /v1/chat          |
| litellm openai    | tools forced (required, named), streamed     | tools  | /v1/chat          |
| litellm openai    | reasoning_content                            | think  | /v1/chat          |
| litellm           | embedding (ollama/, openai/)                 | embed  | /api/embed, /v1/… |
| litellm anthropic | completion, stream (usage)                   | smollm2| /v1/messages      |
| litellm anthropic | tools forced (tool_choice required)          | tools  | /v1/messages      |
| litellm anthropic | forced call cut by max_tokens                | tools  | /v1/messages      |
| ollama-js         | version, list, ps, show (+ capabilities)     | all    | /api/*            |
| ollama-js         | chat, chat stream, generate, generate stream | smollm2| /api/chat, generate |
| ollama-js         | embed                                        | embed  | /api/embed        |
| ollama-js         | chat with tools (auto)                       | tools  | /api/chat         |
| ollama-js         | think (whole and streamed)                   | think  | /api/chat think   |
| ollama-js         | unknown model -> ResponseError 404           | -      | /api/chat         |
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

import pytest
from langchain_core.messages import AIMessage, AIMessageChunk, HumanMessage, ToolMessage
from langchain_ollama import ChatOllama, OllamaEmbeddings
from langchain_openai import ChatOpenAI, OpenAIEmbeddings
from pydantic import BaseModel, ConfigDict, Field

from corral.testing.server import CorralServer

# litellm reads it on import: the model cost map comes from the package, not the network.
os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
import litellm

litellm.suppress_debug_info = True

SMOL = "smollm2:135m"
JS = Path(__file__).parent / "js"
CITIES = ("Paris", "London")
# Bounded strings and closed objects: even the random-weight "tools" model's forced call is
# short and well-formed.
WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": list(CITIES)}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
WEATHER_Q = "What is the weather in Paris?"
# litellm.completion imports its MCP gateway (and the optional `mcp` package, not installed
# here) whenever tools are given; this private switch skips that client-side detour.
NO_MCP: dict[str, Any] = {"_skip_mcp_handler": True}


class Weather(BaseModel):
    """The weather in a city."""

    model_config = ConfigDict(extra="forbid")
    city: Literal["Paris", "London"] = Field(description="the city")


class YesNo(BaseModel):
    """A yes or no answer."""

    answer: Literal["yes", "no"]


def rfc3339(value: str) -> datetime:
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


def merge(chunks: list[Any]) -> AIMessageChunk:
    """A LangChain stream's chunks added up into one message."""
    assert chunks and all(isinstance(c, AIMessageChunk) for c in chunks)
    whole = chunks[0]
    for c in chunks[1:]:
        whole = whole + c
    assert isinstance(whole, AIMessageChunk)
    return whole


# ---- LangChain: langchain_ollama -----------------------------------------------------------
@pytest.fixture(scope="module")
def chat_ollama(server: CorralServer) -> ChatOllama:
    return ChatOllama(model=SMOL, base_url=server.url, temperature=0, seed=1, num_predict=8)


def test_chat_ollama_invoke(chat_ollama: ChatOllama) -> None:
    m = chat_ollama.invoke("Say hello.")
    assert isinstance(m, AIMessage) and isinstance(m.content, str) and m.content.strip()
    meta = m.response_metadata
    assert meta["model"] == SMOL and meta["done"] is True and meta["done_reason"] == "length"
    assert m.usage_metadata and m.usage_metadata["output_tokens"] == 8
    assert m.usage_metadata["input_tokens"] > 0


def test_chat_ollama_stream(chat_ollama: ChatOllama) -> None:
    chunks = list(chat_ollama.stream("Count to five."))
    assert len(chunks) >= 3
    whole = merge(chunks)
    assert isinstance(whole.content, str) and whole.content.strip()
    assert whole.response_metadata["done_reason"] == "length"
    assert whole.usage_metadata and whole.usage_metadata["output_tokens"] == 8


def test_chat_ollama_bind_tools(server: CorralServer) -> None:
    # ChatOllama ignores tool_choice (Ollama's API has none), so the random model chooses:
    # with auto it answers text. The tools went through the template: a long prompt.
    llm = ChatOllama(model="tools", base_url=server.url, temperature=0, num_predict=6)
    m = llm.bind_tools([WEATHER], tool_choice="get_weather").invoke(WEATHER_Q)
    assert isinstance(m, AIMessage) and isinstance(m.content, str)
    assert m.response_metadata["done"] is True and m.response_metadata["done_reason"] == "length"
    assert m.usage_metadata and m.usage_metadata["output_tokens"] == 6
    assert m.usage_metadata["input_tokens"] > 100  # the tool's schema is in the prompt
    for call in m.tool_calls:  # should the random model call: a well-formed call
        assert call["name"] == "get_weather" and isinstance(call["args"], dict)


def test_chat_ollama_tool_history(server: CorralServer) -> None:
    llm = ChatOllama(model="tools", base_url=server.url, temperature=0, num_predict=4)
    call: Any = {"name": "get_weather", "args": {"city": "Paris"}, "id": "call_1"}
    history = [
        HumanMessage(WEATHER_Q),
        AIMessage("", tool_calls=[call]),
        ToolMessage("18 degrees and sunny", tool_call_id="call_1", name="get_weather"),
    ]
    first = llm.bind_tools([WEATHER]).invoke(history[:1])
    m = llm.bind_tools([WEATHER]).invoke(history)
    assert isinstance(m, AIMessage) and m.response_metadata["done"] is True
    assert first.usage_metadata and m.usage_metadata
    # The call and its result were rendered by the template.
    assert m.usage_metadata["input_tokens"] > first.usage_metadata["input_tokens"] + 15


def test_chat_ollama_structured_output(server: CorralServer) -> None:
    llm = ChatOllama(model=SMOL, base_url=server.url, temperature=0, num_predict=32)
    r = llm.with_structured_output(YesNo, method="json_schema").invoke(
        "Is the sky blue? Answer yes or no."
    )
    assert isinstance(r, YesNo) and r.answer in ("yes", "no")


def test_chat_ollama_reasoning(server: CorralServer) -> None:
    on = ChatOllama(model="think", base_url=server.url, seed=1, num_predict=8, reasoning=True)
    m = on.invoke("hi")
    assert isinstance(m, AIMessage)
    assert m.additional_kwargs.get("reasoning_content") and m.content == ""
    off = ChatOllama(model="think", base_url=server.url, seed=1, num_predict=8, reasoning=False)
    m = off.invoke("hi")
    assert m.content and "reasoning_content" not in m.additional_kwargs
    assert m.response_metadata["done_reason"] == "length"


def test_ollama_embeddings(server: CorralServer) -> None:
    emb = OllamaEmbeddings(model="embed", base_url=server.url)
    q = emb.embed_query("hello there")
    assert len(q) == 64 and math.isclose(math.hypot(*q), 1.0, rel_tol=1e-3)
    docs = emb.embed_documents(["first text", "second text", "hello there"])
    assert [len(d) for d in docs] == [64, 64, 64]
    assert docs[0] != docs[1]
    assert max(abs(a - b) for a, b in zip(docs[2], q, strict=True)) < 1e-5


def test_ollama_embeddings_from_a_chat_model(server: CorralServer) -> None:
    # Ollama embeds with any model: LangChain's RAG examples use the chat model's name
    emb = OllamaEmbeddings(model="smollm2:135m", base_url=server.url, keep_alive=0)
    q = emb.embed_query("hello there")
    assert len(q) == 576 and math.isclose(math.hypot(*q), 1.0, rel_tol=1e-3)
    docs = emb.embed_documents(["first text", "hello there"])
    assert max(abs(a - b) for a, b in zip(docs[1], q, strict=True)) < 1e-5


# ---- LangChain: langchain_openai -----------------------------------------------------------
def chat_openai(
    server: CorralServer, model: str = SMOL, max_tokens: int = 8, **kw: Any
) -> ChatOpenAI:
    opts: dict[str, Any] = {
        "model": model, "base_url": f"{server.url}/v1", "api_key": "x", "temperature": 0,
        "max_tokens": max_tokens, "max_retries": 0, "timeout": 120, **kw,
    }  # fmt: skip
    return ChatOpenAI(**opts)


def test_chat_openai_invoke(server: CorralServer) -> None:
    m = chat_openai(server).invoke("Say hello.")
    assert isinstance(m, AIMessage) and isinstance(m.content, str) and m.content.strip()
    meta = m.response_metadata
    assert meta["finish_reason"] == "length" and meta["model_name"] == SMOL
    assert m.usage_metadata and m.usage_metadata["output_tokens"] == 8
    assert m.usage_metadata["total_tokens"] == m.usage_metadata["input_tokens"] + 8


def test_chat_openai_stream(server: CorralServer) -> None:
    chunks = list(chat_openai(server, stream_usage=True).stream("Count to five."))
    whole = merge(chunks)
    assert isinstance(whole.content, str) and whole.content.strip()
    assert whole.response_metadata["finish_reason"] == "length"
    assert whole.usage_metadata and whole.usage_metadata["output_tokens"] == 8


@pytest.mark.parametrize("choice", ["required", "get_weather"])
def test_chat_openai_bind_tools_forced(server: CorralServer, choice: str) -> None:
    m = chat_openai(server, "tools", 40).bind_tools([WEATHER], tool_choice=choice).invoke(WEATHER_Q)
    assert isinstance(m, AIMessage) and m.response_metadata["finish_reason"] == "tool_calls"
    assert len(m.tool_calls) == 1 and not m.invalid_tool_calls
    (call,) = m.tool_calls
    assert call["name"] == "get_weather" and call["id"]
    assert set(call["args"]) == {"city"} and call["args"]["city"] in CITIES


def test_chat_openai_bind_tools_forced_streamed(server: CorralServer) -> None:
    llm = chat_openai(server, "tools", 40).bind_tools([WEATHER], tool_choice="required")
    chunks = list(llm.stream(WEATHER_Q))
    whole = merge(chunks)
    assert isinstance(whole, AIMessageChunk)
    assert whole.response_metadata["finish_reason"] == "tool_calls"
    assert [c["name"] for c in whole.tool_calls] == ["get_weather"]
    assert whole.tool_calls[0]["args"]["city"] in CITIES and whole.tool_calls[0]["id"]


def test_chat_openai_structured_output_function_calling(server: CorralServer) -> None:
    llm = chat_openai(server, "tools", 40)
    r = llm.with_structured_output(Weather, method="function_calling").invoke(WEATHER_Q)
    assert isinstance(r, Weather) and r.city in CITIES


def test_chat_openai_structured_output_json_schema(server: CorralServer) -> None:
    llm = chat_openai(server, SMOL, 32)
    r = llm.with_structured_output(YesNo, method="json_schema", include_raw=True).invoke(
        "Is the sky blue? Answer yes or no."
    )
    assert isinstance(r, dict) and r["parsing_error"] is None
    assert isinstance(r["parsed"], YesNo) and r["parsed"].answer in ("yes", "no")
    assert json.loads(r["raw"].content) == r["parsed"].model_dump()


def test_chat_openai_responses_api(server: CorralServer) -> None:
    llm = chat_openai(server, use_responses_api=True)
    m = llm.invoke("Say hello.")
    assert isinstance(m, AIMessage) and m.text.strip()
    assert m.id and m.id.startswith("resp_")
    meta = m.response_metadata
    assert meta["object"] == "response" and meta["model"] == SMOL
    assert meta["status"] == "incomplete"
    assert meta["incomplete_details"] == {"reason": "max_output_tokens"}
    assert m.usage_metadata and m.usage_metadata["output_tokens"] == 8
    chunks = list(llm.stream("Say hello."))
    whole = merge(chunks)
    assert whole.text.strip() and whole.id and whole.id.startswith("resp_")
    assert whole.usage_metadata and whole.usage_metadata["output_tokens"] == 8


def test_chat_openai_responses_api_forced_tool(server: CorralServer) -> None:
    llm = chat_openai(server, "tools", 40, use_responses_api=True)
    m = llm.bind_tools([WEATHER], tool_choice="required").invoke(WEATHER_Q)
    assert m.response_metadata["status"] == "completed" and not m.text
    (call,) = m.tool_calls
    assert call["name"] == "get_weather" and call["id"] and call["args"]["city"] in CITIES
    assert isinstance(m.content, list)
    (block,) = m.content
    assert isinstance(block, dict) and block["type"] == "function_call"
    assert block["id"].startswith("fc_") and block["call_id"] == call["id"]


def test_chat_openai_responses_api_reasoning(server: CorralServer) -> None:
    # Sampled, not greedy: greedy random weights think only in whitespace, which is trimmed.
    def llm(effort: str) -> ChatOpenAI:
        return chat_openai(
            server, "think", use_responses_api=True, reasoning={"effort": effort},
            temperature=None,
        )  # fmt: skip

    m = llm("low").invoke("hi")
    assert isinstance(m.content, list)
    (block,) = m.content
    assert isinstance(block, dict) and block["type"] == "reasoning"
    assert block["id"].startswith("rs_") and block["content"][0]["type"] == "reasoning_text"
    assert block["content"][0]["text"] and not m.text
    assert m.usage_metadata and m.usage_metadata["output_tokens"] == 8
    assert m.usage_metadata["output_token_details"]["reasoning"] > 0
    off = llm("none").invoke("hi")  # effort "none" turns thinking off: the answer is text
    assert off.text and all(b["type"] == "text" for b in off.content if isinstance(b, dict))


def test_openai_embeddings(server: CorralServer) -> None:
    # check_embedding_ctx_length=False: no tiktoken (whose encodings come from the network).
    emb = OpenAIEmbeddings(
        model="embed", base_url=f"{server.url}/v1", api_key="x",  # type: ignore[arg-type]
        check_embedding_ctx_length=False, max_retries=0,
    )  # fmt: skip
    q = emb.embed_query("hello there")
    assert len(q) == 64 and math.isclose(math.hypot(*q), 1.0, rel_tol=1e-3)
    docs = emb.embed_documents(["first text", "second text", "hello there"])
    assert [len(d) for d in docs] == [64, 64, 64] and docs[0] != docs[1]
    assert max(abs(a - b) for a, b in zip(docs[2], q, strict=True)) < 1e-5
    short = OpenAIEmbeddings(
        model="embed", base_url=f"{server.url}/v1", api_key="x",  # type: ignore[arg-type]
        check_embedding_ctx_length=False, max_retries=0, dimensions=32,
    ).embed_query("hello there")  # fmt: skip
    assert len(short) == 32 and math.isclose(math.hypot(*short), 1.0, rel_tol=1e-3)


# ---- LiteLLM -------------------------------------------------------------------------------
HELLO = [{"role": "user", "content": "Say hello."}]
GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": 8}


def stream_text(chunks: list[Any]) -> str:
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def finish_reasons(chunks: list[Any]) -> list[str]:
    return [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]


def test_litellm_ollama_chat(server: CorralServer) -> None:
    r = litellm.completion(
        model=f"ollama_chat/{SMOL}", api_base=server.url, messages=HELLO, **GREEDY
    )
    (c,) = r.choices
    assert c.message.role == "assistant" and c.message.content.strip()
    assert c.finish_reason == "length"
    assert r.usage.completion_tokens == 8 and r.usage.prompt_tokens > 0


def test_litellm_ollama_chat_stream(server: CorralServer) -> None:
    chunks = list(litellm.completion(
        model=f"ollama_chat/{SMOL}", api_base=server.url, messages=HELLO, stream=True, **GREEDY,
    ))  # fmt: skip
    assert len(chunks) >= 3 and stream_text(chunks).strip()
    assert finish_reasons(chunks) == ["length"]


def test_litellm_ollama_chat_tools(server: CorralServer) -> None:
    # The ollama_chat provider drops tool_choice (Ollama's API has none): the tools reach the
    # template and the random model answers as it likes.
    r = litellm.completion(
        model="ollama_chat/tools", api_base=server.url,
        messages=[{"role": "user", "content": WEATHER_Q}], tools=[WEATHER],
        tool_choice="required", temperature=0, max_tokens=6, **NO_MCP,
    )  # fmt: skip
    (c,) = r.choices
    assert c.message.role == "assistant" and c.finish_reason in ("length", "stop", "tool_calls")
    assert r.usage.completion_tokens == 6 and r.usage.prompt_tokens > 100
    for call in c.message.tool_calls or ():
        assert call.function.name == "get_weather" and json.loads(call.function.arguments)


def test_litellm_ollama_chat_reasoning(server: CorralServer) -> None:
    r = litellm.completion(
        model="ollama_chat/think", api_base=server.url,
        messages=[{"role": "user", "content": "hi"}], reasoning_effort="low", max_tokens=8, seed=1,
    )  # fmt: skip
    msg = r.choices[0].message
    assert msg.reasoning_content and not msg.content
    assert r.usage.completion_tokens == 8


def test_litellm_ollama_generate(server: CorralServer) -> None:
    r = litellm.completion(model=f"ollama/{SMOL}", api_base=server.url, messages=HELLO, **GREEDY)
    (c,) = r.choices
    # litellm's ollama provider reports every finished generate as "stop".
    assert c.message.content.strip() and c.finish_reason in ("stop", "length")
    assert r.usage.completion_tokens == 8 and r.usage.prompt_tokens > 0


def openai_kw(server: CorralServer) -> dict[str, Any]:
    return {"api_base": f"{server.url}/v1", "api_key": "x", "max_retries": 0}


def test_litellm_openai(server: CorralServer) -> None:
    r = litellm.completion(model=f"openai/{SMOL}", messages=HELLO, **openai_kw(server), **GREEDY)
    (c,) = r.choices
    assert c.message.content.strip() and c.finish_reason == "length"
    assert r.usage.completion_tokens == 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + 8


def test_litellm_openai_stream(server: CorralServer) -> None:
    chunks = list(litellm.completion(
        model=f"openai/{SMOL}", messages=HELLO, stream=True,
        stream_options={"include_usage": True}, **openai_kw(server), **GREEDY,
    ))  # fmt: skip
    assert stream_text(chunks).strip() and finish_reasons(chunks) == ["length"]
    usage = [c.usage for c in chunks if getattr(c, "usage", None)]
    assert usage and usage[-1].completion_tokens == 8 and usage[-1].prompt_tokens > 0


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_litellm_openai_tools_forced(server: CorralServer, choice: Any) -> None:
    r = litellm.completion(
        model="openai/tools", messages=[{"role": "user", "content": WEATHER_Q}], tools=[WEATHER],
        tool_choice=choice, temperature=0, max_tokens=40, **openai_kw(server), **NO_MCP,
    )  # fmt: skip
    (c,) = r.choices
    assert c.finish_reason == "tool_calls" and not c.message.content
    (call,) = c.message.tool_calls
    assert call.id and call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] in CITIES


def test_litellm_openai_tools_forced_streamed(server: CorralServer) -> None:
    chunks = list(litellm.completion(
        model="openai/tools", messages=[{"role": "user", "content": WEATHER_Q}], tools=[WEATHER],
        tool_choice="required", temperature=0, max_tokens=40, stream=True, **openai_kw(server),
        **NO_MCP,
    ))  # fmt: skip
    deltas = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or ()]
    assert deltas and deltas[0].id and deltas[0].function.name == "get_weather"
    args = "".join(d.function.arguments or "" for d in deltas)
    assert json.loads(args)["city"] in CITIES
    assert finish_reasons(chunks) == ["tool_calls"]


def test_litellm_openai_reasoning(server: CorralServer) -> None:
    r = litellm.completion(
        model="openai/think", messages=[{"role": "user", "content": "hi"}], max_tokens=8, seed=1,
        **openai_kw(server),
    )  # fmt: skip
    msg = r.choices[0].message
    assert msg.reasoning_content and not msg.content
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 8


@pytest.mark.parametrize("provider", ["ollama", "openai"])
def test_litellm_embedding(server: CorralServer, provider: str) -> None:
    kw = openai_kw(server) if provider == "openai" else {"api_base": server.url}
    r = litellm.embedding(model=f"{provider}/embed", input=["first text", "second text"], **kw)
    vecs = [d["embedding"] for d in r.data]
    assert [d["index"] for d in r.data] == [0, 1]
    assert [len(v) for v in vecs] == [64, 64] and vecs[0] != vecs[1]
    assert all(math.isclose(math.hypot(*v), 1.0, rel_tol=1e-3) for v in vecs)
    assert r.usage.prompt_tokens > 0


def anthropic_kw(server: CorralServer) -> dict[str, Any]:
    return {"api_base": server.url, "api_key": "x", "max_retries": 0}


def test_litellm_anthropic(server: CorralServer) -> None:
    r = litellm.completion(
        model=f"anthropic/{SMOL}", messages=HELLO, **anthropic_kw(server), **GREEDY
    )
    (c,) = r.choices
    assert c.message.content.strip() and c.finish_reason == "length"  # max_tokens, mapped
    assert r.usage.completion_tokens == 8 and r.usage.prompt_tokens > 0


def test_litellm_anthropic_stream(server: CorralServer) -> None:
    chunks = list(litellm.completion(
        model=f"anthropic/{SMOL}", messages=HELLO, stream=True,
        stream_options={"include_usage": True}, **anthropic_kw(server), **GREEDY,
    ))  # fmt: skip
    assert stream_text(chunks).strip() and finish_reasons(chunks) == ["length"]
    usage = [c.usage for c in chunks if getattr(c, "usage", None)]
    assert usage and usage[-1].completion_tokens == 8 and usage[-1].prompt_tokens > 0


def test_litellm_anthropic_tools_forced(server: CorralServer) -> None:
    r = litellm.completion(
        model="anthropic/tools", messages=[{"role": "user", "content": WEATHER_Q}],
        tools=[WEATHER], tool_choice="required", temperature=0, max_tokens=40,
        **anthropic_kw(server), **NO_MCP,
    )  # fmt: skip
    (c,) = r.choices
    assert c.finish_reason == "tool_calls"
    (call,) = c.message.tool_calls
    assert call.id.startswith("toolu_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] in CITIES


# ---- a forced call cut short by max_tokens --------------------------------------------------
# An unbounded string lets the random model write until max_tokens; greedy, the cut falls
# inside the call: the tools template's wrapper, `{"name":"get_weather","arg`, has been
# generated and no arguments are complete.
OPEN_WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
def test_chat_openai_forced_call_cut_by_max_tokens(server: CorralServer) -> None:
    llm = chat_openai(server, "tools", 12)
    m = llm.bind_tools([OPEN_WEATHER], tool_choice="required").invoke(WEATHER_Q)
    assert m.response_metadata["finish_reason"] == "length"
    assert m.content == ""  # no wrapper JSON as text
    # The truncated call is reported, its arguments unparseable.
    assert [c["name"] for c in [*m.tool_calls, *m.invalid_tool_calls]] == ["get_weather"]


def test_chat_openai_responses_api_forced_call_cut_by_max_tokens(server: CorralServer) -> None:
    llm = chat_openai(server, "tools", 12, use_responses_api=True)
    m = llm.bind_tools([OPEN_WEATHER], tool_choice="required").invoke(WEATHER_Q)
    assert m.response_metadata["status"] == "incomplete"
    assert m.text == ""  # no wrapper JSON as text
    assert [b["type"] for b in m.content if isinstance(b, dict)] == ["function_call"]


def test_litellm_anthropic_forced_call_cut_by_max_tokens(server: CorralServer) -> None:
    r = litellm.completion(
        model="anthropic/tools", messages=[{"role": "user", "content": WEATHER_Q}],
        tools=[OPEN_WEATHER], tool_choice="required", temperature=0, max_tokens=12,
        **anthropic_kw(server), **NO_MCP,
    )  # fmt: skip
    (c,) = r.choices
    assert c.finish_reason == "length"
    assert not c.message.content  # no wrapper JSON as text


# ---- ollama-js (node) ----------------------------------------------------------------------
def js(server: CorralServer, *scenarios: str) -> dict[str, Any]:
    """Run tests/js/ollama_client.mjs with the given scenarios; its JSON summary."""
    node = shutil.which("node")
    assert node, "node is not on PATH"
    assert (JS / "node_modules" / "ollama").is_dir(), "run `npm ci` in tests/js"
    proc = subprocess.run(
        [node, "ollama_client.mjs", *scenarios], cwd=JS, capture_output=True, text=True,
        timeout=300, env={**os.environ, "CORRAL_URL": server.url},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out: dict[str, Any] = json.loads(proc.stdout)
    assert list(out) == list(scenarios)
    return out


def js_one(server: CorralServer, scenario: str) -> dict[str, Any]:
    result: dict[str, Any] = js(server, scenario)[scenario]
    assert "error" not in result, result
    return result


def check_final(r: dict[str, Any], model: str, eval_count: int) -> None:
    assert r["done"] is True and r["done_reason"] == "length" and r["model"] == model
    assert r["eval_count"] == eval_count and r["prompt_eval_count"] > 0
    assert r["total_duration"] >= r["eval_duration"] > 0
    rfc3339(r["created_at"])


def test_js_version(server: CorralServer) -> None:
    assert js_one(server, "version")["version"]


def test_js_chat(server: CorralServer) -> None:
    r = js_one(server, "chat")
    assert r["role"] == "assistant" and r["content"].strip()
    check_final(r, SMOL, 8)


def test_js_chat_stream(server: CorralServer) -> None:
    r = js_one(server, "chat_stream")
    assert r["count"] >= 3 and r["text"].strip() and r["roles"] == ["assistant"]
    assert r["dones"] == [False] * (r["count"] - 1) + [True]
    check_final(r["last"], SMOL, 8)


def test_js_generate(server: CorralServer) -> None:
    r = js_one(server, "generate")
    assert r["response"].strip() and r["context_length"] > r["prompt_eval_count"]
    check_final(r, SMOL, 6)


def test_js_generate_stream(server: CorralServer) -> None:
    r = js_one(server, "generate_stream")
    assert r["count"] >= 3 and r["text"].strip()
    assert r["dones"] == [False] * (r["count"] - 1) + [True]
    check_final(r["last"], SMOL, 6)


def test_js_embed(server: CorralServer) -> None:
    r = js_one(server, "embed")
    assert r["model"] == "embed" and r["count"] == 2 and r["dims"] == [64, 64]
    assert r["differ"] and all(math.isclose(n, 1.0, rel_tol=1e-3) for n in r["norms"])
    assert r["prompt_eval_count"] > 0


def test_js_list(server: CorralServer) -> None:
    r = js_one(server, "list")
    assert {SMOL, "tiny:latest", "embed:latest", "tools:latest", "think:latest"} <= {*r["names"]}
    # Broken files are listed too, with the reason and no digest or details.
    broken = {"notgguf:latest", "truncated:latest"}
    assert broken <= set(r["names"])
    for m in r["models"]:
        if m["name"] in broken:
            assert m["error"] and m["digest"] == ""
            continue
        assert "error" not in m and m["model"] == m["name"] and m["size"] > 0
        assert len(m["digest"]) == 64
        assert m["format"] == "gguf" and m["family"]
        rfc3339(m["modified_at"])
    by_name = {m["name"]: m for m in r["models"]}
    assert by_name["embed:latest"]["family"] == "bert" and by_name[SMOL]["family"] == "llama"


def test_js_ps(server: CorralServer) -> None:
    r = js_one(server, "ps")  # the scenario generates with SmolLM2 first
    assert SMOL in r["names"]
    m = next(m for m in r["models"] if m["name"] == SMOL)
    assert m["size"] > 0 and 0 <= m["size_vram"] <= m["size"]
    assert rfc3339(m["expires_at"]).timestamp() > datetime.now().timestamp()


def test_js_show(server: CorralServer) -> None:
    r = js_one(server, "show")
    assert r["family"] == "llama" and r["format"] == "gguf" and r["parameter_size"]
    assert "completion" in r["capabilities"] and r["template_length"] > 0
    assert r["architecture"] == "llama" and "llama.context_length" in r["model_info_keys"]
    caps = r["capabilities_of"]
    assert "tools" in caps["tools"] and "thinking" in caps["think"]
    assert caps["embed"] == ["embedding"]


def test_js_chat_with_tools(server: CorralServer) -> None:
    r = js_one(server, "tools")
    # tool_choice auto: the random model answers text (whitespace the parser trims).
    assert r["role"] == "assistant" and isinstance(r["content"], str)
    check_final(r, "tools", 8)
    assert r["prompt_eval_count"] > 100  # the tool's schema is in the prompt
    for call in r["tool_calls"]:
        assert call["function"]["name"] == "get_weather"
        assert isinstance(call["function"]["arguments"], dict)


def test_js_think(server: CorralServer) -> None:
    r = js_one(server, "think")
    assert r["thinking"] and r["content"] == ""
    check_final(r, "think", 8)
    assert r["streamed_thinking"] and r["streamed_content"] == ""
    check_final(r["streamed_last"], "think", 8)


def test_js_unknown_model_is_a_404(server: CorralServer) -> None:
    r = js(server, "not_found")["not_found"]
    assert r["name"] == "ResponseError" and r["status_code"] == 404
    assert r["error"] == "model 'nope' not found"
