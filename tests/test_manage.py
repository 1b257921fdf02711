"""Managing models like Ollama: create (from a model or uploaded blobs), blobs, copy, delete,
push; created models keep their system prompt and parameters. Driven with the real `ollama`
client, and the CLI verbs as a user runs them."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import ollama
import pytest
from helpers import live_dashboard

from corral.cli import modelfile
from corral.runtime.store import STORE_DIR
from corral.testing import synth
from corral.testing.server import CorralServer

PIRATE = "You are a pirate. Answer every question in the voice of an old sea captain."
# ChatML as an Ollama Go template: what the synthetic models' own template renders when the
# conversation has a system message (without one theirs adds SmolLM2's default)
CHATML = (
    "{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{ end }}"
    "<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("managemodels")
    synth.write_llama_model(d / "tiny.gguf", n_layer=2, context_length=2048)
    synth.write_llama_model(d / "other.gguf", n_layer=2, context_length=2048, seed=5)
    return d


@pytest.fixture(scope="module")
def server(start_server, models: Path) -> CorralServer:
    return start_server(models)


def names(client: ollama.Client) -> set[str]:
    return {m.model or "" for m in client.list().models}


def corral(
    server: CorralServer, *args: str, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "corral", *args], env={**os.environ, "CORRAL_HOST": server.host},
        capture_output=True, text=True, timeout=120, cwd=cwd,
    )  # fmt: skip


def from_line(modelfile: str | None) -> str:
    """The model file a Modelfile names in its comment (its FROM names the model), relative to
    the models directory (absolute to an authorized client: only its name is compared)."""
    line = next(ln for ln in (modelfile or "").splitlines() if ln.startswith("# FROM "))
    return Path(line.removeprefix("# FROM ")).name


def system_of(server: CorralServer, model: str) -> str | None:
    system = server.client.post("/api/show", json={"model": model}).json().get("system")
    return None if system is None else str(system)


def chat(
    client: ollama.Client, model: str, system: str | None = None, **options: float
) -> ollama.ChatResponse:
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": "Where is the treasure?"})
    return client.chat(model=model, messages=messages, options={"temperature": 0, **options})


# ---- create ---------------------------------------------------------------------------------
def test_create_from_a_model_keeps_system_and_parameters(
    ollama_client: ollama.Client, server: CorralServer, models: Path
) -> None:
    parts = list(ollama_client.create(
        model="pirate", from_="tiny", system=PIRATE, template=CHATML, license="MIT",
        parameters={"temperature": 0.3, "num_ctx": 512, "num_predict": 5, "stop": ["Arr"]},
        stream=True,
    ))  # fmt: skip
    statuses = [p.status for p in parts]
    assert statuses[-2:] == ["writing manifest", "success"]
    assert "using file tiny.gguf" in statuses  # (paths relative to the models directory)
    assert any(s and s.startswith("creating new layer sha256:") for s in statuses)
    assert "pirate:latest" in names(ollama_client)

    shown = ollama_client.show("pirate")
    assert system_of(server, "pirate") == PIRATE  # (the ollama client drops `system`)
    assert shown.template == CHATML
    assert shown.license == "MIT"
    params = shown.parameters or ""
    for line in ("temperature", "0.3", "num_ctx", "512", "num_predict", '"Arr"'):
        assert line in params
    assert from_line(shown.modelfile) == "tiny.gguf"
    assert f'SYSTEM """{PIRATE}"""' in shown.modelfile and 'PARAMETER stop "Arr"' in shown.modelfile

    # Requests get the system prompt (when they have none) and the parameters as defaults;
    # the template renders them (the same prompt as the base model's with that system).
    own = chat(ollama_client, "pirate")
    plain = chat(ollama_client, "tiny", system=PIRATE, num_predict=2)
    assert own.prompt_eval_count == plain.prompt_eval_count
    assert own.eval_count is not None and own.eval_count <= 5  # num_predict 5
    assert {m.model: m.context_length for m in ollama_client.ps().models}["pirate:latest"] == 512
    overridden = chat(ollama_client, "pirate", system="Be brief.")
    brief = chat(ollama_client, "tiny", system="Be brief.", num_predict=2)
    assert overridden.prompt_eval_count == brief.prompt_eval_count
    longer = ollama_client.chat(model="pirate", messages=[{"role": "user", "content": "Hi"}],
                                options={"num_predict": 9, "temperature": 0})  # fmt: skip
    assert longer.eval_count is not None and longer.eval_count > 5  # the request's own wins

    # ... on the OpenAI API too (the byte pass-through)
    body = {"messages": [{"role": "user", "content": "Where is the treasure?"}], "temperature": 0}
    with_system = {"messages": [{"role": "system", "content": PIRATE}, *body["messages"]]}
    usage = {
        m: server.client.post("/v1/chat/completions", json={"model": m, **body, **extra}).json()[
            "usage"]
        for m, extra in (("pirate", {}), ("tiny", {"max_tokens": 2, **with_system}))
    }  # fmt: skip
    assert usage["pirate"]["prompt_tokens"] == usage["tiny"]["prompt_tokens"]
    assert usage["pirate"]["completion_tokens"] <= 5


def test_create_from_another_created_model_merges(
    ollama_client: ollama.Client, server: CorralServer
) -> None:
    ollama_client.create(model="pirate-base", from_="tiny", system=PIRATE,
                         parameters={"temperature": 0.3, "num_predict": 5})  # fmt: skip
    ollama_client.create(model="pirate-hot", from_="pirate-base", parameters={"temperature": 1.5})
    shown = ollama_client.show("pirate-hot")
    assert system_of(server, "pirate-hot") == PIRATE
    params = shown.parameters or ""
    assert "1.5" in params and "num_predict" in params and "0.3" not in params


def test_create_from_uploaded_blobs(
    ollama_client: ollama.Client, models: Path, tmp_path: Path
) -> None:
    src = synth.write_llama_model(tmp_path / "upload.gguf", seed=9)
    digest = ollama_client.create_blob(src)
    assert digest == "sha256:" + hashlib.sha256(src.read_bytes()).hexdigest()
    blob = models / STORE_DIR / "blobs" / f"sha256-{digest.split(':')[1]}"
    assert blob.read_bytes() == src.read_bytes()
    parts = list(ollama_client.create(model="uploaded", files={"upload.gguf": digest}, stream=True))
    statuses = [p.status for p in parts]
    assert statuses[0] == "parsing GGUF" and f"using existing layer {digest}" in statuses
    assert statuses[-1] == "success"
    r = ollama_client.generate(model="uploaded", prompt="Hi", options={"num_predict": 3})
    assert r.done

    missing = "sha256:" + "0" * 64
    with pytest.raises(ollama.ResponseError) as e:
        ollama_client.create(model="nope", files={"x.gguf": missing})
    assert e.value.status_code == 400 and "upload it first" in e.value.error
    text = tmp_path / "notes.txt"
    text.write_text("not a model")
    with pytest.raises(ollama.ResponseError) as e:
        ollama_client.create(model="nope", files={"notes.txt": ollama_client.create_blob(text)})
    assert e.value.status_code == 400 and "not a GGUF file" in e.value.error
    assert "nope:latest" not in names(ollama_client)


def test_create_refusals(ollama_client: ollama.Client) -> None:
    with pytest.raises(ollama.ResponseError) as e:
        ollama_client.create(model="small", from_="tiny", quantize="q4_K_M")
    assert e.value.status_code == 400 and "quantize is not supported" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        ollama_client.create(model="x", from_="no-such-model")
    assert e.value.status_code == 404 and "no-such-model" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        ollama_client.create(model="other", from_="tiny")  # other.gguf is the user's file
    assert e.value.status_code == 400 and "other.gguf" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        ollama_client.create(model="x", from_="tiny", parameters={"temprature": 1})
    assert e.value.status_code == 400 and "unknown parameter 'temprature'" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        ollama_client.create(model="x")
    assert e.value.status_code == 400 and "'from'" in e.value.error


def test_create_with_an_adapter(ollama_client: ollama.Client, models: Path, tmp_path: Path) -> None:
    """Ollama's ADAPTER through /api/create: the runner loads it, and it changes the output."""
    lora = synth.write_lora_adapter(tmp_path / "lora.gguf", models / "tiny.gguf")
    digest = ollama_client.create_blob(lora)
    parts = list(ollama_client.create(model="tuned", from_="tiny", adapters={"lora.gguf": digest},
                                      stream=True))  # fmt: skip
    assert f"using existing layer {digest}" in [p.status for p in parts]
    modelfile = ollama_client.show("tuned").modelfile or ""
    assert "ADAPTER " in modelfile and f"sha256-{digest.split(':')[1]}" in modelfile
    opts = {"num_predict": 12, "temperature": 0, "seed": 1}
    tuned = ollama_client.generate(model="tuned", prompt="Once upon a time", options=opts)
    plain = ollama_client.generate(model="tiny", prompt="Once upon a time", options=opts)
    assert tuned.response != plain.response
    with pytest.raises(ollama.ResponseError) as e:  # a model file is not an adapter
        not_an_adapter = ollama_client.create_blob(models / "other.gguf")
        ollama_client.create(model="x", from_="tiny", adapters={"m.gguf": not_an_adapter})
    assert e.value.status_code == 400 and "not a LoRA adapter" in e.value.error


