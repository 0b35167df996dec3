"""How an engine process is started, found again, signalled and observed.

Two runners share one port: `ProcessRunner` (development, the demo, CI: a detached process in
its own session and process group) and `SystemdRunner` (production: `appliance-engine.service`).
Both record an identity — what was launched (spec hash) and which process it is (pid plus its
start time, or the unit's invocation id) — so a restarted daemon can adopt the engine it finds
instead of starting a second one, and never signals a process it did not start.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Protocol

import psutil

from appliance.atomic import write_atomic
from appliance.engine.args import LaunchSpec
from appliance.sdnotify import child_environment

START_TIME_TOLERANCE = 0.05  # seconds; psutil rounds create_time


@dataclass(frozen=True)
class EngineIdentity:
    runner: str
    pid: int
    started_at: float  # the process's create_time (epoch seconds), to tell pid reuse apart
    spec_hash: str
    log_path: str
    invocation_id: str = ""

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> EngineIdentity:
        return cls(**json.loads(text))


class EngineRunner(Protocol):
    name: str

    def launch(self, spec: LaunchSpec, log_path: Path) -> EngineIdentity: ...

    def engine_log(self, log_dir: Path) -> Path:
        """Where this runner's engine writes its output, given the daemon's log directory."""
        ...

    def find(self) -> EngineIdentity | None:
        """The engine this runner launched earlier, if it is still running."""
        ...

    def alive(self, ident: EngineIdentity) -> bool: ...

    def exit_status(self, ident: EngineIdentity) -> int | None:
        """The exit status once it is gone (negative: killed by that signal); None if unknown."""
        ...

    def terminate(self, ident: EngineIdentity) -> None:
        """SIGTERM to the engine's main process only: SGLang drains, then exits."""
        ...

    def kill(self, ident: EngineIdentity) -> None:
        """SIGKILL to everything the engine started."""
        ...

    def forget(self) -> None:
        """The engine is gone for good: drop the record used for adoption."""
        ...

    def read_bytes(self, ident: EngineIdentity, pids: set[int]) -> int:
        """Bytes the engine has read so far (a load-progress signal); 0 when unknown."""
        ...


def same_process(pid: int, started_at: float) -> psutil.Process | None:
    """The live process `pid` if it is the one that started at `started_at` (not a reused pid)."""
    try:
        proc = psutil.Process(pid)
        if abs(proc.create_time() - started_at) > START_TIME_TOLERANCE:
            return None
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None
        return proc
    except psutil.Error:
        return None


def process_read_bytes(pids: set[int]) -> int | None:
    """Bytes read by these processes, page-cache hits included (`read_chars`: a pre-warmed
    checkpoint is read from memory, and that is progress too). None when none of them could
    be read: another user's /proc/<pid>/io needs ptrace rights this daemon does not have."""
    total, readable = 0, False
    for pid in pids:
        with contextlib.suppress(psutil.Error, AttributeError):
            total += psutil.Process(pid).io_counters().read_chars
            readable = True
    return total if readable else None


def tree_pids(pid: int) -> list[int]:
    """The process and all its descendants (for io counters and for stray checks)."""
    try:
        proc = psutil.Process(pid)
        return [pid, *(child.pid for child in proc.children(recursive=True))]
    except psutil.Error:
        return []


class ProcessRunner:
    """A detached engine process: own session and process group, output to a log file.

    The pidfile (`<state_dir>/engine/engine.pid`) holds the identity. The process is this
    daemon's child while the daemon lives (so its exit status is known); after a daemon
    restart it is adopted by identity and its end is known from the log.
    """

    name = "process"

    def __init__(self, state_dir: Path) -> None:
        self.pidfile = state_dir / "engine" / "engine.pid"
        self._children: dict[int, subprocess.Popen[bytes]] = {}

    def engine_log(self, log_dir: Path) -> Path:
        """The daemon opens the log itself here, as its own user: its own directory is safe."""
        return log_dir / "engine.log"

    def launch(self, spec: LaunchSpec, log_path: Path) -> EngineIdentity:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        env = child_environment()
        env.update(dict(spec.env))
        log: IO[bytes]
        with log_path.open("ab") as log:
            proc = subprocess.Popen(
                spec.argv(), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env=env, start_new_session=True, close_fds=True,
            )
        self._children[proc.pid] = proc
        try:
            started = psutil.Process(proc.pid).create_time()
        except psutil.Error:
            started = 0.0  # it died at once; exit_status() will say how
        ident = EngineIdentity(self.name, proc.pid, started, spec.spec_hash, str(log_path))
        write_atomic(self.pidfile, ident.to_json().encode())
        return ident

    def find(self) -> EngineIdentity | None:
        try:
            ident = EngineIdentity.from_json(self.pidfile.read_text())
        except (OSError, ValueError, TypeError):
            return None
        return ident if self.alive(ident) else None

    def alive(self, ident: EngineIdentity) -> bool:
        child = self._children.get(ident.pid)
        if child is not None and child.poll() is not None:
            return False
        return same_process(ident.pid, ident.started_at) is not None

    def exit_status(self, ident: EngineIdentity) -> int | None:
        child = self._children.get(ident.pid)
        if child is None:
            return None
        code = child.poll()
        if code is None and same_process(ident.pid, ident.started_at) is None:
            # Gone (a zombie: `alive` said so) but its status not handed over yet, as seen
            # with the real SGLang killing its own tree after a scheduler crash: wait for it.
            with contextlib.suppress(subprocess.TimeoutExpired):
                code = child.wait(timeout=5)
        return code

    def terminate(self, ident: EngineIdentity) -> None:
        if self.alive(ident):
            os.kill(ident.pid, signal.SIGTERM)

    def kill(self, ident: EngineIdentity) -> None:
        # The group outlives its leader: children may remain after the main process died.
        if self._group_is_ours(ident):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(ident.pid, signal.SIGKILL)
        child = self._children.get(ident.pid)
        if child is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.wait(timeout=5)

    @staticmethod
    def _group_is_ours(ident: EngineIdentity) -> bool:
        """Never signal a stranger: a live process with our leader's pid but another start
        time is a reused pid, and the group with that id is its group, not ours. With no
        process at that pid, the kernel keeps the group id reserved while our orphans live."""
        try:
            proc = psutil.Process(ident.pid)
        except psutil.NoSuchProcess:
            return True
        except psutil.Error:
            return False
        return abs(proc.create_time() - ident.started_at) <= START_TIME_TOLERANCE

    def group_alive(self, ident: EngineIdentity) -> bool:
        if not self._group_is_ours(ident):
            return False
        try:
            os.killpg(ident.pid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True

    def forget(self) -> None:
        self.pidfile.unlink(missing_ok=True)

    def read_bytes(self, ident: EngineIdentity, pids: set[int]) -> int:
        return process_read_bytes(pids) or 0
