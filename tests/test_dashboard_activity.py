"""The dashboard's activity view and log pane: finished requests (the activity ring) and the
server's log lines (`logs.RING`) pushed on the events stream, shown in Debian's chromium driven by
Playwright without a reload and without polling; filtered by model and status (requests) and by
level (log lines). And the log ring itself, as a unit."""

from __future__ import annotations

import json
import logging
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers import fake_devices, live_dashboard
from starlette.testclient import TestClient

from corral import logs
from corral.config import Settings
from corral.server import create_app
from corral.testing.server import CorralServer

TINY = "tiny:latest"


# ---- the log ring -----------------------------------------------------------------------------
def _logger(ring: logs.LogRing, *before: logging.Handler) -> logging.Logger:
    lg = logging.getLogger(f"corral.test.ring.{uuid.uuid4().hex}")
    lg.propagate = False
    lg.setLevel(logging.DEBUG)
    for h in (*before, ring):
        lg.addHandler(h)
    return lg


def test_the_ring_keeps_the_last_lines() -> None:
    ring = logs.LogRing(keep=3)
    lg = _logger(ring)
    for i in range(5):
        lg.info("line %d of %s", i, "five")
    assert [x.message for x in ring.recent()] == [f"line {i} of five" for i in (2, 3, 4)]
    assert [x.message for x in ring.recent(2)] == ["line 3 of five", "line 4 of five"]
    assert ring.recent(0) == []
    ids = [x.id for x in ring.recent()]
    assert ids == sorted(ids) and len(set(ids)) == 3
    last = ring.recent()[-1]
    assert last.level == "info" and last.logger == lg.name
    assert last.json() == {"id": last.id, "time": round(last.time, 3), "level": "info",
                           "logger": lg.name, "message": "line 4 of five"}  # fmt: skip


def test_listeners_hear_each_new_line_until_stopped() -> None:
    ring = logs.LogRing()
    lg = _logger(ring)
    lg.info("before")
    heard: list[str] = []
    stop = ring.listen(lambda x: heard.append(f"{x.level}:{x.message}"))
    lg.warning("one")
    lg.debug("two")
    stop()
    lg.error("after")
    assert heard == ["warning:one", "debug:two"]
    stop()  # twice is harmless


def test_a_line_from_another_thread_and_an_exception() -> None:
    ring = logs.LogRing()
    lg = _logger(ring, logging.NullHandler())
    heard: list[str] = []
    ring.listen(lambda x: heard.append(x.message))
    t = threading.Thread(target=lambda: lg.info("from a thread"))
    t.start()
    t.join()
    try:
        raise ValueError("boom")
    except ValueError:
        lg.exception("it failed")
    assert heard[0] == "from a thread"
    failed = ring.recent()[-1]
    assert failed.level == "error" and failed.message.startswith("it failed\nTraceback")
    assert "ValueError: boom" in failed.message


def test_a_failing_listener_does_not_stop_logging(capsys: pytest.CaptureFixture[str]) -> None:
    ring = logs.LogRing()
    lg = _logger(ring)

    def bad(x: logs.Line) -> None:
        raise RuntimeError("listener")

    heard: list[str] = []
    ring.listen(bad)
    ring.listen(lambda x: heard.append(x.message))
    lg.info("still kept")
    assert ring.recent()[-1].message == "still kept" and heard == ["still kept"]
    assert "RuntimeError: listener" in capsys.readouterr().err  # said, as logging says its own


def test_setup_installs_the_ring_after_the_output() -> None:
    root = logging.getLogger()
    saved, level = root.handlers[:], root.level
    try:
        logs.setup("info", "text")
        assert root.handlers[-1] is logs.RING and len(root.handlers) == 2
        logging.getLogger("corral.test.setup").info("hello %s", "ring")
        assert logs.RING.recent(1)[0].message == "hello ring"
    finally:
        root.handlers[:] = saved
        root.setLevel(level)


