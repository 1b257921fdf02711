"""Vision: a synthetic text model with a synthetic projector (llama.cpp's mmproj, LLaVA-style
"mlp") in a real runner. Every API family takes an image; the prompt grows by the image's
tokens; a model without a projector still answers 400."""

from __future__ import annotations

import base64
import json
import struct
import zlib
from pathlib import Path
from typing import Any

import ollama
import psutil
import pytest
from helpers import parse_log

from corral.core.estimate import estimate
from corral.core.gguf import GGUFError, read_model_info, read_projector_info
from corral.runtime.registry import Registry
from corral.testing import synth
from corral.testing.server import CorralServer

IMAGE_TOKENS = synth.projector_image_tokens()  # 16: a 32-pixel image in 8-pixel patches
PROMPT = "What is in this picture?"


def png(width: int = 24, height: int = 20) -> bytes:
    """A small RGB gradient PNG (any size: the projector resizes it)."""
    rows = b"".join(
        b"\x00" + b"".join(bytes([x * 10 % 256, y * 12 % 256, 128]) for x in range(width))
        for y in range(height)
    )

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows))
        + chunk(b"IEND", b"")
    )  # fmt: skip


B64 = base64.b64encode(png()).decode()
DATA_URL = f"data:image/png;base64,{B64}"


@pytest.fixture(scope="module")
def vision_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("vision")
    # llama.cpp's router layout: a folder with the model and its mmproj, named after the folder.
    synth.write_llama_model(d / "eyes" / "eyes-f16.gguf", seed=5)
    synth.write_projector(d / "eyes" / "mmproj-eyes-f16.gguf", 64)
    # A projector named in models.toml, beside a model that has none.
    synth.write_llama_model(d / "plain.gguf", seed=6)
    synth.write_projector(d / "mmproj-plain.gguf", 64, seed=1)
    (d / "models.toml").write_text(
        '[models.seeing]\nfile = "plain.gguf"\nprojector = "mmproj-plain.gguf"\n'
    )
    return d


@pytest.fixture(scope="module")
def vserver(start_server, vision_dir: Path) -> CorralServer:
    return start_server(vision_dir)


# ---- files and the registry ------------------------------------------------------------------


