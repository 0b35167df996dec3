"""GPU checks: snapshots from the fake GPUs, turned the way real GPUs go wrong, become the
right finding with a hint; a healthy box is all OK."""

from __future__ import annotations

import dataclasses
import datetime as dt

import pytest

from appliance.config import GpuConfig
from appliance.gpu import GpuInfo, GpuSnapshot, snapshot_with_timeout
from appliance.health.gpu_checks import gpu_checks
from appliance.health.model import CheckResult, Level
from appliance.testing.fake_gpus import FakeGpus

GIB = 1 << 30
BOX = GpuConfig()  # 8 x B300, driver 580 or newer, warn 85 °C, critical 92 °C
PER_GPU = ("responding", "temperature", "power", "memory_errors", "clocks", "nvlink", "xid")
ENGINE_PID = 4000


def check(fake: FakeGpus, check_id: str, previous: GpuSnapshot | None = None,
          config: GpuConfig = BOX) -> CheckResult:
    found = {r.id: r for r in gpu_checks(fake.snapshot(), config, previous, {ENGINE_PID})}
    return found[check_id]


def failing(results: list[CheckResult]) -> dict[str, Level]:
    return {r.id: r.level for r in results if r.failing}


def test_a_healthy_box_is_all_ok_with_stable_unique_ids() -> None:
    results = gpu_checks(FakeGpus().snapshot(), BOX, None, {ENGINE_PID})
    ids = [r.id for r in results]
    assert ids[:6] == ["gpu.nvml", "gpu.driver", "gpu.count", "gpu.model", "gpu.fabric",
                       "gpu.processes"]
    assert ids[6:] == [f"gpu.{i}.{name}" for i in range(8) for name in PER_GPU]
    assert failing(results) == {}
    assert {r.group for r in results} == {"gpu"}
    assert all(r.summary for r in results)
    assert gpu_checks(FakeGpus().snapshot(), BOX, None, {ENGINE_PID}) == results


def test_every_finding_has_a_hint() -> None:
    fake = FakeGpus(7, driver_version="570.1")
    fake.lose_gpu(0)
    fake.set_fields(1, temperature_c=99.0, throttle_reasons=("hw_thermal", "hw_slowdown"),
                    nvlink_up=0, fabric_state="not_started", remap_failed=True,
                    ecc_enabled=False, power_limit_w=500.0)
    fake.add_ecc_errors(1)
    fake.add_xid(1, 79)
    fake.add_process(2, pid=1234, used_bytes=GIB)
    results = gpu_checks(fake.snapshot(), BOX, None, {ENGINE_PID})
    assert len(failing(results)) >= 10
    assert all(r.hint for r in results if r.failing)


# --- NVML itself --------------------------------------------------------------------------------


def test_nvml_missing_is_one_critical_with_a_hint() -> None:
    fake = FakeGpus()
    fake.fail()
    results = gpu_checks(fake.snapshot(), BOX, None, {ENGINE_PID})
    assert [(r.id, r.level) for r in results] == [("gpu.nvml", Level.CRITICAL)]
    assert "NVIDIA driver not loaded" in results[0].summary
    assert "modprobe" in results[0].hint


def test_nvml_missing_on_a_box_configured_without_gpus_is_ok() -> None:
    fake = FakeGpus()
    fake.fail()
    results = gpu_checks(fake.snapshot(), GpuConfig(expected_count=0), None, None)
    assert [(r.id, r.level) for r in results] == [("gpu.nvml", Level.OK)]
    assert "none expected" in results[0].summary


def test_a_hung_nvml_call_is_critical_after_the_timeout() -> None:
    fake = FakeGpus()
    fake.hang()
    try:
        results = gpu_checks(snapshot_with_timeout(fake, 0.1), BOX, None, {ENGINE_PID})
    finally:
        fake.unhang()
    (nvml,) = results
    assert nvml.id == "gpu.nvml" and nvml.level is Level.CRITICAL
    assert "did not answer within 0.1 s" in nvml.summary
    assert "Xid" in nvml.hint and "reboot" in nvml.hint


# --- inventory ----------------------------------------------------------------------------------


def test_a_lost_gpu_is_critical_and_its_other_checks_wait() -> None:
    fake = FakeGpus()
    fake.lose_gpu(3)
    results = gpu_checks(fake.snapshot(), BOX, None, {ENGINE_PID})
    assert failing(results) == {"gpu.3.responding": Level.CRITICAL}
    lost = next(r for r in results if r.id == "gpu.3.responding")
    assert "GPU 3" in lost.summary and "lost" in lost.summary and "Xid 79" in lost.hint
    assert not any(r.id.startswith("gpu.3.") and r.id != "gpu.3.responding" for r in results)
    assert next(r for r in results if r.id == "gpu.count").level is Level.OK  # still listed


