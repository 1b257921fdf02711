"""Split GGUF models (llama.cpp's gguf-split: name-00001-of-0000N.gguf): read as one model
(every part's tensors and bytes), served under one name, loaded by a real runner."""

from __future__ import annotations

from pathlib import Path

import pytest

from corral.core.gguf import GGUFError, is_later_split_part, read_model_info, split_parts
from corral.runtime.registry import Registry
from corral.testing import synth


@pytest.fixture(scope="module")
def split_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("split")
    first = synth.write_llama_model(d / "big.gguf", n_layer=4, split_max_tensors=12, seed=5)
    assert first.name == "big-00001-of-00004.gguf"
    synth.write_llama_model(d.parent / f"{d.name}-whole.gguf", n_layer=4, seed=5)
    return d


def test_a_split_model_is_read_as_one(split_dir: Path) -> None:
    first = split_dir / "big-00001-of-00004.gguf"
    whole = read_model_info(split_dir.parent / f"{split_dir.name}-whole.gguf")
    info = read_model_info(first)
    assert [p.name for p in info.files] == [f"big-0000{i}-of-00004.gguf" for i in (1, 2, 3, 4)]
    assert info.file_size == sum(p.stat().st_size for p in info.files)
    # the same model in one file: the same layers, weights and parameters
    assert info.layer_bytes == whole.layer_bytes and info.output_bytes == whole.output_bytes
    assert info.parameter_count == whole.parameter_count and info.n_layer == 4
    assert split_parts(first) == list(info.files)
    assert split_parts(split_dir / "big-00002-of-00004.gguf") == [
        split_dir / "big-00002-of-00004.gguf"
    ]
    assert is_later_split_part("big-00002-of-00004.gguf")
    assert not is_later_split_part(first) and not is_later_split_part("big.gguf")


def test_a_missing_or_broken_part_is_named(split_dir: Path, tmp_path: Path) -> None:
    for p in split_dir.iterdir():
        (tmp_path / p.name).write_bytes(p.read_bytes())
    (tmp_path / "big-00003-of-00004.gguf").unlink()
    with pytest.raises(GGUFError, match=r"part big-00003-of-00004\.gguf .* missing"):
        read_model_info(tmp_path / "big-00001-of-00004.gguf")
    (tmp_path / "big-00003-of-00004.gguf").write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x00" * 8)
    with pytest.raises(GGUFError, match=r"part big-00003-of-00004\.gguf"):
        read_model_info(tmp_path / "big-00001-of-00004.gguf")
    # a first part renamed: llama.cpp could not find the others either
    (tmp_path / "big-00001-of-00004.gguf").rename(tmp_path / "renamed.gguf")
    with pytest.raises(GGUFError, match="must be named like"):
        read_model_info(tmp_path / "renamed.gguf")


def test_the_registry_serves_one_model_from_its_first_part(split_dir: Path) -> None:
    reg = Registry(split_dir, builtin=False)
    (entry,) = reg.all()
    assert entry.name == "big:latest" and entry.path.name == "big-00001-of-00004.gguf"
    assert entry.size == sum(p.stat().st_size for p in split_dir.iterdir())


def test_a_real_runner_loads_and_serves_a_split_model(start_server, split_dir: Path) -> None:
    s = start_server(split_dir, CORRAL_BUILTIN_MODELS="0")
    (tag,) = s.client.get("/api/tags").json()["models"]
    assert tag["name"] == "big:latest"
    r = s.client.post("/api/generate", json={
        "model": "big", "prompt": "Once upon", "stream": False,
        "options": {"num_predict": 4, "temperature": 0},
    })  # fmt: skip
    assert r.status_code == 200, r.text
    assert r.json()["eval_count"] == 4
    (m,) = s.ps()
    assert m["name"] == "big:latest"
