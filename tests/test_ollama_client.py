"""The real `ollama` Python client against a running corral server."""

from __future__ import annotations

import math

import numpy as np
import ollama
import pytest

SMOL = "smollm2:135m"


def test_generate_streams_tokens_then_final_stats(ollama_client: ollama.Client) -> None:
    chunks = list(
        ollama_client.generate(
            model=SMOL,
            prompt="Name a colour.",
            stream=True,
            options={"num_predict": 8, "temperature": 0, "seed": 1},
        )
    )
    assert len(chunks) >= 2
    assert all(not c.done for c in chunks[:-1])
    text = "".join(c.response for c in chunks)
    assert text.strip()
    final = chunks[-1]
    assert final.done and final.done_reason in ("stop", "length")
    assert final.eval_count and 0 < final.eval_count <= 8
    assert final.prompt_eval_count and final.prompt_eval_count > 0
    assert final.total_duration and final.eval_duration and final.prompt_eval_duration
    assert final.total_duration >= final.eval_duration


def test_generate_not_streamed_is_deterministic_with_seed(ollama_client: ollama.Client) -> None:
    opts = {"num_predict": 10, "temperature": 0, "seed": 42}
    a = ollama_client.generate(model=SMOL, prompt="The capital of France is", options=opts)
    b = ollama_client.generate(model=SMOL, prompt="The capital of France is", options=opts)
    assert a.done and a.response.strip()
    assert a.response == b.response
    assert a.done_reason == "length" and a.eval_count == 10


def test_generate_raw_prompt_uses_no_template(ollama_client: ollama.Client) -> None:
    r = ollama_client.generate(
        model=SMOL, prompt="1, 2, 3, 4,", raw=True, options={"num_predict": 4, "temperature": 0}
    )
    assert r.done and r.response


def test_chat_streamed_and_not(ollama_client: ollama.Client) -> None:
    msgs = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Say hello."},
    ]
    full = ollama_client.chat(
        model=SMOL, messages=msgs, options={"num_predict": 12, "temperature": 0}
    )
    assert full.message.role == "assistant" and full.message.content.strip()
    assert full.done and full.eval_count
    parts = list(
        ollama_client.chat(
            model=SMOL, messages=msgs, stream=True, options={"num_predict": 12, "temperature": 0}
        )
    )
    assert "".join(p.message.content for p in parts) == full.message.content
    assert parts[-1].done and parts[-1].done_reason in ("stop", "length")


def test_chat_format_json_gives_json(ollama_client: ollama.Client) -> None:
    import json

    r = ollama_client.chat(
        model=SMOL,
        messages=[{"role": "user", "content": "Give a JSON object."}],
        format="json",
        options={"num_predict": 40, "temperature": 0},
    )
    json.loads(r.message.content) if r.done_reason == "stop" else None
    assert r.message.content.lstrip().startswith(("{", "["))


def test_embed_and_legacy_embeddings(ollama_client: ollama.Client) -> None:
    r = ollama_client.embed(model="embed", input=["hello world", "goodbye"])
    assert len(r.embeddings) == 2
    assert len(r.embeddings[0]) == 64  # n_embd of the synthetic bert model
    norm = math.sqrt(sum(x * x for x in r.embeddings[0]))
    assert abs(norm - 1.0) < 1e-3  # /api/embed returns normalised vectors, as Ollama does
    assert r.embeddings[0] != r.embeddings[1]
    one = ollama_client.embeddings(model="embed", prompt="hello world")
    assert len(one.embedding) == 64
    short = ollama_client.embed(model="embed", input="hello", dimensions=16)
    assert len(short.embeddings[0]) == 16


