"""SystemdRunner against a FAKE `systemctl`, with the engine emulator as the unit's engine.

CI has no systemd as PID 1, so the test writes a small `systemctl` (FAKE_SYSTEMCTL) that
keeps the unit's state in a JSON file beside itself and does what systemd does for
`appliance-engine.service`, as far as the runner can see: `start` runs the unit's ExecStart
(`python -m appliance engine exec-spec --spec ...`, the real command) detached, output appended
to the engine log, under a small supervisor that plays PID 1 (records MainPID and a fresh
InvocationID, waits for the main process, records ExecMainCode/ExecMainStatus, kills what is
left of the process group, marks the unit inactive or failed); `show -p`, `kill
--kill-whom=main|all --signal=...` and `stop [--no-block]` read and act on that state.

Covers: launch writes the spec atomically and records the invocation; a restarted daemon (a new
runner) adopts the same identity, never with a spec hash the unit does not run, and finds
nothing once the unit is inactive; a launch onto a running unit is refused; exit statuses
(crash, drain, SIGKILL, an engine dead right after its exec); terminate() signals the main
process only (the emulator drains and exits 0); kill() takes the whole group; systemctl
failures and a missing systemctl become clear errors; `appliance engine exec-spec` execs the
spec's argv with its environment and refuses a corrupt spec with exit 64.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import stat
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from appliance.atomic import write_atomic
from appliance.config import EngineConfig
from appliance.engine.args import LaunchInputs, LaunchSpec, build_launch_spec
from appliance.engine.runner import EngineIdentity
from appliance.engine.systemd_runner import UNIT, SystemdRunner
from appliance.errors import ApplianceError
from tests.conftest import free_port, run_cli, wait_for

DEADLINE = 30.0  # seconds any single wait may take on a loaded 2-core machine
# The engine program, as the installer lays it out: `<engines>/<build>/bin/sglang`, here a
# script that runs the engine emulator (exec-spec runs nothing outside the engines directory).
EMULATOR_SCRIPT = f"#!{sys.executable}\nimport runpy\n" \
    "runpy.run_module('appliance.testing.fake_sglang', run_name='__main__')\n"


def engine_program(engines: Path, text: str = EMULATOR_SCRIPT) -> Path:
    program = engines / "sglang-test" / "bin" / "sglang"
    program.parent.mkdir(parents=True, exist_ok=True)
    program.write_text(text)
    program.chmod(0o755)
    return program
READY_LINE = "The server is fired up and ready to roll!"

FAKE_SYSTEMCTL = r'''
"""A FAKE systemctl (tests/test_systemd_runner.py): what SystemdRunner calls, for one unit.

State lives in state.json beside this script, the unit's definition in unit.json (exec_start,
log, environment; `fail` makes the listed verbs fail like a polkit refusal; start_waits_for_exit
holds `start` until the engine has ended). `start` spawns `__supervise`, which plays PID 1."""
import contextlib
import ctypes
import fcntl
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
UNIT = "appliance-engine.service"
STATE = HERE / "state.json"
BLANK = {"MainPID": "0", "ExecMainPID": "0", "InvocationID": "", "ActiveState": "inactive",
         "SubState": "dead", "ExecMainStatus": "0", "ExecMainCode": "0", "pgid": 0,
         "supervisor": 0}
RUNNING = ("active", "activating", "deactivating")
CLEAN_SIGNALS = (signal.SIGHUP, signal.SIGINT, signal.SIGTERM, signal.SIGPIPE)


def unit():
    return json.loads((HERE / "unit.json").read_text())


def load():
    try:
        return {**BLANK, **json.loads(STATE.read_text())}
    except FileNotFoundError:
        return dict(BLANK)


def update(**changes):
    with open(HERE / "state.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        state = {**load(), **changes}
        tmp = HERE / f".state.{os.getpid()}"
        tmp.write_text(json.dumps(state))
        os.replace(tmp, STATE)
        return state


def wait_until(check, seconds):
    end = time.monotonic() + seconds
    state = load()
    while not check(state) and time.monotonic() < end:
        time.sleep(0.02)
        state = load()
    return state


def fail(message):
    print(message, file=sys.stderr)
    sys.exit(1)


def supervise(invocation):
    """PID 1's part: run ExecStart (Type=exec), wait for it, record its end, clean up."""
    ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: orphans come here
    config = unit()
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8",
           "INVOCATION_ID": invocation, **config.get("environment", {})}
    with open(config["log"], "ab") as log:
        try:
            main = subprocess.Popen(config["exec_start"], stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, env=env, cwd="/",
                                    start_new_session=True)
        except OSError as exc:
            log.write(f"fake systemd: failed to execute: {exc}\n".encode())
            update(ActiveState="failed", SubState="failed", ExecMainCode="1",
                   ExecMainStatus="203")
            return
    update(MainPID=str(main.pid), ExecMainPID=str(main.pid), ActiveState="active",
           SubState="running", pgid=main.pid)
    while True:
        pid, status = os.wait()
        if pid == main.pid:
            break
    if os.WIFSIGNALED(status):
        code = "3" if os.WCOREDUMP(status) else "2"
        number = os.WTERMSIG(status)
        clean = number in CLEAN_SIGNALS
    else:
        code, number = "1", os.WEXITSTATUS(status)
        clean = number == 0
    update(MainPID="0", ActiveState="deactivating", SubState="stop-sigkill",
           ExecMainCode=code, ExecMainStatus=str(number))
    # The main process is gone: what is left of the unit goes too (the cgroup's SIGKILL).
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(main.pid, signal.SIGKILL)
    import psutil

    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            child.kill()
    with contextlib.suppress(ChildProcessError):
        while True:
            os.wait()
    update(ActiveState="inactive" if clean else "failed", SubState="dead" if clean else "failed",
           pgid=0)


