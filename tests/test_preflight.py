"""Preflight: the pure verdicts as a table, then the IO shell against real sockets, real
directories and a fake GPU port."""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from appliance.config import Config, EngineConfig, GpuConfig, PathsConfig
from appliance.engine.preflight import (
    GIB,
    Check,
    PortHolder,
    PreflightFacts,
    blocking,
    evaluate,
    gather_facts,
    model_dir,
)
from appliance.gpu import GpuSnapshot
from appliance.testing.fake_gpus import FakeGpus

CONFIG = Config()


def good_facts(**changes: object) -> PreflightFacts:
    facts = PreflightFacts(
        gpus=FakeGpus().snapshot(),
        own_pids=frozenset(),
        engine_port=30000,
        port_free=True,
        port_holder=None,
        port_error=None,
        model_dir=Path("/var/lib/appliance/models/moonshotai--Kimi-K3"),
        model_dir_exists=True,
        has_config_json=True,
        safetensors_count=96,
        weights_verified=True,
        models_free_bytes=500 * GIB,
        shm_total_bytes=1536 * GIB,
        shm_free_bytes=1536 * GIB,
    )
    return dataclasses.replace(facts, **changes)  # type: ignore[arg-type]


def snapshot_of(adjust: Callable[[FakeGpus], None], **fake: object) -> GpuSnapshot:
    gpus = FakeGpus(**fake)  # type: ignore[arg-type]
    adjust(gpus)
    return gpus.snapshot()


def failed(checks: tuple[Check, ...], name: str) -> Check:
    [check] = [c for c in checks if c.name == name]
    assert not check.ok, check
    return check


def test_all_good_means_every_check_passes() -> None:
    checks = evaluate(good_facts(), CONFIG)
    assert [c for c in checks if not c.ok] == []
    assert blocking(checks) == []
    assert {c.name for c in checks} == {
        "nvml", "gpu_count", "gpus_responding", "gpu_model", "gpu_processes", "gpu_memory",
        "engine_port", "weights_present", "weights_verified", "shm", "models_volume"}


def _no_driver(g: FakeGpus) -> None:
    g.fail()


def _lose_one(g: FakeGpus) -> None:
    g.remove_gpu(7)


def _lost(g: FakeGpus) -> None:
    g.lose_gpu(4)


def _foreign(g: FakeGpus) -> None:
    g.add_process(0, 4242, 80 * GIB, "python3")
    g.add_process(1, 4242, 80 * GIB, "python3")
    g.add_process(2, 5151, 0)


def _unexplained(g: FakeGpus) -> None:
    g.set_memory_used(6, 40 * GIB)


