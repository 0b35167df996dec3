"""What the engine emulator's pretend GPUs hold, for the fake NVML adapter. A test and demo
instrument (`appliance.testing.fake_sglang`); env `FAKE_SGLANG_GPU_STATE=/path/file.json`.

    {"updated": <unix time>, "emulator": "fake_sglang",
     "gpus": [{"index": i, "memory_used_bytes": N,
               "processes": [{"pid": <rank i's pid>, "used_bytes": N,
                              "name": "sglang::scheduler_TPi"}]}, ...]}

One GPU per tensor-parallel rank; rank i's child process is the one holding GPU i's memory.
Every write replaces the file atomically (temporary file in the same folder, then rename),
under an exclusive flock on the folder so the main process and the ranks never interleave.
The main process writes as the load goes (baseline, weights growing, pools, graphs) and empties
the `processes` lists when it exits; a rank that outlives an abruptly killed main process
removes its own entry as it dies, the way real GPU memory is freed when its holder exits.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def _write(path: Path, gpus: list[dict[str, Any]]) -> None:
    data = {"updated": time.time(), "emulator": "fake_sglang", "gpus": gpus}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1), encoding="utf-8")
    os.replace(tmp, path)


def process_name(rank: int) -> str:
    return f"sglang::scheduler_TP{rank}"


class GpuStateFile:
    """The main process's writer. A `None` path makes every call a no-op."""

    def __init__(self, path: Path | None) -> None:
        self.path = path

    def publish(self, used_by_rank: list[int], pids: list[int]) -> None:
        if self.path is None:
            return
        gpus = [
            {"index": rank, "memory_used_bytes": used,
             "processes": [{"pid": pid, "used_bytes": used, "name": process_name(rank)}]}
            for rank, (used, pid) in enumerate(zip(used_by_rank, pids, strict=True))
        ]
        with contextlib.suppress(OSError), _locked(self.path):
            _write(self.path, gpus)

    def clear(self, gpu_count: int) -> None:
        """Every GPU idle: what NVML shows once the engine's processes are gone."""
        if self.path is None:
            return
        gpus: list[dict[str, Any]] = [
            {"index": i, "memory_used_bytes": 0, "processes": []} for i in range(gpu_count)
        ]
        with contextlib.suppress(OSError), _locked(self.path):
            _write(self.path, gpus)


def release_pid(path: Path, pid: int) -> None:
    """A rank's last act when its main process is gone: drop its entry (and its memory)."""
    with contextlib.suppress(OSError, ValueError, TypeError, AttributeError), _locked(path):
        data = json.loads(path.read_text(encoding="utf-8"))
        gpus = data["gpus"]
        changed = False
        for gpu in gpus:
            kept = [p for p in gpu.get("processes", []) if p.get("pid") != pid]
            if len(kept) != len(gpu.get("processes", [])):
                gpu["processes"] = kept
                gpu["memory_used_bytes"] = sum(int(p.get("used_bytes", 0)) for p in kept)
                changed = True
        if changed:
            _write(path, gpus)
