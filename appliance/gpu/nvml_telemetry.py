"""The health telemetry of one GPU through NVML, each field best effort.

Part of the NVML adapter (`appliance.gpu.nvml`): called from the snapshot thread with the
binding it holds, never imported with pynvml loaded. Each reading is None ("not read") when
the binding lacks the function, the GPU or driver does not support it, or it fails; only a
lost GPU or an uninitialised NVML escapes, so the caller can fail the GPU or the snapshot.
Values are converted to plain units (watts, degrees C, percent, counts, names).
"""

from __future__ import annotations

import ctypes
from typing import Any

from appliance.gpu.port import (
    FABRIC_COMPLETED,
    FABRIC_IN_PROGRESS,
    FABRIC_NOT_STARTED,
    THROTTLE_APPLICATIONS_CLOCKS,
    THROTTLE_DISPLAY_CLOCKS,
    THROTTLE_GPU_IDLE,
    THROTTLE_HW_POWER_BRAKE,
    THROTTLE_HW_SLOWDOWN,
    THROTTLE_HW_THERMAL,
    THROTTLE_SW_POWER_CAP,
    THROTTLE_SW_THERMAL,
    THROTTLE_SYNC_BOOST,
)

# Fixed values of nvml.h, spelt out so that a binding lacking a constant changes nothing.
_TEMPERATURE_GPU = 0  # NVML_TEMPERATURE_GPU
_UNCORRECTED, _CORRECTED = 1, 0  # nvmlMemoryErrorType_t
_VOLATILE, _AGGREGATE = 0, 1  # nvmlEccCounterType_t
_RETIREMENT_CAUSES = (0, 1)  # multiple single-bit errors, a double-bit error
_MAX_NVLINKS = 18  # NVML_NVLINK_MAX_LINKS before bindings for NVLink 5 raised it
_THROTTLE_BITS = (
    (0x1, THROTTLE_GPU_IDLE),
    (0x2, THROTTLE_APPLICATIONS_CLOCKS),
    (0x4, THROTTLE_SW_POWER_CAP),
    (0x8, THROTTLE_HW_SLOWDOWN),
    (0x10, THROTTLE_SYNC_BOOST),
    (0x20, THROTTLE_SW_THERMAL),
    (0x40, THROTTLE_HW_THERMAL),
    (0x80, THROTTLE_HW_POWER_BRAKE),
    (0x100, THROTTLE_DISPLAY_CLOCKS),
)
_FABRIC_STATES = {1: FABRIC_NOT_STARTED, 2: FABRIC_IN_PROGRESS, 3: FABRIC_COMPLETED}


def text(value: Any) -> str:
    """NVML's strings arrive as bytes from some bindings and str from others."""
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _optional(nv: Any, function: str, *args: Any) -> Any:
    """`nv.<function>(*args)`, or None when the binding lacks it, the GPU or driver does not
    support it, or it fails otherwise. A lost GPU or an uninitialised NVML still raises:
    those are not "this reading is missing" but "this GPU (or NVML) is gone"."""
    call = getattr(nv, function, None)
    if call is None:
        return None
    try:
        return call(*args)
    except nv.NVMLError as exc:
        if exc.value in (nv.NVML_ERROR_GPU_IS_LOST, nv.NVML_ERROR_UNINITIALIZED):
            raise
        return None
    except Exception:  # a binding/driver mismatch in ctypes: this reading is missing
        return None


def _first(nv: Any, *calls: tuple[str, tuple[Any, ...]]) -> Any:
    """The first of several ways to read one figure (newest API first) that answers."""
    for function, args in calls:
        value = _optional(nv, function, *args)
        if value is not None:
            return value
    return None


def _milli(value: Any) -> float | None:
    return None if value is None else int(value) / 1000.0


