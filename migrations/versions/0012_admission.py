"""Admission from the ledger: the engine status row names the running launch spec (the
gateway looks its qualification up by it) and, while a qualification runs, the instant it is
expected to end (the gateway's 503 says it; the lease in `qualifying_until` still decides).

Revision ID: 0012_admission
Revises: 0011_cell
Create Date: 2026-12-12
"""

import sqlalchemy as sa
from alembic import op

from appliance.db.models import UTCDateTime

revision = "0012_admission"
down_revision = "0011_cell"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("engine_status") as batch:
        batch.add_column(sa.Column("spec_hash", sa.String(64), nullable=True))
        batch.add_column(sa.Column("qualifying_ends_at", UTCDateTime, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("engine_status") as batch:
        batch.drop_column("qualifying_ends_at")
        batch.drop_column("spec_hash")
