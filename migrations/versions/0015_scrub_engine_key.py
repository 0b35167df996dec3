"""Engine keys out of the rows written before the log parser redacted them (issue 22): an
engine run's `figures` (its parsed `server_args`, the failure line) and `hint` (which quotes
the failure), and an event's `message` and `detail`, pass through the same redaction the
parser and the API use (`appliance.engine.logsecrets`), in place. Only rows that change are
written; the rest of every figure stays as it was. Data only: the schema does not change.

Revision ID: 0015_scrub_engine_key
Revises: 0014_service_classes
Create Date: 2026-12-02
"""

import json
from collections.abc import Callable, Iterator
from typing import Any

import sqlalchemy as sa
from alembic import op

revision = "0015_scrub_engine_key"
down_revision = "0014_service_classes"
branch_labels = None
depends_on = None

BATCH = 500  # rows read at a time: a long-lived box's events table stays out of memory


def upgrade() -> None:
    from appliance.engine.logsecrets import redact

    _scrub("engine_runs", {"figures": _json_text, "hint": redact})
    _scrub("events", {"message": redact, "detail": _json_text})


def downgrade() -> None:
    """Nothing to undo: a redacted key cannot be put back, and the old code reads the rows."""


def _json_text(text: str) -> str:
    """A JSON column redacted structurally, so it still parses (`redact_json`); text that does
    not parse is redacted as text."""
    from appliance.engine.logsecrets import redact, redact_json

    try:
        value: Any = json.loads(text)
    except ValueError:
        return redact(text)
    redacted = redact_json(value)
    return text if redacted == value else json.dumps(redacted)


def _scrub(name: str, columns: dict[str, Callable[[str], str]]) -> None:
    table = sa.table(name, sa.column("id", sa.Integer),
                     *(sa.column(column, sa.Text) for column in columns))
    bind = op.get_bind()
    for rows in _batches(bind, table, list(columns)):
        for row in rows:
            changed = {}
            for column, scrub in columns.items():
                if row[column] is not None and (clean := scrub(row[column])) != row[column]:
                    changed[column] = clean
            if changed:
                bind.execute(table.update().where(table.c.id == row["id"]).values(**changed))


def _batches(bind: sa.Connection, table: sa.TableClause,
             columns: list[str]) -> Iterator[list[dict[str, Any]]]:
    last = 0
    while True:
        query = (sa.select(table.c.id, *(table.c[column] for column in columns))
                 .where(table.c.id > last).order_by(table.c.id).limit(BATCH))
        rows = [dict(row._mapping) for row in bind.execute(query)]
        if not rows:
            return
        yield rows
        last = rows[-1]["id"]
