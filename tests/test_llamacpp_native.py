"""llama.cpp's own server API routed by `model` (as llama.cpp's router mode does), and a
created model's Go TEMPLATE rendered by the real runner as Ollama renders it."""

from __future__ import annotations

import json

import httpx
import pytest

from corral.testing import synth
from corral.testing.server import CorralServer


@pytest.fixture(scope="module")
def s(start_server, tmp_path_factory: pytest.TempPathFactory) -> CorralServer:
    d = tmp_path_factory.mktemp("native")
    synth.write_llama_model(d / "tiny.gguf", n_layer=2, context_length=2048)
    synth.write_bert_model(d / "embed.gguf")
    return start_server(d, CORRAL_BUILTIN_MODELS="0", CORRAL_NUM_PARALLEL="2")


def llama_error(r: httpx.Response, status: int, kind: str) -> str:
    """llama.cpp's error shape; the message."""
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"code", "message", "type"} and err["code"] == status, err
    assert err["type"] == kind, err
    return str(err["message"])


def test_completion_answers_as_the_runner_does_under_the_name_asked_for(s: CorralServer) -> None:
    r = s.client.post("/completion", json={
        "model": "tiny", "prompt": "Once upon", "n_predict": 5, "temperature": 0,
    })  # fmt: skip
    assert r.status_code == 200, r.text
    data = r.json()
    assert data["model"] == "tiny" and data["tokens_predicted"] == 5
    assert isinstance(data["content"], str) and data["stop"] is True
    same = s.client.post("/completions", json={
        "model": "tiny:latest", "prompt": "Once upon", "n_predict": 5, "temperature": 0,
    }).json()  # fmt: skip
    assert same["content"] == data["content"] and same["model"] == "tiny:latest"


def test_a_completion_streams_as_llama_cpp_streams_it(s: CorralServer) -> None:
    with s.client.stream("POST", "/completion", json={
        "model": "tiny", "prompt": "Once upon", "n_predict": 6, "temperature": 0, "stream": True,
    }) as r:  # fmt: skip
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert all(e["stop"] is False for e in events[:-1]) and events[-1]["stop"] is True
    assert events[-1]["model"] == "tiny" and events[-1]["tokens_predicted"] == 6
    whole = s.client.post("/completion", json={
        "model": "tiny", "prompt": "Once upon", "n_predict": 6, "temperature": 0,
    }).json()  # fmt: skip
    assert "".join(e["content"] for e in events) == whole["content"]


def test_tokenize_detokenize_and_apply_template(s: CorralServer) -> None:
    toks = s.client.post("/tokenize", json={"model": "tiny", "content": "hello world"}).json()
    assert toks["tokens"] and all(isinstance(t, int) for t in toks["tokens"])
    text = s.client.post("/detokenize", json={"model": "tiny", "tokens": toks["tokens"]}).json()
    assert text["content"].strip() == "hello world"
    r = s.client.post("/apply-template", json={
        "model": "tiny", "messages": [{"role": "user", "content": "Hi!"}],
    })  # fmt: skip
    assert r.status_code == 200 and "Hi!" in r.json()["prompt"]


def test_embedding_and_props(s: CorralServer) -> None:
    r = s.client.post("/embedding", json={"model": "embed", "content": "hello"})
    assert r.status_code == 200, r.text
    assert isinstance(r.json()[0]["embedding"][0], list)
    props = s.client.get("/props", params={"model": "tiny"})
    assert props.status_code == 200 and "default_generation_settings" in props.json()


def test_errors_come_in_llama_cpp_shape(s: CorralServer) -> None:
    msg = llama_error(s.client.post("/completion", json={"model": "nope", "prompt": "x"}),
                      404, "not_found_error")  # fmt: skip
    assert "nope" in msg
    llama_error(s.client.post("/completion", json={"prompt": "x"}), 400, "invalid_request_error")
    json_type = {"content-type": "application/json"}
    r = s.client.post("/tokenize", content=b"{not json", headers=json_type)
    llama_error(r, 400, "invalid_request_error")
    r = s.client.post("/embedding", json={"model": "tiny", "content": "x"})
    assert "embeddings" in llama_error(r, 400, "invalid_request_error")
    r = s.client.post("/completion", json={"model": "embed", "prompt": "x"})
    llama_error(r, 400, "invalid_request_error")
    llama_error(s.client.get("/props"), 400, "invalid_request_error")
    # a bad value for llama.cpp itself: its own message and a 4xx, not a 500
    r = s.client.post("/detokenize", json={"model": "tiny", "tokens": "abc"})
    assert 400 <= r.status_code < 500, r.text
    assert s.client.get("/api/version").status_code == 200  # the server is fine


# ---- a created model's TEMPLATE -------------------------------------------------------------
LEGACY = (
    "{{ if .System }}<|sys|>{{ .System }}\n{{ end }}<|user|>{{ .Prompt }}\n<|bot|>"
    "{{ .Response }}<|end|>\n"
)
MESSAGES = "{{- range .Messages }}[{{ .Role }}] {{ .Content }}\n{{ end }}[assistant] "
CHAT = [
    {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"},
    {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Name?"},
]  # fmt: skip


def create(s: CorralServer, name: str, template: str) -> None:
    r = s.client.post("/api/create", json={
        "model": name, "from": "tiny", "template": template, "stream": False,
    })  # fmt: skip
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    ("template", "want"),
    [
        (LEGACY, "<|sys|>Be brief.\n<|user|>Hi!\n<|bot|>Hello.<|end|>\n<|user|>Name?\n<|bot|>"),
        (MESSAGES, "[system] Be brief.\n[user] Hi!\n[assistant] Hello.\n[user] Name?\n"
                   "[assistant] "),
    ],
)  # fmt: skip
def test_a_created_models_go_template_is_what_the_runner_renders(
    s: CorralServer, template: str, want: str
) -> None:
    name = "legacy-tmpl" if template is LEGACY else "messages-tmpl"
    create(s, name, template)
    r = s.client.post("/apply-template", json={"model": name, "messages": CHAT})
    assert r.status_code == 200, r.text
    assert r.json()["prompt"] == want
    # /api/show keeps the template as written; chat reads the rendered prompt
    assert s.client.post("/api/show", json={"model": name}).json()["template"] == template
    reply = s.client.post("/api/chat", json={
        "model": name, "messages": CHAT, "stream": False, "options": {"num_predict": 1},
    }).json()  # fmt: skip
    toks = s.client.post("/tokenize", json={
        "model": name, "content": want, "add_special": True, "parse_special": True,
    }).json()["tokens"]  # fmt: skip
    assert reply["prompt_eval_count"] == len(toks)


def test_a_template_corral_cannot_render_is_refused_at_create(s: CorralServer) -> None:
    r = s.client.post("/api/create", json={
        "model": "bad-tmpl", "from": "tiny", "template": "{{ html .Prompt }}", "stream": False,
    })  # fmt: skip
    assert r.status_code == 400 and "html" in r.json()["error"], r.text
    assert s.client.post("/api/show", json={"model": "bad-tmpl"}).status_code == 404


def test_a_jinja_template_is_used_as_it_is(s: CorralServer) -> None:
    jinja = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"
    create(s, "jinja-tmpl", jinja)
    r = s.client.post("/apply-template", json={"model": "jinja-tmpl", "messages": CHAT[1:2]})
    assert r.json()["prompt"] == "<user>Hi!<assistant>"
