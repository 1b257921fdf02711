"""Conversations keep their KV cache across eviction and keep-alive expiry (runtime.kvcache):
saved when a runner stops, restored when the model is loaded again and a prompt continues
them, never into another model or shape, under a size cap, corrupt files dropped; and the
tokens llama.cpp really reuses are measured, not assumed (a sliding-window model too)."""

from __future__ import annotations

import math
import os
import shutil
import struct
import time
from array import array
from pathlib import Path
from typing import Any

import pytest
from helpers import write_slot

from corral.runtime.kvcache import MIN_REUSE, ROLLBACK_SLACK, Entry, KVCache, closest
from corral.runtime.slotfile import MAGIC, CorruptEntry, common_prefix, read_tokens, token_digest
from corral.testing import synth
from corral.testing.server import CorralServer

# --------------------------------------------------------------------------- helpers


def history(turns: int, topic: str = "Rome") -> list[dict[str, str]]:
    msgs = [{"role": "system", "content": "You are a helpful assistant."}]
    for i in range(turns):
        ask = (
            f"Tell me fact number {i} about {topic}, its people, its roads and its "
            "rulers, in one long paragraph please."
        )
        fact = (
            f"Fact {i}: {topic} grew over centuries; its roads ran for hundreds of miles "
            "and its rulers governed a wide land around the sea for a very long time."
        )
        msgs += [{"role": "user", "content": ask}, {"role": "assistant", "content": fact}]
    msgs.append({"role": "user", "content": "Summarize all of that."})
    return msgs


def chat(s: CorralServer, model: str, messages: list[dict[str, str]], **extra: Any) -> dict:
    r = s.client.post("/v1/chat/completions", json={
        "model": model, "messages": messages, "max_tokens": 6, "temperature": 0,
        "logprobs": True, "top_logprobs": 3, **extra,
    })  # fmt: skip
    assert r.status_code == 200, r.text
    return dict(r.json())


def answer(resp: dict) -> str:
    return str(resp["choices"][0]["message"]["content"])


def cached(resp: dict) -> int:
    return int(resp["usage"].get("prompt_tokens_details", {}).get("cached_tokens") or 0)


def first_logprob(resp: dict) -> float:
    return float(resp["choices"][0]["logprobs"]["content"][0]["logprob"])


def resume(msgs: list[dict[str, str]], resp: dict, question: str) -> list[dict[str, str]]:
    return [*msgs, {"role": "assistant", "content": answer(resp)},
            {"role": "user", "content": question}]  # fmt: skip


def unload(s: CorralServer, model: str) -> None:
    """Unload the model (its runner saves its conversations before it stops) and wait until
    it is gone."""
    r = s.client.post("/api/generate", json={"model": model, "keep_alive": 0})
    assert r.status_code == 200, r.text
    names = {model, f"{model}:latest"}
    s.wait_for(lambda: not any(m["name"] in names for m in s.ps()), 60, "unload")


def slots(d: Path) -> list[Path]:
    return sorted(d.glob("*.slot"), key=lambda p: p.stat().st_mtime)


def log_lines(s: CorralServer, text: str) -> list[str]:
    return [ln for ln in s.log().splitlines() if text in ln]


def wait_log(s: CorralServer, text: str) -> list[str]:
    """The log lines with `text`, once there is one (what llama.cpp reused is logged once the
    runner's counters show the request's prompt read)."""
    s.wait_for(lambda: bool(log_lines(s, text)), 30, repr(text))
    return log_lines(s, text)


