"""How far a runner has got in loading its model, read from the kernel's view of its process.

llama.cpp reports its loading progress to a callback (`llama_model_params.progress_callback`),
but no runner lets corral see it: xllamacpp exposes no callback, and llama.cpp's server replaces
the callback with its own, which reports only when it runs as a child of llama.cpp's router
(a `cmd_child_to_router:state:` line). A Python callback patched into the runner cannot help
either: xllamacpp's `Server()` holds the GIL while another thread loads the model, so the
callback would wait for the GIL forever.

What loading a model is, though, is bringing its file into the runner's memory, and the kernel
counts that: the resident pages of the runner's mappings of the file (llama.cpp's default, mmap,
on CPU and while it copies weights to a GPU) and the bytes the runner has read (`use_mmap`
off: /proc/<pid>/io `rchar`). `loaded_bytes` reads both (Linux only); the runner turns them into
a fraction of the files' size while it waits for its child to be ready.
"""

from __future__ import annotations

import os
from collections.abc import Iterable


def loaded_bytes(pid: int, paths: Iterable[str]) -> int | None:
    """Bytes of `paths` the process `pid` holds in memory (resident pages of its mappings of
    them) or has read, whichever is more; None where /proc cannot say (not Linux, gone)."""
    wanted = {os.path.realpath(p) for p in paths}
    mapped = 0
    try:
        with open(f"/proc/{pid}/smaps", encoding="utf-8", errors="replace") as f:
            inside = False
            for line in f:
                head = line.split(" ", 1)[0]
                if "-" in head and not head.endswith(":"):  # a mapping's header line
                    fields = line.split(None, 5)
                    inside = len(fields) == 6 and fields[5].rstrip("\n") in wanted
                elif inside and line.startswith("Rss:"):
                    mapped += int(line.split()[1]) * 1024
        with open(f"/proc/{pid}/io", encoding="ascii") as f:
            read = next((int(ln.split()[1]) for ln in f if ln.startswith("rchar:")), 0)
    except (OSError, ValueError, IndexError):
        return None
    return max(mapped, read)


def file_bytes(paths: Iterable[str]) -> int:
    total = 0
    for p in paths:
        try:
            total += os.path.getsize(p)
        except OSError:
            pass
    return total
