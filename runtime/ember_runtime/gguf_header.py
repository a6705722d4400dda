"""The key/value header of a GGUF file, read in one streaming pass without the tensors.

`gguf.GGUFReader` parses every field into numpy objects, the tokenizer's too: for Gemma 3's
262,144-token vocabulary that took ~550 MB of anonymous memory for a moment, which got the
runtime container OOM-killed at a limit sized for the engine (the memory check runs before the
model loads), and would cost the operator the same for every model it sizes. This reader keeps
scalars and small numeric arrays (per-layer head counts), and only the length of long arrays
(the vocabulary), so it needs a few kilobytes whatever the model.

Format (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md): "GGUF", version (uint32),
tensor count and key/value count (uint64), then each key (uint64 length + UTF-8), a value type
(uint32) and the value; strings are a uint64 length + bytes, arrays an element type, a uint64
count and the elements. Little-endian; versions 2 and 3.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

_SCALARS = {  # GGUF value type -> struct format
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_STRING, _ARRAY = 8, 9
_SMALL_ARRAY = 1024  # numeric arrays up to this length are kept (per-layer values)
_MAX_STRING = 1 << 24  # a corrupt length must not make us allocate gigabytes


@dataclass(frozen=True)
class LongArray:
    """An array too long to keep (e.g. the vocabulary): its element type and length."""

    element_type: int
    length: int
    sha256: str | None = None  # of a string array's elements, each length-prefixed (on request)


Value = int | float | bool | str | list[int | float | bool] | LongArray


class GGUFHeaderError(ValueError):
    """Not a GGUF file this reader understands, or a truncated/corrupt header."""


def read_header(path: Path, *, digest_strings: bool = False) -> dict[str, Value]:
    """Every key of the header; values as described in the module docstring. With
    `digest_strings`, a long string array (the vocabulary's tokens) comes with the sha256 of
    its elements: two vocabularies compared in a few kilobytes of memory."""
    with path.open("rb", buffering=1 << 16) as f:
        if f.read(4) != b"GGUF":
            raise GGUFHeaderError(f"{path}: not a GGUF file")
        (version,) = _unpack(f, "<I")
        if version not in (2, 3):
            raise GGUFHeaderError(f"{path}: GGUF version {version} is not supported")
        _tensors, count = _unpack(f, "<QQ")
        return {_string(f): _value(f, _unpack(f, "<I")[0], digest_strings) for _ in range(count)}


def _unpack(f: BinaryIO, fmt: str) -> tuple[int, ...]:
    size = struct.calcsize(fmt)
    data = f.read(size)
    if len(data) != size:
        raise GGUFHeaderError("truncated GGUF header")
    return struct.unpack(fmt, data)


def _string(f: BinaryIO) -> str:
    (length,) = _unpack(f, "<Q")
    if length > _MAX_STRING:
        raise GGUFHeaderError(f"implausible GGUF string length {length}")
    data = f.read(length)
    if len(data) != length:
        raise GGUFHeaderError("truncated GGUF header")
    return data.decode("utf-8", "replace")


def _value(f: BinaryIO, kind: int, digest_strings: bool = False) -> Value:
    fmt = _SCALARS.get(kind)
    if fmt is not None:
        return _unpack(f, fmt)[0]
    if kind == _STRING:
        return _string(f)
    if kind != _ARRAY:
        raise GGUFHeaderError(f"unknown GGUF value type {kind}")
    element, length = _unpack(f, "<IQ")
    fmt = _SCALARS.get(element)
    if fmt is not None and length <= _SMALL_ARRAY:
        return list(struct.unpack(f"<{length}{fmt[1]}", f.read(struct.calcsize(fmt) * length)))
    if fmt is not None:
        f.seek(struct.calcsize(fmt) * length, 1)
    elif element == _STRING and digest_strings:
        digest = hashlib.sha256()
        for _ in range(length):
            (n,) = _unpack(f, "<Q")
            digest.update(struct.pack("<Q", n) + f.read(n))
        return LongArray(element, length, digest.hexdigest())
    elif element == _STRING:
        for _ in range(length):  # each element has its own length: skip them one by one
            (n,) = _unpack(f, "<Q")
            f.seek(n, 1)
    else:
        raise GGUFHeaderError(f"unsupported GGUF array element type {element}")
    return LongArray(element, length)
