"""How much of a model file is in the OS page cache, and moving it in or out.

A reload costs what reading the file costs: 1-2 s from the page cache, tens of seconds from a
slow disk. `resident` asks the kernel (mincore over a read-only mapping of the file: no page is
read, ~1 ms per GB of file); `prefetch` starts reading a file in the background
(reading it in a thread) while a load waits for evicted runners to exit; `drop` asks the kernel
to forget a file's clean pages (POSIX_FADV_DONTNEED, no root needed), for benchmarks that need
a cold file. Linux only; elsewhere residency is unknown (None) and the others do nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap
import os
from collections.abc import Callable

from corral.core.gguf import split_parts

log = logging.getLogger(__name__)

PAGE = mmap.PAGESIZE
_CHUNK = 4 << 20  # bytes per read while prefetching
_libc: ctypes.CDLL | None = None


def _c() -> ctypes.CDLL | None:
    global _libc
    if _libc is None:
        name = ctypes.util.find_library("c")
        if name is None:
            return None
        _libc = ctypes.CDLL(name, use_errno=True)
        _libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
        _libc.mincore.restype = ctypes.c_int
        _libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                               ctypes.c_int, ctypes.c_long]  # fmt: skip
        _libc.mmap.restype = ctypes.c_void_p
        _libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        _libc.munmap.restype = ctypes.c_int
    return _libc


def resident(path: str) -> float | None:
    """The fraction (0..1) of the model file's pages in the page cache (of all its files, for
    a split model named by its first part); None if unknown."""
    parts = split_parts(path)
    if len(parts) == 1:
        return _resident(path)
    total = have = 0.0
    for p in parts:
        frac, size = _resident(str(p)), _size(str(p))
        if frac is None:
            return None
        total, have = total + size, have + frac * size
    return have / total if total else 1.0


def _size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


def _resident(path: str) -> float | None:
    libc = _c()
    if libc is None:
        return None
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return 1.0
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            return None
        try:
            pages = (size + PAGE - 1) // PAGE
            vec = ctypes.create_string_buffer(pages)
            if libc.mincore(addr, size, vec) != 0:
                return None
            # bit 0 of each byte: the page is resident
            data = vec.raw
            return (pages - data.count(b"\x00")) / pages if pages else 1.0
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)


def prefetch(
    path: str, limit: int | None = None, keep_going: Callable[[], bool] = lambda: True
) -> int:
    """Read (up to `limit` bytes of) the model file into the page cache (every part of a split
    one, in order), from the start, until done or `keep_going()` turns false (the load itself
    has started); the bytes read. Blocking: run it in a thread. (posix_fadvise WILLNEED alone
    was measured here to bring in only a few MiB of a 256 MB file, so the pages are really
    read.)"""
    done = 0
    for p in split_parts(path):
        left = None if limit is None else limit - done
        if left is not None and left <= 0:
            break
        done += _prefetch(str(p), left, keep_going)
    return done


def _prefetch(path: str, limit: int | None, keep_going: Callable[[], bool]) -> int:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return 0
    done = 0
    try:
        size = os.fstat(fd).st_size
        n = size if limit is None else max(0, min(size, limit))
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, n, os.POSIX_FADV_SEQUENTIAL)
        buf = bytearray(_CHUNK)
        view = memoryview(buf)
        while done < n and keep_going():
            got = os.readv(fd, [view[: min(_CHUNK, n - done)]])
            if got <= 0:
                break
            done += got
        return done
    except OSError as e:
        log.debug("prefetch of %s failed: %s", path, e)
        return done
    finally:
        os.close(fd)


def drop(path: str) -> bool:
    """Ask the kernel to drop the file's clean pages from the page cache."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        if not hasattr(os, "posix_fadvise"):
            return False
        os.fsync(fd)  # dirty pages (a file just written) stay until they are on disk
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
