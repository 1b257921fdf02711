"""Runner options (num_batch, num_thread, use_mmap, use_mlock, flash_attn, num_gpu, main_gpu,
n_cpu_moe) from models.toml and Ollama's options: parsed, bounded, passed to llama.cpp (the
xllamacpp parameters and llama-server's flags), and shaping the runner (a change reloads)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from helpers import NothingLearned

from corral.api.service import Resolved, Service
from corral.config import Settings
from corral.core.gguf import read_model_info
from corral.core.options import CLAMPED
from corral.core.spec import Adapter, Estimates, Layout, RunnerSpec, spec_estimate
from corral.runtime import runner_child
from corral.runtime.devices import cpu_cores
from corral.runtime.hop import RunnerClient
from corral.runtime.registry import ModelEntry, Registry
from corral.runtime.runner import GOMP_SPINCOUNT, Runner, runner_env
from corral.testing import synth
from corral.testing.server import CorralServer


@pytest.fixture(scope="module")
def opt_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("options")
    synth.write_llama_model(d / "base.gguf", seed=8)
    (d / "models.toml").write_text(
        """
[models.shaped]
file = "base.gguf"
num_batch = 64
num_thread = 1
use_mmap = false
use_mlock = false
flash_attn = "off"
n_cpu_moe = 1
main_gpu = 0
devices = ["CPU"]

