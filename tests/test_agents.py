"""The real coding agents, driven non-interactively against a real `corral serve`.

Claude Code (`claude -p`: Anthropic Messages), Codex (`codex exec --oss`: Ollama's API then the
Responses API; `codex exec` with a Responses provider on corral's /v1), opencode (`opencode run`:
an OpenAI-compatible provider, Chat Completions), qwen-code (`qwen -p`: Chat Completions) and
aider (`aider --message`: Ollama's /api/chat through litellm), at the versions pinned in
tests/agents (installed by `make setup-test`; a missing agent is a failure, never a skip).

Each agent talks to a scripted model (`tests/scripted.py`) whose answers are known: once
with a plain prompt (its output must be the model's reply), and once where the model calls one
of the agent's own tools, so that the whole loop runs: the tool call in the model family's
native format, parsed by llama.cpp and rendered by corral in the agent's API; the agent running
the tool (its effect checked: a file the command wrote in the scratch working directory); the
tool's result sent back to corral (the model answers only once the conversation holds a tool
result); the final answer printed. For aider the "tool" is its edit format: the reply is a
SEARCH/REPLACE block aider applies to a file.

Every agent runs with a scratch HOME and working directory, with its telemetry, update checks
and other outside traffic switched off, and with its HTTP(S) proxy set to a trap on loopback
(`Trap`, corral's 127.0.0.1 excepted): whatever an agent still asks of another host fails at once
without leaving the machine, and fails the test, so a new version that phones home is noticed.
(qwen-code ignores NO_PROXY, so it runs without the trap.)
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from scripted import Script, write_scripted_model

from corral.testing.server import CorralServer

StartServer = Callable[..., CorralServer]

AGENTS = Path(__file__).parent / "agents"
NODE_BIN = AGENTS / "node_modules" / ".bin"
# `make setup-test` puts aider in a virtualenv of its own inside corral's (.venv/aider).
AIDER = Path(sys.prefix) / "aider" / "bin" / "aider"
SETUP_HINT = "run `make setup-test` (it installs tests/agents and .venv/aider)"
# Upper bound for one agent run: a hung agent fails the test instead of blocking the suite.
RUN_TIMEOUT = 240
# The agents' prompts are large (Claude Code's first request is ~25k tokens of the scripted
# models' vocabulary); the scripted models are one tiny layer, so a long context costs little.
CONTEXT = 131072
PROMPT = "Say hello."


@dataclass(frozen=True)
class Model:
    family: str
    script: Script


def _shell(name: str) -> tuple[str, str]:
    """A command for an agent's shell tool: it prints and writes a marker of its own."""
    marker = f"corral-{name}"
    return marker, f"echo {marker} | tee proof.txt"


CLAUDE_MARK, CLAUDE_CMD = _shell("claude-code")
CODEX_OSS_MARK, CODEX_OSS_CMD = _shell("codex-oss")
CODEX_MARK, CODEX_CMD = _shell("codex-responses")
OPENCODE_MARK, OPENCODE_CMD = _shell("opencode")
QWEN_MARK, QWEN_CMD = _shell("qwen-code")
AIDER_EDIT = (
    "hello.py\n"
    "```python\n"
    "<<<<<<< SEARCH\n"
    'print("original")\n'
    "=======\n"
    'print("edited through corral")\n'
    ">>>>>>> REPLACE\n"
    "```\n"
)

