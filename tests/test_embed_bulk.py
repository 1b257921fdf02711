"""Embeddings in bulk (api/embed.py): a request of thousands of inputs on a runner with many
slots is sent in chunks over them, and every vector comes back in input order, equal to the
vector of the same input sent alone (to the last bits llama.cpp's batching changes). The pure
helpers exactly."""

from __future__ import annotations

import asyncio
import base64
import random
from typing import Any

import httpx
import numpy as np
import orjson
import pytest

from corral.api import embed
from corral.core.spec import EMBED_PARALLEL
from corral.testing import synth
from corral.testing.server import CorralServer

N = 2000
# Inputs share their words; batched with others, an input's vector moves by ~1e-6.
TOLERANCE = 1e-4
WORDS = "alpha bravo copper delta ember falcon garnet harbor island jasper kettle lumen".split()


def texts(n: int, seed: int = 3) -> list[str]:
    rng = random.Random(seed)
    return [f"{i} " + " ".join(rng.choices(WORDS, k=rng.randint(3, 12))) for i in range(n)]


# ---- the pure parts --------------------------------------------------------------------------


def test_chunks_cover_the_inputs_in_order_without_overlap() -> None:
    for n in (0, 1, 63, 64, 65, 2000):
        for size in (1, 7, 64, 128):
            parts = embed.chunks(n, size)
            assert [i for p in parts for i in p] == list(range(n))
            assert all(0 < len(p) <= size for p in parts)
    assert embed.chunk_size(1) == embed.CHUNK_MIN
    assert embed.chunk_size(EMBED_PARALLEL) == max(embed.CHUNK_MIN, 8 * EMBED_PARALLEL)


def _answer(vectors: np.ndarray, order: list[int], tokens: int) -> dict[str, Any]:
    """A runner's base64 answer, its items in `order`."""
    return {
        "model": "m", "object": "list",
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        "data": [{"embedding": base64.b64encode(vectors[i].astype(np.float32).tobytes()).decode(),
                  "index": i, "object": "embedding", "encoding_format": "base64"}
                 for i in order],
    }  # fmt: skip


def test_decode_puts_the_rows_in_input_order() -> None:
    vectors = np.random.default_rng(0).standard_normal((5, 8)).astype(np.float32)
    matrix, tokens = embed.decode(_answer(vectors, [3, 0, 4, 1, 2], 17))
    assert tokens == 17 and matrix.dtype == np.float32
    np.testing.assert_array_equal(matrix, vectors)
    empty, _ = embed.decode({"data": []})
    assert empty.shape == (0, 0)


def test_shorten_renormalises_the_leading_dimensions() -> None:
    v = np.array([[3.0, 4.0, 12.0], [0.0, 0.0, 1.0]], dtype=np.float32)
    short = embed.shorten(v, 2)
    np.testing.assert_allclose(short, [[0.6, 0.8], [0.0, 0.0]])  # a zero row stays zero
    assert embed.shorten(v, None) is v and embed.shorten(v, 3) is v and embed.shorten(v, 9) is v


def test_openai_body_writes_the_numbers_llama_cpp_writes() -> None:
    """Float JSON from the float32s, written as float64 (llama.cpp's JSON gives the same
    values); base64 as little-endian float32s; indices and usage as OpenAI's."""
    vectors = np.random.default_rng(1).standard_normal((3, 6)).astype(np.float32)
    llama_json = orjson.dumps([[float(x) for x in row] for row in vectors])  # float -> double
    body = orjson.loads(embed.openai_body("m", vectors, 9, "float", None))
    assert [d["index"] for d in body["data"]] == [0, 1, 2] and body["model"] == "m"
    assert body["usage"] == {"prompt_tokens": 9, "total_tokens": 9}
    assert [d["embedding"] for d in body["data"]] == orjson.loads(llama_json)
    b64 = orjson.loads(embed.openai_body("m", vectors, 9, "base64", None))
    for d, row in zip(b64["data"], vectors, strict=True):
        np.testing.assert_array_equal(np.frombuffer(base64.b64decode(d["embedding"]), "<f4"), row)
    short = orjson.loads(embed.openai_body("m", vectors, 9, "float", 2))
    for d in short["data"]:
        assert len(d["embedding"]) == 2
        assert np.float32(d["embedding"][0]) == d["embedding"][0]  # float32s, as OpenAI's
        assert abs(np.linalg.norm(d["embedding"]) - 1) < 1e-6


# ---- a runner with many slots ----------------------------------------------------------------


@pytest.fixture(scope="module")
def server(start_server, tmp_path_factory: pytest.TempPathFactory) -> CorralServer:
    d = tmp_path_factory.mktemp("bulk-models")
    synth.write_bert_model(d / "embed.gguf")
    # No slot count: an embedding model gets EMBED_PARALLEL of them.
    return start_server(d, CORRAL_NUM_PARALLEL="auto", CORRAL_BUILTIN_MODELS="0")


