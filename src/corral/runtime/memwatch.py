"""What runner processes really hold, for the books to follow the machine (Core.observed).

A runner's system memory is read from /proc/PID/status (RssAnon, RssFile, RssShmem): kernel
counters, ~50 us whatever the model's size. (PSS from smaps_rollup walks every page the process
maps: 8 ms for SmolLM2, 20 ms per GB of weights, every measure, for every runner.) RSS counts
the code every runner maps (xllamacpp's library, libpython) in each of them, though it is in
memory once: the scheduler books that code once for all runners (Core.reserved) and takes each
runner's resident code (`code_rss`, measured once when it is ready) off its measure. What is
left, its own memory, is its heap, KV cache and buffers (anonymous) and the pages of its model
file it has touched.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import psutil


@dataclass(frozen=True)
class Usage:
    rss: int  # bytes of system memory the process tree has resident (shared code included)
    # ... of which anonymous (heap, KV cache, buffers): the part the kernel's "available" figure
    # does not count as free. Weights mapped from the file are page cache, counted there.
    anon: int
    pids: tuple[int, ...] = ()  # the processes measured (the runner and its children)


def process_usage(pid: int) -> Usage | None:
    """System memory of a runner process and its children; None if it is gone or unreadable."""
    try:
        proc = psutil.Process(pid)
        procs = [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return None
    rss = anon = 0
    pids = []
    for p in procs:
        fields = _status(p.pid)
        if fields is None:
            continue
        a = fields.get("RssAnon", 0) + fields.get("RssShmem", 0)
        rss += a + fields.get("RssFile", 0)
        anon += a
        pids.append(p.pid)
    return Usage(rss, anon, tuple(pids)) if rss else None


def _status(pid: int) -> dict[str, int] | None:
    """The resident-memory counters of /proc/PID/status (RssAnon, RssFile, RssShmem), in bytes."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            text = f.read().decode("ascii", "replace")
    except OSError:
        return None
    out = {}
    for line in text.splitlines():
        if line.startswith("Rss"):
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts and parts[0].isdigit():
                out[key] = int(parts[0]) * 1024  # kB
    return out


def code_rss(pid: int) -> int | None:
    """The resident pages of a process's executable and shared libraries, less those it wrote
    (relocations: its own): the code every runner maps alike, in memory once for all of them.
    Reads /proc/PID/smaps in full, which walks every page the process maps (~10 ms for SmolLM2,
    more for bigger models): once per runner, off the event loop. None if it is gone."""
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
        elif code and key == b"Rss:":
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