[models.fa-off-q8]
file = "wide.gguf"
flash_attn = "off"
kv_cache_type = "q8_0"
"""
    )
    synth.write_llama_model(d / "wide.gguf", n_embd=128, n_head=4, n_head_kv=4, seed=9)
    return d


# ---- models.toml ------------------------------------------------------------------------------


def test_models_toml_options_and_devices(opt_dir: Path) -> None:
    e = Registry(opt_dir, builtin=False).get("shaped")
    assert e is not None
    assert dict(e.options) == {
        "num_batch": 64, "num_thread": 1, "use_mmap": False, "use_mlock": False,
        "flash_attn": "off", "n_cpu_moe": 1, "main_gpu": 0,
    }  # fmt: skip
    assert e.devices == ("cpu",)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('use_mmap = "no"', "use_mmap: expected bool"),
        ("num_batch = true", "num_batch: expected int"),
        ('flash_attn = "maybe"', "flash_attn: expected one of"),
        ("num_thread = -2", "num_thread: must not be negative"),
        ("devices = []", "devices: expected a list"),
        ("adapters = [{ file = 3 }]", "adapters[0].file: expected a path"),
        ('adapters = [{ file = "a.gguf", scale = "x" }]', "adapters[0].scale: expected a number"),
        ("projector = 1", "projector: expected a path"),
    ],
)
def test_models_toml_errors_name_the_field(tmp_path: Path, line: str, message: str) -> None:
    synth.write_llama_model(tmp_path / "m.gguf")
    (tmp_path / "models.toml").write_text(f'[models.bad]\nfile = "m.gguf"\n{line}\n')
    reg = Registry(tmp_path, builtin=False)
    assert reg.get("bad") is None
    assert any(message in err for err in reg.errors), reg.errors


def test_flash_attn_true_means_on(tmp_path: Path) -> None:
    synth.write_llama_model(tmp_path / "m.gguf")
    (tmp_path / "models.toml").write_text('[models.fa]\nfile = "m.gguf"\nflash_attn = true\n')
    assert Registry(tmp_path, builtin=False).get("fa").options["flash_attn"] == "on"  # type: ignore[union-attr]


# ---- the runner spec: defaults, request options, bounds ---------------------------------------


def service() -> Service:
    return Service(
        Settings.load(environ={}), None, NothingLearned(), [], RunnerClient()  # type: ignore[arg-type]
    )


def resolved(path: Path, **entry: Any) -> Resolved:
    return Resolved("m", ModelEntry("m:latest", path, **entry), read_model_info(path), "m:latest")


def test_spec_takes_model_defaults_then_request_options(opt_dir: Path) -> None:
    e = Registry(opt_dir, builtin=False).get("shaped")
    assert e is not None
    r = Resolved("shaped", e, read_model_info(e.path), e.name)
    spec, explicit = service().admission.runner_spec(r, {})
    assert (spec.n_batch, spec.threads, spec.use_mmap, spec.use_mlock) == (64, 1, False, False)
    assert (spec.flash_attn, spec.n_cpu_moe, spec.main_gpu) == ("off", 0, 0)  # no experts
    assert explicit == {"projector", "adapters"}  # the model's parts always match
    spec, explicit = service().admission.runner_spec(
        r, {"num_batch": 128, "use_mmap": True, "use_mlock": True, "num_thread": 1}
    )
    assert (spec.n_batch, spec.use_mmap, spec.use_mlock) == (128, True, True)
    assert {"n_batch", "use_mmap", "use_mlock", "threads"} <= explicit


def test_values_that_would_harm_other_clients_are_bounded(opt_dir: Path) -> None:
    r = resolved(opt_dir / "base.gguf", options={"n_cpu_moe": 1})
    lo, hi = CLAMPED["n_batch"]
    assert service().admission.runner_spec(r, {"num_batch": 1})[0].n_batch == lo
    assert service().admission.runner_spec(r, {"num_batch": 65536})[0].n_batch == hi
    assert service().admission.runner_spec(r, {"num_thread": 1024})[0].threads == cpu_cores()
    assert service().admission.runner_spec(r, {})[0].n_cpu_moe == 0  # no experts: nothing to keep
    moe = resolved(synth.write_moe_model(opt_dir / "moe.gguf"), options={"n_cpu_moe": 99})
    assert service().admission.runner_spec(moe, {})[0].n_cpu_moe == moe.info.n_layer


def test_parts_go_into_the_spec(opt_dir: Path, tmp_path: Path) -> None:
    proj = synth.write_projector(tmp_path / "mmproj.gguf", 64)
    lora = synth.write_lora_adapter(tmp_path / "lora.gguf", opt_dir / "base.gguf")
    r = resolved(opt_dir / "base.gguf", projector=proj, adapters=(Adapter(str(lora), 0.5),))
    spec, _ = service().admission.runner_spec(r, {})
    assert spec.projector == str(proj) and spec.adapters == (Adapter(str(lora), 0.5),)


def test_an_estimate_is_computed_once_per_model_file_and_shape(opt_dir: Path) -> None:
    info = read_model_info(opt_dir / "base.gguf")
    spec = RunnerSpec(str(opt_dir / "base.gguf"), 512, 1)
    estimates = Estimates()
    first = estimates.get(info, spec)
    assert first == spec_estimate(info, spec)
    assert estimates.get(info, spec) is first
    # A file read again (a new ModelInfo) or another shape is estimated afresh.
    assert estimates.get(dataclasses.replace(info), spec) is not first
    assert estimates.get(info, dataclasses.replace(spec, n_ctx=1024)).total > first.total


# ---- what llama.cpp is given --------------------------------------------------------------------


def payload(spec: RunnerSpec, n_gpu_layers: int = 0) -> dict[str, Any]:
    from dataclasses import asdict

    return {**asdict(spec), "n_gpu_layers": n_gpu_layers, "main_gpu": None,
            "tensor_split": [1.0, 1.0], "name": "m"}  # fmt: skip


def test_xllamacpp_parameters(tmp_path: Path) -> None:
    import xllamacpp as x

    spec = RunnerSpec(
        path="/m.gguf", n_ctx=512, num_parallel=2, projector="/mmproj.gguf",
        adapters=(Adapter("/a.gguf", 0.5), Adapter("/b.gguf", 2.0)), n_batch=64,
        use_mmap=False, use_mlock=True, flash_attn="off", n_cpu_moe=2,
    )  # fmt: skip
    p = runner_child.build_params(payload(spec))
    assert p.mmproj.path == "/mmproj.gguf" and p.mmproj_use_gpu is False  # no layers on a GPU
    assert [(a.path, a.scale) for a in p.lora_adapters] == [("/a.gguf", 0.5), ("/b.gguf", 2.0)]
    assert (p.n_batch, p.n_ubatch) == (64, 64)
    assert p.load_mode == x.llama_load_mode.LLAMA_LOAD_MODE_MLOCK
    assert p.flash_attn_type == x.llama_flash_attn_type.LLAMA_FLASH_ATTN_TYPE_DISABLED
    assert (
        p.tensor_buft_overrides.count("=CPU") == 2 and "blk\\.1\\.ffn_" in p.tensor_buft_overrides
    )
    assert runner_child.build_params(payload(spec, n_gpu_layers=3)).mmproj_use_gpu is True
    plain = runner_child.build_params(
        payload(RunnerSpec(path="/m.gguf", n_ctx=512, num_parallel=1))
    )
    assert plain.load_mode == x.llama_load_mode.LLAMA_LOAD_MODE_AUTO and not plain.lora_adapters
    assert plain.flash_attn_type == x.llama_flash_attn_type.LLAMA_FLASH_ATTN_TYPE_AUTO
    assert runner_child.load_mode(True, None) == 1 and runner_child.load_mode(None, True) == 3
    with pytest.raises(ValueError, match="flash_attn"):
        runner_child.build_params(payload(RunnerSpec("/m.gguf", 512, 1, flash_attn="fast")))


def test_llama_server_flags() -> None:
    spec = RunnerSpec(
        path="/m.gguf", n_ctx=512, num_parallel=1, projector="/mmproj.gguf",
        adapters=(Adapter("/a.gguf", 0.5),), n_batch=64, use_mmap=False, use_mlock=True,
        flash_attn="on", n_cpu_moe=2,
    )  # fmt: skip
    cmd = " ".join(Runner("m", spec, "llama-server", Layout(0))._binary_cmd(1234))
    for flag in ("--mmproj /mmproj.gguf --no-mmproj-offload", "--lora-scaled /a.gguf:0.5",
                 "-b 64 -ub 64", "--mlock", "--no-mmap", "-fa on", "--n-cpu-moe 2"):  # fmt: skip
        assert flag in cmd, (flag, cmd)
    on_gpu = " ".join(Runner("m", spec, "llama-server", Layout(5))._binary_cmd(1234))
    assert "--no-mmproj-offload" not in on_gpu


def test_runner_environment() -> None:
    layout = Layout(0, env=(("CUDA_VISIBLE_DEVICES", "1"),))
    env = runner_env({"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "0,1"}, layout.env)
    assert env["PATH"] == "/bin" and env["GGML_NO_BACKTRACE"] == "1"
    assert env["CUDA_VISIBLE_DEVICES"] == "1"  # the layout's GPUs, not corral's
    assert "GOMP_SPINCOUNT" not in env  # alone: llama.cpp's (libgomp's) long spin
    short = runner_env({}, (), short_spin=True)
    assert short["GOMP_SPINCOUNT"] == GOMP_SPINCOUNT and int(GOMP_SPINCOUNT) < 300_000
    # How OpenMP threads wait is the user's call once they make it.
    assert runner_env({"GOMP_SPINCOUNT": "300000"}, (), True)["GOMP_SPINCOUNT"] == "300000"
    assert "GOMP_SPINCOUNT" not in runner_env({"OMP_WAIT_POLICY": "active"}, (), True)


# ---- a real runner: the options reach it and shape it ---------------------------------------


@pytest.fixture(scope="module")
def oserver(start_server, opt_dir: Path) -> CorralServer:
    return start_server(opt_dir)


def test_the_shaped_model_loads_with_its_options(oserver: CorralServer) -> None:
    r = oserver.client.post("/api/generate", json={
        "model": "shaped", "prompt": "hi", "stream": False, "options": {"num_predict": 2},
    })  # fmt: skip
    assert r.status_code == 200, r.text
    shaped = next(m for m in oserver.ps() if m["name"] == "shaped:latest")
    assert [d["id"] for d in shaped["devices"]] == ["cpu"]


def test_flash_attention_off_with_a_quantized_cache_is_refused(oserver: CorralServer) -> None:
    r = oserver.client.post("/api/generate", json={"model": "fa-off-q8", "prompt": "hi"})
    assert r.status_code == 400 and "needs flash attention" in r.json()["error"]


def test_a_request_option_that_shapes_the_runner_reloads_it(oserver: CorralServer) -> None:
    def run(options: dict[str, Any]) -> int:
        r = oserver.client.post("/api/generate", json={
            "model": "base", "prompt": "hi", "stream": False,
            "options": {"num_predict": 2, **options},
        })  # fmt: skip
        assert r.status_code == 200, r.text
        return next(int(m["pid"]) for m in oserver.ps() if m["name"] == "base:latest")

    first = run({})
    assert run({"temperature": 0.5}) == first  # sampling options do not shape the runner
    batched = run({"num_batch": 128})
    assert batched != first
    assert run({"num_batch": 128}) == batched
    assert run({"use_mmap": False}) != batched
    unlocked = run({"use_mlock": False})
    assert run({"use_mlock": False}) == unlocked
