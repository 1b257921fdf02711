"""What runner processes really hold, for the books to follow the machine (Core.observed).

System memory is measured as the proportional set size (PSS: private pages plus a share of
pages mapped by several processes, such as the runners' common libraries and a model file two
runners map), which adds up across processes to what they cost the machine; RSS would count
every shared library once per runner. Reading /proc/PID/smaps_rollup costs ~0.1-1 ms.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import psutil


@dataclass(frozen=True)
class Usage:
    pss: int  # bytes of system memory the process tree costs the machine
    # ... of which anonymous (heap, KV cache, buffers): the part the kernel's "available" figure
    # does not count as free. Weights mapped from the file are page cache, counted there.
    anon: int
    pids: tuple[int, ...] = ()  # the processes measured (the runner and its children)


def process_usage(pid: int) -> Usage | None:
    """System memory of a runner process and its children; None if it is gone or unreadable.
    (Where the kernel reports no PSS, RSS, which errs high.)"""
    try:
        proc = psutil.Process(pid)
        procs = [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return None
    pss = anon = 0
    pids = []
    for p in procs:
        fields = _smaps_rollup(p.pid)
        if fields is not None and "Pss" in fields:
            pss += fields["Pss"]
            anon += fields.get("Pss_Anon", fields.get("Anonymous", fields["Pss"]))
            pids.append(p.pid)
            continue
        with contextlib.suppress(psutil.Error):
            rss = int(p.memory_info().rss)
            pss, anon = pss + rss, anon + rss
            pids.append(p.pid)
    return Usage(pss, anon, tuple(pids)) if pss else None


def process_memory(pid: int) -> int | None:
    """PSS of a runner process and its children, in bytes; None if it is gone."""
    u = process_usage(pid)
    return None if u is None else u.pss


def _smaps_rollup(pid: int) -> dict[str, int] | None:
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            text = f.read().decode("ascii", "replace")
    except OSError:
        return None
    out = {}
    for line in text.splitlines()[1:]:
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            out[key] = int(parts[0]) * 1024  # kB
    return out


def code_pss(pid: int) -> int | None:
    """The part of a process's PSS that is shared code: the pages of its executable and of the
    shared libraries it maps, less those it wrote (relocations: private to it). Every runner
    maps the same code, so this is each runner's equal share of code resident once for all of
    them. Reads /proc/PID/smaps in full (~3 ms: one process per measure, not every one); None
    if the process is gone."""
    try:
        exe = os.readlink(f"/proc/{pid}/exe").encode()
        with open(f"/proc/{pid}/smaps", "rb") as f:
            text = f.read()
    except OSError:
        return None
    total = 0
    code = False
    for line in text.splitlines():
        key, _, rest = line.partition(b" ")
        if not key.endswith(b":"):  # a mapping's header: address perms offset dev inode path
            path = rest.rsplit(b" ", 1)[-1] if rest.count(b" ") >= 4 else b""
            code = path == exe or path.endswith(b".so") or b".so." in path
        elif code and key == b"Pss:":
            total += int(rest.split()[0])
        elif code and key == b"Private_Dirty:":
            total -= int(rest.split()[0])
    return max(0, total) * 1024


def oom_kills(vmstat: str = "/proc/vmstat") -> int | None:
    """How many processes the kernel's OOM killer has killed since boot (every OOM kill, a
    cgroup's included; Linux 4.13+); None where it cannot be read. A runner that died of
    SIGKILL while this did not move was killed by someone, not for memory."""
    try:
        with open(vmstat) as f:
            for line in f:
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None
