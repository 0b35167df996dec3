"""What the dashboard and `/api/v1/status` say about the daemon itself, and how the gateway
admits users (`admission_standing`: qualified, or "unqualified" with what that means, and
refusing everyone while a qualification runs; the dashboard and the Usage page show it).

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
from appliance.cell.published import read_cell_published
from appliance.db.schema import schema_state
from appliance.engine.publish import read_published
from appliance.gateway.engine_gate import engine_capacity
from appliance.gateway.qualified import (
    admission_limit,
    cell_limit,
    point_of,
    qualifying_until,
    refusal_words,
)
from appliance.ops.backup import read_status
from appliance.ops.schedule import last_backup_line
from appliance.qualify.ledger import qualification_for
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
class AdmissionStanding:
    """How many users the gateway lets into the engine at once, and on what ground.

    `qualified`: None while no engine runs or the box heads a cell (whose gateway admits up
    to the decode members' capacity, not at this engine's qualified point), else whether the
    running spec has a qualified point (the gateway admits at it); `refusing_until`: a
    qualification refuses every user until then (`words` say so first, then the limit after
    it). `words` are `AdmissionLimit.words()`, the same as the gateway's `/health`."""

    qualified: bool | None
    words: str
    spec_hash: str | None = None
    refusing_until: dt.datetime | None = None

    @property
    def admitting(self) -> bool:
        return self.refusing_until is None


def _admission(runtime: Runtime, engine_limit: int | None = None) -> AdmissionStanding:
    """The gateway's admission as the database says it (the published engine and cell rows,
    the ledger) with the engine's own slot count (`engine_limit`, from `/server_info`)."""
    now = runtime.clock.now()
    published = runtime.db.call(read_published)
    until = qualifying_until(published, now)
    cell = runtime.db.call(read_cell_published)
    gateway = runtime.config.gateway
    if cell is not None and cell.active:  # the head of a cell admits as its gateway does
        if not cell.serving:
            return AdmissionStanding(None, "the cell is not serving, so the gateway admits "
                                     f"nobody: {cell.message}")
        limit = cell_limit(cell.capacity, override=gateway.max_concurrency)
        limit = limit.during(published, now)
        return AdmissionStanding(None, limit.words(), refusing_until=until)
    spec = runtime.supervisor.running_spec_hash
    if spec is None:
        return AdmissionStanding(None, "no engine is running, so the gateway admits nobody")
    record = runtime.db.call(lambda s: qualification_for(s, spec))
    point = None if record is None else point_of(record)
    decided = admission_limit(engine_limit, point, margin=gateway.qualified_margin,
                              override=gateway.max_concurrency).during(published, now)
    if point is not None or gateway.max_concurrency or engine_limit is not None:
        return AdmissionStanding(point is not None, decided.words(), spec, until)
    unqualified = (
        f"unqualified: the running engine (launch configuration {spec[:12]}) has no "
        "qualified point"
        + (" (its last qualification found none)" if record is not None else "")
        + ", so the gateway admits up to the engine's slot ceiling (its running-request "
        "limit): "
        "what the engine can hold, not what it serves at the floor speed; past that point "
        "requests fail instead of waiting in the gateway's queue")
    if until is not None:
        unqualified = f"{refusal_words(until)}; then {unqualified}"
    return AdmissionStanding(False, unqualified, spec, until)


async def _engine_limit(runtime: Runtime) -> int | None:
    """The running engine's slot count as it says it (what the gateway admits up to while
    unqualified); None while it does not answer."""
    if not runtime.supervisor.status.admits_requests:
        return None
    try:
        return engine_capacity(await runtime.supervisor.client.server_info())
    except Exception:  # an engine that does not answer: the line says so without a number
        return None


async def admission_standing(runtime: Runtime) -> AdmissionStanding:
    limit = await _engine_limit(runtime)
    return await anyio.to_thread.run_sync(_admission, runtime, limit)


async def engine_admission(runtime: Runtime) -> dict[str, object]:
    """`/api/v1/engine`'s admission fields: `admits_requests` is whether users' requests get
    in now (a READY engine that a qualification holds closed does not admit them), and
    `admission` the standing in words with the refusal's end."""
    standing = await admission_standing(runtime)
    until = standing.refusing_until
    return {"admits_requests": runtime.supervisor.status.admits_requests
            and standing.admitting,
            "admission": {"admitting": standing.admitting, "words": standing.words,
                          "refusing_until": until.isoformat() if until else None}}


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
    admission: AdmissionStanding | None = None  # how the gateway admits (module doc)


def _volumes(named: Iterable[tuple[str, Path]]) -> list[VolumeUsage]:
    """Each volume's usage (a directory not there yet: the volume it will live on); one that
    cannot be read is left out, and the health checks report it."""
    found = []
    for name, path in named:
        space = disk_space(path)
        if space is not None:
            found.append(VolumeUsage(name, str(path), total_bytes=space[1], free_bytes=space[0]))
    return found


def _gather(runtime: Runtime, engine_limit: int | None = None) -> DaemonStatus:
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
        admission=_admission(runtime, engine_limit),
    )


async def daemon_status(runtime: Runtime) -> DaemonStatus:
    limit = await _engine_limit(runtime)
    return await anyio.to_thread.run_sync(_gather, runtime, limit)
