"""`appliance backup`: one file holding everything on the box that cannot be downloaded again.

Modelled on the databases' own online backups: SQLite's backup API copies a consistent
snapshot (one read transaction, so the daemon and the gateway keep writing meanwhile, and every
transaction committed before the copy began is in it), PostgreSQL's `pg_dump --format=custom`
does the same from one snapshot. Nothing needs stopping.

The file is a tar (gzip-compressed when its name ends in .gz) of, in this order:

    MANIFEST.json          format, appliance version, schema revision, when, which database,
                           each other file's sha256 and size, whether the secrets are in and
                           how sealed, which configuration values were sealed, what was scrubbed
    MANIFEST.mac           HMAC-SHA256 over MANIFEST.json's bytes, keyed from the passphrase
                           (appliance.ops.crypto.SealKey); absent without a passphrase
    database.sqlite        SQLite: the online-backup copy, its rows scrubbed (below)
    database.pgdump        PostgreSQL: pg_dump's custom format
    secrets.enc            state_dir/secrets/* and the configuration file as it is, sealed with
                           the passphrase; absent when the secrets are left out
    config/appliance.toml  the configuration file with every secret value replaced by
                           "[sealed: <what>]" (a TOML string still: it parses)
    engine/launch-spec.json  the engine's last launch spec, when there is one
    weights/manifest.json  the active weights manifest (the weights themselves are never in a
                           backup: they are pulled or imported again and verified against it)

Invariants: the file appears under its final name only when complete (written beside it,
fsynced, renamed); it is 0600; MANIFEST.json is the first member and lists every other one
(a restore checks it, and its seal, before it writes anything); no secret of the box (the
configuration's secret values, the files under secrets/, credentials of a known shape) is in
the file outside secrets.enc: the SQLite copy's event, audit and engine-run text is scrubbed
of them (and vacuumed, so no old page keeps them) before it is archived.
"""

from __future__ import annotations

import datetime as dt
import gzip
import hashlib
import io
import json
import os
import socket
import sqlite3
import subprocess
import tarfile
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import text
from sqlalchemy.engine import make_url

from appliance import __version__
from appliance.atomic import atomic_writer, write_atomic
from appliance.config import Config
from appliance.errors import EX_CANTCREAT, ApplianceError

FORMAT = 2  # 2: the manifest first, sealed; secrets out of the configuration copy and rows
MANIFEST = "MANIFEST.json"
MAC_MEMBER = "MANIFEST.mac"
SQLITE_MEMBER = "database.sqlite"
PG_MEMBER = "database.pgdump"
SECRETS_MEMBER = "secrets.enc"
CONFIG_MEMBER = "config/appliance.toml"
SPEC_MEMBER = "engine/launch-spec.json"
WEIGHTS_MEMBER = "weights/manifest.json"
NAME_PREFIX = "appliance-backup-"
NAME_SUFFIX = ".tar.gz"
STATUS_FILE = "backup-status.json"
NOT_IN_BACKUPS = ("weights: never in a backup (about 1.56 TB, and downloadable); pull them "
                  "(`appliance weights pull`) or import them (`appliance weights import DIR`), "
                  "verified against the restored manifest")


@dataclass(frozen=True)
class BackupResult:
    path: Path
    size: int
    manifest: dict[str, Any]


def backup_dir(config: Config) -> Path:
    return config.backup.dir or config.paths.state_dir / "backups"


def backup_name(now: dt.datetime) -> str:
    """The name a scheduled backup (and a manual one without --out) gets: sortable by time."""
    return f"{NAME_PREFIX}{now.astimezone(dt.UTC):%Y%m%dT%H%M%SZ}{NAME_SUFFIX}"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _sqlite_path(url: str) -> Path:
    database = make_url(url).database
    assert database, url  # config validation allows only absolute file paths
    return Path(database)


