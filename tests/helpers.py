"""Test-only helpers, kept out of the product: fake device sets (what the placement and
scheduler tests run on instead of this machine's devices), the scheduler's answers to the
admission where a test has none, the allocation in a whole runner log, a runner held still
before its load, a saved slot's file. Imported from the tests directory (`from helpers
import ...`)."""

from __future__ import annotations

import contextlib
import os
import re
import struct
from array import array
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from corral.core.devices import CPU, Device
from corral.core.memreport import Allocation, AllocationParser
from corral.core.units import ConfigError, parse_size
from corral.runtime.slotfile import MAGIC


class NothingLearned:
    """What the admission asks the scheduler, where a test gives it none: no GPU context
    measured yet, and auto's drafting as `drafter` (off: the sizes of runners that draft are
    tests/test_speculative's)."""

    def __init__(self, drafter: str = "off") -> None:
        self._drafter = drafter

    def gpu_contexts(self) -> dict[str, int]:
        return {}

    def drafter(self, model: str) -> str:
        return self._drafter


LIBRARIES = ("cpu", "cuda", "rocm")
_FAKE_ENTRY = re.compile(r"^\s*(cpu|cuda|rocm)\s*=\s*([^/]+?)\s*(?:/\s*(.+?)\s*)?$", re.I)


def fake_devices(spec: str) -> list[Device]:
    """Devices from "cpu=24GiB,cuda=24GiB,cuda=8GiB/6GiB": one entry per device,
    `library=total[/free]` (free defaults to total), GPUs numbered per library in the order
    given. The CPU entry is required (exactly one). Fakes have no uuid, so refresh()
    leaves them as they are. ConfigError for anything else."""
    out: list[Device] = []
    counts = dict.fromkeys(LIBRARIES, 0)
    for entry in spec.split(","):
        m = _FAKE_ENTRY.match(entry)
        if not m:
            raise ConfigError(
                f"device spec: invalid entry {entry.strip()!r} (use e.g. 'cpu=24GiB,cuda=8GiB')"
            )
        lib = m.group(1).lower()
        total = parse_size(m.group(2), f"device spec {lib}")
        free = parse_size(m.group(3), f"device spec {lib}") if m.group(3) else total
        if free > total:
            raise ConfigError(f"device spec: {entry.strip()!r} has more free than total memory")
        index = counts[lib]
        counts[lib] += 1
        if lib == "cpu":
            out.append(Device(CPU, "cpu", -1, "Fake CPU", total, free))
        else:
            name = f"Fake {'CUDA' if lib == 'cuda' else 'ROCm'} GPU {index}"
            out.append(Device(f"{lib}:{index}", lib, index, name, total, free))
    if counts["cpu"] != 1:
        raise ConfigError("device spec: needs exactly one 'cpu=SIZE' entry")
    out.sort(key=lambda d: (d.library != "cpu", d.library, d.index))
    return out


def parse_log(text: str) -> Allocation | None:
    """The allocation in a whole runner log."""
    p = AllocationParser()
    for line in text.splitlines():
        p.feed(line)
    return p.allocation


# A sitecustomize that holds a runner still before it loads: a runner child (python -m
# corral.runtime.runner_child) whose command line names CORRAL_TEST_HOLD's text stops itself
# with SIGSTOP as its interpreter starts. (sys.argv is not set yet when site runs: /proc is.)
_HOLD = """\
import os, signal
_hold = os.environ.get("CORRAL_TEST_HOLD")
if _hold:
    try:
        with open("/proc/self/cmdline", "rb") as _f:
            _cmd = _f.read()
    except OSError:
        _cmd = b""
    if b"corral.runtime.runner_child" in _cmd and _hold.encode() in _cmd:
        os.kill(os.getpid(), signal.SIGSTOP)
"""


def held_runner_env(directory: Path, text: str) -> dict[str, str]:
    """Environment for `corral serve` under which a runner whose command line holds `text`
    (e.g. its model's file name) stops itself before it loads, and stays so until it gets
    SIGCONT or SIGKILL: a load held still, whatever the machine's speed (Linux)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "sitecustomize.py").write_text(_HOLD)
    path = os.pathsep.join(p for p in (str(directory), os.environ.get("PYTHONPATH")) if p)
    return {"PYTHONPATH": path, "CORRAL_TEST_HOLD": text}


@contextlib.contextmanager
def live_dashboard(browser: Any, url: str) -> Iterator[Any]:
    """The dashboard of the server at `url` in a new page, its event stream live; no console
    error or failed request while it is used. `window.__sameDocument` is set, so a test can
    tell that the page was never reloaded."""
    pg = browser.new_page(viewport={"width": 1440, "height": 1000})
    problems: list[str] = []
    # (a refused request's status is logged by the browser; the page shows the error itself)
    pg.on("console", lambda m: m.type in ("error", "warning")
          and "the server responded with a status of 4" not in m.text
          and problems.append(m.text))  # fmt: skip
    pg.on("pageerror", lambda e: problems.append(str(e)))
    pg.goto(url + "/ui")
    pg.wait_for_selector("#conn[data-state='live']")
    pg.evaluate("window.__sameDocument = true")
    yield pg
    pg.close()
    assert problems == []


def write_slot(path: Path, tokens: list[int], state: bytes = b"\0" * 64, version: int = 4) -> Path:
    """A file as llama.cpp's slot save writes it (`version` 4: with its token block's header),
    holding `tokens`."""
    if version >= 4:
        block = array("i", [-1, 1, len(tokens), *tokens, 0])
    else:
        block = array("i", tokens)
    path.write_bytes(struct.pack("<III", MAGIC, version, len(block)) + block.tobytes() + state)
    return path
