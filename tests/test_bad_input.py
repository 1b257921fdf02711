"""Bad input gets a clear error with the right status, and the server keeps serving."""

from __future__ import annotations

import os

import httpx
import psutil
import pytest

SMOL = "smollm2:135m"
TINY = "tiny"
HI = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    "path",
    [
        "/api/generate",
        "/api/chat",
        "/api/embed",
        "/api/show",
        "/v1/chat/completions",
        "/v1/embeddings",
        "/models/load",
    ],
)
def test_malformed_json_is_400(http: httpx.Client, path: str) -> None:
    r = http.post(path, content=b'{"model": "x", ')
    assert r.status_code == 400
    body = r.json()
    msg = body["error"]["message"] if isinstance(body["error"], dict) else body["error"]
    assert "invalid JSON" in msg


@pytest.mark.parametrize("body", [b"", b"[1, 2]", b'"text"', b"null"])
def test_body_not_an_object_is_400(http: httpx.Client, body: bytes) -> None:
    r = http.post("/api/generate", content=body)
    assert r.status_code == 400 and r.json()["error"]


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"model": 5, "prompt": "x"}, "model"),
        ({"model": SMOL, "prompt": 7}, "prompt"),
        ({"model": SMOL, "prompt": "x", "stream": "yes"}, "stream"),
        ({"model": SMOL, "prompt": "x", "options": []}, "options"),
        ({"model": SMOL, "prompt": "x", "options": {"temperature": "hot"}}, "options.temperature"),
        ({"model": SMOL, "prompt": "x", "options": {"num_ctx": 1.5}}, "options.num_ctx"),
        ({"model": SMOL, "prompt": "x", "options": {"num_predict": True}}, "options.num_predict"),
        ({"model": SMOL, "prompt": "x", "keep_alive": "forever"}, "keep_alive"),
        ({"model": SMOL, "prompt": "x", "format": 3}, "format"),
        ({"prompt": "x"}, "model"),
    ],
)
def test_wrong_types_name_the_field(http: httpx.Client, body: dict, field: str) -> None:
    r = http.post("/api/generate", json=body)
    assert r.status_code == 400
    assert f"'{field}'" in r.json()["error"]


def test_chat_message_shape_is_checked(http: httpx.Client) -> None:
    r = http.post("/api/chat", json={"model": SMOL, "messages": [{"content": "no role"}]})
    assert r.status_code == 400 and "messages[0].role" in r.json()["error"]
    r = http.post("/api/chat", json={"model": SMOL, "messages": "hi"})
    assert r.status_code == 400 and "'messages'" in r.json()["error"]


def test_absurd_sizes_are_refused(http: httpx.Client) -> None:
    r = http.post(
        "/api/generate", json={"model": SMOL, "prompt": "x", "options": {"num_ctx": 10**12}}
    )
    assert r.status_code == 400 and "options.num_ctx" in r.json()["error"]
    r = http.post(
        "/api/generate", json={"model": SMOL, "prompt": "x", "options": {"num_predict": 10**15}}
    )
    assert r.status_code == 400
    r = http.post(
        "/api/generate", content=b" " * (65 * 2**20), headers={"content-type": "application/json"}
    )
    assert r.status_code == 413


def test_model_that_cannot_fit_in_memory_is_refused_naming_sizes(start_server, models_dir) -> None:
    # SmolLM2 alone is ~270 MB: it can never fit in 64 MiB.
    s = start_server(models_dir, CORRAL_MEMORY_LIMIT="64MiB", CORRAL_MEMORY_MARGIN="0")
    r = s.client.post("/api/generate", json={"model": SMOL, "prompt": "x"})
    assert r.status_code == 507
    assert "MiB" in r.json()["error"] and SMOL in r.json()["error"]