# One model per scenario (file stem = model name); each tool call is written with the
# arguments the agent's own tool takes, as its requests declare the tool.
MODELS: dict[str, Model] = {
    "claude-plain": Model("qwen3-coder", Script(reply="Claude Code, hello from corral.")),
    "claude-bash": Model(
        "qwen3-coder",
        Script(
            reply="Claude Code, no tools offered.",
            call=("Bash", {"command": CLAUDE_CMD}),
            answer="Claude Code ran Bash through corral.",
        ),
    ),
    "codex-oss-plain": Model("gpt-oss", Script(reply="Codex over Ollama, hello from corral.")),
    "codex-oss-exec": Model(
        "gpt-oss",
        Script(
            reply="Codex over Ollama, no tools offered.",
            call=("exec_command", {"cmd": CODEX_OSS_CMD}),
            answer="Codex over Ollama ran exec_command through corral.",
        ),
    ),
    "codex-plain": Model("glm", Script(reply="Codex over Responses, hello from corral.")),
    "codex-exec": Model(
        "glm",
        Script(
            reply="Codex over Responses, no tools offered.",
            call=("exec_command", {"cmd": CODEX_CMD}),
            answer="Codex over Responses ran exec_command through corral.",
        ),
    ),
    "opencode-plain": Model("llama3", Script(reply="opencode, hello from corral.")),
    "opencode-bash": Model(
        "llama3",
        Script(
            reply="opencode, no tools offered.",
            call=("bash", {"command": OPENCODE_CMD}),
            answer="opencode ran bash through corral.",
        ),
    ),
    "qwen-plain": Model("qwen3", Script(reply="qwen-code, hello from corral.")),
    "qwen-shell": Model(
        "qwen3",
        Script(
            reply="qwen-code, no tools offered.",
            call=("run_shell_command", {"command": QWEN_CMD}),
            answer="qwen-code ran run_shell_command through corral.",
        ),
    ),
    "aider-plain": Model("mistral", Script(reply="aider, hello from corral.")),
    "aider-edit": Model("qwen2.5", Script(reply=AIDER_EDIT)),
}


@pytest.fixture(scope="module")
def corral(start_server: StartServer, tmp_path_factory: pytest.TempPathFactory) -> CorralServer:
    models = tmp_path_factory.mktemp("agent-models")
    for name, model in MODELS.items():
        write_scripted_model(models / f"{name}.gguf", model.family, model.script, CONTEXT)
    return start_server(
        models,
        CORRAL_CONTEXT_LENGTH=str(CONTEXT),
        # a scenario's runner stays for its second run; older ones make room
        CORRAL_MAX_LOADED_MODELS="2",
        CORRAL_KV_CACHE_SIZE="0",
    )


class Trap:
    """The agents' HTTP(S) proxy: it forwards nothing. Each connection's first line (a CONNECT
    to a host, or a plain request) is recorded and the connection closed at once, so a request
    meant for another machine fails fast and is seen."""

    def __init__(self) -> None:
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self.seen: list[str] = []
        self._settled = threading.Condition()
        threading.Thread(target=self._serve, daemon=True, name="agent-proxy-trap").start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(5)
                try:
                    line = conn.recv(4096).split(b"\r\n", 1)[0].decode(errors="replace")
                except OSError:
                    line = "(sent nothing)"
            with self._settled:
                self.seen.append(line)
                self._settled.notify_all()

    def settle(self) -> list[str]:
        """Everything asked so far: a marker connection goes through the accept queue (first
        in, first out) behind any connection an agent made before it exited."""
        marker = f"SETTLE {len(self.seen)} {threading.get_ident()}"
        with socket.create_connection(self._sock.getsockname()) as c:
            c.sendall(marker.encode() + b"\r\n")
        with self._settled:
            assert self._settled.wait_for(lambda: marker in self.seen, timeout=30)
            self.seen.remove(marker)
            return list(self.seen)

    def close(self) -> None:
        self._sock.close()


@pytest.fixture(scope="module")
def trap() -> Iterator[Trap]:
    t = Trap()
    yield t
    t.close()


@dataclass
class Scratch:
    home: Path
    work: Path
    trap: Trap


@pytest.fixture
def scratch(tmp_path: Path, trap: Trap) -> Scratch:
    s = Scratch(tmp_path / "home", tmp_path / "work", trap)
    s.home.mkdir()
    s.work.mkdir()
    return s


def agent(name: str) -> Path:
    path = AIDER if name == "aider" else NODE_BIN / name
    assert path.exists(), f"{name} is not installed at {path}: {SETUP_HINT}"
    return path


