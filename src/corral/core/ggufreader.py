"""Parsing a GGUF file's header, metadata and tensor table, with errors a user can act on.

Parsing goes through llama.cpp's own `gguf` package (GGUFReader memory-maps the file), with two
changes made in a subclass: long arrays (the tokenizer's tokens, merges, scores) are skipped
instead of getting one numpy view per element, which takes SmolLM2-135M from ~2.4 s to ~25 ms;
and every read past the end of the file becomes a GGUFError that says where the file ends.
`core/gguf.py` turns what this reads into a model's, projector's or adapter's description.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFEndian, GGUFValueType
from gguf.gguf_reader import READER_SUPPORTED_VERSIONS, GGUFReader, ReaderField

__all__ = ["GGUFError", "Reader", "array_value", "metadata", "open_reader", "scalar_value",
           "string_array"]  # fmt: skip

_MAGIC = b"GGUF"
_HEADER_SIZE = 24  # magic, version (u32), tensor count (u64), metadata count (u64)
# Arrays longer than this are skipped, not parsed: only the tokenizer's arrays get that long,
# and nothing here needs their contents. Their lengths are kept in ModelInfo.array_lengths.
_MAX_ARRAY = 1024


class GGUFError(Exception):
    """The file is not a usable GGUF model. The message is meant for users."""


class _OutOfBounds(Exception):
    """A read would go past the end of the file; `end` is the byte it needed."""

    def __init__(self, end: int) -> None:
        super().__init__(f"needs byte {end}")
        self.end = end


# Exceptions that GGUFReader (numpy, struct, enum lookups, utf-8) raises on malformed input.
_PARSE_ERRORS = (
    _OutOfBounds,
    ValueError,
    KeyError,
    IndexError,
    TypeError,
    OverflowError,
    struct.error,
)


def _describe(e: BaseException) -> str:
    # KeyError's str() is the repr of its argument; show the message itself.
    return str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)


class Reader(GGUFReader):
    """GGUFReader with bounds checks and lazy long arrays (see the module docstring). It
    overrides GGUFReader internals; tests/test_gguf.py checks them against the installed
    gguf."""

    def _get(
        self,
        offset: int,
        dtype: npt.DTypeLike,
        count: int = 1,
        override_order: Literal["I", "S", "<"] | None = None,
    ) -> npt.NDArray[Any]:
        # numpy would silently return a short (or empty) view here; make that an error.
        end = int(offset) + np.dtype(dtype).itemsize * int(count)
        if end > len(self.data):
            raise _OutOfBounds(end)
        return super()._get(offset, dtype, count, override_order)

    def _get_field_parts(
        self, orig_offs: int, raw_type: int
    ) -> tuple[int, list[npt.NDArray[Any]], list[int], list[GGUFValueType]]:
        if raw_type != GGUFValueType.ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        alen = self._get(orig_offs + 4, np.uint64)
        if int(alen[0]) <= _MAX_ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        itype = GGUFValueType(int(raw_itype[0]))
        end = self._skip_array(orig_offs + 12, itype, int(alen[0]))
        # No element parts: ReaderField.contents() gives [], the length stays in parts[1].
        return end - orig_offs, [raw_itype, alen], [], [GGUFValueType.ARRAY, itype]

    def _skip_array(self, offs: int, itype: GGUFValueType, count: int) -> int:
        if itype == GGUFValueType.STRING:
            # Strings are length-prefixed, so they must be walked; struct is ~100x faster
            # than a numpy view per string.
            unpack = struct.Struct("<Q" if self.endianess == GGUFEndian.LITTLE else ">Q")
            with self.data.data as buf:
                try:
                    for _ in range(count):
                        offs += 8 + unpack.unpack_from(buf, offs)[0]
                except (struct.error, OverflowError):  # past the end, or a bogus length
                    raise _OutOfBounds(offs + 8) from None
        elif itype == GGUFValueType.ARRAY:  # arrays of arrays: nothing uses them, walk them
            for _ in range(count):
                offs += self._get_field_parts(offs, itype)[0]
        else:
            scalar = self.gguf_scalar_to_np.get(itype)
            if scalar is None:
                raise ValueError(f"unhandled array element type {itype.name}")
            offs += np.dtype(scalar).itemsize * count
        if offs > len(self.data):
            raise _OutOfBounds(offs)
        return offs

    def _build_fields(self, offs: int, count: int) -> int:
        try:
            return super()._build_fields(offs, count)
        except _PARSE_ERRORS as e:
            n_read = len(self.fields) - 3  # less GGUF.version, GGUF.tensor_count, GGUF.kv_count
            after = f", after {next(reversed(self.fields))!r}" if n_read > 0 else ""
            where = f"{n_read} of {int(count)} metadata keys read{after}"
            if isinstance(e, _OutOfBounds):
                raise GGUFError(
                    f"file is truncated: the metadata ends early ({where}); it needs byte "
                    f"{e.end} but the file has {len(self.data)} bytes"
                ) from None
            raise GGUFError(f"bad metadata ({where}): {_describe(e)}") from e

    def _build_tensor_info(self, offs: int, count: int) -> tuple[int, list[ReaderField]]:
        try:
            return super()._build_tensor_info(offs, count)
        except _PARSE_ERRORS as e:
            if isinstance(e, _OutOfBounds):
                raise GGUFError(
                    f"file is truncated: the table of {int(count)} tensors ends early; it needs "
                    f"byte {e.end} but the file has {len(self.data)} bytes"
                ) from None
            raise GGUFError(f"bad tensor table: {_describe(e)}") from e

    def _build_tensors(self, start_offs: int, fields: list[ReaderField]) -> None:
        # Check every tensor's type and extent first, so that a truncated download is reported
        # by tensor name instead of as a numpy reshape error.
        size = len(self.data)
        overruns: list[tuple[int, str]] = []
        for f in fields:
            _, name_data, _, dims, raw_dtype, offset = f.parts
            name = bytes(name_data).decode("utf-8", errors="replace")
            raw = int(raw_dtype[0])
            try:
                qtype = GGMLQuantizationType(raw)
                block_size, type_size = GGML_QUANT_SIZES[qtype]
            except (ValueError, KeyError):
                raise GGUFError(
                    f"tensor {name!r} has unknown type {raw} (the file may need a newer "
                    "llama.cpp and gguf package)"
                ) from None
            n_elements = math.prod(int(d) for d in dims)
            end = int(start_offs) + int(offset[0]) + n_elements * type_size // block_size
            if end > size:
                overruns.append((end, name))
        if overruns:
            end, name = min(overruns)
            raise GGUFError(
                f"file is truncated: tensor {name!r} ends at byte {end} but the file has "
                f"{size} bytes (incomplete download?)"
            )
        try:
            super()._build_tensors(start_offs, fields)
        except _PARSE_ERRORS as e:
            raise GGUFError(f"bad tensor: {_describe(e)}") from e


def _check_header(head: bytes, size: int) -> None:
    """Reject what is plainly not a GGUF file, naming what it looks like instead."""
    if head[:4] != _MAGIC:
        if len(head) < 4 and _MAGIC.startswith(head):
            raise GGUFError(f"file is truncated: only {size} bytes")
        raise GGUFError(f"not a GGUF file (bad magic {head[:4]!r}{_looks_like(head)})")
    if size < _HEADER_SIZE:
        raise GGUFError(
            f"file is truncated: {size} bytes is too short for a GGUF header ({_HEADER_SIZE} bytes)"
        )
    version = int.from_bytes(head[4:8], "little")
    if version & 0xFFFF == 0:  # written on a big-endian machine
        version = int.from_bytes(head[4:8], "big")
    if version not in READER_SUPPORTED_VERSIONS:
        supported = ", ".join(str(v) for v in READER_SUPPORTED_VERSIONS)
        raise GGUFError(
            f"unsupported GGUF version {version} (supported: {supported}); re-convert the model "
            "with a current llama.cpp"
        )


def _looks_like(head: bytes) -> str:
    if head.startswith(b"version https://git-lfs"):
        return "; it is a Git LFS pointer, not the model itself"
    if head[:4] in (b"lmgg", b"fmgg", b"tjgg"):  # "ggml", "ggmf", "ggjt" as little-endian u32
        return "; it is a legacy GGML/GGJT model, convert it to GGUF"
    if head[8:9] == b"{":
        return "; it looks like a safetensors file, convert it to GGUF"
    text = head.strip()
    if text and all(32 <= c < 127 or c in b"\t\r\n" for c in text):
        return "; it looks like a text file, e.g. an error page saved in place of the model"
    return ""


def open_reader(path: Path, size: int) -> Reader:
    """The file's parsed header, metadata and tensor table; GGUFError if it is not GGUF."""
    if size == 0:
        raise GGUFError("file is empty (0 bytes)")
    with path.open("rb") as f:
        head = f.read(_HEADER_SIZE)
    _check_header(head, size)
    try:
        return Reader(path)
    except _OutOfBounds as e:
        raise GGUFError(
            f"file is truncated: it needs byte {e.end} but the file has {size} bytes"
        ) from None
    except _PARSE_ERRORS as e:
        raise GGUFError(f"invalid GGUF file: {_describe(e)}") from e


