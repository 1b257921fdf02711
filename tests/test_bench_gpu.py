"""`corral bench gpu` (corral.bench.gpu) without a GPU: its log reading exactly, and its
plumbing end to end on the CPU with tiny models: the sections that run anywhere produce their
tables, the GPU-only ones say why they did not run, and (with a stand-in for the other program
on the card) the shared-card and out-of-memory sections run their requests and tables too."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from corral.bench import gpu, gpu_machine
from corral.bench.common import Section, Table

MIB = 2**20

LOG = """\
2026-11-28 01:49:49,084 INFO corral.runtime.scheduler: loading model 'a:latest' (runner 1): \
booked 101.2 MiB on cpu, 2048.0 MiB on cuda:0
2026-11-28 01:49:49,100 DEBUG corral.runtime.runner: [a:latest] load_tensors:   CPU_Mapped \
model buffer size =    10.00 MiB
2026-11-28 01:49:49,101 DEBUG corral.runtime.runner: [a:latest] load_tensors:        CUDA0 \
model buffer size =  1000.00 MiB
2026-11-28 01:49:49,102 DEBUG corral.runtime.runner: [a:latest] llama_kv_cache:      CUDA0 \
KV buffer size =   512.00 MiB
2026-11-28 01:49:49,103 DEBUG corral.runtime.runner: [b:latest] llama_kv_cache:      CUDA0 \
KV buffer size =   999.00 MiB
2026-11-28 01:49:49,104 DEBUG corral.runtime.runner: [a:latest] ggml-cuda.cu:109: CUDA error
2026-11-28 01:49:50,000 ERROR corral.runtime.scheduler: runner for model 'a:latest' was killed \
by signal 6
2026-11-28 01:49:50,001 WARNING corral.runtime.scheduler: loading 'a:latest' ran out of memory: \
placing its requests again
2026-11-28 01:49:50,002 INFO corral.runtime.scheduler: loading model 'a:latest' waits: other \
programs leave corral's runners only 1.0 GiB
2026-11-28 01:49:51,000 INFO corral.runtime.scheduler: loading model 'a:latest' (runner 2): \
booked 3000.0 MiB on cpu
2026-11-28 01:49:52,000 INFO corral.runtime.scheduler: unloading model 'b:latest' (runner 3): \
evicted for 'a:latest'
"""


def test_reads_what_corral_booked_at_each_load() -> None:
    loads = gpu_machine.booked_lines(LOG)
    assert [(b["model"], b["runner"]) for b in loads] == [("a:latest", 1), ("a:latest", 2)]
    assert loads[0]["devices"] == {"cpu": round(101.2 * MIB), "cuda:0": 2048 * MIB}
    assert gpu_machine.booked_lines(LOG, "a")[-1]["devices"] == {"cpu": 3000 * MIB}
    assert gpu_machine.booked_lines(LOG, "b") == []


def test_reads_llama_cpp_buffers_of_one_runner_from_its_lines() -> None:
    # The second load logged no buffers (yet): what the last load allocated is nothing.
    assert gpu_machine.runner_buffers(LOG, "a", ["cpu", "cuda:0"]) == {}
    first = LOG.split("loading model 'a:latest' (runner 2)")[0]
    # b's line is not a's; CPU_Mapped weights are system memory.
    assert gpu_machine.runner_buffers(first, "a", ["cpu", "cuda:0"]) == {
        "cpu": 10 * MIB, "cuda:0": 1512 * MIB,
    }  # fmt: skip


def test_finds_what_corral_did_and_what_went_wrong() -> None:
    did = gpu_machine.what_corral_did(LOG)
    assert did["loads"] == ["a:latest: 101 MiB on cpu, 2.00 GiB on cuda:0",
                            "a:latest: 2.93 GiB on cpu"]  # fmt: skip
    assert did["unloads"] == ["b:latest: evicted for 'a:latest'"]
    assert did["waits"] == ["a:latest: other programs leave corral's runners only 1.0 GiB"]
    assert did["oom_retries"] == ["a:latest"]
    bad = gpu_machine.trouble(LOG)
    # corral's own lines, not the runner's output it repeats at debug level
    assert len(bad) == 2 and "killed by signal 6" in bad[0] and "ran out of memory" in bad[1]


def test_models_toml_and_figures() -> None:
    entry = {"file": "/m/a b.gguf", "num_ctx": 2048, "num_parallel": 4}
    text = gpu_machine.models_toml({"x-1": entry})
    assert text.splitlines() == [
        '[models."x-1"]', 'file = "/m/a b.gguf"', "num_ctx = 2048", "num_parallel = 4",
    ]  # fmt: skip
    assert gpu_machine.ratio(110, 100) == "1.100x" and gpu_machine.ratio(None, 100) == "-"
    assert gpu_machine.gib(3 * 2**30) == "3.00 GiB" and gpu_machine.gib(5 * MIB) == "5 MiB"
    table = Table("t", ["a"] * 7)
    level = gpu_machine.Level(1, 2.0, 100, [0.5, 0.1, 0.2])
    gpu.speed_rows(table, [1, 64], {"corral": {1: level}}, {})
    assert table.rows[0][:5] == ["1", "50", "-", "-", "200 ms"]
    assert table.rows[1][:3] == ["64", "-", "-"]


def test_results_are_written_as_a_section_goes(tmp_path: Path) -> None:
    results = gpu.Results(tmp_path)
    sec = Section("placement", "P", tables=[Table("t", ["x"], [["1"]])])
    results.save(sec)
    assert json.loads((tmp_path / "02-placement.json").read_text())["tables"][0]["rows"] == [["1"]]
    assert not (tmp_path / "gpu.md").exists()  # appended only once the section ends
    results.done(sec)
    assert "| 1 |" in (tmp_path / "gpu.md").read_text()


def _run(tmp_path: Path, sections: tuple[str, ...], gpu_here: bool) -> dict[str, dict]:
    from corral.bench.llama_build import find_llama_server

    binary, _ = find_llama_server()  # the CPU build the other benches use, or corral's own
    out = tmp_path / "out"
    done = gpu.run(
        out, binary, gpu_machine.SMOKE, tmp_path / "models", tmp_path / "work", 600.0,
        sections=sections, gpu=gpu_here, say=lambda m: None,
    )  # fmt: skip
    assert [s.name for s in done] == list(sections)
    text = (out / "gpu.md").read_text()
    for name in sections:
        assert f"## {gpu_machine.TITLES[name]}" in text
        assert (out / f"{gpu_machine.SECTIONS.index(name) + 1:02d}-{name}.json").is_file()
    return {s.name: s.to_json() for s in done}


@pytest.mark.e2e
def test_plumbing_on_the_cpu(tmp_path: Path) -> None:
    secs = _run(tmp_path, gpu_machine.SECTIONS, gpu_here=False)
    for name in ("devices", "placement", "speed"):
        assert secs[name]["error"] is None, secs[name]["error"]
        assert secs[name]["tables"] and all(t["rows"] for t in secs[name]["tables"]), name
    assert secs["devices"]["tables"][0]["rows"][0][0] == "cpu"
    per_device, loads = secs["placement"]["tables"]
    assert [r[1] for r in loads["rows"]] == ["200"] * 3
    assert {r[2] for r in per_device["rows"]} == {"cpu"}
    for row in per_device["rows"]:  # booked at load, llama.cpp's buffers, real: all read
        assert row[3] != "-" and row[4] != "-" and row[6] != "-", row
    (speed,) = secs["speed"]["tables"]
    assert [r[0] for r in speed["rows"]] == ["1", "2"] and speed["rows"][0][1] != "-"
    for name in ("shared", "oom"):
        assert secs[name]["tables"] == [] and gpu_machine.NO_GPU in secs[name]["notes"][0]


class OtherProgram:
    """Stands in for the process that holds the card (there is no card here)."""

    def __init__(self, log: Path) -> None:
        self.calls: list[str] = []

    def hold(self, keep: int) -> tuple[int, int]:
        self.calls.append(f"hold {keep}")
        return 100 * MIB, keep

    def release(self) -> int:
        self.calls.append("release")
        return 0

    def stop(self) -> None:
        pass


@pytest.mark.e2e
def test_shared_card_and_out_of_memory_sections_with_a_stand_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gpu, "Hog", OtherProgram)
    monkeypatch.setattr(gpu, "torch_here", lambda: True)
    secs = _run(tmp_path, ("shared", "oom"), gpu_here=True)
    shared, oom = secs["shared"], secs["oom"]
    assert shared["error"] is None and oom["error"] is None, (shared["error"], oom["error"])
    requests = next(t for t in shared["tables"] if t["title"].startswith("Requests"))
    assert [(r[0], r[1], r[2]) for r in requests["rows"]] == [
        ("two at once", "shared-a", "200"), ("two at once", "shared-b", "200"),
        ("then a third", "shared-c", "200"),
    ]  # fmt: skip
    assert any(t["title"].startswith("Loaded at the end") for t in shared["tables"])
    assert [b["title"] for b in shared["blocks"]][:1] == ["What corral logged"]
    cases = oom["tables"][0]["rows"]
    assert [(r[1], r[2]) for r in cases] == [("oom-a", "200"), ("oom-b", "200")]
    assert all(r[4] != "-" for r in cases)  # each load's booking was read from the log
