"""`make demo-cell` (appliance.testing.demo_cell): its smoke run starts a cell of three boxes
(a prefill head and two decode members, each its own daemon, emulator and pretend GPUs), the
head's real sglang-router and its gateway, joins the members through the daemons' admin API,
sees one chat completion through the cell, and stops everything it started: no engine, router
or daemon of the cell is left. And the boxes' configuration files load as the daemons load
them, one cell's ports never repeating, and a second run finds the same ports.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from appliance.config import load_config
from appliance.testing.demo_cell_boxes import (
    GATEWAY_PORT,
    box_toml,
    plan_layout,
    port_picker,
    read_layout,
)
from tests.test_cell_engine import ROUTER_MISSING


def cell_processes(root: Path) -> list[str]:
    """Processes of this cell still alive: anything whose command line or working files name
    its folder (daemons, emulators: their model path), and the router by its pidfile."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline", "status"]):
        try:
            if proc.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            if str(root) in " ".join(proc.info["cmdline"] or []):
                found.append(f"{proc.pid}: {' '.join(proc.info['cmdline'])}")
        except psutil.Error:
            continue
    pidfile = root / "head" / "state" / "router" / "router.pid"
    if pidfile.exists():
        found.append(f"the router's pidfile is left: {pidfile.read_text()}")
    return found


@pytest.mark.skipif(ROUTER_MISSING, reason="sglang-router is not installed (dev extra: pip "
                    "install -e '.[dev]'); the cell demo runs SGLang's own router")
def test_the_smoke_run_serves_a_chat_through_the_cell_and_leaves_nothing(tmp_path: Path) -> None:
    root = tmp_path / "cell"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("APPLIANCE_", "FAKE_SGLANG_"))}
    env["FAKE_SGLANG_LOAD_SECONDS"] = "1"
    done = subprocess.run(
        [sys.executable, "-m", "appliance.testing.demo_cell", "--smoke", "--root", str(root),
         "--timeout", "150"], capture_output=True, text=True, env=env, timeout=280,
        check=False)
    said = done.stdout + done.stderr
    assert done.returncode == 0, said
    verdicts = [line for line in said.splitlines() if line.startswith("demo-cell smoke:")]
    assert len(verdicts) == 1 and verdicts[0].startswith("demo-cell smoke: OK: a chat "
                                                         "completion"), said
    assert "decode-1 joined as member 1 (engine key handed over)" in said
    assert "decode-2 joined as member 2 (engine key handed over)" in said
    assert "nothing is left running" in said
    assert cell_processes(root) == [], said
    # Each box ran its own engine on its own pretend GPUs.
    for name in ("head", "decode-1", "decode-2"):
        assert (root / name / "state" / "fake-gpus.json").exists(), name
        assert (root / name / "log" / "engine.log").stat().st_size > 0, name


def test_the_boxes_configuration_loads_and_a_second_run_keeps_its_ports(
        tmp_path: Path) -> None:
    layout = plan_layout(tmp_path, port_picker(prefer=False))
    ports = [layout.gateway_port, layout.bootstrap_port, layout.router_port,
             *(p for box in layout.boxes for p in (box.console_port, box.engine_port))]
    assert len(set(ports)) == len(ports) and GATEWAY_PORT not in ports
    assert read_layout(tmp_path) is None  # nothing written yet
    for box in layout.boxes:
        box.directory.mkdir()
        box.config_path.write_text(box_toml(layout, box))
        config = load_config(box.config_path, dev=True, env={})
        assert (config.server.port, config.engine.port) == (box.console_port, box.engine_port)
        assert config.cell.role == box.role
        assert config.paths.state_dir == box.directory / "state" == box.state_dir
        assert config.engine.runner == "process"  # the emulator, as in `make demo`
    assert [b.role for b in layout.boxes] == ["prefill", "decode", "decode"]
    assert read_layout(tmp_path) == layout
