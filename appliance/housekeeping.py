"""The daemon's own periodic jobs, and scheduler problems turned into events.

Later issues add their jobs (health polls, usage roll-ups) beside these, with the same
defaults: one instance each, coalesced, generous misfire grace (see `new_scheduler`).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from typing import Any

from apscheduler.events import EVENT_JOB_ERROR, EVENT_JOB_MISSED, JobExecutionEvent
from sqlalchemy import and_, delete, or_
from sqlalchemy.orm import Session

from appliance.auth.sessions import purge_expired
from appliance.db.journal import add_event
from appliance.db.models import AuditEntry
from appliance.runtime import Runtime

log = logging.getLogger(__name__)


async def purge_sessions(runtime: Runtime) -> int:
    now = runtime.clock.now()
    return await runtime.db.run(lambda s: purge_expired(s, now))


# Audit actions anyone on the network can add rows of: (action, whether its "ok" rows stay).
UNAUTHENTICATED = (("auth.login", True), ("cell.join", True), ("cell.peer.refused", False))


def purge_failed(session: Session, before: dt.datetime) -> int:
    """Delete the failed and refused attempts of `UNAUTHENTICATED` older than `before` (failed
    logins, refused join tokens, refused cell peer credentials); every other audit entry, and
    every successful login and join, stays.

    Anyone who can reach /login or the cell's join and peer routes can add these, so unlike
    the rest of the audit log they are history with a retention
    (`auth.failed_login_retention_days`), not a record kept for good.
    """
    failed = or_(*(and_(AuditEntry.action == action, AuditEntry.outcome != "ok")
                   if keep_ok else AuditEntry.action == action
                   for action, keep_ok in UNAUTHENTICATED))
    result = session.execute(delete(AuditEntry).where(failed, AuditEntry.at < before))
    return int(getattr(result, "rowcount", 0) or 0)


async def purge_failed_attempts(runtime: Runtime) -> int:
    before = runtime.clock.now() - dt.timedelta(
        days=runtime.config.auth.failed_login_retention_days)
    return await runtime.db.run(lambda s: purge_failed(s, before))


def _on_job_problem(runtime: Runtime, event: JobExecutionEvent) -> None:
    if event.code == EVENT_JOB_MISSED:
        severity, message = "warning", f"scheduled job {event.job_id} missed its run time"
    else:
        severity, message = "error", f"scheduled job {event.job_id} failed: {event.exception!r}"
    log.warning(message)
    now = runtime.clock.now()

    def record() -> None:
        try:
            runtime.db.call(lambda s: add_event(s, at=now, severity=severity,
                                                source="scheduler", message=message))
        except Exception:  # the event log must never take the scheduler down with it
            log.exception("could not record scheduler event")

    # Listeners run on the event loop; the database write goes to a worker thread.
    asyncio.get_running_loop().run_in_executor(None, record)


def schedule_housekeeping(runtime: Runtime) -> None:
    scheduler = runtime.scheduler
    scheduler.add_job(purge_sessions, "interval", minutes=5, args=[runtime],
                      id="purge_sessions", replace_existing=True)
    scheduler.add_job(purge_failed_attempts, "interval", hours=1, args=[runtime],
                      id="purge_failed_attempts", replace_existing=True)

    def listener(event: Any) -> None:
        _on_job_problem(runtime, event)

    scheduler.add_listener(listener, EVENT_JOB_ERROR | EVENT_JOB_MISSED)
