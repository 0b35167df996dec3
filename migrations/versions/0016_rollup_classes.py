"""Per-class SLO counts in the usage roll-ups (issue 24): a roll-up row now sums one bucket's
requests of one key, model and service class, with what they got of the class's promise
(`slo_met`, `slo_refused`, `slo_missed_ttft`, `slo_missed_decode`) and the early refusals by
reason (`refused_predicted_miss`, `refused_queue_full`, `refused_queue_timeout`), so the
per-class counts outlive the per-request rows (gateway.usage_retention_days).

Upgrade: the columns are added (class "", counts 0), the unique key gains `service_class`,
and every roll-up row is split by the classes of its requests whose per-request rows are
still kept (written since 0014): their sums move to a row of their class, with their SLO
counts, and what is left (requests without a class, or whose rows were pruned) stays in the
row of class "". Totals do not change. A row whose requests the kept rows do not all fit in
(a database edited by hand) is left as it was.

Downgrade: the rows of one bucket, key and model are summed back into one, then the columns
and the wider unique key go. The per-class counts of pruned requests are lost with them.

The sums are written out here, not taken from `appliance.gateway.usage`, so this revision
does what it did when it was written whatever that module becomes.

Revision ID: 0016_rollup_classes
Revises: 0015_scrub_engine_key
Create Date: 2026-12-03
"""

import datetime as dt
from collections.abc import Callable, Iterator
from typing import Any

import sqlalchemy as sa
from alembic import op

from appliance.db.models import UTCDateTime

revision = "0016_rollup_classes"
down_revision = "0015_scrub_engine_key"
branch_labels = None
depends_on = None

TABLES = ("usage_hourly", "usage_daily")
OLD_GRAIN = ("bucket", "key_id", "model")
NEW_GRAIN = (*OLD_GRAIN, "service_class")
RESULTS = {"met": "slo_met", "refused": "slo_refused", "missed_ttft": "slo_missed_ttft",
           "missed_decode": "slo_missed_decode"}
REASONS = {"slo_ttft_predicted_miss": "refused_predicted_miss",
           "queue_full": "refused_queue_full", "queue_timeout": "refused_queue_timeout"}
COUNTS = (*RESULTS.values(), *REASONS.values())
OLD_SUMS = ("requests", "errors", "prompt_tokens", "completion_tokens", "cached_tokens",
            "duration_ms", "ttft_ms", "ttft_count", "appended", "rewritten")
SUMS = (*OLD_SUMS, *COUNTS)
FLOATS = frozenset({"duration_ms", "ttft_ms"})
BATCH = 5000  # per-request rows read at a time: a busy box keeps millions


def upgrade() -> None:
    for name in TABLES:
        with op.batch_alter_table(name) as batch:
            batch.add_column(sa.Column("service_class", sa.String(32), nullable=False,
                                       server_default=sa.text("''")))
            for column in COUNTS:
                batch.add_column(sa.Column(column, sa.Integer, nullable=False,
                                           server_default=sa.text("0")))
            batch.drop_constraint(f"uq_{name}", type_="unique")
            batch.create_unique_constraint(f"uq_{name}", list(NEW_GRAIN))
    bind = op.get_bind()
    hourly, daily = _kept_sums(bind)
    _split(bind, "usage_hourly", hourly)
    _split(bind, "usage_daily", daily)


def downgrade() -> None:
    bind = op.get_bind()
    for name in TABLES:
        _merge(bind, name)
        with op.batch_alter_table(name) as batch:
            batch.drop_constraint(f"uq_{name}", type_="unique")
            batch.create_unique_constraint(f"uq_{name}", list(OLD_GRAIN))
            for column in reversed(COUNTS):
                batch.drop_column(column)
            batch.drop_column("service_class")


def _rollup(name: str) -> sa.TableClause:
    return sa.table(name, sa.column("id", sa.Integer), sa.column("bucket", UTCDateTime),
                    sa.column("key_id", sa.Integer), sa.column("model", sa.String),
                    sa.column("service_class", sa.String),
                    *(sa.column(c, sa.Float if c in FLOATS else sa.Integer) for c in SUMS))


Group = tuple[dt.datetime, int, str, str]  # bucket, key_id, model, service_class


def _hour(at: dt.datetime) -> dt.datetime:
    return at.astimezone(dt.UTC).replace(minute=0, second=0, microsecond=0)


def _day(at: dt.datetime) -> dt.datetime:
    return _hour(at).replace(hour=0)


