"""Fuzzed requests on every route (hypothesis): malformed JSON, bodies that are not objects,
every documented field with a value of the wrong type, shape or size, nesting far past any
API's, absurd counts and unknown models. Whatever comes in, corral answers in the route
family's error shape, never with a 5xx (but 503 busy / 507 cannot fit), and the client's
keep-alive connection survives to carry its next request.

Generation stays cheap: every fuzzed body keeps a tiny token limit unless the limit itself is
what is fuzzed, and then only with values that are invalid; options that reshape a runner
(and so reload it) are fuzzed only with values of the wrong type."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

CHAT_MODEL, EMBED_MODEL = "tiny", "embed"
LIMIT = 2  # tokens a fuzzed body may generate
USER = [{"role": "user", "content": "hi"}]
FN = {"name": "get_weather", "description": "d",
      "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}  # fmt: skip

Path = tuple[str | int, ...]


class Body(bytes):
    """A request body that shows only its start in hypothesis's reports."""

    def __repr__(self) -> str:
        return f"<{len(self)} bytes: {bytes(self[:200])!r}>"


@dataclass
class Route:
    path: str
    family: str  # "ollama", "openai" or "anthropic": the error shape its errors take
    base: dict[str, Any]  # a valid, cheap request
    examples: dict[str, Any]  # more documented fields, each with a valid value
    limits: dict[Path, Any] = field(default_factory=dict)  # token limits, put back after fuzzing
    # Fields a valid value of which would reload or unload a runner: only wrong types there.
    touchy: frozenset[str] = frozenset()

    def __str__(self) -> str:
        return self.path


def chat_examples() -> dict[str, Any]:
    """OpenAI chat fields (and llama.cpp's own) with valid values."""
    return {
        "messages": [{"role": "system", "content": "s"},
                     {"role": "user", "content": [{"type": "text", "text": "hi"}]},
                     {"role": "assistant", "content": None, "tool_calls": [
                         {"id": "c1", "type": "function",
                          "function": {"name": "get_weather", "arguments": "{}"}}]},
                     {"role": "tool", "tool_call_id": "c1", "content": "sunny"}],
        "temperature": 0.5, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "seed": 7,
        "presence_penalty": 0.1, "frequency_penalty": 0.1, "max_completion_tokens": LIMIT,
        "stop": ["\n\n"], "logit_bias": {"15": -1}, "logprobs": True, "top_logprobs": 2,
        "n": 2, "stream": True, "stream_options": {"include_usage": True},
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": "x", "schema": {"type": "object"}}},
        "tools": [{"type": "function", "function": FN}], "tool_choice": "auto",
        "parallel_tool_calls": False, "user": "u", "n_probs": 2, "samplers": ["top_k"],
        "chat_template_kwargs": {"enable_thinking": False}, "grammar": "root ::= \"a\"",
        "json_schema": {"type": "string"}, "cache_prompt": True, "id_slot": -1, "n_cmpl": 1,
        "lora": [], "reasoning_format": "none", "reasoning_effort": "low",
        "metadata": {"k": "v"}, "store": False, "service_tier": "auto",
    }  # fmt: skip


def ollama_examples() -> dict[str, Any]:
    return {
        "options": {"num_predict": LIMIT, "temperature": 0.5, "top_k": 40, "top_p": 0.9,
                    "seed": 1, "stop": ["\n"], "repeat_penalty": 1.1, "num_ctx": 1024,
                    "num_thread": 2, "num_gpu": 0, "main_gpu": 0, "num_batch": 64},
        "stream": True, "format": {"type": "object"}, "keep_alive": "5m", "think": False,
        "logprobs": True, "top_logprobs": 2,
    }  # fmt: skip


