"""`appliance doctor [--json]`.

As a real subprocess on a migrated box with no daemon, on this machine (no NVIDIA driver): NVML
missing is CRITICAL with its hint and the exit status is 1; with no GPU expected
(`APPLIANCE_GPU_EXPECTED_COUNT=0`) it is OK and the exit status 0; an unmigrated database is
CRITICAL. In process (`run_doctor` with fake GPUs and an engine answering through
`httpx.MockTransport`): a serving idle engine is probed, a busy one gets no generation, a
loading one is not contacted at all, a FAILED one is CRITICAL; the report's text and JSON.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import json
import os
from pathlib import Path
from typing import Any

import httpx
import pytest

from appliance.config import Config, load_config
from appliance.db.database import Database
from appliance.engine.publish import write_published
from appliance.health.doctor import Report, daemon_check, render, run_doctor
from appliance.health.model import CheckResult, Level
from appliance.lock import InstanceLock
from appliance.testing.fake_gpus import FakeGpus
from tests.conftest import run_cli
from tests.test_server import write_config

# Generous host lines, so the result does not depend on this machine's free disk and RAM.
ROOMY = {"APPLIANCE_HEALTH_MODELS_FREE_WARN_GIB": "0",
         "APPLIANCE_HEALTH_MODELS_FREE_CRITICAL_GIB": "0",
         "APPLIANCE_HEALTH_STATE_FREE_WARN_GIB": "0",
         "APPLIANCE_HEALTH_STATE_FREE_CRITICAL_GIB": "0",
         "APPLIANCE_HEALTH_MEMORY_AVAILABLE_WARN_PERCENT": "0",
         "APPLIANCE_HEALTH_SHM_FREE_WARN_GIB": "0"}
HAS_DRIVER = Path("/dev/nvidiactl").exists()


@pytest.fixture(scope="module")
def box(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A migrated box (the doctor only reads it, so the tests share it)."""
    config = write_config(tmp_path_factory.mktemp("doctor") / "box")
    assert run_cli("--config", str(config), "migrate").returncode == 0
    return config


def doctor(box: Path, *args: str, **env: str) -> tuple[int, str, str]:
    result = run_cli("--config", str(box), "doctor", *args, env={**ROOMY, **env})
    return result.returncode, result.stdout, result.stderr


def by_id(document: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["id"]: c for c in document["checks"]}


# --- as the operator runs it ------------------------------------------------------------------


@pytest.mark.skipif(HAS_DRIVER, reason="this machine has an NVIDIA driver")
def test_no_driver_is_critical_with_its_hint(box: Path) -> None:
    code, out, err = doctor(box)
    assert code == 1, err
    assert "\nGPUs\n  CRITICAL  NVML: cannot read the GPUs: " in out
    lines = out.splitlines()
    nvml = next(i for i, line in enumerate(lines) if "NVML: cannot read" in line)
    assert lines[nvml + 1].startswith(" " * 12 + "what to do: ")
    assert "nvidia-smi" in lines[nvml + 1]
    assert "  OK        Database: SQLite, schema" in out
    assert "  WARN      Daemon: the daemon is not running" in out
    assert "  OK        Engine /ready: not checked while stopped" in out
    assert lines[-1].startswith("Overall: CRITICAL (1 critical, ")

    code, out, err = doctor(box, "--json")
    assert code == 1, err
    document = json.loads(out)
    assert list(document) == ["format", "version", "at", "overall", "counts", "checks"]
    assert document["format"] == 1 and document["overall"] == "critical"
    assert document["counts"]["critical"] == 1
    checks = by_id(document)
    assert checks["gpu.nvml"]["level"] == "critical"
    assert "install the NVIDIA datacenter driver" in checks["gpu.nvml"]["hint"]
    assert [c["group"] for c in document["checks"]] == sorted(
        (c["group"] for c in document["checks"]),
        key=["appliance", "gpu", "engine", "host"].index)
    assert {"appliance.config", "appliance.database", "appliance.weights", "engine.state",
            "engine.ready", "host.models_disk", "host.load"} <= set(checks)
    assert "host.daemon_memory" not in checks  # the doctor's own memory says nothing
    assert all(set(c) == {"id", "group", "title", "level", "summary", "hint"}
               for c in document["checks"])


def test_no_gpus_expected(box: Path) -> None:
    code, out, err = doctor(box, "--json", APPLIANCE_GPU_EXPECTED_COUNT="0")
    assert code == 0, out + err
    checks = by_id(json.loads(out))
    nvml = checks["gpu.nvml"]
    assert nvml["level"] == "ok" and "none expected" in nvml["summary"]
    assert nvml["hint"] == ""
    assert json.loads(out)["overall"] == "warn"  # no daemon, no weights yet
    code, out, _ = doctor(box, APPLIANCE_GPU_EXPECTED_COUNT="0")
    assert code == 0 and out.splitlines()[-1].startswith("Overall: WARN (0 critical, ")


