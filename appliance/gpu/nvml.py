"""The production GPU port over NVML (the `nvidia-ml-py` binding, module `pynvml`).

The only module that imports pynvml, and only inside functions: importing this module loads
nothing and touches no driver. `NvmlGpus.snapshot()` initialises NVML on first use (and again
after a failure, so a driver loaded later is picked up), then reads the inventory, memory,
compute processes and the health telemetry (temperature, power, utilisation, ECC and row
remapping, clock event reasons, NVLink, fabric state, recent Xids). Every NVML failure becomes
an error snapshot with a hint; nothing raises.

Telemetry is best effort per field: a reading the GPU or driver does not support (or that an
older binding lacks) is None, "not read". Only a GPU that is lost fails the whole GPU, and
only NVML being unusable fails the snapshot.

NVML calls can block in the kernel on a sick GPU: call `snapshot()` from a worker thread
through `appliance.gpu.snapshot_with_timeout`, never on the event loop.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Mapping
from typing import Any

from appliance.clock import Clock, SystemClock
from appliance.gpu.nvml_events import XidWatch
from appliance.gpu.nvml_telemetry import read_telemetry, text
from appliance.gpu.port import GpuInfo, GpuProcess, GpuSnapshot, XidEvent

DRIVER_HINT = "check `nvidia-smi`; if it fails too, see `dmesg` for NVIDIA driver errors"
DRIVER_NOT_LOADED = (
    "NVIDIA driver not loaded",
    "check `nvidia-smi` and `lsmod | grep nvidia`; load it with `sudo modprobe nvidia` or "
    "reboot after a driver install, and see `dmesg` if it refuses to load",
)
GPU_IS_LOST = (
    "GPU is lost (fell off the bus)",
    "check `dmesg` for Xid 79; the GPU needs a reset (`sudo nvidia-smi -r`) or the box a "
    "reboot; if it recurs, call the hardware vendor",
)

# NVML return codes (nvml.h) -> what happened and what to do. Keyed by pynvml's constant
# names so an older binding lacking one simply skips it.
_EXPLANATIONS: dict[str, tuple[str, str]] = {
    "NVML_ERROR_LIBRARY_NOT_FOUND": (
        "the NVML library (libnvidia-ml.so.1) was not found: no NVIDIA driver is installed",
        "install the NVIDIA datacenter driver (the appliance checks drivers, it never installs "
        "them) and confirm with `nvidia-smi`; on a machine without NVIDIA GPUs (development, "
        "CI) set gpu.expected_count = 0 (APPLIANCE_GPU_EXPECTED_COUNT=0)",
    ),
    "NVML_ERROR_DRIVER_NOT_LOADED": DRIVER_NOT_LOADED,
    "NVML_ERROR_NO_PERMISSION": (
        "NVML refused access (no permission)",
        "the daemon's user must be able to open /dev/nvidiactl and /dev/nvidia*: check the "
        "device permissions and the unit's DeviceAllow= lines",
    ),
    "NVML_ERROR_LIB_RM_VERSION_MISMATCH": (
        "the NVML library and the loaded NVIDIA kernel module are different versions",
        "the driver was upgraded without a reboot: reboot the box (or reload the nvidia "
        "kernel modules) so they match",
    ),
    "NVML_ERROR_GPU_IS_LOST": GPU_IS_LOST,
    "NVML_ERROR_RESET_REQUIRED": (
        "the GPU needs a reset",
        "reset it (`sudo nvidia-smi -r -i <index>`, with nothing running on it) or reboot",
    ),
    "NVML_ERROR_INSUFFICIENT_POWER": (
        "a GPU's power cables are not connected or supply too little power",
        "check the GPU's power connections and the power supplies; see `dmesg`",
    ),
    "NVML_ERROR_TIMEOUT": (
        "NVML timed out talking to the driver",
        DRIVER_HINT,
    ),
}


def explain_nvml_error(code: int, detail: str) -> tuple[str, str]:
    """(message, hint) for an NVML return code; `detail` is NVML's own text for it."""
    import pynvml  # here, never at import time

    for constant, explanation in _EXPLANATIONS.items():
        if getattr(pynvml, constant, None) == code:
            return explanation
    return f"NVML error: {detail} (code {code})", DRIVER_HINT


def _cuda_version(value: int) -> str:
    """NVML reports the driver's CUDA version as 1000*major + 10*minor (12080 -> "12.8")."""
    return f"{value // 1000}.{value % 1000 // 10}"


