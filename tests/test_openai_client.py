"""The real `openai` Python client against a running corral server."""

from __future__ import annotations

import httpx
import numpy as np
import openai
import pytest

SMOL = "smollm2:135m"


def test_chat_completion(openai_client: openai.OpenAI) -> None:
    r = openai_client.chat.completions.create(
        model=SMOL,
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=10,
        temperature=0,
    )
    assert r.object == "chat.completion"
    assert r.model == SMOL
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage and r.usage.completion_tokens and r.usage.completion_tokens <= 10


def test_chat_completion_streamed_with_usage(openai_client: openai.OpenAI) -> None:
    stream = openai_client.chat.completions.create(
        model=SMOL,
        messages=[{"role": "user", "content": "Count to five."}],
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.strip()
    assert any(c.choices and c.choices[0].finish_reason for c in chunks)
    usage = [c.usage for c in chunks if c.usage]
    assert usage and usage[-1].completion_tokens and usage[-1].prompt_tokens


def test_completions(openai_client: openai.OpenAI) -> None:
    r = openai_client.completions.create(
        model=SMOL, prompt="Once upon a time", max_tokens=6, temperature=0
    )
    assert r.choices[0].text


def test_embeddings(openai_client: openai.OpenAI) -> None:
    r = openai_client.embeddings.create(model="embed", input=["a", "b", "c"])
    assert [d.index for d in r.data] == [0, 1, 2]
    assert all(len(d.embedding) == 64 for d in r.data)


def test_embeddings_from_a_chat_model(openai_client: openai.OpenAI, http: httpx.Client) -> None:
    # served by the chat model's embedding runner (as the Ollama routes are)
    r = openai_client.embeddings.create(model=SMOL, input=["hello world", "the sky is blue"])
    assert r.model == SMOL and [d.index for d in r.data] == [0, 1]
    v = np.asarray([d.embedding for d in r.data])
    assert v.shape == (2, 576) and r.usage.prompt_tokens > 0
    np.testing.assert_allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-5)
    ollama = http.post("/api/embed", json={"model": SMOL, "input": "hello world"}).json()
    np.testing.assert_allclose(ollama["embeddings"][0], v[0], atol=1e-6)
    short = openai_client.embeddings.create(model=SMOL, input="hello world", dimensions=32)
    assert len(short.data[0].embedding) == 32
    # its embedding runner alone unloaded, by the name ps gives it
    http.post("/api/generate", json={"model": f"{SMOL} (embedding)", "keep_alive": 0})


def test_models(openai_client: openai.OpenAI) -> None:
    ids = {m.id for m in openai_client.models.list()}
    assert {SMOL, "tiny:latest", "embed:latest"} <= ids
    m = openai_client.models.retrieve(SMOL)
    assert m.id == SMOL and m.object == "model"


def test_errors_in_openai_shape(openai_client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        openai_client.chat.completions.create(
            model="nope", messages=[{"role": "user", "content": "x"}]
        )
    assert e.value.status_code == 404
    body = e.value.body
    assert isinstance(body, dict) and body["code"] == "model_not_found"
    assert "model 'nope' not found" in body["message"] and body["type"]
    with pytest.raises(openai.NotFoundError):
        openai_client.models.retrieve("nope")
    with pytest.raises(openai.BadRequestError):
        openai_client.chat.completions.create(model=SMOL, messages=[])