# ---- blobs ----------------------------------------------------------------------------------
def test_blob_upload_is_checked_against_its_digest(server: CorralServer, models: Path) -> None:
    data = b"some bytes that are not what the digest says"
    wrong = "sha256:" + hashlib.sha256(b"something else").hexdigest()
    r = server.client.post(f"/api/blobs/{wrong}", content=data)
    assert r.status_code == 400 and "digest mismatch" in r.json()["error"]
    assert server.client.head(f"/api/blobs/{wrong}").status_code == 404
    assert not list((models / STORE_DIR / "partial").glob("upload-*"))  # nothing left behind
    right = "sha256:" + hashlib.sha256(data).hexdigest()
    assert server.client.post(f"/api/blobs/{right}", content=data).status_code == 201
    assert server.client.head(f"/api/blobs/{right}").status_code == 200
    assert server.client.post(f"/api/blobs/{right}", content=data).status_code == 200  # had it
    r = server.client.post("/api/blobs/md5:abc", content=data)
    assert r.status_code == 400 and "invalid digest" in r.json()["error"]


# ---- copy, delete, push -----------------------------------------------------------------------
def test_copy_and_delete(ollama_client: ollama.Client, server: CorralServer, models: Path) -> None:
    ollama_client.create(model="captain", from_="tiny", system=PIRATE)
    assert ollama_client.copy("captain", "captain-copy").status == "success"
    assert system_of(server, "captain-copy") == PIRATE
    # a copy of the user's own file refers to it; deleting the copy leaves the file alone
    assert ollama_client.copy("tiny", "tiny-alias").status == "success"
    assert from_line(ollama_client.show("tiny-alias").modelfile) == "tiny.gguf"
    # Each name made from one file is a model of its own: its own ID, made when it was made.
    os.utime(models / "tiny.gguf", (1e9, 1e9))  # the file is old (2001)
    tags = {m["name"]: m for m in server.client.get("/api/tags").json()["models"]}
    ids = [tags[n]["digest"] for n in ("tiny:latest", "tiny-alias:latest", "captain:latest",
                                       "captain-copy:latest")]  # fmt: skip
    assert len(set(ids)) == 4, ids
    assert tags["tiny:latest"]["modified_at"].startswith("2001-")
    assert not tags["tiny-alias:latest"]["modified_at"].startswith("2001-")
    assert ollama_client.delete("tiny-alias").status == "success"
    assert (models / "tiny.gguf").is_file() and "tiny:latest" in names(ollama_client)
    assert "tiny-alias:latest" not in names(ollama_client)

    assert ollama_client.delete("captain").status == "success"
    listed = names(ollama_client)
    assert "captain:latest" not in listed and "captain-copy:latest" in listed

    with pytest.raises(ollama.ResponseError) as e:
        ollama_client.copy("captain", "again")  # gone
    assert e.value.status_code == 404
    with pytest.raises(ollama.ResponseError) as e:
        ollama_client.copy("captain-copy", "tiny")  # the user's file's name
    assert e.value.status_code == 400