# name, facts, failing check, severity, text in the message, text in the hint
CASES = [
    ("nvml unavailable", good_facts(gpus=snapshot_of(_no_driver)), "nvml", "error",
     "NVIDIA driver not loaded", "modprobe"),
    ("a gpu missing", good_facts(gpus=snapshot_of(_lose_one)), "gpu_count", "error",
     "found 7 GPU(s), expected 8", "gpu.expected_count"),
    ("more gpus", good_facts(gpus=snapshot_of(lambda g: None, count=9)), "gpu_count",
     "warning", "found 9 GPUs", "gpu.expected_count"),
    ("a gpu lost", good_facts(gpus=snapshot_of(_lost)), "gpus_responding", "error",
     "GPU 4: GPU is lost", "Xid 79"),
    ("wrong model", good_facts(gpus=snapshot_of(lambda g: None, name="NVIDIA H100 80GB HBM3")),
     "gpu_model", "error", "GPU 0 is 'NVIDIA H100 80GB HBM3'", "gpu.expected_model"),
    ("foreign processes", good_facts(gpus=snapshot_of(_foreign)), "gpu_processes", "error",
     "pid 4242 (python3) on GPU 0, 1 (160.0 GiB); pid 5151 on GPU 2 (memory not reported)",
     "never stops processes it did not start"),
    ("unexplained memory", good_facts(gpus=snapshot_of(_unexplained)), "gpu_memory",
     "warning", "GPU 6: 40.0 GiB in use", "containers"),
    ("port held by a stranger",
     good_facts(port_free=False, port_holder=PortHolder(999, "sglang", "sglang serve --port "
                                                                        "30000")),
     "engine_port", "error", "held by pid 999 (sglang), which this appliance did not start",
     "never stops processes it did not start"),
    ("port held, holder invisible", good_facts(port_free=False, port_holder=PortHolder(None)),
     "engine_port", "error", "cannot see", "ss -ltnp"),
    ("port holder unknown", good_facts(port_free=False), "engine_port", "error",
     "cannot see", "engine.port"),
    ("port held by our own engine",
     good_facts(port_free=False, port_holder=PortHolder(321, "python"),
                own_pids=frozenset({321})),
     "engine_port", "error", "an engine this appliance started (pid 321", "wait for it"),
    ("port not bindable", good_facts(port_free=False, port_error="Permission denied"),
     "engine_port", "error", "Permission denied", "engine.port"),
    ("no model dir", good_facts(model_dir_exists=False, has_config_json=False,
                                safetensors_count=0),
     "weights_present", "error", "does not exist", "download the weights"),
    ("no config.json", good_facts(has_config_json=False), "weights_present", "error",
     "lacks config.json", "download the weights"),
    ("no shards", good_facts(safetensors_count=0), "weights_present", "error",
     "lacks any *.safetensors shard", "download the weights"),
    ("no manifest", good_facts(weights_verified=None), "weights_verified", "error",
     "have no manifest", "appliance weights pull"),
    ("not verified", good_facts(weights_verified=False), "weights_verified", "error",
     "are not verified", "download the damaged shards"),
    ("service says why", good_facts(weights_verified=False, weights_detail="3 of 9 files of "
                                    "x are not verified yet", weights_hint="let the pull "
                                    "finish"), "weights_verified", "error",
     "3 of 9 files", "let the pull finish"),
    ("small shm", good_facts(shm_total_bytes=GIB // 16, shm_free_bytes=GIB // 16), "shm",
     "warning", "67.11 MB free", "remount"),
    ("unreadable shm", good_facts(shm_total_bytes=None, shm_free_bytes=None), "shm", "warning",
     "could not be read", "/dev/shm"),
    ("models volume full", good_facts(models_free_bytes=GIB), "models_volume", "warning",
     "only 1.07 GB free", "free space"),
    ("models volume unreadable", good_facts(models_free_bytes=None), "models_volume",
     "warning", "could not be read", "free space"),
]


@pytest.mark.parametrize(("facts", "name", "severity", "message", "hint"),
                         [case[1:] for case in CASES], ids=[case[0] for case in CASES])
def test_each_problem_fails_its_check(facts: PreflightFacts, name: str, severity: str,
                                      message: str, hint: str) -> None:
    checks = evaluate(facts, CONFIG)
    check = failed(checks, name)
    assert check.severity == severity
    assert message in check.message
    assert hint in check.hint
    assert (check in blocking(checks)) == (severity == "error")
    others = [c for c in checks if not c.ok and c.name != name]
    assert others == [], "one problem, one failed check"


def test_own_processes_on_the_gpus_are_fine() -> None:
    facts = good_facts(gpus=snapshot_of(_foreign), own_pids=frozenset({4242, 5151}))
    assert blocking(evaluate(facts, CONFIG)) == []


def test_no_gpus_expected_turns_nvml_errors_into_a_warning() -> None:
    config = Config(gpu=GpuConfig(expected_count=0))
    checks = evaluate(good_facts(gpus=snapshot_of(_no_driver)), config)
    assert blocking(checks) == []
    assert failed(checks, "nvml").severity == "warning"
    checks = evaluate(good_facts(gpus=snapshot_of(_lose_one)), config)
    assert [c for c in checks if not c.ok] == []  # 7 GPUs: count not checked


def test_empty_expected_model_skips_the_model_check() -> None:
    config = Config(gpu=GpuConfig(expected_model=""))
    facts = good_facts(gpus=snapshot_of(lambda g: None, name="Some Other GPU"))
    checks = evaluate(facts, config)
    assert blocking(checks) == [] and "gpu_model" not in {c.name for c in checks}


def test_every_failure_names_a_next_step() -> None:
    for case in CASES:
        for check in evaluate(case[1], CONFIG):
            assert check.ok or check.hint, check


# --- gather_facts ------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def config_for(root: Path, port: int, model: str = "moonshotai/Kimi-K3") -> Config:
    return Config(
        paths=PathsConfig(state_dir=root / "state", models_dir=root / "models",
                          log_dir=root / "log"),
        engine=EngineConfig(port=port, model=model),
    )


@pytest.fixture
def listener() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield int(sock.getsockname()[1])


def test_a_held_port_names_its_holder(tmp_path: Path, listener: int) -> None:
    facts = gather_facts(config_for(tmp_path, listener), FakeGpus())
    assert not facts.port_free and facts.port_error is None
    assert facts.port_holder is not None
    assert facts.port_holder.pid == os.getpid()
    assert facts.port_holder.name
    check = failed(evaluate(facts, CONFIG), "engine_port")
    assert f"pid {os.getpid()}" in check.message and str(listener) in check.message


def test_a_free_port_is_free(tmp_path: Path) -> None:
    facts = gather_facts(config_for(tmp_path, free_port()), FakeGpus())
    assert facts.port_free and facts.port_holder is None and facts.port_error is None


def test_a_cell_box_binds_its_listen_address_and_one_it_lacks_is_named(tmp_path: Path) -> None:
    import dataclasses

    from appliance.config import CellConfig

    def at(address: str) -> Config:
        return dataclasses.replace(config_for(tmp_path, free_port()),
                                   cell=CellConfig(role="decode", listen_address=address))

    facts = gather_facts(at("127.0.0.2"), FakeGpus())  # another loopback address: bindable
    assert facts.engine_host == "127.0.0.2" and facts.port_free
    # TEST-NET-1 (RFC 5737) is never an address of this box: the bind fails, and says where.
    facts = gather_facts(at("192.0.2.7"), FakeGpus())
    assert not facts.port_free and facts.port_error is not None
    check = failed(evaluate(facts, CONFIG), "engine_port")
    assert f"on 192.0.2.7: {facts.port_error}" in check.message
    assert "cell.listen_address" in check.hint


def test_model_directory_cases(tmp_path: Path) -> None:
    config = config_for(tmp_path, free_port(), model="org/name")
    where = model_dir(config)
    assert where == tmp_path / "models" / "org--name"

    facts = gather_facts(config, FakeGpus())
    assert (facts.model_dir, facts.model_dir_exists) == (where, False)
    assert facts.models_free_bytes is not None  # measured on the nearest existing parent

    where.mkdir(parents=True)
    (where / "model-00001-of-00002.safetensors").write_bytes(b"x")
    facts = gather_facts(config, FakeGpus())
    assert facts.model_dir_exists and not facts.has_config_json
    assert facts.safetensors_count == 1

    (where / "config.json").write_text("{}")
    (where / "model-00002-of-00002.safetensors").write_bytes(b"x")
    (where / "notes.txt").write_text("not a shard")
    facts = gather_facts(config, FakeGpus(), weights_verified=True)
    assert facts.has_config_json and facts.safetensors_count == 2
    assert facts.weights_verified is True
    assert [c.name for c in evaluate(facts, CONFIG) if c.name.startswith("weights") and c.ok] \
        == ["weights_present", "weights_verified"]


def test_shm_is_measured(tmp_path: Path) -> None:
    facts = gather_facts(config_for(tmp_path, free_port()), FakeGpus(), shm_path=tmp_path)
    assert facts.shm_total_bytes and facts.shm_free_bytes is not None
    facts = gather_facts(config_for(tmp_path, free_port()), FakeGpus(),
                         shm_path=tmp_path / "absent")
    assert facts.shm_total_bytes is None and facts.shm_free_bytes is None


def test_own_pids_include_their_children(tmp_path: Path) -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        facts = gather_facts(config_for(tmp_path, free_port()), FakeGpus(),
                             own_pids=[os.getpid()])
        assert {os.getpid(), child.pid} <= facts.own_pids
    finally:
        child.kill()
        child.wait()


def test_a_hung_gpu_does_not_hang_the_preflight(tmp_path: Path) -> None:
    gpus = FakeGpus()
    gpus.hang(5)
    try:
        facts = gather_facts(config_for(tmp_path, free_port()), gpus, gpu_timeout_s=0.2)
    finally:
        gpus.unhang()
    check = failed(evaluate(facts, CONFIG), "nvml")
    assert check.severity == "error" and "did not answer within 0.2 s" in check.message