class NvmlGpus:
    """Production `GpuPort` over NVML. Safe to share between threads (NVML is thread-safe);
    one instance per process is enough.

    `nvml` is the binding: pynvml, imported on first use, unless a stand-in with the same
    functions and errors is given (tests, to drive the paths a real driver rarely takes).
    `clock` stamps and ages the Xid events (`appliance.gpu.nvml_events`).
    """

    def __init__(self, nvml: Any | None = None, clock: Clock | None = None) -> None:
        self._nvml = nvml
        self._init_lock = threading.Lock()
        self._initialized = False
        self._xids = XidWatch(clock or SystemClock())

    def _binding(self) -> Any:
        if self._nvml is None:
            import pynvml  # here, never at import time

            self._nvml = pynvml
        return self._nvml

    def snapshot(self) -> GpuSnapshot:
        try:
            nv = self._binding()
        except ImportError:
            return GpuSnapshot.unavailable(
                "the NVML Python binding (nvidia-ml-py) is not installed",
                "the appliance's installation is incomplete: reinstall it from its bundle",
            )
        try:
            return self._read(nv)
        except nv.NVMLError as exc:
            if exc.value == nv.NVML_ERROR_UNINITIALIZED:
                self._initialized = False  # someone shut NVML down: initialise next time
            return GpuSnapshot.unavailable(*explain_nvml_error(exc.value, str(exc)))
        except Exception as exc:  # ctypes or binding surprises: still a snapshot, not a raise
            return GpuSnapshot.unavailable(
                f"reading the GPUs through NVML failed ({type(exc).__name__}: {exc})",
                DRIVER_HINT,
            )

    def close(self) -> None:
        """Release NVML (optional; the process exiting does the same)."""
        with self._init_lock:
            if not self._initialized:
                return
            self._initialized = False
            nv = self._binding()
            self._xids.close(nv)
            with contextlib.suppress(nv.NVMLError):
                nv.nvmlShutdown()

    def _read(self, nv: Any) -> GpuSnapshot:
        with self._init_lock:
            if not self._initialized:
                nv.nvmlInit()  # raises on a missing library or driver; retried next snapshot
                self._xids.start()  # a new NVML session: register the GPUs afresh
                self._initialized = True
        driver = text(nv.nvmlSystemGetDriverVersion())
        cuda = _cuda_version(nv.nvmlSystemGetCudaDriverVersion())
        count = nv.nvmlDeviceGetCount()
        xids = self._xids.collect(nv, count)  # registers what is missing, then drains
        gpus = tuple(self._gpu(nv, index, xids) for index in range(count))
        return GpuSnapshot(driver_version=driver, cuda_version=cuda, gpus=gpus)

    def _gpu(self, nv: Any, index: int, xids: Mapping[str, tuple[XidEvent, ...]]) -> GpuInfo:
        """One GPU; a GPU that does not answer is reported with its error, not dropped, so
        the count stays what the driver enumerates."""
        try:
            handle = nv.nvmlDeviceGetHandleByIndex(index)
            name = text(nv.nvmlDeviceGetName(handle))
            uuid = text(nv.nvmlDeviceGetUUID(handle))
            memory = nv.nvmlDeviceGetMemoryInfo(handle)
            processes = self._processes(nv, handle)
            telemetry = read_telemetry(nv, handle)
        except nv.NVMLError as exc:
            if exc.value == nv.NVML_ERROR_UNINITIALIZED:
                raise  # NVML itself, not this GPU: `snapshot` fails and re-initialises
            message, hint = explain_nvml_error(exc.value, str(exc))
            return GpuInfo(index=index, uuid="", name="", memory_total_bytes=0,
                           memory_used_bytes=0, error=message, hint=hint)
        return GpuInfo(
            index=index, uuid=uuid, name=name, memory_total_bytes=int(memory.total),
            memory_used_bytes=int(memory.used), processes=processes,
            xid_events=xids.get(uuid), **telemetry,
        )

    def _processes(self, nv: Any, handle: Any) -> tuple[GpuProcess, ...]:
        unsupported = (nv.NVMLError_NotSupported, nv.NVMLError_FunctionNotFound)
        try:
            running = nv.nvmlDeviceGetComputeRunningProcesses(handle)
        except unsupported:  # not on B300-class GPUs; a consumer board may lack it
            return ()
        except nv.NVMLLibraryMismatchError:  # a driver older than the binding: ask its way
            try:
                running = nv.nvmlDeviceGetComputeRunningProcesses_v2(handle)
            except unsupported:
                return ()
        processes = []
        for proc in running:
            try:
                name = text(nv.nvmlSystemGetProcessName(proc.pid))
            except nv.NVMLError:
                name = ""  # exited meanwhile, or not ours to read
            used = proc.usedGpuMemory  # None when the driver does not report it
            processes.append(GpuProcess(pid=int(proc.pid), used_bytes=int(used or 0), name=name))
        return tuple(processes)