def _copy_sqlite(source: Path, target: Path) -> None:
    """SQLite's online backup into `target`: one step (pages=-1), so one read transaction and
    one consistent snapshot; in WAL mode writers go on meanwhile. The copy is made a plain
    rollback-journal file (one file, no -wal beside it) and checked."""
    if not source.exists():
        raise ApplianceError("backup_no_database", f"there is no database at {source}",
                             "check paths.state_dir / database.url, or run `appliance migrate` "
                             "on a new box first")
    src = sqlite3.connect(source, timeout=30)
    dst = sqlite3.connect(target)
    try:
        src.execute("PRAGMA busy_timeout=30000")
        src.backup(dst)
        dst.execute("PRAGMA journal_mode=DELETE")
        verdict = dst.execute("PRAGMA quick_check").fetchone()
        if not verdict or verdict[0] != "ok":
            raise ApplianceError("backup_database_damaged",
                                 f"the copy of {source} fails SQLite's check: {verdict}",
                                 "run `sqlite3 DB 'PRAGMA integrity_check'` and report it")
    finally:
        src.close()
        dst.close()


def libpq_target(url: str) -> tuple[str, dict[str, str]]:
    """A libpq URI without the password (argv is world-readable in /proc) and the environment
    that carries it (PGPASSWORD)."""
    parsed = make_url(url)
    env = {"PGPASSWORD": parsed.password} if parsed.password else {}
    plain = parsed.set(drivername="postgresql", password=None)
    return plain.render_as_string(hide_password=False), env


def _pg_dump(url: str, target: Path) -> None:
    uri, secret_env = libpq_target(url)
    try:
        done = subprocess.run(["pg_dump", "--format=custom", "--no-owner", "--no-privileges",
                               f"--file={target}", f"--dbname={uri}"],
                              env={**os.environ, **secret_env}, capture_output=True, text=True,
                              check=False, timeout=6 * 3600)
    except FileNotFoundError:
        raise ApplianceError("backup_no_pg_dump", "pg_dump is not installed",
                             "install the PostgreSQL client of the server's major version "
                             "(`apt-get install postgresql-client`)") from None
    if done.returncode != 0:
        raise ApplianceError("backup_pg_dump_failed",
                             f"pg_dump failed (exit {done.returncode}): "
                             f"{done.stderr.strip()[-500:]}",
                             "check database.url and that this pg_dump is not older than "
                             "the server")


def _revision_of(url: str) -> str | None:
    from sqlalchemy import create_engine

    from appliance.db.database import normalise_url

    engine = create_engine(normalise_url(url))
    try:
        with engine.connect() as conn:
            return conn.execute(text("SELECT version_num FROM alembic_version")).scalar()
    except Exception:  # no alembic_version table: never migrated
        return None
    finally:
        engine.dispose()


def _weights_manifest(url: str) -> tuple[str | None, dict[str, Any] | None]:
    """The active weights manifest (JSON text) and a summary, from the database at `url`."""
    from appliance.db.database import Database
    from appliance.weights import records

    db = Database(url)
    try:
        set_id = db.call(lambda s: records.get_control(s).active_set_id)
        if set_id is None:
            return None, None
        manifest = db.call(lambda s: records.load_manifest(s, set_id))
    except Exception:  # an empty or unmigrated database: nothing to name
        return None, None
    finally:
        db.dispose()
    return manifest.to_json(), {"repo": manifest.repo_id, "revision": manifest.revision,
                                "commit": manifest.commit, "files": len(manifest.files),
                                "bytes": manifest.total_bytes}