def test_the_history_sampler_stops_with_the_server(tmp_path: Path) -> None:
    settings = Settings.load({"CORRAL_MODELS": str(tmp_path), "CORRAL_KV_CACHE_SIZE": "0",
                              "CORRAL_BUILTIN_MODELS": "0"}, {})  # fmt: skip
    app = create_app(settings, fake_devices("cpu=8GiB"))
    history = app.state.dashboard.history
    with TestClient(app, base_url="http://127.0.0.1") as client:
        assert client.get("/ui").status_code == 200  # the page starts the sampler
        assert history.running
    assert not history.running  # the lifespan's end stopped it (Dashboard.close)


# ---- the events stream ------------------------------------------------------------------------
def test_the_event_stream_brings_requests_and_log_lines(server: CorralServer) -> None:
    """The kept ones first, then each as it comes: the page polls nothing."""
    missing = f"nosuch-{uuid.uuid4().hex[:8]}"
    got: dict[str, list[dict[str, Any]]] = {"activity": [], "log": []}
    sent = False
    with httpx.stream("GET", server.url + "/api/corral/events", timeout=30) as r:
        kind, states = "", 0
        for line in r.iter_lines():
            if line.startswith("event: "):
                kind = line[7:]
                states += kind == "state"
            elif line.startswith("data: ") and kind in got:
                got[kind].append(json.loads(line[6:]))
            if not sent and got["activity"] and got["log"]:
                sent = True  # the kept ones are in: now a request the stream has to bring
                server.client.post("/api/generate", json={"model": missing, "prompt": "hi"})
            reqs = [q for d in got["activity"][1:] for q in d["requests"]]
            lines = [x for d in got["log"][1:] for x in d["lines"]]
            if any(q["model"] == missing for q in reqs) and any(
                missing in x["message"] for x in lines
            ):
                break
            assert states < 30, "the request never came on the stream"
    first_activity, *_ = got["activity"]
    first_log, *_ = got["log"]
    assert first_activity["full"] is True and first_log["full"] is True
    assert all("full" not in d for d in got["activity"][1:] + got["log"][1:])
    (req,) = [q for d in got["activity"][1:] for q in d["requests"] if q["model"] == missing]
    assert req["status"] == 404 and req["route"] == "/api/generate" and "not found" in req["error"]
    (line,) = [x for d in got["log"][1:] for x in d["lines"] if missing in x["message"]]
    assert line["logger"] == "corral.request" and line["level"] == "info"
    assert line["message"].startswith("404 | ")


# ---- in a browser -----------------------------------------------------------------------------


@pytest.fixture()
def page(server: CorralServer, browser: Any) -> Iterator[Any]:
    """The dashboard, live; no console error or failed request while a test uses it."""
    with live_dashboard(browser, server.url) as pg:
        yield pg


def newest_id(s: CorralServer, **params: str) -> int:
    """The id of the newest kept request that matches (waited for: a request is kept once its
    last byte is sent, which may be just after the client read it)."""
    found: list[int] = []

    def seen() -> bool:
        reqs = s.client.get("/api/corral/activity", params={**params, "limit": "1"}).json()
        found[:] = [q["id"] for q in reqs["requests"]]
        return bool(found)

    s.wait_for(seen, timeout=10, what=f"a kept request matching {params}")
    return found[0]


