"""Atomic file replacement: the old content or the new, never half, never a wider mode.

A sibling temp file is created with the final mode, written, fsynced and renamed over the
target, then the directory is fsynced: without those fsyncs a crash can leave an empty file
under the new name. Used for secrets, launch specs and pidfiles.
"""

from __future__ import annotations

import os
from pathlib import Path


def write_atomic(path: Path, data: bytes, *, mode: int = 0o640, dir_mode: int = 0o750) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=dir_mode)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)  # a leftover from a crash must not lend us its mode
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
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
