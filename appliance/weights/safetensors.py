"""Structural check of one safetensors file, from its header alone.

A safetensors file is an 8-byte little-endian header length N, N bytes of UTF-8 JSON naming
every tensor's dtype, shape and byte range, then the tensor data. Reading the prefix and the
header (one small read each, ~100 KB for thousands of tensors) proves what can be proven
without reading the data: the header parses, every tensor's byte range fits its dtype and
shape, the ranges tile the data section with no gap or overlap, and the file ends exactly
where the last tensor does. That catches truncation, a zeroed prefix, a garbled header and a
preallocated-but-unwritten tail in milliseconds; flipped bits inside the data need the full
hash (hashing.py).

The rules are safetensors 0.8.0's parser's, so a file that passes here loads there.
`check_header` is pure; `check_shard` is the IO around it. Neither raises for a bad or
missing file: what is wrong comes back as sentences in `ShardHeader.problems`.
"""

from __future__ import annotations

import errno
import json
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

# Bits per element of every dtype safetensors 0.8.0 accepts (from its parser's error message).
# It rejects F8_E4M3FN, C128, F4_E2M1, U4 and I4, so they are unknown here too.
KNOWN_DTYPES: Mapping[str, int] = MappingProxyType({
    "BOOL": 8, "U8": 8, "I8": 8,
    "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8,
    "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
    "I32": 32, "U32": 32, "F32": 32,
    "C64": 64, "F64": 64, "I64": 64, "U64": 64,
    "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
})
MAX_HEADER = 100_000_000  # the safetensors crate's MAX_HEADER_SIZE
PREFIX_BYTES = 8
# A garbled header can be wrong about every one of thousands of tensors; a person needs the
# first few sentences and a count, not the whole list.
MAX_PROBLEMS = 8


@dataclass(frozen=True)
class ShardHeader:
    """What a shard's header says, and everything wrong with it.

    `tensors` holds the names the header declares (empty when the header could not be read);
    `data_bytes` is the end of the last tensor (the sum of tensor bytes when the ranges tile);
    `header_len` is N (0 when the prefix could not be read). The file is sound exactly when
    `problems` is empty.
    """

    tensors: frozenset[str]
    data_bytes: int
    header_len: int
    problems: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.problems


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def header_length(file_size: int, prefix: bytes) -> tuple[int, str | None]:
    """N from the 8-byte prefix, and the problem with it if any: N must be 1..MAX_HEADER and
    the header must fit in the file."""
    if len(prefix) < PREFIX_BYTES or file_size < PREFIX_BYTES:
        return 0, (f"the file is {_plural(file_size, 'byte')} long, shorter than the 8-byte "
                   "header length that starts every safetensors file")
    (n,) = struct.unpack("<Q", prefix[:PREFIX_BYTES])
    if not 0 < n <= MAX_HEADER:
        return n, (f"header length {n} is out of range (1 to {MAX_HEADER}): the first 8 "
                   "bytes are damaged")
    if PREFIX_BYTES + n > file_size:
        return n, (f"header length {n} runs past the end of the file ({file_size} bytes): "
                   "the file is truncated or its first 8 bytes are damaged")
    return n, None


