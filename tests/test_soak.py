"""The soak of issue 8, bounded: 32 clients for 60 s over every API family against a real
corral with five synthetic models under a memory limit that holds about half of them, with
chaos (runners frozen and killed mid-stream, clients leaving mid-stream, options flipping).
The runners' real memory (PSS) never exceeds the limit on any 200 ms sample, every response is
complete or an explicit error in its family's shape, and no runner outlives the server.

corral.bench.soak does the work (`corral bench soak` prints the same figures)."""

from __future__ import annotations

import json
from pathlib import Path

from corral.bench.soak import SoakConfig, format_report, run_soak
from corral.bench.soakwire import FAMILIES

CONFIG = SoakConfig(duration=60.0, clients=32, sizes_mb=(4, 8, 12, 20, 30), chaos=True)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _tracebacks(log: str) -> str:
    """Each traceback in the server's log with the lines just before it (the tail of a
    long log rarely holds them)."""
    lines = log.splitlines()
    starts = [i for i, line in enumerate(lines) if "Traceback (most recent call last)" in line]
    return "\n...\n".join("\n".join(lines[max(0, i - 5) : i + 40]) for i in starts)


def test_soak_never_over_commits_and_every_response_ends(tmp_path: Path) -> None:
    r = run_soak(tmp_path, CONFIG, print)
    report = format_report(r)
    print(report)
    mem, limit = r["memory"], r["limit_bytes"]
    log = Path(r["log"]).read_text(errors="replace")

    # The sampler really sampled: about every 200 ms over the whole run.
    assert mem["samples"] >= CONFIG.duration / CONFIG.sample_every / 2, mem
    # Real memory never above the limit, on any sample.
    assert mem["pss_over_limit_samples"] == 0, (
        f"the runners' PSS exceeded the limit on {mem['pss_over_limit_samples']} of "
        f"{mem['samples']} samples (peak {_mib(mem['peak_pss'])} against {_mib(limit)}); "
        f"first samples over:\n{json.dumps(mem['pss_over'][:3], indent=1)}\n{report}"
    )
    # Every response is complete or an explicit error: none BAD.
    assert r["bad"] == 0, (
        f"{r['bad']} BAD responses: {r['bad_reasons']}\n"
        f"{json.dumps(r['bad_examples'], indent=1)}\n{report}"
    )
    # Every family got answers, streamed and not.
    for family in FAMILIES:
        f = r["families"][family]
        assert f["complete"] > 0, f"no {family} request completed: {f}\n{report}"
    assert sum(f["streamed_complete"] for f in r["families"].values()) > 0
    # The frozen runners were killed by the watchdog, and no runner outlived the server.
    assert r["stalls_induced"] >= 1, f"no runner was frozen: {r['chaos']}"
    assert not r["frozen_runners_not_killed"], (
        f"frozen runners the watchdog did not kill: {r['frozen_runners_not_killed']}"
    )
    assert not r["leaked_runners"], (
        f"runners {r['leaked_runners']} outlived the server:\n{log[-3000:]}"
    )
    assert r["tracebacks"] == 0, _tracebacks(log)
