"""The GPU port: the fake's knobs and its emulator-following, the NVML adapter (on this
machine's driver or its absence, and on a stand-in binding for the paths a real driver rarely
takes: telemetry, unsupported readings, lost GPUs, Xid events), and the timeout guard against
NVML calls that hang."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from appliance.gpu import GpuSnapshot, NvmlGpus, snapshot_with_timeout
from appliance.gpu.nvml import explain_nvml_error
from appliance.testing.clock import FakeClock
from appliance.testing.fake_gpus import B300_MEMORY_BYTES, B300_NAME, FakeGpus

GIB = 1 << 30


# --- FakeGpus -------------------------------------------------------------------------------


def test_fake_defaults_to_eight_idle_b300s() -> None:
    snap = FakeGpus().snapshot()
    assert snap.ok and snap.error is None
    assert [g.index for g in snap.gpus] == list(range(8))
    assert {g.name for g in snap.gpus} == {B300_NAME}
    assert all(g.memory_total_bytes == B300_MEMORY_BYTES for g in snap.gpus)
    assert all(g.memory_used_bytes == 0 and g.processes == () for g in snap.gpus)
    assert len({g.uuid for g in snap.gpus}) == 8
    assert snap.driver_version and snap.cuda_version


def test_lose_gpu_keeps_it_enumerated_with_an_error() -> None:
    fake = FakeGpus()
    fake.lose_gpu(3)
    snap = fake.snapshot()
    assert len(snap.gpus) == 8 and not snap.ok and snap.error is None
    lost = snap.gpus[3]
    assert lost.error is not None and "lost" in lost.error
    assert "Xid 79" in lost.hint
    assert all(g.error is None for g in snap.gpus if g.index != 3)


def test_remove_gpu_renumbers_like_nvml() -> None:
    fake = FakeGpus()
    before = fake.snapshot().gpus
    fake.remove_gpu(2)
    after = fake.snapshot().gpus
    assert [g.index for g in after] == list(range(7))
    assert after[2].uuid == before[3].uuid


def test_processes_and_memory_knobs() -> None:
    fake = FakeGpus()
    fake.set_memory_used(1, 3 * GIB)
    fake.add_process(1, pid=4242, used_bytes=80 * GIB, name="python3")
    gpu = fake.snapshot().gpus[1]
    assert gpu.memory_used_bytes == 83 * GIB
    assert [(p.pid, p.used_bytes, p.name) for p in gpu.processes] == [(4242, 80 * GIB, "python3")]
    fake.remove_process(4242)
    gpu = fake.snapshot().gpus[1]
    assert gpu.processes == () and gpu.memory_used_bytes == 3 * GIB


def test_memory_used_never_exceeds_total() -> None:
    fake = FakeGpus(1, memory_total_bytes=10 * GIB)
    fake.add_process(0, pid=1, used_bytes=50 * GIB)
    assert fake.snapshot().gpus[0].memory_used_bytes == 10 * GIB


def test_fail_and_recover() -> None:
    fake = FakeGpus()
    fake.fail()
    snap = fake.snapshot()
    assert snap.gpus == () and snap.error == "NVIDIA driver not loaded"
    assert "nvidia-smi" in snap.hint
    fake.fail("custom", "do this")
    assert (fake.snapshot().error, fake.snapshot().hint) == ("custom", "do this")
    fake.recover()
    assert fake.snapshot().ok


def test_fake_reports_a_healthy_b300s_telemetry() -> None:
    gpu = FakeGpus().snapshot().gpus[4]
    assert gpu.temperature_c is not None and gpu.temperature_c < 50
    assert gpu.power_w is not None and gpu.power_limit_w == gpu.power_default_limit_w
    assert gpu.ecc_enabled and gpu.ecc_uncorrected_volatile == 0 and not gpu.remap_pending
    assert gpu.nvlink_up == gpu.nvlink_total == 18 and gpu.fabric_state == "completed"
    assert gpu.throttle_reasons == ("gpu_idle",) and gpu.xid_events == ()
    assert gpu.pci_bus_id is not None and gpu.pci_bus_id.endswith(":00.0")
    assert len({g.pci_bus_id for g in FakeGpus().snapshot().gpus}) == 8


def test_fake_fault_knobs() -> None:
    fake = FakeGpus()
    fake.set_fields(3, temperature_c=93.0, throttle_reasons=("hw_thermal",), nvlink_up=None)
    fake.add_ecc_errors(5, uncorrectable=2, correctable=7)
    fake.add_ecc_errors(5)
    fake.add_xid(1, 79)
    fake.add_xid(1, 13)
    snap = fake.snapshot()
    assert (snap.gpus[3].temperature_c, snap.gpus[3].throttle_reasons) == (93.0, ("hw_thermal",))
    assert snap.gpus[3].nvlink_up is None
    assert (snap.gpus[5].ecc_uncorrected_volatile, snap.gpus[5].ecc_uncorrected_aggregate,
            snap.gpus[5].ecc_corrected_volatile) == (3, 3, 7)
    assert [e.xid for e in snap.gpus[1].xid_events or ()] == [79, 13]
    assert snap.gpus[0].temperature_c == 34.0  # the others untouched
    fake.clear_xids()
    assert fake.snapshot().gpus[1].xid_events == ()
    with pytest.raises(ValueError, match="uuid"):
        fake.set_fields(0, uuid="GPU-x")
    with pytest.raises(ValueError, match="temprature_c"):
        fake.set_fields(0, temprature_c=1.0)


# --- following the emulator's state file ------------------------------------------------------


def _write(path: Path, gpus: list[dict[str, object]]) -> None:
    path.write_text(json.dumps({"updated": time.time(), "gpus": gpus}), encoding="utf-8")


def test_follows_the_state_file(tmp_path: Path) -> None:
    state = tmp_path / "gpus.json"
    me = os.getpid()
    _write(state, [
        {"index": 0, "memory_used_bytes": 200 * GIB,
         "processes": [{"pid": me, "used_bytes": 200 * GIB, "name": "fake_sglang"}]},
        {"index": 5, "memory_used_bytes": 7 * GIB},  # no processes listed: figure trusted
        {"index": 99, "memory_used_bytes": 1},  # beyond the inventory: ignored
    ])
    fake = FakeGpus(state_file=state)
    fake.add_process(0, pid=777, used_bytes=GIB)  # a knob adds on top of the file
    snap = fake.snapshot()
    assert len(snap.gpus) == 8
    assert snap.gpus[0].memory_used_bytes == 201 * GIB
    assert [(p.pid, p.name) for p in snap.gpus[0].processes] == [(me, "fake_sglang"), (777, "")]
    assert snap.gpus[5].memory_used_bytes == 7 * GIB
    assert snap.gpus[1].memory_used_bytes == 0

    _write(state, [{"index": 0, "memory_used_bytes": 100 * GIB, "processes": []}])
    assert fake.snapshot().gpus[0].memory_used_bytes == 101 * GIB  # re-read every snapshot


def test_memory_of_exited_processes_is_freed(tmp_path: Path) -> None:
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    dead_pid = int(gone.stdout)
    state = tmp_path / "gpus.json"
    _write(state, [{"index": 0, "memory_used_bytes": 200 * GIB,
                    "processes": [{"pid": dead_pid, "used_bytes": 200 * GIB}]}])
    gpu = FakeGpus(state_file=state).snapshot().gpus[0]
    assert gpu.processes == () and gpu.memory_used_bytes == 0


def test_follows_telemetry_in_the_state_file(tmp_path: Path) -> None:
    state = tmp_path / "gpus.json"
    _write(state, [{"index": 2, "memory_used_bytes": 0, "temperature_c": 61,
                    "power_w": 780.5, "utilization_pct": 88}])
    fake = FakeGpus(state_file=state)
    gpu = fake.snapshot().gpus[2]
    assert (gpu.temperature_c, gpu.power_w, gpu.utilization_pct) == (61.0, 780.5, 88.0)
    fake.set_fields(2, temperature_c=90.0)  # a knob wins over the file
    assert fake.snapshot().gpus[2].temperature_c == 90.0


def test_gpus_the_emulator_holds_get_busy_and_drift(tmp_path: Path) -> None:
    state, clock, me = tmp_path / "gpus.json", FakeClock(), os.getpid()
    held = 250 * GIB  # full pools, as while serving
    _write(state, [{"index": i, "memory_used_bytes": held,
                    "processes": [{"pid": me, "used_bytes": held, "name": f"TP{i}"}]}
                   for i in range(2)] + [
                   {"index": 2, "memory_used_bytes": 25 * GIB,  # still loading weights
                    "processes": [{"pid": me, "used_bytes": 25 * GIB}]}])
    fake = FakeGpus(state_file=state, clock=clock)
    fake.add_process(5, pid=4242, used_bytes=80 * GIB)  # a knob's stranger: not busy work
    first = fake.snapshot().gpus
    for gpu in first[:2]:
        assert gpu.utilization_pct is not None and 45 <= gpu.utilization_pct <= 95
        assert gpu.power_w is not None and 650 <= gpu.power_w <= 1000
        assert gpu.temperature_c is not None and 55 <= gpu.temperature_c <= 75
        assert gpu.throttle_reasons == ()  # busy, so not idle
    loading, idle, stranger = first[2], first[3], first[5]
    assert loading.utilization_pct is not None and loading.utilization_pct < 15
    assert first[0].utilization_pct is not None and loading.utilization_pct < \
        first[0].utilization_pct
    for gpu in (idle, stranger):
        assert (gpu.utilization_pct, gpu.power_w, gpu.temperature_c) == (0.0, 190.0, 34.0)
        assert gpu.throttle_reasons == ("gpu_idle",)
    assert first[0].utilization_pct != first[1].utilization_pct  # each GPU on its own phase
    assert fake.snapshot().gpus == first  # a function of the clock, not of chance
    clock.advance(75)  # a quarter of the wave later the figures have moved
    later = fake.snapshot().gpus[0]
    assert (later.utilization_pct, later.power_w) != (first[0].utilization_pct,
                                                      first[0].power_w)
    fake.set_fields(0, temperature_c=93.0)  # knobs still win
    assert fake.snapshot().gpus[0].temperature_c == 93.0


def test_missing_state_file_means_idle(tmp_path: Path) -> None:
    fake = FakeGpus(state_file=tmp_path / "absent.json")
    fake.set_memory_used(0, GIB)
    snap = fake.snapshot()
    assert snap.ok and snap.gpus[0].memory_used_bytes == GIB  # the knob's idle figure
    assert all(g.processes == () for g in snap.gpus)


@pytest.mark.parametrize("content", [
    "",
    "{not json",
    "[]",
    '{"gpus": {}}',
    '{"gpus": [1]}',
    '{"gpus": [{"index": true, "memory_used_bytes": 1}]}',
    '{"gpus": [{"index": 0, "memory_used_bytes": -5}]}',
    '{"gpus": [{"index": 0, "memory_used_bytes": "lots"}]}',
    '{"gpus": [{"index": 0, "memory_used_bytes": 1, "processes": {}}]}',
    '{"gpus": [{"index": 0, "memory_used_bytes": 1, "processes": [{"used_bytes": 1}]}]}',
    '{"gpus": [{"index": 0, "memory_used_bytes": 1, '
    '"processes": [{"pid": 1, "used_bytes": 1, "name": 3}]}]}',
    '{"gpus": [{"index": 0, "memory_used_bytes": 5}, "junk"]}',
    '{"gpus": [{"index": 0, "memory_used_bytes": 1, "temperature_c": "hot"}]}',
    '{"gpus": [{"index": 0, "memory_used_bytes": 1, "power_w": -1}]}',
    '{"gpus": [{"index": 0, "memory_used_bytes": 1, "utilization_pct": true}]}',
])
def test_malformed_state_file_means_idle(tmp_path: Path, content: str) -> None:
    state = tmp_path / "gpus.json"
    state.write_text(content, encoding="utf-8")
    snap = FakeGpus(state_file=state).snapshot()
    assert snap.ok
    assert all(g.memory_used_bytes == 0 and g.processes == () for g in snap.gpus)
    assert all(g.temperature_c == 34.0 for g in snap.gpus)


# --- NVML on this machine ----------------------------------------------------------------------


def test_nvml_without_a_driver_is_an_error_snapshot_not_an_exception() -> None:
    snap = NvmlGpus().snapshot()
    if snap.error is None:  # a machine with a working driver: the real path must be sane
        assert all(g.uuid.startswith("GPU-") and g.memory_total_bytes > 0 for g in snap.gpus)
        return
    assert snap.gpus == () and snap.driver_version is None
    assert "nvidia-smi" in snap.hint
    assert NvmlGpus().snapshot() == snap  # init is retried, and fails the same way


def test_nvml_error_explanations() -> None:
    import pynvml  # only to read NVML's return codes

    message, hint = explain_nvml_error(pynvml.NVML_ERROR_DRIVER_NOT_LOADED, "Driver Not Loaded")
    assert message == "NVIDIA driver not loaded" and "`nvidia-smi`" in hint
    message, hint = explain_nvml_error(pynvml.NVML_ERROR_GPU_IS_LOST, "GPU is lost")
    assert "lost" in message and "Xid 79" in hint
    message, hint = explain_nvml_error(pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH, "mismatch")
    assert "reboot" in hint
    message, hint = explain_nvml_error(pynvml.NVML_ERROR_UNKNOWN, "Unknown Error")
    assert "Unknown Error" in message and "dmesg" in hint


class StandInNvml:
    """pynvml's errors, constants and structures, with the functions answering like a box
    with two GPUs: GPU 0 is healthy and busy, runs two processes (one whose memory the
    driver does not report) and has NVSwitch links; GPU 1 has fallen off the bus.
    `init_failures` makes the first nvmlInit calls fail; `events` are handed out by the event
    set as (handle, event type, data). Functions a subclass deletes (`missing`) read as
    absent from the binding, as in an older one."""

    missing: frozenset[str] = frozenset()

    def __init__(self, init_failures: int = 0) -> None:
        import pynvml

        self._real = pynvml
        self.init_failures = init_failures
        self.inits = 0
        self.events: list[tuple[int, int, int]] = []
        self.registered: list[tuple[int, int]] = []

    def __getattribute__(self, name: str) -> Any:
        if name in object.__getattribute__(self, "missing"):
            raise AttributeError(name)
        return object.__getattribute__(self, name)

    def __getattr__(self, name: str) -> object:
        if name.startswith("nvml"):  # a function this stand-in lacks: absent, never the real
            raise AttributeError(name)
        return getattr(self._real, name)  # NVMLError_* classes, NVML_* constants, c_* structs

    def error(self, code: int) -> Exception:
        return self._real.NVMLError(code)

    def nvmlInit(self) -> None:
        self.inits += 1
        if self.init_failures:
            self.init_failures -= 1
            raise self.error(self._real.NVML_ERROR_DRIVER_NOT_LOADED)

    def nvmlSystemGetDriverVersion(self) -> str:
        return "580.95.05"

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        return 13000

    def nvmlDeviceGetCount(self) -> int:
        return 2

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def _alive(self, handle: int) -> None:
        if handle == 1:
            raise self.error(self._real.NVML_ERROR_GPU_IS_LOST)

    def nvmlDeviceGetName(self, handle: int) -> bytes:
        self._alive(handle)
        return b"NVIDIA B300 SXM6 AC"

    def nvmlDeviceGetUUID(self, handle: int) -> str:
        self._alive(handle)
        return f"GPU-{handle}"

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> SimpleNamespace:
        return SimpleNamespace(total=B300_MEMORY_BYTES, used=90 * GIB, free=0)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: int) -> list[SimpleNamespace]:
        return [SimpleNamespace(pid=11, usedGpuMemory=80 * GIB),
                SimpleNamespace(pid=12, usedGpuMemory=None)]

    def nvmlSystemGetProcessName(self, pid: int) -> str:
        if pid == 12:
            raise self.error(self._real.NVML_ERROR_NOT_FOUND)
        return "/usr/bin/python3"

    # telemetry
    def nvmlDeviceGetPciInfo(self, handle: int) -> SimpleNamespace:
        return SimpleNamespace(busId=b"00000000:18:00.0", pciDeviceId=0x290110DE)

    def nvmlDeviceGetTemperatureV(self, handle: int, sensor: int) -> int:
        assert sensor == 0
        return 71

    def nvmlDeviceGetPowerUsage(self, handle: int) -> int:
        return 912_345  # mW

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: int) -> int:
        return 1_000_000

    def nvmlDeviceGetPowerManagementDefaultLimit(self, handle: int) -> int:
        return 1_100_000

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> SimpleNamespace:
        return SimpleNamespace(gpu=97, memory=40)

    def nvmlDeviceGetEccMode(self, handle: int) -> list[int]:
        return [1, 1]

    def nvmlDeviceGetTotalEccErrors(self, handle: int, error_type: int, counter: int) -> int:
        return {(1, 0): 2, (1, 1): 5, (0, 0): 300}[(error_type, counter)]

    def nvmlDeviceGetRemappedRows(self, handle: int) -> tuple[int, int, int, int]:
        return (3, 1, 1, 0)

    def nvmlDeviceGetRetiredPages(self, handle: int, cause: int) -> list[int]:
        raise self.error(self._real.NVML_ERROR_NOT_SUPPORTED)  # Blackwell remaps rows

    def nvmlDeviceGetRetiredPagesPendingStatus(self, handle: int) -> int:
        raise self.error(self._real.NVML_ERROR_NOT_SUPPORTED)

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: int) -> int:
        return 0x4 | 0x40  # software power cap, hardware thermal slowdown

    def nvmlDeviceGetNvLinkState(self, handle: int, link: int) -> int:
        if link >= 18:
            raise self.error(self._real.NVML_ERROR_INVALID_ARGUMENT)
        return 0 if link == 7 else 1

    def nvmlDeviceGetGpuFabricInfoV(self, handle: int, info: Any) -> int:
        info._obj.state = 3  # completed
        info._obj.status = 0
        return 0

    # events
    def nvmlEventSetCreate(self) -> str:
        return "the-set"

    def nvmlDeviceGetSupportedEventTypes(self, handle: int) -> int:
        self._alive(handle)
        return 0x8 | 0x2

    def nvmlDeviceRegisterEvents(self, handle: int, types: int, event_set: str) -> None:
        self.registered.append((handle, types))

    def nvmlEventSetWait_v2(self, event_set: str, timeout_ms: int) -> SimpleNamespace:
        assert timeout_ms == 0  # never waits
        if not self.events:
            raise self.error(self._real.NVML_ERROR_TIMEOUT)
        handle, kind, data = self.events.pop(0)
        return SimpleNamespace(device=handle, eventType=kind, eventData=data)


def test_nvml_adapter_reads_inventory_processes_and_lost_gpus() -> None:
    snap = NvmlGpus(nvml=StandInNvml()).snapshot()
    assert (snap.error, snap.driver_version, snap.cuda_version) == (None, "580.95.05", "13.0")
    first, lost = snap.gpus
    assert (first.index, first.uuid, first.name) == (0, "GPU-0", "NVIDIA B300 SXM6 AC")
    assert (first.memory_total_bytes, first.memory_used_bytes) == (B300_MEMORY_BYTES, 90 * GIB)
    assert [(p.pid, p.used_bytes, p.name) for p in first.processes] == [
        (11, 80 * GIB, "/usr/bin/python3"), (12, 0, "")]
    assert lost.index == 1 and lost.error is not None and "lost" in lost.error
    assert "Xid 79" in lost.hint and not snap.ok


def test_nvml_adapter_reads_the_health_telemetry() -> None:
    gpu = NvmlGpus(nvml=StandInNvml()).snapshot().gpus[0]
    assert (gpu.pci_bus_id, gpu.pci_device_id) == ("00000000:18:00.0", "10de:2901")
    assert gpu.temperature_c == 71.0 and gpu.utilization_pct == 97.0
    assert (gpu.power_w, gpu.power_limit_w, gpu.power_default_limit_w) == (912.345, 1000.0,
                                                                            1100.0)
    assert gpu.ecc_enabled is True
    assert (gpu.ecc_uncorrected_volatile, gpu.ecc_uncorrected_aggregate,
            gpu.ecc_corrected_volatile) == (2, 5, 300)
    assert (gpu.remapped_rows_correctable, gpu.remapped_rows_uncorrectable,
            gpu.remap_pending, gpu.remap_failed) == (3, 1, True, False)
    assert gpu.retired_pages is None and gpu.retired_pages_pending is None  # not supported
    assert gpu.throttle_reasons == ("sw_power_cap", "hw_thermal")
    assert (gpu.nvlink_up, gpu.nvlink_total) == (17, 18)  # links past 18 do not exist
    assert (gpu.fabric_state, gpu.fabric_error) == ("completed", None)
    assert gpu.xid_events == ()  # watched, nothing yet


def test_nvml_adapter_reports_a_failed_fabric_with_nvmls_words() -> None:
    class FabricFailed(StandInNvml):
        def nvmlDeviceGetGpuFabricInfoV(self, handle: int, info: Any) -> int:
            info._obj.state = 3
            info._obj.status = self._real.NVML_ERROR_UNKNOWN
            return 0

        def nvmlErrorString(self, code: int) -> str:
            return "Unknown Error"

    gpu = NvmlGpus(nvml=FabricFailed()).snapshot().gpus[0]
    assert gpu.fabric_state == "completed" and gpu.fabric_error == "Unknown Error (code 999)"


def test_the_fabric_state_is_one_byte_whatever_follows_it() -> None:
    class Padded(StandInNvml):  # nvml.h's state is a char; the binding's field is wider
        def nvmlDeviceGetGpuFabricInfoV(self, handle: int, info: Any) -> int:
            info._obj.state = 0xABCD00 | 2  # in progress, with junk in the padding
            info._obj.status = 0
            return 0

    assert NvmlGpus(nvml=Padded()).snapshot().gpus[0].fabric_state == "in_progress"


def test_nvml_uninitialised_mid_read_fails_the_snapshot_and_initialises_again() -> None:
    class ShutDownByOthers(StandInNvml):
        def __init__(self) -> None:
            super().__init__()
            self.shut = True

        def nvmlDeviceGetPowerUsage(self, handle: int) -> int:
            if self.shut:
                self.shut = False
                raise self.error(self._real.NVML_ERROR_UNINITIALIZED)
            return super().nvmlDeviceGetPowerUsage(handle)

    nvml = ShutDownByOthers()
    gpus = NvmlGpus(nvml=nvml)
    snap = gpus.snapshot()
    assert snap.error is not None and snap.gpus == ()  # NVML, not GPU 0, is the problem
    again = gpus.snapshot()
    assert again.error is None and again.gpus[0].error is None and nvml.inits == 2


_TELEMETRY = (
    "nvmlDeviceGetPciInfo", "nvmlDeviceGetTemperatureV", "nvmlDeviceGetPowerUsage",
    "nvmlDeviceGetEnforcedPowerLimit", "nvmlDeviceGetPowerManagementDefaultLimit",
    "nvmlDeviceGetUtilizationRates", "nvmlDeviceGetEccMode", "nvmlDeviceGetTotalEccErrors",
    "nvmlDeviceGetRemappedRows", "nvmlDeviceGetCurrentClocksEventReasons",
    "nvmlDeviceGetNvLinkState", "nvmlDeviceGetGpuFabricInfoV", "nvmlEventSetCreate",
)
_UNREAD = ("temperature_c", "power_w", "power_limit_w", "power_default_limit_w",
           "utilization_pct", "ecc_enabled", "ecc_uncorrected_volatile", "remap_pending",
           "throttle_reasons", "nvlink_up", "nvlink_total", "fabric_state", "pci_bus_id",
           "xid_events")


def test_an_older_binding_without_the_telemetry_functions_reads_none() -> None:
    class Old(StandInNvml):
        missing = frozenset(_TELEMETRY)

    snap = NvmlGpus(nvml=Old()).snapshot()
    gpu = snap.gpus[0]
    assert snap.error is None and gpu.error is None and gpu.memory_used_bytes == 90 * GIB
    assert all(getattr(gpu, name) is None for name in _UNREAD)


def test_telemetry_the_gpu_does_not_support_reads_none() -> None:
    class Unsupported(StandInNvml):
        def __getattribute__(self, name: str) -> Any:
            if name in _TELEMETRY or name == "nvmlDeviceGetTemperature":
                real = object.__getattribute__(self, "_real")

                def refuse(*args: Any) -> Any:
                    raise real.NVMLError(real.NVML_ERROR_NOT_SUPPORTED)
                return refuse
            return super().__getattribute__(name)

    gpu = NvmlGpus(nvml=Unsupported()).snapshot().gpus[0]
    assert gpu.error is None
    assert all(getattr(gpu, name) is None for name in _UNREAD)


def test_older_apis_are_the_fallback() -> None:
    class Older(StandInNvml):
        missing = frozenset({"nvmlDeviceGetTemperatureV",
                             "nvmlDeviceGetCurrentClocksEventReasons"})

        def nvmlDeviceGetTemperature(self, handle: int, sensor: int) -> int:
            return 55

        def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: int) -> int:
            return 0x1

    gpu = NvmlGpus(nvml=Older()).snapshot().gpus[0]
    assert gpu.temperature_c == 55.0 and gpu.throttle_reasons == ("gpu_idle",)


def test_a_gpu_lost_while_reading_its_telemetry_is_reported_lost() -> None:
    class LostMidway(StandInNvml):
        def nvmlDeviceGetPowerUsage(self, handle: int) -> int:
            raise self.error(self._real.NVML_ERROR_GPU_IS_LOST)

    gpu = NvmlGpus(nvml=LostMidway()).snapshot().gpus[0]
    assert gpu.error is not None and "lost" in gpu.error and "Xid 79" in gpu.hint


def test_xid_events_are_kept_for_an_hour_and_matched_by_handle() -> None:
    nvml, clock = StandInNvml(), FakeClock()
    gpus = NvmlGpus(nvml=nvml, clock=clock)
    assert gpus.snapshot().gpus[0].xid_events == ()
    assert nvml.registered == [(0, 0x8)]  # the lost GPU could not be registered
    nvml.events = [(0, 0x8, 79), (0, 0x2, 0), (0, 0x8, 13)]  # a double-bit event is skipped
    first = gpus.snapshot().gpus[0]
    assert first.xid_events is not None
    assert [(e.xid, e.at) for e in first.xid_events] == [(79, clock.now()), (13, clock.now())]
    assert nvml.events == []  # drained without waiting
    clock.advance(1800)
    nvml.events = [(0, 0x8, 31)]
    assert [e.xid for e in gpus.snapshot().gpus[0].xid_events or ()] == [79, 13, 31]
    clock.advance(1801)  # the first two are now older than an hour
    assert [e.xid for e in gpus.snapshot().gpus[0].xid_events or ()] == [31]
    assert gpus.snapshot().gpus[1].xid_events is None  # lost: not watched, error instead


def test_xids_unwatched_when_nvml_refuses_events() -> None:
    class NoEvents(StandInNvml):
        def nvmlDeviceRegisterEvents(self, handle: int, types: int, event_set: str) -> None:
            raise self.error(self._real.NVML_ERROR_NO_PERMISSION)

    assert NvmlGpus(nvml=NoEvents()).snapshot().gpus[0].xid_events is None

    class BrokenSet(StandInNvml):
        def nvmlEventSetWait_v2(self, event_set: str, timeout_ms: int) -> SimpleNamespace:
            raise self.error(self._real.NVML_ERROR_UNKNOWN)

    gpus = NvmlGpus(nvml=BrokenSet())
    snap = gpus.snapshot()
    assert snap.error is None and snap.gpus[0].xid_events is None

    class NoWait(StandInNvml):  # a binding that can make a set but not read it
        missing = frozenset({"nvmlEventSetWait_v2"})

    snap = NvmlGpus(nvml=NoWait()).snapshot()
    assert snap.error is None and snap.gpus[0].xid_events is None


class MendableEvents(StandInNvml):
    """Event sets that are counted, freed and can fail: `lost` GPUs do not answer (GPU 1
    at first) and `wait_failures` reads of the set fail with an error other than 'nothing
    waiting'."""

    def __init__(self) -> None:
        super().__init__()
        self.lost = {1}
        self.sets: list[str] = []
        self.freed: list[str] = []
        self.wait_failures = 0
        self.asked_support: list[int] = []

    def _alive(self, handle: int) -> None:
        if handle in self.lost:
            raise self.error(self._real.NVML_ERROR_GPU_IS_LOST)

    def nvmlEventSetCreate(self) -> str:
        self.sets.append(f"set-{len(self.sets) + 1}")
        return self.sets[-1]

    def nvmlEventSetFree(self, event_set: str) -> None:
        self.freed.append(event_set)

    def nvmlDeviceGetSupportedEventTypes(self, handle: int) -> int:
        self.asked_support.append(handle)
        return super().nvmlDeviceGetSupportedEventTypes(handle)

    def nvmlDeviceRegisterEvents(self, handle: int, types: int, event_set: str) -> None:
        assert event_set == self.sets[-1] and event_set not in self.freed
        super().nvmlDeviceRegisterEvents(handle, types, event_set)

    def nvmlEventSetWait_v2(self, event_set: str, timeout_ms: int) -> SimpleNamespace:
        if self.wait_failures:
            self.wait_failures -= 1
            raise self.error(self._real.NVML_ERROR_GPU_IS_LOST)
        return super().nvmlEventSetWait_v2(event_set, timeout_ms)


