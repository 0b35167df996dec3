"""Free and total space of the volume a path lives on (blocking: call it from a thread).

One reader for the engine's preflight, the weights pull's disk check, the health monitor's
host checks and the dashboard, so they never disagree about a disk.
"""

from __future__ import annotations

from pathlib import Path

import psutil


def nearest_existing(path: Path) -> Path:
    """`path`, or its nearest existing parent (the volume a folder to be created will be on)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def disk_space(path: Path, *, nearest_parent: bool = True) -> tuple[int, int] | None:
    """(free, total) bytes of the volume holding `path`; None when it cannot be read. A
    directory that does not exist yet is measured on its nearest existing parent, the volume
    it will live on, unless `nearest_parent` is False (a mount point such as /dev/shm, whose
    parent is the wrong volume): then anything but a directory is None."""
    try:
        if nearest_parent:
            path = nearest_existing(path)
        elif not path.is_dir():
            return None
        usage = psutil.disk_usage(str(path))
    except OSError:
        return None
    return usage.free, usage.total
