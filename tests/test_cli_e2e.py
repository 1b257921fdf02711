"""The `corral` CLI as a user runs it, against a real server: a subprocess per command."""

from __future__ import annotations

import contextlib
import fcntl
import os
import pty
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import httpx
import pytest

from corral.cli import repl
from corral.runtime.runner import free_port
from corral.testing.server import CorralServer


def corral(
    server: CorralServer, *args: str, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "CORRAL_HOST": server.host}
    return subprocess.run(
        [sys.executable, "-m", "corral", *args],
        env=env,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_run_list_ps_show_stop(server: CorralServer) -> None:
    r = corral(server, "run", "smollm2:135m", "Say", "hi.", "--verbose")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()  # the streamed answer
    assert "eval count" in r.stderr and "eval rate" in r.stderr
    assert corral(server, "run", "tiny2").returncode == 0  # load only: no prompt, no TTY

    r = corral(server, "list")
    assert r.returncode == 0 and "smollm2:135m" in r.stdout and "tiny2:latest" in r.stdout
    assert "98 MB" in r.stdout  # the built-in model's size, ollama-style

    r = corral(server, "ps")
    assert r.returncode == 0
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("tiny2:latest"))
    assert "100% CPU" in line and "from now" in line

    r = corral(server, "show", "smollm2:135m")
    assert r.returncode == 0
    for word in ("llama", "134.52M", "Q4_1", "completion"):
        assert word in r.stdout

    r = corral(server, "stop", "tiny2")
    assert r.returncode == 0
    server.wait_for(
        lambda: "tiny2:latest" not in {m["model"] for m in server.ps()}, what="tiny2 to stop"
    )


def test_run_reads_prompt_from_stdin(server: CorralServer) -> None:
    r = corral(server, "run", "smollm2:135m", stdin="Say something.\n")
    assert r.returncode == 0, r.stderr and r.stdout.strip()


@pytest.mark.parametrize("args", [("run", "nope", "hi"), ("show", "nope"), ("stop", "nope")])
def test_unknown_model_is_a_clean_error(server: CorralServer, args: tuple[str, ...]) -> None:
    r = corral(server, *args)
    assert r.returncode == 1
    assert "Error: model 'nope' not found" in r.stderr
    assert "Traceback" not in r.stderr