@pytest.fixture(scope="module")
def kv_models(models_dir: Path, gemma3: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("kv_models")
    for name in ("tiny", "tiny2"):
        shutil.copy(models_dir / f"{name}.gguf", d / f"{name}.gguf")
    # gemma3: 5 of every 6 layers see only the last 128 tokens
    synth.write_swa_model(d / "swa.gguf", n_layer=6, context_length=4096, sliding_window=128)
    (d / "gemma3.gguf").symlink_to(gemma3)  # the real one: the last 512
    return d


def kv_server(start_server: Any, models: Path, kv: Path, **env: str) -> CorralServer:
    return start_server(models, **{"CORRAL_KV_CACHE_DIR": str(kv), "CORRAL_NUM_PARALLEL": "1",
                                   **env})  # fmt: skip


# --------------------------------------------------------------------------- with real runners


def test_a_conversation_resumes_from_its_saved_cache_after_an_unload(
    start_server: Any, kv_models: Path, tmp_path: Path
) -> None:
    kv = tmp_path / "kv"
    s = kv_server(start_server, kv_models, kv)
    msgs = history(6)
    first = chat(s, "smollm2:135m", msgs)
    assert cached(first) == 0
    unload(s, "smollm2:135m")
    (saved,) = slots(kv)
    tokens = read_tokens(saved)
    assert len(tokens) >= first["usage"]["prompt_tokens"]  # the prompt and the answer
    assert log_lines(s, "kv cache: saved slot 0 of 'smollm2:135m'")

    follow = resume(msgs, first, "And what about its bridges?")
    resumed = chat(s, "smollm2:135m", follow)
    prompt = resumed["usage"]["prompt_tokens"]
    # llama.cpp took (nearly) the whole earlier prompt from the restored cache
    assert cached(resumed) >= first["usage"]["prompt_tokens"] - 8, resumed["usage"]
    (line,) = wait_log(s, "resumed a saved conversation")  # llama.cpp's count, as logged
    assert f"reused {cached(resumed)} of the prompt's {prompt} tokens" in line

    # The same request without a saved cache: the same greedy answer.
    unload(s, "smollm2:135m")
    for p in slots(kv):
        p.unlink()
    fresh = chat(s, "smollm2:135m", follow)
    assert cached(fresh) == 0
    assert answer(resumed) == answer(fresh)
    assert math.isclose(first_logprob(resumed), first_logprob(fresh), abs_tol=0.05)


def test_eviction_saves_the_conversation_and_the_reload_restores_it(
    start_server: Any, kv_models: Path, tmp_path: Path
) -> None:
    kv = tmp_path / "kv"
    # Two slots: what llama.cpp reuses is measured by a probe in the restored slot.
    s = kv_server(
        start_server, kv_models, kv, CORRAL_MAX_LOADED_MODELS="1", CORRAL_NUM_PARALLEL="2"
    )
    msgs = history(8, "Carthage")
    first = chat(s, "tiny", msgs)
    chat(s, "tiny2", history(3, "Athens"))  # evicts tiny: a load waits for its room
    s.wait_for(lambda: len(slots(kv)) == 1, 30, "tiny's conversation saved")
    resumed = chat(s, "tiny", resume(msgs, first, "And then?"))  # evicts tiny2, reloads tiny
    assert cached(resumed) >= first["usage"]["prompt_tokens"] - 8, resumed["usage"]
    (line,) = wait_log(s, "kv cache: 'tiny:latest' resumed a saved conversation")
    assert "measured on the probe" in line


def test_no_restore_into_another_model_or_another_shape(
    start_server: Any, kv_models: Path, tmp_path: Path
) -> None:
    kv = tmp_path / "kv"
    s = kv_server(start_server, kv_models, kv)
    msgs = history(8)
    first = chat(s, "tiny", msgs)
    unload(s, "tiny")
    (saved,) = slots(kv)
    follow = resume(msgs, first, "More?")

    # Another model (same tokenizer, so the prompt's tokens match the file's).
    other = chat(s, "tiny2", follow)
    assert cached(other) == 0
    # The same model with another context: another runner shape.
    r = s.client.post("/api/chat", json={
        "model": "tiny", "messages": follow, "stream": False,
        "options": {"num_ctx": 2048, "num_predict": 2, "temperature": 0},
    })  # fmt: skip
    assert r.status_code == 200, r.text
    assert r.json()["prompt_eval_count"] >= first["usage"]["prompt_tokens"]  # all evaluated
    assert not log_lines(s, "a saved conversation")  # neither restored nor resumed
    assert saved.exists()

    # The file was fine all along: the shape it was saved from restores it.
    unload(s, "tiny")
    resumed = chat(s, "tiny", follow)
    assert cached(resumed) > 0
    assert wait_log(s, "kv cache: 'tiny:latest' resumed a saved conversation")


def test_the_size_cap_removes_the_least_recently_used(
    start_server: Any, kv_models: Path, tmp_path: Path
) -> None:
    kv = tmp_path / "kv"
    # tiny's KV cache: 2 layers x 2 KV heads x 16 dims x (K + V) x f16 = 256 bytes a token,
    # so one ~800-token conversation takes ~200 KiB and two do not fit in 300 KiB.
    s = kv_server(start_server, kv_models, kv, CORRAL_KV_CACHE_SIZE="300KiB")
    chat(s, "tiny", history(10, "Rome"))
    unload(s, "tiny")
    (older,) = slots(kv)
    assert 120 * 1024 < older.stat().st_size < 300 * 1024
    chat(s, "tiny", history(10, "Sparta"))
    unload(s, "tiny")
    (newer,) = slots(kv)
    assert newer != older and not older.exists()
    assert log_lines(s, f"kv cache: removed {older.name}")


@pytest.mark.parametrize("damage", ["magic", "state", "renamed"])
def test_a_corrupt_file_is_dropped(
    start_server: Any, kv_models: Path, tmp_path: Path, damage: str
) -> None:
    kv = tmp_path / "kv"
    s = kv_server(start_server, kv_models, kv)
    msgs = history(8)
    first = chat(s, "tiny", msgs)
    unload(s, "tiny")
    (saved,) = slots(kv)
    data = saved.read_bytes()
    if damage == "magic":  # not a llama.cpp state file
        saved.write_bytes(b"XXXX" + data[4:])
    elif damage == "state":  # the header is fine, the KV state cut short: llama.cpp refuses it
        n_words = struct.unpack_from("<I", data, 8)[0]
        saved.write_bytes(data[: 12 + 4 * n_words + 16])
    else:  # its tokens are not the ones its name says
        fake = saved.with_name(saved.name.rpartition("-")[0] + "-" + "0" * 24 + ".slot")
        saved.rename(fake)
    resumed = chat(s, "tiny", resume(msgs, first, "More?"))
    assert cached(resumed) == 0
    assert log_lines(s, "kv cache: dropping")
    assert not slots(kv) or all(p.name != saved.name for p in slots(kv))


@pytest.mark.parametrize("model", ["swa", "gemma3"])
def test_a_sliding_window_model_reports_what_it_really_reuses(
    start_server: Any, kv_models: Path, tmp_path: Path, model: str
) -> None:
    """llama.cpp's sliding-window cache holds only the window: whether a restored one can be
    resumed depends on llama.cpp. corral measures it and reports that figure, whatever it is;
    the answer must be the one a fresh runner gives (random weights and Gemma 3 270M's)."""
    kv = tmp_path / "kv"
    s = kv_server(start_server, kv_models, kv, CORRAL_CONTEXT_LENGTH="2048")
    msgs = history(10)
    first = chat(s, model, msgs)
    unload(s, model)
    assert len(slots(kv)) == 1
    follow = resume(msgs, first, "More?")
    resumed = chat(s, model, follow)
    if cached(resumed) > 0:
        (line,) = wait_log(s, f"kv cache: '{model}:latest' resumed a saved conversation")
        assert f"reused {cached(resumed)} of" in line
    else:
        assert wait_log(s, "llama.cpp reused none of them")
    unload(s, model)
    for p in slots(kv):
        p.unlink()
    fresh = chat(s, model, follow)
    assert cached(fresh) == 0
    assert answer(resumed) == answer(fresh)
    assert math.isclose(first_logprob(resumed), first_logprob(fresh), abs_tol=0.05)


# --------------------------------------------------------------------------- the files


def test_read_tokens_knows_both_layouts_and_refuses_broken_files(tmp_path: Path) -> None:
    toks = [1, 9690, 198, 42]
    assert list(read_tokens(write_slot(tmp_path / "a", toks, version=4))) == toks
    assert list(read_tokens(write_slot(tmp_path / "b", toks, version=3))) == toks
    assert list(read_tokens(write_slot(tmp_path / "e", [], version=4))) == []
    (tmp_path / "short").write_bytes(b"ggsq")
    bad = write_slot(tmp_path / "magic", toks)
    bad.write_bytes(b"XXXX" + bad.read_bytes()[4:])
    long = tmp_path / "long"
    long.write_bytes(struct.pack("<III", MAGIC, 4, 10**6) + b"\0" * 100)
    odd = tmp_path / "odd"  # a layout this build does not write: refused, not guessed
    odd.write_bytes(struct.pack("<III", MAGIC, 4, 5) + array("i", [-1, 2, 1, 7, 0]).tobytes())
    for p in ("short", "magic", "long", "odd"):
        with pytest.raises(CorruptEntry):
            read_tokens(tmp_path / p)


def test_the_restore_takes_the_conversation_sharing_most_and_holding_least_past_it() -> None:
    """Of the saved conversations a prompt continues, the one sharing most of it; of those
    sharing as much, the one with the fewest tokens past the prompt (a sliding-window cache
    cannot go back from a longer one). None shares enough: nothing to restore."""
    prompt = list(range(1000))

    def entry(name: str, tokens: list[int]) -> Entry:
        return Entry(Path(name), array("i", tokens))

    longer = entry("longer", [*prompt, *range(5000, 7000)])
    exact = entry("exact", [*prompt, 7])
    less = entry("less", prompt[:900])
    for order in ([longer, exact, less], [less, exact, longer]):
        assert closest(prompt, order, 0) == (1000, exact)
    assert closest(prompt, [longer, less], 0) == (1000, longer)
    assert closest(prompt, [less], 0) == (900, less)
    assert closest(prompt, [less], 900 - MIN_REUSE + 1) is None
    assert closest(prompt, [entry("other", [-1, *prompt])], 0) is None
    assert closest(prompt, [], 0) is None
    # A cache that cannot go back: only those the prompt leaves within ROLLBACK_SLACK of their end.
    assert closest(prompt, [longer, less], 0, back=False) == (900, less)
    near = entry("near", [*prompt, *range(5000, 5000 + ROLLBACK_SLACK)])
    past = entry("past", [*prompt, *range(5000, 5001 + ROLLBACK_SLACK)])
    assert closest(prompt, [near], 0, back=False) == (1000, near)
    assert closest(prompt, [past], 0, back=False) is None
    assert closest(prompt, [past], 0) == (1000, past)


def test_common_prefix() -> None:
    a = list(range(1000))
    assert common_prefix(a, a) == 1000
    assert common_prefix(a, [*a[:700], -1]) == 700
    assert common_prefix(a[:10], a) == 10
    assert common_prefix([], a) == 0


def test_the_cap_goes_by_last_use(tmp_path: Path) -> None:
    cache = KVCache(tmp_path, max_bytes=250)
    files = []
    for i in range(3):
        toks = [i] * 10
        p = write_slot(tmp_path / f"k-{token_digest(toks)}.slot", toks, state=b"\0" * 40)
        os.utime(p, (time.time() - 100 + i, time.time() - 100 + i))
        files.append(p)
    os.utime(files[0])  # restored just now: the most recently used
    cache.enforce_cap()  # each file is 108 bytes: two fit
    assert [p.exists() for p in files] == [True, False, True]


def test_a_sliding_window_cache_cannot_go_back_so_nothing_is_restored_for_it(
    start_server: Any, kv_models: Path, tmp_path: Path
) -> None:
    """A prompt that leaves the saved tokens further back than a sliding window holds: llama.cpp
    would reuse nothing (as from the cache in memory), so corral does not restore them, and it
    keeps saving the model's conversations. The same prompt on a model whose cache goes back
    is restored."""
    kv = tmp_path / "kv"
    s = kv_server(start_server, kv_models, kv, CORRAL_CONTEXT_LENGTH="2048")
    msgs = history(10)
    # shares only the system prompt and the first turn: ~90 of the ~800 saved tokens, while the
    # sliding-window layers hold about the last 640 (the window plus a batch)
    edited = [*msgs[:3], {"role": "user", "content": "Something else: Carthage?"}]
    for _ in range(2):  # two failures in a row would stop saves if they counted
        for p in slots(kv):  # only the full conversation saved: nothing closer to restore
            p.unlink()
        chat(s, "swa", msgs)
        unload(s, "swa")
        resp = chat(s, "swa", edited)
        assert cached(resp) == 0
        unload(s, "swa")
    assert not log_lines(s, "'swa:latest' restored a saved conversation")
    assert not log_lines(s, "not saving this model's conversations")
    assert len(log_lines(s, "kv cache: saved slot 0 of 'swa:latest'")) == 4
    for p in slots(kv):
        p.unlink()
    chat(s, "tiny", msgs)
    unload(s, "tiny")
    chat(s, "tiny", edited)
    assert wait_log(s, "'tiny:latest' restored a saved conversation")


@pytest.mark.e2e
async def test_a_load_waiting_for_the_memory_is_not_held_up_by_saving(
    kv_models: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Saving before an eviction delays the load that waits for the memory: with one waiting,
    only saves within its budget are made (here none: the budget is 0); a runner stopped
    with nothing waiting saves its conversation."""
    import asyncio
    import functools
    import logging

    from corral.core.spec import RunnerSpec
    from corral.runtime import kvcache
    from corral.runtime.runner import Runner
    from corral.runtime.scheduler import Hooks, Scheduler, SchedulerConfig

    caplog.set_level(logging.INFO, "corral.runtime.kvcache")
    monkeypatch.setattr(kvcache, "WAITING_BUDGET", 0.0)
    cache = KVCache(tmp_path / "kv", 2**30)
    mib = 2**20
    sched = Scheduler(
        {"cpu": 400 * mib}, SchedulerConfig(max_loaded=1, measure_interval=3600),
        runners=functools.partial(Runner, slot_save_path=cache.slot_save_path),
        hooks=Hooks(before_stop=cache.before_stop),
    )  # fmt: skip
    prompt = " ".join(f"word{i}" for i in range(200))

    async def converse(model: str) -> None:
        spec = RunnerSpec(path=str(kv_models / f"{model}.gguf"), n_ctx=1024, num_parallel=1)
        lease = await sched.acquire(model, spec, size=100 * mib)
        try:
            answer = await lease.hop.api.post_json(
                "/completion", {"prompt": prompt, "n_predict": 2}
            )
            assert answer["tokens_evaluated"] >= 64
        finally:
            lease.release()

    try:
        await converse("tiny")
        await converse("tiny2")  # tiny is evicted for it: a load waits for the memory
        assert cache.stats["skipped_saves"] == 1 and cache.stats["saves"] == 0
        assert not list((tmp_path / "kv").glob("*.slot"))
        assert "with a load waiting" in caplog.text
        assert sched.unload("tiny2")  # nothing waits for this one
        for _ in range(100):
            if cache.stats["saves"]:
                break
            await asyncio.sleep(0.1)
        assert cache.stats["saves"] == 1 and len(list((tmp_path / "kv").glob("*.slot"))) == 1
    finally:
        await sched.shutdown()
