"""The quarantine folder: where a damaged weight file goes, out of the engine's way.

A small module of its own so the jobs that move files there (full verification, adoption)
and the ones that clear it (a pull that proved the set again), and the checks that look in
it, share it without importing each other.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from pathlib import Path

QUARANTINE = ".quarantine"


def quarantine(target_dir: Path, path: str) -> Path | None:
    """Move a damaged file aside (`<model dir>/.quarantine/<path>`), out of the engine's way;
    None when there was nothing to move. Never deletes: an earlier quarantined copy of the
    same file is kept, and this one gets a numbered name beside it."""
    source = target_dir / path
    if not source.exists():
        return None
    destination = target_dir / QUARANTINE / path
    destination.parent.mkdir(parents=True, exist_ok=True)
    number = 1
    while os.path.lexists(destination):
        destination = target_dir / QUARANTINE / f"{path}.{number}"
        number += 1
    os.replace(source, destination)
    return destination


def quarantined(target_dir: Path, paths: Sequence[str]) -> list[str]:
    """The manifest paths with a copy in the model directory's quarantine (blocking)."""
    root = target_dir / QUARANTINE
    if not root.is_dir():
        return []
    return [p for p in paths if os.path.lexists(root / p)]


def remove_quarantine(target_dir: Path) -> None:
    shutil.rmtree(target_dir / QUARANTINE, ignore_errors=True)
