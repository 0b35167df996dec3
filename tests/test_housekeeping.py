"""The scheduler's housekeeping and its problems, recorded as events, on a real loop."""

from __future__ import annotations

import asyncio
import datetime as dt

from sqlalchemy.orm import Session

from appliance.auth.accounts import create_admin
from appliance.auth.sessions import open_session
from appliance.db.journal import add_audit, list_audit, list_events
from appliance.db.models import AdminSession
from appliance.housekeeping import purge_failed_attempts, purge_sessions, schedule_housekeeping
from appliance.runtime import Runtime
from appliance.testing.clock import FakeClock


def test_purge_job_removes_expired_sessions(runtime: Runtime, clock: FakeClock) -> None:
    now = clock.now()
    admin = runtime.db.call(lambda s: create_admin(s, "alice", "long enough password", now))
    runtime.db.call(lambda s: open_session(s, admin, now, runtime.session_policy,
                                           address="", user_agent=""))
    clock.advance(runtime.session_policy.idle.total_seconds() + 1)
    assert asyncio.run(purge_sessions(runtime)) == 1
    assert runtime.db.call(lambda s: s.query(AdminSession).count()) == 0


def test_a_failing_job_becomes_an_error_event(runtime: Runtime) -> None:
    async def scenario() -> None:
        schedule_housekeeping(runtime)

        def broken() -> None:
            raise OSError("disk went away")

        runtime.scheduler.add_job(broken, "date", id="broken",
                                  run_date=dt.datetime.now(dt.UTC))
        runtime.scheduler.start()
        for _ in range(200):
            events = await runtime.db.run(lambda s: list_events(s, source="scheduler"))
            if events.total:
                break
            await asyncio.sleep(0.02)
        runtime.scheduler.shutdown(wait=False)

    asyncio.run(scenario())
    events = runtime.db.call(lambda s: list_events(s, source="scheduler")).items
    assert len(events) == 1
    assert events[0].severity == "error"
    assert "broken failed" in events[0].message and "disk went away" in events[0].message


def test_failed_cell_attempts_are_purged_by_retention_and_successes_kept(
        runtime: Runtime, clock: FakeClock) -> None:
    retention = runtime.config.auth.failed_login_retention_days
    old = clock.now() - dt.timedelta(days=retention, hours=1)
    recent = clock.now() - dt.timedelta(days=retention - 1)
    kinds = [("cell.join", "denied"), ("cell.join", "ok"), ("cell.peer.refused", "denied"),
             ("auth.login", "failed"), ("auth.login", "ok"), ("cell.leave", "ok"),
             ("cell.peer.status", "ok")]

    def seed(s: Session) -> None:
        for at in (old, recent):
            for action, outcome in kinds:
                add_audit(s, at=at, actor="cell head", action=action, outcome=outcome)

    runtime.db.call(seed)
    assert asyncio.run(purge_failed_attempts(runtime)) == 3  # the old refused ones
    left = {(e.action, e.outcome, e.at == old)
            for e in runtime.db.call(lambda s: list_audit(s, per_page=100)).items}
    assert left == {(a, o, False) for a, o in kinds} | {
        ("cell.join", "ok", True), ("auth.login", "ok", True), ("cell.leave", "ok", True),
        ("cell.peer.status", "ok", True)}
