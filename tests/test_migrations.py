"""Schema migrations on real databases: the result matches the models, the daemon refuses a
schema it does not match, and a failing upgrade leaves the previous database usable.

Newer, older and broken releases are simulated with a copy of `migrations/` plus one extra
revision written by the test; the real migrations are never edited.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import func, inspect, select, text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from appliance.auth.accounts import create_admin
from appliance.auth.sessions import SessionPolicy, open_session
from appliance.auth.tokens import create_token
from appliance.db.database import Database
from appliance.db.journal import add_audit, list_audit
from appliance.db.models import AdminSession, AdminUser, ApiToken, Base
from appliance.db.schema import check_schema, migrate, schema_state
from appliance.errors import EX_CONFIG, MigrationFailed, SchemaMismatch
from appliance.resources import migrations_dir
from tests.conftest import PASSWORD, REPO, free_port, run_cli

HEAD = ScriptDirectory(str(migrations_dir())).get_current_head()  # this release's newest
NEXT = "9999_test"
NOW = dt.datetime(2026, 11, 30, 12, 0, tzinfo=dt.UTC)
TABLES = set(Base.metadata.tables)

# Bodies of `upgrade()` for the extra revision.
HARMLESS = """
op.create_table("extra_notes", sa.Column("id", sa.Integer, primary_key=True),
                sa.Column("note", sa.String(64), nullable=False))
"""
FAILING = """
op.create_table("half_applied", sa.Column("id", sa.Integer, primary_key=True))
op.execute("INSERT INTO half_applied (id) VALUES (1)")
op.execute("UPDATE admin_users SET username = 'mangled'")
raise RuntimeError("simulated failure inside 0002")
"""
DRIFT = """
op.drop_index("ix_events_severity", table_name="events")
"""
# Alembic's batch mode rebuilds a SQLite table by copy, DROP and RENAME.
REBUILD_PARENT = """
with op.batch_alter_table("admin_users", recreate="always") as batch:
    batch.add_column(sa.Column("display_name", sa.String(64), nullable=True))