def test_an_unmigrated_database_is_critical(tmp_path: Path) -> None:
    config = write_config(tmp_path / "box")
    code, out, _ = doctor(config, "--json", APPLIANCE_GPU_EXPECTED_COUNT="0")
    assert code == 1
    checks = by_id(json.loads(out))
    assert checks["appliance.database"]["level"] == "critical"
    assert checks["appliance.database"]["hint"] == "run `appliance migrate`"
    assert checks["appliance.weights"]["summary"] == "not checked: the database cannot be read"
    assert checks["engine.state"]["level"] == "warn"


# --- in process, with fakes -------------------------------------------------------------------


class Engine:
    """The engine's HTTP side for the probe: `running` requests in flight; every request
    seen is kept in `paths`."""

    def __init__(self, running: int = 0) -> None:
        self.running = running
        self.paths: list[str] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        self.paths.append(path)
        if path == "/ready" or path == "/health_generate":
            return httpx.Response(200)
        if path == "/metrics":
            return httpx.Response(200, text=(
                f'sglang:num_running_reqs{{tp_rank="0"}} {self.running}\n'
                'sglang:num_queue_reqs{tp_rank="0"} 0\n'
                'sglang:token_usage{tp_rank="0"} 0.25\n'))
        if path == "/v1/chat/completions":
            chunks = "".join(
                f'data: {{"choices": [{{"delta": {{"content": "{w}"}}}}]}}\n\n'
                for w in ("one", " two", " three"))
            return httpx.Response(200, text=chunks + "data: [DONE]\n\n",
                                  headers={"content-type": "text/event-stream"})
        return httpx.Response(404)


@pytest.fixture
def migrated(config: Config, db: Database) -> Config:
    """The conftest config, its database migrated, no GPU expected, roomy host lines."""
    return load_config(dev=True, dev_root=config.paths.state_dir.parent,
                       env={"APPLIANCE_SERVER_PORT": str(config.server.port), **ROOMY})


def publish(config: Config, state: str, message: str = "") -> None:
    db = Database(config.database_url)
    try:
        db.call(lambda s: write_published(s, state, message or state, None,
                                          dt.datetime.now(dt.UTC)))
    finally:
        db.dispose()


def diagnose(config: Config, engine: Engine) -> Report:
    return asyncio.run(run_doctor(config, gpus=FakeGpus(8),
                                  engine_transport=httpx.MockTransport(engine)))


def test_a_serving_idle_engine_is_probed(migrated: Config) -> None:
    publish(migrated, "ready", "serving")
    engine = Engine(running=0)
    report = diagnose(migrated, engine)
    levels = {r.id: r.level for r in report.results}
    assert levels["engine.ready"] is Level.OK and levels["engine.generate"] is Level.OK
    state = next(r for r in report.results if r.id == "engine.state")
    assert state.summary.startswith("ready, published ") and "not running" in state.summary
    assert {"/ready", "/metrics", "/health_generate", "/v1/chat/completions"} <= set(
        engine.paths)
    assert levels["gpu.count"] is Level.OK and levels["gpu.3.temperature"] is Level.OK


def test_a_busy_engine_gets_no_generation(migrated: Config) -> None:
    publish(migrated, "ready")
    engine = Engine(running=50)
    report = diagnose(migrated, engine)
    assert "/ready" in engine.paths and "/metrics" in engine.paths
    assert "/health_generate" not in engine.paths
    assert "/v1/chat/completions" not in engine.paths
    assert next(r for r in report.results if r.id == "engine.ready").level is Level.OK


def test_a_loading_engine_is_not_contacted(migrated: Config) -> None:
    publish(migrated, "loading_weights", "loading weights: 40%")
    engine = Engine()
    report = diagnose(migrated, engine)
    assert engine.paths == []
    ready = next(r for r in report.results if r.id == "engine.ready")
    assert ready.summary == "not checked while loading weights"


def test_a_failed_engine_is_critical(migrated: Config) -> None:
    publish(migrated, "failed", "out of memory while allocating the KV cache")
    report = diagnose(migrated, Engine())
    state = next(r for r in report.results if r.id == "engine.state")
    assert state.level is Level.CRITICAL and "out of memory" in state.summary
    assert "Engine page" in state.hint
    assert report.overall is Level.CRITICAL


def test_the_daemon_is_seen_through_its_lock(migrated: Config) -> None:
    state_dir = migrated.paths.state_dir
    assert daemon_check(state_dir).level is Level.WARN
    lock = InstanceLock(state_dir)
    lock.acquire()
    try:
        seen = daemon_check(state_dir)
        assert seen.level is Level.OK and f"(pid {os.getpid()})" in seen.summary
    finally:
        lock.release()
    assert daemon_check(state_dir).level is Level.WARN
    again = InstanceLock(state_dir)
    again.acquire()  # the doctor's look did not keep the lock
    again.release()


