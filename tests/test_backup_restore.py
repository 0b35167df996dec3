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
import io
import json
import tarfile
import threading
import tomllib
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select, text

from appliance.config import Config, load_config
from appliance.db.database import Database
from appliance.db.journal import add_audit, add_event
from appliance.db.models import AuditEntry, UsageRequest
from appliance.db.schema import migrate
from appliance.engine.records import open_run, update_run
from appliance.errors import AlreadyRunning, ApplianceError
from appliance.gateway.keys import create_key, list_keys, load_entries, revoke_key
from appliance.health.model import Level
from appliance.lock import InstanceLock
from appliance.ops import backup as bk
from appliance.ops.crypto import PassphraseWrong
from appliance.ops.jobs import tick
from appliance.ops.restore import BackupRefused, restore
from appliance.ops.schedule import backup_check
from appliance.ops.unpack import read_manifest
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
    assert names[:2] == ["MANIFEST.json", "MANIFEST.mac"]  # read and checked before the rest
    assert set(names) == {"database.sqlite", "secrets.enc", "config/appliance.toml",
                          "engine/launch-spec.json", "MANIFEST.json", "MANIFEST.mac"}
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
                     actor="test", unverified=True)
    text_ = "\n".join(report.lines())
    assert "will NOT work" in text_ and "taken without them" in text_
    assert "restored --unverified" in text_
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
    done = run_cli("--config", fresh.source, "restore", str(out), "--no-secrets",
                   "--unverified")
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
    with pytest.raises(PassphraseWrong, match=r"the passphrase does not open the backup box"):
        restore(fresh, out, passphrase="not the passphrase at all", now=NOW, actor="test",
                script_location=migrations_dir())
    assert state_digest(fresh) == before
    done = run_cli("--config", fresh.source, "restore", str(out), "--passphrase-file",
                   str(passphrase_file(tmp_path, "another wrong passphrase")))
    assert done.returncode == 65 and "does not open the backup box.tar.gz" in done.stderr
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
                actor="test", unverified=True)
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
                     now=NOW, actor="test", unverified=True)
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
                actor="test", unverified=True)
    assert state_digest(busy) == before
    restore(busy, out, passphrase=None, script_location=migrations_dir(), now=NOW,
            actor="test", force=True, unverified=True)
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


# --- secrets stay sealed, and a changed file is refused (issue 22) ----------------------------

HUB = "hf_BackupPlantedHubToken0123456789"
HOOK = "https://hooks.example.com/services/T0/B0/BackupWebhookSecret77"
SECRET_CONFIG = (f'[weights]\ntoken = "{HUB}"\n\n[health]\nwebhook_url = "{HOOK}"\n')


def members_of(path: Path) -> list[tuple[str, bytes]]:
    with tarfile.open(path) as tar:
        return [(m.name, tar.extractfile(m).read())  # type: ignore[union-attr]
                for m in tar.getmembers()]


