"""The production runner: `appliance-engine.service`, started and stopped through systemctl.

The daemon writes the launch spec atomically to `<state_dir>/engine/launch-spec.json`; the
unit's ExecStart (`appliance engine exec-spec`) reads it and execs SGLang, whose output the
unit appends to `/var/log/appliance-engine/engine.log` (`UNIT_LOG`: a directory the daemon
may read but not write, because the service manager opens that file as root). The unit has
no Restart=: this daemon is the one restart brain. Identity is the unit's InvocationID plus
its main pid and start time, so a restarted daemon adopts exactly the engine it launched.
polkit lets the daemon's user start, stop and signal this one unit (installer issue).

Invariants:
- a launch never writes the spec file while the unit runs (a `systemctl start` of an active
  unit does nothing, so the new spec would not be what runs), so the spec file is what the
  running invocation read, unless someone edits it by hand;
- after a start the runner records `{invocation_id, spec_hash, pid, started_at}` in
  `<state_dir>/engine/engine-unit.json`; `find()` trusts the spec hash only for that
  invocation, and otherwise only a spec file older than the unit's main process;
- nothing is signalled unless the unit's InvocationID is the identity's.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import psutil

from appliance.atomic import write_atomic
from appliance.engine.args import LaunchSpec
from appliance.engine.runner import EngineIdentity, process_read_bytes, same_process
from appliance.errors import ApplianceError

UNIT = "appliance-engine.service"
# The unit's StandardOutput=append: path (systemd/appliance-engine.service; a test holds the
# two together). Not under paths.log_dir: PID 1 opens it as root, following symlinks, so it
# must lie where the daemon's user cannot plant one.
UNIT_LOG = Path("/var/log/appliance-engine/engine.log")
SHOW_PROPS = "MainPID,ExecMainPID,InvocationID,ActiveState,SubState,ExecMainStatus,ExecMainCode"
RUNNING = ("active", "activating", "deactivating", "reloading")
# ExecMainCode is the si_code of the main process's end (waitid(2)): exited, killed, dumped.
CLD_EXITED, CLD_KILLED, CLD_DUMPED = "1", "2", "3"
CALL_TIMEOUT = 60.0
# `start` waits for the job, which waits for nvidia-persistenced/fabricmanager (After=).
START_TIMEOUT = 300.0
SETTLE_SECONDS = 10.0  # how long to wait for systemd to record an end we caused
# psutil's create_time rests on the whole-second boot time: a file written just before the
# process started can look up to a second younger than it.
CLOCK_SLACK = 2.0


class SystemdRunner:
    name = "systemd"

    def __init__(self, state_dir: Path, log_path: Path, systemctl: str = "systemctl") -> None:
        self.spec_path = state_dir / "engine" / "launch-spec.json"
        self.record_path = state_dir / "engine" / "engine-unit.json"
        self.log_path = log_path
        self.systemctl = systemctl

    # --- systemctl ------------------------------------------------------------------------

    def _run(self, *args: str, timeout: float = CALL_TIMEOUT) -> str:
        command = " ".join([self.systemctl, *args])
        try:
            done = subprocess.run([self.systemctl, *args], capture_output=True, text=True,
                                  timeout=timeout, check=False)
        except FileNotFoundError:
            raise ApplianceError(
                "systemctl_missing",
                f"`{command}` could not run: there is no {self.systemctl} on this host",
                "engine.runner = \"systemd\" needs a systemd host with appliance-engine.service "
                "installed; for development, the demo or CI set engine.runner = \"process\"",
            ) from None
        except OSError as exc:
            raise ApplianceError(
                "systemctl_failed", f"`{command}` could not run: {exc.strerror or exc}",
                "is this a systemd host? for development set engine.runner = \"process\"",
            ) from None
        except subprocess.TimeoutExpired:
            raise ApplianceError(
                "systemctl_timeout", f"`{command}` did not finish within {timeout:.0f} s",
                f"systemd may still be working on it: see `systemctl status {UNIT}` and "
                "`systemctl list-jobs`",
            ) from None
        if done.returncode != 0:
            raise ApplianceError(
                "systemctl_failed",
                f"`{command}` failed (exit {done.returncode}): "
                f"{done.stderr.strip() or 'no message'}",
                f"check `systemctl status {UNIT}` and that the installer set up the polkit "
                f"rule letting this daemon's user manage {UNIT}",
            )
        return done.stdout

    def show(self) -> dict[str, str]:
        out = self._run("show", "-p", SHOW_PROPS, UNIT)
        props: dict[str, str] = {}
        for line in out.splitlines():
            key, sep, value = line.partition("=")
            if sep:
                props[key] = value
        return props

    # --- identity -------------------------------------------------------------------------

    @staticmethod
    def _main(props: dict[str, str]) -> tuple[int, float] | None:
        """The unit's live main process as (pid, start time), if it has one."""
        if props.get("ActiveState") not in RUNNING:
            return None
        pid = _int(props.get("MainPID"))
        if pid <= 0:
            return None
        try:
            proc = psutil.Process(pid)
            if proc.status() == psutil.STATUS_ZOMBIE:
                return None
            return pid, proc.create_time()
        except psutil.Error:
            return None

    def _record(self) -> EngineIdentity | None:
        try:
            return EngineIdentity.from_json(self.record_path.read_text())
        except (OSError, ValueError, TypeError):
            return None

    def _settle(self, props: dict[str, str]) -> dict[str, str]:
        """Wait (bounded) while the unit is deactivating: its end is being recorded."""
        deadline = time.monotonic() + SETTLE_SECONDS
        while props.get("ActiveState") == "deactivating" and time.monotonic() < deadline:
            time.sleep(0.1)
            props = self.show()
        return props

    # --- the EngineRunner port ------------------------------------------------------------

    def engine_log(self, log_dir: Path) -> Path:
        """The unit's own log file, wherever the daemon's log directory is."""
        return self.log_path

    def launch(self, spec: LaunchSpec, log_path: Path) -> EngineIdentity:
        """Write the spec, start the unit, record the invocation. The unit appends its output
        to the log path the installer configured (`self.log_path`), whatever `log_path` is.

        An engine that dies right after its exec still gets an identity (alive() is False and
        exit_status() says how it ended), as with the process runner."""
        before = self._settle(self.show())
        if before.get("ActiveState") in RUNNING:
            raise ApplianceError(
                "engine_unit_busy",
                f"{UNIT} is already {before.get('ActiveState')} (main pid "
                f"{before.get('MainPID', '?')}, invocation {before.get('InvocationID') or '?'}); "
                "starting it again would not run the new launch spec",
                f"stop it first (`appliance engine stop`, or `systemctl stop {UNIT}` if the "
                "daemon does not know it)", status=409,
            )
        write_atomic(self.spec_path, spec.to_json().encode())
        self._run("start", UNIT, timeout=START_TIMEOUT)
        props = self.show()
        invocation = props.get("InvocationID", "")
        if not invocation or invocation == before.get("InvocationID", ""):
            raise ApplianceError(
                "engine_unit_not_running", f"`systemctl start {UNIT}` returned but the unit "
                f"shows no new invocation (state {props.get('ActiveState', '?')})",
                f"see `systemctl status {UNIT}`, `journalctl -u {UNIT}` and {self.log_path}",
            )
        main = self._main(props)
        pid, started = main if main is not None else (_int(props.get("ExecMainPID")), 0.0)
        ident = EngineIdentity(self.name, pid, started, spec.spec_hash, str(self.log_path),
                               invocation)
        write_atomic(self.record_path, ident.to_json().encode())
        return ident

    def find(self) -> EngineIdentity | None:
        """The running invocation with the spec it runs: the one this runner recorded at
        launch, or one started otherwise (by hand, or the daemon died before recording it)
        when the spec file predates its main process. None if the unit is not running or
        what it runs cannot be told."""
        if not self.spec_path.exists():
            return None  # this daemon never launched anything here: nothing of ours to adopt
        props = self.show()
        main = self._main(props)
        invocation = props.get("InvocationID", "")
        if main is None or not invocation:
            return None
        pid, started = main
        record = self._record()
        if record is not None and record.invocation_id == invocation:
            return EngineIdentity(self.name, pid, started, record.spec_hash,
                                  str(self.log_path), invocation)
        try:
            written = self.spec_path.stat().st_mtime
            spec = LaunchSpec.from_json(self.spec_path.read_text())
        except (OSError, ValueError):
            return None
        if written > started + CLOCK_SLACK:
            return None  # rewritten after the engine read it: it runs something else
        return EngineIdentity(self.name, pid, started, spec.spec_hash, str(self.log_path),
                              invocation)

    def alive(self, ident: EngineIdentity) -> bool:
        props = self.show()
        if props.get("InvocationID", "") != ident.invocation_id:
            return False
        main = self._main(props)
        return (main is not None and main[0] == ident.pid
                and same_process(ident.pid, ident.started_at) is not None)

    def exit_status(self, ident: EngineIdentity) -> int | None:
        props = self.show()
        if props.get("InvocationID", "") != ident.invocation_id:
            return None  # another invocation, or the unit was garbage-collected
        code = props.get("ExecMainCode", "")
        try:
            status = int(props.get("ExecMainStatus", ""))
        except ValueError:
            return None
        if code == CLD_EXITED:
            return status
        if code in (CLD_KILLED, CLD_DUMPED):
            return -status  # ExecMainStatus holds the signal number
        return None  # 0: the main process has not ended yet

    def terminate(self, ident: EngineIdentity) -> None:
        if not self.alive(ident):
            return
        try:
            self._run("kill", "--kill-whom=main", "--signal=SIGTERM", UNIT)
        except ApplianceError:
            if self.alive(ident):
                raise
            # It ended between the check and the signal ("No main process to kill").

    def kill(self, ident: EngineIdentity) -> None:
        props = self.show()
        if props.get("InvocationID", "") != ident.invocation_id:
            return  # never signal an invocation this identity is not
        if props.get("ActiveState") not in RUNNING:
            return
        try:
            self._run("kill", "--kill-whom=all", "--signal=SIGKILL", UNIT)
        except ApplianceError:
            if self.show().get("ActiveState") in RUNNING:
                raise
        # In case anything outlived SIGKILL; --no-block: a stop may wait TimeoutStopSec.
        self._run("stop", "--no-block", UNIT)
        deadline = time.monotonic() + SETTLE_SECONDS
        while time.monotonic() < deadline:
            props = self.show()
            if (props.get("InvocationID", "") != ident.invocation_id
                    or props.get("ActiveState") not in RUNNING):
                return
            time.sleep(0.1)

    def forget(self) -> None:
        """The spec file stays for the record; the invocation record goes."""
        self.record_path.unlink(missing_ok=True)

    def read_bytes(self, ident: EngineIdentity, pids: set[int]) -> int:
        """The processes' own counters when this daemon may read them; otherwise (the unit
        runs as its own user, so /proc/<pid>/io is closed to us) the unit's cgroup
        `IOReadBytes` (IOAccounting=yes), which counts reads from disk only, so a load from
        a pre-warmed page cache shows there as little progress."""
        counted = process_read_bytes(pids)
        if counted is not None:
            return counted
        try:
            out = self._run("show", "-p", "IOReadBytes", UNIT)
        except ApplianceError:
            return 0
        value = out.strip().partition("=")[2]
        # "[not set]" or 2^64-1 when accounting is off
        return _int(value) if _int(value) < 1 << 63 else 0


def _int(value: str | None) -> int:
    try:
        return int(value or 0)
    except ValueError:
        return 0