"""
ORPHANING = """
op.execute("DELETE FROM admin_users")
"""


def migrations_with(tmp_path: Path, body: str, revision: str = NEXT) -> Path:
    """A copy of the real migrations folder with one more revision on top of the head."""
    target = Path(tempfile.mkdtemp(prefix="migrations-", dir=tmp_path))
    shutil.copytree(migrations_dir(), target, ignore=shutil.ignore_patterns("__pycache__"),
                    dirs_exist_ok=True)
    source = (
        '"""Test revision."""\n\n'
        "import sqlalchemy as sa\n"
        "from alembic import op\n\n"
        f"revision = {revision!r}\n"
        f"down_revision = {HEAD!r}\n"
        "branch_labels = None\n"
        "depends_on = None\n\n\n"
        "def upgrade() -> None:\n"
        f"{textwrap.indent(textwrap.dedent(body).strip(), '    ')}\n\n\n"
        "def downgrade() -> None:\n"
        "    pass\n"
    )
    (target / "versions" / f"{revision}.py").write_text(source)
    return target


def seed(db: Database, *, sessions: bool = False) -> None:
    """An admin and an audit entry (and optionally a session and an API token)."""
    def apply(s: Session) -> None:
        admin = create_admin(s, "alice", PASSWORD, NOW)
        add_audit(s, at=NOW, actor="cli:root", action="admin.create", target="alice")
        if sessions:
            policy = SessionPolicy(idle=dt.timedelta(hours=1), absolute=dt.timedelta(hours=12))
            open_session(s, admin, NOW, policy, address="127.0.0.1", user_agent="test")
            create_token(s, b"k" * 32, admin, "ci", NOW)

    db.call(apply)


def assert_seeded(db: Database) -> None:
    def read(s: Session) -> tuple[list[str], list[tuple[str, str]]]:
        users = list(s.scalars(select(AdminUser.username)))
        audit = [(e.action, e.target) for e in list_audit(s).items]
        return users, audit

    users, audit = db.call(read)
    assert users == ["alice"]
    assert ("admin.create", "alice") in audit


def table_names(db: Database) -> set[str]:
    with db.engine.connect() as conn:
        return set(inspect(conn).get_table_names())


def file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def database(backend_url: str) -> Iterator[Database]:
    db = Database(backend_url)
    yield db
    db.dispose()


# -- upgrade from empty ---------------------------------------------------------------------


def test_upgrade_from_empty_matches_models(database: Database, tmp_path: Path) -> None:
    result = migrate(database, migrations_dir(), tmp_path / "backups", NOW)

    assert (result.before, result.after, result.backup) == (None, HEAD, None)
    assert not (tmp_path / "backups").exists()  # nothing to protect in an empty database
    assert schema_state(database, migrations_dir()).at_head
    assert table_names(database) >= TABLES
    with database.engine.connect() as conn:
        context = MigrationContext.configure(
            conn, opts={"compare_type": True, "compare_server_default": True})
        assert compare_metadata(context, Base.metadata) == []


def test_alembic_alone_knows_every_table(tmp_path: Path) -> None:
    """env.py's metadata holds the tables of row modules outside `appliance.db.models` (the
    health tables) even when nothing else imported them: an upgrade in a fresh interpreter
    that imported only the models leaves nothing for autogenerate to add or drop."""
    script = textwrap.dedent(f"""
        import sqlalchemy
        from alembic import command
        from alembic.autogenerate import compare_metadata
        from alembic.config import Config
        from alembic.runtime.migration import MigrationContext

        from appliance.db.models import Base

        assert "health_samples" not in Base.metadata.tables
        engine = sqlalchemy.create_engine("sqlite:///{tmp_path / 'alone.db'}")
        cfg = Config()
        cfg.set_main_option("script_location", {str(migrations_dir())!r})
        with engine.begin() as conn:
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, "head")
        with engine.connect() as conn:
            diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
        assert "health_samples" in Base.metadata.tables, sorted(Base.metadata.tables)
        assert diff == [], diff
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=REPO, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_model_comparison_notices_drift(database: Database, tmp_path: Path) -> None:
    """The comparison above has teeth: a schema that lost an index is reported."""
    migrate(database, migrations_with(tmp_path, DRIFT), tmp_path / "backups", NOW)
    with database.engine.connect() as conn:
        diffs = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    assert [(d[0], d[1].name) for d in diffs] == [("add_index", "ix_events_severity")]


def test_failed_first_migration_leaves_database_empty(database: Database, tmp_path: Path) -> None:
    """From empty there is no backup, so the upgrade itself must be all or nothing: on SQLite
    too, where the driver would otherwise autocommit each CREATE TABLE."""
    with pytest.raises(MigrationFailed) as failure:
        migrate(database, migrations_with(tmp_path, FAILING), tmp_path / "backups", NOW)

    assert f"from empty to {NEXT} failed" in failure.value.message
    assert table_names(database) == set()
    assert schema_state(database, migrations_dir()).current is None
    # The real release can still initialise it.
    assert migrate(database, migrations_dir(), tmp_path / "backups", NOW).after == HEAD


# -- SQLite connection settings -------------------------------------------------------------


def test_sqlite_connections_get_durability_pragmas(tmp_path: Path) -> None:
    db = Database(f"sqlite:///{tmp_path / 'p.db'}")
    pragmas = ("journal_mode", "synchronous", "foreign_keys", "busy_timeout")

    def read_engine() -> tuple[object, ...]:
        with db.engine.connect() as conn:
            return tuple(conn.exec_driver_sql(f"PRAGMA {p}").scalar() for p in pragmas)

    def read_session() -> tuple[object, ...]:
        return db.call(lambda s: tuple(s.execute(text(f"PRAGMA {p}")).scalar() for p in pragmas))

    expected = ("wal", 2, 1, 10000)  # synchronous=FULL is 2
    assert read_engine() == expected
    assert read_session() == expected
    seen: list[tuple[object, ...]] = []
    worker = threading.Thread(target=lambda: seen.append(read_session()))  # as Database.run
    worker.start()
    worker.join()
    assert seen == [expected]
    db.dispose()


