"""Pulling models from Hugging Face, against a stand-in hub (tests/hubstub.py) that
huggingface_hub reaches through HF_ENDPOINT; driven with the real `ollama` client."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import ollama
import pytest
from hubstub import FakeHub

from corral.runtime import hub as pull
from corral.runtime.store import STORE_DIR
from corral.testing import synth
from corral.testing.server import CorralServer

REPO = "corral-test/Tiny-GGUF"
Q4, Q8, MMPROJ = "Tiny-Q4_K_M.gguf", "Tiny-Q8_0.gguf", "mmproj-Tiny-F16.gguf"


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("hubfiles")
    out = {
        Q4: synth.write_llama_model(d / Q4, seed=21),
        Q8: synth.write_llama_model(d / Q8, n_layer=3, seed=22),
        # one model per test that downloads, so that no test finds its blob already there
        "resume": synth.write_llama_model(d / "resume.gguf", seed=23),
        "retry": synth.write_llama_model(d / "retry.gguf", seed=24),
        "corrupt": synth.write_llama_model(d / "corrupt.gguf", seed=25),
        "chat": synth.write_llama_model(d / "chat.gguf", seed=26),
        "cli": synth.write_llama_model(d / "cli.gguf", seed=27),
        "router": synth.write_llama_model(d / "router.gguf", seed=28),
        "leave": synth.write_llama_model(d / "leave.gguf", seed=29),
        "run": synth.write_llama_model(d / "run.gguf", seed=30),
    }
    split = d / "split"
    split.mkdir()
    first = synth.write_llama_model(split / "Big-Q4_K_M.gguf", n_layer=4, split_max_tensors=12)
    out["split"] = first
    projector = getattr(synth, "write_projector", None)
    if projector is not None:
        out[MMPROJ] = projector(d / MMPROJ, text_n_embd=64)
    else:  # any small GGUF is a file to pull
        out[MMPROJ] = synth.write_bert_model(d / MMPROJ)
    return out


@pytest.fixture(scope="module")
def hub(files: dict[str, Path]) -> Iterator[FakeHub]:
    with FakeHub() as h:
        h.add_repo(REPO, {Q4: files[Q4], Q8: files[Q8], MMPROJ: files[MMPROJ],
                          "README.md": b"# a test repo\n"})  # fmt: skip
        for key in ("resume", "retry", "corrupt", "chat", "cli", "router", "leave", "run"):
            h.add_repo(f"corral-test/{key}-GGUF", {f"{key}-Q4_K_M.gguf": files[key]})
        parts = {p.name: p for p in files["split"].parent.iterdir()}
        h.add_repo("corral-test/Big-GGUF", parts)
        h.add_repo("corral-test/Broken-GGUF", dict(sorted(parts.items())[:3]))  # one missing
        yield h


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("pullmodels")


@pytest.fixture(scope="module")
def server(start_server, hub: FakeHub, models: Path, tmp_path_factory) -> CorralServer:
    hf_home = tmp_path_factory.mktemp("hf_home")
    return start_server(
        models, HF_ENDPOINT=hub.url, HF_HOME=str(hf_home), HF_HUB_DISABLE_TELEMETRY="1",
        CORRAL_BUILTIN_MODELS="0",
    )  # fmt: skip


@pytest.fixture()
def client(server: CorralServer, hub: FakeHub) -> Iterator[ollama.Client]:
    hub.reset()
    with ollama.Client(server.url) as c:
        yield c


def names(client: ollama.Client) -> set[str]:
    return {m.model or "" for m in client.list().models}


def blobs(models: Path) -> set[str]:
    return {p.name for p in (models / STORE_DIR / "blobs").glob("*")}


def partials(models: Path) -> list[Path]:
    return list((models / STORE_DIR / "partial").glob("*.partial"))


# ---- names and choices (pure) ----------------------------------------------------------------
def test_names_as_ollama_takes_them() -> None:
    n = pull.parse_name("hf.co/bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M")
    assert (n.host, n.repo, n.quant) == ("hf.co", "bartowski/Llama-3.2-1B-Instruct-GGUF", "Q4_K_M")
    assert n.model_name == "hf.co/bartowski/llama-3.2-1b-instruct-gguf:q4_k_m"
    n = pull.parse_name("https://huggingface.co/owner/repo")
    assert (n.host, n.quant, n.model_name) == ("huggingface.co", None,
                                               "huggingface.co/owner/repo:latest")  # fmt: skip
    for bad in ("llama3.2", "hf.co/onlyowner", "registry.ollama.ai/library/llama3"):
        with pytest.raises(pull.PullError) as e:
            pull.parse_name(bad)
        assert e.value.status == 400 and "hf.co/{owner}/{repo}" in e.value.message


def test_choosing_the_file() -> None:
    files = ["m-Q4_K_S.gguf", "m-Q4_K_M.gguf", "m-Q8_0.gguf", "mmproj-m-f16.gguf",
             "mmproj-m-q8_0.gguf", "README.md"]  # fmt: skip
    assert pull.choose(files, None) == ("m-Q4_K_M.gguf", "mmproj-m-f16.gguf")
    assert pull.choose(files, "q8_0") == ("m-Q8_0.gguf", "mmproj-m-f16.gguf")
    assert pull.choose(files, "Q4_K_S")[0] == "m-Q4_K_S.gguf"
    with pytest.raises(pull.PullError) as e:
        pull.choose(files, "Q4_K")  # a part of a name, not a quantization of its own
    assert e.value.status == 404 and "Q4_K_M" in e.value.message
    # without Q4_K_M: the preferred order, else the first
    assert pull.choose(["a-Q8_0.gguf", "a-Q6_K.gguf"], None)[0] == "a-Q6_K.gguf"
    assert pull.choose(["a-weird.gguf"], None) == ("a-weird.gguf", None)
    # a split model: its first part (the plan adds the others)
    split = ["b-Q4_K_M-00001-of-00002.gguf", "b-Q4_K_M-00002-of-00002.gguf", "b-Q8_0.gguf"]
    assert pull.choose(split, None) == ("b-Q4_K_M-00001-of-00002.gguf", None)


# ---- pulls against the stand-in hub --------------------------------------------------------
def test_pull_streams_progress_then_lists_the_model(
    client: ollama.Client, hub: FakeHub, files: dict[str, Path], models: Path
) -> None:
    hub.throttle = 0.02  # 64 KiB per 20 ms: a few progress lines per file
    parts = list(client.pull(f"hf.co/{REPO}:q8_0", stream=True))
    statuses = [p.status for p in parts]
    assert statuses[0] == "pulling manifest"
    assert statuses[-3:] == ["verifying sha256 digest", "writing manifest", "success"]
    for name in (Q8, MMPROJ):
        digest = sha256(files[name])
        lines = [p for p in parts if p.digest == f"sha256:{digest}"]
        assert lines, f"no progress for {name}"
        assert {p.status for p in lines} == {f"pulling {digest[:12]}"}
        assert {p.total for p in lines} == {files[name].stat().st_size}
        done = [p.completed for p in lines]
        assert done == sorted(done) and done[-1] == files[name].stat().st_size
    q8 = [p for p in parts if p.digest == f"sha256:{sha256(files[Q8])}"]
    assert len(q8) >= 3, "the download's progress was not streamed"
    assert all(r is None for r in hub.ranges(Q8))  # one whole download
    assert hub.ranges(Q4) == []  # only the quantization asked for

    name = "hf.co/corral-test/tiny-gguf:q8_0"
    assert name in names(client)
    shown = client.show(name)
    assert shown.modelfile and f"sha256-{sha256(files[Q8])}" in shown.modelfile
    assert {f"sha256-{sha256(files[Q8])}", f"sha256-{sha256(files[MMPROJ])}"} <= blobs(models)
    assert not partials(models)

    # a second pull of the same model downloads nothing
    hub.reset()
    last = client.pull(f"hf.co/{REPO}:Q8_0")
    assert last.status == "success"
    assert hub.ranges(Q8) == []


def test_pull_without_quant_takes_q4_k_m(
    client: ollama.Client, hub: FakeHub, files: dict[str, Path]
) -> None:
    assert client.pull(f"huggingface.co/{REPO}").status == "success"
    shown = client.show(f"huggingface.co/{REPO}")  # the tag is :latest
    assert shown.modelfile and f"sha256-{sha256(files[Q4])}" in shown.modelfile
    assert hub.ranges(Q8) == []


def test_missing_repo_or_quant_is_a_clear_404(client: ollama.Client) -> None:
    with pytest.raises(ollama.ResponseError) as e:
        client.pull("hf.co/corral-test/no-such-repo")
    assert e.value.status_code == 404
    assert "no repository 'corral-test/no-such-repo'" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:  # streaming: refused before the stream
        list(client.pull(f"hf.co/{REPO}:Q2_K", stream=True))
    assert e.value.status_code == 404
    assert "no GGUF file for quantization 'Q2_K'" in e.value.error
    assert "Q4_K_M" in e.value.error and "Q8_0" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.pull("llama3.2")
    assert e.value.status_code == 400 and "Hugging Face" in e.value.error


def test_interrupted_pull_resumes(
    client: ollama.Client, hub: FakeHub, files: dict[str, Path], models: Path
) -> None:
    fname, name = "resume-Q4_K_M.gguf", "hf.co/corral-test/resume-GGUF"
    # The connection drops after 600000 bytes and the hub then fails the retry: the pull ends
    # with an error line, keeping what it got.
    hub.break_after(fname, 600_000, then_fail=1)
    with pytest.raises(ollama.ResponseError) as e:
        list(client.pull(name, stream=True))
    assert "503" in e.value.error
    assert f"{name.lower()}:latest" not in names(client)  # never listed half-downloaded
    kept = partials(models)
    assert len(kept) == 1 and 0 < kept[0].stat().st_size < files["resume"].stat().st_size
    have = kept[0].stat().st_size

    parts = list(client.pull(name, stream=True))
    assert parts[-1].status == "success"
    assert hub.ranges(fname)[-1] == f"bytes={have}-"  # only the rest was fetched
    first = next(p for p in parts if p.digest)
    assert first.completed is not None and first.completed >= have  # progress starts there
    assert f"sha256-{sha256(files['resume'])}" in blobs(models)
    assert not partials(models)
    assert f"{name.lower()}:latest" in names(client)


def test_connection_dropped_mid_file_is_resumed_within_the_pull(
    client: ollama.Client, hub: FakeHub, files: dict[str, Path], models: Path
) -> None:
    fname = "retry-Q4_K_M.gguf"
    hub.break_after(fname, 600_000)  # huggingface_hub retries from where it stopped
    assert client.pull("hf.co/corral-test/retry-GGUF").status == "success"
    ranges = hub.ranges(fname)
    assert ranges[0] is None and ranges[1] is not None and ranges[1].startswith("bytes=")
    assert f"sha256-{sha256(files['retry'])}" in blobs(models)


def test_client_leaving_stops_the_download_and_keeps_it(
    server: CorralServer, hub: FakeHub, files: dict[str, Path], models: Path
) -> None:
    hub.reset()
    fname, name = "leave-Q4_K_M.gguf", "hf.co/corral-test/leave-GGUF"
    hub.throttle = 0.05  # ~1.3 MB/s: the pull takes about a second
    with server.client.stream("POST", "/api/pull", json={"model": name}) as r:
        for line in r.iter_lines():
            if '"completed":' in line and '"completed":0' not in line:
                break  # some bytes arrived: leave
    before = len(hub.ranges(fname))
    server.wait_for(lambda: len(partials(models)) == 1, what="the partial download")
    time.sleep(1.0)  # the download would have finished by now had it gone on
    kept = partials(models)
    have = kept[0].stat().st_size
    assert len(kept) == 1 and 0 < have < files["leave"].stat().st_size
    assert len(hub.ranges(fname)) == before  # no retry behind the client's back
    hub.throttle = 0.0
    with ollama.Client(server.url) as client:
        assert client.pull(name).status == "success"
    assert hub.ranges(fname)[-1] == f"bytes={have}-"
    assert "Traceback" not in server.log()


def test_corrupted_download_is_rejected(
    client: ollama.Client, hub: FakeHub, files: dict[str, Path], models: Path
) -> None:
    name, fname = "hf.co/corral-test/corrupt-GGUF", "corrupt-Q4_K_M.gguf"
    hub.corrupt(fname)
    with pytest.raises(ollama.ResponseError) as e:
        list(client.pull(name, stream=True))
    assert "digest mismatch" in e.value.error and sha256(files["corrupt"]) in e.value.error
    with pytest.raises(ollama.ResponseError) as e:  # not streamed: the status says it
        client.pull(name)
    assert e.value.status_code == 502 and "digest mismatch" in e.value.error
    assert f"{name.lower()}:latest" not in names(client)
    assert f"sha256-{sha256(files['corrupt'])}" not in blobs(models)
    assert not partials(models)  # the bad download is discarded, not resumed
    hub.corrupt(fname, on=False)
    assert client.pull(name).status == "success"


def test_pulled_model_chats(client: ollama.Client) -> None:
    assert client.pull("hf.co/corral-test/chat-GGUF:Q4_K_M").status == "success"
    r = client.chat(
        model="hf.co/corral-test/chat-GGUF:Q4_K_M",
        messages=[{"role": "user", "content": "Hello"}],
        options={"num_predict": 8, "temperature": 0},
    )
    assert r.done and isinstance(r.message.content, str) and r.eval_count


@pytest.mark.skipif(not hasattr(synth, "write_projector"), reason="no synthetic projector")
def test_pulled_model_with_projector_chats(client: ollama.Client) -> None:
    assert client.pull(f"hf.co/{REPO}:Q4_K_M").status == "success"
    assert "vision" in (client.show(f"hf.co/{REPO}:Q4_K_M").capabilities or [])
    r = client.chat(
        model=f"hf.co/{REPO}:Q4_K_M", messages=[{"role": "user", "content": "Hi"}],
        options={"num_predict": 4},
    )  # fmt: skip
    assert r.done


def test_cli_pull_shows_progress(server: CorralServer, models: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "corral", "pull", "hf.co/corral-test/cli-GGUF"],
        env={**os.environ, "CORRAL_HOST": server.host}, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    for word in ("pulling manifest", "verifying sha256 digest", "success"):
        assert word in r.stderr
    r = subprocess.run(
        [sys.executable, "-m", "corral", "pull", "hf.co/corral-test/nothing-here"],
        env={**os.environ, "CORRAL_HOST": server.host}, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert r.returncode == 1
    assert "Error: model 'hf.co/corral-test/nothing-here' not found" in r.stderr


def test_cli_run_pulls_a_missing_model_first(server: CorralServer) -> None:
    """`corral run` of a model not there but with a pullable name pulls it, with progress,
    then loads it, as `ollama run` does; a name nothing can pull is just not found."""
    env = {**os.environ, "CORRAL_HOST": server.host}

    def corral(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "corral", *args], env=env,
                              capture_output=True, text=True, timeout=120)  # fmt: skip

    name = "hf.co/corral-test/run-GGUF"
    r = corral("run", name)  # no prompt, no terminal: pull and load only
    assert r.returncode == 0, r.stderr
    for word in ("pulling manifest", "verifying sha256 digest", "success"):
        assert word in r.stderr
    assert "hf.co/corral-test/run-gguf:latest" in {m["model"] for m in server.ps()}
    r = corral("run", name)  # there now: no pull
    assert r.returncode == 0 and "pulling manifest" not in r.stderr, r.stderr
    r = corral("run", "hf.co/corral-test/not-there-GGUF", "hi")
    assert r.returncode == 1
    assert "Error: model 'hf.co/corral-test/not-there-GGUF' not found" in r.stderr
    r = corral("run", "run-gguf", "hi")  # not a name corral pulls
    assert r.returncode == 1 and "pulling" not in r.stderr
    assert r.stderr.startswith("Error: model 'run-gguf' not found")
    assert "Did you mean this?\n\thf.co/corral-test/run-gguf:latest\n" in r.stderr
    corral("stop", name)


def test_router_download_and_delete(server: CorralServer, models: Path) -> None:
    r = server.client.post("/models", json={"model": "corral-test/router-GGUF:Q4_K_M"})
    assert r.status_code == 200, r.text
    assert r.json() == {"success": True, "model": "hf.co/corral-test/router-gguf:q4_k_m"}
    listed = {m["id"] for m in server.client.get("/models").json()["data"]}
    assert "hf.co/corral-test/router-gguf:q4_k_m" in listed
    name = "hf.co/corral-test/router-gguf:q4_k_m"
    r = server.client.request("DELETE", "/models", json={"model": name})
    assert r.status_code == 200 and r.json()["success"] is True
    assert any("sha256-" in p for p in r.json()["removed"])
    r = server.client.post("/models", json={"model": "corral-test/absent"})
    assert r.status_code == 404 and "error" in r.json()


def test_a_split_model_is_pulled_whole_and_served(
    client: ollama.Client, server: CorralServer, models: Path
) -> None:
    """llama.cpp loads a split model from its first part and finds the others by name: every
    part is pulled and verified, and linked under its hub name for the runner."""
    before = blobs(models)
    last = client.pull("hf.co/corral-test/Big-GGUF")
    assert last.status == "success"
    assert len(blobs(models) - before) == 4
    name = "hf.co/corral-test/big-gguf:latest"
    (tag,) = [m for m in client.list().models if m.model == name]
    links = list((models / STORE_DIR / "splits").rglob("*.gguf"))
    assert tag.size == sum(f.stat().st_size for f in links)
    r = client.generate(model=name, prompt="Once upon", options={"num_predict": 3})
    assert r.eval_count == 3
    # the links the runner read: the hub's names, each to its verified blob
    (view,) = (models / STORE_DIR / "splits").iterdir()
    assert sorted(p.name for p in view.iterdir()) == [
        f"Big-Q4_K_M-0000{i}-of-00004.gguf" for i in (1, 2, 3, 4)
    ]
    client.delete(name)
    assert blobs(models) == before and not view.exists()
    # a repository missing a part: refused before anything is downloaded
    with pytest.raises(ollama.ResponseError) as e:
        client.pull("hf.co/corral-test/Broken-GGUF")
    assert e.value.status_code == 502 and "00004-of-00004" in str(e.value)
    assert blobs(models) == before
