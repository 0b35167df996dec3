"""Roles: each console account and admin API token gets a role (viewer, operator, admin).

Accounts and tokens from before roles become admins: they could do everything already, and a
box must never be left without an admin by an upgrade.

Revision ID: 0009_roles
Revises: 0008_qualification
Create Date: 2026-12-09
"""

import sqlalchemy as sa
from alembic import op

revision = "0009_roles"
down_revision = "0008_qualification"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # add_column outside batch mode: SQLite adds a column in place, so the rows stay where
    # they are (a batch rebuild of admin_users would cascade into its sessions and tokens).
    op.add_column("admin_users", sa.Column("role", sa.String(16), nullable=False,
                                           server_default="admin"))
    op.add_column("api_tokens", sa.Column("role", sa.String(16), nullable=False,
                                          server_default="admin"))


def downgrade() -> None:
    with op.batch_alter_table("api_tokens") as batch:
        batch.drop_column("role")
    with op.batch_alter_table("admin_users") as batch:
        batch.drop_column("role")