def test_unreachable_server(tmp_path) -> None:
    env = {**os.environ, "CORRAL_HOST": "127.0.0.1:9"}
    r = subprocess.run(
        [sys.executable, "-m", "corral", "ps"], env=env, capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 1 and "could not connect" in r.stderr


# ---- Ollama's CLI habits -----------------------------------------------------------------------
def test_did_you_mean(server: CorralServer) -> None:
    r = corral(server, "lst")
    assert r.returncode == 1
    assert r.stderr.startswith('Error: unknown command "lst" for "corral"\n\nDid you mean this?\n')
    assert "\tlist\n" in r.stderr
    r = corral(server, "run", "smollm2", "hi")  # not a name corral pulls: just not there
    assert r.returncode == 1
    assert r.stderr == ("Error: model 'smollm2' not found\n\nDid you mean this?\n\tsmollm2:135m\n")


def test_show_modelfile_creates_the_same_model(server: CorralServer, tmp_path: Path) -> None:
    """`corral show --modelfile X > f; corral create Y -f f` makes a model like X."""
    (tmp_path / "Modelfile").write_text(
        'FROM tiny\nSYSTEM """You are a pirate.\nSpeak like one."""\nPARAMETER temperature 0.25\n'
        'PARAMETER stop "Arr"\nPARAMETER stop "<end>"\nPARAMETER num_ctx 512\n'
        'MESSAGE user """Who are you?"""\nMESSAGE assistant Captain.\nLICENSE "MIT"\n'
    )
    try:
        r = corral(server, "create", "h4-roundtrip-a", "-f", str(tmp_path / "Modelfile"))
        assert r.returncode == 0, r.stderr
        r = corral(server, "show", "--modelfile", "h4-roundtrip-a")
        assert r.returncode == 0, r.stderr
        assert "\nFROM h4-roundtrip-a:latest\n" in r.stdout
        (tmp_path / "shown").write_text(r.stdout)
        r = corral(server, "create", "h4-roundtrip-b", "-f", str(tmp_path / "shown"))
        assert r.returncode == 0, r.stderr
        a, b = (server.client.post("/api/show", json={"model": f"h4-roundtrip-{x}"}).json()
                for x in "ab")  # fmt: skip
        for key in ("system", "parameters", "template", "messages", "license", "details"):
            assert a.get(key) == b.get(key), key
        assert a["system"] == "You are a pirate.\nSpeak like one."
        assert a["messages"][1] == {"role": "assistant", "content": "Captain."}
        # and one more round: the copy's Modelfile makes the same again
        r = corral(server, "show", "--modelfile", "h4-roundtrip-b")
        assert r.stdout.replace("roundtrip-b", "roundtrip-a") == (tmp_path / "shown").read_text()
    finally:
        corral(server, "rm", "h4-roundtrip-a", "h4-roundtrip-b")


def test_host_as_a_port_alone_and_ollama_host(tmp_path: Path) -> None:
    """A server told where to listen by OLLAMA_HOST alone (CORRAL_HOST unset), as a port alone;
    clients find it by CORRAL_HOST as a port alone, or by OLLAMA_HOST, CORRAL_HOST first."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("CORRAL_HOST", "OLLAMA_HOST")}
    log = tmp_path / "corral.log"
    serve_env = {**env, "OLLAMA_HOST": str(port), "CORRAL_MODELS": str(tmp_path),
                 "CORRAL_BUILTIN_MODELS": "0",
                 "CORRAL_KV_CACHE_DIR": str(tmp_path / "kv")}  # fmt: skip
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "corral", "serve"], env=serve_env,
                                stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
    s = CorralServer(f"http://127.0.0.1:{port}", proc, log)
    try:
        s.wait_for(lambda: _answers(s), timeout=60, what="the server to listen")

        def version(**host: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [sys.executable, "-m", "corral", "version"], env={**env, **host},
                capture_output=True, text=True, timeout=60,
            )  # fmt: skip

        for host in ({"CORRAL_HOST": str(port)}, {"OLLAMA_HOST": f"http://127.0.0.1:{port}"},
                     {"OLLAMA_HOST": str(port)},
                     {"CORRAL_HOST": str(port), "OLLAMA_HOST": "127.0.0.1:9"}):  # fmt: skip
            r = version(**host)
            assert "corral server version" in r.stdout, (host, r.stderr)
        r = version(OLLAMA_HOST="127.0.0.1:9")  # nothing there
        assert "could not connect to corral server at http://127.0.0.1:9" in r.stderr
    finally:
        s.stop_and_check()


def _answers(s: CorralServer) -> bool:
    try:
        return s.client.get("/api/version").status_code == 200
    except httpx.TransportError:
        return False


class Terminal:
    """A `corral` command on a pseudo-terminal: what it writes, read as it comes; lines typed."""

    def __init__(self, server: CorralServer, *args: str) -> None:
        self.fd, child = pty.openpty()
        fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
        env = {**os.environ, "CORRAL_HOST": server.host, "TERM": "xterm"}
        self.proc = subprocess.Popen([sys.executable, "-m", "corral", *args], env=env,
                                     stdin=child, stdout=child, stderr=child)  # fmt: skip
        os.close(child)
        self.seen = b""

    def expect(self, text: str, timeout: float = 120) -> str:
        """What was written up to and including `text` (AssertionError if the command ends, or
        `timeout` passes, first: a bound on a hang, not a measure)."""
        want = text.encode()
        deadline = time.monotonic() + timeout
        while want not in self.seen:
            left = deadline - time.monotonic()
            ready = select.select([self.fd], [], [], max(left, 0))[0] if left > 0 else []
            chunk = b""
            with contextlib.suppress(OSError):  # EIO: the command has ended
                chunk = os.read(self.fd, 65536) if ready else b""
            assert chunk, f"no {text!r} in {self.seen[-2000:].decode(errors='replace')!r}"
            self.seen += chunk
        cut = self.seen.index(want) + len(want)
        out, self.seen = self.seen[:cut], self.seen[cut:]
        return out.decode(errors="replace")

    def type(self, line: str) -> str:
        """Type a line; what the session wrote before it asked for the next one."""
        os.write(self.fd, line.encode() + b"\r")
        return self.expect(repl.HINT)

    def close(self) -> int:
        with contextlib.suppress(subprocess.TimeoutExpired):
            return self.proc.wait(30)
        self.proc.kill()
        return self.proc.wait()


def test_interactive_set_and_show_in_a_terminal(server: CorralServer) -> None:
    """Ollama's REPL habits in a real terminal against the built-in SmolLM2: the prompt's
    hint, /set and /show, a message answered with the session's settings, /save, /load."""
    term = Terminal(server, "run", "smollm2:135m")
    try:
        assert ">>> " in term.expect(repl.HINT)  # Send a message (/? for help)
        out = term.type("/set parameter num_predict 12")
        assert "Set parameter 'num_predict' to '12'" in out
        assert "Set parameter 'temperature' to '0'" in term.type("/set parameter temperature 0")
        assert "Couldn't set parameter" in term.type("/set parameter top_k many")
        assert "Set system message." in term.type("/set system You answer in one word.")
        assert "Set 'verbose' mode." in term.type("/set verbose")
        out = term.type("/show system")
        assert "You answer in one word.\r\n" in out
        out = term.type("/show parameters")
        assert "Model defined parameters:" in out and "User defined parameters:" in out
        assert f"{'num_predict':<30} 12" in out and f"{'temperature':<30} 0" in out
        out = term.type("/show info")
        assert "architecture        llama" in out and "Q4_1" in out
        out = term.type("/show template")  # the model's own chat template
        assert "{%" in out and "<|im_start|>" in out
        out = term.type("/show modelfile")
        assert "FROM smollm2:135m" in out and 'SYSTEM """You answer in one word."""' in out
        assert "PARAMETER num_predict 12" in out
        out = term.type("Hello")  # an answer, then the stats /set verbose asked for
        assert "eval count:" in out and "eval rate:" in out
        assert "Set format to 'json' mode." in term.type("/set format json")
        assert "Disabled format." in term.type("/unset format")
        assert "Set 'quiet' mode." in term.type("/set quiet")
        assert "Created new model 'h4-repl-saved'" in term.type("/save h4-repl-saved")
        out = term.type("/load tiny")
        assert "Loading model 'tiny'" in out and "Couldn't find" not in out
        assert "Couldn't find model 'nope'" in term.type("/load nope")
        assert "Cleared session context" in term.type("/clear")
        assert "Available Commands:" in term.type("/?")
        os.write(term.fd, b"/bye\r")
        assert term.close() == 0
        saved = server.client.post("/api/show", json={"model": "h4-repl-saved"}).json()
        assert saved["system"] == "You answer in one word."
        assert "num_predict" in saved["parameters"] and "temperature" in saved["parameters"]
        assert [m["role"] for m in saved["messages"]] == ["user", "assistant"]
        assert saved["messages"][0]["content"] == "Hello"
    finally:
        term.close()
        server.client.request("DELETE", "/api/delete", json={"model": "h4-repl-saved"})