def start(config):
    state = wait_until(lambda s: s["ActiveState"] != "deactivating", 20)
    if state["ActiveState"] in RUNNING:
        return  # starting an active unit does nothing
    invocation = uuid.uuid4().hex
    update(InvocationID=invocation, ActiveState="activating", SubState="start", MainPID="0",
           ExecMainPID="0", ExecMainCode="0", ExecMainStatus="0")
    helper = subprocess.Popen([sys.executable, __file__, "__supervise", invocation],
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True)
    update(supervisor=helper.pid)
    state = wait_until(lambda s: s["ActiveState"] != "activating", 20)
    if state["ActiveState"] == "activating":
        fail(f"Job for {UNIT} timed out.")
    if state["ExecMainCode"] == "1" and state["ExecMainStatus"] == "203":
        fail(f"Job for {UNIT} failed because of unavailable resources or another system error."
             f'\nSee "systemctl status {UNIT}" and "journalctl -xeu {UNIT}" for details.')
    if config.get("start_waits_for_exit"):
        wait_until(lambda s: s["ActiveState"] not in RUNNING, 30)


def kill(options):
    whom = options.get("--kill-whom", "all")
    name = options.get("--signal", "SIGTERM")
    sig = signal.Signals[name if name.startswith("SIG") else "SIG" + name]
    state = load()
    main = int(state["MainPID"])
    if whom == "main":
        if main <= 0:
            fail(f"Failed to kill unit {UNIT}: No main process to kill")
        os.kill(main, sig)
    elif whom == "all":
        if state["ActiveState"] in RUNNING and state["pgid"]:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(state["pgid"], sig)
    else:
        fail(f"Invalid kill-whom: {whom}")


def stop(flags):
    state = load()
    main = int(state["MainPID"])
    if state["ActiveState"] in RUNNING and main > 0:
        os.kill(main, signal.SIGTERM)  # KillMode=mixed: SIGTERM to the main process only
    if "--no-block" in flags:
        return
    state = wait_until(lambda s: s["ActiveState"] not in RUNNING, 10)
    if state["ActiveState"] in RUNNING and state["pgid"]:  # TimeoutStopSec (shortened)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(state["pgid"], signal.SIGKILL)
        wait_until(lambda s: s["ActiveState"] not in RUNNING, 10)