def _kept_sums(bind: sa.Connection) -> tuple[dict[Group, dict[str, Any]],
                                            dict[Group, dict[str, Any]]]:
    """The sums of the kept per-request rows that have a class, per hourly and daily group,
    as the gateway's writer added them to the roll-ups."""
    sums: tuple[dict[Group, dict[str, Any]], dict[Group, dict[str, Any]]] = ({}, {})
    bucket_of: tuple[Callable[[dt.datetime], dt.datetime], ...] = (_hour, _day)
    for row in _requests(bind):
        for groups, of in zip(sums, bucket_of, strict=True):
            group = (of(row["started_at"]), row["key_id"] or 0, row["model"],
                     row["service_class"])
            _add(groups.setdefault(group, dict.fromkeys(SUMS, 0)), row)
    return sums


def _requests(bind: sa.Connection) -> Iterator[dict[str, Any]]:
    table = sa.table("usage_requests", sa.column("id", sa.Integer),
                     sa.column("started_at", UTCDateTime),
                     *(sa.column(c, sa.String) for c in ("model", "outcome", "history",
                                                         "service_class", "slo")),
                     *(sa.column(c, sa.Integer) for c in ("key_id", "prompt_tokens",
                                                          "completion_tokens",
                                                          "cached_tokens")),
                     sa.column("duration_ms", sa.Float), sa.column("ttft_ms", sa.Float))
    last = 0
    while True:
        rows = [dict(r._mapping) for r in bind.execute(
            sa.select(table).where(table.c.id > last, table.c.service_class != "")
            .order_by(table.c.id).limit(BATCH))]
        yield from rows
        if len(rows) < BATCH:
            return
        last = rows[-1]["id"]


def _add(sums: dict[str, Any], row: dict[str, Any]) -> None:
    sums["requests"] += 1
    sums["errors"] += row["outcome"] != "ok"
    for column in ("prompt_tokens", "completion_tokens", "cached_tokens", "duration_ms"):
        sums[column] += row[column] or 0
    if row["ttft_ms"] is not None:
        sums["ttft_ms"] += row["ttft_ms"]
        sums["ttft_count"] += 1
    if row["history"] in ("appended", "rewritten"):
        sums[row["history"]] += 1
    if row["slo"] in RESULTS:
        sums[RESULTS[row["slo"]]] += 1
        if row["slo"] == "refused" and row["outcome"] in REASONS:
            sums[REASONS[row["outcome"]]] += 1


def _split(bind: sa.Connection, name: str, groups: dict[Group, dict[str, Any]]) -> None:
    """Move each group's sums out of its roll-up row of class "" into a row of its class."""
    table = _rollup(name)
    for (bucket, key_id, model, cls), sums in sorted(groups.items()):
        base = bind.execute(sa.select(table).where(
            table.c.bucket == bucket, table.c.key_id == key_id, table.c.model == model,
            table.c.service_class == "")).mappings().first()
        if base is None or any(base[c] < sums[c] for c in OLD_SUMS if c not in FLOATS):
            continue  # the kept rows are not all in this roll-up row: leave it be
        bind.execute(table.insert().values(bucket=bucket, key_id=key_id, model=model,
                                           service_class=cls, **sums))
        # what stays has no class, so no SLO counts (they were all 0 before this revision)
        rest = {c: max(0.0, base[c] - sums[c]) if c in FLOATS else base[c] - sums[c]
                for c in OLD_SUMS}
        where = table.c.id == base["id"]
        if rest["requests"] == 0:
            bind.execute(table.delete().where(where))
        else:
            bind.execute(table.update().where(where).values(**rest))


def _merge(bind: sa.Connection, name: str) -> None:
    """Sum the rows of each bucket, key and model into its first (the old grain's one row)."""
    table = _rollup(name)
    grain = [table.c[c] for c in OLD_GRAIN]
    shared = bind.execute(sa.select(*grain).group_by(*grain)
                          .having(sa.func.count(table.c.id) > 1)).all()
    for bucket, key_id, model in shared:
        rows = bind.execute(sa.select(table).where(
            table.c.bucket == bucket, table.c.key_id == key_id, table.c.model == model)
            .order_by(table.c.id)).mappings().all()
        keep, *others = rows
        total = {c: sum(r[c] for r in rows) for c in SUMS}
        bind.execute(table.delete().where(table.c.id.in_([r["id"] for r in others])))
        bind.execute(table.update().where(table.c.id == keep["id"])
                     .values(service_class="", **total))
