"""Engine runs and the operator's desired engine state.

Revision ID: 0002_engine
Revises: 0001_foundation
Create Date: 2026-11-30
"""

import sqlalchemy as sa
from alembic import op

from appliance.db.models import UTCDateTime

revision = "0002_engine"
down_revision = "0001_foundation"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "engine_runs",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("started_at", UTCDateTime, nullable=False),
        sa.Column("runner", sa.String(16), nullable=False),
        sa.Column("spec_hash", sa.String(64), nullable=False),
        sa.Column("spec_json", sa.Text, nullable=False),
        sa.Column("identity_json", sa.Text, nullable=True),
        sa.Column("attempt", sa.Integer, nullable=False),
        sa.Column("adopted", sa.Boolean, nullable=False),
        sa.Column("state", sa.String(32), nullable=False),
        sa.Column("phases", sa.Text, nullable=False),
        sa.Column("ready_at", UTCDateTime, nullable=True),
        sa.Column("ready_seconds", sa.Float, nullable=True),
        sa.Column("ended_at", UTCDateTime, nullable=True),
        sa.Column("exit_code", sa.Integer, nullable=True),
        sa.Column("reason", sa.String(32), nullable=True),
        sa.Column("hint", sa.Text, nullable=False),
        sa.Column("figures", sa.Text, nullable=False),
        sa.Column("log_path", sa.String(1024), nullable=False),
    )
    op.create_index("ix_engine_runs_started_at", "engine_runs", ["started_at"])
    op.create_table(
        "engine_control",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("desired", sa.String(16), nullable=False),
        sa.Column("last_good_spec_json", sa.Text, nullable=True),
        sa.Column("updated_at", UTCDateTime, nullable=False),
        sa.Column("updated_by", sa.String(128), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("engine_control")
    op.drop_table("engine_runs")
