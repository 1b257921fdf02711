"""Model discovery: files, names, models.toml."""

from __future__ import annotations

import os
from pathlib import Path

from corral.runtime.registry import BUILTIN_NAME, Registry, canonical_name


def test_canonical_names() -> None:
    assert canonical_name("Foo") == "foo:latest"
    assert canonical_name("foo:latest") == "foo:latest"
    assert canonical_name("smollm2:135m") == "smollm2:135m"
    assert canonical_name("ns/model") == "ns/model:latest"
    assert canonical_name("host:5000/ns/model") == "host:5000/ns/model:latest"


def test_files_are_served_by_stem_and_new_files_appear(tmp_path: Path) -> None:
    (tmp_path / "alpha.gguf").write_bytes(b"x")
    reg = Registry(tmp_path, builtin=False)
    assert [e.name for e in reg.all()] == ["alpha:latest"]
    assert reg.get("alpha") is reg.get("ALPHA:latest")
    assert reg.get("beta") is None
    (tmp_path / "beta.gguf").write_bytes(b"x")
    os.utime(tmp_path, ns=(1, 10**18))  # make sure the directory's mtime moves
    assert reg.get("beta") is not None


def test_builtin_model_is_listed(tmp_path: Path) -> None:
    reg = Registry(tmp_path, builtin=True)
    entry = reg.get(BUILTIN_NAME)
    assert entry is not None and entry.path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_models_toml(tmp_path: Path) -> None:
    (tmp_path / "weights.gguf").write_bytes(b"x")
    (tmp_path / "models.toml").write_text(
        '[models."chat:7b"]\nfile = "weights.gguf"\nnum_ctx = 8192\nnum_parallel = 2\n'
        'keep_alive = "30m"\naliases = ["chat"]\npinned = true\npriority = 3\n'
    )
    reg = Registry(tmp_path, builtin=False)
    e = reg.get("chat:7b")
    assert e is not None and e.path == tmp_path / "weights.gguf"
    assert e.options == {"num_ctx": 8192, "num_parallel": 2}
    assert e.keep_alive == 1800 and e.pinned and e.priority == 3
    assert reg.get("chat") is e  # alias
    assert reg.get("weights") is not None  # the file is still served by its stem too


def test_bad_models_toml_is_reported_not_fatal(tmp_path: Path) -> None:
    (tmp_path / "ok.gguf").write_bytes(b"x")
    (tmp_path / "models.toml").write_text("[models.bad]\nfile = 5\n")
    reg = Registry(tmp_path, builtin=False)
    assert reg.get("ok") is not None
    assert reg.errors and "models.bad.file" in reg.errors[0]


def test_a_models_nodes_are_read_with_it(tmp_path: Path) -> None:
    """models.toml `nodes` (cluster mode's pins) is read by the registry with the rest of the
    entry, and a malformed one is reported as any other key is."""
    (tmp_path / "w.gguf").write_bytes(b"x")
    (tmp_path / "models.toml").write_text(
        '[models.pinned]\nfile = "w.gguf"\nnodes = ["gpu1", "gpu2"]\n'
        '[models.free]\nfile = "w.gguf"\n'
        '[models.bad]\nfile = "w.gguf"\nnodes = "gpu1"\n'
    )
    reg = Registry(tmp_path, builtin=False)
    pinned, free = reg.get("pinned"), reg.get("free")
    assert pinned is not None and pinned.nodes == ("gpu1", "gpu2")
    assert free is not None and free.nodes == ()
    assert reg.get("bad") is None and any("models.bad.nodes" in e for e in reg.errors)


def test_names_of_one_file_and_runner_shape_share_a_runner(tmp_path: Path) -> None:
    (tmp_path / "base.gguf").write_bytes(b"x")
    os.utime(tmp_path / "base.gguf", (1e9, 1e9))  # made first
    os.symlink(tmp_path / "base.gguf", tmp_path / "link.gguf")  # the same file by another path
    (tmp_path / "models.toml").write_text(
        '[models.alias]\nfile = "base.gguf"\n'
        '[models.wide]\nfile = "base.gguf"\nnum_ctx = 8192\n'
        '[models.wider]\nfile = "base.gguf"\nnum_ctx = 8192\n'
    )
    reg = Registry(tmp_path, builtin=False)
    by = {e.name: reg.runner_name(e.name) for e in reg.all()}
    # one file, no runner options of its own: one runner, known by the first name made (the
    # file's time for all three: then by name)
    assert by["alias:latest"] == by["link:latest"] == by["base:latest"] == "alias:latest"
    # its own context: a runner of its own, shared with the name of the same shape
    assert by["wide:latest"] == by["wider:latest"] == "wide:latest"
    assert reg.sharing("alias:latest") == ["alias:latest", "base:latest", "link:latest"]
    assert reg.runner_name("BASE") == "alias:latest"


def test_a_model_with_rules_of_its_own_keeps_its_own_runner(tmp_path: Path) -> None:
    (tmp_path / "base.gguf").write_bytes(b"x")
    (tmp_path / "models.toml").write_text(
        '[models.fixed]\nfile = "base.gguf"\nkeep_alive = "30s"\nkeep_alive_fixed = true\n'
        '[models.pinned]\nfile = "base.gguf"\npinned = true\n'
    )
    reg = Registry(tmp_path, builtin=False)
    assert reg.runner_name("fixed") == "fixed:latest"  # clients of "base" cannot change it
    assert reg.runner_name("pinned") == "pinned:latest"
    assert reg.runner_name("base") == "base:latest"
