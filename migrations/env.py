"""Alembic environment. Run through `appliance migrate`, which passes an open connection.

Running `alembic` by hand is not supported: the daemon's configuration (and the backup taken
before every upgrade) lives in `appliance migrate`.
"""

from alembic import context

# Row modules outside appliance.db.models: importing them puts their tables on Base.metadata.
import appliance.cell.rows
import appliance.health.rows  # noqa: F401
from appliance.db.models import Base

connection = context.config.attributes.get("connection")
if connection is None:
    raise SystemExit("run migrations with `appliance migrate`, not the alembic command")

context.configure(
    connection=connection,
    target_metadata=Base.metadata,
    render_as_batch=connection.dialect.name == "sqlite",
    compare_type=True,
)
with context.begin_transaction():
    context.run_migrations()
