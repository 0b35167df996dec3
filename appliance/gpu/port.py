"""The GPU port: what the appliance reads from the GPUs, as frozen values.

`GpuPort.snapshot()` returns one `GpuSnapshot` and never raises: when NVML cannot be used at
all (library missing, driver not loaded, no permission) the snapshot carries `error` and a
`hint` naming the next step; when one GPU does not answer (fell off the bus) that `GpuInfo`
carries its own `error` and the others are still reported.

`snapshot()` is synchronous and may block: NVML calls can hang in the kernel on a sick GPU.
Callers never run it on the event loop; they use `snapshot_with_timeout()` from a worker
thread (e.g. `await asyncio.to_thread(snapshot_with_timeout, gpus, 10.0)`), which returns an
error snapshot instead of waiting past its timeout. Callers asking at the same time (the
supervisor, the health monitor, tuning) share one NVML read rather than queueing behind it.

Every telemetry field of `GpuInfo` defaults to None, meaning "not read" (the GPU or driver
does not support it, or the adapter does not ask); a check treats None as "nothing known",
never as zero. Extending it: add a field with a `None` default, fill it in `NvmlGpus` and in
`FakeGpus`' healthy defaults; existing constructors, fakes and checks keep working.
"""

from __future__ import annotations

import datetime as dt
import threading
import time
from dataclasses import dataclass, field
from typing import Protocol

# Names of the clock event ("throttle") reasons NVML reports, one per bit of its mask.
THROTTLE_GPU_IDLE = "gpu_idle"
THROTTLE_APPLICATIONS_CLOCKS = "applications_clocks"
THROTTLE_SW_POWER_CAP = "sw_power_cap"
THROTTLE_HW_SLOWDOWN = "hw_slowdown"
THROTTLE_SYNC_BOOST = "sync_boost"
THROTTLE_SW_THERMAL = "sw_thermal"
THROTTLE_HW_THERMAL = "hw_thermal"
THROTTLE_HW_POWER_BRAKE = "hw_power_brake"
THROTTLE_DISPLAY_CLOCKS = "display_clocks"

# NVLink fabric states (NVSwitch systems, set up by nvidia-fabricmanager).
FABRIC_NOT_STARTED = "not_started"
FABRIC_IN_PROGRESS = "in_progress"
FABRIC_COMPLETED = "completed"


@dataclass(frozen=True)
class GpuProcess:
    """A compute process holding memory on one GPU. `used_bytes` is 0 when the driver does
    not report it; `name` is empty when it cannot be read."""

    pid: int
    used_bytes: int
    name: str = ""


@dataclass(frozen=True)
class XidEvent:
    """A critical Xid error NVML reported for one GPU (the number `dmesg` shows as
    "NVRM: Xid (PCI:...): 79, ...") and when it arrived."""

    xid: int
    at: dt.datetime


@dataclass(frozen=True)
class GpuInfo:
    """One GPU as NVML enumerates it. `error`/`hint` are set when this GPU did not answer
    (the other fields are then empty, zero or None)."""

    index: int
    uuid: str
    name: str
    memory_total_bytes: int
    memory_used_bytes: int
    processes: tuple[GpuProcess, ...] = ()
    error: str | None = None
    hint: str = ""
    # Inventory.
    pci_bus_id: str | None = None  # NVML's form, "00000000:18:00.0"
    pci_device_id: str | None = None  # "vendor:device" in hex, as lspci writes it
    # Telemetry; None: not read (unsupported, or not asked).
    temperature_c: float | None = None
    power_w: float | None = None
    power_limit_w: float | None = None  # the enforced limit
    power_default_limit_w: float | None = None  # the board's default limit
    utilization_pct: float | None = None
    # Memory health. Volatile counts are since the driver loaded; aggregate, lifetime.
    ecc_enabled: bool | None = None
    ecc_uncorrected_volatile: int | None = None
    ecc_uncorrected_aggregate: int | None = None
    ecc_corrected_volatile: int | None = None
    remapped_rows_correctable: int | None = None
    remapped_rows_uncorrectable: int | None = None
    remap_pending: bool | None = None  # a remap waits for the next GPU reset
    remap_failed: bool | None = None  # no spare row was left
    retired_pages: int | None = None  # pre-Ampere page retirement; Blackwell remaps rows
    retired_pages_pending: bool | None = None
    # Clocks, links, fabric, errors.
    throttle_reasons: tuple[str, ...] | None = None  # THROTTLE_* names active now
    nvlink_up: int | None = None
    nvlink_total: int | None = None  # links the GPU has; None: no NVLink reported
    fabric_state: str | None = None  # FABRIC_*; None: no NVSwitch fabric (or not read)
    fabric_error: str | None = None  # set when the fabric set-up finished with a failure
    # Critical Xids of the last hour, oldest first; None: not watched now, and none kept.
    xid_events: tuple[XidEvent, ...] | None = None