def test_foreign_keys_are_enforced(database: Database, tmp_path: Path) -> None:
    migrate(database, migrations_dir(), tmp_path / "backups", NOW)
    seed(database, sessions=True)

    orphan = AdminSession(id="x" * 64, user_id=999, created_at=NOW, last_seen_at=NOW,
                          expires_at=NOW, address="", user_agent="")
    with pytest.raises(IntegrityError):
        database.call(lambda s: s.add(orphan))

    def delete_alice(s: Session) -> None:
        s.delete(s.scalars(select(AdminUser)).one())

    database.call(delete_alice)
    counts = database.call(lambda s: (s.scalar(select(func.count()).select_from(AdminSession)),
                                      s.scalar(select(func.count()).select_from(ApiToken))))
    assert counts == (0, 0)  # ON DELETE CASCADE


# -- check_schema ---------------------------------------------------------------------------


def test_check_schema_refuses_empty_database(database: Database) -> None:
    with pytest.raises(SchemaMismatch) as refusal:
        check_schema(database, migrations_dir())
    assert refusal.value.code == "schema_empty"
    assert refusal.value.exit_code == EX_CONFIG
    assert "not been initialised" in refusal.value.message
    assert "run `appliance migrate`" in refusal.value.hint


def test_check_schema_refuses_older_database(database: Database, tmp_path: Path) -> None:
    migrate(database, migrations_dir(), tmp_path / "backups", NOW)
    newer_release = migrations_with(tmp_path, HARMLESS)

    with pytest.raises(SchemaMismatch) as refusal:
        check_schema(database, newer_release)
    assert refusal.value.code == "schema_older"
    assert HEAD in refusal.value.message and NEXT in refusal.value.message
    assert "run `appliance migrate`" in refusal.value.hint
    assert check_schema(database, migrations_dir()).current == HEAD


def test_check_schema_refuses_newer_database(database: Database, tmp_path: Path) -> None:
    migrate(database, migrations_with(tmp_path, HARMLESS), tmp_path / "backups", NOW)

    with pytest.raises(SchemaMismatch) as refusal:
        check_schema(database, migrations_dir())
    assert refusal.value.code == "schema_newer"
    assert NEXT in refusal.value.message and "newer" in refusal.value.message
    assert "newer release" in refusal.value.hint and "backup" in refusal.value.hint
    # `migrate` of the older release refuses the same way and changes nothing.
    with pytest.raises(SchemaMismatch):
        migrate(database, migrations_dir(), tmp_path / "backups", NOW)
    assert schema_state(database, migrations_dir()).current == NEXT
    assert "extra_notes" in table_names(database)


def write_config(tmp_path: Path) -> tuple[Path, Path]:
    """A TOML config whose paths are all under tmp_path; returns (config file, state dir)."""
    root = tmp_path / "appliance"
    state = root / "state"
    path = tmp_path / "appliance.toml"
    path.write_text(textwrap.dedent(f"""\
        [server]
        port = {free_port()}

        [paths]
        state_dir = "{state}"
        models_dir = "{root / 'models'}"
        log_dir = "{root / 'log'}"
    """))
    state.mkdir(parents=True)
    return path, state


def test_serve_refuses_newer_database_and_leaves_it_alone(tmp_path: Path) -> None:
    config, state = write_config(tmp_path)
    db_file = state / "appliance.db"
    db = Database(f"sqlite:///{db_file}")
    migrate(db, migrations_with(tmp_path, HARMLESS), state / "backups", NOW)
    seed(db)
    db.dispose()
    before = file_digest(db_file)

    proc = run_cli("--config", str(config), "serve", timeout=30)

    assert proc.returncode == EX_CONFIG, proc.stderr
    assert NEXT in proc.stderr
    assert "newer release" in proc.stderr and "backup" in proc.stderr
    assert file_digest(db_file) == before
    assert not (state / "backups").exists()


# -- failing migrations ---------------------------------------------------------------------


