"""Migration 0016 (per-class SLO counts in the usage roll-ups) on a database with rows: a
database at 0015 holding per-request rows of two classes, roll-ups written the way that
release wrote them (one row per bucket, key and model), requests whose per-request rows were
already pruned and requests from before the classes. The upgrade splits each roll-up row by
the classes of its kept rows without changing any total, the counts then outlive pruning, and
the downgrade sums the rows back to what they were. Real databases (SQLite; PostgreSQL where
CI gives one), real alembic.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, replace
from typing import Any

import pytest
import sqlalchemy as sa
from alembic import command
from alembic.config import Config as AlembicConfig
from sqlalchemy import insert, inspect

from appliance.db.database import Database
from appliance.db.models import UsageRequest, UTCDateTime
from appliance.db.schema import migrate, schema_state
from appliance.gateway import slo
from appliance.gateway.usage import (
    UsageRecord,
    class_counts,
    day_of,
    hour_of,
    prune,
    rollup_sums,
)
from appliance.resources import migrations_dir
from tests.test_usage_rollup_classes import expected

BEFORE = "0015_scrub_engine_key"
UTC = dt.UTC
T0 = dt.datetime(2026, 11, 29, 23, 0, tzinfo=UTC)
M = dt.timedelta(minutes=1)
OLD_SUMS = ("requests", "errors", "prompt_tokens", "completion_tokens", "cached_tokens",
            "duration_ms", "ttft_ms", "ttft_count", "appended", "rewritten")
NOW = dt.datetime(2026, 12, 3, tzinfo=UTC)


def rec(key_id: int | None, started: dt.datetime, cls: str = "", result: str = "",
        outcome: str = "ok", *, prompt: int = 1000, ttft: float | None = 250.5,
        history: str = "") -> UsageRecord:
    return UsageRecord(key_id, "kimi-k3", "chat", True, 429 if result == slo.REFUSED else 200,
                       outcome, prompt, 120, 300, started, started + 2 * M, 1.5, ttft,
                       1999.25, history, cls, result)


KEPT = [  # per-request rows still there at the upgrade (written since 0014)
    rec(1, T0 + 5 * M, "interactive", slo.MET, history="appended"),
    rec(1, T0 + 6 * M, "interactive", slo.MISSED_TTFT, prompt=9000),
    rec(1, T0 + 7 * M, "batch", slo.MET, history="rewritten"),  # the key moved class
    rec(2, T0 + 8 * M, "interactive", slo.REFUSED, slo.PREDICTED_MISS, ttft=None),
    rec(2, T0 + 70 * M, "batch", slo.REFUSED, "queue_timeout", ttft=None),
    rec(2, T0 + 71 * M, "batch", slo.MISSED_DECODE),
    rec(2, T0 + 72 * M, "batch", "", "bad_request", ttft=None),  # a class, nothing judged
]
PRUNED = [  # only in the roll-ups: their per-request rows went before the upgrade
    rec(1, T0 + 1 * M, "interactive", slo.MET),
    rec(2, T0 - 10 * 60 * M, "batch", slo.MET),
]
UNCLASSED = [  # before the classes (0013), or refused before a key
    rec(1, T0 + 2 * M),
    rec(None, T0 + 9 * M, outcome="unauthorized", prompt=0, ttft=None),
]
EVERY = [*KEPT, *PRUNED, *UNCLASSED]
KEPT_ROWS = [*KEPT, UNCLASSED[1]]  # what usage_requests holds at the upgrade


@pytest.fixture
def database(backend_url: str) -> Iterator[Database]:
    db = Database(backend_url)
    yield db
    db.dispose()


def alembic(database: Database, verb: Callable[[AlembicConfig, str], None],
            revision: str) -> None:
    cfg = AlembicConfig()
    cfg.set_main_option("script_location", str(migrations_dir()))
    with database.engine.begin() as conn:
        cfg.attributes["connection"] = conn
        verb(cfg, revision)


def grouped(records: Iterable[UsageRecord], bucket_of: Callable[[dt.datetime], dt.datetime],
            *, by_class: bool) -> dict[tuple[Any, ...], dict[str, Any]]:
    groups: dict[tuple[Any, ...], list[UsageRecord]] = {}
    for r in records:
        grain = (bucket_of(r.started_at), r.key_id or 0, r.model)
        groups.setdefault((*grain, r.service_class) if by_class else grain, []).append(r)
    return {g: rollup_sums(items) for g, items in groups.items()}


def old_rollup(name: str) -> sa.TableClause:
    return sa.table(name, sa.column("bucket", UTCDateTime), sa.column("key_id"),
                    sa.column("model"), *(sa.column(c) for c in OLD_SUMS))


def write_as_0015(database: Database) -> None:
    """The per-request rows kept, and the roll-ups of every request, as 0015 wrote them."""
    with database.engine.begin() as conn:
        conn.execute(insert(UsageRequest), [asdict(r) for r in KEPT_ROWS])
        for name, of in (("usage_hourly", hour_of), ("usage_daily", day_of)):
            rows = [{"bucket": bucket, "key_id": key_id, "model": model,
                     **{c: sums[c] for c in OLD_SUMS}}
                    for (bucket, key_id, model), sums in grouped(EVERY, of,
                                                                 by_class=False).items()]
            conn.execute(old_rollup(name).insert(), rows)


def read(database: Database, name: str) -> dict[tuple[Any, ...], dict[str, Any]]:
    table = sa.Table(name, sa.MetaData(), autoload_with=database.engine)
    out = {}
    with database.engine.connect() as conn:
        for row in conn.execute(sa.select(table)).mappings():
            values = dict(row)
            bucket = UTCDateTime().process_result_value(values.pop("bucket"),
                                                        database.engine.dialect)
            grain = (bucket, values.pop("key_id"), values.pop("model"))
            if "service_class" in values:
                grain = (*grain, values.pop("service_class"))
            values.pop("id")
            out[grain] = values
    return out


def approx(sums: dict[tuple[Any, ...], dict[str, Any]],
           columns: Iterable[str]) -> dict[tuple[Any, ...], dict[str, Any]]:
    return {g: {c: pytest.approx(v[c]) for c in columns} for g, v in sums.items()}


def totals(rows: dict[tuple[Any, ...], dict[str, Any]]) -> dict[tuple[Any, ...], dict[str, Any]]:
    """Summed over the classes: the old grain's rows."""
    out: dict[tuple[Any, ...], dict[str, Any]] = {}
    for grain, values in rows.items():
        into = out.setdefault(grain[:3], dict.fromkeys(OLD_SUMS, 0))
        for c in OLD_SUMS:
            into[c] += values[c]
    return out