@dataclass(frozen=True)
class GpuSnapshot:
    """Every GPU at one moment. `error` is set (with a `hint`) when NVML could not be used;
    `gpus` is then empty. The versions are None when unknown."""

    driver_version: str | None
    cuda_version: str | None
    gpus: tuple[GpuInfo, ...]
    error: str | None = None
    hint: str = ""

    @classmethod
    def unavailable(cls, error: str, hint: str) -> GpuSnapshot:
        return cls(driver_version=None, cuda_version=None, gpus=(), error=error, hint=hint)

    @property
    def ok(self) -> bool:
        """NVML answered and every GPU in it answered too."""
        return self.error is None and all(gpu.error is None for gpu in self.gpus)


class GpuPort(Protocol):
    def snapshot(self) -> GpuSnapshot:
        """Read every GPU. Never raises; may block (see the module docstring)."""
        ...


@dataclass
class _Call:
    """One `snapshot()` running in its own thread; every caller that arrives meanwhile waits
    on the same `done` and shares `result`."""

    started: float  # monotonic
    done: threading.Event = field(default_factory=threading.Event)
    result: list[GpuSnapshot] = field(default_factory=list)


# A port whose call is still running is not asked again until it returns: callers join the
# running call instead. A call stuck in the kernel cannot be cancelled, and piling up one
# stuck thread per poll would leak threads.
_in_flight: dict[int, _Call] = {}  # id(port) -> its unfinished call
_in_flight_lock = threading.Lock()

HUNG_HINT = (
    "a GPU or the NVIDIA driver may be hung: check `dmesg` for Xid errors and try "
    "`nvidia-smi` (it may hang too); if it does not answer, the box needs a GPU reset or a "
    "reboot. The appliance keeps running and asks again later."
)


def snapshot_with_timeout(port: GpuPort, timeout_s: float) -> GpuSnapshot:
    """`port.snapshot()`, but never blocks the caller for more than `timeout_s` seconds.

    The call runs in a daemon thread; if it has not answered in time an error snapshot says
    so, and the thread is left to finish (or not) on its own. A caller that arrives while a
    call for the same port runs shares that call: it gets the call's answer if it comes
    within `timeout_s` of the call's start, and an error at once if the call is already
    older than that (stuck). A port that raises (a bug: the contract says it must not)
    also yields an error snapshot.
    """
    key = id(port)
    with _in_flight_lock:
        call = _in_flight.get(key)
        joined = call is not None
        if call is None:
            call = _in_flight[key] = _Call(started=time.monotonic())
    if not joined:
        threading.Thread(target=_run, args=(port, key, call), name="gpu-snapshot",
                         daemon=True).start()
    wait = timeout_s if not joined else max(0.0, call.started + timeout_s - time.monotonic())
    if call.done.wait(wait):
        return call.result[0]
    if joined:
        return GpuSnapshot.unavailable(
            f"NVML has not answered a GPU query started {time.monotonic() - call.started:.0f} "
            "s ago", HUNG_HINT)
    return GpuSnapshot.unavailable(f"NVML did not answer within {timeout_s:g} s", HUNG_HINT)


def _run(port: GpuPort, key: int, call: _Call) -> None:
    try:
        call.result.append(port.snapshot())
    except Exception as exc:
        call.result.append(GpuSnapshot.unavailable(
            f"the GPU query failed unexpectedly ({type(exc).__name__}: {exc})",
            "this is a bug in the appliance; the daemon log has details, please report it"))
    finally:
        with _in_flight_lock:
            _in_flight.pop(key, None)
        call.done.set()
