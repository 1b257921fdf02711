"""Which requests may start from a copy of another slot's state (runtime/slotcopy): the
copies themselves run end to end in test_slots (a real runner, llama.cpp's timings)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from corral.core.spec import RunnerSpec
from corral.runtime.hop import Hop
from corral.runtime.kvcache import KVCache
from corral.runtime.runner import Runner
from corral.runtime.slotcopy import SlotCopier
from corral.testing import synth

CHAT = "/v1/chat/completions"
HELLO = {"messages": [{"role": "user", "content": "hello"}]}


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("slotcopy")
    return {
        "llama": synth.write_llama_model(d / "llama.gguf"),
        "swa": synth.write_swa_model(d / "swa.gguf", n_layer=6, sliding_window=128),
        "kv": d / "kv",
    }


def runner(paths: dict[str, Path], model: str = "llama", save: bool = True, **spec: Any) -> Hop:
    """The hop of a runner (not started: what a copy may be made for is decided before any
    request reaches it)."""
    return Hop.of(Runner(model, RunnerSpec(str(paths[model]), 1024, 4, kv_unified=True, **spec),
                         slot_save_path=str(paths["kv"]) if save else None))  # fmt: skip


def test_a_chat_or_one_raw_prompt_may_start_from_a_copy(paths: dict[str, Path]) -> None:
    copier = SlotCopier(KVCache(paths["kv"], 1 << 30))
    r = runner(paths)
    assert copier.wants(r, CHAT, HELLO)
    assert copier.wants(r, "/completion", {"prompt": "once upon a time"})
    assert copier.wants(r, "/completion", {"prompt": [1, 2, 3, "and then"]})  # Ollama's context


def test_what_cannot_start_from_a_copy(paths: dict[str, Path]) -> None:
    copier = SlotCopier(KVCache(paths["kv"], 1 << 30))
    r = runner(paths)
    image = {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}  # fmt: skip
    for path, payload in [
        (CHAT, image),  # its chunks are not text tokens
        (CHAT, {**HELLO, "cache_prompt": False}),
        (CHAT, {**HELLO, "n": 2}),  # the other choices run on other slots
        ("/completion", {"prompt": ["one prompt", "and another"]}),  # two tasks
        ("/completion", {"prompt": {"prompt_string": "x", "multimodal_data": []}}),
        ("/completion", {}),
    ]:
        assert not copier.wants(r, path, payload), payload
    # No slot_save_path (CORRAL_KV_CACHE_SIZE=0), a vision projector, a sliding window.
    assert not copier.wants(runner(paths, save=False), CHAT, HELLO)
    assert not copier.wants(runner(paths, projector="mmproj.gguf"), CHAT, HELLO)
    assert not copier.wants(runner(paths, "swa"), CHAT, HELLO)
