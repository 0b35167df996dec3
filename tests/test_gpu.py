"""The GPU port: the fake's knobs and its emulator-following, the NVML adapter on a machine
without a driver, and the timeout guard against NVML calls that hang."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from appliance.gpu import GpuSnapshot, NvmlGpus, snapshot_with_timeout
from appliance.gpu.nvml import explain_nvml_error
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
])
def test_malformed_state_file_means_idle(tmp_path: Path, content: str) -> None:
    state = tmp_path / "gpus.json"
    state.write_text(content, encoding="utf-8")
    snap = FakeGpus(state_file=state).snapshot()
    assert snap.ok
    assert all(g.memory_used_bytes == 0 and g.processes == () for g in snap.gpus)


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
    """pynvml's errors and constants, with the functions answering like a box with two
    GPUs: GPU 0 runs two processes (one whose memory the driver does not report), GPU 1 has
    fallen off the bus. `init_failures` makes the first nvmlInit calls fail."""

    def __init__(self, init_failures: int = 0) -> None:
        import pynvml

        self._real = pynvml
        self.init_failures = init_failures
        self.inits = 0

    def __getattr__(self, name: str) -> object:
        return getattr(self._real, name)  # NVMLError_* classes and NVML_* constants

    def nvmlInit(self) -> None:
        self.inits += 1
        if self.init_failures:
            self.init_failures -= 1
            raise self._real.NVMLError(self._real.NVML_ERROR_DRIVER_NOT_LOADED)

    def nvmlSystemGetDriverVersion(self) -> str:
        return "580.95.05"

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        return 13000

    def nvmlDeviceGetCount(self) -> int:
        return 2

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetName(self, handle: int) -> bytes:
        if handle == 1:
            raise self._real.NVMLError(self._real.NVML_ERROR_GPU_IS_LOST)
        return b"NVIDIA B300 SXM6 AC"

    def nvmlDeviceGetUUID(self, handle: int) -> str:
        return f"GPU-{handle}"

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> SimpleNamespace:
        return SimpleNamespace(total=B300_MEMORY_BYTES, used=90 * GIB, free=0)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: int) -> list[SimpleNamespace]:
        return [SimpleNamespace(pid=11, usedGpuMemory=80 * GIB),
                SimpleNamespace(pid=12, usedGpuMemory=None)]

    def nvmlSystemGetProcessName(self, pid: int) -> str:
        if pid == 12:
            raise self._real.NVMLError(self._real.NVML_ERROR_NOT_FOUND)
        return "/usr/bin/python3"


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


def test_nvml_adapter_tolerates_process_listing_not_supported() -> None:
    class NoProcesses(StandInNvml):
        def nvmlDeviceGetComputeRunningProcesses(self, handle: int) -> list[SimpleNamespace]:
            raise self._real.NVMLError(self._real.NVML_ERROR_NOT_SUPPORTED)

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
            "appliance.engine.preflight; assert 'pynvml' not in sys.modules, 'pynvml loaded'")
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
