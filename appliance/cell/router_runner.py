"""How the head's daemon starts, restarts and stops SGLang's router (the port and its two
adapters), like `appliance.engine.runner` does for the engine.

- `SystemdRouterRunner` (production): `systemctl restart|stop|is-active
  appliance-router.service`. The unit's ExecStart names the spec file itself
  (`appliance cell exec-router --spec …`), so a restart is how a rewritten spec takes effect;
  polkit lets the daemon's user do these three things to this one unit.
- `ProcessRouterRunner` (development, the demo, CI): the spec's arguments under the same
  launcher exec-router uses (`router_exec.launch_argv`), the key read from the spec's key file
  and written to the router's stdin, never onto its command line, as a detached process with
  the spec's environment (`HF_HUB_OFFLINE=1`), output appended to `state_dir/router/router.log`. Its
  identity (pid and start time) is kept in `state_dir/router/router.pid`, so a restarted
  daemon finds the router it started and never signals a stranger with a reused pid. Stopped
  with SIGTERM to its process group, then SIGKILL after `grace` seconds.

A router restart is cheap (seconds) and never touches an engine. The calls block (a
subprocess, a wait), so the async methods run them in a thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import IO, Final, Protocol

import psutil

from appliance.atomic import write_atomic
from appliance.cell.router import RouterSpec
from appliance.cell.router_exec import launch_argv, read_key
from appliance.engine.runner import EngineIdentity, same_process
from appliance.errors import ApplianceError
from appliance.sdnotify import child_environment

UNIT: Final = "appliance-router.service"
CALL_TIMEOUT: Final = 60.0


class RouterRunner(Protocol):
    async def restart(self, spec_path: Path) -> None:
        """(Re)start the router from the spec at `spec_path`; raises ApplianceError when it
        could not be started."""
        ...

    async def stop(self) -> None: ...

    async def running(self) -> bool: ...


class SystemdRouterRunner:
    def __init__(self, systemctl: str = "systemctl") -> None:
        self.systemctl = systemctl

    def _run(self, *args: str) -> subprocess.CompletedProcess[str]:
        command = " ".join([self.systemctl, *args])
        try:
            return subprocess.run([self.systemctl, *args], capture_output=True, text=True,
                                  timeout=CALL_TIMEOUT, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise ApplianceError(
                "router_unit_failed", f"`{command}` could not run: {exc}",
                "the cell's router needs a systemd host with appliance-router.service "
                "installed; for development set engine.runner = \"process\"") from None

    def _act(self, verb: str) -> None:
        done = self._run(verb, UNIT)
        if done.returncode != 0:
            raise ApplianceError(
                "router_unit_failed", f"`systemctl {verb} {UNIT}` failed: "
                f"{(done.stderr or done.stdout).strip()[:300]}",
                f"see `systemctl status {UNIT}` and `journalctl -u {UNIT}`; the polkit rule "
                "must let the daemon's user start, stop and restart it")

    async def restart(self, spec_path: Path) -> None:
        await asyncio.to_thread(self._act, "restart")

    async def stop(self) -> None:
        await asyncio.to_thread(self._act, "stop")

    async def running(self) -> bool:
        done = await asyncio.to_thread(self._run, "is-active", "--quiet", UNIT)
        return done.returncode == 0


class ProcessRouterRunner:
    def __init__(self, state_dir: Path, *, grace: float = 10.0) -> None:
        self.pidfile = state_dir / "router" / "router.pid"
        self.log_path = state_dir / "router" / "router.log"
        self.grace = grace
        self._child: subprocess.Popen[bytes] | None = None

    def _found(self) -> EngineIdentity | None:
        try:
            ident = EngineIdentity.from_json(self.pidfile.read_text())
        except (OSError, ValueError, TypeError):
            return None
        if self._child is not None and self._child.pid == ident.pid \
                and self._child.poll() is not None:
            return None
        return ident if same_process(ident.pid, ident.started_at) is not None else None

    def _start(self, spec_path: Path) -> None:
        try:
            spec = RouterSpec.from_json(spec_path.read_text())
            key = read_key(Path(spec.key_file))
        except (OSError, ValueError) as exc:
            raise ApplianceError("router_spec_invalid", f"cannot start the router: {exc}",
                                 "the head's daemon rewrites the spec at its next poll") from None
        env = child_environment()
        env.update(dict(spec.env))
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log: IO[bytes]
        with self.log_path.open("ab") as log:
            proc = subprocess.Popen(
                launch_argv(spec), stdin=subprocess.PIPE, stdout=log,
                stderr=subprocess.STDOUT, env=env, start_new_session=True, close_fds=True)
        if proc.stdin is not None:  # the launcher reads one line, then closes its stdin
            with contextlib.suppress(BrokenPipeError):
                proc.stdin.write(key.encode() + b"\n")
            with contextlib.suppress(BrokenPipeError):
                proc.stdin.close()
        self._child = proc
        try:
            started = psutil.Process(proc.pid).create_time()
        except psutil.Error:  # it died at once: running() says so
            started = 0.0
        ident = EngineIdentity("process", proc.pid, started, spec.spec_hash, str(self.log_path))
        write_atomic(self.pidfile, ident.to_json().encode())

    def _stop(self) -> None:
        ident = self._found()
        if ident is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(ident.pid, signal.SIGTERM)
            deadline = time.monotonic() + self.grace
            while time.monotonic() < deadline and self._found() is not None:
                self._reap()
                time.sleep(0.05)
            if self._found() is not None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(ident.pid, signal.SIGKILL)
        self._reap()
        self.pidfile.unlink(missing_ok=True)

    def _reap(self) -> None:
        if self._child is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._child.wait(timeout=0.05)

    def _restart(self, spec_path: Path) -> None:
        self._stop()
        self._start(spec_path)

    async def restart(self, spec_path: Path) -> None:
        await asyncio.to_thread(self._restart, spec_path)

    async def stop(self) -> None:
        await asyncio.to_thread(self._stop)

    async def running(self) -> bool:
        return await asyncio.to_thread(self._found) is not None
