"""The dashboard's tools, in Debian's chromium driven by Playwright: the last hour's charts (fed by
`GET /api/corral/history`, sampled every 0.2 s here), the playground (a streamed answer from the
built-in SmolLM2 with its stats and the request as curl), a model's detail view, and pulling
(against the stand-in hub, with progress) and deleting models from the page."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers import live_dashboard
from hubstub import FakeHub

from corral.testing import synth
from corral.testing.server import CorralServer

REPO = "corral-test/Dash-GGUF"
PULLED = "hf.co/corral-test/dash-gguf:q4_k_m"


@pytest.fixture(scope="module")
def hub_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("dashhub")
    return synth.write_llama_model(d / "Dash-Q4_K_M.gguf", n_layer=2, seed=41)


@pytest.fixture(scope="module")
def hub(hub_model: Path) -> Iterator[FakeHub]:
    with FakeHub() as h:
        h.add_repo(REPO, {hub_model.name: hub_model})
        yield h


@pytest.fixture(scope="module")
def dash(start_server, hub: FakeHub, tmp_path_factory: pytest.TempPathFactory) -> CorralServer:
    """A server of its own (models come and go here): one synthetic model, the built-in SmolLM2,
    the stand-in hub to pull from, and a history sample every 0.2 s."""
    models = tmp_path_factory.mktemp("dashmodels")
    synth.write_llama_model(models / "tiny.gguf", n_layer=2, context_length=2048)
    return start_server(
        models, CORRAL_HISTORY_INTERVAL="0.2", CORRAL_NUM_PARALLEL="2", HF_ENDPOINT=hub.url,
        HF_HOME=str(tmp_path_factory.mktemp("hf_home")), HF_HUB_DISABLE_TELEMETRY="1",
    )  # fmt: skip




@pytest.fixture()
def page(dash: CorralServer, browser: Any) -> Iterator[Any]:
    """The dashboard, live; no console error or failed request while a test uses it."""
    with live_dashboard(browser, dash.url) as pg:
        yield pg


# ---- without a browser ------------------------------------------------------------------------
def test_history_and_model_documents(dash: CorralServer) -> None:
    r = dash.client.post("/api/generate", json={"model": "tiny", "prompt": "hi", "stream": False,
                                                "options": {"num_predict": 4}})  # fmt: skip
    assert r.status_code == 200, r.text
    doc: dict[str, Any] = {}

    def sampled() -> bool:
        doc.update(dash.client.get("/api/corral/history").json())
        return len(doc["time"]) >= 2 and any(m["kind"] == "ready" for m in doc["marks"])

    dash.wait_for(sampled, timeout=20, what="history samples and a ready mark")
    assert doc["interval"] == 0.2 and doc["window"] == 3600
    cpu = doc["devices"]["cpu"]
    assert cpu["budget"] > 0 and max(cpu["booked"]) > 0
    assert len(cpu["booked"]) == len(cpu["measured"]) == len(doc["time"]) == len(doc["in_flight"])
    load = next(m for m in doc["marks"] if m["kind"] == "load")
    assert load["model"] == "tiny:latest" and load["at"] <= doc["now"]
    newer = dash.client.get("/api/corral/history", params={"since": doc["time"][-1]}).json()
    assert all(t > doc["time"][-1] for t in newer["time"])
    bad = dash.client.get("/api/corral/history", params={"since": "soon"})
    assert bad.status_code == 400 and "since" in bad.json()["error"]

    info = dash.client.get("/api/corral/model", params={"name": "tiny"}).json()
    assert info["name"] == "tiny:latest" and len(info["digest"]) == 64
    assert [f["role"] for f in info["files"]] == ["model"]
    assert info["files"][0]["file"] == "tiny.gguf" and info["files"][0]["size"] > 0
    assert info["context"]["trained"] == 2048
    assert [r["context_length"] for r in info["runners"]] and info["runners"][0]["slots"] == 2
    assert {"load", "ready"} <= {e["kind"] for e in info["journal"]}
    missing = dash.client.get("/api/corral/model")
    assert missing.status_code == 400 and "name" in missing.json()["error"]
    assert dash.client.get("/api/corral/model", params={"name": "nope"}).status_code == 404


def test_the_event_stream_brings_the_history(dash: CorralServer) -> None:
    """All of it first, then only what is new: the page's charts need no polling."""
    got: list[dict[str, Any]] = []
    with httpx.stream("GET", dash.url + "/api/corral/events", timeout=30) as r:
        kind, states = "", 0
        for line in r.iter_lines():
            if line.startswith("event: "):
                kind = line[7:]
                states += kind == "state"
            elif line.startswith("data: ") and kind == "history":
                got.append(json.loads(line[6:]))
            if len(got) >= 3 or states > 60:
                break
    full, *deltas = got
    assert full["full"] is True and len(full["time"]) >= 2 and full["devices"]["cpu"]["budget"]
    assert deltas and all(d["full"] is False for d in deltas)
    times = full["time"] + [t for d in deltas for t in d["time"]]
    assert times == sorted(set(times))  # no sample twice, none out of order
    assert all(len(d["in_flight"]) == len(d["time"]) for d in deltas)


