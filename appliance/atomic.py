"""Atomic file replacement: the old content or the new, never half, never a wider mode.

A sibling temp file is created with the final mode, written, fsynced and renamed over the
target, then the directory is fsynced: without those fsyncs a crash can leave an empty file
under the new name. Used for secrets, launch specs and pidfiles.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO


def write_atomic(path: Path, data: bytes, *, mode: int = 0o640, dir_mode: int = 0o750) -> None:
    with atomic_writer(path, mode=mode, dir_mode=dir_mode) as handle:
        handle.write(data)


@contextlib.contextmanager
def atomic_writer(path: Path, *, mode: int = 0o640,
                  dir_mode: int = 0o750) -> Iterator[BinaryIO]:
    """A binary handle on the sibling temp file; on a clean exit it is fsynced and renamed
    over `path` (then the directory fsynced), on an error removed: for content written in a
    stream (a backup archive) rather than held as bytes."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=dir_mode)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)  # a leftover from a crash must not lend us its mode
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
