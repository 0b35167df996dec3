"""Schema version checks and migrations (Alembic), with a SQLite backup taken first.

The daemon never migrates by itself: `appliance migrate` does, so an upgrade is a deliberate
step with a backup. `check_schema` tells the daemon whether it may start:
- at head: yes;
- empty or older: no, run `appliance migrate`;
- newer than this code (a revision this release does not know): no, install the newer release
  or restore a backup; running would risk writing rows an old schema understanding corrupts.
"""

from __future__ import annotations

import datetime as dt
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

from alembic import command
from alembic.config import Config as AlembicConfig
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection
from sqlalchemy.engine import make_url

from appliance.db.database import Database
from appliance.errors import MigrationFailed, SchemaMismatch


@dataclass(frozen=True)
class SchemaState:
    current: str | None
    head: str
    known: bool

    @property
    def at_head(self) -> bool:
        return self.current == self.head


def _alembic_config(script_location: Path) -> AlembicConfig:
    cfg = AlembicConfig()
    cfg.set_main_option("script_location", str(script_location))
    return cfg


def schema_state(db: Database, script_location: Path) -> SchemaState:
    script = ScriptDirectory.from_config(_alembic_config(script_location))
    head = script.get_current_head()
    assert head is not None, "the migrations folder has no head revision"
    with db.engine.connect() as conn:
        current = MigrationContext.configure(conn).get_current_revision()
    known = current is None or _revision_known(script, current)
    return SchemaState(current=current, head=head, known=known)


def _revision_known(script: ScriptDirectory, revision: str) -> bool:
    try:
        return script.get_revision(revision) is not None
    except Exception:  # alembic raises several types for unknown ids
        return False


def check_schema(db: Database, script_location: Path) -> SchemaState:
    """Raise `SchemaMismatch` unless the database is exactly at this code's head revision."""
    state = schema_state(db, script_location)
    where = _describe(db)
    if not state.known:
        raise SchemaMismatch(
            "schema_newer",
            f"the database {where} is at schema revision {state.current}, which is newer than "
            f"this release of the appliance knows (its newest is {state.head})",
            "start the newer release that migrated it, or restore the backup taken before "
            "that upgrade (state dir, backups/)",
        )
    if state.current is None:
        raise SchemaMismatch(
            "schema_empty",
            f"the database {where} has not been initialised",
            "run `appliance migrate` (with the same --config) and start again",
        )
    if not state.at_head:
        raise SchemaMismatch(
            "schema_older",
            f"the database {where} is at schema revision {state.current}; this release "
            f"needs {state.head}",
            "run `appliance migrate` (it backs the database up first) and start again",
        )
    return state


@dataclass(frozen=True)
class MigrationResult:
    before: str | None
    after: str
    backup: Path | None


def migrate(
    db: Database, script_location: Path, backup_dir: Path, now: dt.datetime
) -> MigrationResult:
    """Upgrade to head in one transaction. On SQLite, copy the database first (unless it is
    empty) and put the copy back if a step fails."""
    state = schema_state(db, script_location)
    if not state.known:
        check_schema(db, script_location)  # raises the "newer" message
    if state.at_head:
        return MigrationResult(state.current, state.head, None)
    has_data = state.current is not None  # an empty database has nothing worth a copy
    backup = None
    if db.is_sqlite and has_data:
        backup = _backup_sqlite(db, backup_dir, now, state.current)
    cfg = _alembic_config(script_location)
    try:
        with db.engine.connect() as conn, _migration_transaction(conn):
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, "head")
    except Exception as exc:
        restored = ""
        if backup is not None:
            try:
                _restore_sqlite(db, backup)
            except Exception as restore_exc:
                raise MigrationFailed(
                    "migration_failed",
                    f"migrating the database {_describe(db)} from {state.current} to "
                    f"{state.head} failed ({type(exc).__name__}: {exc}), and putting back "
                    f"the copy taken before it failed too ({type(restore_exc).__name__}: "
                    f"{restore_exc})",
                    f"with the daemon stopped, copy {backup} over {_describe(db)} by hand, "
                    "then keep running the previous release and report this error",
                ) from exc
            restored = f"; the database was restored from {backup}"
        raise MigrationFailed(
            "migration_failed",
            f"migrating the database {_describe(db)} from {state.current or 'empty'} to "
            f"{state.head} failed: {type(exc).__name__}: {exc}{restored}",
            "keep running the previous release (its schema is intact) and report this error",
        ) from exc
    return MigrationResult(state.current, state.head, backup)