def main(argv):
    if argv[:1] == ["__supervise"]:
        supervise(argv[1])
        return
    with open(HERE / "calls.log", "a") as calls:
        calls.write(json.dumps(argv) + "\n")
    config = unit()
    verb, rest = argv[0], argv[1:]
    refusal = config.get("fail")
    if refusal and verb in refusal["verbs"]:
        fail(refusal["message"])
    options, flags, units = {}, [], []
    while rest:
        token = rest.pop(0)
        if token == "-p":
            options["-p"] = rest.pop(0)
        elif token.startswith("--") and "=" in token:
            key, _, value = token.partition("=")
            options[key] = value
        elif token.startswith("-"):
            flags.append(token)
        else:
            units.append(token)
    for name in units:
        if name != UNIT:
            fail(f"Unit {name} not found.")
    if verb == "show":
        state = load()
        for prop in options["-p"].split(","):
            print(f"{prop}={state.get(prop, '')}")
    elif verb == "start":
        start(config)
    elif verb == "kill":
        kill(options)
    elif verb == "stop":
        stop(flags)
    else:
        fail(f"Unknown command verb '{verb}'.")


main(sys.argv[1:])
'''

# What `appliance engine exec-spec` runs in the CLI test instead of an engine: it writes down
# what it was started with, then exits with a status of its own.
ARGV_PROBE = """
import json, os, sys
from pathlib import Path
Path(__file__).with_name("probe.json").write_text(json.dumps({
    "argv": sys.argv[1:], "ppid": os.getppid(),
    "env": {k: v for k, v in os.environ.items()
            if k.startswith(("SGLANG_", "PYTHONUNBUFFERED", "NOTIFY_SOCKET"))}}))
sys.exit(7)
"""



def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@dataclasses.dataclass
class Host:
    """A temp 'box': state and log dirs, a config file, a tiny checkpoint, the fake systemctl."""

    root: Path

    def __post_init__(self) -> None:
        self.state_dir = self.root / "state"
        self.log_path = self.root / "log" / "engine.log"
        self.spec_path = self.state_dir / "engine" / "launch-spec.json"
        self.config_path = self.root / "appliance.toml"
        self.config_path.write_text(
            f'[paths]\nstate_dir = "{self.state_dir}"\nmodels_dir = "{self.root / "models"}"\n'
            f'log_dir = "{self.log_path.parent}"\n\n[engine]\nrunner = "process"\n')
        self.model_dir = self.root / "models" / "moonshotai--Kimi-K3"
        self.model_dir.mkdir(parents=True)
        (self.model_dir / "config.json").write_text(json.dumps({
            "model_type": "kimi_k3", "architectures": ["KimiK3ForConditionalGeneration"],
            "text_config": {"max_position_embeddings": 262144}}))
        header = b'{"__metadata__":{"format":"pt"}}'
        for i in (1, 2):
            (self.model_dir / f"model-0000{i}-of-00002.safetensors").write_bytes(
                len(header).to_bytes(8, "little") + header + os.urandom(64 * 1024))
        self.bin = self.root / "sysd"
        self.bin.mkdir()
        self.systemctl = self.bin / "systemctl"
        self.systemctl.write_text(f"#!{sys.executable}\n{FAKE_SYSTEMCTL}")
        self.systemctl.chmod(0o755)
        self.log_path.parent.mkdir(parents=True)
        self.engines = self.root / "engines"
        self.program = engine_program(self.engines)
        self.unit(exec_start=[sys.executable, "-m", "appliance", "--config",
                              str(self.config_path), "engine", "exec-spec", "--spec",
                              str(self.spec_path), "--engines-dir", str(self.engines)],
                  log=str(self.log_path))

    def unit(self, **changes: Any) -> None:
        path = self.bin / "unit.json"
        body = json.loads(path.read_text()) if path.exists() else {}
        path.write_text(json.dumps({**body, **changes}))

    def state(self) -> dict[str, Any]:
        path = self.bin / "state.json"
        return dict(json.loads(path.read_text())) if path.exists() else {}

    def calls(self) -> list[list[str]]:
        path = self.bin / "calls.log"
        lines = path.read_text().splitlines() if path.exists() else []
        return [json.loads(line) for line in lines]

    def runner(self) -> SystemdRunner:
        """A new runner each time: what a restarted daemon builds."""
        return SystemdRunner(self.state_dir, self.log_path, str(self.systemctl))

    def spec(self, *, load_seconds: float = 1, fault: str = "",
             operator_args: tuple[str, ...] = ()) -> LaunchSpec:
        defaults = EngineConfig()
        env = [("FAKE_SGLANG_LOAD_SECONDS", f"{load_seconds:g}")]
        if fault:
            env.append(("FAKE_SGLANG_FAULT", fault))
        return build_launch_spec((str(self.program),), LaunchInputs(
            model_path=self.model_dir, served_model_name="kimi-k3", port=free_port(),
            tp_size=2, dcp_size=2, mem_fraction_static=defaults.mem_fraction_static,
            mamba_full_memory_ratio=defaults.mamba_full_memory_ratio,
            kv_cache_dtype=defaults.kv_cache_dtype, speculative=False,
            operator_args=operator_args, extra_env=tuple(env)))

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def wait_log(self, text: str) -> None:
        def seen() -> bool:
            if self.state().get("ActiveState") in ("failed", "inactive"):
                pytest.fail(f"the engine ended before {text!r}:\n{self.log()[-3000:]}")
            return text in self.log()
        wait_for(seen, repr(text))

    def wait_settled(self) -> dict[str, Any]:
        """The unit's end is fully recorded (what systemd shows once the cgroup is empty)."""
        return dict(wait_for(lambda: self.state().get("ActiveState") in ("failed", "inactive")
                             and self.state(), "the unit to become inactive or failed"))

    def cleanup(self) -> None:
        """Kill whatever the fake unit still runs; let its supervisor reap and leave."""
        state = self.state()
        if state.get("pgid"):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(int(state["pgid"]), signal.SIGKILL)
        helper = int(state.get("supervisor") or 0)
        if helper:
            deadline = time.monotonic() + 10
            while not gone(helper) and time.monotonic() < deadline:
                time.sleep(0.05)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(helper, signal.SIGKILL)


@pytest.fixture
def host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Host]:
    for name in ("FAKE_SGLANG_FAULT", "FAKE_SGLANG_LOAD_SECONDS", "FAKE_SGLANG_GPU_STATE"):
        monkeypatch.delenv(name, raising=False)
    box = Host(tmp_path)
    try:
        yield box
    finally:
        box.cleanup()


def ended(runner: SystemdRunner, ident: EngineIdentity) -> int:
    wait_for(lambda: not runner.alive(ident), "the engine to end")
    code = runner.exit_status(ident)
    assert code is not None
    return code


# --- launch, adoption, drain -------------------------------------------------------------

def test_launch_adopt_and_terminate_drains_to_exit_0(host: Host) -> None:
    runner = host.runner()
    spec = host.spec()
    ident = runner.launch(spec, host.log_path)

    # The spec: whole, valid, the same spec back, not world-readable, no temp file left.
    text = host.spec_path.read_text()
    assert json.loads(text)["spec_hash"] == spec.spec_hash
    assert LaunchSpec.from_json(text) == spec
    assert stat.S_IMODE(host.spec_path.stat().st_mode) & 0o007 == 0
    assert sorted(p.name for p in host.spec_path.parent.iterdir()) == [
        "engine-unit.json", "launch-spec.json"]

    unit = host.state()
    assert [call[0] for call in host.calls()] == ["show", "start", "show"]
    assert ident.runner == "systemd"
    assert ident.invocation_id == unit["InvocationID"] and len(ident.invocation_id) == 32
    assert ident.pid == int(unit["MainPID"])
    assert ident.started_at == psutil.Process(ident.pid).create_time()
    assert ident.spec_hash == spec.spec_hash
    assert ident.log_path == str(host.log_path)
    # exec-spec execs the engine: the unit's main process becomes the emulator, same pid.
    # (the kernel puts the script's interpreter in front of its argv)
    wait_for(lambda: psutil.Process(ident.pid).cmdline()[1:] == spec.argv(), "exec-spec's exec")
    assert runner.alive(ident)
    assert runner.exit_status(ident) is None  # ExecMainCode=0: not ended

    # A restarted daemon adopts exactly this engine.
    assert host.runner().find() == ident

    # Identities of another invocation are never signalled.
    stranger = dataclasses.replace(ident, invocation_id="0" * 32)
    before = len(host.calls())
    host.runner().terminate(stranger)
    host.runner().kill(stranger)
    assert not [c for c in host.calls()[before:] if c[0] in ("kill", "stop")]
    assert runner.alive(ident)

    host.wait_log(READY_LINE)
    runner.terminate(ident)
    assert ["kill", "--kill-whom=main", "--signal=SIGTERM", UNIT] in host.calls()
    assert ended(runner, ident) == 0  # the emulator drained, then exited 0
    assert "Gracefully exiting... Remaining number of requests 0" in host.log()
    assert host.wait_settled()["ActiveState"] == "inactive"
    assert host.runner().find() is None
    # A second terminate (the unit has no main process now) is quiet.
    runner.terminate(ident)


def test_crash_during_load_is_exit_status_1(host: Host) -> None:
    runner = host.runner()
    ident = runner.launch(host.spec(fault="crash_at=50"), host.log_path)
    assert ended(runner, ident) == 1
    assert "scheduler died during initialization" in host.log()
    state = host.wait_settled()
    assert (state["ActiveState"], state["ExecMainCode"]) == ("failed", "1")
    assert host.runner().find() is None
    assert runner.exit_status(ident) == 1  # still known after the unit failed


def test_engine_dead_right_after_exec_still_gets_an_identity(host: Host) -> None:
    """The unit has failed before launch() looks: no exception, the status tells why."""
    host.unit(start_waits_for_exit=True)
    runner = host.runner()
    ident = runner.launch(host.spec(operator_args=("--no-such-flag", "1")), host.log_path)
    assert host.state()["ActiveState"] == "failed"
    assert ident.invocation_id == host.state()["InvocationID"]
    assert ident.pid == int(host.state()["ExecMainPID"]) and ident.started_at == 0.0
    assert not runner.alive(ident)
    # exec-spec's own check refuses the flag before SGLang would (argparse's exit 2)
    assert runner.exit_status(ident) == 64
    assert "--no-such-flag: unknown flag" in host.log()


def test_kill_takes_the_whole_group_and_reports_the_signal(host: Host) -> None:
    runner = host.runner()
    ident = runner.launch(host.spec(load_seconds=60), host.log_path)
    host.wait_log("Load weight begin")
    tree = [ident.pid, *(c.pid for c in psutil.Process(ident.pid).children(recursive=True))]
    assert len(tree) >= 3  # main, two TP ranks (and the detokenizer)
    runner.kill(ident)
    assert ["kill", "--kill-whom=all", "--signal=SIGKILL", UNIT] in host.calls()
    assert ["stop", "--no-block", UNIT] in host.calls()
    assert host.state()["ActiveState"] == "failed"  # kill() waited for the end to be recorded
    assert all(gone(pid) for pid in tree)
    assert not runner.alive(ident)
    assert runner.exit_status(ident) == -signal.SIGKILL  # ExecMainCode=2: killed, by 9
    before = len(host.calls())
    runner.kill(ident)  # nothing left: no signal, no stop
    assert [c[0] for c in host.calls()[before:]] == ["show"]


# --- which spec runs ---------------------------------------------------------------------

def test_find_never_claims_a_spec_the_unit_does_not_run(host: Host) -> None:
    runner = host.runner()
    first = host.spec(load_seconds=60)
    ident = runner.launch(first, host.log_path)
    assert host.runner().find() == ident

    # A second launch onto the running unit is refused, and the spec file is left alone.
    second = host.spec(load_seconds=30)
    with pytest.raises(ApplianceError) as refused:
        host.runner().launch(second, host.log_path)
    assert refused.value.code == "engine_unit_busy"
    assert "stop it first" in refused.value.hint
    assert LaunchSpec.from_json(host.spec_path.read_text()) == first
    assert sum(c == ["start", UNIT] for c in host.calls()) == 1

    # The spec file rewritten under the running unit: the recorded invocation's spec wins.
    write_atomic(host.spec_path, second.to_json().encode())
    adopted = host.runner().find()
    assert adopted is not None and adopted.spec_hash == first.spec_hash

    # No record of this invocation (the daemon died before writing it): only a spec file
    # older than the engine's main process tells what it runs.
    (host.state_dir / "engine" / "engine-unit.json").unlink()
    os.utime(host.spec_path, (ident.started_at + 10, ident.started_at + 10))
    assert host.runner().find() is None
    write_atomic(host.spec_path, first.to_json().encode())
    os.utime(host.spec_path, (ident.started_at - 10, ident.started_at - 10))
    assert host.runner().find() == ident
    host.spec_path.write_text("{ corrupt")
    assert host.runner().find() is None

    runner.kill(ident)
    write_atomic(host.spec_path, first.to_json().encode())
    assert host.runner().find() is None  # the unit is inactive


# --- systemctl failing -------------------------------------------------------------------

def test_a_refused_systemctl_names_the_command_and_points_at_polkit(host: Host) -> None:
    message = f"Failed to start {UNIT}: Interactive authentication required."
    host.unit(fail={"verbs": ["start"], "message": message})
    with pytest.raises(ApplianceError) as raised:
        host.runner().launch(host.spec(), host.log_path)
    error = raised.value
    assert error.code == "systemctl_failed"
    assert f"start {UNIT}" in error.message and message in error.message
    assert f"systemctl status {UNIT}" in error.hint and "polkit" in error.hint
    assert host.state().get("InvocationID", "") == ""  # nothing was started

    host.unit(fail={"verbs": ["show"], "message": "Failed to connect to bus: No medium found"})
    with pytest.raises(ApplianceError) as raised:
        host.runner().find()
    assert "show -p" in raised.value.message and "No medium found" in raised.value.message


def test_no_systemctl_says_to_use_the_process_runner(tmp_path: Path) -> None:
    runner = SystemdRunner(tmp_path / "state", tmp_path / "engine.log",
                           systemctl=str(tmp_path / "no-such" / "systemctl"))
    assert runner.find() is None  # never launched here: nothing to ask systemd about
    with pytest.raises(ApplianceError) as raised:
        runner.show()
    assert raised.value.code == "systemctl_missing"
    assert "no-such/systemctl" in raised.value.message
    assert 'engine.runner = "process"' in raised.value.hint


# --- the unit's ExecStart ----------------------------------------------------------------

def test_exec_spec_execs_the_argv_and_refuses_a_corrupt_spec(host: Host) -> None:
    probe = engine_program(host.root / "probe-engines", f"#!{sys.executable}\n{ARGV_PROBE}")
    spec = build_launch_spec((str(probe),), LaunchInputs(
        model_path=host.model_dir, served_model_name="kimi-k3", port=free_port(), tp_size=2,
        dcp_size=2, mem_fraction_static=0.9, mamba_full_memory_ratio=2.5,
        kv_cache_dtype="fp8_e4m3", speculative=True))
    spec_file = host.root / "spec.json"
    write_atomic(spec_file, spec.to_json().encode())
    cli = ("--config", str(host.config_path), "engine", "exec-spec", "--spec", str(spec_file),
           "--engines-dir", str(host.root / "probe-engines"))

    done = run_cli(*cli, env={"NOTIFY_SOCKET": "/run/systemd/notify"})
    assert done.returncode == 7, done.stderr  # the probe's own status: exec, not a child
    seen = json.loads((probe.parent / "probe.json").read_text())
    assert seen["argv"] == spec.argv()[1:]  # after the program
    assert seen["ppid"] == os.getpid()  # the CLI process became the probe
    assert seen["env"] == {"PYTHONUNBUFFERED": "1", "SGLANG_RAGGED_VERIFY_MODE": "static"}

    (probe.parent / "probe.json").unlink()
    tampered = json.loads(spec.to_json())
    tampered["argv"].append("--enable-lora")  # edited by hand: the hash no longer fits
    for text, why in (("{ not json", "not JSON"),
                      (json.dumps(tampered), "does not match its hash")):
        spec_file.write_text(text)
        done = run_cli(*cli)
        assert done.returncode == 64
        assert f"cannot use the launch spec {spec_file}" in done.stderr
        assert why in done.stderr
        assert not (probe.parent / "probe.json").exists()


def test_read_bytes_uses_the_units_cgroup_when_the_processes_are_not_readable(
        host: Host) -> None:
    """The engine unit runs as its own user, so /proc/<pid>/io is closed to the daemon: the
    load-progress bytes then come from the unit's IOReadBytes (IOAccounting=yes)."""
    runner = host.runner()
    ident = EngineIdentity(runner="systemd", pid=os.getpid(), started_at=0.0, spec_hash="",
                           log_path=str(host.log_path))
    assert runner.read_bytes(ident, {os.getpid()}) > 0  # readable: its own counters
    assert host.calls() == []
    (host.bin / "state.json").write_text(json.dumps({"IOReadBytes": "123456789"}))
    assert runner.read_bytes(ident, set()) == 123456789  # none readable: the cgroup's figure
    assert host.calls()[-1][:3] == ["show", "-p", "IOReadBytes"]
    (host.bin / "state.json").write_text(json.dumps({"IOReadBytes": str((1 << 64) - 1)}))
    assert runner.read_bytes(ident, set()) == 0  # accounting off: unknown, not 18 EB
