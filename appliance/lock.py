"""One daemon per state directory: an exclusive flock on `<state_dir>/appliance.lock`.

The lock is held for the life of the process and released by the kernel when it dies (even
by SIGKILL), so a stale file never blocks a restart. A second daemon exits with a message
that names the holder.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import IO

from appliance.errors import AlreadyRunning


class InstanceLock:
    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / "appliance.lock"
        self._handle: IO[str] | None = None

    def acquire(self) -> None:
        handle = self.path.open("a+")
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "unknown"
            handle.close()
            raise AlreadyRunning(
                "already_running",
                f"another appliance daemon (pid {holder}) is using {self.path.parent}",
                "stop it first (`systemctl stop appliance`), or give this one another "
                "state directory; `appliance migrate` also needs the daemon stopped",
            ) from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"{os.getpid()}\n")
        handle.flush()
        self._handle = handle

    def release(self) -> None:
        if self._handle is not None:
            fcntl.flock(self._handle.fileno(), fcntl.LOCK_UN)
            self._handle.close()
            self._handle = None