def one_by_one(url: str, inputs: list[str]) -> tuple[np.ndarray, int]:
    """Each input in a request of its own (the runner's own answer, passed through), 16 at
    once: the vectors and the prompt tokens in all."""

    async def run() -> list[dict[str, Any]]:
        gate = asyncio.Semaphore(16)
        async with httpx.AsyncClient(base_url=url, timeout=120) as c:

            async def one(text: str) -> dict[str, Any]:
                async with gate:
                    r = await c.post("/v1/embeddings", json={"model": "embed", "input": text})
                r.raise_for_status()
                out: dict[str, Any] = r.json()
                return out

            return list(await asyncio.gather(*(one(t) for t in inputs)))

    answers = asyncio.run(run())
    vectors = np.array([a["data"][0]["embedding"] for a in answers])
    return vectors, sum(a["usage"]["prompt_tokens"] for a in answers)


@pytest.fixture(scope="module")
def alone(server: CorralServer) -> tuple[list[str], np.ndarray, int]:
    inputs = texts(N)
    vectors, tokens = one_by_one(server.url, inputs)
    return inputs, vectors, tokens


def same_vectors(bulk: np.ndarray, alone: np.ndarray) -> None:
    """Row i of `bulk` is the vector of input i: equal within TOLERANCE, and nearer to it than
    to any other input's."""
    assert bulk.shape == alone.shape
    np.testing.assert_allclose(bulk, alone, rtol=0, atol=TOLERANCE)
    nearest = np.argmax(bulk @ alone.T, axis=1)  # unit vectors: the largest cosine
    assert (nearest == np.arange(len(bulk))).all()


def test_thousands_of_inputs_come_back_in_order_through_both_apis(
    server: CorralServer, alone: tuple[list[str], np.ndarray, int]
) -> None:
    inputs, vectors, tokens = alone
    (m,) = server.ps()
    assert m["num_parallel"] == EMBED_PARALLEL  # the runner the inputs are spread over
    c = server.client
    r = c.post("/api/embed", json={"model": "embed", "input": inputs}, timeout=600)
    assert r.status_code == 200, r.text
    ollama = r.json()
    assert ollama["prompt_eval_count"] == tokens
    same_vectors(np.array(ollama["embeddings"]), vectors)
    r = c.post("/v1/embeddings", json={"model": "embed", "input": inputs}, timeout=600)
    assert r.status_code == 200, r.text
    openai = r.json()
    assert openai["model"] == "embed" and openai["object"] == "list"
    assert [d["index"] for d in openai["data"]] == list(range(N))
    assert {d["object"] for d in openai["data"]} == {"embedding"}
    assert openai["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    same_vectors(np.array([d["embedding"] for d in openai["data"]]), vectors)


def test_thousands_of_inputs_in_base64_and_fewer_dimensions(
    server: CorralServer, alone: tuple[list[str], np.ndarray, int]
) -> None:
    inputs, vectors, _ = alone
    body = {"model": "embed", "input": inputs, "encoding_format": "base64"}
    r = server.client.post("/v1/embeddings", json=body, timeout=600)
    assert r.status_code == 200, r.text
    b64 = np.array([np.frombuffer(base64.b64decode(d["embedding"]), "<f4")
                    for d in r.json()["data"]])  # fmt: skip
    same_vectors(b64, vectors)
    r = server.client.post("/api/embed", json={"model": "embed", "input": inputs,
                                                "dimensions": 16}, timeout=600)  # fmt: skip
    assert r.status_code == 200, r.text
    head = vectors[:, :16] / np.linalg.norm(vectors[:, :16], axis=1, keepdims=True)
    same_vectors(np.array(r.json()["embeddings"]), head)


def test_token_arrays_in_bulk_are_inputs_too(server: CorralServer) -> None:
    """OpenAI's input may be token id arrays: each is one input, in order."""
    arrays = [[1 + (i * 7 + j) % 900 for j in range(3 + i % 5)] for i in range(300)]
    r = server.client.post("/v1/embeddings", json={"model": "embed", "input": arrays}, timeout=600)
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    assert [d["index"] for d in data] == list(range(300))
    for i in (0, 150, 299):
        single = server.client.post("/v1/embeddings", json={"model": "embed", "input": arrays[i]})
        np.testing.assert_allclose(data[i]["embedding"], single.json()["data"][0]["embedding"],
                                   rtol=0, atol=TOLERANCE)  # fmt: skip


def test_many_long_inputs_are_cut_or_the_first_refused(server: CorralServer) -> None:
    """Long inputs are tokenized (several at once) and cut to the batch; with truncate false
    the first in input order is named."""
    long = ["word " * (600 + i) for i in range(20)]  # each well past 512 tokens
    inputs = [x for pair in zip(texts(20), long, strict=True) for x in pair]
    r = server.client.post("/api/embed", json={"model": "embed", "input": inputs}, timeout=600)
    assert r.status_code == 200, r.text
    vectors = np.array(r.json()["embeddings"])
    assert vectors.shape == (40, 64)
    # cut to the same first 512 tokens: the long inputs' vectors agree
    np.testing.assert_allclose(vectors[1::2], np.repeat(vectors[1:2], 20, axis=0), atol=TOLERANCE)
    r = server.client.post("/api/embed", json={"model": "embed", "input": inputs,
                                                "truncate": False})  # fmt: skip
    assert r.status_code == 400 and "input 1 " in r.json()["error"]
