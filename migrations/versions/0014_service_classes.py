"""Service classes (issue 24): each API key belongs to a class (`interactive` for every key
that existed before), and each usage row keeps the class it was served under and what it got
of the class's promise (met, refused, missed_ttft, missed_decode; empty for rows before).

Revision ID: 0014_service_classes
Revises: 0013_cell_watch
Create Date: 2026-12-02
"""

import sqlalchemy as sa
from alembic import op

revision = "0014_service_classes"
down_revision = "0013_cell_watch"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("gateway_keys") as batch:
        batch.add_column(sa.Column("service_class", sa.String(32), nullable=False,
                                   server_default="interactive"))
    with op.batch_alter_table("usage_requests") as batch:
        # text("''"): an empty string as server_default="" would be dropped as no default
        batch.add_column(sa.Column("service_class", sa.String(32), nullable=False,
                                   server_default=sa.text("''")))
        batch.add_column(sa.Column("slo", sa.String(16), nullable=False,
                                   server_default=sa.text("''")))


def downgrade() -> None:
    with op.batch_alter_table("usage_requests") as batch:
        batch.drop_column("slo")
        batch.drop_column("service_class")
    with op.batch_alter_table("gateway_keys") as batch:
        batch.drop_column("service_class")