def test_embed_with_a_chat_model(ollama_client: ollama.Client, server) -> None:
    """Ollama embeds with any model: a chat model's vectors come from a second runner of its
    file in embedding mode (the last token's hidden state), listed, kept and unloaded as any
    runner, beside the one that chats."""
    n_embd = ollama_client.show(SMOL).modelinfo["llama.embedding_length"]
    r = ollama_client.embed(model=SMOL, input=["hello world", "the sky is blue", "hello world"])
    v = np.asarray(r.embeddings)
    assert r.model == SMOL and v.shape == (3, n_embd) and r.prompt_eval_count
    # normalised, as Ollama's /api/embed returns them
    np.testing.assert_allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-5)
    np.testing.assert_allclose(v[0], v[2], atol=1e-6)
    assert not np.allclose(v[0], v[1], atol=1e-3)
    again = ollama_client.embed(model=SMOL, input="hello world")
    np.testing.assert_allclose(again.embeddings[0], v[0], atol=1e-6)
    # the legacy route gives the runner's vector as it is: Ollama never normalised it
    legacy = np.asarray(ollama_client.embeddings(model=SMOL, prompt="hello world").embedding)
    assert np.linalg.norm(legacy) > 2
    np.testing.assert_allclose(legacy / np.linalg.norm(legacy), v[0], atol=1e-5)
    chat = ollama_client.chat(model=SMOL, messages=[{"role": "user", "content": "Hi"}],
                              options={"num_predict": 3})  # fmt: skip
    assert chat.done and chat.message.content
    # two runners of one model, each its own line in ps
    ps = {m["name"]: m for m in server.ps()}
    embedder = ps[f"{SMOL} (embedding)"]
    assert embedder["embedding"] and not ps[SMOL]["embedding"]
    assert embedder["state"] == "ready" and embedder["size"] > 0
    assert embedder["models"] == [SMOL] and embedder["details"]["family"] == "llama"
    assert embedder["num_parallel"] == 2  # the shared server's fixed count
    # Ollama lists no "embedding" capability for a chat model
    assert "embedding" not in ollama_client.show(SMOL).capabilities
    # unloading the model unloads both
    ollama_client.generate(model=SMOL, keep_alive=0)
    server.wait_for(
        lambda: not {SMOL, f"{SMOL} (embedding)"} & {m["name"] for m in server.ps()},
        what="both runners to unload",
    )


def test_list_show_ps(ollama_client: ollama.Client) -> None:
    names = {m.model for m in ollama_client.list().models}
    assert {SMOL, "tiny:latest", "embed:latest"} <= names
    smol = next(m for m in ollama_client.list().models if m.model == SMOL)
    assert smol.size and smol.size > 90_000_000 and smol.details.family == "llama"
    assert smol.details.quantization_level == "Q4_1"

    show = ollama_client.show(SMOL)
    assert "completion" in show.capabilities
    assert show.modelinfo["general.architecture"] == "llama"
    assert show.modelinfo["llama.block_count"] == 30
    assert show.template and "im_start" in show.template
    assert "embedding" in ollama_client.show("embed").capabilities

    ollama_client.generate(model=SMOL, prompt="hi", options={"num_predict": 1})
    ps = {m.model: m for m in ollama_client.ps().models}
    assert SMOL in ps
    assert ps[SMOL].size and ps[SMOL].size > 90_000_000
    assert ps[SMOL].context_length == 1024
    assert ps[SMOL].expires_at is not None


def test_load_only_and_unload(ollama_client: ollama.Client, server) -> None:
    r = ollama_client.generate(model="tiny")
    assert r.done and r.done_reason == "load"
    assert "tiny:latest" in {m.model for m in ollama_client.ps().models}
    r = ollama_client.chat(model="tiny", messages=[], keep_alive=0)
    assert r.done and r.done_reason == "unload"
    server.wait_for(
        lambda: "tiny:latest" not in {m["model"] for m in server.ps()}, what="tiny to unload"
    )


def test_unknown_model_is_404(ollama_client: ollama.Client) -> None:
    with pytest.raises(ollama.ResponseError) as e:
        ollama_client.generate(model="does-not-exist", prompt="hi")
    assert e.value.status_code == 404
    assert "model 'does-not-exist' not found" in e.value.error
