"""Qualification: the ledger of qualifications per launch-spec hash, and the gateway's
"closed for qualification" lease on the engine status row.

Revision ID: 0008_qualification
Revises: 0007_health
Create Date: 2026-12-08
"""

import sqlalchemy as sa
from alembic import op

from appliance.db.models import UTCDateTime

revision = "0008_qualification"
down_revision = "0007_health"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("engine_status") as batch:
        batch.add_column(sa.Column("qualifying_until", UTCDateTime, nullable=True))
    op.create_table(
        "qualifications",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("spec_hash", sa.String(64), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("started_at", UTCDateTime, nullable=False),
        sa.Column("ended_at", UTCDateTime, nullable=True),
        sa.Column("started_by", sa.String(128), nullable=False),
        sa.Column("engine_version", sa.String(64), nullable=False),
        sa.Column("tuning", sa.String(200), nullable=False),
        sa.Column("settings_json", sa.Text, nullable=False),
        sa.Column("steps_json", sa.Text, nullable=False),
        sa.Column("qualified", sa.Integer, nullable=True),
        sa.Column("verdict", sa.Text, nullable=False),
        sa.Column("error", sa.Text, nullable=False),
    )
    op.create_index("ix_qualifications_spec", "qualifications", ["spec_hash", "started_at"])


def downgrade() -> None:
    op.drop_index("ix_qualifications_spec", table_name="qualifications")
    op.drop_table("qualifications")
    with op.batch_alter_table("engine_status") as batch:
        batch.drop_column("qualifying_until")
