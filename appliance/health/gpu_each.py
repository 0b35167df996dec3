"""The checks of one GPU (`gpu.i.*`) and the finding/verdict helpers all GPU checks share.

Part of `appliance.health.gpu_checks` (which documents the ids and invariants); pure.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from dataclasses import dataclass

from appliance.config import GpuConfig
from appliance.gpu.port import (
    THROTTLE_HW_POWER_BRAKE,
    THROTTLE_HW_SLOWDOWN,
    THROTTLE_HW_THERMAL,
    THROTTLE_SW_THERMAL,
    GpuInfo,
)
from appliance.health.model import CheckResult, Level
from appliance.health.xids import xid_meaning
from appliance.sizes import gib_text

# An enforced power limit this far below the board's default is someone's cap, not rounding.
POWER_CAP_RATIO = 0.95

_COOLING = ("check the box's cooling (fans, airflow, inlet temperature, the BMC's sensor log) "
            "and `nvidia-smi -q -d TEMPERATURE,PERFORMANCE -i {gpu}`")
# Clock event reasons that are findings, with their level and words; the rest (idle, the
# software power cap under load, sync boost, application clocks) are normal operation.
_THROTTLES = {
    THROTTLE_HW_THERMAL: (Level.CRITICAL, "hardware thermal slowdown (the GPU is overheating)",
                          _COOLING),
    THROTTLE_HW_POWER_BRAKE: (Level.WARN, "hardware power brake (asserted by the system's "
                              "power supply)", "check the power supplies and the BMC's event "
                              "log; the whole engine runs at this GPU's pace"),
    THROTTLE_HW_SLOWDOWN: (Level.WARN, "hardware slowdown (clocks cut by half or more)",
                           "it follows heat or a power fault: " + _COOLING + ", and the power "
                           "supplies"),
    THROTTLE_SW_THERMAL: (Level.WARN, "software thermal slowdown", _COOLING),
}


@dataclass(frozen=True)
class Finding:
    """One thing a check found; a check's verdict is the worst of its findings."""

    level: Level
    summary: str
    hint: str = ""


def verdict(check_id: str, title: str, findings: Iterable[Finding],
            ok_summary: str) -> CheckResult:
    """OK with `ok_summary` when nothing (but benign findings) was found; otherwise the
    worst level, every finding's summary worst first, and their distinct hints."""
    failing = sorted((f for f in findings if f.level is not Level.OK),
                     key=lambda f: f.level, reverse=True)
    if not failing:
        return CheckResult(check_id, "gpu", title, Level.OK, ok_summary)
    hints = dict.fromkeys(f.hint for f in failing if f.hint)  # distinct, worst first
    return CheckResult(check_id, "gpu", title, failing[0].level,
                       "; ".join(f.summary for f in failing), "; ".join(hints))


def label(info: GpuInfo) -> str:
    return f"GPU {info.index}" + (f" ({info.pci_bus_id})" if info.pci_bus_id else "")


# --- the checks --------------------------------------------------------------------------------


def per_gpu_checks(info: GpuInfo, gpu: GpuConfig, before: GpuInfo | None) -> list[CheckResult]:
    prefix, name = f"gpu.{info.index}", f"GPU {info.index}"
    if info.error is not None:
        return [verdict(f"{prefix}.responding", name, [Finding(
            Level.CRITICAL, f"{label(info)} does not answer: {info.error}", info.hint)], "")]
    return [
        verdict(f"{prefix}.responding", name, (),
                f"{label(info)} answers ({gib_text(info.memory_used_bytes)} of "
                f"{gib_text(info.memory_total_bytes)} in use)"),
        _temperature(info, gpu),
        _power(info),
        _memory_errors(info, before),
        _clocks(info),
        _nvlink(info, gpu),
        _xids(info),
    ]


def _temperature(info: GpuInfo, gpu: GpuConfig) -> CheckResult:
    check_id, title = f"gpu.{info.index}.temperature", f"GPU {info.index} temperature"
    temp = info.temperature_c
    if temp is None:
        return verdict(check_id, title, (), f"GPU {info.index}'s temperature is not reported")
    hint = _COOLING.format(gpu=info.index) + "; a hot GPU throttles and slows the whole engine"
    findings = []
    if temp >= gpu.temperature_critical_c:
        findings.append(Finding(Level.CRITICAL, f"GPU {info.index} is at {temp:.0f} °C, at or "
                                f"above the {gpu.temperature_critical_c} °C critical line",
                                hint + ", and past its slowdown point it may shut down"))
    elif temp >= gpu.temperature_warn_c:
        findings.append(Finding(Level.WARN, f"GPU {info.index} is at {temp:.0f} °C, above the "
                                f"{gpu.temperature_warn_c} °C warning line", hint))
    return verdict(check_id, title, findings, f"GPU {info.index} is at {temp:.0f} °C")


def _power(info: GpuInfo) -> CheckResult:
    check_id, title = f"gpu.{info.index}.power", f"GPU {info.index} power"
    draw, limit, default = info.power_w, info.power_limit_w, info.power_default_limit_w
    findings = []
    if limit is not None and default and limit < default * POWER_CAP_RATIO:
        findings.append(Finding(
            Level.WARN, f"GPU {info.index} is capped at {limit:.0f} W, below its default "
            f"{default:.0f} W, so it runs slower than it can",
            f"restore it (`sudo nvidia-smi -i {info.index} -pl {default:.0f}`); if the cap is "
            "deliberate (a power budget), mute this check"))
    if draw is None:
        ok = f"GPU {info.index}'s power draw is not reported"
    elif limit:
        ok = f"GPU {info.index} draws {draw:.0f} W of its {limit:.0f} W limit"
    else:
        ok = f"GPU {info.index} draws {draw:.0f} W"
    return verdict(check_id, title, findings, ok)


