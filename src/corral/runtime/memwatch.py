"""What runner processes really hold, for the books to follow the machine (Core.observed).

System memory is measured as the proportional set size (PSS: private pages plus a share of
pages mapped by several processes, such as the runners' common libraries and a model file two
runners map), which adds up across processes to what they cost the machine; RSS would count
every shared library once per runner. Reading /proc/PID/smaps_rollup costs ~0.1-1 ms.
"""

from __future__ import annotations

import contextlib

import psutil


def process_memory(pid: int) -> int | None:
    """PSS of a runner process and its children, in bytes; None if it is gone or unreadable.
    (Where the kernel reports no PSS, RSS, which errs high.)"""
    try:
        proc = psutil.Process(pid)
        procs = [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return None
    total = 0
    for p in procs:
        with contextlib.suppress(psutil.Error):
            info = p.memory_full_info()
            total += int(getattr(info, "pss", info.rss))
    return total or None