def test_a_failed_event_set_is_freed_and_built_again_at_the_next_read() -> None:
    nvml = MendableEvents()
    nvml.lost = set()
    gpus = NvmlGpus(nvml=nvml, clock=FakeClock())
    assert [g.xid_events for g in gpus.snapshot().gpus] == [(), ()]
    nvml.events = [(0, 0x8, 79)]
    nvml.wait_failures = 1  # e.g. a GPU fell off the bus under the set
    snap = gpus.snapshot()
    assert nvml.freed == ["set-1"]
    # this read's events are lost with the set; not watched until it is built again
    assert snap.gpus[0].xid_events is None and snap.gpus[1].xid_events is None
    nvml.events = [(0, 0x8, 79), (1, 0x8, 13)]
    snap = gpus.snapshot()
    assert nvml.sets == ["set-1", "set-2"]
    assert nvml.registered == [(0, 0x8), (1, 0x8)] * 2  # both GPUs, in the new set
    assert [[e.xid for e in g.xid_events or ()] for g in snap.gpus] == [[79], [13]]
    nvml.wait_failures = 1
    snap = gpus.snapshot()  # kept Xids stay reported while the set is being mended
    assert [[e.xid for e in g.xid_events or ()] for g in snap.gpus] == [[79], [13]]


def test_a_set_that_keeps_failing_is_built_again_at_most_once_per_read() -> None:
    nvml = MendableEvents()
    nvml.wait_failures = 100
    gpus = NvmlGpus(nvml=nvml, clock=FakeClock())
    for _ in range(3):
        assert gpus.snapshot().gpus[0].xid_events is None
    assert nvml.sets == ["set-1", "set-2", "set-3"] and nvml.freed == nvml.sets
    nvml.wait_failures = 0
    assert gpus.snapshot().gpus[0].xid_events == ()
    assert nvml.sets[-1] == "set-4" and "set-4" not in nvml.freed