def base_env(s: Scratch, *, trapped: bool = True, **extra: str) -> dict[str, str]:
    """A clean environment: the caller's PATH (node, bash), the scratch HOME, nothing else of
    the caller's (no API keys, no proxies); `trapped`: the proxy is the trap, corral's loopback
    address excepted."""
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(s.home),
        "LANG": "C.UTF-8",
        "TERM": "dumb",
        "NO_COLOR": "1",
        "TMPDIR": os.environ.get("TMPDIR", "/tmp"),
    }
    if trapped:
        env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,localhost"
        for var in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
            env[var] = env[var.lower()] = s.trap.url
    env.update(extra)
    return env


def run(
    corral: CorralServer, s: Scratch, argv: Sequence[str | Path], env: Mapping[str, str]
) -> subprocess.CompletedProcess[str]:
    """Run an agent to its end in the scratch working directory: it must succeed and must not
    have asked for anything outside this machine; a failure shows its output and corral's log."""
    before = len(s.trap.settle())
    try:
        proc = subprocess.run(
            [str(a) for a in argv],
            cwd=s.work,
            env=dict(env),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT,
        )
    except subprocess.TimeoutExpired as e:
        raise AssertionError(
            f"{argv[0]} did not finish\nstdout:\n{e.stdout!r}\nstderr:\n{e.stderr!r}\n"
            f"corral log:\n{corral.log()[-3000:]}"
        ) from None
    assert proc.returncode == 0, describe(proc, corral)
    outside = s.trap.settle()[before:]
    assert not outside, f"{argv[0]} reached for other hosts: {outside}\n{describe(proc, corral)}"
    return proc


def describe(proc: subprocess.CompletedProcess[str], corral: CorralServer) -> str:
    return (
        f"{proc.args[0]} exited {proc.returncode}\nstdout:\n{proc.stdout[-4000:]}\n"
        f"stderr:\n{proc.stderr[-4000:]}\ncorral log:\n{corral.log()[-3000:]}"
    )


