"""`GET /metrics` after a real sequence: the values are the ones the sequence implies.

Two models under a memory limit that holds one (one eviction), a queue-full refusal, a crashed
runner; the text is parsed with prometheus-client's own parser."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from corral.core.estimate import RUNNER_CODE_BYTES
from corral.testing.server import CorralServer

TINY, TINY2 = "tiny:latest", "tiny2:latest"


def scrape(s: CorralServer) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    r = s.client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out = {}
    for fam in text_string_to_metric_families(r.text):
        for sample in fam.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def value(m: dict, name: str, **labels: str) -> float:
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


def gen(s: CorralServer, model: str, **options: int) -> httpx.Response:
    return s.client.post(
        "/api/generate",
        json={"model": model, "prompt": "hi", "stream": False,
              "options": {"num_predict": 2, **options}},
    )  # fmt: skip


def booked(s: CorralServer, model: str) -> int:
    (m,) = [m for m in s.ps() if m["name"] == model]
    return int(m["size"])


def test_metrics_follow_a_real_sequence(start_server, models_dir: Path) -> None:
    # Learn what each model books on an unlimited server, then allow room for one of them.
    probe = start_server(models_dir, CORRAL_BUILTIN_MODELS="0")
    sizes = []
    for model in (TINY, TINY2):
        assert gen(probe, model).status_code == 200
        sizes.append(booked(probe, model))
    probe.stop_and_check()
    limit = int(max(sizes) * 1.35)
    assert sum(sizes) > limit
    limit += RUNNER_CODE_BYTES  # booked once for all runners
    s = start_server(
        models_dir, CORRAL_BUILTIN_MODELS="0", CORRAL_MEMORY_LIMIT=str(limit),
        CORRAL_MAX_QUEUE="1", CORRAL_NUM_PARALLEL="1",
    )  # fmt: skip

    assert gen(s, TINY).status_code == 200
    assert gen(s, TINY2).status_code == 200  # evicts tiny: one load each, one eviction

    # tiny2's only slot busy with a stream, one request queued, the next refused.
    # Greedy decoding of a seeded random model never samples EOS (at 0.8 it ended one after 116
    # tokens, 65 ms, before the next request came), and the runner is held still meanwhile.
    body = {"model": TINY2, "prompt": "count",
            "options": {"num_predict": 100000, "temperature": 0}}  # fmt: skip
    queued: list[int] = []
    with s.client.stream("POST", "/api/generate", json=body) as stream:
        lines = stream.iter_lines()
        next(lines)
        (runner,) = [m["pid"] for m in s.ps() if m["name"] == TINY2]
        os.kill(runner, signal.SIGSTOP)
        try:
            t = threading.Thread(target=lambda: queued.append(gen(s, TINY2).status_code))
            t.start()
            s.wait_for(lambda: value(scrape(s), "corral_queue_depth", model=TINY2) == 1,
                       timeout=10, what="one request queued")  # fmt: skip
            refused = gen(s, TINY2)
            assert refused.status_code == 503 and int(refused.headers["retry-after"]) >= 1
        finally:
            os.kill(runner, signal.SIGCONT)
        for _ in lines:
            pass
    t.join(30)
    assert queued == [200]

    # The runners' own token counters are read with every memory measure (2 s).
    s.wait_for(lambda: value(scrape(s), "corral_generated_tokens_total", model=TINY2) > 0,
               timeout=15, what="tokens counted")  # fmt: skip

    (pid,) = [m["pid"] for m in s.ps() if m["name"] == TINY2]
    os.kill(pid, signal.SIGKILL)
    s.wait_for(lambda: not s.ps(), timeout=15, what="the crashed runner gone")

    m = scrape(s)
    assert value(m, "corral_loads_total", model=TINY) == 1
    assert value(m, "corral_loads_total", model=TINY2) == 1
    assert value(m, "corral_unloads_total", model=TINY, reason="memory") == 1
    assert value(m, "corral_unloads_total", model=TINY2, reason="crashed") == 1
    assert value(m, "corral_runner_crashes_total", model=TINY2) == 1
    assert value(m, "corral_requests_refused_total", model=TINY2) == 1
    assert value(m, "corral_load_duration_seconds_count", model=TINY) == 1
    assert value(m, "corral_load_failures_total", model=TINY) == 0
    # requests: 3 plain generates and the stream answered 200, one refused with 503
    assert value(m, "corral_requests_total", route="/api/generate", status="200") == 4
    assert value(m, "corral_requests_total", route="/api/generate", status="503") == 1
    assert value(m, "corral_request_duration_seconds_count", route="/api/generate") == 5
    assert value(m, "corral_queue_wait_seconds_count", model=TINY2) == 3  # granted ones
    assert value(m, "corral_time_to_first_token_seconds_count", model=TINY2) == 1  # the stream
    assert value(m, "corral_generated_tokens_total", model=TINY2) >= 2
    assert value(m, "corral_prompt_tokens_total", model=TINY2) > 0
    assert value(m, "corral_device_budget_bytes", device="cpu") == limit
    # nothing loaded now: only the runners' shared code is booked, which is always reserved
    reserved = value(m, "corral_device_reserved_bytes", device="cpu")
    assert reserved >= RUNNER_CODE_BYTES  # (raised if the code was measured bigger)
    assert value(m, "corral_device_booked_bytes", device="cpu") == reserved
    # the same books as a cluster's agent reads them
    books = s.client.get("/api/corral/books").json()
    memory = books.pop("memory")
    assert books == {"budgets": {"cpu": limit}, "reserved": {"cpu": reserved}, "waiting": []}
    # and each device's memory: total, held by corral's runners, by others, free
    cpu = memory["cpu"]
    assert cpu["total"] == cpu["ours"] + cpu["others"] + cpu["free"] and cpu["free"] > 0
    assert cpu["ours"] == 0 and cpu["headroom"] > 0  # nothing loaded
    assert value(m, "corral_models_loaded", state="ready") == 0
    assert value(m, "corral_queue_depth", model=TINY2) == 0
    assert value(m, "corral_device_used_bytes", device="cpu") > 0
    # a model's booking and measured memory while it is loaded
    assert gen(s, TINY).status_code == 200
    m = scrape(s)
    assert value(m, "corral_model_booked_bytes", model=TINY, device="cpu") == booked(s, TINY)
    assert value(m, "corral_models_loaded", state="ready") == 1
    assert value(m, "corral_model_resident_bytes", model=TINY) > 0
    # unknown paths share one label
    s.client.get("/no/such/path")
    assert value(scrape(s), "corral_requests_total", route="other", status="404") == 1


def test_a_runner_unloaded_at_once_still_counts_its_tokens(start_server, models_dir: Path) -> None:
    """The runners' token counters are read every 2 s and once more as a runner stops: a model
    unloaded right after its answer (keep_alive 0) loses none."""
    s = start_server(models_dir, CORRAL_BUILTIN_MODELS="0")
    for n in (5, 7):
        r = s.client.post("/api/generate", json={
            "model": "tiny", "prompt": "hello there", "stream": False, "keep_alive": 0,
            "options": {"num_predict": n, "temperature": 0},
        })  # fmt: skip
        assert r.status_code == 200, r.text
        s.wait_for(lambda: not s.ps(), timeout=30, what="the unload")
    m = scrape(s)
    assert value(m, "corral_generated_tokens_total", model=TINY) == 5 + 7
    assert value(m, "corral_relayed_tokens_total", model=TINY) == 5 + 7  # counted as they passed
    assert value(m, "corral_prompt_tokens_total", model=TINY) >= 2 * r.json()["prompt_eval_count"]