def test_a_gpu_not_registered_at_start_is_registered_later(
        caplog: pytest.LogCaptureFixture) -> None:
    nvml = MendableEvents()
    gpus = NvmlGpus(nvml=nvml, clock=FakeClock())
    for _ in range(3):
        assert gpus.snapshot().gpus[0].xid_events == ()
    assert nvml.registered == [(0, 0x8)]
    assert sum("GPU 1" in r.getMessage() for r in caplog.records) == 1  # said once
    nvml.lost = set()  # answers again (a reset, or a registration NVML refused once)
    snap = gpus.snapshot()
    assert nvml.registered == [(0, 0x8), (1, 0x8)] and nvml.sets == ["set-1"]
    assert snap.gpus[1].xid_events == ()
    nvml.events = [(1, 0x8, 48)]
    assert [e.xid for e in gpus.snapshot().gpus[1].xid_events or ()] == [48]


def test_a_gpu_without_xid_events_is_not_asked_again() -> None:
    class NoXids(MendableEvents):
        def nvmlDeviceGetSupportedEventTypes(self, handle: int) -> int:
            self.asked_support.append(handle)
            return 0x2  # double-bit ECC only

    nvml = NoXids()
    nvml.lost = set()
    gpus = NvmlGpus(nvml=nvml, clock=FakeClock())
    for _ in range(3):
        assert gpus.snapshot().gpus[0].xid_events is None
    assert nvml.asked_support == [0, 1] and nvml.registered == []