def test_names_of_one_file_share_one_runner(
    ollama_client: ollama.Client, server: CorralServer
) -> None:
    """Models made from one file with the same runner shape (create, cp) are served by one
    runner, one process and one booking, known by the first of them made; each name keeps its
    own system prompt and is named in its answers. One with its own runner options (pirate's
    num_ctx, template) has its own runner."""
    ollama_client.create(model="mate", from_="other", system=PIRATE)
    ollama_client.create(model="lookout", from_="other", system="Be brief.")
    assert ollama_client.copy("mate", "bosun").status == "success"
    own = {m: chat(ollama_client, m, num_predict=2) for m in ("mate", "lookout", "bosun")}
    plain = {s: chat(ollama_client, "other", system=s, num_predict=2)
             for s in (PIRATE, "Be brief.")}  # fmt: skip
    assert own["mate"].prompt_eval_count == plain[PIRATE].prompt_eval_count
    assert own["bosun"].prompt_eval_count == plain[PIRATE].prompt_eval_count
    assert own["lookout"].prompt_eval_count == plain["Be brief."].prompt_eval_count
    assert plain[PIRATE].prompt_eval_count != plain["Be brief."].prompt_eval_count
    assert {a.model for a in own.values()} == {"mate", "lookout", "bosun"}
    answer = server.client.post("/v1/chat/completions", json={
        "model": "lookout", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
    }).json()  # fmt: skip
    assert answer["model"] == "lookout"

    rows = [m for m in server.client.get("/api/ps").json()["models"]
            if {"mate:latest", "other:latest"} & set(m["models"])]  # fmt: skip
    assert len(rows) == 1, rows  # one runner: one process, booked once
    assert rows[0]["name"] == "other:latest" and rows[0]["pid"] in server.runners()
    assert {"other:latest", "mate:latest", "lookout:latest", "bosun:latest"} <= set(
        rows[0]["models"])  # fmt: skip
    router = {m["id"]: m["status"]["value"] for m in server.client.get("/models").json()["data"]}
    assert router["bosun:latest"] == router["other:latest"] == "loaded"
    dash = {m["name"]: m for m in server.client.get("/api/corral/state").json()["models"]}
    assert dash["mate:latest"]["state"] == "ready"
    assert dash["mate:latest"]["runner"]["pid"] == rows[0]["pid"]

    # `corral stop` (an unload) of any of its names stops the shared runner
    r = server.client.post("/api/generate", json={"model": "bosun", "keep_alive": 0})
    assert r.status_code == 200, r.text
    server.wait_for(lambda: not [m for m in server.ps() if "bosun:latest" in m["models"]],
                    what="the shared runner to stop")  # fmt: skip


