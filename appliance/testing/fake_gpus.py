"""Fake GPUs: a test and demo instrument, never used in production (which reads NVML).

`FakeGpus` is a real `GpuPort` built from data: by default the box this appliance is made for,
eight idle, healthy "NVIDIA B300 SXM6 AC" (cool, at their default power limit, ECC on and
clean, 18 NVLinks up, the NVSwitch fabric set up, no Xid). Knobs change what the next
`snapshot()` reports, the way the real thing goes wrong: a GPU lost or gone, a foreign
compute process, memory in use, ECC errors, an Xid, a hot or throttled GPU, links down, the
fabric manager stopped, NVML unavailable, NVML hanging. `set_fields` sets any telemetry field
of `GpuInfo` as NVML would report it. Knobs may be turned from any thread.

With `state_file=`, it follows the engine emulator (`appliance.testing.fake_sglang`), which
writes what its pretend GPUs hold as it loads and serves:

    {"updated": 1764500000.0,
     "gpus": [{"index": 0, "memory_used_bytes": 210000000000,
               "processes": [{"pid": 4242, "used_bytes": 210000000000, "name": "sglang"}]}]}

Listed GPUs report those figures; a listed process that has exited is dropped and, as on real
GPUs, its memory is freed (a GPU whose listed processes are all gone reads idle). A GPU the
emulator's live processes hold is busy: its utilisation, power and temperature rise with its
work and drift on a slow wave offset per GPU, so the demo's charts move; the figures are a
pure function of that work, the GPU's index and `clock.monotonic()` (no randomness). The work
is the engine's load when `activity=` is given (a callable returning 0..1, e.g.
`metrics_activity(url)`, which reads the engine's own `/metrics`: its running share of
`max_running_requests`, full while requests queue), so a GPU holding full pools with nothing
running reads idle, as a real one does; without it, the share of its memory in use. An entry
may also carry "temperature_c", "power_w" and "utilization_pct" (non-negative numbers), which
replace the derived ones. A missing or malformed file (not JSON, wrong shape, wrong types)
means idle GPUs. Knobs win over the file. The writer should replace the file atomically
(temporary file, then rename) so a reader never sees half of it.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import math
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeGuard

import httpx
import psutil

from appliance.clock import Clock, SystemClock
from appliance.gpu.nvml import DRIVER_NOT_LOADED, GPU_IS_LOST
from appliance.gpu.port import (
    FABRIC_COMPLETED,
    THROTTLE_GPU_IDLE,
    GpuInfo,
    GpuProcess,
    GpuSnapshot,
    XidEvent,
)

MIB = 1 << 20
B300_NAME = "NVIDIA B300 SXM6 AC"
# Sold as 288 GB (8 stacks of 36 GiB HBM3e); NVML reports less because the driver reserves
# part of it. 275,040 MiB (268.6 GiB) is the share NVML keeps on a B200 (183,359 of
# 196,608 MiB) applied to 294,912 MiB, and fits the reference K3 startup log ("avail
# mem=266.93 GB" after a 1.12 GB baseline). Replace it with a reading from the box.
B300_MEMORY_BYTES = 275_040 * MIB
FAKE_DRIVER_VERSION = "580.95.05"
FAKE_CUDA_VERSION = "13.0"
B300_POWER_LIMIT_W = 1100.0  # the HGX B300 board's default; replace it with a box reading
B300_NVLINKS = 18  # NVLink 5 links per Blackwell GPU
# PCI buses of an HGX baseboard's eight GPUs (illustrative; every server numbers its own).
_BUSES = (0x18, 0x2A, 0x3A, 0x5D, 0x9A, 0xAB, 0xBA, 0xDB)

# What an idle, healthy B300 reports. pci_device_id stays None (not read): no B300 reading
# was at hand, and a made-up id would look like a fact.
_IDLE_TEMPERATURE_C = 34.0
_IDLE_POWER_W = 190.0
_IDLE = {
    "temperature_c": _IDLE_TEMPERATURE_C,
    "power_w": _IDLE_POWER_W,
    "power_limit_w": B300_POWER_LIMIT_W,
    "power_default_limit_w": B300_POWER_LIMIT_W,
    "utilization_pct": 0.0,
    "ecc_enabled": True,
    "ecc_uncorrected_volatile": 0,
    "ecc_uncorrected_aggregate": 0,
    "ecc_corrected_volatile": 0,
    "remapped_rows_correctable": 0,
    "remapped_rows_uncorrectable": 0,
    "remap_pending": False,
    "remap_failed": False,
    "retired_pages": None,  # Blackwell remaps rows; page retirement reads "not supported"
    "retired_pages_pending": None,
    "throttle_reasons": (THROTTLE_GPU_IDLE,),
    "nvlink_up": B300_NVLINKS,
    "nvlink_total": B300_NVLINKS,
    "fabric_state": FABRIC_COMPLETED,
    "fabric_error": None,
    "xid_events": (),
}
# GpuInfo fields `set_fields` may change: everything but identity, memory and processes,
# which have knobs of their own.
SETTABLE = frozenset(f.name for f in dataclasses.fields(GpuInfo)) - {
    "index", "uuid", "name", "memory_total_bytes", "memory_used_bytes", "processes",
    "error", "hint"}
_FOLLOWED = ("temperature_c", "power_w", "utilization_pct")  # optional in the state file
# A busy GPU's figures swing on this period: slow enough that 15-second samples draw a curve
# on the dashboard's hour-long sparklines, fast enough that a few minutes show movement.
_WAVE_SECONDS = 300.0


def _busy(load: float, index: int, at: float) -> dict[str, Any]:
    """What GPU `index` reports at monotonic time `at` doing `load` (0..1) of its work: the
    engine's load, or the share of its memory the emulator holds; 0 is idle. Near full load
    it swings between about 50% and 90% utilisation, 700 and 950 W of the 1100 W limit and
    60 and 72 °C: busy, and below every warning line, so a demo box stays healthy until a
    knob says otherwise."""
    load = max(0.0, min(1.0, load))
    if load == 0.0:
        return {}  # holding memory is not work: idle figures
    wave = 0.5 + 0.5 * math.sin(2 * math.pi * at / _WAVE_SECONDS + 0.8 * index)
    return {
        "utilization_pct": round(load * (55.0 + 40.0 * wave), 1),
        "power_w": round(_IDLE_POWER_W + load * (560.0 + 260.0 * wave), 1),
        "temperature_c": round(_IDLE_TEMPERATURE_C + load * (28.0 + 12.0 * wave), 1),
        "throttle_reasons": () if load else _IDLE["throttle_reasons"],  # not idle any more
    }


def metrics_activity(url: str, *, timeout: float = 1.0) -> Callable[[], float]:
    """The engine's load from its Prometheus `/metrics` at `url` (open on SGLang and the
    emulator alike): `sglang:utilization` (running requests over `max_running_requests`),
    1.0 while requests queue, 0.0 when it does not answer (nothing can be running). Each
    call reads it once (blocking; `FakeGpus.snapshot` runs in a worker thread)."""

    def read() -> float:
        try:
            text = httpx.get(url, timeout=timeout).text
        except httpx.HTTPError:
            return 0.0
        figures: dict[str, str] = {}
        for name, value in _METRIC.findall(text):
            figures.setdefault(name, value)
        try:
            if float(figures.get("num_queue_reqs", "0")) > 0:
                return 1.0
            return max(0.0, min(1.0, float(figures.get("utilization", "0"))))
        except ValueError:
            return 0.0

    return read


# A gauge line: `sglang:NAME{labels} VALUE` (the first one of each name, rank 0's, counts).
_METRIC = re.compile(r"^sglang:(utilization|num_queue_reqs)(?:\{[^}]*\})? (\S+)$", re.M)


def _bus_id(index: int) -> str:
    bus = _BUSES[index] if index < len(_BUSES) else 0xE0 + index
    return f"00000000:{bus:02X}:00.0"


@dataclass
class _Gpu:
    uuid: str
    name: str
    total: int
    pci_bus_id: str
    used: int = 0  # without the processes added by knobs
    processes: list[GpuProcess] = field(default_factory=list)
    lost: bool = False
    fields: dict[str, Any] = field(default_factory=dict)  # set by knobs, over _IDLE


class FakeGpus:
    """A `GpuPort` for tests and the demo. `count` GPUs named `name` with `memory_total_bytes`
    each, idle until a knob or the emulator's state file says otherwise. `clock` drives the
    drift of busy GPUs' figures (see the module docstring)."""

    def __init__(
        self,
        count: int = 8,
        *,
        name: str = B300_NAME,
        memory_total_bytes: int = B300_MEMORY_BYTES,
        driver_version: str = FAKE_DRIVER_VERSION,
        cuda_version: str = FAKE_CUDA_VERSION,
        state_file: Path | None = None,
        clock: Clock | None = None,
        activity: Callable[[], float] | None = None,
    ) -> None:
        self._lock = threading.Lock()
        self._clock = clock or SystemClock()
        self._gpus = [
            _Gpu(uuid=f"GPU-fa4e0000-b300-4000-8000-{i:012x}", name=name,
                 total=memory_total_bytes, pci_bus_id=_bus_id(i))
            for i in range(count)
        ]
        self._versions = (driver_version, cuda_version)
        self._failure: tuple[str, str] | None = None
        self._hang_s: float | None = None
        self._hanging = False
        self._release = threading.Event()
        self.state_file = state_file
        self.activity = activity  # blocking: snapshot() runs off the event loop

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

    def set_fields(self, index: int, **fields: Any) -> None:
        """GPU `index` reports these `GpuInfo` fields as given, e.g.
        `set_fields(3, temperature_c=93.0, throttle_reasons=("hw_thermal",))`; a field set to
        None reads "not read". Unknown or identity fields are refused."""
        unknown = set(fields) - SETTABLE
        if unknown:
            raise ValueError(f"not settable GpuInfo fields: {sorted(unknown)}")
        with self._lock:
            self._gpus[index].fields.update(fields)

    def reset_fields(self, index: int, *names: str) -> None:
        """GPU `index` reports these fields as it did before `set_fields` (idle, or following
        the emulator)."""
        with self._lock:
            for name in names:
                self._gpus[index].fields.pop(name, None)

    def add_ecc_errors(self, index: int, uncorrectable: int = 1, correctable: int = 0) -> None:
        """ECC errors happen on GPU `index`: the volatile (since driver load) and aggregate
        (lifetime) counters rise."""
        with self._lock:
            gpu = self._gpus[index]
            for name, more in (("ecc_uncorrected_volatile", uncorrectable),
                               ("ecc_uncorrected_aggregate", uncorrectable),
                               ("ecc_corrected_volatile", correctable)):
                gpu.fields[name] = (gpu.fields.get(name, _IDLE[name]) or 0) + more

    def add_xid(self, index: int, xid: int, at: dt.datetime | None = None) -> None:
        """NVML reports Xid `xid` on GPU `index` (kept until `clear_xids`)."""
        event = XidEvent(xid=xid, at=at or dt.datetime.now(dt.UTC))
        with self._lock:
            gpu = self._gpus[index]
            gpu.fields["xid_events"] = (*(gpu.fields.get("xid_events") or ()), event)

    def clear_xids(self) -> None:
        """The reported Xids age out of the window."""
        with self._lock:
            for gpu in self._gpus:
                gpu.fields["xid_events"] = ()

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
            gpus = [(g.uuid, g.name, g.total, g.pci_bus_id, g.used, tuple(g.processes),
                     g.lost, dict(g.fields)) for g in self._gpus]
        if failure is not None:
            return GpuSnapshot.unavailable(*failure)
        followed = self._follow() if self.state_file is not None else {}
        at = self._clock.monotonic()
        # A few running requests already keep a GPU visibly busy (decode is memory-bound: any
        # batch runs kernels most of the time), hence the square root of the running share.
        work = math.sqrt(max(0.0, self.activity())) \
            if self.activity is not None and followed else None
        infos = []
        for index, (uuid, name, total, bus, used, extra, lost, knobs) in enumerate(gpus):
            if lost:
                error, hint = GPU_IS_LOST
                infos.append(GpuInfo(index=index, uuid="", name="", memory_total_bytes=0,
                                     memory_used_bytes=0, error=error, hint=hint))
                continue
            base_used, base_processes, figures = followed.get(index, (used, (), {}))
            processes = base_processes + extra
            in_use = min(total, base_used + sum(p.used_bytes for p in extra))
            # Only the emulator's live processes make a GPU busy; a process added by a knob
            # (a stranger, in tests) leaves the idle figures alone.
            busy = _busy(base_used / total if work is None else work, index, at) \
                if base_processes and total else {}
            fields = {"pci_bus_id": bus, **_IDLE, **busy, **figures, **knobs}
            infos.append(GpuInfo(index=index, uuid=uuid, name=name, memory_total_bytes=total,
                                 memory_used_bytes=in_use, processes=processes, **fields))
        driver, cuda = self._versions
        return GpuSnapshot(driver_version=driver, cuda_version=cuda, gpus=tuple(infos))

    def _follow(self) -> dict[int, tuple[int, tuple[GpuProcess, ...], dict[str, float]]]:
        """index -> (memory used, live processes, telemetry figures) from the emulator's state
        file; {} when the file is missing or malformed."""
        assert self.state_file is not None
        try:
            data = json.loads(self.state_file.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        parsed = _parse_state(data)
        if parsed is None:
            return {}
        followed = {}
        for index, used, processes, figures in parsed:
            alive = tuple(p for p in processes if _alive(p.pid))
            if processes and not alive:
                used = 0  # every process that held this memory has exited: freed
            followed[index] = (used, alive, figures)
        return followed


def _is_count(value: object) -> TypeGuard[int]:
    """A non-negative JSON integer (`true` is not one)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_figure(value: object) -> TypeGuard[int | float]:
    """A non-negative JSON number (`true` is not one)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and value >= 0


def _parse_state(
    data: Any,
) -> list[tuple[int, int, tuple[GpuProcess, ...], dict[str, float]]] | None:
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
        figures = {}
        for key in _FOLLOWED:
            if key in entry:
                value = entry[key]
                if not _is_figure(value):
                    return None
                figures[key] = float(value)
        parsed.append((index, used, tuple(processes), figures))
    return parsed


def _alive(pid: int) -> bool:
    """Running and not a zombie: an exited process holds no GPU memory even before it is
    reaped."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
