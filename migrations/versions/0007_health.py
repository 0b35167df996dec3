"""Health monitoring: fine samples, hourly roll-ups, check transitions and mutes.

Revision ID: 0007_health
Revises: 0006_gateway
Create Date: 2026-12-05
"""

import sqlalchemy as sa
from alembic import op

from appliance.db.models import UTCDateTime

revision = "0007_health"
down_revision = "0006_gateway"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "health_samples",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer, "sqlite"), primary_key=True,
                  autoincrement=True),
        sa.Column("at", UTCDateTime, nullable=False),
        sa.Column("name", sa.String(64), nullable=False),
        sa.Column("subject", sa.String(32), nullable=False),
        sa.Column("value", sa.Float, nullable=False),
    )
    op.create_index("ix_health_samples_series", "health_samples", ["name", "subject", "at"])
    op.create_index("ix_health_samples_at", "health_samples", ["at"])
    op.create_table(
        "health_hourly",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("bucket", UTCDateTime, nullable=False),
        sa.Column("name", sa.String(64), nullable=False),
        sa.Column("subject", sa.String(32), nullable=False),
        sa.Column("count", sa.Integer, nullable=False),
        sa.Column("min", sa.Float, nullable=False),
        sa.Column("avg", sa.Float, nullable=False),
        sa.Column("max", sa.Float, nullable=False),
        sa.UniqueConstraint("name", "subject", "bucket", name="uq_health_hourly"),
    )
    op.create_index("ix_health_hourly_bucket", "health_hourly", ["bucket"])
    op.create_table(
        "health_transitions",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("at", UTCDateTime, nullable=False),
        sa.Column("check_id", sa.String(128), nullable=False),
        sa.Column("check_group", sa.String(16), nullable=False),
        sa.Column("title", sa.String(128), nullable=False),
        sa.Column("level", sa.String(16), nullable=False),
        sa.Column("previous_level", sa.String(16), nullable=False),
        sa.Column("summary", sa.Text, nullable=False),
        sa.Column("hint", sa.Text, nullable=False),
        sa.Column("muted", sa.Boolean, nullable=False),
    )
    op.create_index("ix_health_transitions_check", "health_transitions", ["check_id", "at"])
    op.create_index("ix_health_transitions_at", "health_transitions", ["at"])
    op.create_table(
        "health_mutes",
        sa.Column("check_id", sa.String(128), primary_key=True),
        sa.Column("until", UTCDateTime, nullable=True),
        sa.Column("created_at", UTCDateTime, nullable=False),
        sa.Column("created_by", sa.String(128), nullable=False),
        sa.Column("reason", sa.Text, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("health_mutes")
    op.drop_index("ix_health_transitions_at", "health_transitions")
    op.drop_index("ix_health_transitions_check", "health_transitions")
    op.drop_table("health_transitions")
    op.drop_index("ix_health_hourly_bucket", "health_hourly")
    op.drop_table("health_hourly")
    op.drop_index("ix_health_samples_at", "health_samples")
    op.drop_index("ix_health_samples_series", "health_samples")
    op.drop_table("health_samples")
