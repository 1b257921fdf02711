"""Speculative decoding as a model's runner option (`speculative`): a model drafts with one of
llama.cpp's n-gram drafters by default (`auto`: ngram-mod while it pays, tests/test_drafting) or
when its models.toml entry names one, both runner kinds get it, the estimate books what
verifying drafts costs, what was drafted is counted, and the answer at temperature 0 is the same
with and without it (real SmolLM2 and Gemma 3 270M)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from helpers import NothingLearned

from corral.bench.speculative import FILE, STORY, edit
from corral.config import Settings
from corral.core.drafting import DRAFTER
from corral.core.estimate import estimate
from corral.core.gguf import read_model_info
from corral.core.options import NGRAM_MOD_MAX
from corral.core.spec import GPU_PARALLEL, RunnerSpec, runner_spec
from corral.runtime.registry import ModelEntry, Registry, smollm2_path
from corral.runtime.runner import Runner
from corral.testing import synth
from corral.testing.server import CorralServer

EDIT = edit(FILE, 0)[0][1]  # an agent's edit: a file it was shown, changed


def spec_of(entry: ModelEntry, drafter: str = "ngram-mod") -> RunnerSpec:
    settings = Settings.load(environ={})
    return runner_spec(entry, read_model_info(entry.path), {}, settings, 2, drafter=drafter)[0]


def test_a_model_drafts_by_default_or_as_it_says(tmp_path: Path) -> None:
    """`auto` drafts with what auto chose for the model (ngram-mod until it is judged not to
    pay); a model's own drafter is used, and is not auto's to turn off; an embedding model
    never drafts."""
    chat = synth.write_llama_model(tmp_path / "chat.gguf")
    embed = synth.write_bert_model(tmp_path / "embed.gguf")
    auto = spec_of(ModelEntry("chat", chat))
    assert auto.speculative == "ngram-mod" and auto.speculative_auto
    assert spec_of(ModelEntry("chat", chat), drafter="off").speculative == "off"
    own = spec_of(ModelEntry("chat", chat, options={"speculative": "ngram-simple"}))
    assert own.speculative == "ngram-simple" and not own.speculative_auto
    off = spec_of(ModelEntry("chat", chat, options={"speculative": "off"}))
    assert off.speculative == "off" and not off.speculative_auto
    asked = ModelEntry("embed", embed, options={"speculative": "ngram-mod"})
    assert spec_of(asked).speculative == "off"
    assert not spec_of(ModelEntry("e", embed)).speculative_auto


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
    """Verification batches need 1 + NGRAM_MOD_MAX output rows a slot (ngram-mod's longest draft
    as corral starts it: logits in the compute graph and the output buffer) and ngram-mod's
    table is 16 MiB: booked where a drafter is on."""
    info = read_model_info(synth.write_llama_model(tmp_path / "m.gguf"))
    off = estimate(info, 2048, 4, unified=True)
    on = estimate(info, 2048, 4, unified=True, speculative="ngram-mod")
    rows = 4 * (1 + NGRAM_MOD_MAX) * info.n_vocab * 4
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

    svc = Service(
        Settings.load(environ={}), None, NothingLearned(DRAFTER), devices, None  # type: ignore[arg-type]
    )
    for options, wide in (({}, "off"), ({"speculative": "ngram-mod"}, "ngram-mod")):
        entry = ModelEntry("m", path, options=options)
        r = Resolved("m", entry, read_model_info(path), "m")
        spec, _ = svc.admission.runner_spec(r, {})
        sizes = svc.admission.sizings(r, spec, {})
        assert sizes[0].spec.num_parallel == GPU_PARALLEL and sizes[0].spec.speculative == wide
        # the CPU's few slots: the model's choice, or auto's
        assert sizes[-1].spec.speculative == "ngram-mod"


SMOLLM2 = smollm2_path()


@pytest.mark.e2e
async def test_the_answer_at_temperature_0_is_the_same_with_drafts(real_model: Path) -> None:
    """Each real model (SmolLM2; Gemma 3 270M, sliding-window) returns an edited file with
    ngram-mod drafting and without: byte for byte the same answer, and the drafter really
    drafted (llama.cpp's timings)."""
    answers = {}
    for drafter in ("off", "ngram-mod"):
        spec = RunnerSpec(str(real_model), 4096, 1, speculative=drafter)
        runner = Runner(real_model.stem, spec)
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
            timings = out["timings"]
            assert (counts.drafted, counts.accepted) == (
                timings["draft_n"], timings["draft_n_accepted"])  # fmt: skip
        else:
            assert (counts.drafted, counts.accepted) == (0, 0)
    assert answers["off"] == answers["ngram-mod"] and len(answers["off"]) > 100


# ---- real: auto on SmolLM2 ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def auto(start_server, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    assert SMOLLM2 is not None
    d = tmp_path_factory.mktemp("automodels")
    # one file, two runners (tale's context differs): each test judges a model of its own
    (d / "models.toml").write_text(
        f'[models.smol]\nfile = "{SMOLLM2}"\n[models.tale]\nfile = "{SMOLLM2}"\nnum_ctx = 2048\n'
    )
    return start_server(d, CORRAL_BUILTIN_MODELS="0", CORRAL_CONTEXT_LENGTH="4096")


@pytest.mark.e2e
def test_auto_drafts_until_a_client_asks_for_logprobs(auto) -> None:  # type: ignore[no-untyped-def]
    """By default a model drafts (ngram-mod); a request for logprobs is served by a runner that
    does not draft (llama.cpp gives accepted drafts no probabilities: a drafting runner would
    answer them with empty alternatives), and the model stays off for a while, which /api/ps,
    `ps --verbose`'s fields and /metrics say."""
    from corral.cli.models import drafting_lines

    c = auto.client
    body = {"model": "smol", "messages": [{"role": "user", "content": EDIT}],
            "max_tokens": 120, "temperature": 0}  # fmt: skip
    r = c.post("/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    assert r.json()["timings"]["draft_n_accepted"] > 0  # it drafted the file from the prompt
    (run,) = auto.ps()
    assert run["speculative"] == "ngram-mod" and "drafting" not in run  # not judged yet
    r = c.post("/v1/chat/completions", json={**body, "logprobs": True, "top_logprobs": 2},
               timeout=300)
    assert r.status_code == 200, r.text
    entries = r.json()["choices"][0]["logprobs"]["content"]
    assert len(entries) == r.json()["usage"]["completion_tokens"]
    # every token has its alternatives: none was an accepted draft without probabilities
    assert all(len(e["top_logprobs"]) == 2 for e in entries)
    assert r.json()["timings"].get("draft_n", 0) == 0
    (run,) = auto.ps()
    assert run["speculative"] == "off"
    assert run["drafting"] == "off: a client asked for logprobs"
    assert drafting_lines([run]) == [
        "smol:latest: no drafting (auto, off: a client asked for logprobs)"
    ]
    # the model's next requests keep that runner: no reload back and forth
    r = c.post("/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200 and r.json()["timings"].get("draft_n", 0) == 0
    assert auto.ps()[0]["pid"] == run["pid"]
    metrics = c.get("/metrics").text
    assert 'corral_drafting{model="smol:latest"} 0.0' in metrics
    (item,) = [m for m in c.get("/api/corral/state").json()["models"] if m["name"] == "smol:latest"]
    assert item["drafting"] == {"on": False, "why": "a client asked for logprobs"}


def notes(words: int) -> str:
    """Unrelated words in no order: a prompt as long as an edit's that nothing copies from."""
    import random

    pick = random.Random(29).choice
    vocabulary = ("harbor", "copper", "meadow", "violin", "granite", "lantern", "orchid",
                  "pepper", "saddle", "thistle", "walnut", "zephyr", "basket", "cobalt",
                  "falcon", "juniper", "marble", "nickel", "quarry", "ribbon")  # fmt: skip
    return " ".join(pick(vocabulary) for _ in range(words))


@pytest.mark.e2e
def test_auto_judges_drafting_against_the_speed_measured_without_it(auto: CorralServer) -> None:
    """A story, which ngram-mod finds nothing to draft in, tells the model's speed without
    drafts (llama.cpp's counters, read once it ended); the edits' drafts are then judged
    against that measured speed, not an estimate, which /api/corral/state says. A step reads
    its whole context, so the story comes after as many tokens as the edit's file (within a
    square root of two: core/drafting.deep). (Whether drafting paid is the speed's to say:
    not asserted.)"""
    c = auto.client

    def item() -> dict[str, Any]:
        models = c.get("/api/corral/state").json()["models"]
        return next(m for m in models if m["name"] == "tale:latest")

    def tokens() -> dict[str, int]:
        return item()["tokens"] or {}

    def judged() -> str | None:
        return item().get("drafting", {}).get("why")

    long_story = f"Notes to ignore: {notes(1050)}\n\n{STORY}"  # 1,350 tokens; the edit 1,490
    story = {"model": "tale", "messages": [{"role": "user", "content": long_story}],
             "max_tokens": 200, "temperature": 0}  # fmt: skip
    r = c.post("/v1/chat/completions", json=story, timeout=300)
    assert r.status_code == 200, r.text
    told = r.json()["usage"]["completion_tokens"]
    assert told >= 128 and r.json()["timings"].get("draft_n", 0) == 0  # nothing to copy
    # the measure reads the runner's counters with the story's end alone in them
    auto.wait_for(lambda: tokens().get("generated", 0) >= told, 30, "the story to be counted")
    body = {"model": "tale", "messages": [{"role": "user", "content": EDIT}],
            "max_tokens": 400, "temperature": 0}  # fmt: skip

    for _ in range(4):  # MIN_DRAFTED drafted tokens: an edit or two
        r = c.post("/v1/chat/completions", json=body, timeout=300)
        assert r.status_code == 200 and r.json()["timings"]["draft_n"] > 0, r.text
        told += r.json()["usage"]["completion_tokens"]
        auto.wait_for(lambda n=told: tokens().get("generated", 0) >= n, 30, "the edit's count")
        if judged() is not None:
            break
    why = judged()
    assert why is not None and why.endswith(" measured without"), why
