"""A prefill or decode launch's own preflight (appliance.engine.pd_host): the transfer
library imported by the engine environment's python (a real child process: a stub python
that fails the import, one that passes), the RDMA devices in a fake /sys/class/infiniband
tree, and the engine unit's RDMA drop-in; then the same through `gather_facts` and the
preflight's verdicts, which block the launch."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

from appliance.config import CellConfig, Config, EngineConfig
from appliance.engine import pd_host
from appliance.engine.preflight import blocking, evaluate, gather_facts
from appliance.testing.fake_gpus import FakeGpus


def sysfs(root: Path, devices: dict[str, dict[str, str]]) -> Path:
    """/sys/class/infiniband as the kernel lays it out: DEVICE/ports/N/state."""
    root.mkdir(parents=True, exist_ok=True)
    for name, ports in devices.items():
        for port, state in ports.items():
            (root / name / "ports" / port).mkdir(parents=True, exist_ok=True)
            (root / name / "ports" / port / "state").write_text(state + "\n")
    return root


def engine_python(venv: Path, importable: bool) -> Path:
    """A stand-in for the engine venv's bin/python: a real script that fails `import X` the
    way python does (ModuleNotFoundError on stderr, exit 1), or passes."""
    python = venv / "bin" / "python"
    python.parent.mkdir(parents=True, exist_ok=True)
    body = "exit 0" if importable else (
        'echo "Traceback (most recent call last):" >&2\n'
        "echo \"ModuleNotFoundError: No module named 'mooncake'\" >&2\nexit 1")
    python.write_text(f"#!/bin/sh\n{body}\n")
    python.chmod(0o755)
    return python


def by_name(findings: tuple[pd_host.Finding, ...]) -> dict[str, pd_host.Finding]:
    return {f.name: f for f in findings}


UP = {"1": "4: ACTIVE"}
DOWN = {"1": "1: DOWN"}


def test_a_unified_box_has_no_pd_checks(tmp_path: Path) -> None:
    facts = pd_host.gather("unified", "mooncake", "mlx5_0", python=tmp_path / "none",
                           sysfs=tmp_path / "absent", dropin=tmp_path / "rdma.conf")
    assert pd_host.evaluate(facts) == ()


def test_an_engine_environment_without_the_transfer_library_is_refused_by_name(
        tmp_path: Path) -> None:
    python = engine_python(tmp_path / "venv", importable=False)
    facts = pd_host.gather("decode", "mooncake", "mlx5_0", python=python,
                           sysfs=sysfs(tmp_path / "ib", {"mlx5_0": UP}))
    found = by_name(pd_host.evaluate(facts))["kv_transfer"]
    assert not found.ok and found.blocking
    assert "cannot import mooncake.engine" in found.message
    assert "No module named 'mooncake'" in found.message
    assert f"{python} -m pip install 'mooncake-transfer-engine-cuda13==0.3.14'" in found.hint


def test_nixl_names_its_own_package_and_says_mooncake_needs_nothing(tmp_path: Path) -> None:
    python = engine_python(tmp_path / "venv", importable=False)
    facts = pd_host.gather("prefill", "nixl", "", python=python, sysfs=tmp_path / "absent")
    found = by_name(pd_host.evaluate(facts))["kv_transfer"]
    assert "nixl._api" in found.message and "'nixl-cu13==1.5.1'" in found.hint
    assert 'cell.transfer_backend = "mooncake" needs nothing more' in found.hint


def test_a_real_python_imports_what_it_has_and_not_what_it_lacks() -> None:
    python = Path(sys.executable)
    assert pd_host.try_import(python, "json") is None
    error = pd_host.try_import(python, "mooncake.engine")
    assert error is not None and "mooncake" in error


def test_a_present_library_and_active_devices_pass(tmp_path: Path) -> None:
    python = engine_python(tmp_path / "venv", importable=True)
    dropin = tmp_path / "rdma.conf"
    dropin.write_text("[Service]\n")
    facts = pd_host.gather("decode", "mooncake", "mlx5_0,mlx5_1", python=python,
                           sysfs=sysfs(tmp_path / "ib", {"mlx5_0": UP,
                                                         "mlx5_1": {**DOWN, "2": "4: ACTIVE"}}),
                           dropin=dropin)
    assert all(f.ok for f in pd_host.evaluate(facts)), pd_host.evaluate(facts)


@pytest.mark.parametrize(("tree", "ib_device", "expected"), [
    pytest.param(None, "mlx5_0", "does not exist, so SGLang refuses", id="no-sysfs"),
    pytest.param({"mlx5_0": UP}, "mlx5_0,mlx5_3", "names mlx5_3, not in", id="missing"),
    pytest.param({"mlx5_0": DOWN}, "mlx5_0", "no port up on mlx5_0: mlx5_0 port 1 is 1: DOWN",
                 id="link-down"),
    pytest.param({"mlx5_0": UP}, '{"0": "mlx5_0", "1": "mlx5_9"}', "names mlx5_9",
                 id="per-gpu-json"),
])
def test_a_named_device_missing_or_down_blocks_and_names_it(
        tmp_path: Path, tree: dict[str, dict[str, str]] | None, ib_device: str,
        expected: str) -> None:
    root = sysfs(tmp_path / "ib", tree) if tree is not None else tmp_path / "absent"
    facts = pd_host.gather("prefill", "mooncake", ib_device, python=None, sysfs=root)
    found = by_name(pd_host.evaluate(facts))["ib_devices"]
    assert not found.ok and found.blocking
    assert expected in found.message, found.message
    assert found.hint


def test_no_named_device_and_none_up_is_a_warning_not_a_refusal(tmp_path: Path) -> None:
    facts = pd_host.gather("decode", "mooncake", "", python=None,
                           sysfs=sysfs(tmp_path / "ib", {"mlx5_0": DOWN}))
    found = by_name(pd_host.evaluate(facts))["ib_devices"]
    assert not found.ok and not found.blocking
    assert "mlx5_0" in found.message


def test_a_missing_rdma_drop_in_blocks_under_systemd(tmp_path: Path) -> None:
    facts = pd_host.gather("decode", "mooncake", "", python=None, sysfs=tmp_path / "absent",
                           dropin=tmp_path / "rdma.conf")
    found = by_name(pd_host.evaluate(facts))["rdma_unit"]
    assert not found.ok and found.blocking and "installer" in found.hint


def test_the_launch_preflight_refuses_a_decode_box_lacking_the_library(tmp_path: Path) -> None:
    """Through gather_facts, as the supervisor calls it before every launch: the role given
    (the head's choice) is the one checked, and the verdict blocks."""
    venv = tmp_path / "venv"
    engine_python(venv, importable=False)
    config = Config(engine=EngineConfig(venv=venv, runner="process"),
                    cell=CellConfig(ib_device="mlx5_0"))
    tree = sysfs(tmp_path / "ib", {"mlx5_0": UP})
    unified = evaluate(gather_facts(config, FakeGpus(), ib_sysfs=tree), config)
    assert not {c.name for c in unified} & {"kv_transfer", "ib_devices", "rdma_unit"}
    checks = evaluate(gather_facts(config, FakeGpus(), ib_sysfs=tree, role="decode"), config)
    [refused] = [c for c in blocking(checks) if c.name == "kv_transfer"]
    assert "mooncake-transfer-engine-cuda13" in refused.hint
    assert "rdma_unit" not in {c.name for c in checks}  # a process runner has no unit
    fixed = dataclasses.replace(config, engine=dataclasses.replace(config.engine, venv=None))
    assert not [c for c in blocking(evaluate(gather_facts(fixed, FakeGpus(), ib_sysfs=tree,
                                                          role="decode"), fixed))
                if c.name in ("kv_transfer", "ib_devices")]
