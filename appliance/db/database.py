"""The database adapter: one SQLAlchemy engine, sessions, and a way to run work off the loop.

SQLite (the embedded default) is opened with WAL, `synchronous=FULL` (commits survive power
loss on storage that honours fsync), foreign keys and a busy timeout on every connection.
PostgreSQL URLs are used as given (with the psycopg 3 driver).

Queries are synchronous functions of a `Session`; async callers go through `Database.run`,
which executes them in a worker thread so the event loop never waits on disk.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import anyio.to_thread
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import NullPool, QueuePool

T = TypeVar("T")

SQLITE_PRAGMAS = (
    "PRAGMA journal_mode=WAL",
    "PRAGMA synchronous=FULL",
    "PRAGMA foreign_keys=ON",
    "PRAGMA busy_timeout=10000",
)


def normalise_url(url: str) -> str:
    """Use psycopg 3 for plain `postgresql://` URLs (SQLAlchemy would pick psycopg2)."""
    parsed = make_url(url)
    if parsed.drivername == "postgresql":
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed.render_as_string(hide_password=False)


def create_db_engine(url: str, kept: int = 0) -> Engine:
    """An engine with the pragmas and pooling this appliance relies on.

    SQLite: by default no pool (NullPool): each unit of work opens its own connection, so no
    connection outlives a task that may replace the file. `kept` > 0 keeps up to that many
    open between units of work, for a process that writes many small transactions and never
    replaces the database (the gateway: `appliance restore` refuses while it runs). Opening
    one costs more than most of its transactions: four PRAGMAs and, as the only connection,
    a new WAL, checkpointed, synced and deleted again at its close (measured: about 0.4 ms of
    CPU and three files created and removed per unit of work)."""
    url = normalise_url(url)
    if url.startswith("sqlite"):
        if kept > 0:
            # handed to one thread at a time by the pool; pragmas set once per connection
            engine = create_engine(url, poolclass=QueuePool, pool_size=kept, max_overflow=8,
                                   connect_args={"timeout": 10, "check_same_thread": False})
        else:
            engine = create_engine(url, poolclass=NullPool, connect_args={"timeout": 10})

        @event.listens_for(engine, "connect")
        def _pragmas(dbapi_connection: Any, _record: Any) -> None:
            cursor = dbapi_connection.cursor()
            for pragma in SQLITE_PRAGMAS:
                cursor.execute(pragma)
            cursor.close()

        return engine
    return create_engine(url, pool_pre_ping=True, pool_size=5, max_overflow=5)


class Database:
    """Owns the engine; hands out transactional sessions."""

    def __init__(self, url: str, *, kept_connections: int = 0) -> None:
        self.url = normalise_url(url)
        self.engine = create_db_engine(self.url, kept_connections)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)

    @property
    def is_sqlite(self) -> bool:
        return self.engine.dialect.name == "sqlite"

    @contextmanager
    def session(self) -> Iterator[Session]:
        """A session that commits on success and rolls back on any exception."""
        with self._sessions.begin() as session:
            yield session

    def call(self, fn: Callable[[Session], T]) -> T:
        """Run `fn` in one transaction, in this thread."""
        with self.session() as session:
            return fn(session)

    async def run(self, fn: Callable[[Session], T]) -> T:
        """Run `fn` in one transaction in a worker thread (never block the event loop)."""
        return await anyio.to_thread.run_sync(self.call, fn)

    def dispose(self) -> None:
        self.engine.dispose()
