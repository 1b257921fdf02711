"""After a GPU runner exits, its memory stays booked until the driver reports it free."""

from __future__ import annotations

import dataclasses

from helpers import fake_devices

from corral.runtime.measure import wait_for_recovery

GiB = 2**30


async def test_waits_until_the_driver_reports_the_memory_back() -> None:
    devices = fake_devices("cpu=16GiB,cuda=24GiB/4GiB")
    reads = {"n": 0}

    def refresh(devs):  # the driver frees the 10 GiB on the third read
        reads["n"] += 1
        free = 4 * GiB + (10 * GiB if reads["n"] >= 3 else 0)
        return [dataclasses.replace(d, free=free) if d.id != "cpu" else d for d in devs]

    ok = await wait_for_recovery(
        refresh, devices, {"cuda:0": 4 * GiB}, {"cuda:0": 10 * GiB}, timeout=5, interval=0.01
    )
    assert ok and reads["n"] == 3


async def test_gives_up_after_the_timeout() -> None:
    devices = fake_devices("cpu=16GiB,cuda=24GiB/4GiB")
    ok = await wait_for_recovery(
        lambda d: d, devices, {"cuda:0": 4 * GiB}, {"cuda:0": 10 * GiB}, timeout=0.05, interval=0.01
    )
    assert not ok


async def test_cpu_only_runners_do_not_wait() -> None:
    devices = fake_devices("cpu=16GiB")
    ok = await wait_for_recovery(lambda d: d, devices, {}, {"cpu": 10 * GiB}, timeout=5)
    assert ok