@contextmanager
def _migration_transaction(conn: Connection) -> Iterator[None]:
    """One transaction around the whole upgrade, so a failing step leaves nothing behind.

    PostgreSQL has transactional DDL; a plain transaction is enough. SQLite has it too, but
    Python's sqlite3 driver only opens a transaction before INSERT/UPDATE/DELETE, so DDL would
    run in autocommit and a failing step would leave the steps before it applied. Here the
    driver's transaction handling is switched off and the transaction begun explicitly
    (IMMEDIATE: the write lock is taken up front, waiting out other writers).

    On SQLite foreign key enforcement is also off for the migration (it cannot change inside a
    transaction). Alembic's batch mode rebuilds a table by copy, DROP and RENAME, and with
    enforcement on, dropping a parent table runs ON DELETE CASCADE on its children: rebuilding
    `admin_users` would silently delete every session and API token. `PRAGMA
    foreign_key_check` before the commit then refuses a migration that leaves a dangling
    reference, so turning enforcement off hides nothing.
    """
    if conn.dialect.name != "sqlite":
        with conn.begin():
            yield
        return
    raw = conn.connection.driver_connection
    assert isinstance(raw, sqlite3.Connection)
    previous = raw.isolation_level
    raw.isolation_level = None
    raw.execute("PRAGMA foreign_keys=OFF")
    try:
        with conn.begin():
            conn.exec_driver_sql("BEGIN IMMEDIATE")
            yield
            dangling = conn.exec_driver_sql("PRAGMA foreign_key_check").all()
            if dangling:
                shown = "; ".join(
                    f"{table} row {rowid} refers to a missing {parent} row"
                    for table, rowid, parent, _fk in dangling[:5]
                )
                more = f" (and {len(dangling) - 5} more)" if len(dangling) > 5 else ""
                raise RuntimeError(f"the migrated schema breaks foreign keys: {shown}{more}")
    finally:
        # The connection is closed right after (NullPool); this is hygiene, never worth
        # hiding the migration's own error for.
        with suppress(sqlite3.Error):
            raw.execute("PRAGMA foreign_keys=ON")
            raw.isolation_level = previous


def _sqlite_path(db: Database) -> Path | None:
    database = make_url(db.url).database
    return Path(database) if database and database != ":memory:" else None


def _describe(db: Database) -> str:
    path = _sqlite_path(db) if db.is_sqlite else None
    return str(path) if path else make_url(db.url).render_as_string(hide_password=True)


def _backup_sqlite(
    db: Database, backup_dir: Path, now: dt.datetime, revision: str | None
) -> Path | None:
    path = _sqlite_path(db)
    if path is None or not path.exists():
        return None
    backup_dir.mkdir(parents=True, exist_ok=True)
    stamp = now.astimezone(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    target = backup_dir / f"{path.stem}-{stamp}-{revision or 'empty'}.db"
    # The online backup API copies a consistent snapshot, WAL included.
    with sqlite3.connect(path) as src, sqlite3.connect(target) as dst:
        src.backup(dst)
    src.close()
    dst.close()
    return target


def _restore_sqlite(db: Database, backup: Path) -> None:
    path = _sqlite_path(db)
    assert path is not None
    db.dispose()
    with sqlite3.connect(backup) as src, sqlite3.connect(path) as dst:
        src.backup(dst)
    src.close()
    dst.close()
