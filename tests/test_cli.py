"""Tests for the `corral` CLI: pure formatting helpers, and commands run in-process against a
small HTTP server that answers with canned Ollama-shaped JSON and NDJSON."""

from __future__ import annotations

import argparse
import io
import json
import sys
import threading
import types
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from corral import __version__, cli
from corral.cli import chat, client, display, models, repl, serve, suggest
from corral.config import DEFAULTS, ConfigError
from corral.runtime.runner import free_port

NOW = datetime(2025, 1, 1, 12, 0, 0, tzinfo=timezone.utc)


# ---------------------------------------------------------------------------------------------
# Pure helpers


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0 B"),
        (999, "999 B"),
        (1000, "1 KB"),
        (1_500_000, "1.5 MB"),
        (98_000_000, "98 MB"),
        (98_765_432, "98 MB"),
        (1_234_567_890, "1.2 GB"),
        (2_000_000_000, "2 GB"),
        (12_345_678_901, "12 GB"),
        (3 * 10**12, "3 TB"),
    ],
)
def test_human_bytes(n: int, text: str) -> None:
    assert display.human_bytes(n) == text


@pytest.mark.parametrize(
    ("n", "text"),
    [(135_000_000, "135M"), (1_235_814_432, "1.2B"), (8_000_000_000, "8B"), (1500, "2K"), (7, "7")],
)
def test_human_number(n: int, text: str) -> None:
    assert display.human_number(n) == text


@pytest.mark.parametrize(
    ("offset", "text"),
    [
        (timedelta(minutes=4, seconds=30), "4 minutes from now"),
        (timedelta(seconds=-0.5), "Less than a second ago"),
        (timedelta(seconds=-1), "1 second ago"),
        (timedelta(seconds=-45), "45 seconds ago"),
        (timedelta(seconds=-61), "About a minute ago"),
        (timedelta(minutes=-59), "59 minutes ago"),
        (timedelta(minutes=-61), "About an hour ago"),
        (timedelta(hours=-2), "2 hours ago"),
        (timedelta(days=-3), "3 days ago"),
        (timedelta(days=-21), "3 weeks ago"),
        (timedelta(days=-90), "3 months ago"),
        (timedelta(days=-3 * 365 - 5), "3 years ago"),
        (timedelta(days=300 * 365), "Forever"),
    ],
)
def test_human_time(offset: timedelta, text: str) -> None:
    assert display.human_time(NOW + offset, NOW) == text


def test_human_time_zero_value() -> None:
    assert display.human_time(None, NOW) == "Never"


def test_until_text() -> None:
    assert display.until_text(NOW + timedelta(minutes=4, seconds=59), NOW) == "4 minutes from now"
    assert display.until_text(NOW - timedelta(seconds=1), NOW) == "Stopping..."
    assert display.until_text(None, NOW) == "Forever"
    forever = display.parse_time("2318-04-11T23:47:16.854775807Z")
    assert display.until_text(forever, NOW) == "Forever"


def test_parse_time() -> None:
    t = display.parse_time("2024-06-04T14:38:31.837530123-07:00")
    assert t == datetime(2024, 6, 4, 21, 38, 31, 837530, tzinfo=timezone.utc)
    assert display.parse_time("2025-01-01T12:00:00Z") == NOW
    assert display.parse_time("2025-01-01T12:00:00+0000") == NOW
    assert display.parse_time("0001-01-01T00:00:00Z") is None  # Go's zero time
    assert display.parse_time(None) is None
    assert display.parse_time("yesterday") is None
    far = display.parse_time("12025-01-01T00:00:00Z")
    assert far is not None and far.year == 9999


@pytest.mark.parametrize(
    ("size", "vram", "text"),
    [
        (1000, 0, "100% CPU"),
        (1000, 1000, "100% GPU"),
        (1000, 520, "48%/52% CPU/GPU"),
        (1000, 995, "1%/99% CPU/GPU"),
        (1000, 2000, "Unknown"),
        (0, 0, "100% CPU"),
    ],
)
def test_processor(size: int, vram: int, text: str) -> None:
    assert display.processor(size, vram) == text


@pytest.mark.parametrize(
    ("ns", "text"),
    [
        (0, "0s"),
        (500, "500ns"),
        (1_500, "1.5µs"),
        (12_345_000, "12.345ms"),
        (1_500_000_000, "1.5s"),
        (90 * 10**9, "1m30s"),
        (3600 * 10**9, "1h0m0s"),
        (2_034_567_891, "2.034567891s"),
    ],
)
def test_go_duration(ns: int, text: str) -> None:
    assert display.go_duration(ns) == text


