"""The dashboard: `GET /` sends a browser to `/ui`, the page's files and state document, and the
page itself in a real headless browser (Debian's chromium driven by Playwright): it loads with no
console errors, lists the models, and shows a load made through the API (state, memory, the
event) without a reload; its buttons unload and load, a click held across a state push too;
auto's drafting turned off shows, with why."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from corral.core.estimate import RUNNER_CODE_BYTES
from corral.core.waits import WHY
from corral.testing.server import CorralServer

TINY = "tiny:latest"


@pytest.fixture(scope="module")
def dash(start_server, models_dir: Path) -> CorralServer:
    """A server of its own: what it has loaded is what these tests did."""
    return start_server(models_dir, CORRAL_NUM_PARALLEL="2")


def registered(s: CorralServer) -> list[str]:
    return sorted(m["name"] for m in s.client.get("/api/tags").json()["models"])


# ---- without a browser ------------------------------------------------------------------------
def test_root_answers_clients_and_sends_browsers_to_the_page(dash: CorralServer) -> None:
    plain = dash.client.get("/")
    assert plain.status_code == 200 and plain.text == "Ollama is running"
    plain = dash.client.get("/", headers={"Accept": "application/json"})
    assert plain.text == "Ollama is running"  # as Ollama answers it; some clients compare
    assert plain.headers["x-corral-version"]
    assert dash.client.head("/").status_code == 200
    browser = dash.client.get(
        "/", headers={"Accept": "text/html,application/xhtml+xml,*/*;q=0.8"},
        follow_redirects=False,
    )  # fmt: skip
    assert browser.status_code == 302 and browser.headers["location"] == "/ui"


def test_page_and_its_files_come_from_corral(dash: CorralServer) -> None:
    page = dash.client.get("/ui")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    csp = page.headers["content-security-policy"]
    assert "default-src 'self'" in csp and "script-src 'self'" in csp
    assert "http" not in page.text.replace("http-equiv", "")  # nothing from elsewhere
    for name, kind in (("app.js", "text/javascript"), ("style.css", "text/css")):
        r = dash.client.get(f"/ui/{name}")
        assert r.status_code == 200 and r.headers["content-type"].startswith(kind)
        assert f"/ui/{name}" in page.text
    assert dash.client.get("/ui/secret.py").status_code == 404
    assert dash.client.get("/ui/../server.py").status_code == 404


def test_state_document(dash: CorralServer) -> None:
    doc = dash.client.get("/api/corral/state").json()
    assert {m["name"] for m in doc["models"]} >= set(registered(dash))
    (cpu,) = [d for d in doc["devices"] if d["id"] == "cpu"]
    assert cpu["budget"] > 0 and cpu["total"] >= cpu["budget"] and cpu["in_use"] > 0
    broken = {m["name"]: m for m in doc["models"]}["notgguf:latest"]
    assert broken["state"] == "not_loaded" and broken["error"]
    one = dash.client.get("/api/corral/state", params={"model": "Tiny"}).json()["models"]
    assert [m["name"] for m in one] == [TINY]


def test_events_stream_pushes_state_and_journal(dash: CorralServer) -> None:
    got: list[tuple[str, Any]] = []
    done = threading.Event()

    def read() -> None:
        with httpx.stream("GET", dash.url + "/api/corral/events", timeout=30) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            kind = ""
            for line in r.iter_lines():
                if line.startswith("event: "):
                    kind = line[7:]
                elif line.startswith("data: "):
                    got.append((kind, json.loads(line[6:])))
                if any(k == "journal" and d["kind"] == "ready" for k, d in got):
                    done.set()
                    return

    t = threading.Thread(target=read, daemon=True)
    t.start()
    dash.wait_for(lambda: bool(got), timeout=10, what="the first state")
    assert got[0][0] == "state" and "models" in got[0][1]
    assert dash.client.post("/api/generate", json={"model": "tiny2"}).status_code == 200
    assert done.wait(20)
    ready = [d for k, d in got if k == "journal" and d["kind"] == "ready"]
    assert ready[0]["model"] == "tiny2:latest" and ready[0]["seconds"] > 0
    dash.client.post("/models/unload", json={"model": "tiny2"})
    dash.wait_for(lambda: not dash.ps(), timeout=15, what="tiny2 unloaded")


# ---- in a browser -----------------------------------------------------------------------------


def test_dashboard_in_a_browser(dash: CorralServer, browser: Any, tmp_path: Path) -> None:
    dash.client.post("/models/unload", json={"model": "tiny"})
    dash.wait_for(lambda: not dash.ps(), timeout=15, what="nothing loaded")
    page = browser.new_page(viewport={"width": 1440, "height": 900})
    problems: list[str] = []
    page.on("console", lambda m: m.type in ("error", "warning") and problems.append(m.text))
    page.on("pageerror", lambda e: problems.append(str(e)))
    page.on("requestfailed", lambda r: problems.append(f"{r.url}: {r.failure}"))

    page.goto(dash.url + "/")  # a browser at the root lands on the dashboard
    assert page.url.endswith("/ui")
    row = page.locator(f"tr[data-model='{TINY}']")
    row.wait_for()
    page.wait_for_selector("#conn[data-state='live']")
    names = page.eval_on_selector_all("#model-rows tr", "rows => rows.map(r => r.dataset.model)")
    assert set(registered(dash)) <= set(names)
    assert row.get_attribute("data-state") == "not_loaded"
    assert page.locator(".device[data-device='cpu'] .bar").count() == 1
    page.evaluate("window.__sameDocument = true")

    # A load through the API, not the page: the page sees it by itself.
    r = dash.client.post("/api/generate", json={"model": "tiny", "prompt": "hi", "stream": False,
                                                "options": {"num_predict": 3}})  # fmt: skip
    assert r.status_code == 200, r.text
    page.wait_for_selector(f"tr[data-model='{TINY}'][data-state='ready']", timeout=15000)
    booked = dash.ps()[0]["size"]
    memory = row.locator("td.memory").inner_text()
    assert "MiB" in memory and "cpu" in memory
    assert row.locator(".pill").inner_text() == "ready"
    assert page.locator("#events").inner_text().count("tiny:latest") >= 2  # load, ready
    assert "ready in" in page.locator("#events").inner_text()
    page.wait_for_function(
        "n => [...document.querySelectorAll('.device-foot .who')]"
        ".some(e => e.textContent.includes(n))", arg=TINY,
    )  # fmt: skip
    # Within a measure (2 s), what a reload would cost: the file is in the page cache.
    row.locator(".page-cache").wait_for(timeout=10000)
    assert re.fullmatch(r"\d+% in page cache · reload ≈ [\d.]+ s",
                        row.locator(".page-cache").inner_text()), row.inner_text()  # fmt: skip
    assert page.evaluate("window.__sameDocument") is True  # no reload happened
    assert booked > 0
    row.locator(".mname").wait_for()
    page.wait_for_timeout(1500)  # a measure has come in: the runner's real memory shows too
    shot = tmp_path / "dashboard.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 10_000
    print(f"dashboard screenshot: {shot}")

    # The buttons: unload, then load again.
    row.locator("button[data-act='unload']").click()
    page.wait_for_selector(f"tr[data-model='{TINY}'][data-state='not_loaded']", timeout=15000)
    assert "unloaded on request" in page.locator("#events").inner_text()
    row.locator("button[data-act='load']").click()
    page.wait_for_selector(f"tr[data-model='{TINY}'][data-state='ready']", timeout=15000)
    assert [m["name"] for m in dash.ps()] == [TINY]

    # A client's logprobs turn auto's drafting off for the model: the tokens cell says so, and
    # why on hover, without a reload.
    r = dash.client.post("/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
        "logprobs": True,
    })  # fmt: skip
    assert r.status_code == 200, r.text
    drafts = row.locator(".drafts")
    drafts.wait_for(timeout=15000)
    assert "drafting off" in drafts.inner_text()
    assert drafts.get_attribute("title") == "a client asked for logprobs"
    assert page.evaluate("window.__sameDocument") is True
    assert problems == []
    page.close()


def test_a_click_survives_a_state_push_between_press_and_release(
    dash: CorralServer, browser: Any
) -> None:
    """A browser clicks only where the press and the release met one element: the table is
    not redrawn while a button is held, so a state push then does not lose the click."""
    dash.client.post("/models/unload", json={"model": "tiny2"})
    gen = {"model": "tiny", "prompt": "hi", "stream": False, "options": {"num_predict": 2}}
    assert dash.client.post("/api/generate", json=gen).status_code == 200
    page = browser.new_page(viewport={"width": 1440, "height": 900})
    page.goto(dash.url + "/ui")
    button = page.locator(f"tr[data-model='{TINY}'][data-state='ready'] button[data-act='unload']")
    box = button.bounding_box(timeout=15000)
    assert box is not None
    relayed = (f"() => last.models.find(m => m.name === '{TINY}').tokens?.relayed ?? 0")
    before = page.evaluate(relayed)
    page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
    page.mouse.down()
    # While it is held, the model answers: the page gets a new state (its `last`).
    assert dash.client.post("/api/generate", json=gen).status_code == 200
    page.wait_for_function(f"() => ({relayed})() > {before}", timeout=15000)
    page.mouse.up()
    page.wait_for_selector(f"tr[data-model='{TINY}'][data-state='not_loaded']", timeout=15000)
    assert dash.ps() == []
    page.close()


def test_dashboard_shows_an_eviction_and_a_crash(
    start_server, models_dir: Path, browser: Any, tmp_path: Path
) -> None:
    # Learn what each model books, then allow room for one of them only.
    probe = start_server(models_dir, CORRAL_BUILTIN_MODELS="0")
    sizes = []
    for model in ("tiny", "tiny2"):
        assert probe.client.post("/api/generate", json={"model": model}).status_code == 200
    sizes = [m["size"] for m in probe.ps()]
    probe.stop_and_check()
    s = start_server(
        models_dir,
        CORRAL_BUILTIN_MODELS="0",
        CORRAL_MEMORY_LIMIT=str(int(max(sizes) * 1.35) + RUNNER_CODE_BYTES),
    )
    page = browser.new_page(viewport={"width": 1440, "height": 900})
    problems: list[str] = []
    page.on("console", lambda m: m.type in ("error", "warning") and problems.append(m.text))
    page.on("pageerror", lambda e: problems.append(str(e)))
    page.goto(s.url + "/ui")
    page.wait_for_selector("#conn[data-state='live']")

    assert s.client.post("/api/generate", json={"model": "tiny"}).status_code == 200
    assert s.client.post("/api/generate", json={"model": "tiny2"}).status_code == 200
    events = page.locator("#events")
    page.wait_for_function(
        "() => document.querySelector('#events').textContent.includes('to make room for')"
    )
    first = events.locator("li.k-unload").first.inner_text()
    assert "tiny:latest" in first and "evicted for memory" in first and "tiny2:latest" in first
    page.wait_for_selector("tr[data-model='tiny:latest'][data-state='not_loaded']")
    page.wait_for_selector("tr[data-model='tiny2:latest'][data-state='ready']")
    page.screenshot(path=str(tmp_path / "eviction.png"), full_page=True)

    (pid,) = [m["pid"] for m in s.ps()]
    os.kill(pid, signal.SIGKILL)
    crash = events.locator("li.k-crash")
    crash.wait_for(timeout=15000)
    assert "tiny2:latest crashed" in crash.inner_text()
    crash.locator("summary").click()  # the runner's last log lines
    assert "SIGKILL" in crash.locator("pre").inner_text()
    page.wait_for_selector("tr[data-model='tiny2:latest'][data-state='not_loaded']")
    page.screenshot(path=str(tmp_path / "events.png"), full_page=True)
    assert problems == []
    page.close()


def test_dashboard_shows_who_waits(
    start_server, models_dir: Path, browser: Any, tmp_path: Path
) -> None:
    """A request queued behind the only slot of a busy runner shows in the Waiting list (its
    model, place 1 of 1, the time it has waited, why); the list goes once it is served."""
    s = start_server(models_dir, CORRAL_BUILTIN_MODELS="0")  # one slot per runner
    page = browser.new_page(viewport={"width": 1440, "height": 900})
    problems: list[str] = []
    page.on("console", lambda m: m.type in ("error", "warning") and problems.append(m.text))
    page.on("pageerror", lambda e: problems.append(str(e)))
    page.goto(s.url + "/ui")
    page.wait_for_selector("#conn[data-state='live']")
    assert page.locator("#waiting").is_hidden()  # nothing waits: nothing shows

    # A long greedy generation holds the only slot until its client leaves.
    body = {"model": "long", "prompt": "once upon a time", "raw": True,
            "options": {"num_predict": 100000, "num_ctx": 32768, "temperature": 0}}  # fmt: skip
    served: list[int] = []
    with httpx.Client(base_url=s.url, timeout=60) as holder:
        with holder.stream("POST", "/api/generate", json=body) as r:
            assert r.status_code == 200, r.read()
            lines = r.iter_lines()  # keep a reference: a dropped iterator closes the stream
            next(lines)
            t = threading.Thread(target=lambda: served.append(s.client.post("/api/generate", json={
                "model": "long", "prompt": "hi", "stream": False,
                # the busy runner's own context: without it the core may start a second
                # runner of a smaller context for this one, which then waits for that load
                "options": {"num_predict": 2, "num_ctx": 32768}}).status_code))  # fmt: skip
            t.start()
            # One snapshot of the shown list (the page redraws it on every state it gets)
            seen = page.wait_for_function("""() => {
                const row = document.querySelector("#waiting tr[data-waiting='long:latest']");
                if (!row || document.getElementById("waiting").hidden) return null;
                return {why: row.dataset.why, place: row.querySelector(".place").innerText,
                        text: row.querySelector(".why").innerText, all: row.innerText};
            }""", timeout=15000).json_value()
            # Behind the busy slot; or, when the core starts a load for it as it arrives
            # (seen on a busy machine), waiting for that: the row says which
            assert seen["why"] in ("busy", "loading"), seen
            assert seen["place"] == "1 of 1" and seen["text"] == WHY[seen["why"]]
            assert re.search(r"\d s", seen["all"]), seen  # the time it waited
            page.screenshot(path=str(tmp_path / "waiting.png"), full_page=True)
    t.join(30)
    assert served == [200]
    page.wait_for_selector("#waiting", state="hidden", timeout=15000)
    assert page.locator("#waiting-rows tr").count() == 0
    assert problems == []
    page.close()