def test_nvml_adapter_tolerates_process_listing_not_supported() -> None:
    class NoProcesses(StandInNvml):
        def nvmlDeviceGetComputeRunningProcesses(self, handle: int) -> list[SimpleNamespace]:
            raise self.error(self._real.NVML_ERROR_NOT_SUPPORTED)

    first = NvmlGpus(nvml=NoProcesses()).snapshot().gpus[0]
    assert first.error is None and first.processes == ()


def test_nvml_init_is_retried_until_the_driver_is_there() -> None:
    nvml = StandInNvml(init_failures=1)
    gpus = NvmlGpus(nvml=nvml)
    snap = gpus.snapshot()
    assert snap.error == "NVIDIA driver not loaded" and "modprobe" in snap.hint
    assert gpus.snapshot().error is None
    gpus.snapshot()
    assert nvml.inits == 2  # once it worked, NVML stays initialised


def test_importing_the_gpu_code_does_not_load_pynvml() -> None:
    code = ("import sys, appliance.gpu, appliance.gpu.nvml, appliance.testing.fake_gpus, "
            "appliance.engine.preflight, appliance.health.gpu_checks; "
            "assert 'pynvml' not in sys.modules, 'pynvml loaded'")
    subprocess.run([sys.executable, "-c", code], check=True)


