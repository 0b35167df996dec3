"""GPU checks over whole adapters: the NVML adapter on a stand-in binding (no library, a lost
GPU) and the fake GPUs following the engine emulator as the demo runs them. The checks'
finding-by-finding cases are in test_gpu_checks.py."""

from __future__ import annotations

import os
from pathlib import Path

from appliance.config import GpuConfig
from appliance.gpu import NvmlGpus
from appliance.health.gpu_checks import gpu_checks
from appliance.health.model import Level
from appliance.testing.clock import FakeClock
from appliance.testing.fake_gpus import FakeGpus
from tests.test_gpu import GIB, StandInNvml, _write


def test_nvml_library_missing_is_one_critical_naming_the_driver() -> None:
    class NoLibrary(StandInNvml):
        def nvmlInit(self) -> None:
            self.inits += 1
            raise self.error(self._real.NVML_ERROR_LIBRARY_NOT_FOUND)

    results = gpu_checks(NvmlGpus(nvml=NoLibrary()).snapshot(), GpuConfig(), None, frozenset())
    assert [(r.id, r.level) for r in results] == [("gpu.nvml", Level.CRITICAL)]
    (nvml,) = results
    assert "libnvidia-ml.so.1" in nvml.summary and "no NVIDIA driver" in nvml.summary
    assert "install the NVIDIA datacenter driver" in nvml.hint and "nvidia-smi" in nvml.hint


def test_a_gpu_lost_under_nvml_is_critical_and_the_other_is_still_checked() -> None:
    snap = NvmlGpus(nvml=StandInNvml()).snapshot()  # GPU 1 fell off the bus
    results = {r.id: r for r in gpu_checks(snap, GpuConfig(expected_count=2), None, {11, 12})}
    lost = results["gpu.1.responding"]
    assert lost.level is Level.CRITICAL and "GPU 1" in lost.summary and "lost" in lost.summary
    assert "Xid 79" in lost.hint
    assert not any(i.startswith("gpu.1.") and i != "gpu.1.responding" for i in results)
    assert results["gpu.0.responding"].level is Level.OK
    assert results["gpu.processes"].level is Level.OK  # 11 and 12 are the engine's


def test_the_demo_box_serving_stays_healthy_through_its_drift(tmp_path: Path) -> None:
    state, clock, engine = tmp_path / "gpus.json", FakeClock(), os.getpid()
    held = 255 * GIB
    _write(state, [{"index": i, "memory_used_bytes": held,
                    "processes": [{"pid": engine, "used_bytes": held,
                                   "name": f"sglang::scheduler_TP{i}"}]} for i in range(8)])
    fake = FakeGpus(state_file=state, clock=clock)
    for _ in range(20):  # a whole wave of the busy figures, in 15-second polls
        results = gpu_checks(fake.snapshot(), GpuConfig(), None, {engine})
        assert [r.id for r in results if r.failing] == []
        clock.advance(15)

    # The same processes with no engine known to the supervisor are strangers.
    stranger = {r.id: r for r in gpu_checks(fake.snapshot(), GpuConfig(), None, frozenset())}
    assert stranger["gpu.processes"].level is Level.WARN
    assert f"pid {engine} (sglang::scheduler_TP0) on GPU 0, 1" in stranger["gpu.processes"].summary