def test_a_gpu_gone_from_the_bus_is_named_from_the_previous_snapshot() -> None:
    fake = FakeGpus()
    before = fake.snapshot()
    fake.remove_gpu(2)
    count = check(fake, "gpu.count", previous=before)
    assert count.level is Level.CRITICAL
    assert "found 7 GPU(s), expected 8" in count.summary
    assert before.gpus[2].uuid in count.summary and "was GPU 2 (00000000:3A:00.0)" in count.summary
    assert "nvidia-smi -L" in count.hint
    # Without the previous snapshot the count still tells.
    assert check(fake, "gpu.count").level is Level.CRITICAL


def test_more_gpus_than_expected_warns() -> None:
    assert check(FakeGpus(9), "gpu.count").level is Level.WARN
    assert check(FakeGpus(3), "gpu.count", config=GpuConfig(expected_count=0)).level is Level.OK


def test_the_wrong_model_is_critical() -> None:
    result = check(FakeGpus(name="NVIDIA H200"), "gpu.model")
    assert result.level is Level.CRITICAL and "'NVIDIA H200'" in result.summary
    assert "gpu.expected_model" in result.hint


@pytest.mark.parametrize(("driver", "level"), [
    ("580.95.05", Level.OK), ("580.65.06", Level.OK), ("580.65.05", Level.CRITICAL),
    ("590.1", Level.OK),
    ("575.57.08", Level.CRITICAL), ("535.261.03", Level.CRITICAL), ("beta-1", Level.WARN),
])
def test_the_driver_version_against_the_minimum(driver: str, level: Level) -> None:
    result = check(FakeGpus(driver_version=driver), "gpu.driver")
    assert result.level is level
    assert driver in result.summary
    if level is Level.CRITICAL:
        assert "580" in result.summary and "install" in result.hint


# --- per GPU ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("celsius", "level", "words"), [
    (84.0, Level.OK, "at 84 °C"),
    (86.0, Level.WARN, "GPU 6 is at 86 °C, above the 85 °C warning line"),
    (92.0, Level.CRITICAL, "at or above the 92 °C critical line"),
])
def test_a_hot_gpu(celsius: float, level: Level, words: str) -> None:
    fake = FakeGpus()
    fake.set_fields(6, temperature_c=celsius)
    result = check(fake, "gpu.6.temperature")
    assert result.level is level and words in result.summary
    if level is not Level.OK:
        assert "cooling" in result.hint and "-i 6" in result.hint


def test_rising_ecc_errors_are_critical_then_settle_to_a_warning() -> None:
    fake = FakeGpus()
    before = fake.snapshot()
    fake.add_ecc_errors(5, uncorrectable=2)
    rising = check(fake, "gpu.5.memory_errors", previous=before)
    assert rising.level is Level.CRITICAL
    assert "2 new uncorrectable ECC error(s) on GPU 5" in rising.summary
    assert "nvidia-smi -r -i 5" in rising.hint
    steady = check(fake, "gpu.5.memory_errors", previous=fake.snapshot())
    assert steady.level is Level.WARN and "2 uncorrectable" in steady.summary
    # The GPU is matched by UUID: one removed before it does not confuse the comparison.
    fake.remove_gpu(0)
    assert check(fake, "gpu.4.memory_errors", previous=fake.snapshot()).level is Level.WARN


def test_memory_repair_findings() -> None:
    fake = FakeGpus()
    fake.set_fields(0, remap_failed=True)
    fake.set_fields(1, remap_pending=True)
    fake.set_fields(2, ecc_enabled=False)
    failed = check(fake, "gpu.0.memory_errors")
    assert failed.level is Level.CRITICAL and "RMA" in failed.hint
    pending = check(fake, "gpu.1.memory_errors")
    assert pending.level is Level.WARN and "next GPU reset" in pending.summary
    ecc_off = check(fake, "gpu.2.memory_errors")
    assert ecc_off.level is Level.WARN and "-e 1" in ecc_off.hint
    assert "0 corrected, 0 rows remapped" in check(fake, "gpu.3.memory_errors").summary


def test_a_stranger_process_warns_and_the_engine_does_not() -> None:
    fake = FakeGpus()
    fake.add_process(1, pid=ENGINE_PID, used_bytes=200 * GIB, name="sglang::scheduler")
    fake.add_process(1, pid=4242, used_bytes=80 * GIB, name="python3")
    fake.add_process(2, pid=4242, used_bytes=0)
    result = check(fake, "gpu.processes")
    assert result.level is Level.WARN
    assert "pid 4242 (python3) on GPU 1, 2 (80.0 GiB)" in result.summary
    assert str(ENGINE_PID) not in result.summary
    assert "kill 4242" in result.hint and "never stops" in result.hint
    unattributed = gpu_checks(fake.snapshot(), BOX, None, None)
    listed = next(r for r in unattributed if r.id == "gpu.processes")
    assert listed.level is Level.OK and "pid 4242" in listed.summary


