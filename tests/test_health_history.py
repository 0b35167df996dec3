"""Health history on a real, migrated SQLite: samples, hourly roll-ups, pruning, transitions,
mutes, and the migration that creates the tables (up and down)."""

from __future__ import annotations

import datetime as dt
from functools import partial
from pathlib import Path

from alembic import command
from alembic.config import Config as AlembicConfig
from sqlalchemy import func, inspect, select

from appliance.db.database import Database
from appliance.gpu.port import GpuInfo, GpuSnapshot
from appliance.health import history, model
from appliance.health.model import CheckResult, EngineFigures, HealthSnapshot, Level, Sample
from appliance.health.rows import HealthHourlyRow, HealthSampleRow
from appliance.health.transitions import changes
from appliance.resources import migrations_dir
from appliance.testing.clock import FakeClock
from appliance.testing.fake_gpus import FakeGpus
from tests.test_health_host import roomy_host

HEALTH_TABLES = {"health_samples", "health_hourly", "health_transitions", "health_mutes"}
TEMP = model.GPU_TEMPERATURE


def test_samples_of_keeps_known_readings_only() -> None:
    at = dt.datetime(2026, 11, 30, 12, tzinfo=dt.UTC)
    gpus = GpuSnapshot("580.95.05", "13.0", (
        GpuInfo(0, "GPU-0", "B300", 100, 40, temperature_c=61.0, power_w=700.0,
                power_limit_w=1100.0, utilization_pct=93.0),
        GpuInfo(1, "", "", 0, 0, error="GPU is lost"),  # a lost GPU has no figures
        GpuInfo(2, "GPU-2", "B300", 100, 0),  # telemetry not read: only memory is known
    ))
    engine = EngineFigures(at=at, state="ready", running_requests=3, queued_requests=0,
                           token_usage=0.5, state_usage=0.25)
    samples = history.samples_of(HealthSnapshot(at=at, gpus=gpus, engine=engine))
    assert set(samples) == {
        Sample(TEMP, "0", 61.0), Sample(model.GPU_POWER, "0", 700.0),
        Sample(model.GPU_UTILIZATION, "0", 93.0), Sample(model.GPU_MEMORY_USED, "0", 40.0),
        Sample(model.GPU_MEMORY_USED, "2", 0.0),
        Sample(model.ENGINE_RUNNING, "", 3.0), Sample(model.ENGINE_QUEUED, "", 0.0),
        Sample(model.ENGINE_TOKEN_USAGE, "", 0.5), Sample(model.ENGINE_STATE_USAGE, "", 0.25),
    }


def test_a_full_snapshot_keeps_every_sample_name_and_only_those() -> None:
    """`SAMPLE_NAMES` (what the API serves) and `samples_of` (what is kept) agree."""
    at = dt.datetime(2026, 11, 30, 12, tzinfo=dt.UTC)
    engine = EngineFigures(at=at, state="ready", running_requests=3, queued_requests=0,
                           token_usage=0.5, state_usage=0.2, cache_hit_rate=0.6,
                           generation_tokens_per_second=900.0, ttft_p50_seconds=0.3)
    snapshot = HealthSnapshot(at=at, gpus=FakeGpus().snapshot(), engine=engine,
                              host=roomy_host(at))
    names = [s.name for s in history.samples_of(snapshot)]
    assert set(names) == set(model.SAMPLE_NAMES)
    assert len(set(model.SAMPLE_NAMES)) == len(model.SAMPLE_NAMES)


