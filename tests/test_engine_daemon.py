"""The engine through the real daemon process, its API and its CLI.

Fault 2: kill -9 of the daemon while the engine loads — the engine keeps running, the
restarted daemon adopts it (same pid, no second engine) and its progress carries on to READY.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.conftest import free_port, run_cli
from tests.test_engine_lifecycle import write_model
from tests.test_server import Daemon, write_config

LOAD_SECONDS = "12"


def box_config(root: Path) -> Path:
    path = write_config(root)
    with path.open("a") as handle:
        handle.write(
            f'\n[engine]\nrunner = "process"\ncommand = ["{sys.executable}", "-m", '
            f'"appliance.testing.fake_sglang"]\nvenv = ""\nport = {free_port()}\n\n'
            "[gpu]\nexpected_count = 0\n"  # no NVML here: GPU checks become warnings
        )
    write_model(root / "models")
    return path


def engine_cli(config: Path, *args: str) -> dict[str, Any]:
    result = run_cli("--config", str(config), "engine", *args, "--json")
    assert result.returncode == 0, result.stderr
    body: dict[str, Any] = json.loads(result.stdout)
    return body


def wait_state(config: Path, wanted: set[str], timeout: float = 90) -> dict[str, Any]:
    end = time.monotonic() + timeout
    while True:
        status = engine_cli(config, "status")
        if status["state"] in wanted:
            return status
        assert time.monotonic() < end, f"engine stuck in {status['state']}: {status}"
        time.sleep(0.5)


def emulators(port: int) -> list[int]:
    """Engine main processes (session leaders) serving this port."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if "appliance.testing.fake_sglang" in cmdline and str(port) in cmdline:
            try:
                if os.getpgid(proc.pid) == proc.pid:
                    found.append(proc.pid)
            except ProcessLookupError:
                pass
    return found


@pytest.fixture
def box(tmp_path: Path) -> Path:
    config = box_config(tmp_path / "box")
    assert run_cli("--config", str(config), "migrate").returncode == 0
    # The engine refuses unproven weights: import the folder in place with its manifest
    # (no daemon runs yet, so the CLI runs the import itself).
    models = config.parent / "models"
    imported = run_cli("--config", str(config), "weights", "import",
                       str(models / "moonshotai--Kimi-K3"), "--manifest",
                       str(config.parent / "manifest-moonshotai--Kimi-K3.json"))
    assert imported.returncode == 0, imported.stdout + imported.stderr
    created = run_cli("--config", str(config), "admin", "create", "--username", "ops",
                      "--password-stdin", input="a sturdy passphrase\n")
    assert created.returncode == 0, created.stderr
    return config


def test_kill_9_daemon_while_loading_then_adopt(box: Path) -> None:
    env = {"FAKE_SGLANG_LOAD_SECONDS": LOAD_SECONDS}
    daemon = Daemon(box, env=env)
    daemon.wait_ready()
    port = daemon.settings.engine.port
    second = None
    daemons: list[Daemon] = []
    try:
        started = engine_cli(box, "start")
        assert started["pending"] == "start" or started["state"] in ("preflight", "launching")
        loading = wait_state(box, {"loading_weights"})
        pids = emulators(port)
        assert len(pids) == 1
        daemon.proc.send_signal(signal.SIGKILL)
        daemon.proc.wait(timeout=10)
        assert psutil.pid_exists(pids[0])  # the engine outlived the daemon

        second = Daemon(box, env=env)
        second.wait_ready()
        adopted = engine_cli(box, "status")
        assert adopted["adopted"] is True
        assert adopted["run_id"] == loading["run_id"]
        ready = wait_state(box, {"ready"})
        assert ready["log"]["ready"] is True
        assert emulators(port) == pids  # the same engine, and no second one

        # And while it serves: kill -9 again; the next daemon adopts a READY engine.
        second.proc.send_signal(signal.SIGKILL)
        second.proc.wait(timeout=10)
        third = Daemon(box, env=env)
        daemons.append(third)
        third.wait_ready()
        serving = wait_state(box, {"ready"})
        assert serving["adopted"] is True and serving["run_id"] == loading["run_id"]
        assert emulators(port) == pids
        refused = run_cli("--config", str(box), "engine", "stop")
        assert refused.returncode != 0 and "repeat with --yes" in refused.stderr
        stopped = engine_cli(box, "stop", "--yes")
        assert stopped["pending"] == "stop" or stopped["state"] in ("draining", "stopping")
        wait_state(box, {"stopped"})
        assert emulators(port) == []
    finally:
        for proc in (daemon, second, *daemons):
            if proc is not None and proc.proc.poll() is None:
                proc.stop()
        for pid in emulators(port):
            os.killpg(pid, signal.SIGKILL)


def test_parse_log_cli_reads_a_log_without_any_config(tmp_path: Path) -> None:
    sample = Path(__file__).parent / "data" / "engine_logs" / "k3_startup.sample.log"
    result = run_cli("engine", "parse-log", str(sample))
    assert result.returncode == 0, result.stderr
    assert "\N{MULTIPLICATION SIGN} DCP8 =" in result.stdout
    as_json = json.loads(run_cli("engine", "parse-log", str(sample), "--json").stdout)
    assert as_json["ready"] is True
    missing = run_cli("engine", "parse-log", str(tmp_path / "nope.log"))
    assert missing.returncode == 64 and "cannot read" in missing.stderr


def test_exec_spec_needs_no_config_and_refuses_a_corrupt_spec(tmp_path: Path) -> None:
    spec = tmp_path / "launch-spec.json"
    spec.write_text("{not json")
    result = run_cli("engine", "exec-spec", "--spec", str(spec))
    assert result.returncode == 64
    assert "cannot use the launch spec" in result.stderr and "configuration" not in result.stderr