# --- the timeout guard -------------------------------------------------------------------------


def test_a_hung_port_times_out_and_is_not_asked_again_while_stuck() -> None:
    fake = FakeGpus()
    fake.hang(5)
    try:
        snap = snapshot_with_timeout(fake, 0.2)
        assert snap.gpus == ()
        assert snap.error == "NVML did not answer within 0.2 s"
        assert "Xid" in snap.hint and "reboot" in snap.hint
        again = snapshot_with_timeout(fake, 0.2)  # the first call is still stuck
        assert again.error is not None and "has not answered" in again.error
    finally:
        fake.unhang()
    deadline = time.monotonic() + 10
    snap = snapshot_with_timeout(fake, 1.0)
    while snap.error is not None and time.monotonic() < deadline:
        time.sleep(0.05)  # the released call is finishing
        snap = snapshot_with_timeout(fake, 1.0)
    assert snap.ok and len(snap.gpus) == 8


def test_an_answering_port_passes_through() -> None:
    fake = FakeGpus(2)
    assert snapshot_with_timeout(fake, 5.0) == fake.snapshot()


class _Broken:
    def snapshot(self) -> GpuSnapshot:
        raise RuntimeError("boom")


def test_a_port_that_raises_becomes_an_error_snapshot() -> None:
    snap = snapshot_with_timeout(_Broken(), 5.0)
    assert snap.error is not None and "RuntimeError: boom" in snap.error and snap.hint


