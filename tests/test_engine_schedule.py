"""Engine actions in maintenance windows: persisted, restored after a restart, never run late."""

from __future__ import annotations

import asyncio
import datetime as dt

import pytest

from appliance.auth.middleware import CSRF_COOKIE
from appliance.db.journal import list_audit, list_events
from appliance.db.models import ScheduledAction
from appliance.engine.schedule import (
    list_scheduled,
    restore_scheduled,
    run_scheduled,
    schedule_action,
)
from appliance.engine.states import Command
from appliance.runtime import Runtime
from appliance.testing.clock import FakeClock
from tests.conftest import Console, LiveServer


def _post(console: Console, action: str, **body: object) -> tuple[int, dict[str, object]]:
    response = console.http.post(f"/api/v1/engine/{action}", json=body,
                                 headers={"X-CSRF-Token": console.http.cookies[CSRF_COOKIE]})
    return response.status_code, response.json()


def test_schedule_then_cancel_a_restart(logged_in: Console, server: LiveServer,
                                        runtime: Runtime, clock: FakeClock) -> None:
    when = (clock.now() + dt.timedelta(hours=6)).isoformat()
    code, body = _post(logged_in, "restart", at=when)
    assert code == 409 and "confirm" in str(body["hint"])  # a restart always asks
    code, body = _post(logged_in, "restart", at=when, confirm=True)
    assert code == 202
    scheduled = body["scheduled"]
    assert isinstance(scheduled, dict) and scheduled["status"] == "pending"
    assert runtime.scheduler.get_job(f"engine-action-{scheduled['id']}") is not None
    listed = logged_in.http.get("/api/v1/engine/scheduled").json()
    assert [a["command"] for a in listed] == ["restart"]
    cancelled = logged_in.http.delete(f"/api/v1/engine/scheduled/{scheduled['id']}",
                                      headers={"X-CSRF-Token": logged_in.http.cookies[CSRF_COOKIE]})
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    assert runtime.scheduler.get_job(f"engine-action-{scheduled['id']}") is None
    actions = [a.action for a in runtime.db.call(lambda s: list_audit(s, action="engine.")).items]
    assert actions == ["engine.schedule_cancel", "engine.schedule"]


@pytest.mark.parametrize("years", [-10, 10])
def test_the_job_waits_the_windows_distance_on_the_runtime_clock(
        runtime: Runtime, clock: FakeClock, years: int) -> None:
    """APScheduler fires on the host's wall clock: a window six hours ahead on the runtime's
    clock fires six hours from now, wherever that clock stands on the calendar (a fake date
    the real one has passed must not fire at once, nor one years ahead wait years)."""
    clock.jump_wall(years * 365 * 86400)
    run_at = clock.now() + dt.timedelta(hours=6)
    action = asyncio.run(schedule_action(runtime, Command.RESTART, run_at, actor="alice",
                                         address="127.0.0.1"))
    job = runtime.scheduler.get_job(f"engine-action-{action.id}")
    assert job is not None and action.run_at == run_at  # the record keeps the runtime's time
    wait = job.trigger.run_date - dt.datetime.now(dt.UTC)
    assert dt.timedelta(hours=5, minutes=59) < wait <= dt.timedelta(hours=6)


def test_bad_windows_are_refused(logged_in: Console, clock: FakeClock, runtime: Runtime) -> None:
    code, body = _post(logged_in, "start", at=(clock.now() - dt.timedelta(minutes=1)).isoformat())
    assert code == 422 and body["code"] == "schedule_in_past"
    code, body = _post(logged_in, "start", at="2026-12-01T02:00:00")
    assert code == 422 and body["code"] == "schedule_naive_time"
    assert runtime.db.call(list_scheduled) == []


def test_restore_reschedules_pending_and_reports_missed(runtime: Runtime,
                                                        clock: FakeClock) -> None:
    now = clock.now()
    runtime.db.call(lambda s: s.add_all([
        ScheduledAction(command="restart", run_at=now - dt.timedelta(hours=2), created_at=now,
                        created_by="alice", status="pending", outcome=""),
        ScheduledAction(command="restart", run_at=now + dt.timedelta(hours=2), created_at=now,
                        created_by="alice", status="pending", outcome=""),
    ]))

    async def scenario() -> list[str]:
        await restore_scheduled(runtime)
        return [job.id for job in runtime.scheduler.get_jobs()]

    jobs = asyncio.run(scenario())
    statuses = {a.run_at < now: a.status for a in runtime.db.call(list_scheduled)}
    assert statuses == {True: "missed", False: "pending"}
    assert len(jobs) == 1
    warnings = [e.message for e in runtime.db.call(lambda s: list_events(s, source="engine")).items]
    assert any("was missed" in m and "not run late" in m for m in warnings)


def test_window_opening_hands_the_action_to_the_supervisor(runtime: Runtime,
                                                           clock: FakeClock) -> None:
    """Here the start fails its preflight (no GPUs on this machine): the row says so."""
    now = clock.now()
    runtime.db.call(lambda s: s.add(ScheduledAction(
        command="start", run_at=now, created_at=now, created_by="alice", status="pending",
        outcome="")))
    action_id = runtime.db.call(list_scheduled)[0].id

    async def scenario() -> None:
        await runtime.supervisor.start_service()
        try:
            await run_scheduled(runtime, action_id)
        finally:
            await runtime.supervisor.stop_service()

    asyncio.run(scenario())
    done = runtime.db.call(list_scheduled)[0]
    assert done.status == "failed" and "preflight failed" in done.outcome
    events = [e.message for e in runtime.db.call(lambda s: list_events(s, source="engine")).items]
    assert any(m.startswith("scheduled start (by alice)") for m in events)


def test_console_schedules_and_cancels_in_a_window(logged_in: Console, runtime: Runtime,
                                                   clock: FakeClock) -> None:
    token = logged_in.page_token("/engine")
    when = (clock.now() + dt.timedelta(days=1)).strftime("%Y-%m-%dT%H:%M")
    form = {"command": "restart", "at": when, "_csrf_token": token}
    headers = {"HX-Request": "true"}
    refused = logged_in.http.post("/engine/schedule", data=form, headers=headers)
    assert refused.status_code == 409 and "confirm" in refused.text
    assert runtime.db.call(list_scheduled) == []
    done = logged_in.http.post("/engine/schedule", data={**form, "confirm": "yes"},
                               headers=headers)
    assert done.status_code == 200 and "restart scheduled for" in done.text
    (action,) = runtime.db.call(list_scheduled)
    assert action.run_at.strftime("%Y-%m-%dT%H:%M") == when and action.status == "pending"
    bad = logged_in.http.post("/engine/schedule", data={**form, "at": "tomorrow"},
                              headers=headers)
    assert bad.status_code == 422 and "date and time" in bad.text
    cancelled = logged_in.http.post(f"/engine/scheduled/{action.id}/cancel",
                                    data={"_csrf_token": token}, headers=headers)
    assert cancelled.status_code == 200 and "Cancelled." in cancelled.text
    assert runtime.db.call(list_scheduled)[0].status == "cancelled"
