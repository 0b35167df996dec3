"""The daemon's own periodic jobs, and scheduler problems turned into events.

Later issues add their jobs (health polls, usage roll-ups) beside these, with the same
defaults: one instance each, coalesced, generous misfire grace (see `new_scheduler`).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from apscheduler.events import EVENT_JOB_ERROR, EVENT_JOB_MISSED, JobExecutionEvent

from appliance.auth.sessions import purge_expired
from appliance.db.journal import add_event
from appliance.runtime import Runtime

log = logging.getLogger(__name__)


async def purge_sessions(runtime: Runtime) -> int:
    now = runtime.clock.now()
    return await runtime.db.run(lambda s: purge_expired(s, now))


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

    def listener(event: Any) -> None:
        _on_job_problem(runtime, event)

    scheduler.add_listener(listener, EVENT_JOB_ERROR | EVENT_JOB_MISSED)