def string_array(reader: Reader, key: str) -> tuple[bytes, ...] | None:
    """The metadata array `key` of strings, each as its bytes (None if absent or not strings),
    walked with struct as `Reader._skip_array` walks it: a numpy view per string would take
    seconds for a tokenizer's 150,000 tokens."""
    fld = reader.fields.get(key)
    if fld is None or fld.types[:2] != [GGUFValueType.ARRAY, GGUFValueType.STRING]:
        return None
    count = int(fld.parts[4][0])  # parts: key length, key, type, item type, count, ...
    offs = int(fld.offset) + 8 + len(fld.name.encode()) + 4 + 4 + 8
    unpack = struct.Struct("<Q" if reader.endianess == GGUFEndian.LITTLE else ">Q").unpack_from
    out = []
    with reader.data.data as buf:
        try:
            for _ in range(count):
                (n,) = unpack(buf, offs)
                out.append(bytes(buf[offs + 8 : offs + 8 + n]))
                offs += 8 + n
        except (struct.error, OverflowError):
            raise GGUFError(f"file is truncated: the metadata array {key} ends early") from None
    return tuple(out)


def _decode(part: npt.NDArray[Any]) -> str:
    # Lenient: one bad byte in, say, a chat template should not make the model unusable.
    return bytes(part).decode("utf-8", errors="replace")


