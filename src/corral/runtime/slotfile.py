"""llama.cpp's slot files: which tokens a saved sequence state holds.

A file is llama.cpp's `llama_state_seq_save_file` output: u32 magic 'ggsq', u32 version, u32
count, that many i32 (up to version 3 the token ids; in version 4, this build's, a token block
-1, 1, n, the n ids, 0), then the sequence's KV state. The header tells corral which tokens a
file holds, so nothing is kept beside it (runtime/kvcache names each file by a digest of them).
"""

from __future__ import annotations

import hashlib
import os
import struct
from array import array
from collections.abc import Sequence
from pathlib import Path

MAGIC = 0x67677371  # LLAMA_STATE_SEQ_MAGIC ('ggsq')
HEADER = struct.Struct("<III")  # magic, version, token count


class CorruptEntry(ValueError):
    """A cache file that is not what its name says."""


def read_tokens(path: Path) -> array[int]:
    """The token ids a slot file holds (its header); CorruptEntry if it is not one."""
    with open(path, "rb") as f:
        head = f.read(HEADER.size)
        if len(head) < HEADER.size:
            raise CorruptEntry("shorter than its header")
        magic, version, n = HEADER.unpack(head)
        if magic != MAGIC:
            raise CorruptEntry(f"not a llama.cpp sequence state (magic {magic:#010x})")
        size = os.fstat(f.fileno()).st_size
        if HEADER.size + 4 * n > size:
            raise CorruptEntry(f"says {n} tokens but holds {size} bytes")
        words = array("i")
        words.frombytes(f.read(4 * n))
    if words.itemsize != 4:  # pragma: no cover - every platform corral runs on
        raise CorruptEntry("no 32-bit int array on this platform")
    if version < 4:
        return words  # versions 1-3: the token ids themselves
    return _block_tokens(words)


def _block_tokens(words: array[int]) -> array[int]:
    """The token ids of a version-4 file's token block (llama.cpp's batch_ext tokens, as the
    files of this build lay them out: -1, 1, n, n ids, 0). Another layout (several runs, the
    per-token state embeddings of MTP models) is refused rather than guessed."""
    if len(words) >= 4 and words[0] == -1 and words[1] == 1:
        n = words[2]
        if 0 <= n and len(words) == n + 4 and words[n + 3] == 0:
            return words[3 : 3 + n]
    head = ", ".join(map(str, words[:4]))
    raise CorruptEntry(f"a token block this corral does not know ({head}, ...)")


def token_digest(tokens: Sequence[int]) -> str:
    return hashlib.sha256(array("i", tokens).tobytes()).hexdigest()[:24]


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    # Compare in blocks first: conversations share thousands of tokens.
    step = 256
    while i + step <= n and a[i : i + step] == b[i : i + step]:
        i += step
    while i < n and a[i] == b[i]:
        i += 1
    return i