def create_backup(config: Config, out: Path, *, passphrase: str | None,
                  now: dt.datetime) -> BackupResult:
    """Write a backup to `out` (see the module docstring). `passphrase` None: the secrets
    (and the configuration's secret values) are left out and the manifest is not sealed, and
    the manifest says so."""
    from appliance.ops.crypto import CIPHER, SealKey
    from appliance.ops.redact import for_box
    from appliance.ops.sealing import config_copy, removed, scrub_rows, secrets_payload

    key = SealKey.new(passphrase) if passphrase is not None else None
    out = out.absolute()
    try:
        out.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as exc:
        raise ApplianceError("backup_cannot_write", f"cannot create {out.parent}: "
                             f"{exc.strerror or exc}", "choose another --out or backup.dir",
                             exit_code=EX_CANTCREAT) from None
    redactor = for_box(config)
    url = config.database_url
    sqlite = url.startswith("sqlite")
    members: list[tuple[str, bytes]] = []
    scrubbed: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix=".appliance-backup-", dir=out.parent) as work:
        if sqlite:
            copy = Path(work) / SQLITE_MEMBER
            _copy_sqlite(_sqlite_path(url), copy)
            scrubbed = scrub_rows(copy, lambda text: redactor.credentials(text, removed))
            copy_url = f"sqlite:///{copy}"
            revision = _revision_of(copy_url)
            weights_json, weights = _weights_manifest(copy_url)
            members.append((SQLITE_MEMBER, copy.read_bytes()))
        else:
            revision = _revision_of(url)  # changes only under `appliance migrate`
            weights_json, weights = _weights_manifest(url)
            dump = Path(work) / PG_MEMBER
            _pg_dump(url, dump)
            members.append((PG_MEMBER, dump.read_bytes()))
    plain_config, original_config, secret_settings = config_copy(config, redactor)
    secrets: dict[str, Any] = {"included": False}
    if key is not None:
        payload = secrets_payload(config.paths.state_dir, original_config)
        members.append((SECRETS_MEMBER, key.seal(payload)))
        secrets = {"included": True, "cipher": CIPHER, "kdf": key.kdf}
    if plain_config is not None:
        members.append((CONFIG_MEMBER, plain_config))
    spec = config.paths.state_dir / "engine" / "launch-spec.json"
    if spec.is_file():
        members.append((SPEC_MEMBER, spec.read_bytes()))
    if weights_json is not None:
        members.append((WEIGHTS_MEMBER, weights_json.encode()))
    manifest = {
        "format": FORMAT,
        "appliance_version": __version__,
        "schema_revision": revision,
        "database": "sqlite" if sqlite else "postgresql",
        "created_at": now.astimezone(dt.UTC).isoformat(),
        "host": socket.gethostname(),
        "secrets": secrets,
        "seal": ({"mac": "hmac-sha256", "kdf": key.kdf, "check": key.check_value()}
                 if key is not None else None),
        "config": {"file": original_config is not None, "plain_copy": plain_config is not None,
                   "secret_settings": secret_settings},
        "scrubbed_rows": scrubbed,
        "weights": weights,
        "not_included": [NOT_IN_BACKUPS],
        "files": {name: {"sha256": _sha256(data), "bytes": len(data)} for name, data in members},
    }
    head = json.dumps(manifest, indent=2, sort_keys=True).encode() + b"\n"
    sealed = [(MAC_MEMBER, key.mac(head).encode())] if key is not None else []
    size = _write_tar(out, [(MANIFEST, head), *sealed, *members],
                      compress=out.name.endswith(".gz"), mtime=now)
    return BackupResult(out, size, manifest)


