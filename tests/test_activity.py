"""Every request is visible (api/activity.py): one log line per request, as Ollama's `[GIN]`
line, in corral's text format and as JSON (CORRAL_LOG_FORMAT=json), for answers and for every
kind of error; the ring of the last requests at `GET /api/corral/activity`, filtered by model
and status; the runners' own output in the log at debug level, with the model's name."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hubstub import FakeHub

from corral.api.activity import Activity, Entry, Record, record, status_filter
from corral.errors import ApiError
from corral.runtime.meter import Meter
from corral.testing import synth
from corral.testing.server import CorralServer

GEN = {"model": "tiny", "prompt": "Once upon a time", "raw": True,
       "options": {"num_predict": 5, "temperature": 0}}  # fmt: skip
CORRUPT = "hf.co/corral-test/corrupt-GGUF"


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeHub]:
    """A stand-in hub whose one repo serves a file that does not match its digest."""
    d = tmp_path_factory.mktemp("activityhub")
    gguf = synth.write_llama_model(d / "corrupt.gguf", seed=31)
    with FakeHub() as h:
        h.add_repo("corral-test/corrupt-GGUF", {"corrupt-Q4_K_M.gguf": gguf})
        h.corrupt("corrupt-Q4_K_M.gguf")
        yield h


@pytest.fixture(scope="module")
def server(start_server, models_dir: Path, hub: FakeHub, tmp_path_factory) -> CorralServer:
    """Text logs at debug level (the runners' output shows), pulls from the stand-in hub."""
    return start_server(
        models_dir, CORRAL_BUILTIN_MODELS="0", CORRAL_LOG_LEVEL="debug", HF_ENDPOINT=hub.url,
        HF_HOME=str(tmp_path_factory.mktemp("hf_home")), HF_HUB_DISABLE_TELEMETRY="1",
    )  # fmt: skip


def request_lines(s: CorralServer) -> list[str]:
    return [ln for ln in s.log().splitlines() if " corral.request: " in ln]


def logged(s: CorralServer, *parts: str) -> str:
    """The request log line holding every one of `parts` (waited for: the line is written once
    the response's last byte is sent, which may be just after the client read it)."""
    found: list[str] = []

    def seen() -> bool:
        found[:] = [ln for ln in request_lines(s) if all(p in ln for p in parts)]
        return bool(found)

    s.wait_for(seen, timeout=10, what=f"a request line with {parts}")
    return found[-1]


def activity(s: CorralServer, **params: str) -> list[dict[str, Any]]:
    r = s.client.get("/api/corral/activity", params=params)
    assert r.status_code == 200, r.text
    return list(r.json()["requests"])


# ---- the log line ---------------------------------------------------------------------------
def test_a_streamed_answer_is_logged_with_its_tokens_and_first_token(server: CorralServer) -> None:
    with server.client.stream("POST", "/api/generate", json=GEN) as r:
        assert r.status_code == 200
        chunks = [json.loads(line) for line in r.iter_lines() if line.strip()]
    assert chunks[-1]["done"] and chunks[-1]["eval_count"] == 5
    line = logged(server, "| POST /api/generate |", "tiny:latest", "5 generated")
    # e.g. "200 | 0.412s | 127.0.0.1 | POST /api/generate | tiny:latest | 4 prompt tokens,
    # 5 generated, first token 0.398s, 240.1 tokens/s"
    m = re.search(
        r"INFO corral\.request: 200 \| ([\d.]+)s \| 127\.0\.0\.1 \| POST /api/generate \| "
        r"tiny:latest \| (\d+) prompt tokens, 5 generated, first token ([\d.]+)s, "
        r"([\d.]+) tokens/s$", line,
    )  # fmt: skip
    assert m, line
    duration, prompt, ttft, speed = float(m[1]), int(m[2]), float(m[3]), float(m[4])
    assert prompt == chunks[-1]["prompt_eval_count"]
    assert 0 < ttft <= duration and speed > 0
    rec = next(r for r in activity(server, model="tiny") if r["generated_tokens"] == 5)
    assert rec["status"] == 200 and rec["route"] == "/api/generate" and rec["method"] == "POST"
    assert rec["client"] == "127.0.0.1" and rec["error"] is None
    assert rec["prompt_tokens"] == prompt and 0 < rec["time_to_first_token"] <= rec["duration"]


def test_a_whole_answer_is_logged_with_llamacpps_timings(server: CorralServer) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    r = server.client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    line = logged(server, "| POST /v1/chat/completions |", "200 |")
    assert f"| tiny:latest | {usage['prompt_tokens']} prompt tokens, 3 generated, " in line
    assert "first token" in line and "tokens/s" in line


def test_an_unknown_model_is_logged_with_its_404(server: CorralServer) -> None:
    r = server.client.post("/api/chat", json={"model": "nope", "messages": []})
    assert r.status_code == 404
    line = logged(server, "| POST /api/chat | nope |")
    assert re.search(r"corral\.request: 404 \| [\d.]+s \| 127\.0\.0\.1 \| POST /api/chat \| "
                     r"nope \| error: model 'nope' not found$", line), line  # fmt: skip


def test_malformed_json_is_logged_with_its_400(server: CorralServer) -> None:
    r = server.client.post("/api/chat", content=b'{"model": "tiny",',
                           headers={"content-type": "application/json"})  # fmt: skip
    assert r.status_code == 400
    line = logged(server, "400 |", "| POST /api/chat | - |")
    assert "error: " + r.json()["error"] in line


def test_a_broken_model_file_is_logged_when_refused(server: CorralServer) -> None:
    r = server.client.post("/api/generate", json={"model": "truncated", "prompt": "hi"})
    assert r.status_code == 500
    line = logged(server, "| POST /api/generate | truncated |")
    assert line.startswith(line.split(" corral.request: ")[0])  # one line
    assert "500 |" in line and "error: model 'truncated' cannot be loaded" in line
    assert "file is truncated" in line


def test_a_failed_pull_is_logged_however_it_fails(server: CorralServer) -> None:
    r = server.client.post("/api/pull", json={"model": "hf.co/corral-test/none-GGUF"})
    assert r.status_code == 404
    line = logged(server, "| POST /api/pull | hf.co/corral-test/none-GGUF |")
    assert "404 |" in line and "error: " in line
    # A download that fails once the progress stream has started: 200, ended by an error line.
    with server.client.stream("POST", "/api/pull", json={"model": CORRUPT}) as r:
        assert r.status_code == 200
        last = [json.loads(ln) for ln in r.iter_lines() if ln.strip()][-1]
    assert "digest mismatch" in last["error"]
    line = logged(server, f"| POST /api/pull | {CORRUPT} |", "200 |")
    assert "error: " in line and "digest mismatch" in line


def test_a_list_of_models_names_none(server: CorralServer) -> None:
    for path in ("/api/tags", "/v1/models"):
        assert server.client.get(path).status_code == 200
        assert logged(server, f"| GET {path} |").endswith(f"| GET {path} | -")


def test_an_embedding_is_logged_with_its_prompt_tokens_and_none_generated(
    server: CorralServer,
) -> None:
    r = server.client.post("/v1/embeddings", json={"model": "embed", "input": ["a b c", "d e"]})
    assert r.status_code == 200, r.text
    tokens = r.json()["usage"]["prompt_tokens"]
    line = logged(server, "| POST /v1/embeddings | embed:latest |")
    assert line.endswith(f"| embed:latest | {tokens} prompt tokens"), line
    (row,) = [a for a in activity(server, model="embed") if a["route"] == "/v1/embeddings"][:1]
    assert row["prompt_tokens"] == tokens and row["generated_tokens"] is None


def test_a_model_looked_up_by_name_is_logged_with_it(server: CorralServer) -> None:
    assert server.client.get("/v1/models/tiny").status_code == 200
    assert logged(server, "| GET /v1/models/tiny |").endswith("| GET /v1/models/tiny | tiny:latest")
    assert server.client.get("/v1/models/nope").status_code == 404
    assert "| nope | error: model 'nope' not found" in logged(server, "GET /v1/models/nope")


def test_the_guards_refusals_are_logged(server: CorralServer) -> None:
    r = server.client.post("/api/chat", json={}, headers={"origin": "https://evil.example"})
    assert r.status_code == 403
    line = logged(server, "403 |", "| POST /api/chat |")
    assert "origin 'https://evil.example' is not allowed" in line


def test_the_runners_output_is_logged_at_debug_level_with_the_models_name(
    server: CorralServer,
) -> None:
    assert server.client.post("/api/generate", json={**GEN, "stream": False}).status_code == 200
    mark = " corral.runtime.runner: [tiny:latest] "
    lines = [ln for ln in server.log().splitlines() if mark in ln]
    assert lines and all(" DEBUG " in ln for ln in lines)
    assert any("llama" in ln for ln in lines), lines[:5]  # llama.cpp's own lines


def test_the_dashboards_own_polling_stays_out_of_the_activity(server: CorralServer) -> None:
    for _ in range(3):
        assert server.client.get("/api/corral/state").status_code == 200
    assert not any(r["route"] == "/api/corral/state" for r in activity(server))
    assert any(ln.endswith("| GET /api/corral/state | -") for ln in server.log().splitlines()
               if " DEBUG corral.request: " in ln)  # fmt: skip


# ---- the activity ring ----------------------------------------------------------------------
def test_the_activity_is_filtered_by_model_and_status(server: CorralServer) -> None:
    r = server.client.post("/api/chat", json={"model": "nope", "messages": []})
    assert r.status_code == 404
    r = server.client.post("/api/generate", json={**GEN, "stream": False})
    assert r.status_code == 200
    server.wait_for(lambda: any(x["status"] == 200 and x["model"] == "tiny:latest"
                                for x in activity(server)), timeout=10)  # fmt: skip
    everything = activity(server)
    assert [x["id"] for x in everything] == sorted((x["id"] for x in everything), reverse=True)
    missing = activity(server, status="404")
    assert missing and all(x["status"] == 404 for x in missing)
    assert any(x["model"] == "nope" and x["error"] == "model 'nope' not found" for x in missing)
    assert {x["status"] for x in activity(server, status="4xx")} <= set(range(400, 500))
    assert all(x["status"] >= 400 for x in activity(server, status="error"))
    tiny = activity(server, model="tiny")
    assert tiny and all(x["model"] == "tiny:latest" for x in tiny)
    assert activity(server, model="tiny", status="ok")[0]["generated_tokens"] == 5
    assert len(activity(server, limit="1")) == 1
    bad = server.client.get("/api/corral/activity", params={"status": "teapot"})
    assert bad.status_code == 400 and "not a status" in bad.json()["error"]
    fields = {"id", "time", "client", "method", "route", "model", "status", "prompt_tokens",
              "generated_tokens", "time_to_first_token", "tokens_per_second", "duration",
              "error"}  # fmt: skip
    assert all(set(x) == fields for x in everything)


def test_json_log_lines_carry_the_requests_fields(start_server, models_dir: Path) -> None:
    s = start_server(models_dir, CORRAL_BUILTIN_MODELS="0", CORRAL_LOG_FORMAT="json")
    with s.client.stream("POST", "/api/generate", json=GEN) as r:
        assert r.status_code == 200
        r.read()
    assert s.client.post("/api/chat", json={"model": "nope", "messages": []}).status_code == 404
    s.wait_for(lambda: len([ln for ln in s.log().splitlines() if '"corral.request"' in ln]) >= 2,
               timeout=10)  # fmt: skip
    objs = [json.loads(ln) for ln in s.log().splitlines() if ln.strip()]
    reqs = [o for o in objs if o["logger"] == "corral.request"]
    ok = next(o for o in reqs if o["status"] == 200)
    assert ok["level"] == "info" and ok["method"] == "POST" and ok["route"] == "/api/generate"
    assert ok["model"] == "tiny:latest" and ok["client"] == "127.0.0.1"
    assert ok["generated_tokens"] == 5 and ok["prompt_tokens"] > 0 and ok["error"] is None
    assert 0 < ok["time_to_first_token"] <= ok["duration"] and ok["tokens_per_second"] > 0
    assert ok["message"].startswith("200 | ")
    missing = next(o for o in reqs if o["status"] == 404)
    assert missing["model"] == "nope" and missing["error"] == "model 'nope' not found"
    assert missing["generated_tokens"] is None and missing["time_to_first_token"] is None


# ---- the pieces, alone ----------------------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_a_records_figures_come_from_its_tally() -> None:
    clock = Clock()
    tally = Meter(clock).tally("runner", "m")
    entry = Entry(1.7e9, 10.0, "127.0.0.1", "POST", "/api/chat", "m:latest", 200, streamed=True)
    entry.granted = 10.5
    entry.tallies.append(tally)
    clock.t += 1.0
    tally.add(1)  # the first token passes 1 s after the tally began
    clock.t += 2.0
    tally.timed({"prompt_n": 7, "cache_n": 3, "prompt_ms": 250.0, "predicted_n": 20,
                 "predicted_ms": 2000.0})  # fmt: skip
    tally.end()
    rec = record(entry, 1, now=14.0)  # 4 s after its arrival, 2 s after the first token
    assert (rec.prompt_tokens, rec.generated_tokens) == (10, 20)
    assert rec.time_to_first_token == pytest.approx(2.0)
    assert rec.tokens_per_second == pytest.approx(10.0) and rec.duration == pytest.approx(4.0)
    whole = record(Entry(1.7e9, 10.0, None, "POST", "/api/chat", granted=10.5,
                         tallies=[tally]), 2, now=14.0)  # fmt: skip
    assert whole.time_to_first_token == pytest.approx(0.75)  # the wait, then the prompt read
    assert whole.line() == ("0 | 4.000s | - | POST /api/chat | - | 10 prompt tokens, "
                            "20 generated, first token 0.750s, 10.0 tokens/s")  # fmt: skip


def test_an_errors_line_is_one_line() -> None:
    why = "runner for model 'm' exited with code 1; last log lines:\nabc\ndef"
    rec = Record(1, 1.7e9, "::1", "POST", "/v1/chat/completions", "m:latest", 200, None, 3,
                 None, None, 0.5, why)  # fmt: skip
    assert rec.line() == ("200 | 0.500s | ::1 | POST /v1/chat/completions | m:latest | "
                          "3 generated | error: runner for model 'm' exited with code 1; last "
                          "log lines:; abc; def")  # fmt: skip


def test_the_ring_keeps_the_last_ones_and_tells_listeners() -> None:
    ring = Activity(keep=3)
    heard: list[int] = []
    stop = ring.listen(lambda r: heard.append(r.id))
    for i in range(5):
        ring.add(Record(ring.next_id(), 0.0, None, "GET", "/", f"m{i % 2}", 200 + i, None,
                        None, None, None, 0.0, None))  # fmt: skip
    stop()
    ring.add(Record(ring.next_id(), 0.0, None, "GET", "/", None, 500, None, None, None, None,
                    0.0, "x"))  # fmt: skip
    assert heard == [1, 2, 3, 4, 5]
    assert [r.id for r in ring.find()] == [6, 5, 4]
    assert [r.id for r in ring.find(model="m0")] == [5]
    assert [r.id for r in ring.find(status=status_filter("5xx"))] == [6]
    assert [r.id for r in ring.find(status=status_filter("204"))] == [5]
    assert [r.id for r in ring.find(status=status_filter("OK"))] == [5, 4]
    with pytest.raises(ApiError, match="not a status"):
        status_filter("2x")