def test_format_stats() -> None:
    final = {
        "total_duration": 2_500_000_000,
        "load_duration": 1_000_000,
        "prompt_eval_count": 10,
        "prompt_eval_duration": 100_000_000,
        "eval_count": 50,
        "eval_duration": 2_000_000_000,
    }
    assert chat.format_stats(final) == [
        "total duration:       2.5s",
        "load duration:        1ms",
        "prompt eval count:    10 token(s)",
        "prompt eval duration: 100ms",
        "prompt eval rate:     100.00 tokens/s",
        "eval count:           50 token(s)",
        "eval duration:        2s",
        "eval rate:            25.00 tokens/s",
    ]
    assert chat.format_stats({}) == []


@pytest.mark.parametrize(
    ("host", "url"),
    [
        ("", "http://127.0.0.1:11434"),
        ("127.0.0.1:11434", "http://127.0.0.1:11434"),
        (":8080", "http://127.0.0.1:8080"),
        ("example.com", "http://example.com:11434"),
        ("example.com:9000", "http://example.com:9000"),
        ("0.0.0.0:11434", "http://127.0.0.1:11434"),
        ("http://10.0.0.5:1234", "http://10.0.0.5:1234"),
        ("http://10.0.0.5", "http://10.0.0.5:80"),
        ("https://models.example.com", "https://models.example.com:443"),
        ("https://models.example.com/corral/", "https://models.example.com:443/corral"),
        ("[::1]:9000", "http://[::1]:9000"),
        ("::1", "http://[::1]:11434"),
        ("  localhost:1  ", "http://localhost:1"),
        ("21997", "http://127.0.0.1:21997"),  # a port alone
        ("ftp://example.com", "ftp://example.com:11434"),  # Ollama's default port for others
    ],
)
def test_base_url(host: str, url: str) -> None:
    assert client.base_url(host) == url


@pytest.mark.parametrize("host", ["host:port", "host:0", "host:70000", "[::1]x"])
def test_base_url_rejects_bad_ports(host: str) -> None:
    with pytest.raises(ValueError):
        client.base_url(host)


def test_keep_alive_value() -> None:
    assert chat.keep_alive_value("-1") == -1
    assert chat.keep_alive_value("0") == 0
    assert chat.keep_alive_value("2.5") == 2.5
    assert chat.keep_alive_value("10m") == "10m"


def test_error_message() -> None:
    body = '{"error": "model not found"}'
    assert client.error_message(404, "Not Found", body) == "model not found"
    assert client.error_message(502, "Bad Gateway", "upstream died\n") == "upstream died"
    assert client.error_message(500, "Internal Server Error", "") == "500 Internal Server Error"


def test_rows() -> None:
    ps = models.ps_rows(
        [
            {
                "name": "a:latest",
                "digest": "sha256:0123456789abcdef",
                "size": 98_000_000,
                "size_vram": 0,
                "context_length": 4096,
                "expires_at": "2025-01-01T12:04:30Z",
            }
        ],
        NOW,
    )
    assert ps == [["a:latest", "0123456789ab", "98 MB", "100% CPU", "4096", "4 minutes from now"]]
    tags = models.list_rows(
        [
            {
                "name": "b:1b",
                "digest": "fedcba9876543210ff",
                "size": 1_300_000_000,
                "modified_at": "2025-01-01T10:00:00Z",
            }
        ],
        NOW,
    )
    assert tags == [["b:1b", "fedcba987654", "1.3 GB", "2 hours ago"]]


def test_token_printer_wraps_words() -> None:
    out = io.StringIO()
    printer = chat.TokenPrinter(out, width=10)
    for token in ["hel", "lo wo", "rld an", "d more"]:
        printer.write(token)
    # "world" would overflow: the partial "wor" is erased and rewritten on the next line
    assert out.getvalue() == "hello wor\x1b[3D\x1b[K\nworld and\nmore"
    plain = io.StringIO()
    chat.TokenPrinter(plain).write("hello world and more")
    assert plain.getvalue() == "hello world and more"


def test_read_message_multiline() -> None:
    def read(*lines: str) -> str:
        it = iter(lines)
        return repl.unquote(repl.read_message(lambda prompt: next(it)))

    assert read('"""first', "second", 'third"""') == "first\nsecond\nthird"
    assert read('"""one line"""') == "one line"
    assert read("plain") == "plain"
    # /set system takes triple quotes too; the command gets them to strip
    it = iter(['/set system """You are', 'a pirate."""'])
    entry = repl.read_message(lambda prompt: next(it))
    assert entry == '/set system """You are\na pirate."""'
    assert repl.read_message(lambda prompt: '/set system """brief"""') == '/set system """brief"""'


def test_format_show() -> None:
    text = models.format_show(SHOW)
    assert text.splitlines() == [
        "  Model",
        "    architecture        llama",
        "    parameters          1.2B",
        "    context length      131072",
        "    embedding length    2048",
        "    quantization        Q8_0",
        "",
        "  Capabilities",
        "    completion",
        "    tools",
        "",
        "  Parameters",
        '    stop           "<|eot_id|>"',
        "    temperature    0.6",
        "",
        "  License",
        "    LLAMA 3.2 COMMUNITY LICENSE AGREEMENT",
        "    Llama 3.2 Version Release Date: September 25, 2024",
        "    ...",
    ]


