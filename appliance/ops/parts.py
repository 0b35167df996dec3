"""The values a support bundle's collectors and its builder share (appliance.ops.bundle builds,
appliance.ops.collectors collects): a `Part` of the archive, a `Skip` with its reason, the
`Context` every collector reads, and a `Collector`. A module of its own so that the builder
and the collectors each depend on it and not on one another.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from appliance.config import Config

if TYPE_CHECKING:
    from appliance.db.database import Database
    from appliance.gpu.port import GpuPort, GpuSnapshot

LOG_LINES = 5000
RUNS = 10
COLLECTOR_TIMEOUT_S = 60.0


class Skip(Exception):
    """A collector has nothing to add here; the message says why (it goes in the README)."""


@dataclass(frozen=True)
class Part:
    """One file of the archive: its path under the bundle's folder, content, and a line."""

    path: str
    data: bytes
    about: str


@dataclass(frozen=True)
class Skipped:
    what: str
    reason: str


@dataclass
class Context:
    """What collectors read. `db` is None when there is no database to read (the reason is in
    `db_error`); `extra` holds parts the daemon supplies (live state only it knows)."""

    config: Config
    now: dt.datetime
    since: dt.datetime
    db: Database | None
    db_error: str = ""
    gpus: GpuPort | None = None
    log_lines: int = LOG_LINES
    extra: tuple[Part, ...] = ()
    daemon_note: str = ""  # why `extra` is empty (the daemon did not answer, and why)
    refused: list[str] = field(default_factory=list)  # files not read, and why (README)
    _gpu_snapshot: GpuSnapshot | None = field(default=None, repr=False)

    def need_db(self) -> Database:
        if self.db is None:
            raise Skip(self.db_error or "no database")
        return self.db

    def gpu_snapshot(self) -> GpuSnapshot:
        """One NVML read per bundle (shared by the versions and the GPU parts), bounded."""
        if self._gpu_snapshot is None:
            from appliance.gpu.nvml import NvmlGpus
            from appliance.gpu.port import snapshot_with_timeout

            self.gpus = self.gpus or NvmlGpus()
            self._gpu_snapshot = snapshot_with_timeout(
                self.gpus, float(self.config.health.nvml_timeout_seconds))
        return self._gpu_snapshot


Collect = Callable[[Context], list[Part]]


@dataclass(frozen=True)
class Collector:
    name: str
    collect: Collect
    timeout_s: float = COLLECTOR_TIMEOUT_S
