"""Runner lifecycle with real runner processes: keep-alive, unload, crashes, disconnects,
and no runner outliving the server."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time

import httpx
import psutil
import pytest

from corral.runtime.runner import GOMP_SPINCOUNT
from corral.testing.server import CorralServer, all_runner_pids

# Greedy decoding of a seeded random model repeats tokens and never samples EOS, so a stream
# runs until the 16k context is full: several seconds, long enough to act on it mid-stream.
LONG = {
    "model": "long",
    "prompt": "once upon a time",
    "raw": True,
    "options": {"num_predict": 100000, "num_ctx": 16384, "temperature": 0},
}


def loaded(server: CorralServer) -> dict[str, dict]:
    """Models with a runner that is loading or serving (not one on its way out)."""
    return {m["model"]: m for m in server.ps() if m["state"] != "unloading"}


def gen(server: CorralServer, model: str, **body) -> httpx.Response:
    return server.client.post(
        "/api/generate",
        json={
            "model": model,
            "prompt": "hi",
            "stream": False,
            "options": {"num_predict": 2},
            **body,
        },
    )


@pytest.fixture(scope="module")
def short_keepalive(start_server, models_dir) -> CorralServer:
    return start_server(
        models_dir, CORRAL_KEEP_ALIVE="1s", CORRAL_NUM_PARALLEL="1", CORRAL_CONTEXT_LENGTH="2048"
    )


def test_keep_alive_expiry_stops_the_runner(short_keepalive: CorralServer) -> None:
    s = short_keepalive
    assert gen(s, "tiny").status_code == 200
    pid = loaded(s)["tiny:latest"]["pid"]
    assert psutil.pid_exists(pid)
    s.wait_for(lambda: "tiny:latest" not in loaded(s), timeout=15, what="keep-alive expiry")
    # The runner may end between any two looks at it: a vanished pid is the outcome we want.
    with contextlib.suppress(psutil.NoSuchProcess):
        psutil.Process(pid).wait(10)
    assert not psutil.pid_exists(pid)
    assert "keep-alive expired" in s.log()


def test_a_runner_has_its_own_process_group_but_not_its_own_session(short_keepalive) -> None:
    """Ctrl-C in the terminal reaches corral only (which stops the runners), while the runners
    stay in corral's session: the kernel's autogroup scheduling makes each session a CPU group
    of its own, and a runner in its own group spun its compute threads' barriers against
    itself whenever runners were busy together (3-80x slower on 2 cores)."""
    s = short_keepalive
    assert gen(s, "tiny", keep_alive="1m").status_code == 200
    pid = loaded(s)["tiny:latest"]["pid"]
    assert os.getpgid(pid) == pid != os.getpgid(s.proc.pid)
    assert os.getsid(pid) == os.getsid(s.proc.pid)
    if os.path.exists(f"/proc/{pid}/autogroup"):  # kernels built with autogroup scheduling
        # "/autogroup-N nice 0", or empty where the process sits in a CPU cgroup other than the
        # root (containers): autogroups apply only in the root group. Same group either way.
        with open(f"/proc/{pid}/autogroup") as mine, open(f"/proc/{s.proc.pid}/autogroup") as its:
            assert mine.read() == its.read()
    assert gen(s, "tiny", keep_alive=0).status_code == 200


def spin(pid: int) -> str | None:
    with open(f"/proc/{pid}/environ", "rb") as f:
        env = dict(v.decode().partition("=")[::2] for v in f.read().split(b"\0") if v)
    return env.get("GOMP_SPINCOUNT")


def test_a_runner_started_beside_another_spins_briefly(short_keepalive) -> None:
    """Alone, a CPU runner keeps libgomp's long spin at its barriers (fastest alone); one
    started while another CPU runner stays spins GOMP_SPINCOUNT pauses, so that runners
    computing at once do not burn their time slices waiting for threads off the CPU."""
    s = short_keepalive
    s.wait_for(lambda: not loaded(s), timeout=15, what="the runners of earlier tests to go")
    assert gen(s, "tiny", keep_alive="1m").status_code == 200
    assert gen(s, "tiny2", keep_alive="1m").status_code == 200
    ps = loaded(s)
    assert spin(ps["tiny:latest"]["pid"]) is None
    assert spin(ps["tiny2:latest"]["pid"]) == GOMP_SPINCOUNT
    for model in ("tiny", "tiny2"):
        assert gen(s, model, keep_alive=0).status_code == 200


def test_request_keep_alive_overrides_and_negative_is_forever(short_keepalive) -> None:
    s = short_keepalive
    assert gen(s, "tiny", keep_alive=-1).status_code == 200
    time.sleep(2.5)  # well past the server's 1s default
    m = loaded(s)["tiny:latest"]
    assert m["expires_at"].startswith("9999")
    assert gen(s, "tiny", keep_alive="1s").status_code == 200  # the model's keep-alive follows
    s.wait_for(lambda: "tiny:latest" not in loaded(s), timeout=15, what="unload after 1s")


def test_keep_alive_zero_unloads_when_the_request_ends(short_keepalive) -> None:
    s = short_keepalive
    assert gen(s, "tiny2", keep_alive=0).status_code == 200
    s.wait_for(lambda: "tiny2:latest" not in loaded(s), timeout=10, what="unload")


def test_runner_killed_mid_stream_fails_request_with_its_log_then_reloads(short_keepalive) -> None:
    s = short_keepalive
    body = LONG
    lines: list[dict] = []
    with s.client.stream("POST", "/api/generate", json=body) as r:
        assert r.status_code == 200
        it = r.iter_lines()
        lines.append(json.loads(next(it)))
        pid = loaded(s)["long:latest"]["pid"]
        os.kill(pid, signal.SIGKILL)
        for line in it:
            lines.append(json.loads(line))
    last = lines[-1]
    assert "error" in last, last
    assert "runner for model 'long:latest'" in last["error"]
    assert "killed by signal 9" in last["error"]
    s.wait_for(lambda: "long:latest" not in loaded(s), timeout=10, what="dead runner to leave")
    r2 = gen(s, "long")
    assert r2.status_code == 200 and r2.json()["done"]
    assert loaded(s)["long:latest"]["pid"] != pid


def test_disconnect_mid_stream_frees_the_slot_at_once(short_keepalive) -> None:
    s = short_keepalive  # one slot per runner: a leaked slot would block the next request
    body = LONG
    with httpx.Client(base_url=s.url, timeout=30) as c:
        with c.stream("POST", "/api/generate", json=body) as r:
            assert r.status_code == 200, r.read()
            lines = r.iter_lines()  # keep a reference: a dropped iterator closes the stream
            next(lines)
            ps = loaded(s)["long:latest"]
            assert ps["requests_in_flight"] == 1 and ps["queued"] == 0
            assert ps["waiting_for_room"] == 0 and ps["speculative"] == "ngram-mod"
    s.wait_for(
        lambda: loaded(s)["long:latest"]["requests_in_flight"] == 0,
        timeout=5,
        what="slot release after disconnect",
    )
    t = time.monotonic()
    assert gen(s, "long").status_code == 200
    assert time.monotonic() - t < 5


def test_disconnect_while_queued_leaves_no_queue_entry(short_keepalive) -> None:
    s = short_keepalive
    body = LONG
    with httpx.Client(base_url=s.url, timeout=30) as holder:
        with holder.stream("POST", "/api/generate", json=body) as r:
            assert r.status_code == 200, r.read()
            lines = r.iter_lines()  # keep a reference: a dropped iterator closes the stream
            next(lines)

            def queued_request() -> None:
                try:
                    httpx.post(f"{s.url}/api/generate", json={**body, "stream": False}, timeout=1.0)
                except httpx.TimeoutException:
                    pass  # the client gives up while its request waits for the busy slot

            t = threading.Thread(target=queued_request)
            t.start()
            s.wait_for(lambda: loaded(s)["long:latest"]["queued"] == 1, timeout=5, what="queue")
            t.join()
            s.wait_for(
                lambda: loaded(s)["long:latest"]["queued"] == 0,
                timeout=5,
                what="queue entry to go with its client",
            )
    s.wait_for(
        lambda: loaded(s)["long:latest"]["requests_in_flight"] == 0, timeout=5, what="slot release"
    )


def test_concurrent_requests_for_one_unloaded_model_share_one_load(
    start_server, models_dir
) -> None:
    s = start_server(models_dir, CORRAL_NUM_PARALLEL="4")
    results: list[int] = []
    threads = [
        threading.Thread(target=lambda: results.append(gen(s, "tiny2").status_code))
        for _ in range(6)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [200] * 6
    assert s.log().count("loading model 'tiny2:latest'") == 1


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_no_runner_outlives_the_server(start_server, models_dir, sig: int) -> None:
    s = start_server(models_dir)
    assert gen(s, "long").status_code == 200
    assert gen(s, "tiny2").status_code == 200
    pids = s.runners()
    assert len(pids) == 2 and pids <= all_runner_pids()
    s.stop(sig)
    deadline = time.monotonic() + 10
    while pids & all_runner_pids() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pids & all_runner_pids()
