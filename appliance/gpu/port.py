"""The GPU port: what the appliance reads from the GPUs, as frozen values.

`GpuPort.snapshot()` returns one `GpuSnapshot` and never raises: when NVML cannot be used at
all (library missing, driver not loaded, no permission) the snapshot carries `error` and a
`hint` naming the next step; when one GPU does not answer (fell off the bus) that `GpuInfo`
carries its own `error` and the others are still reported.

`snapshot()` is synchronous and may block: NVML calls can hang in the kernel on a sick GPU.
Callers never run it on the event loop; they use `snapshot_with_timeout()` from a worker
thread (e.g. `await asyncio.to_thread(snapshot_with_timeout, gpus, 10.0)`), which returns an
error snapshot instead of waiting past its timeout.

Extending it (the health monitor will want temperature, ECC counts, throttle reasons, ...):
add a field to `GpuInfo` with a `None` default ("not read"), fill it in `NvmlGpus` and give
`FakeGpus` a knob. Existing constructors, fakes and checks keep working unchanged.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class GpuProcess:
    """A compute process holding memory on one GPU. `used_bytes` is 0 when the driver does
    not report it; `name` is empty when it cannot be read."""

    pid: int
    used_bytes: int
    name: str = ""


@dataclass(frozen=True)
class GpuInfo:
    """One GPU as NVML enumerates it. `error`/`hint` are set when this GPU did not answer
    (the other fields are then empty or zero)."""

    index: int
    uuid: str
    name: str
    memory_total_bytes: int
    memory_used_bytes: int
    processes: tuple[GpuProcess, ...] = ()
    error: str | None = None
    hint: str = ""


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


# A port whose call is still hung is not asked again until it returns: a call stuck in the
# kernel cannot be cancelled, and piling up one stuck thread per poll would leak threads.
_in_flight: dict[int, float] = {}  # id(port) -> monotonic start of its unfinished call
_in_flight_lock = threading.Lock()

HUNG_HINT = (
    "a GPU or the NVIDIA driver may be hung: check `dmesg` for Xid errors and try "
    "`nvidia-smi` (it may hang too); if it does not answer, the box needs a GPU reset or a "
    "reboot. The appliance keeps running and asks again later."
)


def snapshot_with_timeout(port: GpuPort, timeout_s: float) -> GpuSnapshot:
    """`port.snapshot()`, but never blocks the caller for more than `timeout_s` seconds.

    The call runs in a daemon thread; if it has not answered in time an error snapshot says
    so, and the thread is left to finish (or not) on its own. While it is still stuck, later
    calls for the same port return an error at once instead of starting another thread.
    A port that raises (a bug: the contract says it must not) also yields an error snapshot.
    """
    key = id(port)
    with _in_flight_lock:
        started = _in_flight.get(key)
        if started is not None:
            return GpuSnapshot.unavailable(
                f"NVML has not answered a GPU query started {time.monotonic() - started:.0f} s "
                "ago", HUNG_HINT)
        _in_flight[key] = time.monotonic()

    result: list[GpuSnapshot] = []
    done = threading.Event()

    def call() -> None:
        try:
            result.append(port.snapshot())
        except Exception as exc:
            result.append(GpuSnapshot.unavailable(
                f"the GPU query failed unexpectedly ({type(exc).__name__}: {exc})",
                "this is a bug in the appliance; the daemon log has details, please report it"))
        finally:
            with _in_flight_lock:
                _in_flight.pop(key, None)
            done.set()

    threading.Thread(target=call, name="gpu-snapshot", daemon=True).start()
    if done.wait(timeout_s):
        return result[0]
    return GpuSnapshot.unavailable(f"NVML did not answer within {timeout_s:g} s", HUNG_HINT)
