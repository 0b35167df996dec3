"""Gateway: API keys, per-request usage with hourly and daily roll-ups, and the engine
status the control plane publishes for the gateway process.

Revision ID: 0006_gateway
Revises: 0005_tuning
Create Date: 2026-12-02
"""

import sqlalchemy as sa
from alembic import op

from appliance.db.models import UTCDateTime

revision = "0006_gateway"
down_revision = "0005_tuning"
branch_labels = None
depends_on = None


def _rollup(name: str) -> None:
    op.create_table(
        name,
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("bucket", UTCDateTime, nullable=False, index=True),
        sa.Column("key_id", sa.Integer, nullable=False),
        sa.Column("model", sa.String(200), nullable=False),
        sa.Column("requests", sa.Integer, nullable=False),
        sa.Column("errors", sa.Integer, nullable=False),
        sa.Column("prompt_tokens", sa.BigInteger, nullable=False),
        sa.Column("completion_tokens", sa.BigInteger, nullable=False),
        sa.Column("cached_tokens", sa.BigInteger, nullable=False),
        sa.Column("duration_ms", sa.Float, nullable=False),
        sa.Column("ttft_ms", sa.Float, nullable=False),
        sa.Column("ttft_count", sa.Integer, nullable=False),
        sa.Column("appended", sa.Integer, nullable=False),
        sa.Column("rewritten", sa.Integer, nullable=False),
        sa.UniqueConstraint("bucket", "key_id", "model", name=f"uq_{name}"),
    )


def upgrade() -> None:
    op.create_table(
        "engine_status",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("state", sa.String(32), nullable=False),
        sa.Column("message", sa.Text, nullable=False),
        sa.Column("eta_seconds", sa.Float, nullable=True),
        sa.Column("updated_at", UTCDateTime, nullable=False),
    )
    op.create_table(
        "gateway_keys",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("name", sa.String(64), nullable=False),
        sa.Column("owner", sa.String(128), nullable=False),
        sa.Column("prefix", sa.String(8), nullable=False, unique=True),
        sa.Column("key_hash", sa.String(64), nullable=False),
        sa.Column("created_at", UTCDateTime, nullable=False),
        sa.Column("created_by", sa.String(128), nullable=False),
        sa.Column("changed_at", UTCDateTime, nullable=False),
        sa.Column("last_used_at", UTCDateTime, nullable=True),
        sa.Column("expires_at", UTCDateTime, nullable=True),
        sa.Column("revoked_at", UTCDateTime, nullable=True),
        sa.Column("revoked_by", sa.String(128), nullable=False),
        sa.Column("max_concurrency", sa.Integer, nullable=True),
        sa.Column("requests_per_minute", sa.Integer, nullable=True),
        sa.Column("tokens_per_day", sa.BigInteger, nullable=True),
        sa.Column("max_tokens", sa.Integer, nullable=True),
    )
    op.create_table(
        "usage_requests",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer, "sqlite"), primary_key=True,
                  autoincrement=True),
        sa.Column("key_id", sa.Integer, nullable=True),
        sa.Column("model", sa.String(200), nullable=False),
        sa.Column("endpoint", sa.String(32), nullable=False),
        sa.Column("stream", sa.Boolean, nullable=False),
        sa.Column("status", sa.Integer, nullable=False),
        sa.Column("outcome", sa.String(32), nullable=False),
        sa.Column("prompt_tokens", sa.Integer, nullable=False),
        sa.Column("completion_tokens", sa.Integer, nullable=False),
        sa.Column("cached_tokens", sa.Integer, nullable=False),
        sa.Column("started_at", UTCDateTime, nullable=False),
        sa.Column("ended_at", UTCDateTime, nullable=False),
        sa.Column("queue_ms", sa.Float, nullable=False),
        sa.Column("ttft_ms", sa.Float, nullable=True),
        sa.Column("duration_ms", sa.Float, nullable=False),
        sa.Column("history", sa.String(16), nullable=False),
    )
    op.create_index("ix_usage_requests_started_at", "usage_requests", ["started_at"])
    op.create_index("ix_usage_requests_key_started", "usage_requests", ["key_id", "started_at"])
    _rollup("usage_hourly")
    _rollup("usage_daily")


def downgrade() -> None:
    op.drop_table("usage_daily")
    op.drop_table("usage_hourly")
    op.drop_index("ix_usage_requests_key_started", "usage_requests")
    op.drop_index("ix_usage_requests_started_at", "usage_requests")
    op.drop_table("usage_requests")
    op.drop_table("gateway_keys")
    op.drop_table("engine_status")