# ---------------------------------------------------------------------------------------------
# serve: flags become environment-variable overrides


@pytest.fixture
def fake_serve(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, str]]:
    calls: list[dict[str, str]] = []
    module = types.ModuleType("corral.server")
    module.serve = lambda overrides: calls.append(dict(overrides))  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "corral.server", module)
    return calls


def test_serve_passes_only_given_flags(fake_serve: list[dict[str, str]]) -> None:
    assert cli.main(["serve", "--host", ":1234", "--models", "/srv/models"]) == 0
    assert fake_serve == [{"CORRAL_HOST": ":1234", "CORRAL_MODELS": "/srv/models"}]
    assert cli.main(["serve"]) == 0
    assert fake_serve[-1] == {}


def test_serve_maps_every_flag(fake_serve: list[dict[str, str]]) -> None:
    # --ray switches to cluster mode (its own entry process): tested in test_cluster.py
    assert serve.SERVE_FLAGS["--ray"][0] == "CORRAL_RAY_ADDRESS"
    single = {f: v for f, v in serve.SERVE_FLAGS.items() if f != "--ray"}
    argv = ["serve"]
    for i, flag in enumerate(single):
        argv += [flag, f"v{i}"]
    assert cli.main(argv) == 0
    assert fake_serve[0] == {env: f"v{i}" for i, (env, _, _) in enumerate(single.values())}
    assert set(fake_serve[0]) == {
        "CORRAL_HOST",
        "CORRAL_MODELS",
        "CORRAL_KEEP_ALIVE",
        "CORRAL_CONTEXT_LENGTH",
        "CORRAL_NUM_PARALLEL",
        "CORRAL_LOAD_TIMEOUT",
        "CORRAL_MAX_LOADED_MODELS",
        "CORRAL_MAX_QUEUE",
        "CORRAL_RUNNER_STALL_TIMEOUT",
        "CORRAL_MEMORY_MARGIN",
        "CORRAL_MEMORY_LIMIT",
        "CORRAL_LLAMA_SERVER",
        "CORRAL_LOG_LEVEL",
        "CORRAL_ORIGINS",
        "CORRAL_SHUTDOWN_GRACE",
        "CORRAL_READ_TIMEOUT",
        "CORRAL_IDLE_TIMEOUT",
        "CORRAL_MAX_CONNECTIONS",
    }
    assert set(fake_serve[0]) <= set(DEFAULTS)  # every flag is a setting


def test_serve_overrides_from_namespace() -> None:
    ns = argparse.Namespace(CORRAL_KEEP_ALIVE="10m", CORRAL_MAX_QUEUE=None)
    assert serve.serve_overrides(ns) == {"CORRAL_KEEP_ALIVE": "10m"}


def test_serve_config_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def serve(overrides: dict[str, str]) -> None:
        raise ConfigError("CORRAL_NUM_PARALLEL: expected an integer, got 'x'")

    module = types.ModuleType("corral.server")
    module.serve = serve  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "corral.server", module)
    assert cli.main(["serve", "--num-parallel", "x"]) == 1
    assert capsys.readouterr().err == "Error: CORRAL_NUM_PARALLEL: expected an integer, got 'x'\n"


# ---------------------------------------------------------------------------------------------
# Commands against a canned HTTP server

Reply = tuple[int, Any]  # (status, dict -> JSON | list -> NDJSON lines | str -> text)
Route = Callable[[Any], Reply]


class FakeServer:
    def __init__(self) -> None:
        self.routes: dict[tuple[str, str], Route] = {}
        self.requests: list[tuple[str, str, Any]] = []
        self.url = ""


def _handler(fake: FakeServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _serve(self, method: str) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length)) if length else None
            fake.requests.append((method, self.path, body))
            route = fake.routes.get((method, self.path))
            status, payload = route(body) if route else (404, {"error": "no route"})
            if isinstance(payload, list):
                self.send_response(status)
                self.send_header("Content-Type", "application/x-ndjson")
                self.end_headers()
                for item in payload:  # one line at a time, as a streaming server writes
                    self.wfile.write((json.dumps(item) + "\n").encode())
                    self.wfile.flush()
                return
            is_json = isinstance(payload, dict)
            data = (json.dumps(payload) if is_json else str(payload)).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json" if is_json else "text/plain")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            self._serve("GET")

        def do_POST(self) -> None:
            self._serve("POST")

        def log_message(self, format: str, *args: Any) -> None:
            pass

    return Handler


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeServer]:
    fake = FakeServer()
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(fake))
    thread = threading.Thread(target=httpd.serve_forever, args=(0.01,), daemon=True)
    thread.start()
    fake.url = f"http://127.0.0.1:{httpd.server_address[1]}"
    monkeypatch.setenv("CORRAL_HOST", fake.url)
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))  # not a TTY, nothing piped
    try:
        yield fake
    finally:
        httpd.shutdown()
        httpd.server_close()