def _write_tar(out: Path, members: list[tuple[str, bytes]], *, compress: bool,
               mtime: dt.datetime) -> int:
    with atomic_writer(out, mode=0o600) as raw:
        stream: Any = gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) if compress else raw
        with tarfile.open(fileobj=stream, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for name, data in members:
                info = tarfile.TarInfo(name)
                info.size, info.mode = len(data), 0o600
                info.mtime = int(mtime.timestamp())
                tar.addfile(info, io.BytesIO(data))
        if compress:
            stream.close()
    return out.stat().st_size


def prune(directory: Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` backups named as `backup_name` makes them in
    `directory`; other files (a migration's database copy, an operator's file) are never
    touched. Returns what was deleted."""
    found = sorted(p for p in directory.glob(f"{NAME_PREFIX}*{NAME_SUFFIX}") if p.is_file())
    doomed = found[:-keep] if keep > 0 else found
    for path in doomed:
        path.unlink(missing_ok=True)
    return doomed


# --- the record of the last backups (dashboard, health check, schedule) ----------------------


@dataclass(frozen=True)
class BackupStatus:
    """What `state_dir/backup-status.json` holds. `armed_at`/`armed_schedule`: when the
    current schedule was first seen, so a new box (or a schedule just turned on) is not
    overdue for a time before it existed."""

    last_success_at: dt.datetime | None = None
    last_success_file: str = ""
    last_success_bytes: int = 0
    last_success_secrets: bool = False
    last_attempt_at: dt.datetime | None = None
    last_failure_at: dt.datetime | None = None
    last_failure: str = ""
    armed_at: dt.datetime | None = None
    armed_schedule: str = ""

    def to_json(self) -> str:
        def when(value: dt.datetime | None) -> str | None:
            return value.astimezone(dt.UTC).isoformat() if value else None

        return json.dumps({
            "last_success_at": when(self.last_success_at),
            "last_success_file": self.last_success_file,
            "last_success_bytes": self.last_success_bytes,
            "last_success_secrets": self.last_success_secrets,
            "last_attempt_at": when(self.last_attempt_at),
            "last_failure_at": when(self.last_failure_at),
            "last_failure": self.last_failure,
            "armed_at": when(self.armed_at),
            "armed_schedule": self.armed_schedule,
        }, indent=2) + "\n"


def _parse_when(value: Any) -> dt.datetime | None:
    if not isinstance(value, str):
        return None
    try:
        parsed = dt.datetime.fromisoformat(value)
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=dt.UTC)


def read_status(state_dir: Path) -> BackupStatus:
    """The recorded status; an absent or unreadable file is "no backup yet" (never an error:
    the dashboard and the health check must not fail on it)."""
    try:
        raw = json.loads((state_dir / STATUS_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return BackupStatus()
    if not isinstance(raw, dict):
        return BackupStatus()
    return BackupStatus(
        last_success_at=_parse_when(raw.get("last_success_at")),
        last_success_file=str(raw.get("last_success_file") or ""),
        last_success_bytes=int(raw.get("last_success_bytes") or 0),
        last_success_secrets=bool(raw.get("last_success_secrets")),
        last_attempt_at=_parse_when(raw.get("last_attempt_at")),
        last_failure_at=_parse_when(raw.get("last_failure_at")),
        last_failure=str(raw.get("last_failure") or ""),
        armed_at=_parse_when(raw.get("armed_at")),
        armed_schedule=str(raw.get("armed_schedule") or ""),
    )


def write_status(state_dir: Path, status: BackupStatus) -> None:
    path = state_dir / STATUS_FILE
    write_atomic(path, status.to_json().encode(), mode=0o640, dir_mode=0o750)
    own_like(path, state_dir)


def own_like(path: Path, reference: Path) -> None:
    """Run as root (a restore, a backup by hand), give what was written to the owner of the
    state directory, so the daemon's user can read and replace it."""
    if os.geteuid() != 0:
        return
    ref = reference.stat()
    os.chown(path, ref.st_uid, ref.st_gid)


@contextmanager
def recording(state_dir: Path, now: dt.datetime) -> Iterator[list[BackupResult]]:
    """Around one backup: record the attempt, then its success or its failure (re-raised).
    The caller appends the result to the yielded list."""
    from dataclasses import replace

    done: list[BackupResult] = []
    status = replace(read_status(state_dir), last_attempt_at=now)
    try:
        yield done
    except Exception as exc:
        message = exc.message if isinstance(exc, ApplianceError) else f"{type(exc).__name__}: {exc}"
        write_status(state_dir, replace(status, last_failure_at=now, last_failure=message))
        raise
    if done:
        result = done[0]
        write_status(state_dir, replace(
            read_status(state_dir), last_attempt_at=now, last_success_at=now,
            last_success_file=str(result.path), last_success_bytes=result.size,
            last_success_secrets=bool(result.manifest["secrets"]["included"])))
