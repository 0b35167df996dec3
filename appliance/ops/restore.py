"""`appliance restore FILE`: put a backup (appliance.ops.backup) back onto a box.

Meant for a freshly installed box (or this one after a loss), with the daemon and the gateway
stopped. In order, and nothing on the box changes before step 4:

1. take the daemon's lock (a running daemon is refused) and refuse while the gateway's port
   answers (it would keep writing to the database being replaced);
2. read MANIFEST.json first (the first member; a format-1 file's is the last, so its member
   headers are read first, writing nothing) and check its seal, an HMAC keyed from the
   passphrase: a wrong passphrase, a manifest changed after it was written (a database swapped
   in, its digests rewritten) or one whose seal was stripped is refused; a backup with no
   seal (taken without a passphrase, or by an older release), or restored without its
   passphrase, only with `unverified` (`--unverified`). Refuse a newer format or schema
   revision than this release knows, and a backup of the other database kind;
3. extract into a scratch directory, each member bounded by the size the checked manifest
   gives and checked against its sha256 (a damaged, truncated or inflated member is refused,
   naming it), the total checked against the free space first; open the secrets with the
   passphrase;
4. write the database (SQLite's backup API into the configured file; `pg_restore` into the
   configured PostgreSQL), then migrate it when it is older than this release; write the
   secrets (0600 in a 0700 directory) and the launch spec; put the old box's configuration
   (with its secret values when the secrets were opened) and weights manifest under
   state_dir/restored/ for the operator to compare and use;
5. record the restore in the audit log and say what was restored and what was not.

Users' API keys and admin tokens keep working only with the secrets: their stored HMACs are
keyed with server.key. Without the secrets the report says so, plainly.
"""

from __future__ import annotations

import base64
import contextlib
import datetime as dt
import json
import shutil
import socket
import sqlite3
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from appliance.atomic import write_atomic
from appliance.config import Config
from appliance.errors import EX_DATAERR, ApplianceError
from appliance.ops import backup as bk
from appliance.ops.unpack import (
    BackupRefused,
    OpenedBackup,
    damaged,
    extract,
    read_manifest,
    safe_name,
)

__all__ = ["BackupRefused", "RestoreReport", "restore"]


@dataclass
class RestoreReport:
    restored: list[str] = field(default_factory=list)
    not_restored: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        out = ["restored:"] + [f"  - {item}" for item in self.restored]
        out += ["not restored:"] + [f"  - {item}" for item in self.not_restored]
        out += [f"warning: {item}" for item in self.warnings]
        return out


def check_schema(opened: OpenedBackup, script_location: Path) -> str:
    """The backup's revision, refused when this release does not know it (newer) or the
    backup has none."""
    from alembic.config import Config as AlembicConfig
    from alembic.script import ScriptDirectory

    revision = opened.manifest.get("schema_revision")
    if not isinstance(revision, str) or not revision:
        raise BackupRefused("backup_no_schema",
                            f"the backup {opened.path} holds a database that was never migrated",
                            "use a backup of a box that ran")
    cfg = AlembicConfig()
    cfg.set_main_option("script_location", str(script_location))
    script = ScriptDirectory.from_config(cfg)
    try:
        known = script.get_revision(revision) is not None
    except Exception:  # alembic raises several types for an unknown id
        known = False
    if not known:
        raise BackupRefused(
            "backup_schema_newer",
            f"the backup {opened.path} is at schema revision {revision}, newer than this "
            f"release knows (its newest is {script.get_current_head()}); nothing was changed",
            f"install appliance {opened.manifest.get('appliance_version', '?')} or newer, "
            "then restore")
    return revision


def answers(host: str, port: int) -> bool:
    """Whether something on this box accepts a connection at the address a service of the
    box listens on (an unspecified address is reached on loopback)."""
    host = "127.0.0.1" if host in ("0.0.0.0", "", "::") else host  # noqa: S104
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


