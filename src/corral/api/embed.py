"""Embeddings in bulk: a request's inputs sent to its runner in chunks, a few chunks at once,
and the vectors gathered in input order as one float32 matrix.

llama.cpp makes every input of a request a task, and its slots take the tasks in order as they
free up, the inputs of all busy slots sharing one batch: one request already keeps every slot
busy. Chunks (`chunk_size`, CONCURRENT in flight) keep them so, while bounding what a request
costs the runner: its waiting tasks are scanned once per finished input (a list of N inputs
costs it N^2 / 2 steps: a tenth of its time at 10,000 short inputs), and it holds the
JSON of every answer until the last (tens of MB a request, never given back to the system).
Between two chunks another request's inputs get their turn, instead of waiting behind the
whole list.

The runner answers in base64 (its float32s in this machine's byte order), decoded by numpy:
no Python float per number on the way, and a third of the bytes of JSON. The answers are
written from float64 copies, so a client reads the very numbers llama.cpp's JSON gives.
"""

from __future__ import annotations

import asyncio
import binascii
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import orjson

from corral.api.activity import note_embedded
from corral.errors import ApiError

if TYPE_CHECKING:
    from corral.runtime.hop import Hop

# llama.cpp's default physical batch (n_ubatch): the most tokens one embedding input may have.
EMBED_BATCH = 512
# Inputs per chunk: a few per slot, so that a chunk's tail (fewer inputs than slots) is short
# beside it, and never so few that the request's own overhead (~1 ms a chunk) shows.
CHUNK_PER_SLOT = 8
CHUNK_MIN = 64
# Chunks in flight: while one ends (its last inputs in a few slots) the next one's fill the
# others, and a third is on its way (tokenized by the runner's HTTP threads meanwhile).
CONCURRENT = 3
# Long inputs tokenized at once to check their length (llama.cpp tokenizes on its HTTP threads).
TOKENIZE_CONCURRENT = 8


def chunk_size(slots: int) -> int:
    """Inputs per chunk for a runner with `slots` slots."""
    return max(CHUNK_MIN, CHUNK_PER_SLOT * slots)


def chunks(n: int, size: int) -> list[range]:
    """The inputs 0..n-1 as consecutive ranges of at most `size`."""
    return [range(i, min(i + size, n)) for i in range(0, n, max(1, size))]


def decode(data: Mapping[str, Any]) -> tuple[np.ndarray, int]:
    """A runner's /v1/embeddings answer in base64 as an (inputs x dimensions) float32 matrix
    in input order, and the prompt tokens it counted."""
    items = sorted(data.get("data") or (), key=lambda d: d["index"])
    rows = [np.frombuffer(binascii.a2b_base64(d["embedding"]), dtype=np.float32) for d in items]
    usage = data.get("usage") or {}
    tokens = int(usage.get("prompt_tokens") or 0)
    if not rows:
        return np.zeros((0, 0), dtype=np.float32), tokens
    return np.vstack(rows), tokens


def shorten(vectors: np.ndarray, dims: int | None) -> np.ndarray:
    """Matryoshka truncation: each row's leading `dims` dimensions scaled back to unit length
    (in float64; a zero row stays zero); the rows as they are without `dims` or when they are
    no longer."""
    if not dims or dims >= vectors.shape[-1]:
        return vectors
    cut = vectors[:, :dims].astype(np.float64)
    norm = np.linalg.norm(cut, axis=-1, keepdims=True)
    return np.divide(cut, norm, out=cut, where=norm > 0)


def as_json_numbers(vectors: np.ndarray) -> np.ndarray:
    """The rows to write as JSON numbers: float64 (orjson writes a float32 with the fewest
    digits that make that float32, llama.cpp its float64 value), C-ordered for orjson."""
    return np.ascontiguousarray(vectors, dtype=np.float64)