def _f32(x: Any) -> float:
    # 1e-05 rather than 9.999999747378752e-06: the shortest text that reads back as the
    # same float32, as Ollama's JSON shows it.
    return float(str(np.float32(x)))


def scalar_value(fld: ReaderField) -> Any:
    vtype = fld.types[0]
    if vtype == GGUFValueType.STRING:
        return _decode(fld.parts[-1])
    if vtype == GGUFValueType.FLOAT32:
        return _f32(fld.parts[-1][0])
    return fld.parts[-1].tolist()[0]


def array_value(fld: ReaderField) -> tuple[Any, ...]:
    item_type = fld.types[-1]
    if item_type == GGUFValueType.STRING:
        return tuple(_decode(fld.parts[i]) for i in fld.data)
    values = [v for i in fld.data for v in fld.parts[i].tolist()]
    if item_type == GGUFValueType.FLOAT32:
        return tuple(_f32(v) for v in values)
    return tuple(values)


def metadata(fields: Iterable[tuple[str, ReaderField]]) -> tuple[dict[str, Any], dict[str, int]]:
    """The file's metadata (scalars, and arrays short enough to have been parsed, as tuples),
    and the length of every array-valued key, parsed or not."""
    meta: dict[str, Any] = {}
    array_lengths: dict[str, int] = {}
    for key, fld in fields:
        if key.startswith("GGUF."):  # the reader's pseudo-keys for the header
            continue
        if fld.types[0] == GGUFValueType.ARRAY:
            array_lengths[key] = int(fld.parts[4][0])  # parts: key len, key, type, item type, len
            if fld.data or array_lengths[key] == 0:
                meta[key] = array_value(fld)
        else:
            meta[key] = scalar_value(fld)
    return meta, array_lengths
