"""Engine actions in a maintenance window: persisted rows, run by APScheduler.

An operator schedules restart (or stop, start, rollback) for a time; the row is the record
and survives daemon restarts; on every daemon start the pending rows become APScheduler
date jobs again. A window that passed while the daemon was down is marked *missed* and
reported — never run late at a time nobody chose.
"""

from __future__ import annotations

import datetime as dt
import logging
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from appliance.db.journal import add_audit, add_event
from appliance.db.models import ScheduledAction
from appliance.engine.states import Command
from appliance.errors import ApplianceError
from appliance.runtime import Runtime

log = logging.getLogger(__name__)
GRACE = dt.timedelta(minutes=15)  # how late a window may still start (a slow daemon start)


@dataclass(frozen=True)
class Scheduled:
    id: int
    command: str
    run_at: dt.datetime
    created_at: dt.datetime
    created_by: str
    status: str
    outcome: str
    finished_at: dt.datetime | None


def _record(row: ScheduledAction) -> Scheduled:
    return Scheduled(row.id, row.command, row.run_at, row.created_at, row.created_by,
                     row.status, row.outcome, row.finished_at)


def list_scheduled(session: Session, limit: int = 50) -> list[Scheduled]:
    rows = session.scalars(select(ScheduledAction).order_by(ScheduledAction.run_at.desc())
                           .limit(limit))
    return [_record(r) for r in rows]


def _job_id(action_id: int) -> str:
    return f"engine-action-{action_id}"


async def schedule_action(runtime: Runtime, command: Command, run_at: dt.datetime, *,
                          actor: str, address: str) -> Scheduled:
    now = runtime.clock.now()
    if run_at.tzinfo is None:
        raise ApplianceError("schedule_naive_time", "the window's time has no time zone",
                             "give an ISO time with a zone, e.g. 2026-12-01T02:00:00Z",
                             status=422)
    if run_at <= now:
        raise ApplianceError("schedule_in_past", f"{run_at.isoformat()} is not in the future",
                             "pick a later time, or run the action now", status=422)

    def add(s: Session) -> Scheduled:
        row = ScheduledAction(command=command.value, run_at=run_at, created_at=now,
                              created_by=actor, status="pending", outcome="")
        s.add(row)
        s.flush()
        add_audit(s, at=now, actor=actor, address=address, action="engine.schedule",
                  target=command.value, detail={"run_at": run_at.isoformat(), "id": row.id})
        return _record(row)

    scheduled = await runtime.db.run(add)
    _add_job(runtime, scheduled)
    return scheduled


async def cancel_action(runtime: Runtime, action_id: int, *, actor: str,
                        address: str) -> Scheduled:
    now = runtime.clock.now()

    def cancel(s: Session) -> Scheduled:
        row = s.get(ScheduledAction, action_id)
        if row is None or row.status != "pending":
            raise ApplianceError("schedule_unknown", f"no pending scheduled action {action_id}",
                                 "list them with GET /api/v1/engine/scheduled", status=404)
        row.status, row.finished_at, row.outcome = "cancelled", now, f"cancelled by {actor}"
        add_audit(s, at=now, actor=actor, address=address, action="engine.schedule_cancel",
                  target=row.command, detail={"id": action_id})
        return _record(row)

    cancelled = await runtime.db.run(cancel)
    job = runtime.scheduler.get_job(_job_id(action_id))
    if job is not None:
        job.remove()
    return cancelled


def _add_job(runtime: Runtime, action: Scheduled) -> None:
    runtime.scheduler.add_job(
        run_scheduled, "date", run_date=scheduler_date(runtime, action.run_at),
        args=[runtime, action.id], id=_job_id(action.id), replace_existing=True,
    )


def scheduler_date(runtime: Runtime, run_at: dt.datetime) -> dt.datetime:
    """When APScheduler must fire for a window at `run_at` on `runtime.clock`.

    APScheduler keeps its own time (the host's wall clock), not the runtime's clock, so the
    window's distance from the runtime's now is laid onto the wall clock. With the system
    clock the two agree (the shift is the microseconds between two reads); with a clock set
    anywhere else (a test's fake clock) a future window stays in the future — given as it is,
    a window on a fake date the real calendar has passed would fire at once.
    """
    return dt.datetime.now(dt.UTC) + (run_at - runtime.clock.now())


async def run_scheduled(runtime: Runtime, action_id: int) -> None:
    """The window opened: hand the action to the supervisor's queue, and record what happened."""
    rows = await runtime.db.run(lambda s: [
        _record(r) for r in [s.get(ScheduledAction, action_id)] if r is not None])
    if not rows or rows[0].status != "pending":
        return
    action = rows[0]
    actor = f"schedule ({action.created_by})"
    try:
        await runtime.supervisor.submit(Command(action.command), actor)
        status, outcome = "done", f"{action.command} carried out"
    except ApplianceError as exc:
        status, outcome = "failed", exc.message
    now = runtime.clock.now()

    def finish(s: Session) -> None:
        row = s.get(ScheduledAction, action_id)
        assert row is not None
        row.status, row.outcome, row.finished_at = status, outcome, now
        add_event(s, at=now, severity="info" if status == "done" else "error", source="engine",
                  message=f"scheduled {action.command} (by {action.created_by}): {outcome}")

    await runtime.db.run(finish)


async def restore_scheduled(runtime: Runtime) -> None:
    """On daemon start: pending windows become jobs again; windows missed while down are
    marked missed and reported."""
    now = runtime.clock.now()

    def pending(s: Session) -> list[Scheduled]:
        found = []
        for row in s.scalars(select(ScheduledAction).where(ScheduledAction.status == "pending")):
            if row.run_at < now - GRACE:
                row.status, row.finished_at = "missed", now
                row.outcome = "the daemon was not running when the window opened"
                add_event(s, at=now, severity="warning", source="engine",
                          message=f"scheduled {row.command} for {row.run_at:%Y-%m-%d %H:%M} UTC "
                                  "was missed (daemon down); not run late — schedule it again")
            else:
                found.append(_record(row))
        return found

    for action in await runtime.db.run(pending):
        _add_job(runtime, action)