def _memory_errors(info: GpuInfo, before: GpuInfo | None) -> CheckResult:
    i = info.index
    check_id, title = f"gpu.{i}.memory_errors", f"GPU {i} memory errors"
    reset = (f"stop the engine and reset the GPU (`sudo nvidia-smi -r -i {i}`) or reboot at a "
             "convenient time")
    findings = []
    if info.remap_failed:
        findings.append(Finding(
            Level.CRITICAL, f"GPU {i}'s memory repair (row remapping) failed: no spare row was "
            "left", f"GPU {i} needs replacing: contact the hardware vendor (RMA); details in "
            f"`nvidia-smi -q -d ROW_REMAPPER -i {i}`"))
    total = info.ecc_uncorrected_volatile
    old = before.ecc_uncorrected_volatile if before is not None else None
    if total is not None and old is not None and total > old:
        findings.append(Finding(
            Level.CRITICAL, f"{total - old} new uncorrectable ECC error(s) on GPU {i} since the "
            f"last check ({total} since the driver loaded)",
            f"the processes that hit the errors were killed (an engine crash now has its "
            f"cause); {reset}; errors that keep coming mean the GPU needs replacing"))
    elif total:
        findings.append(Finding(Level.WARN, f"{total} uncorrectable ECC error(s) on GPU {i} "
                                "since the driver loaded", reset))
    if info.ecc_enabled is False:
        findings.append(Finding(
            Level.WARN, f"ECC is off on GPU {i}: memory errors go undetected",
            f"turn ECC on (`sudo nvidia-smi -i {i} -e 1`) and reboot"))
    if info.remap_pending or info.retired_pages_pending:
        findings.append(Finding(
            Level.WARN, f"a memory repair on GPU {i} waits for the next GPU reset", reset))
    counted = []
    if info.ecc_corrected_volatile is not None:
        counted.append(f"{info.ecc_corrected_volatile} corrected")
    if info.remapped_rows_correctable is not None and info.remapped_rows_uncorrectable is not None:
        counted.append(f"{info.remapped_rows_correctable + info.remapped_rows_uncorrectable} "
                       "rows remapped")
    if info.retired_pages is not None:
        counted.append(f"{info.retired_pages} pages retired")
    if total is None and not counted:
        ok = f"GPU {i}'s memory error counters are not reported"
    else:
        ok = f"no uncorrectable memory errors on GPU {i}" + (
            f" ({', '.join(counted)})" if counted else "")
    return verdict(check_id, title, findings, ok)


def _clocks(info: GpuInfo) -> CheckResult:
    check_id, title = f"gpu.{info.index}.clocks", f"GPU {info.index} clocks"
    reasons = info.throttle_reasons
    if reasons is None:
        return verdict(check_id, title, (), f"GPU {info.index}'s clock limits are not reported")
    findings = [Finding(level, f"GPU {info.index}: {words}", hint.format(gpu=info.index))
                for reason, (level, words, hint) in _THROTTLES.items() if reason in reasons]
    return verdict(check_id, title, findings, f"GPU {info.index}'s clocks are not held back "
                   "by heat or power faults")


def _nvlink(info: GpuInfo, gpu: GpuConfig) -> CheckResult:
    i = info.index
    check_id, title = f"gpu.{i}.nvlink", f"GPU {i} NVLink"
    up, total = info.nvlink_up, info.nvlink_total
    if up is None or not total:
        return verdict(check_id, title, (), f"GPU {i} reports no NVLink")
    hint = (f"see `nvidia-smi nvlink -s -i {i}` and `systemctl status nvidia-fabricmanager`; "
            "a GPU reset or a reboot often retrains links; links that stay down need the "
            "hardware vendor")
    findings = []
    if up == 0 and gpu.expected_count > 1:
        findings.append(Finding(Level.CRITICAL, f"none of GPU {i}'s {total} NVLinks is up: "
                                "tensor-parallel traffic cannot use NVLink", hint))
    elif up < total:
        findings.append(Finding(Level.WARN, f"{total - up} of GPU {i}'s {total} NVLinks are "
                                "down: less bandwidth between the GPUs", hint))
    return verdict(check_id, title, findings, f"{up} of {total} NVLinks up on GPU {i}")


def _xids(info: GpuInfo) -> CheckResult:
    i = info.index
    check_id, title = f"gpu.{i}.xid", f"GPU {i} Xid errors"
    events = info.xid_events
    if events is None:
        return verdict(check_id, title, (), f"Xid errors on GPU {i} are not watched right "
                       "now (NVML has not registered it for Xid events yet, or it does not "
                       "support them); `dmesg` still has them")
    if not events:
        return verdict(check_id, title, (), f"no recent Xid error on GPU {i}")
    findings = []
    for xid in dict.fromkeys(e.xid for e in events):
        same = [e for e in events if e.xid == xid]
        meaning = xid_meaning(xid)
        times = f" ({len(same)} times)" if len(same) > 1 else ""
        when = same[-1].at.astimezone(dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
        findings.append(Finding(meaning.level, f"Xid {xid}{times} on GPU {i} "
                                f"({meaning.meaning}), last at {when}",
                                meaning.hint.format(gpu=i)))
    benign = [f.summary for f in findings if f.level is Level.OK]
    return verdict(check_id, title, findings, f"only benign Xids on GPU {i}: "
                   + "; ".join(benign))