def test_the_dashboard_books_a_shared_runner_once(
    ollama_client: ollama.Client, server: CorralServer, browser: Any
) -> None:
    ollama_client.create(model="cook", from_="other", system="You are the ship's cook.")
    chat(ollama_client, "cook", num_predict=1)
    with live_dashboard(browser, server.url) as page:
        page.wait_for_selector("tr[data-model='cook:latest'][data-state='ready']")
        cook = page.locator("tr[data-model='cook:latest'] td.memory").inner_text()
        assert "in the runner of other:latest" in cook and "booked once" in cook
        own = page.locator("tr[data-model='other:latest'] td.memory").inner_text()
        assert "MiB" in own and "cook:latest" in own  # also serves ...
        who = page.eval_on_selector_all(".device-foot .who", "es => es.map(e => e.textContent)")
        assert [w for w in who if "other:latest" in w or "cook:latest" in w] == [
            w for w in who if w.startswith("other:latest +")]  # fmt: skip
        assert len([w for w in who if w.startswith("other:latest +")]) == 1


def test_delete_never_touches_files_corral_did_not_make(
    ollama_client: ollama.Client, server: CorralServer, models: Path
) -> None:
    r = server.client.request("DELETE", "/api/delete", json={"model": "tiny"})
    assert r.status_code == 400
    error = r.json()["error"]
    assert "never deletes it" in error and "the file tiny.gguf" in error
    assert (models / "tiny.gguf").is_file()
    if "smollm2:135m" in names(ollama_client):
        r = server.client.request("DELETE", "/api/delete", json={"model": "smollm2:135m"})
        assert r.status_code == 400 and "built-in" in r.json()["error"]
    with pytest.raises(ollama.ResponseError) as e:
        ollama_client.delete("never-was")
    assert e.value.status_code == 404


def test_delete_a_loaded_model_unloads_it_first(
    ollama_client: ollama.Client, server: CorralServer, models: Path, tmp_path: Path
) -> None:
    src = synth.write_llama_model(tmp_path / "own.gguf", seed=12)
    digest = ollama_client.create_blob(src)
    ollama_client.create(model="busy", files={"own.gguf": digest})
    ollama_client.generate(model="busy", prompt="Hi", options={"num_predict": 2})
    assert "busy:latest" in {m.model for m in ollama_client.ps().models}
    r = server.client.request("DELETE", "/api/delete", json={"model": "busy"})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["unloaded"] is True
    blob = f"{STORE_DIR}/blobs/sha256-{digest.split(':')[1]}"
    assert blob in out["removed"] and not (models / blob).exists()
    assert f"{STORE_DIR}/manifests/busy%3Alatest.json" in out["removed"]
    assert "busy:latest" not in {m.model for m in ollama_client.ps().models}
    assert "busy:latest" not in names(ollama_client)


