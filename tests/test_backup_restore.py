"""Backup and restore (appliance.ops): an online backup under write load loses nothing
committed, a restore onto a clean state dir brings back keys (still authenticating), usage and
audit, and a damaged file, a wrong passphrase or a newer schema is refused with nothing
changed; the scheduled backup keeps `backup.keep`, and the health check says when it is
overdue (on the runtime's clock). Real SQLite, the CLI as a real subprocess."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import hashlib
import tarfile
import threading
from pathlib import Path

import pytest
from sqlalchemy import func, select, text

from appliance.config import Config, load_config
from appliance.db.database import Database
from appliance.db.journal import add_audit
from appliance.db.models import AuditEntry, UsageRequest
from appliance.db.schema import migrate
from appliance.errors import AlreadyRunning, ApplianceError
from appliance.gateway.keys import create_key, list_keys, load_entries, revoke_key
from appliance.health.model import Level
from appliance.lock import InstanceLock
from appliance.ops import backup as bk
from appliance.ops.crypto import PassphraseWrong
from appliance.ops.jobs import tick
from appliance.ops.restore import BackupRefused, restore
from appliance.ops.schedule import backup_check
from appliance.resources import migrations_dir
from appliance.runtime import build_runtime
from appliance.secrets import server_secret
from appliance.status import daemon_status
from appliance.testing.clock import FakeClock
from tests.conftest import free_port, run_cli

PASSPHRASE = "a long and sturdy passphrase"
NOW = dt.datetime(2026, 11, 30, 12, 0, tzinfo=dt.UTC)


def _head() -> str:
    from alembic.config import Config as AlembicConfig
    from alembic.script import ScriptDirectory

    cfg = AlembicConfig()
    cfg.set_main_option("script_location", str(migrations_dir()))
    head = ScriptDirectory.from_config(cfg).get_current_head()
    assert head is not None
    return head


HEAD = _head()


def write_box(root: Path, extra: str = "") -> Path:
    """A configuration file for a box under `root` (ports free, gateway on loopback)."""
    root.mkdir(parents=True, exist_ok=True)
    path = root / "appliance.toml"
    path.write_text(
        f"[server]\nport = {free_port()}\n\n[gateway]\nhost = \"127.0.0.1\"\n"
        f"port = {free_port()}\n\n"
        f'[paths]\nstate_dir = "{root / "state"}"\nmodels_dir = "{root / "models"}"\n'
        f'log_dir = "{root / "log"}"\n\n{extra}')
    return path


def new_box(root: Path, extra: str = "") -> Config:
    """A freshly installed box: configuration written, database migrated."""
    config = load_config(write_box(root, extra), env={})
    db = Database(config.database_url)
    migrate(db, migrations_dir(), config.paths.state_dir / "backups", NOW)
    db.dispose()
    return config


def passphrase_file(tmp_path: Path, value: str = PASSPHRASE) -> Path:
    path = tmp_path / f"passphrase-{hashlib.sha256(value.encode()).hexdigest()[:8]}"
    path.write_text(value + "\n")
    path.chmod(0o600)
    return path


def fill(config: Config) -> dict[str, object]:
    """Keys (one revoked), usage rows and audit entries; returns what a restore must bring
    back, and one key to authenticate with."""
    db = Database(config.database_url)
    secret = server_secret(config.paths.state_dir)
    try:
        def work(s: object) -> str:
            from sqlalchemy.orm import Session

            assert isinstance(s, Session)
            key, info = create_key(s, secret, name="alice", owner="a@x", by="test", now=NOW)
            create_key(s, secret, name="bob", owner="b@x", by="test", now=NOW)
            _, gone = create_key(s, secret, name="carol", owner="c@x", by="test", now=NOW)
            revoke_key(s, gone.prefix, by="test", now=NOW)
            for n in range(25):
                s.add(UsageRequest(key_id=info.id, model="kimi-k3", endpoint="chat",
                                   stream=False, status=200, outcome="ok", prompt_tokens=100 + n,
                                   completion_tokens=10 * n, cached_tokens=0, started_at=NOW,
                                   ended_at=NOW, queue_ms=0.0, duration_ms=5.0, history=""))
            for n in range(7):
                add_audit(s, at=NOW, actor="test", action="key.create", target=f"t{n}")
            return key

        key = db.call(work)
        return {"key": key, **facts(config)}
    finally:
        db.dispose()


def facts(config: Config) -> dict[str, object]:
    db = Database(config.database_url)
    try:
        return db.call(lambda s: {
            "keys": sorted((k.prefix, k.name, k.owner, k.status(NOW)) for k in list_keys(s)),
            "usage": tuple(s.execute(select(
                func.count(), func.sum(UsageRequest.prompt_tokens),
                func.sum(UsageRequest.completion_tokens))).one()),
            "audit": s.scalar(select(func.count()).select_from(AuditEntry)),
        })
    finally:
        db.dispose()


def authenticates(config: Config, key: str) -> bool:
    db = Database(config.database_url)
    try:
        entries = db.call(load_entries)
    finally:
        db.dispose()
    secret = server_secret(config.paths.state_dir)
    return any(e.accepts(secret, key, NOW) for e in entries)


def state_digest(config: Config) -> dict[str, str]:
    """Every file of the state dir by content: "nothing changed" is this, equal."""
    root = config.paths.state_dir
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != "appliance.lock"}


# --- online backup under load -----------------------------------------------------------------


def test_a_backup_under_write_load_holds_every_row_committed_before_it(tmp_path: Path) -> None:
    config = new_box(tmp_path / "a")
    db = Database(config.database_url)
    committed: list[int] = []
    stop = threading.Event()
    started = threading.Event()
    errors: list[BaseException] = []

    def writer() -> None:
        try:
            for n in range(5000):  # bounded: the backup ends the loop long before
                if stop.is_set():
                    return

                def one(s: object, n: int = n) -> int:
                    from sqlalchemy.orm import Session

                    assert isinstance(s, Session)
                    entry = AuditEntry(at=NOW, actor="writer", action="load.write",
                                       target=str(n), outcome="ok", detail="{}")
                    s.add(entry)
                    s.flush()
                    return entry.id

                committed.append(db.call(one))  # appended only once its commit returned
                if len(committed) >= 30:
                    started.set()
        except BaseException as exc:
            errors.append(exc)
            started.set()

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        assert started.wait(60), "the writer never got going"
        before = list(committed)
        result = bk.create_backup(config, tmp_path / "under-load.tar", passphrase=None,
                                  now=NOW)
        during = len(committed)
    finally:
        stop.set()
        thread.join(60)
    assert not errors, errors
    with tarfile.open(result.path) as tar:
        tar.extract(bk.SQLITE_MEMBER, tmp_path / "x", filter="data")
    copy = Database(f"sqlite:///{tmp_path / 'x' / bk.SQLITE_MEMBER}")
    try:
        ids = set(copy.call(lambda s: s.scalars(select(AuditEntry.id).where(
            AuditEntry.actor == "writer")).all()))
        check = copy.call(lambda s: s.execute(text("PRAGMA integrity_check")).scalar())
    finally:
        copy.dispose()
        db.dispose()
    assert len(before) >= 30 and set(before) <= ids
    assert ids <= set(committed)  # nothing half-written, nothing invented
    assert during >= len(before) and check == "ok"
    assert result.manifest["schema_revision"] == HEAD
    assert result.manifest["secrets"] == {"included": False}


# --- the round trip, through the CLI ----------------------------------------------------------


def test_restore_on_a_clean_box_brings_back_keys_usage_and_audit(tmp_path: Path) -> None:
    old = new_box(tmp_path / "old")
    want = fill(old)
    spec = old.paths.state_dir / "engine" / "launch-spec.json"
    spec.parent.mkdir()
    spec.write_text('{"argv": ["sglang", "serve"]}\n')
    secret_file = passphrase_file(tmp_path)
    out = tmp_path / "b" / "box.tar.gz"
    done = run_cli("--config", old.source, "backup", "--out", str(out),
                   "--passphrase-file", str(secret_file))
    assert done.returncode == 0, done.stderr
    assert f"backup written to {out}" in done.stdout and "secrets sealed" in done.stdout
    assert (out.stat().st_mode & 0o777) == 0o600
    with tarfile.open(out) as tar:
        names = tar.getnames()
    assert names[-1] == "MANIFEST.json"
    assert set(names) == {"database.sqlite", "secrets.enc", "config/appliance.toml",
                          "engine/launch-spec.json", "MANIFEST.json"}
    status = bk.read_status(old.paths.state_dir)
    assert status.last_success_file == str(out) and status.last_success_secrets

    fresh = new_box(tmp_path / "new")
    assert not authenticates(fresh, str(want["key"]))  # a new box: its own server.key
    done = run_cli("--config", fresh.source, "restore", str(out),
                   "--passphrase-file", str(secret_file))
    assert done.returncode == 0, done.stderr
    assert "secrets (server.key" in done.stdout and "keep working" in done.stdout
    assert "not restored:" in done.stdout and "weights" in done.stdout
    got = facts(fresh)
    assert got["keys"] == want["keys"] and got["usage"] == want["usage"]
    assert got["audit"] == int(str(want["audit"])) + 1  # and the restore's own entry
    assert authenticates(fresh, str(want["key"]))
    secrets = fresh.paths.state_dir / "secrets"
    assert (secrets.stat().st_mode & 0o777) == 0o700
    assert ((secrets / "server.key").stat().st_mode & 0o777) == 0o600
    assert (fresh.paths.state_dir / "engine" / "launch-spec.json").read_text() == spec.read_text()
    aside = fresh.paths.state_dir / "restored" / "appliance.toml"
    assert aside.read_text() == Path(old.source).read_text()


def test_without_the_secrets_the_restore_says_keys_will_not_work(tmp_path: Path) -> None:
    old = new_box(tmp_path / "old")
    want = fill(old)
    out = bk.create_backup(old, tmp_path / "plain.tar", passphrase=None, now=NOW).path
    fresh = new_box(tmp_path / "new")
    report = restore(fresh, out, passphrase=None, script_location=migrations_dir(), now=NOW,
                     actor="test")
    text_ = "\n".join(report.lines())
    assert "will NOT work" in text_ and "taken without them" in text_
    assert facts(fresh)["keys"] == want["keys"]
    assert not authenticates(fresh, str(want["key"]))


# --- refusals: nothing changes -----------------------------------------------------------------


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_damaged_member_is_refused_naming_the_file_and_nothing_changes(
        tmp_path: Path) -> None:
    old = new_box(tmp_path / "old")
    fill(old)
    out = bk.create_backup(old, tmp_path / "box.tar", passphrase=PASSPHRASE, now=NOW).path
    with tarfile.open(out) as tar:
        member = tar.getmember(bk.SQLITE_MEMBER)
        flip_byte(out, member.offset_data + member.size // 2)
    fresh = new_box(tmp_path / "new")
    before = state_digest(fresh)
    with pytest.raises(BackupRefused) as caught:
        restore(fresh, out, passphrase=PASSPHRASE, script_location=migrations_dir(), now=NOW,
                actor="test")
    message = caught.value.message
    assert str(out) in message and "database.sqlite does not match its checksum" in message
    assert "nothing was changed" in message
    assert state_digest(fresh) == before


def test_a_damaged_compressed_file_is_refused_by_the_cli(tmp_path: Path) -> None:
    old = new_box(tmp_path / "old")
    fill(old)
    out = bk.create_backup(old, tmp_path / "box.tar.gz", passphrase=None, now=NOW).path
    flip_byte(out, out.stat().st_size // 2)
    fresh = new_box(tmp_path / "new")
    before = state_digest(fresh)
    done = run_cli("--config", fresh.source, "restore", str(out), "--no-secrets")
    assert done.returncode == 65, done.stdout + done.stderr
    assert f"the backup {out} is damaged" in done.stderr
    assert "hint: use another copy of this backup" in done.stderr
    assert state_digest(fresh) == before


def test_a_wrong_passphrase_is_refused_and_nothing_changes(tmp_path: Path) -> None:
    old = new_box(tmp_path / "old")
    fill(old)
    out = bk.create_backup(old, tmp_path / "box.tar.gz", passphrase=PASSPHRASE, now=NOW).path
    fresh = new_box(tmp_path / "new")
    before = state_digest(fresh)
    with pytest.raises(PassphraseWrong, match=r"the passphrase does not open secrets\.enc"):
        restore(fresh, out, passphrase="not the passphrase at all", now=NOW, actor="test",
                script_location=migrations_dir())
    assert state_digest(fresh) == before
    done = run_cli("--config", fresh.source, "restore", str(out), "--passphrase-file",
                   str(passphrase_file(tmp_path, "another wrong passphrase")))
    assert done.returncode == 65 and "does not open secrets.enc" in done.stderr
    assert state_digest(fresh) == before


def test_a_backup_from_a_newer_schema_is_refused(tmp_path: Path) -> None:
    old = new_box(tmp_path / "old")
    db = Database(old.database_url)
    db.call(lambda s: s.execute(text("UPDATE alembic_version SET version_num='0099_future'")))
    db.dispose()
    out = bk.create_backup(old, tmp_path / "box.tar", passphrase=None, now=NOW).path
    fresh = new_box(tmp_path / "new")
    before = state_digest(fresh)
    with pytest.raises(BackupRefused, match="0099_future, newer than this release knows"):
        restore(fresh, out, passphrase=None, script_location=migrations_dir(), now=NOW,
                actor="test")
    assert state_digest(fresh) == before


def test_a_backup_from_an_older_schema_is_migrated(tmp_path: Path) -> None:
    from alembic import command
    from alembic.config import Config as AlembicConfig

    config = load_config(write_box(tmp_path / "old"), env={})
    cfg = AlembicConfig()
    cfg.set_main_option("script_location", str(migrations_dir()))
    db = Database(config.database_url)
    with db.engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "0007_health")
    db.dispose()
    out = bk.create_backup(config, tmp_path / "old.tar", passphrase=None, now=NOW)
    assert out.manifest["schema_revision"] == "0007_health"
    fresh = new_box(tmp_path / "new")
    report = restore(fresh, out.path, passphrase=None, script_location=migrations_dir(),
                     now=NOW, actor="test")
    assert "migrated from schema 0007_health to " + HEAD in report.restored[0]
    db = Database(fresh.database_url)
    try:
        assert db.call(lambda s: s.execute(text("SELECT version_num FROM alembic_version"))
                       .scalar()) == HEAD
    finally:
        db.dispose()


def test_a_running_daemon_is_refused(tmp_path: Path) -> None:
    old = new_box(tmp_path / "old")
    out = bk.create_backup(old, tmp_path / "box.tar", passphrase=None, now=NOW).path
    fresh = new_box(tmp_path / "new")
    held = InstanceLock(fresh.paths.state_dir)
    held.acquire()
    try:
        with pytest.raises(AlreadyRunning):
            restore(fresh, out, passphrase=None, script_location=migrations_dir(), now=NOW,
                    actor="test")
    finally:
        held.release()


def test_a_box_in_use_is_replaced_only_with_force(tmp_path: Path) -> None:
    old = new_box(tmp_path / "old")
    want = fill(old)
    out = bk.create_backup(old, tmp_path / "box.tar", passphrase=None, now=NOW).path
    busy = new_box(tmp_path / "busy")
    fill(busy)
    before = state_digest(busy)
    with pytest.raises(ApplianceError, match="already holds 3 API keys and 25 usage records"):
        restore(busy, out, passphrase=None, script_location=migrations_dir(), now=NOW,
                actor="test")
    assert state_digest(busy) == before
    restore(busy, out, passphrase=None, script_location=migrations_dir(), now=NOW,
            actor="test", force=True)
    assert facts(busy)["keys"] == want["keys"]


# --- the schedule, retention and the health check ---------------------------------------------


def test_the_scheduled_backup_runs_once_per_day_and_keeps_backup_keep(tmp_path: Path) -> None:
    config = new_box(tmp_path / "box", '[backup]\nschedule = "daily 03:00"\nkeep = 2\n')
    stranger = bk.backup_dir(config) / "appliance-20261101.db"  # a migration's copy
    stranger.parent.mkdir(parents=True, exist_ok=True)
    stranger.write_bytes(b"keep me")
    db = Database(config.database_url)
    clock = FakeClock(dt.datetime(2026, 11, 30, 12, 0, tzinfo=dt.UTC))
    try:
        assert tick(config, db, clock.now(), dt.UTC) is None  # arms; 03:00 today was before
        taken = []
        for _day in range(4):
            clock.advance(15 * 3600 + 5 * 60)  # 03:05 the next day
            result = tick(config, db, clock.now(), dt.UTC)
            assert result is not None
            taken.append(result.path.name)
            assert tick(config, db, clock.now(), dt.UTC) is None  # once per occurrence
            clock.advance(9 * 3600 - 5 * 60)  # back to 12:00
    finally:
        db.dispose()
    left = sorted(p.name for p in bk.backup_dir(config).iterdir())
    assert left == sorted([stranger.name, *taken[-2:]])
    status = bk.read_status(config.paths.state_dir)
    assert status.last_success_file.endswith(taken[-1]) and not status.last_success_secrets


def test_the_health_check_says_overdue_on_the_runtimes_clock() -> None:
    armed = bk.BackupStatus(armed_at=NOW - dt.timedelta(days=10), armed_schedule="daily 03:00",
                            last_success_at=dt.datetime(2026, 11, 29, 3, 1, tzinfo=dt.UTC))
    fine = backup_check("daily 03:00", armed, dt.datetime(2026, 11, 30, 4, 0, tzinfo=dt.UTC),
                        dt.UTC)
    assert fine.level is Level.OK  # today's is due, but within the grace
    late = backup_check("daily 03:00", armed, dt.datetime(2026, 11, 30, 5, 30, tzinfo=dt.UTC),
                        dt.UTC)
    assert late.level is Level.WARN and late.id == "host.backup"
    assert "the backup due at 2026-11-30 03:00" in late.summary and "appliance backup" in late.hint
    failed = dataclasses.replace(armed, last_failure_at=dt.datetime(
        2026, 11, 30, 3, 0, tzinfo=dt.UTC), last_failure="no space left on device")
    assert "no space left on device" in backup_check(
        "daily 03:00", failed, dt.datetime(2026, 11, 30, 5, 30, tzinfo=dt.UTC), dt.UTC).summary
    new = bk.BackupStatus(armed_at=dt.datetime(2026, 11, 30, 4, 0, tzinfo=dt.UTC))
    assert backup_check("daily 03:00", new, dt.datetime(2026, 11, 30, 23, 0, tzinfo=dt.UTC),
                        dt.UTC).level is Level.OK  # a box armed after 03:00 is not late yet
    assert backup_check("off", bk.BackupStatus(), NOW).level is Level.OK


def test_the_monitor_and_the_dashboard_read_the_backup_status(config: Config, db: Database,
                                                              clock: FakeClock) -> None:
    runtime = build_runtime(config, clock=clock, db=db)
    bk.write_status(config.paths.state_dir, bk.BackupStatus(
        armed_at=clock.now() - dt.timedelta(days=10), armed_schedule="daily 03:00",
        last_success_at=clock.now() - dt.timedelta(days=5), last_success_secrets=True))
    snapshot = asyncio.run(runtime.health.check_host())
    result = snapshot.result("host.backup")
    assert result is not None and result.level is Level.WARN
    assert "the last success was 5 days ago" in result.summary
    status = asyncio.run(daemon_status(runtime))
    assert status.last_backup.startswith(
        f"{clock.now() - dt.timedelta(days=5):%Y-%m-%d %H:%M} UTC (5 days ago, with secrets")


def test_a_short_or_exposed_passphrase_is_refused(tmp_path: Path) -> None:
    from appliance.ops.crypto import read_passphrase_file

    with pytest.raises(ApplianceError, match="12 to"):
        read_passphrase_file(passphrase_file(tmp_path, "short"))
    exposed = passphrase_file(tmp_path)
    exposed.chmod(0o644)
    with pytest.raises(ApplianceError, match="readable or writable by others"):
        read_passphrase_file(exposed)


# --- PostgreSQL: pg_dump and pg_restore ---------------------------------------------------------


@pytest.mark.postgres
def test_a_postgresql_box_round_trips_through_pg_dump(tmp_path: Path) -> None:
    from tests.conftest import postgres_database

    with postgres_database() as old_url, postgres_database() as new_url:
        old = new_box(tmp_path / "old", f'[database]\nurl = "{old_url}"\n')
        want = fill(old)
        out = bk.create_backup(old, tmp_path / "pg.tar.gz", passphrase=PASSPHRASE, now=NOW)
        assert out.manifest["database"] == "postgresql"
        assert out.manifest["schema_revision"] == HEAD
        fresh = new_box(tmp_path / "new", f'[database]\nurl = "{new_url}"\n')
        report = restore(fresh, out.path, passphrase=PASSPHRASE,
                         script_location=migrations_dir(), now=NOW, actor="test")
        assert report.restored[0].startswith(f"database (postgresql, schema {HEAD})")
        got = facts(fresh)
        assert got["keys"] == want["keys"] and got["usage"] == want["usage"]
        assert got["audit"] == int(str(want["audit"])) + 1
        assert authenticates(fresh, str(want["key"]))
