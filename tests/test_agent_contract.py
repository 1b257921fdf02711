"""The edges of the API contract that coding agents hit first: Claude Code's system messages
inside `messages`, its billing header, betas and model discovery; Codex --oss's version check
and pull of a present model; Ollama's root and raw-mode answers. Pure translation tests first,
then the real server with the real `anthropic` and `ollama` clients."""

from __future__ import annotations

from typing import Any

import anthropic
import httpx
import ollama
import orjson
import pytest

from corral.api.families.anthropic.protocol import to_chat
from corral.api.model_lists import anthropic_model_list as model_list
from corral.core.roles import place_system, renders_later_system
from corral.errors import ApiError
from corral.testing.ggufwrite import smollm2_path

SMOL = "smollm2:135m"

REMINDER = "<system-reminder>Today is 2026-11-25.</system-reminder>"


# A Claude Code-shaped request (2.1.x): the billing header block first, cache_control on
# blocks, a system message inside `messages`, adaptive thinking, effort, context management.
def claude_code_body(cch: str = "a1b2c", turns: list[dict[str, Any]] | None = None) -> dict:
    return {
        "model": SMOL, "max_tokens": 8, "temperature": 0,
        "system": [
            {"type": "text",
             "text": f"x-anthropic-billing-header: cc_version=2.1.197.abc; cch={cch};"},
            {"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude.",
             "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": "You are an interactive CLI tool that helps users with "
             "software engineering tasks. " * 8, "cache_control": {"type": "ephemeral"}},
        ],
        "messages": turns or [
            {"role": "user", "content": [{"type": "text", "text": "List the files.",
                                          "cache_control": {"type": "ephemeral"}}]},
            {"role": "system", "content": REMINDER},
        ],
        "tools": [{
            "name": "Bash", "description": "Run a shell command",
            "input_schema": {"type": "object", "properties": {"command": {"type": "string"}},
                             "required": ["command"]},
            "cache_control": {"type": "ephemeral"},
        }, {"type": "web_search_20250305", "name": "web_search", "max_uses": 5}],
        "thinking": {"type": "adaptive"},
        "output_config": {"effort": "high"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "metadata": {"user_id": "user_abc_account_def_session_123"},
        "stream": False,
    }  # fmt: skip


# ---- pure: where system messages go -----------------------------------------------------------
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
ALTERNATING = (  # Mistral's and Gemma's kind: roles must alternate, a system only first
    "{% if messages[0]['role'] == 'system' %}{% set rest = messages[1:] %}"
    "{% else %}{% set rest = messages %}{% endif %}"
    "{% for m in rest %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant') }}"
    "{% endif %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
)
FIRST_ONLY = (  # renders the first system message and silently drops any other
    "{% for m in messages %}{% if m['role'] != 'system' or loop.first %}"
    "<{{ m['role'] }}>{{ m['content'] }}{% endif %}{% endfor %}"
)


def test_which_templates_render_a_later_system_message() -> None:
    import gguf

    smol = gguf.GGUFReader(smollm2_path()).fields["tokenizer.chat_template"]
    smol_template = bytes(smol.parts[smol.data[0]]).decode()
    assert renders_later_system(smol_template)
    assert renders_later_system(CHATML)
    assert renders_later_system(None)  # llama.cpp's ChatML fallback
    assert not renders_later_system(ALTERNATING)
    assert not renders_later_system(FIRST_ONLY)
    # Hermes 3's tool-use template iterates `tools` unguarded: jinja2 raises TypeError on the
    # probe, which must mean "fold", not a 500.
    assert not renders_later_system("{% for t in tools %}{{ t }}{% endfor %}" + CHATML)


def test_place_system_keeps_or_folds() -> None:
    msgs = [
        {"role": "system", "content": "top"}, {"role": "system", "content": "second"},
        {"role": "user", "content": "u1"}, {"role": "assistant", "content": "a1"},
        {"role": "system", "content": "reminder"}, {"role": "user", "content": "u2"},
    ]  # fmt: skip
    kept = place_system(msgs, in_place=True)
    assert kept[0] == {"role": "system", "content": "top\n\nsecond"}
    assert kept[1:] == msgs[2:]
    folded = place_system(msgs, in_place=False)
    assert [m["role"] for m in folded] == ["system", "user", "assistant", "user"]
    assert folded[0]["content"] == "top\n\nsecond"  # the prefix does not change
    assert folded[3]["content"] == "reminder\n\nu2"
    # At the end of the conversation, the last user turn takes it.
    tail = place_system([{"role": "user", "content": "u1"}, {"role": "system", "content": "r"}],
                        in_place=False)  # fmt: skip
    assert tail == [{"role": "user", "content": "u1\n\nr"}]
    # Content with images stays a list of parts.
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}
    parts = place_system([{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                          {"role": "system", "content": "r"},
                          {"role": "user", "content": [image]}], in_place=False)  # fmt: skip
    assert parts[-1]["content"] == [{"type": "text", "text": "r"}, image]
    # No user turn at all: the system prompt takes it.
    assert place_system([{"role": "assistant", "content": "a"},
                         {"role": "system", "content": "r"}], in_place=False)[0] == {
        "role": "system", "content": "r"}  # fmt: skip


def test_claude_code_body_to_chat() -> None:
    chat = to_chat(claude_code_body())
    system = chat.messages[0]
    assert system["role"] == "system" and "x-anthropic-billing-header" not in system["content"]
    assert system["content"].startswith("You are Claude Code")
    assert chat.messages[-1] == {"role": "system", "content": REMINDER}
    assert [t["function"]["name"] for t in chat.tools] == ["Bash"]  # the server tool left out
    assert chat.params["chat_template_kwargs"] == {"enable_thinking": True,
                                                   "reasoning_effort": "high"}  # fmt: skip
    # The billing header differs on every request; the chat does not.
    assert to_chat(claude_code_body("zzzzz")).messages == chat.messages
    # A system message's content as text blocks; a string system prompt with the header line.
    blocks = to_chat({"messages": [
        {"role": "user", "content": "hi"},
        {"role": "system", "content": [{"type": "text", "text": "a"},
                                       {"type": "text", "text": "b"}]},
    ], "system": "x-anthropic-billing-header: cch=1;\nBe brief."})  # fmt: skip
    # Only a header the prompt starts with is one; the same words inside a prompt stay.
    kept = "Quote this: x-anthropic-billing-header: cch=1;"
    assert to_chat({"messages": [{"role": "user", "content": "hi"}], "system": kept}
                   ).messages[0]["content"] == kept  # fmt: skip
    assert blocks.messages == [{"role": "system", "content": "Be brief."},
                               {"role": "user", "content": "hi"},
                               {"role": "system", "content": "a\nb"}]  # fmt: skip


def test_forcing_a_server_tool_is_refused() -> None:
    body = claude_code_body()
    body["tool_choice"] = {"type": "tool", "name": "web_search"}
    with pytest.raises(ApiError) as e:
        to_chat(body)
    assert e.value.status == 400 and "server tool" in e.value.message


def test_model_list_pages() -> None:
    class E:
        def __init__(self, name: str) -> None:
            self.name, self.modified_at = name, 1_700_000_000.0

    entries: Any = [E(n) for n in ("a", "b", "c", "d")]
    first = model_list(entries, {"limit": "2"})
    assert [m["id"] for m in first["data"]] == ["a", "b"]
    assert first["has_more"] and first["first_id"] == "a" and first["last_id"] == "b"
    assert first["data"][0] == {"type": "model", "id": "a", "display_name": "a",
                                "created_at": "2023-11-14T22:13:20Z"}  # fmt: skip
    rest = model_list(entries, {"after_id": "b"})
    assert [m["id"] for m in rest["data"]] == ["c", "d"] and not rest["has_more"]
    before = model_list(entries, {"before_id": "d", "limit": "2"})
    assert [m["id"] for m in before["data"]] == ["b", "c"] and before["has_more"]
    for bad in ({"limit": "0"}, {"limit": "x"}, {"after_id": "nope"}):
        with pytest.raises(ApiError):
            model_list(entries, bad)


# ---- the real server ---------------------------------------------------------------------------
def test_claude_code_request(http: httpx.Client) -> None:
    betas = ("claude-code-20250219,mid-conversation-system-2026-04-07,"
             "interleaved-thinking-2025-05-14,no-such-beta-2099-01-01")
    headers = {"anthropic-version": "2023-06-01", "x-api-key": "x", "anthropic-beta": betas}
    r = http.post("/v1/messages?beta=true", json=claude_code_body(), headers=headers)
    assert r.status_code == 200, r.text
    assert r.json()["type"] == "message"
    streamed = http.post("/v1/messages?beta=true", headers=headers,
                         json={**claude_code_body(), "stream": True})  # fmt: skip
    assert streamed.status_code == 200 and b"event: message_stop" in streamed.content
    counted = http.post("/v1/messages/count_tokens?beta=true", headers=headers,
                        json={k: v for k, v in claude_code_body().items()
                              if k not in ("max_tokens", "stream", "temperature")})  # fmt: skip
    assert counted.status_code == 200, counted.text
    assert counted.json()["input_tokens"] > 100


def test_billing_header_leaves_the_prompt_alone(anthropic_client: anthropic.Anthropic) -> None:
    def count(body: dict[str, Any]) -> int:
        return anthropic_client.messages.count_tokens(
            model=SMOL, system=body["system"], messages=body["messages"]
        ).input_tokens

    with_header = count(claude_code_body("11111"))
    assert count(claude_code_body("99999")) == with_header
    body = claude_code_body()
    body["system"] = body["system"][1:]
    assert count(body) == with_header


def test_mid_conversation_system_message_renders_in_place(
    anthropic_client: anthropic.Anthropic
) -> None:
    """SmolLM2's template renders a later system turn: the message costs its own turn's
    tokens, more than the same text folded into the user's turn would."""
    convo = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    base = anthropic_client.messages.count_tokens(model=SMOL, messages=[
        *convo, {"role": "user", "content": "Bye"}]).input_tokens  # fmt: skip
    reminder: Any = {"role": "system", "content": "Be brief."}
    with_system = anthropic_client.messages.count_tokens(model=SMOL, messages=[
        *convo, reminder, {"role": "user", "content": "Bye"}]).input_tokens  # fmt: skip
    folded = anthropic_client.messages.count_tokens(model=SMOL, messages=[
        *convo, {"role": "user", "content": "Be brief.\n\nBye"}]).input_tokens  # fmt: skip
    assert base < folded < with_system


def test_beta_messages_with_the_sdk(anthropic_client: anthropic.Anthropic) -> None:
    r = anthropic_client.beta.messages.create(
        model=SMOL, max_tokens=4, messages=[{"role": "user", "content": "Hi"}],
        betas=["context-management-2025-06-27", "some-future-beta-2030-01-01"],
        extra_body={"temperature": 0},
    )  # fmt: skip
    assert r.role == "assistant" and r.usage.output_tokens > 0


def test_models_in_anthropic_shape(
    anthropic_client: anthropic.Anthropic, http: httpx.Client
) -> None:
    page = anthropic_client.models.list()
    ids = [m.id for m in page.data]
    assert SMOL in ids and all(m.type == "model" for m in page.data)
    one = anthropic_client.models.retrieve(SMOL)
    assert one.id == SMOL and one.display_name == SMOL and one.created_at.year > 2000
    raw = http.get("/v1/models", params={"limit": 1},
                   headers={"anthropic-version": "2023-06-01"}).json()  # fmt: skip
    assert set(raw) == {"data", "has_more", "first_id", "last_id"}
    assert len(raw["data"]) == 1 and set(raw["data"][0]) == {
        "type", "id", "display_name", "created_at"}  # fmt: skip
    # Without the header: OpenAI's list.
    openai_shape = http.get("/v1/models").json()
    assert openai_shape["object"] == "list" and openai_shape["data"][0]["object"] == "model"


def test_root_answers_as_ollama_does(http: httpx.Client) -> None:
    r = http.get("/")
    assert r.status_code == 200 and r.text == "Ollama is running"
    assert r.headers["x-corral-version"]
    head = http.head("/")
    assert head.status_code == 200 and head.content == b""


def test_version_is_a_current_ollama_api(http: httpx.Client) -> None:
    got = http.get("/api/version").json()
    major, minor, patch = (int(x) for x in got["version"].split("."))
    assert (major, minor, patch) >= (0, 13, 4)  # Codex --oss's minimum
    assert got["corral"] == __import__("corral").__version__


@pytest.mark.parametrize("name", [SMOL, "tiny", "tiny:latest"])
def test_pull_of_a_present_model_succeeds(server, http: httpx.Client, name: str) -> None:
    r = http.post("/api/pull", json={"model": name, "stream": False})
    assert r.status_code == 200 and r.json() == {"status": "success"}
    streamed = http.post("/api/pull", json={"model": name})
    lines = [orjson.loads(line) for line in streamed.text.splitlines()]
    assert lines[0] == {"status": "pulling manifest"} and lines[-1] == {"status": "success"}
    progress = list(ollama.Client(host=server.url).pull(name, stream=True))
    assert progress[-1].status == "success"


def test_pull_of_an_absent_local_name_still_fails(http: httpx.Client) -> None:
    r = http.post("/api/pull", json={"model": "no-such-model", "stream": False})
    assert r.status_code == 400 and "hf.co" in r.json()["error"]


@pytest.mark.parametrize("extra", [{"system": "Be brief."}, {"template": "{{ .Prompt }}"},
                                   {"context": [1, 2, 3]}])  # fmt: skip
def test_raw_with_system_template_or_context(http: httpx.Client, extra: dict[str, Any]) -> None:
    r = http.post("/api/generate", json={"model": SMOL, "prompt": "Hi", "raw": True, **extra})
    assert r.status_code == 400
    assert r.json() == {"error": "raw mode does not support template, system, or context"}


# ---- the prompt cache across an agent's turns ---------------------------------------------------
@pytest.mark.slow
def test_claude_code_session_evaluates_only_new_tokens(
    anthropic_client: anthropic.Anthropic
) -> None:
    """20 turns of a Claude Code-shaped conversation: a billing header that changes every
    request, a growing history with system reminders inside it. After the first turn, every
    turn reuses all of the previous turn's prompt from the runner's cache and evaluates only
    what is new."""
    history: list[dict[str, Any]] = []
    previous = 0
    for turn in range(20):
        history.append({"role": "user", "content": f"Step {turn}: go on."})
        if turn % 5 == 0:
            reminder = f"<system-reminder>{turn}</system-reminder>"
            history.append({"role": "system", "content": reminder})
        body = claude_code_body(cch=f"{turn:05x}", turns=history)
        r = anthropic_client.messages.create(
            model=SMOL, max_tokens=4, system=body["system"], messages=history,
            tools=body["tools"], extra_body={"temperature": 0},
        )  # fmt: skip
        u = r.usage
        reused = u.cache_read_input_tokens or 0
        prompt = u.input_tokens + reused
        if turn:
            assert reused >= previous, (turn, u)  # the whole previous prompt came from the cache
            assert 0 < u.input_tokens <= prompt - previous, (turn, u)  # only the new tokens
        text = "".join(b.text for b in r.content if b.type == "text")
        history.append({"role": "assistant", "content": text or "ok"})
        previous = prompt


def test_show_keeps_arrays_for_verbose(server) -> None:
    client = ollama.Client(host=server.url)
    plain = client.show(SMOL).modelinfo or {}
    # as Ollama's docs show it: the arrays present and empty unless verbose
    assert plain["tokenizer.ggml.tokens"] == plain["tokenizer.ggml.merges"] == []
    assert plain["tokenizer.ggml.token_type"] == []
    full = server.client.post("/api/show", json={"model": SMOL, "verbose": True}).json()
    tokens = full["model_info"]["tokenizer.ggml.tokens"]
    assert len(tokens) == 49152 and tokens[:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert full["model_info"]["tokenizer.ggml.token_type"][:3] == [3, 3, 3]
    assert len(full["model_info"]["tokenizer.ggml.merges"]) > 40000


# A chat template that, as Mistral's and Gemma's do, refuses a system message anywhere but first.
STRICT = (
    "{% if messages[0]['role'] == 'system' %}{% set rest = messages[1:] %}"
    "{% else %}{% set rest = messages %}{% endif %}"
    "{% for m in rest %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant') }}"
    "{% endif %}{{ '[' + m['role'] + '] ' + m['content'] + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '[assistant] ' }}{% endif %}"
)


@pytest.fixture(scope="module")
def strict(start_server, tmp_path_factory: pytest.TempPathFactory):
    from corral.testing import synth

    d = tmp_path_factory.mktemp("strict")
    synth.write_llama_model(d / "strict.gguf", n_layer=1, context_length=1024,
                            chat_template=STRICT)  # fmt: skip
    return start_server(d, CORRAL_BUILTIN_MODELS="0")


def test_later_system_messages_on_every_api(strict) -> None:
    """A template that refuses a later system message gets it folded into the next user turn
    on every generating route, not llama.cpp's template error (Codex's developer messages,
    Claude Code's reminders)."""
    assert not renders_later_system(STRICT)
    turns: list[dict[str, Any]] = [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Bye"},
    ]  # fmt: skip
    http = strict.client
    r = http.post("/api/chat", json={"model": "strict", "messages": turns, "stream": False,
                                     "options": {"num_predict": 2}})  # fmt: skip
    assert r.status_code == 200, r.text
    r = http.post("/v1/responses", json={"model": "strict", "max_output_tokens": 2, "input": [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
        {"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Bye"}]})
    assert r.status_code == 200, r.text
    r = http.post("/v1/messages", json={"model": "strict", "max_tokens": 2, "messages": turns})
    assert r.status_code == 200, r.text
