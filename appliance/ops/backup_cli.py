"""`appliance backup [--out FILE]` and `appliance restore FILE`.

Both need no daemon: a backup is taken online beside a running daemon and gateway (SQLite's
backup API, pg_dump); a restore demands both stopped. The passphrase for the secrets comes
from --passphrase-file, or is asked for on a terminal; --no-secrets leaves them out.
"""

from __future__ import annotations

import argparse
import datetime as dt
import getpass
import json
import os
import sys
import tarfile
from pathlib import Path
from typing import Any

from appliance.config import Config
from appliance.errors import EX_USAGE, ApplianceError


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    backup = sub.add_parser(
        "backup", parents=[common],
        help="write a backup of the database, secrets, configuration and tuning state",
        description="An online backup: the daemon and the gateway keep running. The weights "
        "are not in it (they are pulled or imported again, verified against its manifest).")
    backup.add_argument("--out", type=Path, default=None,
                        help="the file to write (default <backup.dir>/appliance-backup-"
                             "<time>.tar.gz; a name ending .tar is not compressed)")
    restore = sub.add_parser(
        "restore", parents=[common],
        help="restore a backup onto this box (daemon and gateway stopped)",
        description="Checks every file of the backup before changing anything, migrates an "
        "older schema, refuses a newer one, and says what it did not restore.")
    restore.add_argument("file", type=Path, help="a file `appliance backup` wrote")
    restore.add_argument("--force", action="store_true",
                         help="replace a database that already holds API keys or usage")
    restore.add_argument("--unverified", action="store_true",
                         help="restore a backup whose contents nothing can check: one taken "
                              "without a passphrase or by an older release, or one restored "
                              "with --no-secrets (only for a file no one else could change)")
    for cmd in (backup, restore):
        how = cmd.add_mutually_exclusive_group()
        how.add_argument("--passphrase-file", type=Path, default=None,
                         help="the passphrase that seals the secrets, on this file's first line")
        how.add_argument("--no-secrets", action="store_true",
                         help="leave the secrets out (users' API keys and admin tokens will "
                              "not work on a box restored without them)")


def _actor() -> str:
    try:
        return f"cli:{getpass.getuser()}"
    except Exception:
        return f"cli:uid{os.getuid()}"


def _passphrase(args: argparse.Namespace, *, confirm: bool) -> str | None:
    from appliance.ops.crypto import check_passphrase, read_passphrase_file

    if args.no_secrets:
        return None
    if args.passphrase_file is not None:
        return read_passphrase_file(args.passphrase_file)
    if not sys.stdin.isatty():
        raise ApplianceError("backup_passphrase_needed",
                             "the secrets need a passphrase and there is no terminal to ask",
                             "give --passphrase-file FILE, or --no-secrets to leave them out",
                             exit_code=EX_USAGE)
    first = getpass.getpass("Passphrase for the secrets: ")
    if confirm:
        check_passphrase(first)
        if getpass.getpass("Repeat it: ") != first:
            raise ApplianceError("backup_passphrase_mismatch", "the two passphrases differ",
                                 "run the command again", exit_code=EX_USAGE)
    return first


def run(args: argparse.Namespace, config: Config) -> int:
    if args.command == "backup":
        return run_backup(args, config)
    return run_restore(args, config)


def run_backup(args: argparse.Namespace, config: Config) -> int:
    from appliance.ops import backup as bk

    now = dt.datetime.now(dt.UTC)
    passphrase = _passphrase(args, confirm=True)
    out = args.out or bk.backup_dir(config) / bk.backup_name(now)
    with bk.recording(config.paths.state_dir, now) as done:
        result = bk.create_backup(config, out, passphrase=passphrase, now=now)
        bk.own_like(result.path, config.paths.state_dir)
        if result.path.parent == bk.backup_dir(config):  # the daemon writes there too
            bk.own_like(result.path.parent, config.paths.state_dir)
        done.append(result)
    _audit(config, now, result)
    secrets = ("secrets sealed with the passphrase" if passphrase is not None
               else "secrets LEFT OUT: a box restored from it needs new API keys and tokens")
    print(f"appliance: backup written to {result.path} ({result.size:,} bytes, schema "
          f"{result.manifest['schema_revision']}; {secrets})")
    print(f"appliance: not in it: {bk.NOT_IN_BACKUPS}")
    return 0


def _audit(config: Config, now: dt.datetime, result: Any) -> None:
    """The audit entry, after the snapshot (so not in it). Best effort: the backup is written
    and recorded already; a database that cannot take the entry must not undo that."""
    from appliance.db.database import Database
    from appliance.db.journal import add_audit

    db = Database(config.database_url)
    try:
        db.call(lambda s: add_audit(
            s, at=now, actor=_actor(), action="backup.create", target=result.path.name,
            detail={"file": str(result.path), "bytes": result.size,
                    "secrets": result.manifest["secrets"]["included"]}))
    except Exception as exc:  # reported, not fatal
        print(f"appliance: warning: the backup was not written to the audit log: {exc}",
              file=sys.stderr)
    finally:
        db.dispose()


def peek_manifest(path: Path) -> dict[str, Any] | None:
    """MANIFEST.json without checking anything (only to know whether to ask for a
    passphrase; `restore` checks it and its seal); None when it cannot be read: `restore`
    then reports the damage."""
    try:
        with tarfile.open(path, mode="r:*") as tar:
            for info in tar:
                if info.name == "MANIFEST.json" and info.isfile():
                    handle = tar.extractfile(info)
                    value = json.loads(handle.read()) if handle else None
                    return value if isinstance(value, dict) else None
    except Exception:
        return None
    return None


def run_restore(args: argparse.Namespace, config: Config) -> int:
    from appliance.ops.restore import restore
    from appliance.resources import migrations_dir

    manifest = peek_manifest(args.file) or {}
    sealed = bool((manifest.get("secrets") or {}).get("included") or manifest.get("seal"))
    passphrase = _passphrase(args, confirm=False) if sealed else None
    report = restore(config, args.file, passphrase=passphrase,
                     script_location=migrations_dir(), now=dt.datetime.now(dt.UTC),
                     actor=_actor(), force=args.force, unverified=args.unverified)
    print(f"appliance: restored {args.file}")
    for line in report.lines():
        print(line)
    print("next: start the daemon and the gateway (`systemctl start appliance "
          "appliance-gateway`), then bring the weights back as above")
    return 0
