"""The qualification ledger on a real migrated database: records survive a new Database
object (a daemon restart), a qualification belongs to its launch spec (another spec is
unqualified), a run a dead daemon left is closed as interrupted and the gateway's
qualification lease cleared at the next start."""

from __future__ import annotations

import asyncio
import datetime as dt
from types import SimpleNamespace
from typing import Any

from appliance.clock import SystemClock
from appliance.config import Config
from appliance.db.database import Database
from appliance.engine.publish import read_published, write_published, write_qualifying
from appliance.qualify import ledger, plan
from appliance.qualify.service import QualifyService
from appliance.qualify.verdict import Sample, judge, qualified_point, round_of, verdict_words

SPEC_A, SPEC_B = "a" * 64, "b" * 64
NOW = dt.datetime(2026, 12, 8, 9, 30, tzinfo=dt.UTC)


def steps() -> tuple[Any, ...]:
    def sample(rate: float) -> Sample:
        return Sample(0.0, 0.5, 0.5 + 99 / rate, 100, 512, (1 / rate,) * 99)

    return tuple(judge(c, [round_of(c, 1, [sample(r)] * c, 4.0)], floor=32, ttft_p90_max=None,
                       repeats=1) for c, r in ((1, 60.0), (2, 45.0), (4, 20.0)))


def record_done(db: Database, spec: str) -> ledger.Record:
    settings = plan.Settings(plan.harsh(512, 100), (1, 2, 4), repeats=1,
                             max_running_requests=4)
    measured = steps()
    point = qualified_point(measured)
    opened = db.call(lambda s: ledger.open_qualification(
        s, spec_hash=spec, at=NOW, by="alice", engine_version="0.5.23",
        tuning="profile chat, --mamba-full-memory-ratio 5", settings=settings))
    closed = db.call(lambda s: ledger.close_qualification(
        s, opened.id, state="done", at=NOW + dt.timedelta(minutes=3), steps=measured,
        qualified=point, verdict=verdict_words(point, 32, None, measured)))
    assert closed is not None
    return closed


def service(config: Config, db: Database, spec: str | None) -> QualifyService:
    supervisor: Any = SimpleNamespace(running_spec_hash=spec)
    return QualifyService(config, db, SystemClock(), supervisor)


def test_the_ledger_survives_a_new_database_object(config: Config, db: Database) -> None:
    written = record_done(db, SPEC_A)
    assert written.qualified == 2
    assert written.verdict == "qualified at 2 concurrent users: every user at or above 32 " \
                              "tokens/s"
    again = Database(config.database_url)  # what a restarted daemon opens
    try:
        found = again.call(lambda s: ledger.get_qualification(s, written.id))
        assert found == written  # every field, the step table and the settings included
        assert [s.concurrency for s in found.steps] == [1, 2, 4]
        assert found.steps[2].passed is False and found.steps[2].rounds[0].decode_p10 == 20.0
        assert again.call(lambda s: ledger.qualification_for(s, SPEC_A)) == written
    finally:
        again.dispose()


def test_another_spec_is_unqualified_until_it_qualifies(config: Config, db: Database) -> None:
    record_done(db, SPEC_A)
    qualified = asyncio.run(service(config, db, SPEC_A).current())
    assert qualified is not None and qualified.qualified == 2
    changed = service(config, db, SPEC_B)  # the engine restarted with another spec
    assert asyncio.run(changed.current()) is None
    from appliance.qualify.outcome import standing

    assert standing(SPEC_B, None) == (
        f"unqualified: the running engine (launch configuration {SPEC_B[:12]}) has never "
        "been qualified")
    # A failed or cancelled run of the new spec does not qualify it either.
    opened = db.call(lambda s: ledger.open_qualification(
        s, spec_hash=SPEC_B, at=NOW, by="bob", engine_version="", tuning="",
        settings=plan.Settings(plan.harsh(), (1,))))
    db.call(lambda s: ledger.close_qualification(s, opened.id, state="cancelled", at=NOW,
                                                 steps=(), qualified=None, verdict="cancelled"))
    assert asyncio.run(changed.current()) is None
    assert [r.state for r in db.call(ledger.list_qualifications)] == ["cancelled", "done"]


def test_a_restart_closes_a_left_run_and_opens_the_gateway(config: Config, db: Database) -> None:
    db.call(lambda s: write_published(s, "ready", "serving", None, NOW))
    db.call(lambda s: write_qualifying(s, dt.datetime.now(dt.UTC) + dt.timedelta(minutes=5)))
    left = db.call(lambda s: ledger.open_qualification(
        s, spec_hash=SPEC_A, at=NOW, by="alice", engine_version="", tuning="",
        settings=plan.Settings(plan.harsh(), (1, 2))))
    published = db.call(read_published)
    assert published is not None and published.qualifying(dt.datetime.now(dt.UTC))

    asyncio.run(service(config, db, SPEC_A).start_service())

    after = db.call(lambda s: ledger.get_qualification(s, left.id))
    assert after is not None and after.state == "interrupted" and after.ended_at is not None
    published = db.call(read_published)
    assert published is not None and published.qualifying_until is None
    assert not published.qualifying(dt.datetime.now(dt.UTC))
    assert published.state == "ready"  # the engine's own state untouched


def test_a_lapsed_lease_no_longer_closes_the_gateway(db: Database) -> None:
    db.call(lambda s: write_published(s, "ready", "serving", None, NOW))
    db.call(lambda s: write_qualifying(s, NOW + dt.timedelta(seconds=30)))
    published = db.call(read_published)
    assert published is not None
    assert published.qualifying(NOW + dt.timedelta(seconds=29))
    assert not published.qualifying(NOW + dt.timedelta(seconds=31))