def test_requests_appear_live_and_filter(server: CorralServer, page: Any, tmp_path: Path) -> None:
    fetched: list[str] = []
    page.on("request", lambda r: fetched.append(r.url))
    missing = f"nosuch-{uuid.uuid4().hex[:8]}"
    before = newest_id(server) if server.client.get("/api/corral/activity").json()[
        "requests"] else 0  # fmt: skip

    # Requests made after the page loaded, not by the page: it shows them by itself.
    r = server.client.post("/api/generate", json={"model": "tiny", "prompt": "activity",
                                                  "stream": False, "options": {"num_predict": 4}})
    assert r.status_code == 200, r.text
    ok = newest_id(server, model="tiny", status="200")
    assert server.client.post("/api/generate", json={"model": missing}).status_code == 404
    bad = newest_id(server, status="404")
    assert before < ok < bad
    row_ok, row_bad = (page.locator(f"#act-rows tr[data-id='{i}']") for i in (ok, bad))
    row_ok.wait_for(timeout=15000)
    row_bad.wait_for(timeout=15000)
    assert page.evaluate("window.__sameDocument") is True  # no reload happened

    assert row_ok.get_attribute("data-status") == "200"
    text = row_ok.inner_text()
    assert "POST /api/generate" in text and "127.0.0.1" in text and "/ 4" in text, text
    # Its model, linked once the page's state lists it (the state and the activity come on
    # one event stream, in either order).
    row_ok.locator("a[data-open='tiny:latest']").wait_for(timeout=15000)
    assert row_ok.locator("a[data-open='tiny:latest']").count() == 1
    assert row_bad.get_attribute("data-status") == "404"
    assert f"model '{missing}' not found" in row_bad.locator(".act-error").inner_text()
    assert row_bad.locator("a[data-open]").count() == 0  # no such model to link

    def shown() -> list[tuple[str, str]]:
        return page.eval_on_selector_all(
            "#act-rows tr", "rows => rows.map(r => [r.dataset.status, r.dataset.requestModel])"
        )

    page.select_option("#act-status", "error")
    assert row_ok.count() == 0 and row_bad.count() == 1
    assert shown() and all(int(s) >= 400 for s, _ in shown())
    page.select_option("#act-status", "")
    page.select_option("#act-model", TINY)
    assert row_ok.count() == 1 and row_bad.count() == 0
    assert all(m == TINY for _, m in shown())
    page.select_option("#act-status", "4xx")
    assert row_ok.count() == 0 and "No request matches" in page.locator("#no-activity").inner_text()
    page.select_option("#act-status", "")
    page.select_option("#act-model", "")
    assert row_ok.count() == 1 and row_bad.count() == 1

    # The request's own log line is in the log pane; the level filter hides it.
    mine = page.locator("#log-lines li", has_text=f"model '{missing}' not found")
    mine.wait_for(timeout=15000)
    assert mine.get_attribute("data-level") == "info"
    assert "corral.request" in mine.inner_text() and "404 |" in mine.inner_text()
    page.screenshot(path=str(tmp_path / "activity.png"), full_page=True)
    page.locator("#activity").screenshot(path=str(tmp_path / "requests.png"))
    page.locator("#log").screenshot(path=str(tmp_path / "log.png"))
    print(f"activity screenshots: {tmp_path}")
    page.select_option("#log-level", "warning")
    assert mine.count() == 0
    assert all(
        lv in ("warning", "error", "critical")
        for lv in page.eval_on_selector_all("#log-lines li", "ls => ls.map(l => l.dataset.level)")
    )
    page.select_option("#log-level", "debug")
    assert mine.count() == 1
    # Lines the server dropped for a page that fell behind (its queue for the page was full)
    # leave a gap in the lines' numbers: the pane says so where they would have been.
    page.evaluate("""() => eventHooks.log({lines: [{id: logLines[logLines.length - 1].id + 4,
        time: Date.now() / 1000, level: "info", logger: "corral", message: "after a gap"}]})""")
    gap = page.locator("#log-lines li", has_text="3 log lines not shown: the page fell behind")
    assert gap.count() == 1 and gap.get_attribute("data-level") == "warning"
    assert "after a gap" in page.locator("#log-lines li").last.inner_text()

    # A row's model opens its detail view.
    row_ok.locator("a[data-open]").click()
    page.locator("#detail-body table.files").wait_for()
    assert page.locator("#detail-name").inner_text() == TINY
    # Nothing was polled: the activity came with the events stream.
    assert not [u for u in fetched if "/api/corral/activity" in u or "/api/corral/state" in u]