def gateway_listening(config: Config) -> bool:
    return answers(config.gateway.host, config.gateway.port)


@dataclass(frozen=True)
class Secrets:
    """What secrets.enc held: the files of state_dir/secrets, and the configuration file as
    it was (None in a backup that did not seal it)."""

    files: dict[str, bytes]
    config: bytes | None


def open_secrets(opened: OpenedBackup, passphrase: str | None) -> Secrets | None:
    """The sealed secrets, or None when the backup has none or `passphrase` is None."""
    from appliance.ops.crypto import unseal

    path = opened.member(bk.SECRETS_MEMBER)
    if path is None or passphrase is None:
        return None
    payload = json.loads(unseal(path.read_bytes(), passphrase))
    files: dict[str, bytes] = {}
    for name, encoded in payload["files"].items():
        if not safe_name(name):
            raise damaged(opened.path, f"its secrets name {name!r}")
        files[name] = base64.b64decode(encoded)
    config = payload.get("config")
    return Secrets(files, base64.b64decode(config) if isinstance(config, str) else None)


def in_use(config: Config) -> str | None:
    """What the configured database already holds that a restore would discard (users' keys,
    usage), or None for a new box's database (or none at all)."""
    from sqlalchemy import func, select

    from appliance.db.database import Database
    from appliance.db.models import GatewayKey, UsageRequest

    if config.database_url.startswith("sqlite") and not bk._sqlite_path(
            config.database_url).exists():
        return None
    db = Database(config.database_url)
    try:
        keys, usage = db.call(lambda s: (
            s.scalar(select(func.count()).select_from(GatewayKey)) or 0,
            s.scalar(select(func.count()).select_from(UsageRequest)) or 0))
    except Exception:  # not migrated yet: nothing of worth in it
        return None
    finally:
        db.dispose()
    return f"{keys} API keys and {usage} usage records" if keys or usage else None


def restore(config: Config, path: Path, *, passphrase: str | None, script_location: Path,
            now: dt.datetime, actor: str, check_gateway: bool = True,
            force: bool = False, unverified: bool = False) -> RestoreReport:
    """See the module docstring. `passphrase` None: the secrets are not restored (the caller
    decided: --no-secrets, or the backup has none). A database that is in use (keys, usage)
    is replaced only with `force`; a backup whose manifest cannot be checked against its
    seal (none, or no passphrase given) is restored only with `unverified`."""
    from appliance.lock import InstanceLock

    state_dir = config.paths.state_dir
    lock = InstanceLock(state_dir)
    lock.acquire()  # refuses a running daemon, and keeps one from starting meanwhile
    try:
        if check_gateway and gateway_listening(config):
            raise ApplianceError(
                "gateway_running",
                f"something answers on the gateway's port {config.gateway.port}; the gateway "
                "writes to the database a restore replaces",
                "stop it first (`systemctl stop appliance-gateway`), then restore", exit_code=75)
        # Everything that needs only the manifest is checked before a byte is extracted.
        verified = read_manifest(path, passphrase, unverified=unverified)
        stand_in = OpenedBackup(path, state_dir, verified.manifest, verified.sealed)
        revision = check_schema(stand_in, script_location)
        kind = verified.manifest.get("database")
        here = "sqlite" if config.database_url.startswith("sqlite") else "postgresql"
        if kind != here:
            raise BackupRefused(
                "backup_database_kind",
                f"the backup {path} holds a {kind} database; this box uses {here}",
                "set database.url like the old box's (see the backup's "
                "config/appliance.toml), or restore on a box configured alike")
        held = None if force else in_use(config)
        if held is not None:
            raise ApplianceError(
                "restore_over_data",
                f"this box's database already holds {held}; a restore replaces them",
                "take a backup of this box first (`appliance backup`), then restore with "
                "--force", exit_code=EX_DATAERR)
        with tempfile.TemporaryDirectory(prefix=".restore-", dir=state_dir) as work:
            opened = extract(verified, Path(work))
            secrets = open_secrets(opened, passphrase)
            return _apply(config, opened, revision, secrets, script_location, now, actor)
    finally:
        lock.release()


