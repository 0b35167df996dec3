"""The health monitor: runs the GPU, engine, host and weights checks, keeps the latest snapshot in
memory, records transitions and history, sends alerts, and applies the engine policy.

One monitor per daemon (built by `build_runtime`, scheduled by `appliance.health.jobs`).
Pages, the API, `/metrics` and `appliance doctor` read `latest`; nothing else polls.

Invariants:
- the event loop never waits on NVML, the disk or the database: GPU and host reads run in
  worker threads (`asyncio.to_thread`; NVML through `snapshot_with_timeout`, so a hung driver
  costs `nvml_timeout_seconds` and yields "gpu.nvml" CRITICAL), database work through
  `Database.run`;
- a check that raises never stops the daemon or the schedule: it becomes a CRITICAL
  "health.monitor.<group>" result for that group until the group's next good poll;
- one poll per group at a time (a lock per group), so a scheduled poll and a "check now"
  never interleave; groups run independently;
- a transition is recorded once (see `transitions`), with its event and alert unless the
  check is muted; samples are written at every poll of their group;
- the monitor never kills or restarts anything itself: it reports to the supervisor and, only
  when the operator enabled it, submits a RESTART like an operator would (see `policy`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Protocol

from sqlalchemy.orm import Session

from appliance.clock import Clock
from appliance.config import Config
from appliance.db.database import Database
from appliance.db.journal import add_audit, add_event
from appliance.engine.states import Command, EngineState
from appliance.engine.supervisor import EngineStatus
from appliance.gpu.port import GpuPort, GpuSnapshot, snapshot_with_timeout
from appliance.health import history, policy
from appliance.health import transitions as changes_of
from appliance.health.alerts import Alerts
from appliance.health.engine_checks import engine_checks
from appliance.health.gpu_checks import gpu_checks
from appliance.health.host_checks import host_checks
from appliance.health.model import (
    GROUPS,
    CheckResult,
    EngineFigures,
    HealthSnapshot,
    HostFigures,
    Level,
    merge,
)
from appliance.health.transitions import Transition
from appliance.health.weights_checks import weights_check
from appliance.ops.backup import read_status
from appliance.ops.schedule import backup_check

log = logging.getLogger(__name__)

SOURCE = "health"
Poll = Callable[[dt.datetime], Awaitable[tuple[list[CheckResult], dict[str, Any]]]]


class SupervisorPort(Protocol):
    """What the monitor needs from `appliance.engine.supervisor.Supervisor`."""

    @property
    def status(self) -> EngineStatus: ...
    @property
    def degraded_seconds(self) -> float | None: ...
    def engine_pids(self) -> frozenset[int]: ...
    async def report_health(self, source: str, failure: str | None, hint: str = "") -> None: ...
    def submit(self, command: Command, actor: str,
               attempt: int = 1) -> asyncio.Future[EngineStatus]: ...


class EngineWatcherPort(Protocol):
    async def poll(self, state: EngineState, now: dt.datetime) -> EngineFigures: ...


class Closable(Protocol):
    async def aclose(self) -> None: ...


class HealthMonitor:
    """See the module docstring. `read_host(now)` is blocking (it runs in a thread);
    `closing` are resources the monitor closes on `close()` (the engine probe)."""

    def __init__(self, *, config: Config, db: Database, clock: Clock, gpus: GpuPort,
                 supervisor: SupervisorPort, watcher: EngineWatcherPort,
                 read_host: Callable[[dt.datetime], HostFigures], alerts: Alerts,
                 closing: Sequence[Closable] = ()) -> None:
        self.config, self.db, self.clock, self.gpus = config, db, clock, gpus
        self.supervisor, self.watcher, self.read_host = supervisor, watcher, read_host
        self.alerts, self._closing = alerts, tuple(closing)
        self._snapshot = HealthSnapshot(at=None)
        self._known: Mapping[str, Level] = {}
        self._mutes: dict[str, dt.datetime | None] = {}
        self._loaded = False
        self._load_lock = asyncio.Lock()
        self._locks = {group: asyncio.Lock() for group in GROUPS}
        self._previous_gpus: GpuSnapshot | None = None
        self._restart_requested = False

    # --- reading ----------------------------------------------------------------------

    @property
    def latest(self) -> HealthSnapshot:
        """The newest snapshot, with the mutes in force now (an expired mute drops out)."""
        return dataclasses.replace(self._snapshot, muted=self._muted(self.clock.now()))

    def _muted(self, now: dt.datetime) -> frozenset[str]:
        return frozenset(c for c, until in self._mutes.items() if until is None or until > now)

    # --- polls ------------------------------------------------------------------------

    async def check_gpus(self) -> HealthSnapshot:
        return await self._run("gpu", self._poll_gpus)

    async def check_engine(self) -> HealthSnapshot:
        return await self._run("engine", self._poll_engine)

    async def check_host(self) -> HealthSnapshot:
        return await self._run("host", self._poll_host)

    async def check_weights(self) -> HealthSnapshot:
        """Also the weights service's `on_job_end` hook: a job's end re-judges it at once."""
        return await self._run("weights", self._poll_weights)

    async def check_all(self) -> HealthSnapshot:
        """Every check once, now (the console's "check now", `appliance doctor`)."""
        await asyncio.gather(self.check_gpus(), self.check_engine(), self.check_host(),
                             self.check_weights())
        return self.latest

    async def _poll_gpus(self, now: dt.datetime) -> tuple[list[CheckResult], dict[str, Any]]:
        timeout = float(self.config.health.nvml_timeout_seconds)
        snapshot = await asyncio.to_thread(snapshot_with_timeout, self.gpus, timeout)
        results = gpu_checks(snapshot, self.config.gpu, self._previous_gpus,
                             self.supervisor.engine_pids())
        if snapshot.error is None:  # ECC counts rise against the last reading that worked
            self._previous_gpus = snapshot
        return results, {"gpus": snapshot}

    async def _poll_engine(self, now: dt.datetime) -> tuple[list[CheckResult], dict[str, Any]]:
        figures = await self.watcher.poll(self.supervisor.status.state, now)
        return engine_checks(figures, self.config.health), {"engine": figures}

    async def _poll_host(self, now: dt.datetime) -> tuple[list[CheckResult], dict[str, Any]]:
        figures = await asyncio.to_thread(self.read_host, now)
        backups = await asyncio.to_thread(read_status, self.config.paths.state_dir)
        results = [*host_checks(figures, self.config.health, self.config.paths),
                   backup_check(self.config.backup.schedule, backups, now)]
        return results, {"host": figures}

    async def _poll_weights(self, now: dt.datetime) -> tuple[list[CheckResult], dict[str, Any]]:
        # The doctor's verdict on the active set (database reads and file stats: a thread).
        return [await asyncio.to_thread(weights_check, self.db, self.config)], {}

    async def _run(self, group: str, poll: Poll) -> HealthSnapshot:
        async with self._locks[group]:
            now = self.clock.now()
            readings: dict[str, Any] = {}
            try:
                results, readings = await poll(now)
                strays = sorted(r.id for r in results if r.group != group)
                if strays:
                    raise ValueError(f"the {group} checks returned {', '.join(strays)}")
            except Exception as exc:
                log.exception("the %s health checks failed", group)
                results, readings = [monitor_result(
                    group, Level.CRITICAL,
                    f"the {group} checks could not run: {type(exc).__name__}: {exc}",
                    "the daemon keeps serving and tries again at the next poll; the traceback "
                    "is in the daemon log (`journalctl -u appliance`): please report it")], {}
            await self._update(group, now, results, readings)
            if group == "engine":
                await self._apply_policy(results)
            return self.latest

    async def _update(self, group: str, now: dt.datetime, results: list[CheckResult],
                      readings: dict[str, Any]) -> None:
        await self._load()
        self._snapshot = merge(self._snapshot, now, group, results, **readings)
        # An unjudged check (not run: the engine is not serving) is absent for transitions, so
        # a failing engine that then crashes does not "recover" by being stopped.
        judged = [*(r for r in results if r.judged), *self._monitor_recovery(group, results)]
        found = changes_of.changes(self._known, judged, now)
        self._known = changes_of.remember(self._known, judged)
        samples = history.samples_of(HealthSnapshot(at=now, **readings))
        muted = self._muted(now)

        def write(session: Session) -> list[Transition]:
            history.record_samples(session, now, samples)
            history.record_transitions(session, found, muted)
            return self.alerts.record(session, found, muted)

        try:
            loud = await self.db.run(write)
        except Exception:
            log.exception("could not store the %s health results", group)
            return
        self.alerts.send(loud)

    def _monitor_recovery(self, group: str, results: list[CheckResult]) -> list[CheckResult]:
        """An OK verdict for the group's "health.monitor.<group>" stand-in once the group's
        checks run again. It is judged (so the failure's recovery is recorded, and a later
        failure is recorded afresh) but not shown: the real results replace it."""
        recovered = monitor_result(group, Level.OK, f"the {group} checks run again")
        if any(r.id == recovered.id for r in results) \
                or self._known.get(recovered.id, Level.OK) is Level.OK:
            return []
        return [recovered]

    async def _load(self) -> None:
        """Seed the last known levels and the mutes from the database, once (retried at the
        next poll when the database does not answer; meanwhile memory is all there is)."""
        async with self._load_lock:
            if self._loaded:
                return
            try:
                known, mutes = await self.db.run(
                    lambda s: (history.last_levels(s), history.mutes(s)))
            except Exception:
                log.exception("could not read the health history; carrying on without it")
                return
            self._known = {**known, **self._known}
            self._mutes = {m.check_id: m.until for m in mutes} | self._mutes
            self._loaded = True

    # --- policy -----------------------------------------------------------------------

    async def _apply_policy(self, results: list[CheckResult]) -> None:
        try:
            status = self.supervisor.status
            if status.state is not EngineState.DEGRADED:
                self._restart_requested = False  # a new degraded spell may restart again
            view = policy.EngineView(status.state, status.pending,
                                     self.supervisor.degraded_seconds)
            decision = policy.decide(
                view, results, restart_requested=self._restart_requested,
                restart_after_minutes=self.config.health.restart_degraded_after_minutes)
            if decision.report:
                await self.supervisor.report_health(SOURCE, decision.failure, decision.hint)
            if decision.restart:
                self._restart_requested = True
                await self._event("warning", decision.reason)
                future = self.supervisor.submit(Command.RESTART, decision.actor)
                future.add_done_callback(_log_refusal)
        except Exception:
            log.exception("the health policy could not be applied")

    async def _event(self, severity: str, message: str) -> None:
        at = self.clock.now()
        await self.db.run(lambda s: add_event(s, at=at, severity=severity, source=SOURCE,
                                              message=message))

    # --- mutes ------------------------------------------------------------------------

    async def mute(self, check_id: str, *, until: dt.datetime | None, by: str,
                   reason: str = "", address: str = "") -> None:
        """Silence one check's alerts (events and webhook) until `until` (None: until
        unmuted). The check still shows, with its level, and its transitions are kept."""
        now = self.clock.now()
        history.check_mute(check_id, until, now)
        detail = {"until": until.isoformat() if until else None, "reason": reason}

        def apply(session: Session) -> None:
            history.set_mute(session, check_id, until=until, at=now, by=by, reason=reason)
            add_audit(session, at=now, actor=by, address=address, action="health.mute",
                      target=check_id, detail=detail)

        await self.db.run(apply)
        self._mutes[check_id] = until

    async def unmute(self, check_id: str, *, by: str, address: str = "") -> None:
        """End a mute (harmless when there is none; the audit entry says which)."""
        now = self.clock.now()

        def apply(session: Session) -> None:
            was = history.clear_mute(session, check_id)
            add_audit(session, at=now, actor=by, address=address, action="health.unmute",
                      target=check_id, detail={"was_muted": was})

        await self.db.run(apply)
        self._mutes.pop(check_id, None)

    # --- housekeeping -----------------------------------------------------------------

    async def prune(self) -> history.Pruned:
        """Roll up and drop old history and expired mutes (the hourly job)."""
        now, health = self.clock.now(), self.config.health
        pruned = await self.db.run(lambda s: history.prune(
            s, now, fine_hours=health.history_fine_hours, hourly_days=health.history_hourly_days))
        self._mutes = {c: u for c, u in self._mutes.items() if u is None or u > now}
        return pruned

    async def close(self) -> None:
        await self.alerts.close()
        for resource in self._closing:
            await resource.aclose()


def monitor_result(group: str, level: Level, summary: str, hint: str = "") -> CheckResult:
    """The "health.monitor.<group>" result that stands in for a group whose checks raised
    (a bug, or a broken host), and its recovery."""
    return CheckResult(f"health.monitor.{group}", group, f"Health monitor ({group} checks)",
                       level, summary, hint)


def _log_refusal(future: asyncio.Future[EngineStatus]) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.warning("the health policy's restart did not run: %s", future.exception())