def json_lines(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def proof(work: Path) -> str:
    path = work / "proof.txt"
    assert path.exists(), f"the tool did not run: no proof.txt in {sorted(work.iterdir())}"
    return path.read_text().strip()


# ---- Claude Code (Anthropic Messages) ------------------------------------------------------


def claude(
    corral: CorralServer, s: Scratch, model: str, *args: str
) -> subprocess.CompletedProcess[str]:
    env = base_env(
        s,
        ANTHROPIC_BASE_URL=corral.url,
        ANTHROPIC_API_KEY="corral-test",
        DISABLE_TELEMETRY="1",
        DISABLE_ERROR_REPORTING="1",
        DISABLE_AUTOUPDATER="1",
        CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
    )
    # Root may not pass --dangerously-skip-permissions: the one tool is allowed by name.
    return run(corral, s, [agent("claude"), "-p", *args, "--model", model], env)


def test_claude_code_plain(corral: CorralServer, scratch: Scratch) -> None:
    out = claude(corral, scratch, "claude-plain", PROMPT)
    assert out.stdout.strip() == MODELS["claude-plain"].script.reply, describe(out, corral)


def test_claude_code_plain_stream_json(corral: CorralServer, scratch: Scratch) -> None:
    out = claude(
        corral, scratch, "claude-plain", PROMPT, "--output-format", "stream-json", "--verbose"
    )
    events = json_lines(out.stdout)
    result = events[-1]
    assert result["type"] == "result" and not result["is_error"], describe(out, corral)
    assert result["result"] == MODELS["claude-plain"].script.reply
    assert not [e for e in events if e["type"] == "user"], "no tool should have run"


def test_claude_code_bash(corral: CorralServer, scratch: Scratch) -> None:
    prompt = f"Run `{CLAUDE_CMD}` with Bash."
    out = claude(corral, scratch, "claude-bash", prompt, "--allowedTools", "Bash")
    assert proof(scratch.work) == CLAUDE_MARK
    assert out.stdout.strip() == MODELS["claude-bash"].script.answer, describe(out, corral)


def test_claude_code_bash_stream_json(corral: CorralServer, scratch: Scratch) -> None:
    prompt = f"Run `{CLAUDE_CMD}` with Bash."
    out = claude(
        corral, scratch, "claude-bash", prompt, "--allowedTools", "Bash",
        "--output-format", "stream-json", "--verbose",
    )  # fmt: skip
    assert proof(scratch.work) == CLAUDE_MARK
    events = json_lines(out.stdout)
    blocks = [
        b for e in events if e["type"] in ("assistant", "user") for b in e["message"]["content"]
    ]
    uses = [b for b in blocks if b["type"] == "tool_use"]
    assert [(u["name"], u["input"]) for u in uses] == [("Bash", {"command": CLAUDE_CMD})], describe(
        out, corral
    )
    results = [b for b in blocks if b["type"] == "tool_result"]
    assert len(results) == 1 and results[0]["tool_use_id"] == uses[0]["id"]
    assert not results[0]["is_error"] and CLAUDE_MARK in str(results[0]["content"])
    texts = [b["text"] for b in blocks if b["type"] == "text"]
    assert texts == [MODELS["claude-bash"].script.answer]
    assert events[-1]["type"] == "result" and events[-1]["result"] == texts[0]


# ---- Codex (Ollama API + Responses) -----------------------------------------------------------


def codex(
    corral: CorralServer, s: Scratch, model: str, prompt: str, *args: str, oss: bool
) -> subprocess.CompletedProcess[str]:
    codex_home = s.home / ".codex"
    codex_home.mkdir()
    config = [
        "check_for_update_on_startup = false",
        # --oss: the built-in Ollama provider, at CODEX_OSS_BASE_URL
        *([] if oss else ['model_provider = "corral"']),
        "[analytics]",
        "enabled = false",
        "[feedback]",
        "enabled = false",
        # the plugin marketplace: a clone of github.com/openai/plugins, api.github.com, chatgpt.com
        "[features]",
        "plugins = false",
    ]
    if not oss:
        config += [
            "[model_providers.corral]",
            'name = "corral"',
            f'base_url = "{corral.url}/v1"',
            'wire_api = "responses"',
        ]
    (codex_home / "config.toml").write_text("\n".join(config) + "\n")
    env = base_env(s, CODEX_HOME=str(codex_home), CODEX_OSS_BASE_URL=f"{corral.url}/v1")
    argv: list[str | Path] = [agent("codex"), "exec"]
    if oss:
        argv += ["--oss", "--local-provider", "ollama"]
    # The documented sandbox: commands may write in the working directory only.
    argv += ["-m", model, "--skip-git-repo-check", "--sandbox", "workspace-write", *args, prompt]
    return run(corral, s, argv, env)


@pytest.mark.parametrize("oss", [True, False], ids=["oss", "responses"])
def test_codex_plain(corral: CorralServer, scratch: Scratch, oss: bool) -> None:
    model = "codex-oss-plain" if oss else "codex-plain"
    out = codex(corral, scratch, model, PROMPT, oss=oss)
    # stdout holds the final message alone (the transcript goes to stderr)
    assert out.stdout.strip() == MODELS[model].script.reply, describe(out, corral)


@pytest.mark.parametrize("oss", [True, False], ids=["oss", "responses"])
def test_codex_exec(corral: CorralServer, scratch: Scratch, oss: bool) -> None:
    model, cmd, mark = (
        ("codex-oss-exec", CODEX_OSS_CMD, CODEX_OSS_MARK) if oss
        else ("codex-exec", CODEX_CMD, CODEX_MARK)
    )  # fmt: skip
    out = codex(corral, scratch, model, f"Run `{cmd}`.", "--json", oss=oss)
    assert proof(scratch.work) == mark
    items = [e["item"] for e in json_lines(out.stdout) if e["type"] == "item.completed"]
    commands = [i for i in items if i["type"] == "command_execution"]
    assert len(commands) == 1, describe(out, corral)
    assert cmd in commands[0]["command"] and commands[0]["exit_code"] == 0
    assert commands[0]["aggregated_output"].strip() == mark
    messages = [i["text"] for i in items if i["type"] == "agent_message"]
    assert messages == [MODELS[model].script.answer], describe(out, corral)
    assert json_lines(out.stdout)[-1]["type"] == "turn.completed"


# ---- opencode (OpenAI-compatible provider) ----------------------------------------------------


def opencode(
    corral: CorralServer, s: Scratch, model: str, prompt: str, *args: str
) -> subprocess.CompletedProcess[str]:
    config = {
        "$schema": "https://opencode.ai/config.json",
        "autoupdate": False,
        "share": "disabled",
        "model": f"corral/{model}",
        "small_model": f"corral/{model}",
        "provider": {
            "corral": {
                "npm": "@ai-sdk/openai-compatible",
                "name": "corral",
                "options": {"baseURL": f"{corral.url}/v1", "apiKey": "corral-test"},
                "models": {model: {"name": model}},
            }
        },
        "permission": {"bash": "allow", "edit": "allow"},
    }
    env = base_env(
        s,
        OPENCODE_CONFIG_CONTENT=json.dumps(config),
        OPENCODE_DISABLE_AUTOUPDATE="1",
        OPENCODE_DISABLE_MODELS_FETCH="1",
        OPENCODE_DISABLE_SHARE="1",
        OPENCODE_DISABLE_LSP_DOWNLOAD="1",
        OPENCODE_DISABLE_DEFAULT_PLUGINS="1",
        OPENCODE_DISABLE_CLAUDE_CODE="1",
        # it installs @opencode-ai/plugin into its config directory from the npm registry
        npm_config_offline="true",
    )
    return run(corral, s, [agent("opencode"), "run", *args, prompt], env)


def test_opencode_plain(corral: CorralServer, scratch: Scratch) -> None:
    out = opencode(corral, scratch, "opencode-plain", PROMPT)
    text = re.sub(r"\x1b\[[0-9;]*m", "", out.stdout).strip()
    assert text == MODELS["opencode-plain"].script.reply, describe(out, corral)


def test_opencode_bash(corral: CorralServer, scratch: Scratch) -> None:
    out = opencode(corral, scratch, "opencode-bash", f"Run `{OPENCODE_CMD}`.", "--format", "json")
    assert proof(scratch.work) == OPENCODE_MARK
    parts = [e["part"] for e in json_lines(out.stdout) if "part" in e]
    tools = [p for p in parts if p["type"] == "tool"]
    assert [(t["tool"], t["state"]["input"]) for t in tools] == [
        ("bash", {"command": OPENCODE_CMD})
    ], describe(out, corral)
    assert tools[0]["state"]["status"] == "completed"
    assert tools[0]["state"]["output"].strip() == OPENCODE_MARK
    texts = [p["text"] for p in parts if p["type"] == "text"]
    assert texts == [MODELS["opencode-bash"].script.answer], describe(out, corral)


# ---- qwen-code (OpenAI Chat Completions) ----------------------------------------------------


def qwen(
    corral: CorralServer, s: Scratch, model: str, prompt: str, *args: str
) -> subprocess.CompletedProcess[str]:
    settings = {
        "security": {"auth": {"selectedType": "openai"}},
        "privacy": {"usageStatisticsEnabled": False},
        "telemetry": {"enabled": False},
        "general": {"disableAutoUpdate": True, "disableUpdateNag": True},
    }
    (s.home / ".qwen").mkdir()
    (s.home / ".qwen" / "settings.json").write_text(json.dumps(settings))
    env = base_env(
        s,
        # qwen-code sends every request through HTTPS_PROXY, NO_PROXY or not (corral's too);
        # without a proxy it was seen (strace) to connect to nothing but corral
        trapped=False,
        OPENAI_BASE_URL=f"{corral.url}/v1",
        OPENAI_API_KEY="corral-test",
        OPENAI_MODEL=model,
    )
    return run(corral, s, [agent("qwen"), "-p", prompt, *args], env)


def test_qwen_code_plain(corral: CorralServer, scratch: Scratch) -> None:
    out = qwen(corral, scratch, "qwen-plain", PROMPT)
    assert out.stdout.strip() == MODELS["qwen-plain"].script.reply, describe(out, corral)


def test_qwen_code_shell(corral: CorralServer, scratch: Scratch) -> None:
    # Headless, qwen-code offers its shell tool only in yolo mode (--allowed-tools does not
    # bring it back); yolo is its documented mode for scripts and CI, and works as root.
    out = qwen(
        corral, scratch, "qwen-shell", f"Run `{QWEN_CMD}`.",
        "--approval-mode", "yolo", "--output-format", "stream-json",
    )  # fmt: skip
    assert proof(scratch.work) == QWEN_MARK
    events = json_lines(out.stdout)
    blocks = [
        b for e in events if e["type"] in ("assistant", "user") for b in e["message"]["content"]
    ]
    uses = [b for b in blocks if b["type"] == "tool_use"]
    assert [(u["name"], u["input"]) for u in uses] == [
        ("run_shell_command", {"command": QWEN_CMD})
    ], describe(out, corral)
    results = [b for b in blocks if b["type"] == "tool_result"]
    assert len(results) == 1 and not results[0]["is_error"], describe(out, corral)
    assert QWEN_MARK in str(results[0]["content"])
    assert events[-1]["type"] == "result" and not events[-1]["is_error"]
    assert events[-1]["result"] == MODELS["qwen-shell"].script.answer, describe(out, corral)


# ---- aider (Ollama /api/chat through litellm) -------------------------------------------------


def aider(
    corral: CorralServer, s: Scratch, model: str, prompt: str, *files: str
) -> subprocess.CompletedProcess[str]:
    # Known model metadata: aider would otherwise fetch litellm's price list from GitHub.
    metadata = s.home / "model-metadata.json"
    info = {
        "max_input_tokens": CONTEXT,
        "max_tokens": CONTEXT,
        "max_output_tokens": 4096,
        "input_cost_per_token": 0,
        "output_cost_per_token": 0,
        "litellm_provider": "ollama_chat",
        "mode": "chat",
    }
    metadata.write_text(json.dumps({f"ollama_chat/{model}": info}))
    env = base_env(s, OLLAMA_API_BASE=corral.url, LITELLM_LOCAL_MODEL_COST_MAP="True")
    argv: list[str | Path] = [
        agent("aider"),
        "--model", f"ollama_chat/{model}",
        "--model-metadata-file", metadata,
        "--edit-format", "diff",
        "--message", prompt,
        "--yes-always",
        "--no-git",
        "--no-auto-commits",
        "--no-check-update",
        "--analytics-disable",
        "--no-show-model-warnings",
        "--no-show-release-notes",
        "--no-detect-urls",
        "--no-pretty",
        "--no-fancy-input",
        "--map-tokens", "0",
        *files,
    ]  # fmt: skip
    return run(corral, s, argv, env)


def test_aider_plain(corral: CorralServer, scratch: Scratch) -> None:
    out = aider(corral, scratch, "aider-plain", PROMPT)
    lines = [line.strip() for line in out.stdout.splitlines()]
    assert MODELS["aider-plain"].script.reply in lines, describe(out, corral)


def test_aider_edit(corral: CorralServer, scratch: Scratch) -> None:
    (scratch.work / "hello.py").write_text('print("original")\n')
    out = aider(corral, scratch, "aider-edit", "Change the greeting in hello.py.", "hello.py")
    assert (scratch.work / "hello.py").read_text() == 'print("edited through corral")\n', describe(
        out, corral
    )
    assert "Applied edit to hello.py" in out.stdout, describe(out, corral)