@pytest.mark.parametrize(("reasons", "level"), [
    (("gpu_idle",), Level.OK),
    (("sw_power_cap",), Level.OK),
    (("sw_thermal",), Level.WARN),
    (("hw_slowdown", "hw_power_brake"), Level.WARN),
    (("hw_slowdown", "hw_thermal"), Level.CRITICAL),
])
def test_clock_slowdowns(reasons: tuple[str, ...], level: Level) -> None:
    fake = FakeGpus()
    fake.set_fields(7, throttle_reasons=reasons)
    result = check(fake, "gpu.7.clocks")
    assert result.level is level
    if "hw_thermal" in reasons:
        assert result.summary.startswith("GPU 7: hardware thermal slowdown")
        assert "hardware slowdown" in result.summary  # every finding is named


def test_nvlinks_down() -> None:
    fake = FakeGpus()
    fake.set_fields(0, nvlink_up=16)
    fake.set_fields(1, nvlink_up=0)
    fake.set_fields(2, nvlink_up=None, nvlink_total=None)
    partial = check(fake, "gpu.0.nvlink")
    assert partial.level is Level.WARN and "2 of GPU 0's 18 NVLinks are down" in partial.summary
    assert check(fake, "gpu.1.nvlink").level is Level.CRITICAL
    assert check(fake, "gpu.2.nvlink").summary == "GPU 2 reports no NVLink"


@pytest.mark.parametrize(("fields", "level", "words"), [
    ({"fabric_state": "not_started"}, Level.CRITICAL, "not set up on GPU 0"),
    ({"fabric_state": "in_progress"}, Level.WARN, "still being set up"),
    ({"fabric_error": "Unknown Error (code 999)"}, Level.CRITICAL, "Unknown Error"),
])
def test_fabric_manager_states(fields: dict[str, str], level: Level, words: str) -> None:
    fake = FakeGpus()
    fake.set_fields(0, **fields)
    result = check(fake, "gpu.fabric")
    assert result.level is level and words in result.summary
    assert "nvidia-fabricmanager" in result.hint


def test_no_fabric_is_fine() -> None:
    fake = FakeGpus(2)
    for i in range(2):
        fake.set_fields(i, fabric_state=None)
    assert check(fake, "gpu.fabric", config=GpuConfig(expected_count=2)).level is Level.OK


def test_xid_errors_by_meaning() -> None:
    fake = FakeGpus()
    at = dt.datetime(2026, 11, 30, 12, 3, 4, tzinfo=dt.UTC)
    fake.add_xid(2, 13, at=at)
    fake.add_xid(2, 13, at=at)
    app = check(fake, "gpu.2.xid")
    assert app.level is Level.WARN
    assert app.summary == ("Xid 13 (2 times) on GPU 2 (graphics engine exception), last at "
                           "2026-11-30 12:03:04 UTC")
    assert "engine log" in app.hint
    fake.add_xid(2, 79, at=at)
    lost = check(fake, "gpu.2.xid")
    assert lost.level is Level.CRITICAL and lost.summary.startswith("Xid 79 on GPU 2")
    assert "nvidia-smi -r -i 2" in lost.hint
    fake.clear_xids()
    fake.add_xid(4, 45)
    benign = check(fake, "gpu.4.xid")
    assert benign.level is Level.OK and "Xid 45" in benign.summary
    fake.add_xid(4, 999)
    unknown = check(fake, "gpu.4.xid")
    assert unknown.level is Level.WARN and "docs.nvidia.com" in unknown.hint


def test_a_power_cap_below_the_default_warns() -> None:
    fake = FakeGpus()
    fake.set_fields(0, power_limit_w=700.0)
    result = check(fake, "gpu.0.power")
    assert result.level is Level.WARN and "capped at 700 W, below its default 1100 W" in \
        result.summary
    assert "-pl 1100" in result.hint
    assert check(fake, "gpu.1.power").summary == "GPU 1 draws 190 W of its 1100 W limit"


def test_readings_that_are_not_reported_are_never_findings() -> None:
    bare = GpuSnapshot(driver_version="580.95.05", cuda_version="13.0", gpus=tuple(
        GpuInfo(index=i, uuid=f"GPU-{i}", name="NVIDIA B300 SXM6 AC",
                memory_total_bytes=GIB, memory_used_bytes=0) for i in range(8)))
    results = gpu_checks(bare, BOX, bare, set())
    assert failing(results) == {}
    summaries = {r.id: r.summary for r in results}
    assert "not reported" in summaries["gpu.0.temperature"]
    assert "not reported" in summaries["gpu.0.memory_errors"]
    assert "not watched" in summaries["gpu.0.xid"]
    assert "no NVSwitch fabric" in summaries["gpu.fabric"]


def test_checks_keep_old_snapshots_working() -> None:
    """A snapshot from before the telemetry fields (all None) and one with them compare."""
    fake = FakeGpus()
    old = dataclasses.replace(fake.snapshot(), gpus=tuple(
        dataclasses.replace(g, ecc_uncorrected_volatile=None) for g in fake.snapshot().gpus))
    assert failing(gpu_checks(fake.snapshot(), BOX, old, {ENGINE_PID})) == {}
