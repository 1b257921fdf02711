"""`corral serve` with a profile hook that records, per asyncio task, which of corral's modules
run a function (tests/test_warm_path.py). SIGUSR2 writes what was recorded, as JSON, to
$CORRAL_TRACE_OUT: one entry per task, in the order the tasks first entered corral."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from types import FrameType
from typing import Any

# by the task itself (held here, so that no later task takes an ended one's id)
seen: dict[asyncio.Task[Any], tuple[str, set[str]]] = {}


def record(frame: FrameType, event: str, arg: Any) -> None:
    if event != "call":
        return
    module = frame.f_globals.get("__name__", "")
    if not module.startswith("corral."):
        return
    try:
        task = asyncio.current_task()
    except RuntimeError:  # not in the event loop's thread
        return
    if task is not None:
        coro = task.get_coro()
        seen.setdefault(task, (getattr(coro, "__qualname__", ""), set()))[1].add(module)


def dump(*_: object) -> None:
    out = [{"task": name, "modules": sorted(mods)} for name, mods in seen.values()]
    path = os.environ["CORRAL_TRACE_OUT"]
    with open(path + ".tmp", "w") as f:
        json.dump(out, f)
    os.replace(path + ".tmp", path)


signal.signal(signal.SIGUSR2, dump)
sys.setprofile(record)

from corral.cli import main  # noqa: E402  (after the hook, so that nothing runs unseen)

sys.argv = ["corral", "serve"]
main()
