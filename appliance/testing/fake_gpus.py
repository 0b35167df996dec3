"""Fake GPUs: a test and demo instrument, never used in production (which reads NVML).

`FakeGpus` is a real `GpuPort` built from data: by default the box this appliance is made for,
eight idle "NVIDIA B300 SXM6 AC". Knobs change what the next `snapshot()` reports, the way the
real thing goes wrong: a GPU lost or gone, a foreign compute process, memory in use, NVML
unavailable, NVML hanging. Knobs may be turned from any thread.

With `state_file=`, it follows the engine emulator (`appliance.testing.fake_sglang`), which
writes what its pretend GPUs hold as it loads and serves:

    {"updated": 1764500000.0,
     "gpus": [{"index": 0, "memory_used_bytes": 210000000000,
               "processes": [{"pid": 4242, "used_bytes": 210000000000, "name": "sglang"}]}]}

Listed GPUs report those figures; a listed process that has exited is dropped and, as on real
GPUs, its memory is freed (a GPU whose listed processes are all gone reads idle). A missing or
malformed file (not JSON, wrong shape, wrong types) means idle GPUs. The writer should replace
the file atomically (temporary file, then rename) so a reader never sees half of it.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeGuard

import psutil

from appliance.gpu.nvml import DRIVER_NOT_LOADED, GPU_IS_LOST
from appliance.gpu.port import GpuInfo, GpuProcess, GpuSnapshot

MIB = 1 << 20
B300_NAME = "NVIDIA B300 SXM6 AC"
# Sold as 288 GB (8 stacks of 36 GiB HBM3e); NVML reports less because the driver reserves
# part of it. 275,040 MiB (268.6 GiB) is the share NVML keeps on a B200 (183,359 of
# 196,608 MiB) applied to 294,912 MiB, and fits the reference K3 startup log ("avail
# mem=266.93 GB" after a 1.12 GB baseline). Replace it with a reading from the box.
B300_MEMORY_BYTES = 275_040 * MIB
FAKE_DRIVER_VERSION = "580.95.05"
FAKE_CUDA_VERSION = "13.0"

@dataclass
class _Gpu:
    uuid: str
    name: str
    total: int
    used: int = 0  # without the processes added by knobs
    processes: list[GpuProcess] = field(default_factory=list)
    lost: bool = False


class FakeGpus:
    """A `GpuPort` for tests and the demo. `count` GPUs named `name` with `memory_total_bytes`
    each, idle until a knob or the emulator's state file says otherwise."""

    def __init__(
        self,
        count: int = 8,
        *,
        name: str = B300_NAME,
        memory_total_bytes: int = B300_MEMORY_BYTES,
        driver_version: str = FAKE_DRIVER_VERSION,
        cuda_version: str = FAKE_CUDA_VERSION,
        state_file: Path | None = None,
    ) -> None:
        self._lock = threading.Lock()
        self._gpus = [
            _Gpu(uuid=f"GPU-fa4e0000-b300-4000-8000-{i:012x}", name=name,
                 total=memory_total_bytes)
            for i in range(count)
        ]
        self._versions = (driver_version, cuda_version)
        self._failure: tuple[str, str] | None = None
        self._hang_s: float | None = None
        self._hanging = False
        self._release = threading.Event()
        self.state_file = state_file

    # -- knobs -------------------------------------------------------------------------------

    def lose_gpu(self, index: int) -> None:
        """The GPU falls off the bus (Xid 79): still enumerated, every query about it fails."""
        with self._lock:
            self._gpus[index].lost = True

    def remove_gpu(self, index: int) -> None:
        """The driver no longer enumerates the GPU (a dead GPU after a reboot); the ones after
        it move down one index, as NVML's do."""
        with self._lock:
            del self._gpus[index]

    def add_process(self, index: int, pid: int, used_bytes: int, name: str = "") -> None:
        """A compute process appears on GPU `index`, holding `used_bytes` more memory."""
        with self._lock:
            self._gpus[index].processes.append(GpuProcess(pid, used_bytes, name))

    def remove_process(self, pid: int) -> None:
        """The process exits: gone from every GPU, its memory freed."""
        with self._lock:
            for gpu in self._gpus:
                gpu.processes = [p for p in gpu.processes if p.pid != pid]

    def set_memory_used(self, index: int, used_bytes: int) -> None:
        """Memory in use on GPU `index`, not counting processes added with `add_process`."""
        with self._lock:
            self._gpus[index].used = used_bytes

    def fail(self, error: str = DRIVER_NOT_LOADED[0], hint: str = DRIVER_NOT_LOADED[1]) -> None:
        """NVML becomes unusable (by default: the driver is not loaded)."""
        with self._lock:
            self._failure = (error, hint)

    def recover(self) -> None:
        """NVML works again (undoes `fail`)."""
        with self._lock:
            self._failure = None

    def hang(self, seconds: float | None = None) -> None:
        """Every `snapshot()` blocks for `seconds` (None: until `unhang()`), as NVML does on a
        sick GPU, then answers."""
        with self._lock:
            self._hang_s = seconds
            self._hanging = True
            self._release.clear()

    def unhang(self) -> None:
        """Release every blocked `snapshot()` and stop blocking."""
        with self._lock:
            self._hanging = False
            self._release.set()

    # -- the port ----------------------------------------------------------------------------

    def snapshot(self) -> GpuSnapshot:
        with self._lock:
            hanging, hang_s = self._hanging, self._hang_s
        if hanging:
            self._release.wait(hang_s)
        with self._lock:
            failure = self._failure
            gpus = [(g.uuid, g.name, g.total, g.used, tuple(g.processes), g.lost)
                    for g in self._gpus]
        if failure is not None:
            return GpuSnapshot.unavailable(*failure)
        followed = self._follow() if self.state_file is not None else {}
        infos = []
        for index, (uuid, name, total, used, extra, lost) in enumerate(gpus):
            if lost:
                error, hint = GPU_IS_LOST
                infos.append(GpuInfo(index=index, uuid="", name="", memory_total_bytes=0,
                                     memory_used_bytes=0, error=error, hint=hint))
                continue
            base_used, base_processes = followed.get(index, (used, ()))
            processes = base_processes + extra
            in_use = min(total, base_used + sum(p.used_bytes for p in extra))
            infos.append(GpuInfo(index=index, uuid=uuid, name=name, memory_total_bytes=total,
                                 memory_used_bytes=in_use, processes=processes))
        driver, cuda = self._versions
        return GpuSnapshot(driver_version=driver, cuda_version=cuda, gpus=tuple(infos))

    def _follow(self) -> dict[int, tuple[int, tuple[GpuProcess, ...]]]:
        """index -> (memory used, live processes) from the emulator's state file; {} when the
        file is missing or malformed."""
        assert self.state_file is not None
        try:
            data = json.loads(self.state_file.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        parsed = _parse_state(data)
        if parsed is None:
            return {}
        followed = {}
        for index, used, processes in parsed:
            alive = tuple(p for p in processes if _alive(p.pid))
            if processes and not alive:
                used = 0  # every process that held this memory has exited: freed
            followed[index] = (used, alive)
        return followed


def _is_count(value: object) -> TypeGuard[int]:
    """A non-negative JSON integer (`true` is not one)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _parse_state(data: Any) -> list[tuple[int, int, tuple[GpuProcess, ...]]] | None:
    if not isinstance(data, dict) or not isinstance(data.get("gpus"), list):
        return None
    parsed = []
    for entry in data["gpus"]:
        if not isinstance(entry, dict):
            return None
        index, used, raw = (entry.get("index"), entry.get("memory_used_bytes"),
                            entry.get("processes", []))
        if not (_is_count(index) and _is_count(used) and isinstance(raw, list)):
            return None
        processes = []
        for proc in raw:
            if not (isinstance(proc, dict) and _is_count(proc.get("pid"))
                    and _is_count(proc.get("used_bytes"))
                    and isinstance(proc.get("name", ""), str)):
                return None
            processes.append(GpuProcess(proc["pid"], proc["used_bytes"], proc.get("name", "")))
        parsed.append((index, used, tuple(processes)))
    return parsed


def _alive(pid: int) -> bool:
    """Running and not a zombie: an exited process holds no GPU memory even before it is
    reaped."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
