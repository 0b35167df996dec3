"""Single sign-on: an account is local (a password here) or the shadow of an OpenID Connect
user, found by the provider's issuer and the user's subject.

Revision ID: 0010_oidc
Revises: 0009_roles
Create Date: 2026-12-10
"""

import sqlalchemy as sa
from alembic import op

revision = "0010_oidc"
down_revision = "0009_roles"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("admin_users") as batch:
        batch.add_column(sa.Column("source", sa.String(16), nullable=False,
                                   server_default="local"))
        batch.add_column(sa.Column("external_issuer", sa.String(255), nullable=True))
        batch.add_column(sa.Column("external_subject", sa.String(255), nullable=True))
        batch.create_unique_constraint("uq_admin_users_external",
                                       ["external_issuer", "external_subject"])


def downgrade() -> None:
    with op.batch_alter_table("admin_users") as batch:
        batch.drop_constraint("uq_admin_users_external", type_="unique")
        batch.drop_column("external_subject")
        batch.drop_column("external_issuer")
        batch.drop_column("source")