def write_members(path: Path, members: list[tuple[str, bytes]]) -> Path:
    with tarfile.open(path, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def with_manifest(members: list[tuple[str, bytes]], change: Any) -> list[tuple[str, bytes]]:
    out = []
    for name, data in members:
        if name == bk.MANIFEST:
            manifest = json.loads(data)
            change(manifest)
            data = json.dumps(manifest, indent=2, sort_keys=True).encode() + b"\n"
        out.append((name, data))
    return out


def test_a_backup_holds_no_secret_in_clear_and_restore_puts_them_back(tmp_path: Path) -> None:
    """The Hub token and the webhook URL in the configuration file, and in an event row and
    an engine run's reason (what a failed delivery or a crash wrote), appear nowhere in the
    backup but inside secrets.enc; the plain configuration copy still parses; a restore with
    the passphrase puts the file back as it was, and one without says what to set again."""
    old = new_box(tmp_path / "old", SECRET_CONFIG)
    server_secret(old.paths.state_dir)
    db = Database(old.database_url)
    db.call(lambda s: add_event(s, at=NOW, severity="warning", source="health",
                                message=f"the webhook {HOOK} answered 500",
                                detail={"url": HOOK}))
    run = db.call(lambda s: open_run(s, at=NOW, runner="process", spec_hash="ab",
                                     spec_json="{}", attempt=1, state="FAILED", log_path=""))
    db.call(lambda s: update_run(s, run.id, reason=f"token {HUB} refused"))
    db.dispose()
    secrets = {"Hub token": HUB, "webhook": HOOK, "webhook secret": "BackupWebhookSecret77",
               "server.key": (old.paths.state_dir / "secrets" / "server.key").read_text()
               .strip()}
    for passphrase in (PASSPHRASE, None):
        out = bk.create_backup(old, tmp_path / f"b-{passphrase is None}.tar.gz",
                               passphrase=passphrase, now=NOW)
        members = dict(members_of(out.path))
        for name, data in members.items():
            if name == bk.SECRETS_MEMBER:
                continue
            for what, value in secrets.items():
                assert value.encode() not in data, f"{what} in clear in {name}"
        plain = tomllib.loads(members[bk.CONFIG_MEMBER].decode())
        assert plain["weights"]["token"] == "[sealed: Hub token]"
        assert plain["health"]["webhook_url"] == "[sealed: webhook URL]"
        assert set(out.manifest["config"]["secret_settings"]) == {"weights.token",
                                                                  "health.webhook_url"}
        assert out.manifest["scrubbed_rows"] == {"events": 1, "engine_runs": 1}

    fresh = new_box(tmp_path / "new")
    report = restore(fresh, tmp_path / "b-False.tar.gz", passphrase=PASSPHRASE, now=NOW,
                     script_location=migrations_dir(), actor="test")
    aside = fresh.paths.state_dir / "restored" / "appliance.toml"
    assert aside.read_text() == Path(old.source).read_text()  # the secret values are back
    assert (aside.stat().st_mode & 0o777) == 0o600
    assert "checked against the backup's sealed manifest" in "\n".join(report.lines())

    plain_box = new_box(tmp_path / "plain")
    report = restore(plain_box, tmp_path / "b-True.tar.gz", passphrase=None, now=NOW,
                     script_location=migrations_dir(), actor="test", unverified=True)
    text_ = "\n".join(report.lines())
    assert "weights.token, health.webhook_url" in text_ and "set them again" in text_
    assert HUB not in (plain_box.paths.state_dir / "restored" / "appliance.toml").read_text()


def test_a_database_swapped_in_with_its_digests_rewritten_is_refused(tmp_path: Path) -> None:
    """Someone who can write to the backup store puts another database in (one with their
    own admin) and rewrites the manifest's digests to match: refused with the right
    passphrase, naming the cause, and nothing changes. So is the same file with its seal
    stripped."""
    old = new_box(tmp_path / "old")
    fill(old)
    good = bk.create_backup(old, tmp_path / "good.tar", passphrase=PASSPHRASE, now=NOW).path
    planted = new_box(tmp_path / "attacker")
    fill(planted)
    theirs = dict(members_of(bk.create_backup(planted, tmp_path / "their.tar", passphrase=None,
                                              now=NOW).path))[bk.SQLITE_MEMBER]

    def swap(manifest: dict[str, Any]) -> None:
        manifest["files"][bk.SQLITE_MEMBER] = {"sha256": hashlib.sha256(theirs).hexdigest(),
                                               "bytes": len(theirs)}

    swapped = [(n, theirs if n == bk.SQLITE_MEMBER else d)
               for n, d in with_manifest(members_of(good), swap)]
    tampered = write_members(tmp_path / "tampered.tar", swapped)
    stripped = write_members(tmp_path / "stripped.tar", with_manifest(
        [(n, d) for n, d in swapped if n != bk.MAC_MEMBER],
        lambda m: m.update(seal=None)))
    fresh = new_box(tmp_path / "new")
    before = state_digest(fresh)

    with pytest.raises(BackupRefused) as caught:
        restore(fresh, tampered, passphrase=PASSPHRASE, script_location=migrations_dir(),
                now=NOW, actor="test")
    assert caught.value.code == "backup_tampered"
    assert "does not match its seal; nothing was changed" in caught.value.message
    with pytest.raises(BackupRefused, match="its manifest's seal is gone") as caught:
        restore(fresh, stripped, passphrase=PASSPHRASE, script_location=migrations_dir(),
                now=NOW, actor="test", unverified=True)
    assert state_digest(fresh) == before
    done = run_cli("--config", fresh.source, "restore", str(tampered), "--passphrase-file",
                   str(passphrase_file(tmp_path)))
    assert done.returncode == 65 and "was changed after it was written" in done.stderr
    assert state_digest(fresh) == before


class Zeros(io.RawIOBase):
    """`size` zero bytes, read in chunks (a 300 MB member without 300 MB in memory)."""

    def __init__(self, size: int) -> None:
        self.left = size

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        n = min(len(buffer), self.left)
        buffer[:n] = bytes(n)
        self.left -= n
        return n


BOMB = 300 * 2**20


def write_bomb(path: Path, *, claimed: int, manifest_first: bool) -> Path:
    digest = hashlib.sha256()
    zeros = Zeros(BOMB)
    while chunk := zeros.read(1 << 20):
        digest.update(chunk)
    manifest = json.dumps({"format": 2 if manifest_first else 1, "schema_revision": HEAD,
                           "database": "sqlite", "secrets": {"included": False},
                           "files": {bk.SQLITE_MEMBER: {"sha256": digest.hexdigest(),
                                                        "bytes": claimed}}}).encode()
    with tarfile.open(path, "w:gz") as tar:
        def add_manifest() -> None:
            info = tarfile.TarInfo(bk.MANIFEST)
            info.size = len(manifest)
            tar.addfile(info, io.BytesIO(manifest))

        if manifest_first:
            add_manifest()
        info = tarfile.TarInfo(bk.SQLITE_MEMBER)
        info.size = BOMB
        tar.addfile(info, io.BufferedReader(Zeros(BOMB)))
        if not manifest_first:
            add_manifest()
    return path


def test_an_archive_that_inflates_writes_nothing_before_it_is_refused(tmp_path: Path) -> None:
    """A ~300 kB file that expands to 300 MB: without a seal it is refused before a byte is
    extracted; accepted unverified, a member larger than its manifest says is refused from
    the headers alone (manifest first, or a format-1 file's manifest last)."""
    honest = write_bomb(tmp_path / "honest.tar.gz", claimed=BOMB, manifest_first=True)
    small_first = write_bomb(tmp_path / "first.tar.gz", claimed=1000, manifest_first=True)
    small_last = write_bomb(tmp_path / "last.tar.gz", claimed=1000, manifest_first=False)
    assert honest.stat().st_size < 2 * 2**20
    fresh = new_box(tmp_path / "new")
    before = state_digest(fresh)
    def listing() -> list[str]:
        return sorted(p.name for p in fresh.paths.state_dir.rglob("*")
                      if p.name != "appliance.lock")  # the restore's own lock file

    files = listing()

    with pytest.raises(BackupRefused, match="carries no seal"):
        restore(fresh, honest, passphrase=None, script_location=migrations_dir(), now=NOW,
                actor="test")
    with pytest.raises(BackupRefused, match=r"is 314,572,800 bytes in the file, 1,000 in its"):
        read_manifest(small_last, None, unverified=True)  # no folder: it cannot write
    for bomb in (small_first, small_last):
        with pytest.raises(BackupRefused, match=r"314,572,800 bytes in the file, 1,000 in"):
            restore(fresh, bomb, passphrase=None, script_location=migrations_dir(), now=NOW,
                    actor="test", unverified=True)
    assert state_digest(fresh) == before
    assert listing() == files


def test_a_backup_from_an_older_release_needs_unverified(tmp_path: Path) -> None:
    """A format-1 file (manifest last, no seal): refused with the way forward, restored with
    --unverified."""
    old = new_box(tmp_path / "old")
    want = fill(old)
    new = members_of(bk.create_backup(old, tmp_path / "v2.tar", passphrase=None, now=NOW).path)
    legacy = with_manifest(new, lambda m: (m.update(format=1), m.pop("seal")))
    manifest = [item for item in legacy if item[0] == bk.MANIFEST]
    legacy = [item for item in legacy if item[0] != bk.MANIFEST] + manifest  # last, as then
    path = write_members(tmp_path / "v1.tar", legacy)
    fresh = new_box(tmp_path / "new")

    done = run_cli("--config", fresh.source, "restore", str(path), "--no-secrets")
    assert done.returncode == 65
    assert "written by an older release" in done.stderr and "--unverified" in done.stderr
    done = run_cli("--config", fresh.source, "restore", str(path), "--no-secrets",
                   "--unverified")
    assert done.returncode == 0, done.stderr
    assert "restored --unverified" in done.stdout
    assert facts(fresh)["keys"] == want["keys"]