def test_the_pages_scripts_come_from_corral(dash: CorralServer) -> None:
    page = dash.client.get("/ui").text
    scripts = re.findall(r'<script src="([^"]+)"', page)
    assert {"/ui/app.js", "/ui/charts.js", "/ui/models.js", "/ui/playground.js"} <= set(scripts)
    for src in scripts:
        r = dash.client.get(src)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/javascript")
        # nothing fetched from elsewhere (the SVG namespace is a name, not a fetch)
        assert re.findall(r"https?://[^\s\"'`]+", r.text) in ([], ["http://www.w3.org/2000/svg"])
    assert 'id="activity"' in page  # the activity view's place


# ---- in a browser -----------------------------------------------------------------------------
def test_charts_have_points_after_traffic(dash: CorralServer, page: Any, tmp_path: Path) -> None:
    fetched: list[str] = []
    page.on("request", lambda r: fetched.append(r.url))

    def logged() -> list[str]:  # the routes in the activity ring
        return [r["route"] for r in dash.client.get("/api/corral/activity").json()["requests"]]

    before = logged().count("/api/corral/history")
    # A load while the page (and so the history's sampler) runs: another test may have loaded
    # the model before the sampler started, leaving no mark of that load.
    dash.client.post("/api/generate", json={"model": "tiny", "keep_alive": 0})
    dash.wait_for(lambda: not [m for m in dash.ps() if m["name"] == "tiny:latest"], 30, "unload")
    r = dash.client.post("/api/generate", json={"model": "tiny", "prompt": "count", "stream": False,
                                                "options": {"num_predict": 64}})  # fmt: skip
    assert r.status_code == 200, r.text
    # The charts poll the history: the model's tokens/s line, memory's lines and the marks.
    page.wait_for_function(
        """() => {
          const pts = (s) => Number(document.querySelector(s)?.dataset.points || 0);
          return pts(".chart[data-chart='tokens'] polyline[data-series='tiny:latest']") >= 2
            && pts(".chart[data-chart='memory-cpu'] polyline[data-series='booked']") >= 2
            && pts(".chart[data-chart='requests'] polyline[data-series='in flight']") >= 2;
        }""",
        timeout=20000,
    )  # fmt: skip
    page.locator(".chart[data-chart='memory-cpu'] .mark[data-kind='load']").first.wait_for(
        state="attached"
    )
    assert page.locator("#no-history").is_hidden()
    title = page.locator(".chart[data-chart='memory-cpu'] .mark[data-kind='load'] title").first
    assert "tiny:latest" in title.text_content()
    legend = page.locator(".chart[data-chart='memory-cpu'] .chart-legend").inner_text()
    assert "booked" in legend and "MiB" in legend
    # the activity view's place is in the layout, left to it
    assert page.locator("section#activity").count() == 1
    # The history came with the state stream: the page polled nothing, the request log and
    # the activity ring hold no line for it.
    assert not [u for u in fetched if "/api/corral/history" in u]
    assert logged().count("/api/corral/history") == before
    page.locator("#history").screenshot(path=str(tmp_path / "charts.png"))
    print(f"charts screenshot: {tmp_path / 'charts.png'}")