async def embed(
    hop: Hop,
    inputs: Sequence[Any],
    extra: Mapping[str, Any] | None = None,
) -> tuple[np.ndarray, int]:
    """The embeddings of `inputs` (strings or token id lists, each fitted to the runner) as a
    float32 matrix in input order, and the prompt tokens: in chunks, CONCURRENT at once; the
    first failure (in input order) cancels the rest. `extra`: more fields for llama.cpp."""
    if not inputs:
        return np.zeros((0, 0), dtype=np.float32), 0
    base = {**(extra or {}), "encoding_format": "base64"}

    async def one(part: range) -> tuple[np.ndarray, int]:
        payload = {**base, "input": list(inputs[part.start : part.stop])}
        data = await hop.api.post_json("/v1/embeddings", payload)
        matrix, tokens = decode(data)
        if matrix.shape[0] != len(part):
            raise ApiError(500, f"the runner answered {matrix.shape[0]} of {len(part)} inputs")
        return matrix, tokens

    parts = chunks(len(inputs), chunk_size(hop.runner.spec.num_parallel))
    done: list[np.ndarray] = []
    tokens = 0
    window: list[asyncio.Future[tuple[np.ndarray, int]]] = []
    try:
        for part in parts:
            window.append(asyncio.ensure_future(one(part)))
            if len(window) >= CONCURRENT:
                matrix, n = await window.pop(0)
                done.append(matrix)
                tokens += n
        while window:
            matrix, n = await window.pop(0)
            done.append(matrix)
            tokens += n
    finally:
        for fut in window:  # a failure or the client leaving: the chunks not needed any more
            fut.cancel()
        if window:
            await asyncio.gather(*window, return_exceptions=True)
    dims = {m.shape[1] for m in done}
    if len(dims) != 1:
        raise ApiError(500, f"the runner answered vectors of {sorted(dims)} dimensions")
    note_embedded(tokens)  # the request log's prompt tokens
    return np.vstack(done), tokens


async def fit(hop: Hop, inputs: Sequence[str], truncate: bool) -> list[str | list[int]]:
    """Inputs an embedding runner can take whole: llama.cpp embeds one input in one physical
    batch and fails on longer ones, so those are cut to it (as token ids) or, with `truncate`
    false, refused (the first in input order). Only inputs with more bytes than the limit are
    tokenized (a token is never shorter than a byte), TOKENIZE_CONCURRENT at once."""
    limit = min(hop.runner.spec.n_ctx, EMBED_BATCH)
    out: list[str | list[int]] = list(inputs)
    # + the specials the model adds ([CLS], [SEP])
    long = [i for i, text in enumerate(inputs) if len(text.encode()) + 2 > limit]
    if not long:
        return out
    gate = asyncio.Semaphore(TOKENIZE_CONCURRENT)

    async def tokens(text: str) -> list[int]:
        async with gate:
            data = await hop.api.post_json("/tokenize", {"content": text, "add_special": True})
        return list(data["tokens"])

    counted = await asyncio.gather(*(tokens(inputs[i]) for i in long))
    for i, toks in zip(long, counted, strict=True):
        if len(toks) <= limit:
            continue
        if not truncate:
            raise ApiError(
                400, f"input {i} is {len(toks)} tokens, more than the {limit} this model "
                "embeds at once; send \"truncate\": true to cut it",
                "input",
            )  # fmt: skip
        out[i] = toks[:limit]
    return out


def openai_body(model: str, vectors: np.ndarray, tokens: int, fmt: str, dims: int | None) -> bytes:
    """OpenAI's embedding list, keys in llama.cpp's order: `fmt` "float" (JSON numbers) or
    "base64" (little-endian float32s, as OpenAI encodes them); `dims` truncates."""
    short = shorten(vectors, dims)
    data: list[dict[str, Any]]
    if fmt == "base64":
        f32 = short.astype("<f4")
        data = [
            {"embedding": binascii.b2a_base64(row.tobytes(), newline=False).decode(),
             "index": i, "object": "embedding"}
            for i, row in enumerate(f32)
        ]  # fmt: skip
    else:
        # the float32s the API returns (a truncated vector is renormalised in float64 first)
        rows = as_json_numbers(short.astype(np.float32) if dims else short)
        data = [{"embedding": row, "index": i, "object": "embedding"} for i, row in enumerate(rows)]
    body = {
        "model": model, "object": "list",
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens}, "data": data,
    }  # fmt: skip
    return orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)