ROUTES = [
    Route("/api/generate", "ollama",
          {"model": CHAT_MODEL, "prompt": "hi", "stream": False, "options": {"num_predict": LIMIT}},
          {**ollama_examples(), "system": "s", "raw": True, "suffix": "", "context": [1, 2],
           "images": ["aGk="], "template": ""},
          {("options", "num_predict"): LIMIT}, frozenset({"keep_alive"})),
    Route("/api/chat", "ollama",
          {"model": CHAT_MODEL, "messages": USER, "stream": False,
           "options": {"num_predict": LIMIT}},
          {**ollama_examples(),
           "messages": [{"role": "user", "content": "hi", "images": ["aGk="]},
                        {"role": "assistant", "content": "", "thinking": "t", "tool_calls": [
                            {"function": {"name": "get_weather", "arguments": {"city": "x"}}}]},
                        {"role": "tool", "content": "sunny", "tool_name": "get_weather"}],
           "tools": [{"type": "function", "function": FN}]},
          {("options", "num_predict"): LIMIT}, frozenset({"keep_alive"})),
    Route("/api/embed", "ollama", {"model": EMBED_MODEL, "input": "hi"},
          {"input": ["a", "b"], "truncate": True, "dimensions": 8, "options": {"seed": 1},
           "keep_alive": "5m"}, touchy=frozenset({"keep_alive"})),
    Route("/api/embeddings", "ollama", {"model": EMBED_MODEL, "prompt": "hi"},
          {"options": {"seed": 1}, "keep_alive": "5m"}, touchy=frozenset({"keep_alive"})),
    Route("/api/show", "ollama", {"model": CHAT_MODEL}, {"name": CHAT_MODEL, "verbose": True}),
    Route("/v1/chat/completions", "openai",
          {"model": CHAT_MODEL, "messages": USER, "max_tokens": LIMIT}, chat_examples(),
          {("max_tokens",): LIMIT, ("max_completion_tokens",): LIMIT}),
    Route("/v1/completions", "openai",
          {"model": CHAT_MODEL, "prompt": "hi", "max_tokens": LIMIT},
          {"prompt": ["a", "b"], "echo": True, "logprobs": 2, "n": 2, "stream": True,
           "stream_options": {"include_usage": True}, "stop": "\n", "seed": 3, "suffix": "",
           "temperature": 0.2, "logit_bias": {"15": 1}, "best_of": 1, "user": "u"},
          {("max_tokens",): LIMIT}),
    Route("/v1/embeddings", "openai", {"model": EMBED_MODEL, "input": "hi"},
          {"input": [[1, 2, 3]], "dimensions": 8, "encoding_format": "base64", "user": "u"}),
    Route("/v1/messages", "anthropic",
          {"model": CHAT_MODEL, "max_tokens": LIMIT, "messages": USER},
          {"system": [{"type": "text", "text": "s"}], "stop_sequences": ["\n"],
           "temperature": 0.5, "top_p": 0.9, "top_k": 5, "stream": True,
           "metadata": {"user_id": "u"}, "thinking": {"type": "disabled"},
           "tools": [{"name": "get_weather", "description": "d",
                      "input_schema": {"type": "object"}}],
           "tool_choice": {"type": "auto", "disable_parallel_tool_use": True},
           "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}},
           "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
                        {"role": "assistant", "content": [
                            {"type": "tool_use", "id": "t1", "name": "get_weather",
                             "input": {"city": "x"}}]},
                        {"role": "user", "content": [
                            {"type": "tool_result", "tool_use_id": "t1", "content": "sunny"}]}]},
          {("max_tokens",): LIMIT}),
    Route("/v1/messages/count_tokens", "anthropic", {"model": CHAT_MODEL, "messages": USER},
          {"system": "s", "tools": [{"name": "f", "input_schema": {"type": "object"}}]}),
    Route("/v1/responses", "openai",
          {"model": CHAT_MODEL, "input": "hi", "max_output_tokens": LIMIT},
          {"instructions": "s", "temperature": 0.5, "top_p": 0.9, "stream": True,
           "input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
                     {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                     {"type": "function_call_output", "call_id": "c1", "output": "ok"}],
           "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
           "tool_choice": "auto", "text": {"format": {"type": "json_object"}},
           "reasoning": {"effort": "low"}, "include": ["message.output_text.logprobs"],
           "top_logprobs": 2, "parallel_tool_calls": True, "metadata": {"k": "v"},
           "store": False, "truncation": "disabled", "user": "u", "max_tool_calls": 1},
          {("max_output_tokens",): LIMIT}),
    # No model here ranks: a valid rerank body passes every check, then gets 400 for the model.
    Route("/v1/rerank", "openai", {"model": EMBED_MODEL, "query": "q", "documents": ["a"]},
          {"documents": [{"text": "a"}, "b"], "top_n": 1, "return_documents": True}),
    Route("/rerank", "ollama", {"model": EMBED_MODEL, "query": "q", "documents": ["a"]},
          {"top_n": 1, "return_documents": True}),
    Route("/models/load", "ollama", {"model": CHAT_MODEL}, {}),
    Route("/models/unload", "ollama", {"model": "tiny2"}, {}),  # not loaded: 400
]  # fmt: skip


