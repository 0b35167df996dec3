"""`make demo` says on Ctrl-C what it leaves running (the engine emulator, by design) and how
to stop it; with nothing left, it says that instead."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import psutil

from appliance.atomic import write_atomic
from appliance.engine.runner import EngineIdentity
from appliance.testing.demo import farewell


def test_the_farewell_names_the_engine_left_running_and_how_to_stop_it(tmp_path: Path) -> None:
    assert farewell(tmp_path).endswith("No engine emulator is running.")
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        ident = EngineIdentity("process", child.pid, psutil.Process(child.pid).create_time(),
                               "hash", str(tmp_path / "engine.log"))
        write_atomic(tmp_path / "engine" / "engine.pid", ident.to_json().encode())
        said = farewell(tmp_path)
        assert f"the engine emulator (pid {child.pid})" in said
        assert f"`kill {child.pid}`" in said
        assert "the next `make demo` adopts it" in said
    finally:
        child.kill()
        child.wait()
    assert farewell(tmp_path).endswith("No engine emulator is running.")  # gone: not claimed