def test_unknown_routes_and_methods(http: httpx.Client) -> None:
    r = http.get("/api/nothing")
    assert r.status_code == 404 and r.json()["error"]
    r = http.get("/api/generate")
    assert r.status_code == 405 and r.json()["error"]
    r = http.get("/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["message"]


@pytest.mark.parametrize(
    ("model", "words"), [("notgguf", "not a GGUF"), ("truncated", "truncated")]
)
def test_broken_model_files_give_clear_errors_and_others_keep_working(
    http: httpx.Client, server, model: str, words: str
) -> None:
    r = http.post("/api/generate", json={"model": model, "prompt": "hi", "stream": False})
    assert r.status_code == 500
    err = r.json()["error"]
    assert f"model '{model}' cannot be loaded" in err and words in err
    assert "Traceback" not in err
    ok = http.post(
        "/api/generate",
        json={"model": "tiny", "prompt": "hi", "stream": False, "options": {"num_predict": 2}},
    )
    assert ok.status_code == 200 and ok.json()["done"]
    tags = http.get("/api/tags").json()["models"]
    broken = next(m for m in tags if m["name"] == f"{model}:latest")
    assert words in broken["error"]
    # Logged when found, once (clients and the dashboard list it again and again).
    assert server.log().count(f"model '{model}:latest' is unusable: ") == 1


def test_generate_on_embedding_model_is_400(http: httpx.Client) -> None:
    r = http.post("/api/generate", json={"model": "embed", "prompt": "hi"})
    assert r.status_code == 400 and "does not support generate" in r.json()["error"]


def test_router_unload_of_a_model_not_loaded(http: httpx.Client) -> None:
    r = http.post("/models/unload", json={"model": "tiny2"})
    assert r.status_code == 400 and "not loaded" in r.json()["error"]
    r = http.post("/models/load", json={"model": "nope"})
    assert r.status_code == 404


# ---- OpenAI: fields llama.cpp would read are checked first --------------------------------


@pytest.mark.parametrize(
    ("path", "extra", "field"),
    [
        ("/v1/chat/completions", {"temperature": "hot"}, "temperature"),
        ("/v1/chat/completions", {"max_tokens": "2"}, "max_tokens"),
        ("/v1/chat/completions", {"max_completion_tokens": [2]}, "max_completion_tokens"),
        ("/v1/chat/completions", {"max_tokens": 10**12}, "max_tokens"),
        ("/v1/chat/completions", {"stop": 5}, "stop"),
        ("/v1/chat/completions", {"stop": ["a", 5]}, "stop"),
        ("/v1/chat/completions", {"seed": "x"}, "seed"),
        ("/v1/chat/completions", {"presence_penalty": {}}, "presence_penalty"),
        ("/v1/chat/completions", {"frequency_penalty": True}, "frequency_penalty"),
        ("/v1/chat/completions", {"logit_bias": "x"}, "logit_bias"),
        ("/v1/chat/completions", {"logit_bias": {"15": "x"}}, "logit_bias"),
        ("/v1/chat/completions", {"response_format": "json"}, "response_format"),
        ("/v1/chat/completions", {"response_format": {"type": 5}}, "response_format.type"),
        ("/v1/chat/completions", {"stream_options": []}, "stream_options"),
        ("/v1/chat/completions", {"tools": "x" * 100_000}, "tools"),
        ("/v1/chat/completions", {"tool_choice": 5}, "tool_choice"),
        ("/v1/chat/completions", {"chat_template_kwargs": "x"}, "chat_template_kwargs"),
        ("/v1/chat/completions", {"n_probs": 10**6}, "n_probs"),
        ("/v1/chat/completions", {"id_slot": 1}, "id_slot"),
        ("/v1/chat/completions", {"n_cmpl": 2}, "n_cmpl"),
        # sizes that would cost every client of the runner (time on its loop, memory)
        ("/v1/chat/completions", {"dry_sequence_breakers": ["a"] * 9}, "dry_sequence_breakers"),
        ("/v1/chat/completions", {"samplers": ["top_k"] * 17}, "samplers"),
        ("/v1/chat/completions", {"samplers": "k" * 17}, "samplers"),
        ("/v1/chat/completions", {"dry_penalty_last_n": 2**27}, "dry_penalty_last_n"),
        ("/v1/chat/completions", {"repeat_last_n": 2**31}, "repeat_last_n"),
        ("/v1/chat/completions", {"messages": [{"role": 5, "content": "x"}]}, "messages[0].role"),
        ("/v1/chat/completions", {"messages": [{"content": "x"}]}, "messages[0].role"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]},
         "messages[0].content"),
        ("/v1/chat/completions",
         {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
         "messages[0].content[0].text"),
        ("/v1/chat/completions",
         {"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": 5}}]}]},
         "messages[0].tool_calls[0].type"),
        ("/v1/chat/completions",
         {"messages": [{"role": "assistant", "tool_calls": [
             {"type": "function", "function": {"name": 5}}]}]},
         "messages[0].tool_calls[0].function.name"),
        ("/v1/completions", {"temperature": "hot"}, "temperature"),
        ("/v1/completions", {"max_tokens": -5}, "max_tokens"),
        ("/v1/completions", {"prompt": [{"a": 1}]}, "prompt"),
        ("/v1/completions", {"suffix": 5}, "suffix"),
        ("/v1/embeddings", {"input": [{"a": 1}]}, "input"),
    ],
)  # fmt: skip
def test_openai_fields_of_the_wrong_type_name_the_field(
    http: httpx.Client, path: str, extra: dict, field: str
) -> None:
    """Refused by corral before any runner sees them (llama.cpp's own errors name no param,
    and answered some of these 500)."""
    base = {
        "/v1/chat/completions": {"model": TINY, "messages": HI, "max_tokens": 2},
        "/v1/completions": {"model": TINY, "prompt": "hi", "max_tokens": 2},
        "/v1/embeddings": {"model": "embed", "input": "hi"},
    }[path]
    r = http.post(path, json={**base, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and f"'{field}'" in err["message"]
    assert err["type"] == "invalid_request_error"


def test_llama_cpp_refusing_the_request_is_a_4xx_with_its_message(http: httpx.Client) -> None:
    """What llama.cpp answers 500 (or 501) for, but is the client's mistake, is a 400."""
    cases = [
        # llama.cpp: 500 "Unknown reasoning format"
        ("/v1/chat/completions", {"model": TINY, "messages": HI, "max_tokens": 2,
                                  "reasoning_format": "bogus"}, "reasoning format"),
        # llama.cpp: 500 "input (... tokens) is too large to process"
        ("/v1/embeddings", {"model": "embed", "input": "hi " * 3000}, "too large"),
        # beyond the model's trained context (2,048): corral's 400 with the numbers
        ("/v1/chat/completions", {"model": TINY, "messages": [{"role": "user",
                                  "content": "hi " * 3000}], "max_tokens": 2},
         "takes at most 2,048 (its trained context)"),
        # llama.cpp: 400s pass as they are
        ("/v1/chat/completions", {"model": TINY, "messages": HI, "max_tokens": 2,
                                  "grammar": "root ::= ???"}, "grammar"),
        ("/v1/chat/completions", {"model": "tools", "messages": HI, "max_tokens": 2,
                                  "grammar": 'root ::= "a"', "tools": [{"type": "function",
                                  "function": {"name": "f"}}]}, "grammar"),
    ]  # fmt: skip
    for path, body, words in cases:
        r = http.post(path, json=body)
        assert r.status_code == 400, (path, r.text)
        assert words in r.json()["error"]["message"], r.text
        assert http.get("/api/version").status_code == 200


def test_deeply_nested_json_is_400_and_the_connection_stays_open(http: httpx.Client) -> None:
    for depth in (100, 255, 300, 1024, 2000):
        body = b'{"model": "tiny", "messages": ' + b"[" * depth + b"]" * depth + b"}"
        for path in ("/api/chat", "/v1/chat/completions", "/v1/messages"):
            r = http.post(path, content=body)
            assert r.status_code == 400, r.text
            assert "too deeply nested" in r.text
    r = http.post("/api/generate", json={"model": TINY, "prompt": "hi", "stream": False,
                                         "options": {"num_predict": 1}})  # fmt: skip
    assert r.status_code == 200


def test_ollama_tool_calls_of_the_wrong_shape_name_the_field(http: httpx.Client) -> None:
    def chat(calls: object) -> httpx.Response:
        msgs = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": "", "tool_calls": calls},
                {"role": "user", "content": "and?"}]  # fmt: skip
        return http.post("/api/chat", json={"model": TINY, "messages": msgs, "stream": False,
                                            "options": {"num_predict": 1}})  # fmt: skip

    for calls, words in [
        ("x", "'messages[1].tool_calls'"),
        ([5], "messages[1].tool_calls[0]"),
        ([{"function": "f"}], "messages[1].tool_calls[0]"),
        ([{"function": {"name": 5}}], "'messages[1].tool_calls[0].function.name'"),
        ([{"function": {"arguments": {}}}], "'messages[1].tool_calls[0].function.name'"),
        ([{"function": {"name": "f", "arguments": 5}}],
         "'messages[1].tool_calls[0].function.arguments'"),
    ]:
        r = chat(calls)
        assert r.status_code == 400, r.text
        assert words in r.json()["error"], r.text
    ok = chat([{"function": {"name": "f", "arguments": {"a": [1, {"b": None}]}}}])
    assert ok.status_code == 200 and ok.json()["done"], ok.text


# ---- options that would hurt other clients -------------------------------------------------


def ps_of(http: httpx.Client, model: str) -> dict:
    return next(m for m in http.get("/api/ps").json()["models"] if m["name"] == f"{model}:latest")


def gen(http: httpx.Client, prompt: str = "hi", **options: object) -> httpx.Response:
    return http.post("/api/generate", json={
        "model": TINY, "prompt": prompt, "stream": False,
        "options": {"num_predict": 1, **options},
    })  # fmt: skip


def test_a_plain_request_gets_the_default_context_after_another_client_shrank_it(
    http: httpx.Client,
) -> None:
    assert gen(http, num_ctx=300).status_code == 200
    assert ps_of(http, TINY)["context_length"] == 300
    # ~600 tokens: more than 300, less than the server's default of 1024.
    long = "hello world " * 200
    r = gen(http, long)
    assert r.status_code == 200, r.text
    assert 300 < r.json()["prompt_eval_count"] < 1024
    assert ps_of(http, TINY)["context_length"] == 1024
    # A context larger than the default serves plain requests as it is: no reload.
    assert gen(http, num_ctx=2048).status_code == 200
    pid = ps_of(http, TINY)["pid"]
    assert gen(http, long).status_code == 200
    assert ps_of(http, TINY)["pid"] == pid and ps_of(http, TINY)["context_length"] == 2048


def test_num_ctx_is_clamped_to_a_minimum_and_to_the_training_context(http: httpx.Client) -> None:
    assert gen(http, num_ctx=16).status_code == 200
    assert ps_of(http, TINY)["context_length"] == 256
    assert gen(http, num_ctx=100_000).status_code == 200  # tiny was trained on 2048
    assert ps_of(http, TINY)["context_length"] == 2048
    assert gen(http).status_code == 200


def test_num_thread_beyond_the_cores_is_clamped(http: httpx.Client) -> None:
    assert gen(http, num_thread=1024).status_code == 200
    runner = psutil.Process(ps_of(http, TINY)["pid"])
    cores = len(os.sched_getaffinity(0))
    spec = next(a for a in runner.cmdline() if a.startswith("{"))
    assert f'"threads": {cores}' in spec, spec
    assert runner.num_threads() < 64  # llama.cpp starts a thread per num_thread
    assert gen(http).status_code == 200


@pytest.mark.parametrize(
    ("option", "value"),
    [("num_batch", 0), ("num_batch", 10**6), ("num_ctx", 0), ("num_ctx", 10**12),
     ("num_thread", -1), ("num_thread", 10**6), ("num_gpu", 10**9), ("main_gpu", -1)],
)  # fmt: skip
def test_absurd_runner_options_are_refused(http: httpx.Client, option: str, value: int) -> None:
    r = gen(http, **{option: value})
    assert r.status_code == 400 and f"'options.{option}'" in r.json()["error"], r.text


def test_an_unexpected_exception_is_a_500_in_the_family_shape_and_not_raised_on() -> None:
    """The last line of defence: whatever a handler raises, the client gets its family's error
    and uvicorn never sees the exception (it would close the keep-alive connection)."""
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.routing import Route
    from starlette.testclient import TestClient

    from corral.server import Unhandled

    async def boom(request: object) -> None:
        raise TypeError("a bug")

    paths = ["/api/chat", "/v1/chat/completions", "/v1/messages"]
    app = Starlette(routes=[Route(p, boom, methods=["POST"]) for p in paths],
                    middleware=[Middleware(Unhandled)])  # fmt: skip
    with TestClient(app) as client:  # raises if the exception escaped the app
        bodies = [client.post(p).json() for p in paths]
    assert bodies[0] == {"error": "internal error: TypeError"}
    assert bodies[1]["error"]["message"] == "internal error: TypeError"
    assert bodies[1]["error"]["type"] == "server_error"
    assert bodies[2]["type"] == "error" and bodies[2]["error"]["type"] == "api_error"
