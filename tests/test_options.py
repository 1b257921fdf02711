"""The one table of options (core/options.py): every check, mapping and runner parameter of an
option is derived from its row, and each row reaches where it says."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import pytest

from corral.api.common import check_options
from corral.api.families.ollama import protocol as ollama
from corral.api.manage import check_parameters
from corral.config import Settings
from corral.core.gguf import read_model_info
from corral.core.options import (
    MODEL_OPTIONS,
    OPTIONS,
    REQUEST_OPTIONS,
)
from corral.core.spec import Layout, RunnerSpec, runner_spec
from corral.errors import ApiError
from corral.runtime import runner_child
from corral.runtime.registry import ModelEntry, Registry
from corral.runtime.runner import Runner
from corral.testing import synth


def test_every_row_is_sound() -> None:
    assert len({o.name for o in OPTIONS}) == len(OPTIONS)
    fields = {f.name for f in dataclasses.fields(RunnerSpec)}
    for o in OPTIONS:
        assert o.request or o.model, o  # reachable from somewhere
        assert o.runner is None or o.runner in fields, o
        assert o.runner is None or o.model, o  # models.toml may set every runner option
        assert o.model is False or isinstance(o.type, type), o  # models.toml names one type
        assert not (o.runner and o.sampling), o


@pytest.mark.parametrize("name", list(REQUEST_OPTIONS))
def test_every_request_option_is_checked(name: str) -> None:
    opt = REQUEST_OPTIONS[name]
    types = opt.type if isinstance(opt.type, tuple) else (opt.type,)
    wrong = 1 if str in types else "x"
    for check, where in ((check_options, "options."), (check_parameters, "parameters.")):
        with pytest.raises(ApiError, match=f"'{where}{name}'"):
            check({name: wrong})
        lo, hi = opt.range
        if hi < math.inf:
            with pytest.raises(ApiError, match=f"'{where}{name}' must be between"):
                check({name: hi + 1})
            with pytest.raises(ApiError, match="must be between"):
                check({name: lo - 1})
            assert check({name: hi}) == {name: hi}
    assert check_options({"not_an_option": 1}) == {}  # ignored, as Ollama does


@pytest.mark.parametrize("name", list(MODEL_OPTIONS))
def test_every_model_option_is_checked_in_models_toml(tmp_path: Path, name: str) -> None:
    opt = MODEL_OPTIONS[name]
    wrong = '"x"' if opt.type is not str else "1"
    (tmp_path / "models.toml").write_text(f'[models.m]\nfile = "m.gguf"\n{name} = {wrong}\n')
    reg = Registry(tmp_path, builtin=False)
    assert reg.get("m") is None and f"models.m.{name}: expected" in reg.errors[0]
    if opt.choices:
        (tmp_path / "models.toml").write_text(f'[models.m]\nfile = "m.gguf"\n{name} = "?"\n')
        reg = Registry(tmp_path, builtin=False)
        assert reg.get("m") is None and "expected one of" in reg.errors[0]
    if opt.type is int:
        (tmp_path / "models.toml").write_text(f'[models.m]\nfile = "m.gguf"\n{name} = -1\n')
        reg = Registry(tmp_path, builtin=False)
        entry = reg.get("m")
        assert (entry is not None) == opt.negative, reg.errors


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synth.write_moe_model(tmp_path_factory.mktemp("options") / "moe.gguf")


# A value for each runner option that differs from what the spec has without it.
RUNNER_VALUES = {"num_ctx": 300, "num_batch": 64, "num_gpu": 3, "main_gpu": 1, "num_thread": 1,
                 "use_mmap": False, "use_mlock": True, "num_parallel": 3, "flash_attn": "off",
                 "n_cpu_moe": 1, "kv_cache_type": "q8_0",
                 "speculative": "ngram-simple", "draft": "/draft.gguf", "draft_max": 8,
                 "draft_min": 2}  # fmt: skip


def test_every_runner_option_shapes_the_spec(model: Path) -> None:
    runner = [o for o in OPTIONS if o.runner is not None]
    assert {o.name for o in runner} == set(RUNNER_VALUES)
    info, settings = read_model_info(model), Settings.load(environ={})
    plain, _ = runner_spec(ModelEntry("m", model), info, {}, settings, 4)
    for o in runner:
        assert o.runner is not None
        value = RUNNER_VALUES[o.name]
        own = ModelEntry("m", model, options={o.name: value})
        spec, explicit = runner_spec(own, info, {}, settings, 4)
        assert getattr(spec, o.runner) == value != getattr(plain, o.runner), o.name
        assert explicit == {"projector", "adapters"}
        if o.request:  # a request's own value wins, and pins the field
            spec, explicit = runner_spec(ModelEntry("m", model), info, {o.name: value}, settings, 4)
            assert getattr(spec, o.runner) == value and o.runner in explicit, o.name


class Recording(dict[str, Any]):
    """A runner child's spec that records which fields were read."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.read: set[str] = set()

    def __getitem__(self, key: str) -> Any:
        self.read.add(key)
        return super().__getitem__(key)

    def get(self, key: str, default: Any = None) -> Any:
        self.read.add(key)
        return super().get(key, default)


def test_every_runner_option_reaches_llama_cpp() -> None:
    pytest.importorskip("xllamacpp")
    spec = RunnerSpec("/m.gguf", 512, 1)
    child = Recording({**dataclasses.asdict(spec), "name": "m", "tensor_split": None})
    runner_child.build_params(child)
    plain = Runner("m", spec, "llama-server", Layout(0))._binary_cmd(1234)
    for o in OPTIONS:
        if o.runner is None:
            continue
        assert o.runner in child.read, o.name  # xllamacpp's parameters
        if o.runner in ("n_gpu_layers", "main_gpu"):  # llama-server's come from the layout
            continue
        changed = dataclasses.replace(spec, **{o.runner: RUNNER_VALUES[o.name]})
        cmd = Runner("m", changed, "llama-server", Layout(0))._binary_cmd(1234)
        assert cmd != plain, o.name


def test_sampling_options_reach_llama_cpp_under_their_names() -> None:
    options = {o.name: 1 for o in OPTIONS if o.sampling}
    assert ollama.sampling(options) == {o.sampling: 1 for o in OPTIONS if o.sampling}
    assert ollama.sampling({"num_predict": -2}) == {"n_predict": -1}
