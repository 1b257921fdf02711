"""Measuring what a process really holds."""

from __future__ import annotations

import os
import subprocess
import sys

from corral.runtime.memwatch import process_memory


def test_a_process_that_allocates_measures_more() -> None:
    code = (
        "import time; b = bytearray(64 << 20); b[::4096] = b'x' * len(b[::4096]); "
        "print('ok', flush=True); time.sleep(30)"
    )
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == b"ok"
        big = process_memory(p.pid)
        me = process_memory(os.getpid())
        assert big is not None and me is not None
        assert big >= 64 << 20  # the touched 64 MiB are counted
    finally:
        p.kill()
        p.wait()
    assert process_memory(p.pid) is None  # gone