def test_the_upgrade_splits_the_roll_ups_by_class_and_the_downgrade_sums_them_back(
        database: Database, tmp_path: Any) -> None:
    alembic(database, command.upgrade, BEFORE)
    write_as_0015(database)
    before = {name: read(database, name) for name in ("usage_hourly", "usage_daily")}

    result = migrate(database, migrations_dir(), tmp_path / "backups", NOW)
    assert result.before == BEFORE and schema_state(database, migrations_dir()).at_head

    for name, of in (("usage_hourly", hour_of), ("usage_daily", day_of)):
        after = read(database, name)
        # Not one total changed.
        assert approx(totals(after), OLD_SUMS) == approx(before[name], OLD_SUMS)
        # Each class's kept requests have a row of their own, with their SLO counts ...
        classed = grouped(KEPT, of, by_class=True)
        for grain, sums in classed.items():
            assert after[grain] == approx({grain: sums}, sums)[grain], (name, grain)
        # ... and the rest (pruned before, no class) stays in the row of class "".
        rest = grouped([*PRUNED, *UNCLASSED], of, by_class=False)
        for grain, sums in rest.items():
            row = after[(*grain, "")]
            assert {c: row[c] for c in OLD_SUMS} == approx({grain: sums}, OLD_SUMS)[grain]
            assert row["slo_met"] == row["slo_refused"] == 0
        assert set(after) == set(classed) | {(*g, "") for g in rest}

    # The counts are the kept rows', and stay so once those rows are gone too.
    span = (T0 - dt.timedelta(days=1), T0 + dt.timedelta(days=2))
    counts = database.call(lambda s: class_counts(s, *span))
    assert counts == expected(KEPT, *span)
    assert [c.name for c in counts] == ["batch", "interactive"]
    assert database.call(lambda s: prune(s, NOW)) == len(KEPT_ROWS)
    assert database.call(lambda s: class_counts(s, *span)) == counts
    assert database.call(lambda s: class_counts(s, *span, 2)) == expected(KEPT, *span, 2)

    alembic(database, command.downgrade, BEFORE)
    for name in ("usage_hourly", "usage_daily"):
        back = read(database, name)
        assert approx(back, OLD_SUMS) == approx(before[name], OLD_SUMS)
        columns = {c["name"] for c in inspect(database.engine).get_columns(name)}
        assert "service_class" not in columns and "slo_met" not in columns
        uniques = inspect(database.engine).get_unique_constraints(name)
        assert [u["column_names"] for u in uniques] == [["bucket", "key_id", "model"]]
    migrate(database, migrations_dir(), tmp_path / "backups", NOW)  # and up again
    assert schema_state(database, migrations_dir()).at_head


def test_a_roll_up_row_the_kept_rows_do_not_fit_in_is_left_as_it_was(
        database: Database, tmp_path: Any) -> None:
    """A database edited by hand (a roll-up row smaller than the rows it should sum): the
    upgrade does not make its numbers negative, it leaves the row alone."""
    alembic(database, command.upgrade, BEFORE)
    with database.engine.begin() as conn:
        conn.execute(insert(UsageRequest), [asdict(r) for r in KEPT[:2]])
        sums = rollup_sums([replace(KEPT[0], service_class="")])
        conn.execute(old_rollup("usage_hourly").insert(), [{
            "bucket": hour_of(T0), "key_id": 1, "model": "kimi-k3",
            **{c: sums[c] for c in OLD_SUMS}}])
    migrate(database, migrations_dir(), tmp_path / "backups", NOW)
    after = read(database, "usage_hourly")
    assert list(after) == [(hour_of(T0), 1, "kimi-k3", "")]
    assert after[(hour_of(T0), 1, "kimi-k3", "")]["requests"] == 1
