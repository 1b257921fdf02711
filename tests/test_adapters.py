"""LoRA adapters: a synthetic adapter GGUF (general.type = adapter) on a synthetic model, loaded
by a real runner from models.toml; its effect on greedy output shows, its scale is a shaping
option (a change reloads the runner), and its memory is in the estimate."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from helpers import parse_log

from corral.core.estimate import estimate
from corral.core.gguf import GGUFError, check_adapter, read_adapter_info, read_model_info
from corral.core.spec import Adapter
from corral.runtime.registry import Registry
from corral.testing import synth
from corral.testing.server import CorralServer

OPTIONS = {"num_predict": 8, "temperature": 0, "seed": 1}


def toml(scale: float) -> str:
    return f"""
[models.tuned]
file = "base.gguf"
adapters = [{{ file = "lora.gguf", scale = {scale} }}]

[models.off]
file = "base.gguf"
adapters = [{{ file = "lora.gguf", scale = 0.0 }}]
"""


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("lora")
    synth.write_llama_model(d / "base.gguf", seed=7)
    synth.write_lora_adapter(d / "lora.gguf", d / "base.gguf")
    synth.write_swa_model(d / "other.gguf")
    synth.write_lora_adapter(d / "other-lora.gguf", d / "other.gguf")
    (d / "models.toml").write_text(toml(1.0))
    return d


@pytest.fixture(scope="module")
def lserver(start_server, lora_dir: Path) -> CorralServer:
    return start_server(lora_dir)


def generate(server: CorralServer, model: str) -> str:
    r = server.client.post("/api/generate", json={
        "model": model, "prompt": "Tell me a story", "stream": False, "options": OPTIONS,
    })  # fmt: skip
    assert r.status_code == 200, r.text
    return str(r.json()["response"])


def pid_of(server: CorralServer, model: str) -> int:
    """The runner serving `model` (models of one file and runner shape share one)."""
    return next(int(m["pid"]) for m in server.ps() if model in m["models"])


# ---- files, registry, estimate ------------------------------------------------------------------


def test_adapter_file_is_read_and_checked(lora_dir: Path) -> None:
    a = read_adapter_info(lora_dir / "lora.gguf")
    info = read_model_info(lora_dir / "base.gguf")
    assert a.architecture == "llama" and a.alpha == 4.0
    assert sorted(a.layer_bytes) == list(range(info.n_layer)) and a.other_bytes == 0
    check_adapter(info, a)
    with pytest.raises(GGUFError, match="architecture 'gemma3'"):
        check_adapter(info, read_adapter_info(lora_dir / "other-lora.gguf"))
    with pytest.raises(GGUFError, match="not an adapter"):
        read_adapter_info(lora_dir / "base.gguf")


def test_registry_reads_adapters(lora_dir: Path) -> None:
    reg = Registry(lora_dir, builtin=False)
    tuned = reg.get("tuned")
    assert tuned is not None
    assert tuned.adapters == (Adapter(str(lora_dir / "lora.gguf"), 1.0),)
    # The adapter files models.toml names are parts, not models of their own.
    assert reg.get("lora") is None and reg.get("base") is not None


def test_estimate_books_adapters_with_their_layers(lora_dir: Path) -> None:
    info = read_model_info(lora_dir / "base.gguf")
    a = read_adapter_info(lora_dir / "lora.gguf")
    base, tuned = estimate(info, 1024), estimate(info, 1024, adapters=[a])
    assert len(tuned.adapters_per_layer) == info.n_layer
    assert all(
        t >= n for t, n in zip(tuned.adapters_per_layer, a.layer_bytes.values(), strict=True)
    )
    assert tuned.total - base.total == sum(tuned.adapters_per_layer) + tuned.adapters_other
    twice = estimate(info, 1024, adapters=[a, a])
    assert twice.total - base.total == 2 * (tuned.total - base.total)


def test_memreport_counts_lora_and_a_graph_reserved_again_once() -> None:
    log = """
load_tensors:   CPU_Mapped model buffer size =     1.14 MiB
llama_adapter_lora_init_impl: CPU_Mapped LoRA buffer size =     0.50 MiB
sched_reserve:        CPU compute buffer size =     1.64 MiB
sched_reserve:        CPU compute buffer size =     1.70 MiB
"""
    alloc = parse_log(log)
    assert alloc is not None
    assert alloc.model_bytes == round(1.14 * 2**20) + round(0.5 * 2**20)
    assert alloc.compute_bytes == round(1.70 * 2**20)


# ---- a real runner ------------------------------------------------------------------------------


def test_adapter_changes_the_output(lserver: CorralServer) -> None:
    base = generate(lserver, "base")
    tuned = generate(lserver, "tuned")
    assert tuned != base  # the adapter is applied
    assert generate(lserver, "tuned") == tuned  # deterministically
    assert generate(lserver, "off") == base  # at scale 0 it changes nothing


def test_changing_the_scale_reloads_the_runner(lserver: CorralServer, lora_dir: Path) -> None:
    tuned = generate(lserver, "tuned")
    before = pid_of(lserver, "tuned:latest")
    assert generate(lserver, "tuned") == tuned and pid_of(lserver, "tuned:latest") == before
    try:
        time.sleep(0.01)  # a new mtime for the registry's rescan
        (lora_dir / "models.toml").write_text(toml(0.0))
        assert generate(lserver, "tuned") == generate(lserver, "base")
        assert pid_of(lserver, "tuned:latest") != before
    finally:
        (lora_dir / "models.toml").write_text(toml(1.0))


def test_adapter_for_another_architecture_is_refused(lserver: CorralServer, lora_dir: Path) -> None:
    try:
        (lora_dir / "models.toml").write_text(
            toml(1.0) + '\n[models.mismatch]\nfile = "base.gguf"\nadapters = ["other-lora.gguf"]\n'
        )
        r = lserver.client.post("/api/generate", json={"model": "mismatch", "prompt": "hi"})
        assert r.status_code == 500 and "architecture 'gemma3'" in r.json()["error"]
    finally:
        (lora_dir / "models.toml").write_text(toml(1.0))
