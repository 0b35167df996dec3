"""A weights job's end re-judges the weights health check at once (issue 23), and the status
names the newest verdict of either kind.

The real runtime (`build_runtime`: the weights service wired to the health monitor), a real
checkpoint and real SQLite; no "check now" and no scheduled poll: the verdict read right after
the job's end (waited on, not timed) is the job's.
"""

from __future__ import annotations

import asyncio
import os

from sqlalchemy.orm import Session

from appliance.health.model import Level
from appliance.runtime import Runtime
from appliance.testing.clock import FakeClock
from appliance.weights import records
from appliance.weights.cli import describe
from tests.test_health_weights import record_verified_set


def weights_verdict(runtime: Runtime) -> tuple[Level, str]:
    found = runtime.health.latest.result("weights.set")
    assert found is not None, runtime.health.latest.results
    return found.level, found.summary


def flip_a_byte(path: os.PathLike[str]) -> None:
    with open(path, "r+b") as handle:
        handle.seek(os.path.getsize(path) // 2)
        byte = handle.read(1)
        handle.seek(-1, os.SEEK_CUR)
        handle.write(bytes([byte[0] ^ 0xFF]))


def test_a_verify_job_end_re_judges_the_check_and_the_status_names_the_newest_verdict(
        runtime: Runtime, clock: FakeClock) -> None:
    folder, paths = record_verified_set(runtime)
    set_id = runtime.db.call(records.active_set).id  # type: ignore[union-attr]

    def unproven(session: Session) -> None:  # what a pull leaves before its last file
        records.set_full_verified(session, set_id, None)

    runtime.db.call(unproven)

    async def scenario() -> None:
        try:
            await runtime.health.check_weights()
            level, summary = weights_verdict(runtime)
            assert level is Level.WARN and "not verified yet" in summary, summary

            await runtime.weights.verify_full(actor="test")
            await runtime.weights.wait_job()
            level, summary = weights_verdict(runtime)
            assert level is Level.OK, summary  # at the job's end, not at the next poll
            quick = await runtime.weights.quick_verify()
            assert quick is not None and quick.ok

            clock.advance(60)
            flip_a_byte(folder / paths[0])  # same size: the quick check cannot see it
            await runtime.weights.verify_full(actor="test", rehash=True)
            await runtime.weights.wait_job()
            level, summary = weights_verdict(runtime)
            assert level is Level.CRITICAL and paths[0] in summary, summary

            view = await runtime.weights.status()
            latest = view.latest_check
            assert latest is not None and latest.kind == "full verification", latest
            assert not latest.ok and paths[0] in latest.summary
            text = describe(view.to_dict())
            assert "latest check: full verification at " in text and "FAILED" in text, text
            assert "quick check" not in text, text  # the older quick pass is not the verdict
        finally:
            await runtime.weights.stop_service()
            await runtime.health.close()

    asyncio.run(scenario())


def test_a_quick_check_newer_than_the_full_verification_is_the_one_shown(
        runtime: Runtime, clock: FakeClock) -> None:
    record_verified_set(runtime)

    async def scenario() -> None:
        try:
            await runtime.weights.verify_full(actor="test", rehash=True)
            await runtime.weights.wait_job()
            clock.advance(30)
            await runtime.weights.quick_verify()
            view = await runtime.weights.status()
            assert view.latest_check is not None
            assert view.latest_check.kind == "quick check" and view.latest_check.ok
            assert "latest check: quick check at " in describe(view.to_dict())
        finally:
            await runtime.weights.stop_service()
            await runtime.health.close()

    asyncio.run(scenario())


def test_a_job_cancelled_or_ended_re_judges_the_check(runtime: Runtime) -> None:
    record_verified_set(runtime)
    judged: list[str] = []

    async def note() -> None:
        judged.append("judged")

    runtime.weights.on_job_end = note

    async def scenario() -> None:
        try:
            await runtime.weights.verify_full(actor="test", rehash=True)
            await runtime.weights.cancel(actor="test")
            assert judged, "the job's end did not re-judge the check"
        finally:
            await runtime.weights.stop_service()
            await runtime.health.close()

    asyncio.run(scenario())


def test_the_unchanged_files_time_is_the_sets_verification_when_it_covers_them() -> None:
    import datetime as dt

    from appliance.weights.importer import _unchanged_since

    set_at = dt.datetime(2026, 12, 2, 3, 44, 20, tzinfo=dt.UTC)

    def file(at: dt.datetime | None) -> records.FileRecord:
        return records.FileRecord(path="a", size=1, sha256=None, git_oid=None, state="verified",
                                  bytes_done=1, attempts=0, last_error="", verified_at=at,
                                  verified_size=1, verified_mtime_ns=1)

    pulled = [file(set_at - dt.timedelta(seconds=19)), file(set_at)]  # one by one, then the set
    assert _unchanged_since(pulled, set_at) == set_at  # "03:44:20" in both lines
    later = set_at + dt.timedelta(hours=1)  # a file re-proven after the set: its own time
    assert _unchanged_since([file(later)], set_at) == later
    assert _unchanged_since([file(None)], set_at) is None
