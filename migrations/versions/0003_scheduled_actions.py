"""Engine actions scheduled for a maintenance window.

Revision ID: 0003_scheduled_actions
Revises: 0002_engine
Create Date: 2026-11-30
"""

import sqlalchemy as sa
from alembic import op

from appliance.db.models import UTCDateTime

revision = "0003_scheduled_actions"
down_revision = "0002_engine"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "scheduled_actions",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("command", sa.String(16), nullable=False),
        sa.Column("run_at", UTCDateTime, nullable=False),
        sa.Column("created_at", UTCDateTime, nullable=False),
        sa.Column("created_by", sa.String(128), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("outcome", sa.Text, nullable=False),
        sa.Column("finished_at", UTCDateTime, nullable=True),
    )
    op.create_index("ix_scheduled_actions_run_at", "scheduled_actions", ["run_at"])


def downgrade() -> None:
    op.drop_table("scheduled_actions")