def test_push_is_not_supported(ollama_client: ollama.Client) -> None:
    with pytest.raises(ollama.ResponseError) as e:
        ollama_client.push("tiny")
    assert e.value.status_code == 501 and "push is not supported" in e.value.error


# ---- the CLI --------------------------------------------------------------------------------
def test_modelfile_parsing(tmp_path: Path) -> None:
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    text = '''# a comment
FROM ./m.gguf
PARAMETER temperature 0.2
PARAMETER num_ctx 1024
PARAMETER stop "<|im_end|>"
PARAMETER stop User:
SYSTEM """You are
a pirate."""
TEMPLATE {{ .Prompt }}
MESSAGE user Ahoy?
MESSAGE assistant "Arr!"
LICENSE MIT
'''
    p = modelfile.parse(text, tmp_path)
    assert p.files == [tmp_path / "m.gguf"]
    assert p.body == {
        "system": "You are\na pirate.", "template": "{{ .Prompt }}", "license": "MIT",
        "parameters": {"temperature": 0.2, "num_ctx": 1024, "stop": ["<|im_end|>", "User:"]},
        "messages": [{"role": "user", "content": "Ahoy?"},
                     {"role": "assistant", "content": "Arr!"}],
    }  # fmt: skip
    assert modelfile.parse("FROM llama3.2\n", tmp_path).body == {"from": "llama3.2"}
    for bad in ("PARAMETER x 1\n", "FROM ./missing.gguf\n", "BOGUS x\n", 'FROM x\nSYSTEM """a\n'):
        with pytest.raises(modelfile.ModelfileError):
            modelfile.parse(bad, tmp_path)


def test_cli_create_cp_rm(server: CorralServer, models: Path, tmp_path: Path) -> None:
    shutil.copy(models / "other.gguf", tmp_path / "weights.gguf")
    (tmp_path / "Modelfile").write_text(
        'FROM ./weights.gguf\nPARAMETER temperature 0.2\nSYSTEM """Talk like a pirate."""\n'
    )
    r = corral(server, "create", "clipirate", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "success" in r.stderr
    r = corral(server, "show", "clipirate", "--system")
    assert r.stdout.strip() == "Talk like a pirate."
    assert corral(server, "cp", "clipirate", "clipirate2").returncode == 0
    r = corral(server, "rm", "clipirate")
    assert r.returncode == 0 and "deleted 'clipirate'" in r.stdout and ".json" in r.stdout
    r = corral(server, "rm", "clipirate2")  # the last user of the uploaded blob: removed too
    assert r.returncode == 0 and "sha256-" in r.stdout
    r = corral(server, "rm", "tiny")
    assert r.returncode == 1 and "never deletes it" in r.stderr
    assert (models / "tiny.gguf").is_file()
    r = corral(server, "create", "small", "-q", "q4_K_M", cwd=tmp_path)
    assert r.returncode == 1 and "quantize is not supported" in r.stderr


def test_start_up_prunes_files_no_model_uses(tmp_path: Path) -> None:
    """As Ollama prunes at start: blobs no manifest uses and abandoned uploads go once older
    than an hour; a blob a model uses, a fresh upload and a download still resumable stay."""
    from corral.runtime.store import FileRef, Manifest, Store

    store = Store(tmp_path)
    store.ensure()
    used, orphan, fresh = (f"sha256:{c * 64}" for c in "abc")
    for d in (used, orphan, fresh):
        store.blob_path(d).write_bytes(b"x")
    store.write(Manifest(name="m:latest", model=FileRef(digest=used)))
    upload, download = store.partial / "upload-123", store.partial_path("sha256:" + "d" * 64)
    upload.write_bytes(b"half")
    download.write_bytes(b"half")
    hours_ago = os.stat(upload).st_mtime - 2 * 3600
    for p in (store.blob_path(used), store.blob_path(orphan), upload, download):
        os.utime(p, (hours_ago, hours_ago))
    removed = store.prune()
    assert sorted(removed) == sorted([str(store.blob_path(orphan)), str(upload)])
    assert store.has_blob(used) and store.has_blob(fresh) and download.exists()
    assert store.prune(stale_partial=3600) == [str(download)]  # not resumed for a week
