"""The cell: join tokens and peer credentials (a member's side), the member registry (a
head's side). Credentials are stored as keyed hashes only; the head keeps each member's
credential in a 0600 file, never in the database.

Revision ID: 0011_cell
Revises: 0010_oidc
Create Date: 2026-12-11
"""

import sqlalchemy as sa
from alembic import op

from appliance.db.models import UTCDateTime

revision = "0011_cell"
down_revision = "0010_oidc"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "cell_join_tokens",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("token_hash", sa.String(64), nullable=False, unique=True),
        sa.Column("created_at", UTCDateTime, nullable=False),
        sa.Column("created_by", sa.String(64), nullable=False),
        sa.Column("expires_at", UTCDateTime, nullable=False),
        sa.Column("used_at", UTCDateTime, nullable=True),
        sa.Column("used_by", sa.String(255), nullable=False),
    )
    op.create_table(
        "cell_peer_credentials",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("prefix", sa.String(16), nullable=False, unique=True),
        sa.Column("credential_hash", sa.String(64), nullable=False, unique=True),
        sa.Column("scope", sa.String(16), nullable=False),
        sa.Column("head", sa.String(255), nullable=False),
        sa.Column("created_at", UTCDateTime, nullable=False),
        sa.Column("last_used_at", UTCDateTime, nullable=True),
        sa.Column("revoked_at", UTCDateTime, nullable=True),
    )
    op.create_table(
        "cell_members",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("address", sa.String(255), nullable=False, unique=True),
        sa.Column("role", sa.String(16), nullable=False),
        sa.Column("verify_tls", sa.Boolean, nullable=False),
        sa.Column("credential_prefix", sa.String(16), nullable=False),
        sa.Column("added_at", UTCDateTime, nullable=False),
        sa.Column("added_by", sa.String(64), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("cell_members")
    op.drop_table("cell_peer_credentials")
    op.drop_table("cell_join_tokens")
