"""The head watches its cell: each member's engine as last seen through the peer API (its
worker URL for the router, bootstrap port, capacity, state), and the one-row `cell_status` the
head's daemon publishes for its gateway (forward to the router, admit up to the decode
members' capacity, or refuse with the reason).

Revision ID: 0013_cell_watch
Revises: 0012_admission
Create Date: 2026-12-13
"""

import sqlalchemy as sa
from alembic import op

from appliance.db.models import UTCDateTime

revision = "0013_cell_watch"
down_revision = "0012_admission"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("cell_members") as batch:
        batch.add_column(sa.Column("engine_url", sa.String(300), nullable=True))
        batch.add_column(sa.Column("bootstrap_port", sa.Integer, nullable=True))
        batch.add_column(sa.Column("reported_role", sa.String(16), nullable=True))
        batch.add_column(sa.Column("engine_state", sa.String(32), nullable=True))
        batch.add_column(sa.Column("capacity", sa.Integer, nullable=True))
        batch.add_column(sa.Column("seen_at", UTCDateTime, nullable=True))
    op.create_table(
        "cell_status",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("active", sa.Boolean, nullable=False),
        sa.Column("upstream_url", sa.String(300), nullable=False),
        sa.Column("serving", sa.Boolean, nullable=False),
        sa.Column("message", sa.Text, nullable=False),
        sa.Column("eta_seconds", sa.Float, nullable=True),
        sa.Column("capacity", sa.Integer, nullable=True),
        sa.Column("updated_at", UTCDateTime, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("cell_status")
    with op.batch_alter_table("cell_members") as batch:
        for name in ("seen_at", "capacity", "engine_state", "reported_role", "bootstrap_port",
                     "engine_url"):
            batch.drop_column(name)