# ---- values ------------------------------------------------------------------------------


def deep(depth: int, kind: str) -> orjson.Fragment:
    """JSON nested `depth` levels (written as bytes: no JSON library writes it that deep)."""
    if kind == "list":
        return orjson.Fragment(b"[" * depth + b"]" * depth)
    return orjson.Fragment(b'{"a":' * depth + b"1" + b"}" * depth)


def number(n: int) -> int | orjson.Fragment:
    """An integer as JSON, also beyond 64 bits (which orjson does not write)."""
    return n if -(2**63) <= n < 2**64 else orjson.Fragment(str(n).encode())


ABSURD = [10**12, -(10**12), 2**63, 2**64 + 1, -(2**63) - 1, 10**6, -2, 1e300, -1e-300, 0.5]
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70).map(number),
    st.sampled_from(ABSURD).map(lambda v: number(v) if isinstance(v, int) else v),
    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=12),
)  # fmt: skip
nested = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3)
    | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
huge = st.sampled_from(["x" * 200_000, "\u00e9" * 70_000, "[" * 50_000])
nesting = st.builds(deep, st.sampled_from([65, 100, 255, 256, 1000, 1024, 1025, 2000]),
                    st.sampled_from(["list", "object"]))  # fmt: skip
bad = st.one_of(scalars, nested, huge, nesting)
# For fields whose valid values are costly (token limits, runner-shaping options, keep_alive):
# values no route accepts there. Counts also get numbers out of every range.
not_a_number = st.one_of(
    st.sampled_from([True, False, "", [], [2], {}, {"a": 2}, {"num_predict": 2}]),
    st.text(max_size=12).map(lambda s: "x" + s), huge, nesting,
)  # fmt: skip
bad_count = not_a_number | st.sampled_from([1.5, -(10**12), 10**12, number(2**64), -5])
TOUCHY_OPTIONS = ("num_ctx", "num_thread", "num_gpu", "main_gpu")


