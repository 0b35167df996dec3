"""The per-GPU part of the control plane's Prometheus exposition (see `metrics_out`).

Pure: a `GpuSnapshot` in, metric families out. Labels: `gpu` (the NVML index, stable while
the box is cabled the same) and `uuid` (the GPU's identity, which follows a swapped board).

Invariants:
- no snapshot yet (the monitor has not polled): only `appliance_gpus_expected`;
- NVML unusable: `appliance_nvml_up` 0 and no per-GPU series at all (nothing is known);
- a GPU that did not answer: `appliance_gpu_up{gpu}` 0 and no other series for it (its UUID
  is not known then, which is why `appliance_gpu_up` carries `gpu` only);
- a reading the driver did not give (None) is left out, never exported as 0.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client.core import GaugeMetricFamily, Metric

from appliance.gpu import port
from appliance.gpu.port import GpuInfo, GpuSnapshot

GpuReading = Callable[[GpuInfo], float | None]


def _flag(value: bool | None) -> float | None:
    return None if value is None else float(value)


def _xid_count(gpu: GpuInfo) -> float | None:
    return None if gpu.xid_events is None else float(len(gpu.xid_events))


def _last_xid(gpu: GpuInfo) -> float | None:
    if not gpu.xid_events:
        return None
    return float(max(gpu.xid_events, key=lambda event: event.at).xid)


# Single-valued per-GPU gauges: name, HELP, and how to read it (None: not read).
GPU_TELEMETRY: tuple[tuple[str, str, GpuReading], ...] = (
    ("appliance_gpu_temperature_celsius", "GPU core temperature", lambda g: g.temperature_c),
    ("appliance_gpu_power_watts", "GPU power draw", lambda g: g.power_w),
    ("appliance_gpu_power_limit_watts", "GPU power limit the driver enforces now",
     lambda g: g.power_limit_w),
    ("appliance_gpu_power_default_limit_watts", "The board's default power limit",
     lambda g: g.power_default_limit_w),
    ("appliance_gpu_utilization_ratio",
     "Fraction of the last sample period a kernel ran on the GPU (0..1)",
     lambda g: None if g.utilization_pct is None else g.utilization_pct / 100.0),
    ("appliance_gpu_memory_used_bytes", "GPU memory in use", lambda g: g.memory_used_bytes),
    ("appliance_gpu_memory_total_bytes", "GPU memory the driver makes available",
     lambda g: g.memory_total_bytes),
    ("appliance_gpu_ecc_enabled", "1 when ECC is on for this GPU's memory",
     lambda g: _flag(g.ecc_enabled)),
    ("appliance_gpu_ecc_uncorrectable_errors",
     "Uncorrectable ECC errors the driver counted since it loaded (a gauge of its count; "
     "any rise means data was lost)", lambda g: g.ecc_uncorrected_volatile),
    ("appliance_gpu_ecc_uncorrectable_errors_lifetime",
     "Uncorrectable ECC errors over the GPU's life (the driver's aggregate count)",
     lambda g: g.ecc_uncorrected_aggregate),
    ("appliance_gpu_ecc_correctable_errors",
     "Correctable ECC errors the driver counted since it loaded",
     lambda g: g.ecc_corrected_volatile),
    ("appliance_gpu_remapped_rows_correctable",
     "Memory rows remapped after correctable errors", lambda g: g.remapped_rows_correctable),
    ("appliance_gpu_remapped_rows_uncorrectable",
     "Memory rows remapped after uncorrectable errors", lambda g: g.remapped_rows_uncorrectable),
    ("appliance_gpu_row_remap_pending",
     "1 when a row remap waits for the next GPU reset", lambda g: _flag(g.remap_pending)),
    ("appliance_gpu_row_remap_failed",
     "1 when a row could not be remapped (no spare left): the GPU needs service",
     lambda g: _flag(g.remap_failed)),
    ("appliance_gpu_nvlink_up_links", "NVLink links that are up", lambda g: g.nvlink_up),
    ("appliance_gpu_nvlink_links", "NVLink links this GPU has", lambda g: g.nvlink_total),
    ("appliance_gpu_xid_errors_last_hour",
     "Critical Xid errors NVML reported for this GPU in the last hour", _xid_count),
    ("appliance_gpu_last_xid", "The number of the newest critical Xid error of the last hour "
     "(as dmesg shows it; 79: fell off the bus, 48: double-bit ECC)", _last_xid),
)

THROTTLE_REASONS = (
    port.THROTTLE_GPU_IDLE, port.THROTTLE_APPLICATIONS_CLOCKS, port.THROTTLE_SW_POWER_CAP,
    port.THROTTLE_HW_SLOWDOWN, port.THROTTLE_SYNC_BOOST, port.THROTTLE_SW_THERMAL,
    port.THROTTLE_HW_THERMAL, port.THROTTLE_HW_POWER_BRAKE, port.THROTTLE_DISPLAY_CLOCKS,
)
FABRIC_STATES = (port.FABRIC_NOT_STARTED, port.FABRIC_IN_PROGRESS, port.FABRIC_COMPLETED)


def gpu_families(snapshot: GpuSnapshot | None, expected: int) -> Iterable[Metric]:
    """The GPU families for one snapshot; see the module docstring for what is left out."""
    expected_family = GaugeMetricFamily(
        "appliance_gpus_expected", "GPUs this box must have (config gpu.expected_count)")
    expected_family.add_metric([], expected)
    yield expected_family
    if snapshot is None:
        return
    nvml = GaugeMetricFamily(
        "appliance_nvml_up", "1 when NVML (the NVIDIA driver's management library) answered "
        "the last poll, 0 when it could not be used; no GPU series are exported while it is 0")
    nvml.add_metric([], 0.0 if snapshot.error is not None else 1.0)
    yield nvml
    if snapshot.error is not None:
        return
    driver = GaugeMetricFamily("appliance_gpu_driver_info",
                               "Always 1; labels carry the NVIDIA driver and CUDA versions",
                               labels=["driver_version", "cuda_version"])
    driver.add_metric([snapshot.driver_version or "", snapshot.cuda_version or ""], 1.0)
    yield driver
    up = GaugeMetricFamily(
        "appliance_gpu_up", "1 when this GPU answered the last poll, 0 when it did not (lost, "
        "fell off the bus); a GPU that is 0 has no other series", labels=["gpu"])
    for gpu in snapshot.gpus:
        up.add_metric([str(gpu.index)], 0.0 if gpu.error is not None else 1.0)
    yield up
    answered = [gpu for gpu in snapshot.gpus if gpu.error is None]
    for name, doc, read in GPU_TELEMETRY:
        family = GaugeMetricFamily(name, doc, labels=["gpu", "uuid"])
        for gpu in answered:
            value = read(gpu)
            if value is not None:
                family.add_metric([str(gpu.index), gpu.uuid], float(value))
        yield family
    yield from _throttle_and_fabric(answered)


def _throttle_and_fabric(answered: list[GpuInfo]) -> Iterable[Metric]:
    throttle = GaugeMetricFamily(
        "appliance_gpu_clocks_throttled",
        "1 when this clock event reason holds the GPU's clocks down now, 0 when not "
        "(gpu_idle is normal; hw_slowdown, hw_thermal, hw_power_brake are not)",
        labels=["gpu", "uuid", "reason"])
    fabric = GaugeMetricFamily(
        "appliance_gpu_fabric_state",
        "The GPU's NVLink fabric set-up (NVSwitch systems): 1 for the current state, 0 for "
        "the others", labels=["gpu", "uuid", "state"])
    fabric_error = GaugeMetricFamily(
        "appliance_gpu_fabric_error",
        "1 when the NVLink fabric set-up finished with a failure (see nvidia-fabricmanager)",
        labels=["gpu", "uuid"])
    for gpu in answered:
        labels = [str(gpu.index), gpu.uuid]
        if gpu.throttle_reasons is not None:
            for reason in THROTTLE_REASONS:
                throttle.add_metric([*labels, reason], float(reason in gpu.throttle_reasons))
        if gpu.fabric_state is not None:
            for state in FABRIC_STATES:
                fabric.add_metric([*labels, state], float(state == gpu.fabric_state))
            fabric_error.add_metric(labels, float(bool(gpu.fabric_error)))
    yield throttle
    yield fabric
    yield fabric_error