def test_projector_file_is_read_and_checked(vision_dir: Path) -> None:
    proj = read_projector_info(vision_dir / "mmproj-plain.gguf")
    assert (proj.projector_type, proj.n_embd, proj.n_layer) == ("mlp", 32, 2)
    assert (proj.image_size // proj.patch_size) ** 2 == IMAGE_TOKENS and proj.weights > 0
    with pytest.raises(GGUFError, match="not a projector"):
        read_projector_info(vision_dir / "plain.gguf")


def test_registry_finds_projectors(vision_dir: Path) -> None:
    reg = Registry(vision_dir, builtin=False)
    names = {e.name for e in reg.all()}
    assert names == {"eyes:latest", "plain:latest", "seeing:latest"}  # no mmproj-* model
    eyes = reg.get("eyes")
    assert eyes is not None and eyes.path.name == "eyes-f16.gguf"
    assert eyes.projector == vision_dir / "eyes" / "mmproj-eyes-f16.gguf"
    seeing = reg.get("seeing")
    assert seeing is not None and seeing.projector == vision_dir / "mmproj-plain.gguf"
    assert reg.get("plain").projector is None  # type: ignore[union-attr]


def test_estimate_books_the_projector(vision_dir: Path) -> None:
    info = read_model_info(vision_dir / "plain.gguf")
    proj = read_projector_info(vision_dir / "mmproj-plain.gguf")
    plain, seeing = estimate(info, 1024), estimate(info, 1024, projector=proj)
    assert seeing.projector_weights >= proj.weights and seeing.projector_compute > 0
    assert seeing.total == plain.total + seeing.projector


def test_memreport_reads_the_projector_buffers() -> None:
    log = """
load_tensors:   CPU_Mapped model buffer size =     1.14 MiB
sched_reserve:        CPU compute buffer size =     1.64 MiB
clip_ctx: CLIP using CUDA0 backend
load_hparams: model size:         2.00 MiB
reserve_compute_meta:      CUDA0 compute buffer size =     3.00 MiB
reserve_compute_meta:        CPU compute buffer size =     0.50 MiB
"""
    alloc = parse_log(log)
    assert alloc is not None
    assert alloc.model == {"CPU": round(1.14 * 2**20), "CUDA0": 2 * 2**20}
    assert alloc.compute == {"CPU": round(2.14 * 2**20), "CUDA0": 3 * 2**20}


# ---- the APIs, through a real runner ------------------------------------------------------------


def _ollama_tokens(client: ollama.Client, model: str, images: list[str]) -> int:
    r = client.chat(
        model=model, messages=[{"role": "user", "content": PROMPT, "images": images}],
        options={"num_predict": 2, "temperature": 0},
    )  # fmt: skip
    assert r.done and r.prompt_eval_count
    return r.prompt_eval_count


def test_capabilities_list_vision(vserver: CorralServer) -> None:
    for model, vision in (("eyes", True), ("seeing", True), ("plain", False)):
        caps = vserver.client.post("/api/show", json={"model": model}).json()["capabilities"]
        assert ("vision" in caps) is vision, (model, caps)


def test_ollama_chat_and_generate_take_images(vserver: CorralServer) -> None:
    client = ollama.Client(host=vserver.url)
    without = _ollama_tokens(client, "eyes", [])
    with_image = _ollama_tokens(client, "eyes", [B64])
    assert with_image == without + IMAGE_TOKENS
    two = _ollama_tokens(client, "eyes", [B64, B64])
    assert two == without + 2 * IMAGE_TOKENS
    plain = client.generate(model="seeing", prompt=PROMPT, options={"num_predict": 2})
    seen = client.generate(model="seeing", prompt=PROMPT, images=[B64], options={"num_predict": 2})
    assert seen.prompt_eval_count == plain.prompt_eval_count + IMAGE_TOKENS  # type: ignore[operator]


def test_a_vision_models_embeddings_come_from_a_runner_without_its_projector(
    vserver: CorralServer,
) -> None:
    r = vserver.client.post("/api/embed", json={"model": "seeing", "input": ["a", "b"]})
    assert r.status_code == 200, r.text
    assert [len(v) for v in r.json()["embeddings"]] == [64, 64]
    ps = {m["name"]: m for m in vserver.ps()}
    pid = ps["seeing:latest (embedding)"]["pid"]
    spec = json.loads(psutil.Process(pid).cmdline()[-1])  # the runner child's spec
    assert spec["embedding"] and spec["projector"] is None
    vserver.client.post("/api/generate", json={"model": "seeing", "keep_alive": 0})


def _openai(server: CorralServer, content: Any) -> dict[str, Any]:
    r = server.client.post("/v1/chat/completions", json={
        "model": "eyes", "max_tokens": 2, "messages": [{"role": "user", "content": content}],
    })  # fmt: skip
    assert r.status_code == 200, r.text
    return r.json()


def test_openai_takes_image_url_data(vserver: CorralServer) -> None:
    text = _openai(vserver, [{"type": "text", "text": PROMPT}])
    image = _openai(vserver, [
        {"type": "text", "text": PROMPT}, {"type": "image_url", "image_url": {"url": DATA_URL}},
    ])  # fmt: skip
    assert image["usage"]["prompt_tokens"] == text["usage"]["prompt_tokens"] + IMAGE_TOKENS


def test_anthropic_takes_image_blocks(vserver: CorralServer) -> None:
    def tokens(blocks: list[dict[str, Any]]) -> int:
        r = vserver.client.post("/v1/messages", json={
            "model": "eyes", "max_tokens": 2,
            "messages": [{"role": "user", "content": [{"type": "text", "text": PROMPT}, *blocks]}],
        })  # fmt: skip
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]  # the part read from the runner's cache is counted apart
        return sum(int(usage.get(k) or 0) for k in ("input_tokens", "cache_read_input_tokens"))

    source = {"type": "base64", "media_type": "image/png", "data": B64}
    assert tokens([{"type": "image", "source": source}]) == tokens([]) + IMAGE_TOKENS


def test_responses_take_input_image(vserver: CorralServer) -> None:
    def tokens(parts: list[dict[str, Any]]) -> int:
        r = vserver.client.post("/v1/responses", json={
            "model": "eyes", "max_output_tokens": 16,
            "input": [{"role": "user",
                       "content": [{"type": "input_text", "text": PROMPT}, *parts]}],
        })  # fmt: skip
        assert r.status_code == 200, r.text
        return int(r.json()["usage"]["input_tokens"])

    assert tokens([{"type": "input_image", "image_url": DATA_URL}]) == tokens([]) + IMAGE_TOKENS


def test_a_model_without_projector_refuses_images(vserver: CorralServer) -> None:
    r = vserver.client.post("/api/chat", json={
        "model": "plain", "stream": False,
        "messages": [{"role": "user", "content": PROMPT, "images": [B64]}],
    })  # fmt: skip
    assert r.status_code == 400 and "images" in r.json()["error"]
    r = vserver.client.post("/v1/chat/completions", json={
        "model": "plain", "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": DATA_URL}}]}],
    })  # fmt: skip
    assert r.status_code == 400