def read_telemetry(nv: Any, handle: Any) -> dict[str, Any]:
    """GpuInfo's optional fields for one GPU, as keyword arguments. Raises only what
    `_optional` lets through (a lost GPU, an uninitialised NVML)."""
    temperature = _first(nv, ("nvmlDeviceGetTemperatureV", (handle, _TEMPERATURE_GPU)),
                         ("nvmlDeviceGetTemperature", (handle, _TEMPERATURE_GPU)))
    utilization = _optional(nv, "nvmlDeviceGetUtilizationRates", handle)
    ecc_mode = _optional(nv, "nvmlDeviceGetEccMode", handle)  # [current, pending]
    remap = _optional(nv, "nvmlDeviceGetRemappedRows", handle)  # (corr, unc, pending, failed)
    throttle = _first(nv, ("nvmlDeviceGetCurrentClocksEventReasons", (handle,)),
                      ("nvmlDeviceGetCurrentClocksThrottleReasons", (handle,)))
    nvlink_up, nvlink_total = _nvlinks(nv, handle)
    fabric_state, fabric_error = _fabric(nv, handle)
    pci_bus_id, pci_device_id = _pci(nv, handle)
    ecc_count = _ecc_counter(nv, handle)
    return {
        "pci_bus_id": pci_bus_id,
        "pci_device_id": pci_device_id,
        "temperature_c": None if temperature is None else float(temperature),
        "power_w": _milli(_optional(nv, "nvmlDeviceGetPowerUsage", handle)),
        "power_limit_w": _milli(_optional(nv, "nvmlDeviceGetEnforcedPowerLimit", handle)),
        "power_default_limit_w": _milli(
            _optional(nv, "nvmlDeviceGetPowerManagementDefaultLimit", handle)),
        "utilization_pct": None if utilization is None else float(utilization.gpu),
        "ecc_enabled": None if ecc_mode is None else bool(ecc_mode[0]),
        "ecc_uncorrected_volatile": ecc_count(_UNCORRECTED, _VOLATILE),
        "ecc_uncorrected_aggregate": ecc_count(_UNCORRECTED, _AGGREGATE),
        "ecc_corrected_volatile": ecc_count(_CORRECTED, _VOLATILE),
        "remapped_rows_correctable": None if remap is None else int(remap[0]),
        "remapped_rows_uncorrectable": None if remap is None else int(remap[1]),
        "remap_pending": None if remap is None else bool(remap[2]),
        "remap_failed": None if remap is None else bool(remap[3]),
        **_retired_pages(nv, handle),
        "throttle_reasons": None if throttle is None else tuple(
            name for bit, name in _THROTTLE_BITS if int(throttle) & bit),
        "nvlink_up": nvlink_up,
        "nvlink_total": nvlink_total,
        "fabric_state": fabric_state,
        "fabric_error": fabric_error,
    }


def _ecc_counter(nv: Any, handle: Any) -> Any:
    def count(error_type: int, counter: int) -> int | None:
        value = _optional(nv, "nvmlDeviceGetTotalEccErrors", handle, error_type, counter)
        return None if value is None else int(value)
    return count


def _retired_pages(nv: Any, handle: Any) -> dict[str, Any]:
    """Page retirement (before Ampere; Hopper and Blackwell remap rows and answer
    "not supported" here, which reads None)."""
    pages = [_optional(nv, "nvmlDeviceGetRetiredPages", handle, cause)
             for cause in _RETIREMENT_CAUSES]
    pending = _optional(nv, "nvmlDeviceGetRetiredPagesPendingStatus", handle)
    return {
        "retired_pages": None if any(p is None for p in pages) else sum(len(p) for p in pages),
        "retired_pages_pending": None if pending is None else bool(pending),
    }


def _nvlinks(nv: Any, handle: Any) -> tuple[int | None, int | None]:
    """(links up, links present); (None, None) for a GPU without NVLink. A link the GPU
    does not have answers "not supported" or "invalid argument" and is not counted."""
    up = total = 0
    for link in range(max(_MAX_NVLINKS, int(getattr(nv, "NVML_NVLINK_MAX_LINKS", 0)))):
        state = _optional(nv, "nvmlDeviceGetNvLinkState", handle, link)
        if state is None:
            continue
        total += 1
        up += 1 if int(state) else 0
    return (up, total) if total else (None, None)


def _fabric(nv: Any, handle: Any) -> tuple[str | None, str | None]:
    """(state, error) of the NVSwitch fabric as this GPU sees it; (None, None) where there
    is no fabric (a PCIe or NVLink-bridge box) or the driver predates the query."""
    info = None
    for struct, function in (("c_nvmlGpuFabricInfoV_t", "nvmlDeviceGetGpuFabricInfoV"),
                             ("c_nvmlGpuFabricInfo_t", "nvmlDeviceGetGpuFabricInfo")):
        make = getattr(nv, struct, None)
        if make is None:
            continue
        candidate = make()
        if _optional(nv, function, handle, ctypes.byref(candidate)) is not None:
            info = candidate
            break
    if info is None:
        return None, None
    # nvml.h's state is one byte; the binding reads it as a c_uint, so keep the low byte
    # whatever the driver leaves in the padding after it. 0: not supported.
    state = _FABRIC_STATES.get(int(info.state) & 0xFF)
    status = int(info.status)
    if state != FABRIC_COMPLETED or status == 0:  # 0: NVML_SUCCESS
        return state, None
    detail = _optional(nv, "nvmlErrorString", status)
    return state, f"{text(detail) if detail else 'NVML error'} (code {status})"


def _pci(nv: Any, handle: Any) -> tuple[str | None, str | None]:
    info = _optional(nv, "nvmlDeviceGetPciInfo", handle)
    if info is None:
        return None, None
    ident = int(info.pciDeviceId)  # device << 16 | vendor
    return text(info.busId), f"{ident & 0xFFFF:04x}:{ident >> 16:04x}"