def check_header(file_size: int, prefix: bytes, header: bytes) -> ShardHeader:
    """Validate a shard from its size, its 8-byte prefix and its header bytes (pure).

    Checks, in safetensors 0.8.0's terms: N is in range and 8 + N <= size; the header is a
    UTF-8 JSON object; `__metadata__`, if present, maps strings to strings; every tensor has
    a known dtype, a shape of non-negative ints and integer `data_offsets` [begin, end] whose
    length is numel * bits / 8 in whole bytes; sorted by begin, the ranges are contiguous from
    0; the last end is exactly size - 8 - N.
    """
    n, problem = header_length(file_size, prefix)
    if problem is not None:
        return ShardHeader(frozenset(), 0, 0, (problem,))
    if len(header) < n:
        return ShardHeader(frozenset(), 0, n, (
            f"the header should be {n} bytes but only {len(header)} could be read",))
    try:
        body = json.loads(header[:n].decode("utf-8"))
    except UnicodeDecodeError as exc:
        return ShardHeader(frozenset(), 0, n, (
            f"the header is not UTF-8 (byte {PREFIX_BYTES + exc.start} of the file)",))
    except ValueError as exc:
        return ShardHeader(frozenset(), 0, n, (f"the header is not valid JSON ({exc})",))
    if not isinstance(body, dict):
        return ShardHeader(frozenset(), 0, n, (
            f"the header is JSON but not an object (it is a {type(body).__name__})",))

    problems: list[str] = []
    metadata = body.pop("__metadata__", None)
    if metadata is not None and not (
            isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        problems.append("__metadata__ must be an object whose values are strings "
                        "(safetensors 0.8.0 rejects anything else)")

    ranges: list[tuple[int, int, str]] = []
    bits_of = dict(KNOWN_DTYPES)
    for name, entry in body.items():
        # Fast path for a sound entry (a K3 shard has thousands; 96 shards must take well
        # under a second): exact types, so bools are not ints; anything odd goes the slow way,
        # which says what is wrong.
        if type(entry) is dict:
            offsets, shape = entry.get("data_offsets"), entry.get("shape")
            dtype = entry.get("dtype")
            bits = bits_of.get(dtype, 0) if type(dtype) is str else 0
            if type(offsets) is list and len(offsets) == 2 and type(shape) is list and bits:
                begin, end = offsets
                numel = 1
                for dim in shape:
                    if type(dim) is not int or dim < 0:
                        numel = -1
                        break
                    numel *= dim
                if (type(begin) is int and type(end) is int and 0 <= begin <= end
                        and numel >= 0 and (end - begin) * 8 == numel * bits):
                    ranges.append((begin, end, name))
                    continue
        ranges.extend(_check_tensor(name, entry, problems))
    ranges.sort()
    cursor = 0
    for begin, end, name in ranges:
        if begin > cursor:
            problems.append(f"tensor {name}'s data offsets leave a gap at byte {cursor}")
        elif begin < cursor:
            problems.append(f"tensor {name}'s data offsets overlap the tensor before it "
                            f"at byte {begin}")
        if end > cursor:
            cursor = end

    buffer = file_size - PREFIX_BYTES - n
    if cursor > buffer:
        problems.append(f"the file is {_plural(cursor - buffer, 'byte')} shorter than its "
                        "tensors need (does not cover the data): it was truncated")
    elif cursor < buffer:
        problems.append(f"the file has {_plural(buffer - cursor, 'byte')} after its last "
                        "tensor (the data is not covered exactly)")
    if len(problems) > MAX_PROBLEMS:
        more = len(problems) - MAX_PROBLEMS + 1
        problems[MAX_PROBLEMS - 1:] = [f"... and {_plural(more, 'more problem')}"]
    return ShardHeader(frozenset(body), cursor, n, tuple(problems))


def _check_tensor(name: str, entry: object, problems: list[str]) -> list[tuple[int, int, str]]:
    """Append what is wrong with one header entry; return its byte range when it has one, so
    offsets are checked even for a tensor with a bad dtype or shape."""
    if not isinstance(entry, dict):
        problems.append(f"tensor {name}'s header entry is not an object")
        return []
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not (isinstance(offsets, list) and len(offsets) == 2
            and all(_is_int(o) and o >= 0 for o in offsets) and offsets[0] <= offsets[1]):
        problems.append(f"tensor {name}'s data_offsets {offsets!r} are not [begin, end] with "
                        "0 <= begin <= end")
        return []
    begin, end = offsets
    bits = KNOWN_DTYPES.get(dtype) if isinstance(dtype, str) else None
    if bits is None:
        problems.append(f"tensor {name} has unknown dtype {dtype!r}")
    if not (isinstance(shape, list) and all(_is_int(d) and d >= 0 for d in shape)):
        problems.append(f"tensor {name}'s shape {shape!r} is not a list of non-negative ints")
    elif bits is not None:
        numel = 1
        for dim in shape:
            numel *= dim
        if numel * bits % 8:
            problems.append(f"tensor {name} ({dtype} {shape}) is not a whole number of bytes")
        elif end - begin != numel * bits // 8:
            problems.append(f"tensor {name} ({dtype} {shape}) needs {numel * bits // 8} bytes "
                            f"but its data_offsets span {end - begin}")
    return [(begin, end, name)]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_shard(path: Path, expected_size: int | None = None) -> ShardHeader:
    """Check the safetensors file at `path`: one 8-byte read, one header read and one
    SEEK_HOLE probe. A missing or unreadable file, a size other than `expected_size` (when
    given) and a sparse hole are problems like any other, never exceptions.

    The hole probe finds regions that were never written (a preallocated or size-extended
    file). Filesystems without SEEK_HOLE skip it. A copy made with sparse detection
    (`cp --sparse=always`, `rsync -S`, ZFS compression) stores long runs of zero bytes as
    holes too; for such a file the full hash is the arbiter.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return ShardHeader(frozenset(), 0, 0, ("the file is missing",))
    except OSError as exc:
        return ShardHeader(frozenset(), 0, 0, (f"the file cannot be opened: {exc.strerror}",))
    try:
        size = os.fstat(fd).st_size
        prefix = os.pread(fd, PREFIX_BYTES, 0)
        n, problem = header_length(size, prefix)
        header = b"" if problem is not None else _pread_all(fd, n, PREFIX_BYTES)
        result = check_header(size, prefix, header)
        extra = []
        if expected_size is not None and size != expected_size:
            extra.append(f"the file is {size} bytes, not the expected {expected_size}")
        hole = _first_hole(fd, size)
        if hole is not None:
            extra.append(f"the file has a sparse hole at byte {hole} (a region that was "
                         "never written): the copy is incomplete")
    except OSError as exc:
        return ShardHeader(frozenset(), 0, 0, (f"the file cannot be read: {exc.strerror}",))
    finally:
        os.close(fd)
    if not extra:
        return result
    return ShardHeader(result.tensors, result.data_bytes, result.header_len,
                       (*extra, *result.problems))


def _pread_all(fd: int, length: int, offset: int) -> bytes:
    """`length` bytes at `offset`, fewer only at end of file (pread may return short)."""
    parts = []
    while length > 0:
        chunk = os.pread(fd, length, offset)
        if not chunk:
            break
        parts.append(chunk)
        length -= len(chunk)
        offset += len(chunk)
    return b"".join(parts)


def _first_hole(fd: int, size: int) -> int | None:
    """Offset of the first hole before end of file, or None (also when unsupported)."""
    if size == 0 or not hasattr(os, "SEEK_HOLE"):
        return None
    try:
        hole = os.lseek(fd, 0, os.SEEK_HOLE)
    except OSError as exc:
        # EINVAL: the filesystem has no SEEK_HOLE; ENXIO: nothing past offset 0. Both mean
        # there is nothing this probe can say.
        if exc.errno in (errno.EINVAL, errno.ENXIO, errno.EOPNOTSUPP):
            return None
        raise
    return hole if hole < size else None