def test_playground_streams_an_answer(dash: CorralServer, page: Any, tmp_path: Path) -> None:
    page.wait_for_selector("#pg-model option[value='smollm2:135m']", state="attached")
    page.select_option("#pg-model", "smollm2:135m")
    page.fill("#pg-system", "You are a helpful assistant. Answer briefly.")
    page.fill("#pg-temp", "0")
    page.fill("#pg-max", "24")
    page.fill("#pg-input", "What is the capital of France?")
    curl = page.locator("#pg-curl").text_content()
    assert curl.startswith(f"curl {dash.url}/api/chat")
    for part in ('"model": "smollm2:135m"', '"temperature": 0', '"num_predict": 24',
                 "You are a helpful assistant.", "capital of France"):  # fmt: skip
        assert part in curl, curl
    page.click("#pg-send")
    answer = page.locator(".pg-msg.assistant").last
    answer.locator(".pg-stats").wait_for(timeout=60000)
    assert answer.get_attribute("data-state") == "done"
    assert answer.locator(".content").inner_text().strip()
    stats = answer.locator(".pg-stats").inner_text()
    for part in ("out", "first token", "tokens/s", "stop:"):
        assert part in stats, stats
    assert "stop: stop" in stats or "stop: length" in stats
    assert page.locator(".pg-msg.user").inner_text().endswith("What is the capital of France?")
    page.locator("#playground").screenshot(path=str(tmp_path / "playground.png"))
    print(f"playground screenshot: {tmp_path / 'playground.png'}")

    # A second turn carries the first: the curl shows the whole conversation.
    page.fill("#pg-input", "And of Italy?")
    curl = page.locator("#pg-curl").text_content()
    assert curl.count('"role": "user"') == 2 and '"role": "assistant"' in curl
    page.click("#pg-clear")
    assert page.locator(".pg-msg").count() == 0


def test_a_models_detail_view(dash: CorralServer, page: Any, tmp_path: Path) -> None:
    page.wait_for_selector("tr[data-model='tiny:latest'][data-state='ready']")
    page.locator("a[data-detail='tiny:latest']").click()
    body = page.locator("#detail-body")
    body.locator("table.files").wait_for()
    text = body.inner_text().lower()  # (headings are upper case on the page)
    assert "tiny.gguf" in text and "template" in text and "context" in text
    assert "of 2048 trained" in text  # the context its runner has, of the trained one
    assert "ready in" in body.locator("ol.events").inner_text()  # its loads, from the journal
    page.screenshot(path=str(tmp_path / "detail.png"))
    print(f"detail screenshot: {tmp_path / 'detail.png'}")
    page.click("#detail-chat")  # on to the playground with this model
    assert page.locator("#pg-model").input_value() == "tiny:latest"
    assert not page.locator("#detail").get_attribute("open")


def test_pull_and_delete_from_the_page(
    dash: CorralServer, hub: FakeHub, hub_model: Path, page: Any, tmp_path: Path
) -> None:
    hub.throttle = 0.02  # 64 KiB per 20 ms: a few progress lines
    # Every share the page shows, as it shows it.
    page.evaluate("""() => {
      window.__seen = [];
      new MutationObserver(() => document.querySelectorAll('.pull-file').forEach(
        (r) => window.__seen.push(r.dataset.percent))
      ).observe(document.getElementById('pull-files'),
                {subtree: true, childList: true, attributes: true});
    }""")
    try:
        page.fill("#pull-name", f"hf.co/{REPO}:Q4_K_M")
        page.click("#pull-go")
        page.locator(".pull-file").first.wait_for(timeout=20000)  # a bar per file, as the CLI
        page.wait_for_selector("#pull[data-state='done']", timeout=60000)
    finally:
        hub.throttle = 0.0
    row = page.locator(".pull-file").first
    assert row.get_attribute("data-percent") == "100"
    seen = page.evaluate("window.__seen")
    assert seen[0] == "0" and seen[-1] == "100", seen  # from the start to the end
    assert "pulling" in row.inner_text() and "MiB" in row.inner_text()
    log = page.locator("#pull-log").inner_text()
    assert "pulling manifest" in log and "verifying sha256 digest" in log and "success" in log
    # The model is there without a reload.
    page.wait_for_selector(f"tr[data-model='{PULLED}']", timeout=15000)
    page.screenshot(path=str(tmp_path / "pulled.png"), full_page=True)
    print(f"pull screenshot: {tmp_path / 'pulled.png'}")
    assert PULLED in {m["name"] for m in dash.client.get("/api/tags").json()["models"]}
    (blob,) = dash.client.get("/api/corral/model", params={"name": PULLED}).json()["files"]
    assert blob["digest"] == "sha256:" + hashlib.sha256(hub_model.read_bytes()).hexdigest()

    # Delete asks once more, then removes it.
    page.click(f"tr[data-model='{PULLED}'] button[data-act='ask-delete']")
    page.click(f"tr[data-model='{PULLED}'] button[data-act='delete']")
    page.wait_for_selector(f"tr[data-model='{PULLED}']", state="detached", timeout=15000)
    assert PULLED not in {m["name"] for m in dash.client.get("/api/tags").json()["models"]}

    # A pull that cannot work says why, in the page.
    page.fill("#pull-name", "hf.co/corral-test/Nothing-GGUF")
    page.click("#pull-go")
    page.wait_for_selector("#pull[data-state='failed']", timeout=20000)
    assert "failed" in page.locator("#pull-status").inner_text()
