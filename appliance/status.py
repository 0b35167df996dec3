"""What the dashboard and `/api/v1/status` say about the daemon itself.

Gathered off the event loop (disk usage and database calls can block on a busy disk).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import anyio.to_thread
import psutil

from appliance.auth.bootstrap import bootstrap_file
from appliance.db.schema import schema_state
from appliance.ops.backup import read_status
from appliance.ops.schedule import last_backup_line
from appliance.runtime import Runtime
from appliance.volumes import disk_space


@dataclass(frozen=True)
class VolumeUsage:
    name: str
    path: str
    total_bytes: int
    free_bytes: int

    @property
    def used_percent(self) -> float:
        return 100.0 * (1 - self.free_bytes / self.total_bytes) if self.total_bytes else 0.0


@dataclass(frozen=True)
class DaemonStatus:
    version: str
    started_at: dt.datetime
    uptime_seconds: int
    database: str
    schema_revision: str | None
    schema_head: str
    bootstrap_pending: bool
    volumes: list[VolumeUsage]
    scheduler_jobs: list[str]
    rss_bytes: int
    last_backup: str = ""  # a sentence: when, how old, with or without secrets


def _volumes(named: Iterable[tuple[str, Path]]) -> list[VolumeUsage]:
    """Each volume's usage (a directory not there yet: the volume it will live on); one that
    cannot be read is left out, and the health checks report it."""
    found = []
    for name, path in named:
        space = disk_space(path)
        if space is not None:
            found.append(VolumeUsage(name, str(path), total_bytes=space[1], free_bytes=space[0]))
    return found


def _gather(runtime: Runtime) -> DaemonStatus:
    paths = runtime.config.paths
    state = schema_state(runtime.db, runtime.migrations)
    database = "SQLite" if runtime.db.is_sqlite else "PostgreSQL"
    return DaemonStatus(
        version=runtime.version,
        started_at=runtime.started_at,
        uptime_seconds=int(runtime.clock.monotonic() - runtime.started_monotonic),
        database=database,
        schema_revision=state.current,
        schema_head=state.head,
        bootstrap_pending=bootstrap_file(paths.state_dir).exists(),
        volumes=_volumes((("state", paths.state_dir), ("models", paths.models_dir),
                          ("logs", paths.log_dir))),
        scheduler_jobs=[job.id for job in runtime.scheduler.get_jobs()],
        rss_bytes=psutil.Process().memory_info().rss,
        last_backup=last_backup_line(read_status(paths.state_dir), runtime.clock.now()),
    )


async def daemon_status(runtime: Runtime) -> DaemonStatus:
    return await anyio.to_thread.run_sync(_gather, runtime)