def test_cli_migrate_failure_restores_backup(tmp_path: Path) -> None:
    """Fault #17: an upgrade whose migration fails half way."""
    config, state = write_config(tmp_path)
    db = Database(f"sqlite:///{state / 'appliance.db'}")
    migrate(db, migrations_dir(), state / "backups", NOW)
    seed(db)
    db.dispose()
    broken = migrations_with(tmp_path, FAILING)

    proc = run_cli("--config", str(config), "migrate", "--migrations", str(broken))

    assert proc.returncode != 0
    backups = list((state / "backups").iterdir())
    assert len(backups) == 1 and backups[0].name.endswith(f"-{HEAD}.db")
    assert "failed" in proc.stderr and "simulated failure inside 0002" in proc.stderr
    assert f"the database was restored from {backups[0]}" in proc.stderr
    assert "keep running the previous release" in proc.stderr
    assert schema_state(db, migrations_dir()).current == HEAD
    assert "half_applied" not in table_names(db)
    assert_seeded(db)  # the username was not left "mangled"
    assert check_schema(db, migrations_dir()).at_head  # `appliance serve` would start
    db.dispose()


def test_failed_migration_keeps_schema_and_data(database: Database, tmp_path: Path) -> None:
    migrate(database, migrations_dir(), tmp_path / "backups", NOW)
    seed(database)

    with pytest.raises(MigrationFailed) as failure:
        migrate(database, migrations_with(tmp_path, FAILING), tmp_path / "backups", NOW)

    message = failure.value.message
    assert f"from {HEAD} to {NEXT} failed" in message
    assert "RuntimeError: simulated failure inside 0002" in message
    assert "keep running the previous release" in failure.value.hint
    assert schema_state(database, migrations_dir()).current == HEAD
    assert "half_applied" not in table_names(database)
    assert_seeded(database)
    if database.is_sqlite:
        assert len(list((tmp_path / "backups").iterdir())) == 1
        assert "restored from" in message
    else:  # transactional DDL: nothing to copy or restore
        assert not (tmp_path / "backups").exists()
        assert "restored" not in message


def test_table_rebuild_keeps_child_rows(tmp_path: Path) -> None:
    """Rebuilding a parent table (batch mode) must not cascade-delete its children: with
    foreign keys on during the migration, DROP TABLE admin_users would delete every session
    and API token."""
    db = Database(f"sqlite:///{tmp_path / 'r.db'}")
    migrate(db, migrations_dir(), tmp_path / "backups", NOW)
    seed(db, sessions=True)

    migrate(db, migrations_with(tmp_path, REBUILD_PARENT), tmp_path / "backups", NOW)

    with db.engine.connect() as conn:
        counts = [conn.scalar(select(func.count()).select_from(model))
                  for model in (AdminUser, AdminSession, ApiToken)]
        columns = {c["name"] for c in inspect(conn).get_columns("admin_users")}
        enforced = conn.exec_driver_sql("PRAGMA foreign_keys").scalar()
    assert counts == [1, 1, 1]
    assert "display_name" in columns
    assert enforced == 1  # later connections enforce foreign keys again
    db.dispose()


def test_migration_leaving_dangling_references_is_refused(tmp_path: Path) -> None:
    db = Database(f"sqlite:///{tmp_path / 'o.db'}")
    migrate(db, migrations_dir(), tmp_path / "backups", NOW)
    seed(db, sessions=True)

    with pytest.raises(MigrationFailed) as failure:
        migrate(db, migrations_with(tmp_path, ORPHANING), tmp_path / "backups", NOW)

    assert "breaks foreign keys" in failure.value.message
    assert "admin_sessions row" in failure.value.message
    assert schema_state(db, migrations_dir()).current == HEAD
    assert_seeded(db)
    db.dispose()


# -- backups --------------------------------------------------------------------------------


def test_cli_migrate_from_empty_then_up_to_date_takes_no_backup(tmp_path: Path) -> None:
    config, state = write_config(tmp_path)

    first = run_cli("--config", str(config), "migrate")
    assert first.returncode == 0, first.stderr
    assert f"migrated from empty to {HEAD}" in first.stdout
    second = run_cli("--config", str(config), "migrate")
    assert second.returncode == 0, second.stderr
    assert "nothing to do" in second.stdout
    assert not (state / "backups").exists()


