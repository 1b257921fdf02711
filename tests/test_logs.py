"""CORRAL_LOG_FORMAT=json: one JSON object per line, every line, the decisions included."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from corral.config import ConfigError, Settings


def test_json_logs_are_one_object_per_line(start_server, models_dir: Path) -> None:
    s = start_server(models_dir, CORRAL_BUILTIN_MODELS="0", CORRAL_LOG_FORMAT="json")
    r = s.client.post("/api/generate", json={"model": "tiny", "prompt": "hi", "stream": False,
                                             "options": {"num_predict": 1}})  # fmt: skip
    assert r.status_code == 200
    s.stop_and_check()
    lines = [ln for ln in s.log().splitlines() if ln.strip()]
    records = [json.loads(ln) for ln in lines]  # every line parses
    assert all({"time", "level", "logger", "message"} <= rec.keys() for rec in records)
    messages = [rec["message"] for rec in records]
    assert any(m.startswith("loading model 'tiny:latest'") for m in messages), messages
    assert any(rec["logger"].startswith("uvicorn") for rec in records)  # uvicorn's too


def test_the_log_format_is_checked() -> None:
    with pytest.raises(ConfigError, match="CORRAL_LOG_FORMAT"):
        Settings.load({"CORRAL_LOG_FORMAT": "xml"})


def test_the_start_up_log_says_what_was_found_and_where_the_dashboard_is(
    start_server, models_dir: Path
) -> None:
    s = start_server(models_dir, CORRAL_BUILTIN_MODELS="1")
    n = len(s.client.get("/api/tags").json()["models"])
    log = s.log()
    assert f"{n} models found, among them the built-in smollm2:135m" in log, log[:2000]
    assert f"dashboard at {s.url}/ui" in log
