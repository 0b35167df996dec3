"""The engine emulator's child processes: one light `sglang::scheduler_TPn` per rank and a
`sglang::detokenizer`, like SGLang's process tree. A test and demo instrument.

Children are forked from the main thread before any thread or event loop exists, stay in the
main process's process group, and do almost nothing: a rank reads the weight files it is told
to (paced, in 1 MiB chunks, so the tree's io counters move), and each exits when told to, when
its main process dies (PR_SET_PDEATHSIG=SIGTERM, as SGLang sets PDEATHSIG, plus a poll of the
parent pid where prctl is missing) or on SIGTERM. The kernel-visible name (comm) is set to
the SGLang title, truncated to 15 characters as setproctitle's is. The main process writes the
log lines; a child writes only its own dying words (a crash), as a real scheduler does.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, Pipe
from pathlib import Path
from types import FrameType

from appliance.testing.fake_sglang.gpustate import release_pid
from appliance.testing.fake_sglang.logwriter import LogWriter

CHUNK = 1 << 20
POLL_SECONDS = 0.5
PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15


class RankDied(Exception):
    def __init__(self, rank: int, exit_code: int) -> None:
        super().__init__(f"rank {rank} exited with {exit_code}")
        self.rank = rank
        self.exit_code = exit_code


@dataclass
class Child:
    rank: int  # -1 for the detokenizer
    name: str
    pid: int
    conn: Connection
    exit_code: int | None = field(default=None)


def _prctl(option: int, value: int | bytes) -> None:
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(option, value, 0, 0, 0)


def _child_main(rank: int, name: str, conn: Connection, parent: int,
                gpu_state: Path | None) -> int:
    _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    _prctl(PR_SET_NAME, name.encode()[:15])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the main process decides what ^C means

    def on_term(signum: int, frame: FrameType | None) -> None:
        # Ignore a second SIGTERM while the entry is dropped: the loop below calls this when
        # the pipe closes, and PDEATHSIG lands a moment later. A nested call would wait on
        # the flock this one holds, and the rank would hang for ever.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if gpu_state is not None:
            release_pid(gpu_state, os.getpid())
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_term)
    if os.getppid() != parent:
        on_term(signal.SIGTERM, None)

    def parent_alive() -> bool:
        return os.getppid() == parent

    while parent_alive():
        try:
            if not conn.poll(POLL_SECONDS):
                continue
            command = conn.recv()
        except (EOFError, OSError):
            break
        kind = command[0]
        if kind == "read":
            _, path, seconds, limit = command
            conn.send(("done", _read(Path(path), float(seconds), limit, parent_alive)))
        elif kind == "crash":
            LogWriter().raw(command[1])
            return 1
        elif kind == "shutdown":
            return 0
    on_term(signal.SIGTERM, None)  # the main process is gone: die as PDEATHSIG would
    return 0


def _read(path: Path, seconds: float, limit: int | None,
          parent_alive: Callable[[], bool]) -> int:
    """Read the file (its first `limit` bytes, if given) in chunks spread evenly over
    `seconds`: never faster, slower if the disk is slower, as on the real box."""
    started = time.monotonic()
    done = 0
    try:
        size = path.stat().st_size if limit is None else min(limit, path.stat().st_size)
        size = max(1, size)
        with path.open("rb", buffering=0) as handle:
            while done < size and (chunk := handle.read(min(CHUNK, size - done))):
                done += len(chunk)
                if not parent_alive():
                    break
                delay = started + seconds * done / size - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
    except OSError:
        pass
    rest = started + seconds - time.monotonic()
    if rest > 0:
        time.sleep(rest)
    return done


class Children:
    """The main process's handle on its children (it alone reaps them)."""

    def __init__(self, children: list[Child]) -> None:
        self.all = children

    @classmethod
    def spawn(cls, tp_size: int, gpu_state: Path | None) -> Children:
        sys.stdout.flush()
        sys.stderr.flush()
        parent = os.getpid()
        children: list[Child] = []
        specs = [(rank, f"sglang::scheduler_TP{rank}") for rank in range(tp_size)]
        specs.append((-1, "sglang::detokenizer"))
        for rank, name in specs:
            ours, theirs = Pipe()
            pid = os.fork()
            if pid == 0:  # the child: never returns into the main program
                code = 1
                try:
                    ours.close()
                    for sibling in children:
                        sibling.conn.close()
                    code = _child_main(rank, name, theirs, parent, gpu_state)
                finally:
                    os._exit(code)
            theirs.close()
            children.append(Child(rank=rank, name=name, pid=pid, conn=ours))
        return cls(children)

    @property
    def ranks(self) -> list[Child]:
        return [child for child in self.all if child.rank >= 0]

    @property
    def rank_pids(self) -> list[int]:
        return [child.pid for child in self.ranks]

    def rank(self, index: int) -> Child:
        return self.ranks[index]

    def reap(self) -> list[Child]:
        """Children that exited since the last call (their exit code set, as a signal's
        negative number, like multiprocessing's exitcode)."""
        gone = []
        for child in self.all:
            if child.exit_code is not None:
                continue
            try:
                pid, status = os.waitpid(child.pid, os.WNOHANG)
            except ChildProcessError:
                child.exit_code = -signal.SIGKILL
                gone.append(child)
                continue
            if pid:
                code = os.waitstatus_to_exitcode(status)
                child.exit_code = code
                gone.append(child)
        return gone

    def wait(self, child: Child, timeout: float) -> int | None:
        deadline = time.monotonic() + timeout
        while child.exit_code is None and time.monotonic() < deadline:
            self.reap()
            if child.exit_code is None:
                time.sleep(0.02)
        return child.exit_code

    def read(self, rank: int, path: Path, seconds: float, limit: int | None = None) -> int:
        """Have `rank` read `path` (up to `limit` bytes) over `seconds`; the bytes read.
        RankDied if any child dies meanwhile."""
        child = self.rank(rank)
        child.conn.send(("read", str(path), seconds, limit))
        while True:
            if child.conn.poll(0.05):
                try:
                    reply = child.conn.recv()
                except (EOFError, OSError):
                    self.wait(child, 1.0)
                    raise RankDied(rank, child.exit_code or 1) from None
                return int(reply[1])
            self.check()

    def check(self) -> None:
        """RankDied for the first child found dead (SGLang polls its children the same way)."""
        for child in self.reap() or [c for c in self.all if c.exit_code is not None]:
            raise RankDied(child.rank, child.exit_code if child.exit_code is not None else 1)

    def crash(self, rank: int, text: str) -> int:
        """Rank `rank` writes `text` (its exception) and exits 1; its exit code."""
        child = self.rank(rank)
        with contextlib.suppress(OSError):
            child.conn.send(("crash", text))
        code = self.wait(child, 5.0)
        return 1 if code is None else code

    def kill(self, child: Child, sig: int = signal.SIGKILL) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child.pid, sig)

    def shutdown(self, timeout: float) -> list[int]:
        """Ask every child to exit, wait up to `timeout`, SIGKILL the rest; the pids killed."""
        for child in self.all:
            if child.exit_code is None:
                with contextlib.suppress(OSError):
                    child.conn.send(("shutdown",))
        deadline = time.monotonic() + timeout
        while any(c.exit_code is None for c in self.all) and time.monotonic() < deadline:
            self.reap()
            time.sleep(0.02)
        stragglers = [c.pid for c in self.all if c.exit_code is None]
        self.kill_all()
        return stragglers

    def kill_all(self) -> None:
        for child in self.all:
            if child.exit_code is None:
                self.kill(child)
        for child in self.all:
            if child.exit_code is None:
                self.wait(child, 5.0)