def _iso(t: datetime) -> str:
    return t.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f") + "123Z"


def _generate_route(chunks: list[dict[str, Any]]) -> Route:
    def route(body: Any) -> Reply:
        if "prompt" not in body and "messages" not in body:  # load-only / unload request
            return 200, [
                {"model": body["model"], "response": "", "done": True, "done_reason": "load"}
            ]
        return 200, chunks

    return route


FINAL = {
    "model": "m",
    "response": "",
    "done": True,
    "done_reason": "stop",
    "total_duration": 2_500_000_000,
    "load_duration": 1_000_000,
    "prompt_eval_count": 10,
    "prompt_eval_duration": 100_000_000,
    "eval_count": 50,
    "eval_duration": 2_000_000_000,
}
TOKENS = [{"model": "m", "response": t, "done": False} for t in ["Hello", ",", " world", "!"]]

SHOW = {
    "license": "LLAMA 3.2 COMMUNITY LICENSE AGREEMENT\nLlama 3.2 Version Release Date: "
    "September 25, 2024\n\nmore terms",
    "modelfile": "FROM /models/llama.gguf\n",
    "parameters": 'stop                           "<|eot_id|>"\ntemperature                    0.6',
    "template": "{{ .Prompt }}",
    "details": {
        "format": "gguf",
        "family": "llama",
        "parameter_size": "1.2B",
        "quantization_level": "Q8_0",
    },
    "model_info": {
        "general.architecture": "llama",
        "general.parameter_count": 1_235_814_432,
        "llama.context_length": 131072,
        "llama.embedding_length": 2048,
    },
    "capabilities": ["completion", "tools"],
}


