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
from sqlalchemy.pool import NullPool

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


def create_db_engine(url: str) -> Engine:
    """An engine with the pragmas and pooling this appliance relies on."""
    url = normalise_url(url)
    if url.startswith("sqlite"):
        # NullPool: each unit of work opens its own connection, so pragmas always apply and
        # no connection is shared across threads.
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

    def __init__(self, url: str) -> None:
        self.url = normalise_url(url)
        self.engine = create_db_engine(self.url)
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