def leaves(value: Any, at: Path = ()) -> Iterator[Path]:
    """Every path inside a JSON value (containers and leaves)."""
    yield at
    if isinstance(value, dict):
        for k, v in value.items():
            yield from leaves(v, (*at, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from leaves(v, (*at, i))


def put(value: Any, at: Path, new: Any) -> Any:
    """`value` with the part at `at` replaced by `new` (copied, never changed in place)."""
    if not at:
        return new
    value = orjson.loads(orjson.dumps(value))
    node = value
    for key in at[:-1]:
        node = node[key]
    node[at[-1]] = new
    return value


def wrong_values(route: Route, at: Path) -> st.SearchStrategy[Any]:
    """What to put at `at`: anything, unless a valid value there would generate without a
    limit, reload a runner (runner-shaping options) or unload one (keep_alive)."""
    if at in route.limits or (len(at) == 2 and at[0] == "options" and at[1] in TOUCHY_OPTIONS):
        return bad_count
    if at[0] in route.touchy:
        return not_a_number
    if any(limit[: len(at)] == at for limit in route.limits):  # holds a limit: keep it there
        return bad.filter(lambda v: v is not None)
    return bad


def cheap(route: Route, body: dict[str, Any], at: Path) -> bytes:
    """The body to send: its token limit put back (unless `at` is the limit), and of the
    options that reshape a runner only the one fuzzed, if any."""
    body = dict(body)
    for limit, n in route.limits.items():
        if limit == at:
            continue
        if len(limit) == 1:
            body[limit[0]] = n
        elif isinstance(body.get(limit[0]), dict):
            body[limit[0]] = {**body[limit[0]], limit[1]: n}
    options = body.get("options")
    if isinstance(options, dict):
        body["options"] = {k: v for k, v in options.items()
                           if k not in TOUCHY_OPTIONS or at == ("options", k)}  # fmt: skip
    return orjson.dumps(body)


# One value of each kind, each tried on every field (random ones follow).
KINDS: list[Any] = [
    "x", -1, 1.5, True, None, [1, "a"], {"a": 1}, "x" * 200_000,
    deep(300, "list"), deep(1100, "object"),
]  # fmt: skip


def each_kind(route: Route, name: str) -> list[bytes]:
    """The request with field `name` set to each of KINDS that is not costly there."""
    at = (name,)
    if at in route.limits:
        kinds = [k for k in KINDS if k is not None and not isinstance(k, int)] + [-5, 10**12]
    elif name in route.touchy:
        kinds = [k for k in KINDS if not isinstance(k, int | float | type(None))]
    elif name not in route.base or any(limit[0] == name for limit in route.limits):
        # null: an optional field left at its default (a plain request), or a limit dropped
        kinds = [k for k in KINDS if k is not None]
    else:
        kinds = KINDS
    out = [Body(cheap(route, {**route.base, name: k}, at)) for k in kinds]
    # And every part inside the field's example: a number, and an array, where it was not.
    example = route.examples.get(name, route.base.get(name))
    for inner in list(leaves(example))[1:]:
        for k in (12345, [1, {}]):
            if (name, *inner) not in route.limits:
                body = {**route.base, name: put(example, inner, k)}
                out.append(Body(cheap(route, body, (name, *inner))))
    return out


@st.composite
def fuzzed_field(draw: st.DrawFn, route: Route, name: str) -> bytes:
    """A valid request to `route` with field `name`, or a part inside it, replaced by a value
    of another type, shape or size."""
    example = route.examples.get(name, route.base.get(name))
    inner: Path = draw(st.sampled_from([*leaves(example)]))
    at = (name, *inner)
    body = {**route.base, name: put(example, inner, draw(wrong_values(route, at)))}
    return Body(cheap(route, body, at))


@st.composite
def fuzzed_request(draw: st.DrawFn, route: Route) -> bytes:
    """A valid request to `route` with another model (unknown, or not a name) or a field
    left out."""
    body: dict[str, Any] = dict(route.base)
    if draw(st.booleans()):
        names = st.sampled_from(["nope", "nope:latest", "../x", "/etc/passwd", "tiny:7b"])
        body["model"] = draw(st.one_of(bad, names))
        return Body(cheap(route, body, ("model",)))
    # Left out, a limit (or what holds it) would let the request generate without one.
    name = draw(st.sampled_from(sorted(k for k in body if all(k != at[0] for at in route.limits))))
    del body[name]
    return Body(cheap(route, body, (name,)))


garbage = st.one_of(
    st.binary(max_size=64),
    st.text(max_size=64).map(str.encode),
    st.sampled_from([b"", b" ", b"null", b"true", b"1", b"-1e999", b'"text"', b"[]", b"[{}]",
                     b'{"model": "tiny", ', b'{"model": "tiny"}}', b"{'model': 'tiny'}",
                     b'{"model": "tiny", "model": 5}', b"\xff\xfe{}", b'{"a": NaN}',
                     b'{"model": "\\ud800"}', b"\x00" * 10]),
    st.builds(orjson.dumps, nested),
    st.builds(lambda d, k: orjson.dumps({"model": CHAT_MODEL, "x": deep(d, k)}),
              st.integers(64, 1100), st.sampled_from(["list", "object"])),
).map(Body)  # fmt: skip


# ---- checks --------------------------------------------------------------------------------


def check_error_shape(family: str, body: Any) -> None:
    if family == "ollama":
        assert set(body) == {"error"} and isinstance(body["error"], str) and body["error"]
    elif family == "openai":
        err = body["error"]
        assert set(err) == {"message", "type", "param", "code"}, err
        assert isinstance(err["message"], str) and err["message"]
        assert err["type"] in ("invalid_request_error", "server_error")
        assert err["param"] is None or isinstance(err["param"], str)
    else:
        assert body["type"] == "error" and set(body) == {"type", "error"}
        assert isinstance(body["error"]["type"], str) and body["error"]["message"]


KEEP_ALIVE_GRACE = 4.0  # seconds idle after which a closed connection is not a drop


class Client:
    """One keep-alive connection for every fuzzed request: each request must go out on the
    connection the one before it used (a server that closed it, or dropped it after an error,
    shows as a new local port, or as a transport error)."""

    def __init__(self, url: str) -> None:
        self.http = httpx.Client(base_url=url, timeout=60)
        self.port: int | None = None
        self.answered = 0.0  # when the last response arrived

    def idle_too_long(self) -> bool:
        """Whether the server may have closed the connection for idling (uvicorn's keep-alive
        timeout, 5 s): generating a big value takes that long on a busy machine."""
        return time.monotonic() - self.answered > KEEP_ALIVE_GRACE

    def post(self, path: str, content: bytes) -> httpx.Response:
        idle = self.idle_too_long()
        r = self.http.post(path, content=content, headers={"content-type": "application/json"})
        self.answered = time.monotonic()
        port = int(r.extensions["network_stream"].get_extra_info("client_addr")[1])
        if not idle:
            assert self.port in (None, port), f"the connection was dropped before POST {path}"
        self.port = port
        return r


def send(client: Client, route: Route, content: bytes) -> httpx.Response:
    """POST, and check the answer: never a 5xx but busy or cannot fit, errors in the route
    family's shape, the connection kept open."""
    r = client.post(route.path, content)
    where = f"{route.path} {content[:300]!r} -> {r.status_code} {r.text[:500]}"
    if r.status_code >= 500:
        assert r.status_code in (503, 507), where
    if r.status_code >= 400:
        assert r.headers["content-type"].startswith("application/json"), where
        check_error_shape(route.family, r.json())
    else:
        assert r.status_code == 200, where
    assert r.headers.get("connection", "").lower() != "close", where
    return r


@pytest.fixture(scope="module")
def shared(server) -> Iterator[Client]:
    c = Client(server.url)
    yield c
    c.http.close()


@pytest.fixture
def client(shared: Client) -> Iterator[Client]:
    """The shared connection; after the test, it must still carry a request (so the test's
    last request did not drop it either). A test that failed does not fail the next one."""
    shared.port = None
    yield shared
    idle = shared.idle_too_long()
    r = shared.http.get("/api/version")
    assert r.status_code == 200
    if not idle:
        assert r.extensions["network_stream"].get_extra_info("client_addr")[1] == shared.port, (
            "the connection was dropped after the test's last request"
        )


def fuzz_settings(n: int) -> settings:
    return settings(
        max_examples=n, deadline=None, derandomize=True, database=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                               HealthCheck.data_too_large, HealthCheck.large_base_example],
    )  # fmt: skip


FIELDS = [(route, name) for route in ROUTES for name in sorted({*route.base, *route.examples})]


@pytest.mark.parametrize(("route", "name"), FIELDS, ids=[f"{r}:{n}" for r, n in FIELDS])
def test_fuzzed_field(client: Client, route: Route, name: str) -> None:
    for content in each_kind(route, name):
        send(client, route, content)

    @fuzz_settings(4)
    @given(content=fuzzed_field(route, name))
    def fuzz(content: bytes) -> None:
        send(client, route, content)

    fuzz()


@pytest.mark.parametrize("route", ROUTES, ids=str)
def test_fuzzed_model_and_missing_fields_then_still_serving(
    client: Client, route: Route
) -> None:
    @fuzz_settings(12)
    @given(content=fuzzed_request(route))
    def fuzz(content: bytes) -> None:
        send(client, route, content)

    fuzz()
    # After every fuzzed request above, still serving, on the same connection.
    ok = send(client, route, orjson.dumps(route.base))
    refused = route.path == "/models/unload" or "rerank" in route.path  # by design, see ROUTES
    assert ok.status_code == (400 if refused else 200), ok.text


@pytest.mark.parametrize("route", ROUTES[:1] + ROUTES[5:6] + ROUTES[8:9], ids=str)
def test_garbage_bodies(client: Client, route: Route) -> None:
    @fuzz_settings(25)
    @given(content=garbage)
    def fuzz(content: bytes) -> None:
        r = send(client, route, content)
        assert r.status_code in (400, 404), r.text  # never served: a body is required

    fuzz()


@pytest.mark.parametrize("route", ROUTES, ids=str)
@pytest.mark.parametrize(
    "content",
    [b'{"model": "tiny", ', b"[1, 2]", b'"text"', b"null", b"",
     b'{"model": "tiny", "x": ' + b"[" * 300 + b"]" * 300 + b"}"],
    ids=["bad-json", "array", "string", "null", "empty", "deep"],
)  # fmt: skip
def test_every_route_refuses_bodies_that_are_not_json_objects(
    client: Client, route: Route, content: bytes
) -> None:
    r = send(client, route, content)
    assert r.status_code == 400, r.text
    if content.endswith(b"]}"):
        assert "too deeply nested" in r.text


def test_nesting_within_the_limit_is_accepted(client: Client) -> None:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(25):  # 25 levels of objects in a tool's parameters: ~55 levels of JSON
        schema = {"type": "object", "properties": {"a": schema}}
    body = {"model": CHAT_MODEL, "messages": USER, "max_tokens": LIMIT,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}]}
    r = send(client, ROUTES[5], orjson.dumps(body))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("length", "stop", "tool_calls")


def test_a_huge_tools_field_then_hundreds_of_requests_then_unload(
    client: Client, server
) -> None:
    """The issue's wedge: a 100 KB `tools` made llama.cpp log a line longer than the log
    reader's limit; the runner later blocked on a full pipe. As a string it is refused now;
    as a valid tool list it reaches the runner, which must keep serving and then unload."""
    model, chat = "tiny2", ROUTES[5]
    base = {"model": model, "messages": USER, "max_tokens": 1}
    r = send(client, chat, orjson.dumps({**base, "tools": "x" * 100_000}))
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
    big = [{"type": "function", "function": {**FN, "description": "y" * 100_000}}]
    r = send(client, chat, orjson.dumps({**base, "tools": big}))
    assert r.status_code in (200, 400), r.text  # 400: the prompt exceeds the context
    for i in range(200):
        r = send(client, chat, orjson.dumps({**base, "seed": i}))
        assert r.status_code == 200, r.text
    r = client.post("/models/unload", orjson.dumps({"model": model}))
    assert r.status_code == 200 and r.json() == {"success": True}
    server.wait_for(
        lambda: all(m["name"] != f"{model}:latest" for m in server.ps()),
        timeout=15, what=f"{model} unloaded and its memory freed",
    )  # fmt: skip
