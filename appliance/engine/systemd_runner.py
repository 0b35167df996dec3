"""The production runner: `appliance-engine.service`, started and stopped through systemctl.

The daemon writes the launch spec atomically to `<state_dir>/engine/launch-spec.json`; the
unit's ExecStart (`appliance engine exec-spec`) reads it and execs SGLang, whose output the
unit appends to `<log_dir>/engine.log`. The unit has no Restart=: this daemon is the one
restart brain. Identity is the unit's InvocationID plus its main pid and start time, so a
restarted daemon adopts exactly the engine it launched. polkit lets the daemon's user start,
stop and signal this one unit (installer issue).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import psutil

from appliance.engine.args import LaunchSpec
from appliance.engine.runner import EngineIdentity, same_process, write_atomic
from appliance.errors import ApplianceError

UNIT = "appliance-engine.service"
SHOW_PROPS = "MainPID,InvocationID,ActiveState,SubState,ExecMainStatus,ExecMainCode"


class SystemdRunner:
    name = "systemd"

    def __init__(self, state_dir: Path, log_path: Path, systemctl: str = "systemctl") -> None:
        self.spec_path = state_dir / "engine" / "launch-spec.json"
        self.log_path = log_path
        self.systemctl = systemctl

    def _run(self, *args: str) -> str:
        try:
            done = subprocess.run([self.systemctl, *args], capture_output=True, text=True,
                                  timeout=60, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise ApplianceError(
                "systemctl_failed", f"`systemctl {' '.join(args)}` could not run: {exc}",
                "is this a systemd host? for development set engine.runner = \"process\"",
            ) from None
        if done.returncode != 0:
            raise ApplianceError(
                "systemctl_failed",
                f"`systemctl {' '.join(args)}` failed: {done.stderr.strip() or done.returncode}",
                f"check `systemctl status {UNIT}` and that the installer set up the polkit rule",
            )
        return done.stdout

    def show(self) -> dict[str, str]:
        out = self._run("show", "-p", SHOW_PROPS, UNIT)
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def _identity(self, props: dict[str, str], spec_hash: str) -> EngineIdentity | None:
        if props.get("ActiveState") not in ("active", "activating", "deactivating"):
            return None
        pid = int(props.get("MainPID", "0") or 0)
        if pid <= 0:
            return None
        try:
            started = psutil.Process(pid).create_time()
        except psutil.Error:
            return None
        return EngineIdentity(self.name, pid, started, spec_hash, str(self.log_path),
                              props.get("InvocationID", ""))

    def launch(self, spec: LaunchSpec, log_path: Path) -> EngineIdentity:
        write_atomic(self.spec_path, spec.to_json())
        self._run("start", UNIT)
        ident = self._identity(self.show(), spec.spec_hash)
        if ident is None:
            raise ApplianceError(
                "engine_unit_not_running", f"{UNIT} did not stay running after start",
                f"see `journalctl -u {UNIT}` and {self.log_path}",
            )
        return ident

    def find(self) -> EngineIdentity | None:
        try:
            spec = LaunchSpec.from_json(self.spec_path.read_text())
        except (OSError, ValueError, TypeError, KeyError):
            return None
        return self._identity(self.show(), spec.spec_hash)

    def alive(self, ident: EngineIdentity) -> bool:
        props = self.show()
        if props.get("InvocationID", "") != ident.invocation_id:
            return False
        return (props.get("ActiveState") in ("active", "activating", "deactivating")
                and same_process(ident.pid, ident.started_at) is not None)

    def exit_status(self, ident: EngineIdentity) -> int | None:
        props = self.show()
        if props.get("InvocationID", "") != ident.invocation_id:
            return None
        try:
            status = int(props.get("ExecMainStatus", ""))
        except ValueError:
            return None
        # ExecMainCode 2 = killed: ExecMainStatus holds the signal number.
        return -status if props.get("ExecMainCode") == "2" else status

    def terminate(self, ident: EngineIdentity) -> None:
        if self.alive(ident):
            self._run("kill", "--kill-whom=main", "--signal=SIGTERM", UNIT)

    def kill(self, ident: EngineIdentity) -> None:
        if self.show().get("InvocationID", "") == ident.invocation_id:
            self._run("kill", "--kill-whom=all", "--signal=SIGKILL", UNIT)
            self._run("stop", UNIT)

    def forget(self) -> None:
        """The spec stays for the record; nothing to drop (systemd keeps no pidfile)."""