class _Gate:
    """A port that blocks in `snapshot()` until released, counting its calls."""

    def __init__(self) -> None:
        self.calls = 0
        self.entered = threading.Event()
        self.release = threading.Event()

    def snapshot(self) -> GpuSnapshot:
        self.calls += 1
        self.entered.set()
        self.release.wait(30)
        return FakeGpus(1).snapshot()


def test_a_caller_arriving_during_a_read_joins_it_instead_of_failing() -> None:
    port = _Gate()
    answers: list[GpuSnapshot] = []
    first = threading.Thread(target=lambda: answers.append(snapshot_with_timeout(port, 30)))
    first.start()
    assert port.entered.wait(30)
    # No time left on a joined read: an error at once, and no second read started.
    joined = snapshot_with_timeout(port, 0)
    assert joined.error is not None and "has not answered" in joined.error
    assert port.calls == 1
    # Time left: the caller gets the read's answer, not a "still busy" error (before, a
    # monitor poll overlapping the supervisor's read was reported as hung NVML).
    second = threading.Thread(target=lambda: answers.append(snapshot_with_timeout(port, 30)))
    second.start()
    port.release.set()
    first.join(30)
    second.join(30)
    assert len(answers) == 2 and all(a.ok for a in answers)


# --- the binding the code needs ----------------------------------------------------------