def _feed(db: Database, clock: FakeClock, hours: int, step_minutes: int = 10) -> None:
    """A temperature sample every `step_minutes` for `hours`: value = minutes since start
    modulo 60, so each hour's min/avg/max are known (0, 25, 50 for 10-minute steps)."""
    for i in range(hours * 60 // step_minutes):
        at = clock.now()
        value = float((i * step_minutes) % 60)
        samples = [Sample(TEMP, "3", value), Sample(TEMP, "4", 99.0)]
        db.call(partial(history.record_samples, at=at, samples=samples))
        clock.advance(step_minutes * 60)


def test_series_uses_fine_samples_recently_and_hourly_rollups_before(db: Database) -> None:
    start = dt.datetime(2026, 11, 30, 0, 0, tzinfo=dt.UTC)
    clock = FakeClock(start)
    _feed(db, clock, hours=30)
    now = clock.now()  # 2026-12-01 06:00
    pruned = db.call(lambda s: history.prune(s, now, fine_hours=24, hourly_days=30))

    assert pruned.rolled_up == 30 * 2  # two series, 30 complete hours
    assert pruned.samples == 6 * 6 * 2  # the 6 hours before the fine window, both series
    points = db.call(lambda s: history.series(s, TEMP, "3", start, now))
    hourly = [p for p in points if p[0] < now - dt.timedelta(hours=24)]
    fine = [p for p in points if p[0] >= now - dt.timedelta(hours=24)]
    assert [at for at, _ in hourly] == [start + dt.timedelta(hours=h) for h in range(6)]
    assert {value for _, value in hourly} == {25.0}  # the hour's average
    assert len(fine) == 24 * 6 and fine[0] == (now - dt.timedelta(hours=24), 0.0)
    assert [at for at, _ in points] == sorted(at for at, _ in points)
    rollup = db.call(lambda s: s.scalars(select(HealthHourlyRow).where(
        HealthHourlyRow.subject == "3").order_by(HealthHourlyRow.bucket)).first())
    assert rollup is not None
    assert (rollup.count, rollup.min, rollup.avg, rollup.max) == (6, 0.0, 25.0, 50.0)
    # Another subject, another series.
    assert {v for _, v in db.call(lambda s: history.series(s, TEMP, "4", start, now))} == {99.0}
    # A window inside the fine part has fine samples only.
    recent = db.call(lambda s: history.series(s, TEMP, "3", now - dt.timedelta(hours=1), now))
    assert len(recent) == 6
    # The dashboard reads its series in one query: the same points, per series.
    hour = now - dt.timedelta(hours=1)
    many = db.call(lambda s: history.recent_series(
        s, [(TEMP, "3"), (TEMP, "4"), (TEMP, "9")], hour, now))
    assert many[(TEMP, "3")] == recent
    assert {v for _, v in many[(TEMP, "4")]} == {99.0} and many[(TEMP, "9")] == []


def test_rolling_up_twice_changes_nothing(db: Database) -> None:
    clock = FakeClock(dt.datetime(2026, 11, 30, 0, 0, tzinfo=dt.UTC))
    _feed(db, clock, hours=3)
    now = clock.now()
    assert db.call(lambda s: history.roll_up(s, now)) == 6
    assert db.call(lambda s: history.roll_up(s, now)) == 0
    clock.advance(3600)  # nothing new in the hour that has just closed
    assert db.call(lambda s: history.roll_up(s, clock.now())) == 0


def test_prune_drops_old_rollups_transitions_and_expired_mutes(db: Database) -> None:
    clock = FakeClock(dt.datetime(2026, 10, 1, 0, 0, tzinfo=dt.UTC))
    _feed(db, clock, hours=2)
    result = CheckResult("gpu.3.temperature", "gpu", "GPU 3 temperature", Level.WARN, "hot")
    db.call(lambda s: history.record_transitions(
        s, changes({}, [result], clock.now()), frozenset()))
    db.call(lambda s: history.set_mute(s, "a", until=clock.now() + dt.timedelta(hours=1),
                                       at=clock.now(), by="alice", reason=""))
    db.call(lambda s: history.set_mute(s, "b", until=None, at=clock.now(), by="alice",
                                       reason="known"))
    clock.advance(31 * 86400)
    now = clock.now()

    pruned = db.call(lambda s: history.prune(s, now, fine_hours=24, hourly_days=30))

    assert (pruned.rolled_up, pruned.samples, pruned.hourly, pruned.transitions,
            pruned.mutes) == (4, 24, 4, 1, 1)
    counts = db.call(lambda s: (s.scalar(select(func.count()).select_from(HealthSampleRow)),
                                s.scalar(select(func.count()).select_from(HealthHourlyRow))))
    assert counts == (0, 0)
    assert [m.check_id for m in db.call(history.mutes)] == ["b"]


def test_transitions_are_listed_newest_first_and_seed_last_levels(db: Database) -> None:
    clock = FakeClock()
    hot = CheckResult("gpu.3.temperature", "gpu", "GPU 3 temperature", Level.WARN, "hot")
    hotter = CheckResult("gpu.3.temperature", "gpu", "GPU 3 temperature", Level.CRITICAL,
                         "very hot", "cool it")
    disk = CheckResult("host.models_disk", "host", "Models disk", Level.WARN, "filling")
    known: dict[str, Level] = {}
    for results in ([hot, disk], [hotter, disk]):
        found = changes(known, results, clock.now())
        known.update((r.id, r.level) for r in results)
        db.call(partial(history.record_transitions, changes=found,
                        muted=frozenset({"host.models_disk"})))
        clock.advance(60)

    every = db.call(lambda s: history.transitions(s))
    assert [(t.check_id, t.kind) for t in every] == [
        ("gpu.3.temperature", "change"), ("host.models_disk", "failure"),
        ("gpu.3.temperature", "failure")]
    assert every[0].previous_level is Level.WARN and every[0].hint == "cool it"
    assert every[1].muted and not every[0].muted
    one = db.call(lambda s: history.transitions(s, "gpu.3.temperature", limit=1))
    assert [t.level for t in one] == [Level.CRITICAL]
    since = db.call(lambda s: history.transitions(s, since=every[0].at))
    assert len(since) == 1
    assert db.call(history.last_levels) == {"gpu.3.temperature": Level.CRITICAL,
                                            "host.models_disk": Level.WARN}


def test_mutes_with_now_hide_expired_ones(db: Database) -> None:
    now = FakeClock().now()
    db.call(lambda s: history.set_mute(s, "x", until=now - dt.timedelta(seconds=1), at=now,
                                       by="alice", reason=""))
    db.call(lambda s: history.set_mute(s, "y", until=now + dt.timedelta(hours=1), at=now,
                                       by="alice", reason="maintenance"))
    assert [m.check_id for m in db.call(history.mutes)] == ["x", "y"]
    active = db.call(lambda s: history.mutes(s, now))
    assert [(m.check_id, m.reason, m.created_by) for m in active] == [
        ("y", "maintenance", "alice")]
    assert db.call(lambda s: history.clear_mute(s, "y"))
    assert not db.call(lambda s: history.clear_mute(s, "y"))


def test_health_migration_goes_down_and_up(tmp_path: Path) -> None:
    db = Database(f"sqlite:///{tmp_path / 'm.db'}")
    cfg = AlembicConfig()
    cfg.set_main_option("script_location", str(migrations_dir()))

    def run(step: str, target: str) -> set[str]:
        with db.engine.begin() as conn:
            cfg.attributes["connection"] = conn
            getattr(command, step)(cfg, target)
        with db.engine.connect() as conn:
            return set(inspect(conn).get_table_names())

    assert run("upgrade", "0007_health") >= HEALTH_TABLES
    tables = run("downgrade", "0006_gateway")
    assert not tables & HEALTH_TABLES and "usage_hourly" in tables
    assert run("upgrade", "0007_health") >= HEALTH_TABLES
    db.dispose()