def test_ps(server: FakeServer, capsys: pytest.CaptureFixture[str]) -> None:
    now = datetime.now(timezone.utc)
    models = [
        {
            "name": "llama3.2:1b",
            "model": "llama3.2:1b",
            "size": 1_300_000_000,
            "digest": "abcdef1234567890abcdef",
            "size_vram": 1_300_000_000,
            "context_length": 4096,
            "expires_at": _iso(now + timedelta(minutes=4, seconds=30)),
        },
        {
            "name": "a-model-with-a-rather-long-name-that-must-not-be-cut:latest",
            "size": 98_000_000,
            "digest": "0011223344556677",
            "size_vram": 0,
            "context_length": 2048,
            "expires_at": _iso(now + timedelta(days=365 * 200)),
        },
    ]
    server.routes["GET", "/api/ps"] = lambda _: (200, {"models": models})
    assert cli.main(["ps"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["NAME", "ID", "SIZE", "PROCESSOR", "CONTEXT", "UNTIL"]
    assert lines[1].split() == [
        "llama3.2:1b",
        "abcdef123456",
        "1.3",
        "GB",
        "100%",
        "GPU",
        "4096",
        "4",
        "minutes",
        "from",
        "now",
    ]
    assert lines[2].split() == [
        "a-model-with-a-rather-long-name-that-must-not-be-cut:latest",
        "001122334455",
        "98",
        "MB",
        "100%",
        "CPU",
        "2048",
        "Forever",
    ]
    assert lines[0].index("ID") == lines[1].index("abcdef123456")  # columns line up


def ps_lines(
    server: FakeServer, capsys: pytest.CaptureFixture[str], rows: list[dict[str, Any]]
) -> list[str]:
    """What `corral ps` prints for a server whose /api/ps lists `rows` (each a loaded model's
    own fields, beside a size, digest, context and expiry in four minutes)."""
    expires = _iso(datetime.now(timezone.utc) + timedelta(minutes=4))
    base = {"size": 98_000_000, "digest": "0011223344556677", "size_vram": 0,
            "context_length": 2048, "expires_at": expires}  # fmt: skip
    server.routes["GET", "/api/ps"] = lambda _: (200, {"models": [{**base, **r} for r in rows]})
    assert cli.main(["ps"]) == 0
    return capsys.readouterr().out.splitlines()


def test_ps_shows_the_tokens_per_second_corral_relays(
    server: FakeServer, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = ps_lines(server, capsys, [
        {"name": "busy:latest", "tokens_per_second": 23.14,
         "slot_tokens_per_second": [12.0, 0.0, 11.14]},
        {"name": "one:latest", "tokens_per_second": 7.0, "slot_tokens_per_second": [7.0, 0.0]},
        {"name": "idle:latest", "tokens_per_second": 0.0, "slot_tokens_per_second": [0.0]},
    ])  # fmt: skip
    assert lines[0].split()[-1] == "TOKENS/S"
    assert lines[1].endswith("23.1 (12.0+11.1)")
    assert lines[2].endswith("7.0") and lines[3].endswith("0.0")
    assert models.rate_text({"name": "from-ollama"}) == "-"  # a server that does not say


def test_ps_shows_the_names_a_shared_runner_serves(
    server: FakeServer, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = ps_lines(server, capsys, [
        {"name": "smollm2:135m", "models": ["smollm2:135m", "captain:latest", "pirate:latest"]},
        {"name": "other:latest", "models": ["other:latest"]},
    ])  # fmt: skip
    assert lines[0].rstrip().endswith("ALSO SERVES")
    assert lines[1].endswith("captain:latest, pirate:latest") and lines[2].endswith("-")


def test_ps_shows_who_waits_only_while_something_does(
    server: FakeServer, capsys: pytest.CaptureFixture[str]
) -> None:
    idle = [{"name": "idle:latest", "queued": 0, "waiting_for_room": 0, "num_parallel": 1}]
    assert "QUEUE" not in ps_lines(server, capsys, idle)[0]  # Ollama's columns otherwise
    busy = [
        {"name": "busy:latest", "requests_in_flight": 4, "num_parallel": 4, "queued": 2,
         "waiting_for_room": 1},
        {"name": "idle:latest", "requests_in_flight": 0, "num_parallel": 1, "queued": 0},
    ]  # fmt: skip
    # corral's books list every waiting request, those for a model not loaded yet included
    server.routes["GET", "/api/corral/books"] = lambda _: (200, {"waiting": [
        {"model": "busy:latest", "place": 1, "why": "busy", "waited": 3.0,
         "reason": "every slot of its model is busy"},
        {"model": "cold:latest", "place": 1, "why": "memory", "waited": 12.4,
         "reason": "waiting for memory the busy models hold"},
        {"model": "cold:latest", "place": 2, "why": "memory", "waited": 2.0,
         "reason": "waiting for memory the busy models hold"},
    ]})  # fmt: skip
    lines = ps_lines(server, capsys, busy)
    assert lines[0].split()[-2:] == ["SLOTS", "QUEUE"]
    assert lines[1].split()[-6:] == ["4/4", "2", "queued,", "1", "for", "room"]
    assert lines[2].split()[-2:] == ["0/1", "-"]
    assert lines[3] == ""
    assert lines[4].split() == ["WAITING", "FOR", "REQUESTS", "LONGEST", "WHY"]
    assert lines[5].split() == ["cold:latest", "2", "12", "seconds", "waiting", "for", "memory",
                                "the", "busy", "models", "hold"]  # fmt: skip
    assert len(lines) == 6


def test_list_and_ls(server: FakeServer, capsys: pytest.CaptureFixture[str]) -> None:
    modified = _iso(datetime.now(timezone.utc) - timedelta(hours=2))
    models = [
        {
            "name": "qwen:0.5b",
            "model": "qwen:0.5b",
            "size": 394_000_000,
            "digest": "fedcba9876543210",
            "modified_at": modified,
            "details": {"family": "qwen2"},
        }
    ]
    server.routes["GET", "/api/tags"] = lambda _: (200, {"models": models})
    for command in ("list", "ls"):
        assert cli.main([command]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert lines[0].split() == ["NAME", "ID", "SIZE", "MODIFIED"]
        assert lines[1].split() == ["qwen:0.5b", "fedcba987654", "394", "MB", "2", "hours", "ago"]
    # A file the server cannot use is listed with why.
    models.append({"name": "broken:latest", "size": 10, "digest": "", "modified_at": modified,
                   "details": {}, "error": "model 'broken' cannot be loaded: file is truncated"})
    assert cli.main(["list"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == (
        "broken:latest is unusable: model 'broken' cannot be loaded: file is truncated"
    )


def test_show(server: FakeServer, capsys: pytest.CaptureFixture[str]) -> None:
    server.routes["POST", "/api/show"] = lambda body: (200, SHOW)
    assert cli.main(["show", "llama3.2"]) == 0
    out = capsys.readouterr().out
    assert out == models.format_show(SHOW) + "\n"
    assert "    quantization        Q8_0\n" in out
    assert server.requests[-1] == ("POST", "/api/show", {"model": "llama3.2"})

    assert cli.main(["show", "llama3.2", "--template"]) == 0
    assert capsys.readouterr().out == "{{ .Prompt }}\n"
    assert cli.main(["show", "llama3.2", "--modelfile"]) == 0
    assert capsys.readouterr().out == "FROM /models/llama.gguf\n"


def test_run_streams_generate(server: FakeServer, capsys: pytest.CaptureFixture[str]) -> None:
    server.routes["POST", "/api/generate"] = _generate_route([*TOKENS, FINAL])
    assert cli.main(["run", "m", "say", "hi"]) == 0
    captured = capsys.readouterr()
    assert captured.out == "Hello, world!\n"
    assert captured.err == ""
    bodies = [body for _, path, body in server.requests if path == "/api/generate"]
    assert bodies == [{"model": "m"}, {"model": "m", "prompt": "say hi", "stream": True}]


def test_run_verbose_options_and_flag_order(
    server: FakeServer, capsys: pytest.CaptureFixture[str]
) -> None:
    server.routes["POST", "/api/generate"] = _generate_route([*TOKENS, FINAL])
    argv = ["run", "m", "--verbose", "say", "--keepalive", "10m", "hi", "--format", "json"]
    assert cli.main(argv) == 0
    captured = capsys.readouterr()
    assert captured.out == "Hello, world!\n"
    assert "total duration:       2.5s\n" in captured.err
    assert "eval rate:            25.00 tokens/s\n" in captured.err
    bodies = [body for _, path, body in server.requests if path == "/api/generate"]
    assert bodies == [
        {"model": "m", "keep_alive": "10m"},
        {"model": "m", "prompt": "say hi", "stream": True, "keep_alive": "10m", "format": "json"},
    ]


def test_run_reads_piped_stdin(
    server: FakeServer, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    server.routes["POST", "/api/generate"] = _generate_route([*TOKENS, FINAL])
    monkeypatch.setattr(sys, "stdin", io.StringIO("summarize this"))
    assert cli.main(["run", "m", "please"]) == 0
    assert capsys.readouterr().out == "Hello, world!\n"
    assert server.requests[-1][2]["prompt"] == "summarize this please"


def test_run_unknown_model_fails_before_prompt(
    server: FakeServer, capsys: pytest.CaptureFixture[str]
) -> None:
    server.routes["POST", "/api/generate"] = lambda body: (404, {"error": "model 'x' not found"})
    # not a name the server pulls (corral: 400, not hf.co/...): the model is just not there
    server.routes["POST", "/api/pull"] = lambda body: (400, {"error": "not a Hugging Face name"})
    server.routes["GET", "/api/tags"] = lambda _: (200, {"models": [{"name": "y:latest"}]})
    assert cli.main(["run", "x", "hello"]) == 1
    captured = capsys.readouterr()
    assert captured.err == "Error: model 'x' not found\n"  # nothing close to it
    assert captured.out == ""
    # the load, the pull it tried, the list for a suggestion: no prompt was sent
    assert [path for _, path, _ in server.requests] == ["/api/generate", "/api/pull", "/api/tags"]


def test_run_pulls_a_missing_model_first(
    server: FakeServer, capsys: pytest.CaptureFixture[str]
) -> None:
    pulled: list[str] = []

    def generate(body: Any) -> Reply:
        if not pulled:
            return 404, {"error": f"model '{body['model']}' not found"}
        return _generate_route([*TOKENS, FINAL])(body)

    def pull(body: Any) -> Reply:
        pulled.append(body["model"])
        return 200, [
            {"status": "pulling manifest"},
            {"status": "pulling abc", "digest": "sha256:abc", "total": 10, "completed": 10},
            {"status": "success"},
        ]

    server.routes["POST", "/api/generate"] = generate
    server.routes["POST", "/api/pull"] = pull
    assert cli.main(["run", "hf.co/o/r", "hi"]) == 0
    captured = capsys.readouterr()
    assert pulled == ["hf.co/o/r"]
    assert "pulling manifest" in captured.err and "success" in captured.err
    assert captured.out == "Hello, world!\n"
    # a pull that fails says why (its own error, not the load's)
    pulled.clear()
    server.routes["POST", "/api/pull"] = lambda body: (404, {"error": "no repository 'o/x'"})
    assert cli.main(["run", "hf.co/o/x", "hi"]) == 1
    assert capsys.readouterr().err == "Error: no repository 'o/x'\n"


def test_did_you_mean_a_model(server: FakeServer, capsys: pytest.CaptureFixture[str]) -> None:
    names = ["smollm2:135m", "tiny:latest", "tiny2:latest", "qwen2.5:0.5b"]
    server.routes["GET", "/api/tags"] = lambda _: (200, {"models": [{"name": n} for n in names]})
    missing = lambda b: (404, {"error": f"model '{b['model']}' not found"})  # noqa: E731
    server.routes["POST", "/api/show"] = missing
    assert cli.main(["show", "smollm2"]) == 1
    assert capsys.readouterr().err == (
        "Error: model 'smollm2' not found\n\nDid you mean this?\n\tsmollm2:135m\n"
    )
    assert cli.main(["show", "tinyy"]) == 1
    assert "Did you mean this?\n\ttiny:latest\n\ttiny2:latest\n" in capsys.readouterr().err


def test_did_you_mean_a_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["lst"]) == 1
    assert capsys.readouterr().err == (
        'Error: unknown command "lst" for "corral"\n\nDid you mean this?\n\tlist\n\tls\n\n'
        "Run 'corral --help' for usage.\n"
    )
    assert cli.main(["help"]) == 0 and "usage: corral" in capsys.readouterr().out
    assert cli.main(["frobnicate"]) == 1
    err = capsys.readouterr().err
    assert err.startswith('Error: unknown command "frobnicate"') and "Did you mean" not in err


def test_close_models() -> None:
    names = ["smollm2:135m", "tiny:latest", "tiny2:latest", "hf.co/o/llama-gguf:q4_k_m"]
    assert suggest.close_models("smollm2", names) == ["smollm2:135m"]
    assert suggest.close_models("smolm2", names) == ["smollm2:135m"]
    assert suggest.close_models("SMOLLM2:135", names) == ["smollm2:135m"]
    assert suggest.close_models("hf.co/o/llama-gguf", names) == ["hf.co/o/llama-gguf:q4_k_m"]
    assert suggest.close_models("llama-gguf", names) == ["hf.co/o/llama-gguf:q4_k_m"]
    assert suggest.close_models("lama-gguf", names) == ["hf.co/o/llama-gguf:q4_k_m"]
    assert suggest.close_models("nothing-like-it", names) == []
    assert suggest.close_models("tiny", names)[:1] == ["tiny:latest"]


def test_error_mid_stream(server: FakeServer, capsys: pytest.CaptureFixture[str]) -> None:
    server.routes["POST", "/api/generate"] = _generate_route(
        [TOKENS[0], {"error": "runner crashed"}, TOKENS[1]]
    )
    assert cli.main(["run", "m", "hi"]) == 1
    captured = capsys.readouterr()
    assert captured.out == "Hello\n"  # the error starts on a line of its own
    assert captured.err == "Error: runner crashed\n"


def test_plain_text_error(server: FakeServer, capsys: pytest.CaptureFixture[str]) -> None:
    server.routes["GET", "/api/tags"] = lambda _: (503, "server busy")
    assert cli.main(["list"]) == 1
    assert capsys.readouterr().err == "Error: server busy\n"


def test_stop(server: FakeServer, capsys: pytest.CaptureFixture[str]) -> None:
    # a plain JSON answer (not NDJSON) is accepted too
    done = {"model": "m", "response": "", "done": True, "done_reason": "unload"}
    server.routes["POST", "/api/generate"] = lambda body: (200, done)
    assert cli.main(["stop", "m"]) == 0
    assert server.requests == [("POST", "/api/generate", {"model": "m", "keep_alive": 0})]
    assert capsys.readouterr().out == ""


def test_version(server: FakeServer, capsys: pytest.CaptureFixture[str]) -> None:
    server.routes["GET", "/api/version"] = lambda _: (200, {"version": "9.9.9"})
    for argv in (["version"], ["--version"]):
        assert cli.main(argv) == 0
        out = capsys.readouterr().out
        assert out == f"corral client version {__version__}\ncorral server version 9.9.9\n"


@pytest.mark.parametrize(
    "argv", [["ps"], ["list"], ["show", "m"], ["run", "m", "hi"], ["stop", "m"], ["run", "m"]]
)
def test_unreachable_server(
    argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("CORRAL_HOST", url)
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    assert cli.main(argv) == 1
    assert capsys.readouterr().err == (
        f"Error: could not connect to corral server at {url}; is it running? "
        "(start it with: corral serve)\n"
    )


def test_version_without_server(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("CORRAL_HOST", f"127.0.0.1:{free_port()}")
    assert cli.main(["--version"]) == 0
    captured = capsys.readouterr()
    assert captured.out == f"corral client version {__version__}\n"
    assert captured.err.startswith("Warning: could not connect to corral server")


def test_bad_host_and_usage_errors(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("CORRAL_HOST", "localhost:notaport")
    assert cli.main(["ps"]) == 1
    assert capsys.readouterr().err.startswith("Error: CORRAL_HOST: invalid port")
    assert cli.main(["ps", "extra"]) == 2
    assert cli.main(["run", "m", "--bogus"]) == 2
    assert cli.main([]) == 0
    assert "usage: corral" in capsys.readouterr().out


def typed(monkeypatch: pytest.MonkeyPatch, lines: list[str]) -> None:
    """`input()` answers with `lines`, one a call, then end of input (Ctrl-D)."""
    it = iter(lines)

    def fake_input(prompt: str) -> str:
        try:
            return next(it)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setattr("builtins.input", fake_input)


def test_interactive_chat(
    server: FakeServer, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    replies = iter(["Hi there.", "Bye."])

    def chat(body: Any) -> Reply:
        text = next(replies)
        return 200, [
            {"model": "m", "message": {"role": "assistant", "content": text}, "done": False},
            {
                "model": "m",
                "message": {"role": "assistant", "content": ""},
                "done": True,
                "eval_count": 3,
                "eval_duration": 1_000_000_000,
            },
        ]

    server.routes["POST", "/api/generate"] = _generate_route([])
    server.routes["POST", "/api/chat"] = chat
    # Pretend stdin and stdout are a terminal (stderr is not, so no spinner).
    monkeypatch.setattr("corral.cli.run._isatty", lambda s: s is sys.stdin or s is sys.stdout)
    typed(monkeypatch, ["hello", "/?", "", "again", "/clear", "/bogus"])
    assert cli.main(["run", "m", "--nowordwrap", "--verbose"]) == 0
    captured = capsys.readouterr()
    assert "Hi there.\n\n" in captured.out
    assert "Bye.\n\n" in captured.out
    assert "Available Commands:" in captured.err  # help goes to stderr, as ollama's does
    assert "Cleared session context" in captured.out
    assert "Unknown command '/bogus'. Type /? for help" in captured.out
    assert "eval rate:            3.00 tokens/s" in captured.err
    chats = [body for _, path, body in server.requests if path == "/api/chat"]
    assert [m["content"] for m in chats[1]["messages"]] == ["hello", "Hi there.", "again"]
    assert chats[1]["stream"] is True


def test_interactive_commands(
    server: FakeServer, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """/set, /unset, /show, /save and /load as Ollama's REPL has them, against canned answers."""
    chats: list[Any] = []

    def chat(body: Any) -> Reply:
        chats.append(body)
        return 200, [{"model": "m", "message": {"role": "assistant", "content": "Arr."},
                      "done": True}]  # fmt: skip

    def generate(body: Any) -> Reply:
        if body["model"] == "absent":
            return 404, {"error": "model 'absent' not found"}
        return _generate_route([])(body)

    server.routes["POST", "/api/generate"] = generate
    server.routes["POST", "/api/chat"] = chat
    server.routes["POST", "/api/show"] = lambda body: (200, SHOW)
    created: list[Any] = []
    server.routes["POST", "/api/create"] = lambda body: (
        created.append(body) or (200, [{"status": "success"}])
    )
    monkeypatch.setattr("corral.cli.run._isatty", lambda s: s is sys.stdin or s is sys.stdout)
    typed(monkeypatch, [
        "/set parameter temperature 0.5", "/set parameter num_predict x",
        "/set parameter bogus 1", "/set parameter stop <a> <b>", "/set parameter seed 7",
        '/set system """You are', 'a pirate."""', "/set format json", "/set verbose",
        "/show system", "/show parameters", "/show template", "/show license", "/show bogus",
        "/show modelfile", "hello", "/save pirate", "/unset format", "/unset parameter seed",
        "/load absent", "/load other", "/set bogus",
    ])  # fmt: skip
    assert cli.main(["run", "m", "--nowordwrap"]) == 0
    out = capsys.readouterr().out
    for text in (
        "Set parameter 'temperature' to '0.5'",
        'Couldn\'t set parameter: "invalid int value [x]"',
        'Couldn\'t set parameter: "unknown parameter \'bogus\'"',
        "Set parameter 'stop' to '<a>, <b>'",
        "Set system message.",
        "Set format to 'json' mode.",
        "Set 'verbose' mode.",
        "You are\na pirate.\n\n",  # /show system: the session's
        "Model defined parameters:\n  stop ",
        "User defined parameters:\n  temperature                    0.5\n"
        "  stop                           [<a> <b>]\n  seed                           7\n",
        "{{ .Prompt }}\n",
        "LLAMA 3.2 COMMUNITY LICENSE AGREEMENT",
        "Unknown command '/show bogus'. Type /? for help",
        'FROM /models/llama.gguf\nSYSTEM """You are\na pirate."""\nPARAMETER temperature 0.5\n'
        'PARAMETER stop "<a>"\nPARAMETER stop "<b>"\nPARAMETER seed 7\n',
        "Arr.",
        "Created new model 'pirate'",
        "Disabled format.",
        "Unset parameter 'seed'.",
        "Loading model 'absent'\nCouldn't find model 'absent'",
        "Loading model 'other'",
        "Unknown command '/set bogus'. Type /? for help",
    ):
        assert text in out, text
    (body,) = chats
    assert body["model"] == "m" and body["format"] == "json"
    assert body["options"] == {"temperature": 0.5, "stop": ["<a>", "<b>"], "seed": 7}
    assert body["messages"] == [
        {"role": "system", "content": "You are\na pirate."},
        {"role": "user", "content": "hello"},
    ]
    assert created == [{
        "model": "pirate", "from": "m", "stream": True, "system": "You are\na pirate.",
        "parameters": {"temperature": 0.5, "stop": ["<a>", "<b>"], "seed": 7},
        "messages": [{"role": "user", "content": "hello"},
                     {"role": "assistant", "content": "Arr."}],
    }]  # fmt: skip
    loads = [b["model"] for _, path, b in server.requests if path == "/api/generate"]
    assert loads == ["m", "absent", "other"]