def _apply(config: Config, opened: OpenedBackup, revision: str,
           secrets: Secrets | None, script_location: Path, now: dt.datetime,
           actor: str) -> RestoreReport:
    from appliance.auth.bootstrap import retire_bootstrap_file
    from appliance.db.database import Database
    from appliance.db.journal import add_audit, add_event
    from appliance.db.schema import migrate
    from appliance.secrets import write_private

    state_dir = config.paths.state_dir
    report = RestoreReport()
    manifest = opened.manifest
    url = config.database_url
    if url.startswith("sqlite"):
        source = opened.member(bk.SQLITE_MEMBER)
        assert source is not None, "checked: the manifest of a SQLite backup lists it"
        target = bk._sqlite_path(url)
        _restore_sqlite(source, target)
        bk.own_like(target, state_dir)
    else:
        source = opened.member(bk.PG_MEMBER)
        assert source is not None
        _pg_restore(url, source)
    db = Database(url)
    try:
        result = migrate(db, script_location, state_dir / "backups", now)
        migrated = (f", migrated from schema {result.before} to {result.after}"
                    if result.before != result.after else "")
        report.restored.append(
            f"database ({manifest['database']}, schema {revision}{migrated}): admin accounts, "
            "users' API keys, usage history, the audit log and events, tuning profiles and the "
            "applied split, qualifications, the weights manifest and the engine's desired state")
        if secrets is not None:
            for name, data in sorted(secrets.files.items()):
                target = state_dir / "secrets" / name
                write_private(target, data)
                bk.own_like(target, state_dir)
            bk.own_like(state_dir / "secrets", state_dir)
            report.restored.append(
                f"secrets ({', '.join(sorted(secrets.files))}): users' API keys and admin API "
                "tokens keep working")
        else:
            why = ("the backup was taken without them" if not manifest["secrets"]["included"]
                   else "--no-secrets was given")
            report.not_restored.append(
                f"secrets ({why}): server.key, the key the stored API keys and admin tokens are "
                "checked with, is this box's own, so EVERY user's API key and every admin API "
                "token of the old box will NOT work; issue new ones (`appliance keys create`, "
                "`appliance token create`). Admin passwords still work")
        spec = opened.member(bk.SPEC_MEMBER)
        if spec is not None:
            target = state_dir / "engine" / "launch-spec.json"
            write_atomic(target, spec.read_bytes(), mode=0o640, dir_mode=0o750)
            bk.own_like(target, state_dir)
            report.restored.append(f"the engine's last launch spec ({target})")
        aside = _put_aside(opened, state_dir / "restored",
                           secrets.config if secrets is not None else None)
        weights = manifest.get("weights")
        if weights:
            report.not_restored.append(
                f"{bk.NOT_IN_BACKUPS}: {weights['repo']} at commit {weights['commit']}, "
                f"{weights['files']} files, {weights['bytes']:,} bytes; its manifest is in "
                f"{aside.get(bk.WEIGHTS_MEMBER, 'the database')} "
                f"(`appliance weights import DIR --manifest` takes it)")
        else:
            report.not_restored.append("weights: the old box had no weights manifest recorded")
        if bk.CONFIG_MEMBER in aside:
            report.not_restored.append(
                f"configuration: the old box's file is in {aside[bk.CONFIG_MEMBER]}; this "
                f"box's ({config.source}) was left as it is. Compare them (`diff`) and carry "
                "over what applies here (paths, database URL, ports, TLS)")
            report.warnings.extend(_config_secrets_note(manifest, secrets))
        if opened.sealed:
            report.restored.append("every file was checked against the backup's sealed "
                                   "manifest")
        else:
            report.warnings.append("restored --unverified: nothing proved this backup is the "
                                   "one the box wrote")
        if retire_bootstrap_file(state_dir):
            report.restored.append("admin accounts replace this box's one-time bootstrap login "
                                   "(its file was deleted)")

        def record(session: Any) -> None:
            detail = {"file": str(opened.path), "created_at": manifest.get("created_at"),
                      "host": manifest.get("host"), "schema": revision,
                      "secrets": secrets is not None, "verified": opened.sealed}
            add_audit(session, at=now, actor=actor, action="backup.restore",
                      target=opened.path.name, detail=detail)
            add_event(session, at=now, severity="info", source="backup",
                      message=f"restored the backup {opened.path.name} taken "
                              f"{manifest.get('created_at')} on {manifest.get('host')}",
                      detail=detail)

        db.call(record)
    finally:
        db.dispose()
    return report