# Attributes the code uses that nvidia-ml-py gained after 12.0, with the first release that has
# each (found by downloading the releases: 12.535.161 lacks both, 12.550.52 has both).
ADDED_AFTER_12 = {"NVMLLibraryMismatchError": (12, 550, 52),
                  "nvmlDeviceGetComputeRunningProcesses_v2": (12, 550, 52)}


def _binding_attributes() -> set[str]:
    """Every `pynvml.NAME` / `nv.NAME` (the binding held as `nv`) in appliance/gpu/; names
    read through getattr with a default are optional by design and not counted."""
    import re

    import appliance.gpu

    source = "\n".join(p.read_text() for p in Path(appliance.gpu.__file__).parent.glob("*.py"))
    return set(re.findall(r"\b(?:pynvml|nv)\.([A-Za-z_][A-Za-z0-9_]*)", source))


def test_the_installed_binding_has_every_attribute_the_code_uses() -> None:
    import pynvml

    used = _binding_attributes()
    assert {"nvmlInit", "NVMLError", "NVMLLibraryMismatchError"} <= used  # the scan still works
    assert sorted(name for name in used if not hasattr(pynvml, name)) == []


def test_the_declared_floor_admits_no_binding_missing_one() -> None:
    import tomllib

    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    [floor] = [d.split(">=", 1)[1].split(",")[0].strip()
               for d in project["project"]["dependencies"] if d.startswith("nvidia-ml-py>=")]
    needed = max(ADDED_AFTER_12[name] for name in _binding_attributes() & ADDED_AFTER_12.keys())
    assert tuple(int(part) for part in floor.split(".")) >= needed