def test_the_text_report() -> None:
    at = dt.datetime(2026, 3, 1, 12, 0, tzinfo=dt.UTC)
    report = Report(at, (
        CheckResult("appliance.config", "appliance", "Configuration", Level.OK, "loaded"),
        CheckResult("gpu.3.temperature", "gpu", "GPU 3 temperature", Level.WARN, "hot",
                    "check the fans"),
        CheckResult("host.load", "host", "Host load", Level.OK, "calm", "ignored when OK")))
    assert render(report).splitlines() == [
        "appliance doctor " + report.to_json()["version"] + ", 2026-03-01 12:00:00 UTC",
        "", "Appliance", "  OK        Configuration: loaded",
        "", "GPUs", "  WARN      GPU 3 temperature: hot",
        "            what to do: check the fans",
        "", "Host", "  OK        Host load: calm",
        "", "Overall: WARN (0 critical, 1 warning, 2 ok)"]
    assert report.to_json()["counts"] == {"ok": 2, "warn": 1, "critical": 0}


def test_a_stranger_on_the_gpus_is_named_when_no_engine_runs(migrated: Config) -> None:
    """No engine of ours runs: a compute process holding GPU memory is a stranger, a WARN
    with its pid, GPU and size (before, processes were only listed)."""
    publish(migrated, "stopped")
    gpus = FakeGpus(8)
    gpus.add_process(2, 31337, 40 * 1024**3, "python")
    report = asyncio.run(run_doctor(migrated, gpus=gpus,
                                    engine_transport=httpx.MockTransport(Engine())))
    found = next(r for r in report.results if r.id == "gpu.processes")
    assert found.level is Level.WARN
    assert "pid 31337 (python) on GPU 2 (40.0 GiB)" in found.summary


def test_uncorrectable_ecc_is_judged_against_the_last_recorded_reading(
        migrated: Config) -> None:
    """The monitor recorded 3 uncorrectable errors on GPU 5; now there are 7: the doctor,
    a one-off process, says 4 are new (CRITICAL) instead of only "7 since the driver
    loaded"."""
    from appliance.health import history, model

    publish(migrated, "stopped")
    db = Database(migrated.database_url)
    try:
        db.call(lambda s: history.record_samples(s, dt.datetime.now(dt.UTC), [
            model.Sample(model.GPU_ECC_UNCORRECTED, "5", 3.0)]))
    finally:
        db.dispose()
    gpus = FakeGpus(8)
    gpus.set_fields(5, ecc_uncorrected_volatile=7)
    report = asyncio.run(run_doctor(migrated, gpus=gpus,
                                    engine_transport=httpx.MockTransport(Engine())))
    found = next(r for r in report.results if r.id == "gpu.5.memory_errors")
    assert found.level is Level.CRITICAL
    assert "4 new uncorrectable ECC error(s) on GPU 5 since the last check" in found.summary


def test_a_decode_box_is_told_of_a_missing_nic_and_transfer_library_before_a_load(
        migrated: Config, tmp_path: Path) -> None:
    """A fake /sys/class/infiniband with mlx5_0 down and no mlx5_1, an engine venv whose
    python cannot import mooncake: both CRITICAL, each naming the device or the package and
    the next step; a unified box has neither line."""
    publish(migrated, "stopped")
    assert not [r for r in diagnose(migrated, Engine()).results
                if r.id in ("appliance.kv_transfer", "appliance.ib_devices")]
    ib = tmp_path / "infiniband" / "mlx5_0" / "ports" / "1"
    ib.mkdir(parents=True)
    (ib / "state").write_text("1: DOWN\n")
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("#!/bin/sh\necho \"ModuleNotFoundError: No module named 'mooncake'\" >&2\n"
                      "exit 1\n")
    python.chmod(0o755)
    decode = dataclasses.replace(
        migrated, engine=dataclasses.replace(migrated.engine, venv=tmp_path / "venv"),
        cell=dataclasses.replace(migrated.cell, role="decode", ib_device="mlx5_0,mlx5_1"))
    report = asyncio.run(run_doctor(decode, gpus=FakeGpus(8), ib_sysfs=tmp_path / "infiniband",
                                    engine_transport=httpx.MockTransport(Engine())))
    found = {r.id: r for r in report.results}
    nic, lib = found["appliance.ib_devices"], found["appliance.kv_transfer"]
    assert nic.level is Level.CRITICAL and "mlx5_1" in nic.summary and "ibv_devices" in nic.hint
    assert lib.level is Level.CRITICAL and "mooncake" in lib.summary
    assert "mooncake-transfer-engine-cuda13==0.3.14" in lib.hint
    assert "RDMA devices: cell.ib_device names mlx5_1" in render(report)
    (tmp_path / "infiniband" / "mlx5_1" / "ports" / "1").mkdir(parents=True)
    (tmp_path / "infiniband" / "mlx5_1" / "ports" / "1" / "state").write_text("4: ACTIVE\n")
    again = asyncio.run(run_doctor(decode, gpus=FakeGpus(8), ib_sysfs=tmp_path / "infiniband",
                                   engine_transport=httpx.MockTransport(Engine())))
    nic = {r.id: r for r in again.results}["appliance.ib_devices"]
    assert nic.level is Level.CRITICAL and "no port up on mlx5_0" in nic.summary