def test_migrate_backs_up_the_previous_database(tmp_path: Path) -> None:
    db_file = tmp_path / "b.db"
    db = Database(f"sqlite:///{db_file}")
    migrate(db, migrations_dir(), tmp_path / "backups", NOW)
    seed(db)

    result = migrate(db, migrations_with(tmp_path, HARMLESS), tmp_path / "backups", NOW)
    db.call(lambda s: add_audit(s, at=NOW, actor="cli:root", action="db.migrate", target=NEXT))

    assert (result.before, result.after) == (HEAD, NEXT)
    assert list((tmp_path / "backups").iterdir()) == [result.backup]
    assert result.backup is not None
    copy = sqlite3.connect(result.backup)
    try:
        assert copy.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        assert copy.execute("SELECT version_num FROM alembic_version").fetchall() == [(HEAD,)]
        assert copy.execute("SELECT username FROM admin_users").fetchall() == [("alice",)]
        assert copy.execute("SELECT action FROM audit_log").fetchall() == [("admin.create",)]
        tables = {r[0] for r in copy.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        assert "extra_notes" not in tables
    finally:
        copy.close()
    assert "extra_notes" in table_names(db)
    db.dispose()


# -- data migrations ------------------------------------------------------------------------

OLD_KEY = "sk-engine-0123456789abcdefOLDROW"  # written in clear before the parser redacted


def test_engine_keys_in_rows_from_before_the_redaction_are_scrubbed(
        database: Database, tmp_path: Path) -> None:
    """An engine run and an event written at 0014 with the engine key in clear (the parsed
    `server_args`, the failure line and the hint quoting it) come out of the upgrade with the
    key redacted and every other figure, word for word, as it was."""
    from alembic import command
    from alembic.config import Config as AlembicConfig

    from appliance.engine.logsecrets import MARK

    cfg = AlembicConfig()
    cfg.set_main_option("script_location", str(migrations_dir()))
    with database.engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "0014_service_classes")
    line = f"ValueError: bad config {{'api_key': '{OLD_KEY}', 'port': 30000}}"
    figures = {"server_args": {"model_path": "/m", "api_key": OLD_KEY, "port": "30000",
                               "admin_api_key": "None"},
               "kv_token_capacity": 4096, "figures": {"max_total_num_tokens": 4096},
               "failure": {"reason": "config", "line": line, "hint": "fix it"}}
    hint = f"the engine refused its arguments The log says: {line}"
    with database.engine.begin() as conn:
        conn.execute(text(
            "INSERT INTO engine_runs (id, started_at, runner, spec_hash, spec_json, attempt, "
            "adopted, state, phases, hint, figures, log_path) VALUES (1, :at, 'process', 'h', "
            "'{}', 1, false, 'failed', '[]', :hint, :figures, '/l')"),
            {"at": NOW, "hint": hint, "figures": json.dumps(figures)})
        conn.execute(text(
            "INSERT INTO events (id, at, severity, source, message, detail) VALUES "
            "(1, :at, 'error', 'engine', :message, :detail), "
            "(2, :at, 'info', 'engine', 'engine ready after 1.0 min', '{\"tokens\": 6}')"),
            {"at": NOW, "message": f"engine exited (config, status 1): {hint}",
             "detail": json.dumps({"line": line, "api_key": OLD_KEY})})

    result = migrate(database, migrations_dir(), tmp_path / "backups", NOW)

    assert result.after == HEAD
    with database.engine.connect() as conn:
        run_hint, run_figures = conn.execute(
            text("SELECT hint, figures FROM engine_runs WHERE id = 1")).one()
        events = conn.execute(text("SELECT message, detail FROM events ORDER BY id")).all()
    stored = " ".join([run_hint, run_figures, *(part for row in events for part in row)])
    assert OLD_KEY not in stored
    clean_line = f"ValueError: bad config {{'api_key': '{MARK}', 'port': 30000}}"
    kept = json.loads(run_figures)
    assert kept == {**figures, "server_args": {**figures["server_args"], "api_key": MARK},
                    "failure": {**figures["failure"], "line": clean_line}}
    assert run_hint == f"the engine refused its arguments The log says: {clean_line}"
    assert events[0][0] == f"engine exited (config, status 1): {run_hint}"
    assert json.loads(events[0][1]) == {"line": clean_line, "api_key": MARK}
    assert tuple(events[1]) == ("engine ready after 1.0 min", '{"tokens": 6}')  # untouched
