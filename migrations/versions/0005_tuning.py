"""Tuning: custom workload profiles and the applied memory split (ratio or pin).

Revision ID: 0005_tuning
Revises: 0004_weights
Create Date: 2026-12-01
"""

import sqlalchemy as sa
from alembic import op

from appliance.db.models import UTCDateTime

revision = "0005_tuning"
down_revision = "0004_weights"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "tuning_profiles",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("name", sa.String(64), nullable=False, unique=True),
        sa.Column("title", sa.String(128), nullable=False),
        sa.Column("description", sa.Text, nullable=False),
        sa.Column("lengths_json", sa.Text, nullable=False),
        sa.Column("target_concurrency", sa.Integer, nullable=False),
        sa.Column("created_at", UTCDateTime, nullable=False),
        sa.Column("created_by", sa.String(128), nullable=False),
        sa.Column("updated_at", UTCDateTime, nullable=False),
        sa.Column("updated_by", sa.String(128), nullable=False),
    )
    op.create_table(
        "tuning_choice",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("profile", sa.String(64), nullable=False),
        sa.Column("ratio", sa.Float, nullable=False),
        sa.Column("pin", sa.Integer, nullable=True),
        sa.Column("applied_at", UTCDateTime, nullable=False),
        sa.Column("applied_by", sa.String(128), nullable=False),
        sa.Column("spec_hash", sa.String(64), nullable=True),
    )


def downgrade() -> None:
    op.drop_table("tuning_choice")
    op.drop_table("tuning_profiles")
