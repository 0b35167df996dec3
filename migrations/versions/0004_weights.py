"""Weights: manifests (sets), their files, and the operator's wish (active set, running job).

Revision ID: 0004_weights
Revises: 0003_scheduled_actions
Create Date: 2026-11-30
"""

import sqlalchemy as sa
from alembic import op

from appliance.db.models import UTCDateTime

revision = "0004_weights"
down_revision = "0003_scheduled_actions"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "weights_sets",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("repo_id", sa.String(200), nullable=False),
        sa.Column("revision", sa.String(255), nullable=False),
        sa.Column("commit_id", sa.String(128), nullable=False),
        sa.Column("source", sa.String(1024), nullable=False),
        sa.Column("manifest_digest", sa.String(64), nullable=False),
        sa.Column("total_bytes", sa.BigInteger, nullable=False),
        sa.Column("created_at", UTCDateTime, nullable=False),
        sa.Column("full_verified_at", UTCDateTime, nullable=True),
        sa.UniqueConstraint("repo_id", "commit_id", name="uq_weights_sets_commit"),
    )
    op.create_table(
        "weights_files",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("set_id", sa.Integer,
                  sa.ForeignKey("weights_sets.id", ondelete="CASCADE"), nullable=False),
        sa.Column("path", sa.String(1024), nullable=False),
        sa.Column("size", sa.BigInteger, nullable=False),
        sa.Column("sha256", sa.String(64), nullable=True),
        sa.Column("git_oid", sa.String(40), nullable=True),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("bytes_done", sa.BigInteger, nullable=False),
        sa.Column("attempts", sa.Integer, nullable=False),
        sa.Column("last_error", sa.Text, nullable=False),
        sa.Column("verified_at", UTCDateTime, nullable=True),
        sa.Column("verified_size", sa.BigInteger, nullable=True),
        sa.Column("verified_mtime_ns", sa.BigInteger, nullable=True),
        sa.UniqueConstraint("set_id", "path", name="uq_weights_files_path"),
    )
    op.create_index("ix_weights_files_set_id", "weights_files", ["set_id"])
    op.create_table(
        "weights_control",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("active_set_id", sa.Integer,
                  sa.ForeignKey("weights_sets.id", ondelete="SET NULL"), nullable=True),
        sa.Column("job", sa.String(16), nullable=False),
        sa.Column("job_args", sa.Text, nullable=False),
        sa.Column("updated_at", UTCDateTime, nullable=False),
        sa.Column("updated_by", sa.String(128), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("weights_control")
    op.drop_table("weights_files")
    op.drop_table("weights_sets")