def _restore_sqlite(source: Path, target: Path) -> None:
    """SQLite's backup API, from the extracted copy into the configured file: it writes
    through the target's own connection, so a -wal file left beside it is handled, never
    replayed over the restored pages."""
    target.parent.mkdir(parents=True, exist_ok=True)
    src = sqlite3.connect(source)
    dst = sqlite3.connect(target, timeout=30)
    try:
        src.backup(dst)
        dst.execute("PRAGMA journal_mode=WAL")  # the daemon's mode (appliance.db.database)
    finally:
        src.close()
        dst.close()


def _pg_restore(url: str, dump: Path) -> None:
    import os

    uri, secret_env = bk.libpq_target(url)
    try:
        done = subprocess.run(
            ["pg_restore", "--clean", "--if-exists", "--no-owner", "--no-privileges",
             "--single-transaction", "--exit-on-error", f"--dbname={uri}", str(dump)],
            env={**os.environ, **secret_env}, capture_output=True, text=True, check=False,
            timeout=6 * 3600)
    except FileNotFoundError:
        raise ApplianceError("restore_no_pg_restore", "pg_restore is not installed",
                             "install the PostgreSQL client (`apt-get install "
                             "postgresql-client`)") from None
    if done.returncode != 0:
        raise ApplianceError("restore_pg_failed",
                             f"pg_restore failed (exit {done.returncode}), and rolled back: "
                             f"{done.stderr.strip()[-500:]}",
                             "check database.url and that the database exists and is empty or "
                             "this appliance's")


def _config_secrets_note(manifest: dict[str, Any], secrets: Secrets | None) -> list[str]:
    """What the operator must know about the old configuration's secret values."""
    settings = (manifest.get("config") or {}).get("secret_settings") or []
    if not settings or (secrets is not None and secrets.config is not None):
        return []
    why = ("the backup was taken without a passphrase, so they were left out"
           if not manifest["secrets"]["included"] else "--no-secrets was given")
    return [f"the old configuration's secret values ({', '.join(settings)}) read "
            f"\"[sealed: …]\" in the copy ({why}): set them again on this box"]


def _put_aside(opened: OpenedBackup, folder: Path, config: bytes | None) -> dict[str, str]:
    """Write the old box's configuration (as it was, from the secrets, when they were opened;
    else the copy without its secret values) and weights manifest to `folder` (0750; the
    configuration 0600 when it holds its secrets)."""
    placed: dict[str, str] = {}
    for member, name in ((bk.CONFIG_MEMBER, "appliance.toml"),
                         (bk.WEIGHTS_MEMBER, "weights-manifest.json")):
        source = opened.member(member)
        whole = config if member == bk.CONFIG_MEMBER else None
        if source is None and whole is None:
            continue
        target = folder / name
        folder.mkdir(mode=0o750, exist_ok=True)
        if whole is not None:
            write_atomic(target, whole, mode=0o600)
        else:
            assert source is not None
            shutil.copyfile(source, target)
            target.chmod(0o640)
        with contextlib.suppress(OSError):
            bk.own_like(target, folder.parent)
            bk.own_like(folder, folder.parent)
        placed[member] = str(target)
    return placed
