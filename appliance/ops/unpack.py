"""Reading a backup file (appliance.ops.backup) before anything of it is written: its
manifest, the manifest's seal, and its members, each bounded by the checked manifest.

`read_manifest` reads MANIFEST.json first (a format-1 file's is its last member: then every
member header is read first, writing nothing) and checks its seal, an HMAC keyed from the
passphrase (`appliance.ops.crypto.SealKey`). `extract` then writes each member into a scratch
directory, never more bytes than the manifest gives it, checking its sha256. Every refusal is
a `BackupRefused` naming the cause; nothing outside the scratch directory is touched here.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import shutil
import tarfile
import zlib
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import IO, Any

from appliance.errors import EX_DATAERR, ApplianceError
from appliance.ops import backup as bk

MAX_MANIFEST = 1 << 20
CHUNK = 1 << 20
SPACE_MARGIN = 64 << 20  # left free on the state volume after a restore's scratch copy

class BackupRefused(ApplianceError):
    """The backup cannot be restored here (damaged, newer, wrong kind); nothing was changed."""

    exit_code = EX_DATAERR



@dataclass(frozen=True)
class Verified:
    """A backup whose manifest was read and checked before anything of it was written: its
    seal verified with the passphrase (`sealed`), or accepted without one (`unverified`);
    and, for a format-1 file (manifest last), every member's name and size already compared
    with it."""

    path: Path
    manifest: dict[str, Any]
    sealed: bool


@dataclass(frozen=True)
class OpenedBackup:
    """A verified backup, extracted into `folder` (a private scratch directory)."""

    path: Path
    folder: Path
    manifest: dict[str, Any]
    sealed: bool = False

    def member(self, name: str) -> Path | None:
        return self.folder / name if name in self.manifest["files"] else None


def damaged(path: Path, why: str) -> BackupRefused:
    return BackupRefused("backup_damaged", f"the backup {path} is damaged: {why}; nothing was "
                         "changed", "use another copy of this backup, or an older backup")


def safe_name(name: str) -> bool:
    parts = PurePosixPath(name).parts
    return bool(parts) and not name.startswith("/") and ".." not in parts


def _small(tar: tarfile.TarFile, info: tarfile.TarInfo, path: Path, cap: int) -> bytes:
    if not info.isfile() or info.size > cap:
        raise damaged(path, f"its {info.name} is not the small file a backup holds")
    handle = tar.extractfile(info)
    assert handle is not None
    return handle.read(cap)


def _tar_errors(path: Path, exc: BaseException) -> BaseException:
    if isinstance(exc, OSError) and not isinstance(exc, tarfile.TarError) \
            and exc.filename is not None:
        return exc  # our own folder, not the backup
    return damaged(path, f"it is not a readable tar file ({type(exc).__name__}: {exc})")


def read_manifest(path: Path, passphrase: str | None, *, unverified: bool = False) -> Verified:
    """Read MANIFEST.json (the first member; the last in a format-1 file, whose headers are
    then all read, without writing anything) and check its seal with `passphrase`. Refused:
    a wrong passphrase (`PassphraseWrong`), a manifest that does not match its seal, one
    that lost its seal, and (unless `unverified`) one that has no seal or whose passphrase
    was not given."""
    if not path.is_file():
        raise ApplianceError("backup_missing", f"there is no backup file at {path}",
                             "give the path of a file `appliance backup` wrote", exit_code=66)
    head: bytes | None = None
    mac: bytes | None = None
    sizes: dict[str, int] | None = None  # format 1: every member's size, read first
    try:
        with tarfile.open(path, mode="r:*") as tar:
            first = tar.next()
            if first is not None and first.name == bk.MANIFEST:
                head = _small(tar, first, path, MAX_MANIFEST)
                second = tar.next()
                if second is not None and second.name == bk.MAC_MEMBER:
                    mac = _small(tar, second, path, 256)
            else:
                sizes = {}
                for info in tar:  # from the first again: read headers are kept
                    if not info.isfile() or not safe_name(info.name) or info.name in sizes:
                        raise damaged(path, f"it holds {info.name!r}, which no backup holds")
                    if info.name == bk.MANIFEST:
                        head = _small(tar, info, path, MAX_MANIFEST)
                    else:
                        sizes[info.name] = info.size
    except (tarfile.TarError, EOFError, zlib.error, OSError) as exc:
        raise _tar_errors(path, exc) from None
    if head is None:
        raise damaged(path, f"it has no {bk.MANIFEST} (is it an appliance backup?)")
    manifest = _parse_manifest(path, head)
    sealed = _check_seal(path, manifest, head, mac, passphrase, unverified=unverified)
    files = manifest["files"]
    if sizes is not None:
        for name in sorted(set(sizes) | set(files)):
            if name not in files:
                raise damaged(path, f"{name} is not listed in its {bk.MANIFEST}")
            if name not in sizes:
                raise damaged(path, f"{name} listed in its {bk.MANIFEST} is missing")
            if sizes[name] != files[name]["bytes"]:
                raise damaged(path, f"{name} is {sizes[name]:,} bytes in the file, "
                               f"{files[name]['bytes']:,} in its {bk.MANIFEST}")
    return Verified(path, manifest, sealed)


def _parse_manifest(path: Path, head: bytes) -> dict[str, Any]:
    try:
        manifest = json.loads(head)
        files = manifest["files"]
        assert isinstance(files, dict)
        for name, entry in files.items():
            assert safe_name(name) and name not in (bk.MANIFEST, bk.MAC_MEMBER)
            assert isinstance(entry["bytes"], int) and entry["bytes"] >= 0
            assert isinstance(entry["sha256"], str)
    except (ValueError, KeyError, TypeError, AssertionError):
        raise damaged(path, f"its {bk.MANIFEST} is not valid") from None
    fmt = manifest.get("format")
    if not isinstance(fmt, int) or fmt > bk.FORMAT:
        raise BackupRefused("backup_format_newer",
                            f"the backup {path} has format {fmt!r}; this release reads format "
                            f"{bk.FORMAT} and older",
                            "restore it with the release that took it (appliance "
                            f"{manifest.get('appliance_version', '?')}) or a newer one")
    assert isinstance(manifest, dict)
    return manifest


def _check_seal(path: Path, manifest: dict[str, Any], head: bytes, mac: bytes | None,
                passphrase: str | None, *, unverified: bool) -> bool:
    """True when the manifest's seal was verified; False when it was accepted unverified."""
    from appliance.ops.crypto import PassphraseWrong, SealKey

    seal = manifest.get("seal")
    secrets_in = bool((manifest.get("secrets") or {}).get("included"))
    if isinstance(seal, dict) and mac is not None:
        if passphrase is None:
            if unverified:
                return False
            raise BackupRefused(
                "backup_unverified", f"the backup {path} is sealed with a passphrase, and none "
                "was given (--no-secrets): its contents cannot be checked; nothing was changed",
                "give the passphrase (--passphrase-file FILE, or at the prompt); if it is lost, "
                "repeat with --no-secrets --unverified, only for a file kept where no one else "
                "could change it")
        key = SealKey.of(passphrase, dict(seal.get("kdf") or {}))
        if not hmac.compare_digest(key.check_value(), str(seal.get("check"))):
            raise PassphraseWrong(
                "backup_passphrase_wrong",
                f"the passphrase does not open the backup {path.name} (a wrong passphrase, or "
                "the file was changed); nothing was changed",
                "give the passphrase the backup was taken with (--passphrase-file FILE, or type "
                "it at the prompt); without it, restore with --no-secrets --unverified and "
                "issue new keys", exit_code=EX_DATAERR)
        if not key.verifies(head, mac.decode("ascii", errors="replace").strip()):
            raise BackupRefused(
                "backup_tampered", f"the backup {path} was changed after it was written: its "
                f"{bk.MANIFEST} does not match its seal; nothing was changed",
                "do not restore it: use another copy, and find out who could write where the "
                "backups are kept")
        return True
    if manifest.get("format", 1) >= 2 and (secrets_in or seal is not None or mac is not None):
        raise BackupRefused(
            "backup_tampered", f"the backup {path} was changed after it was written: it says "
            "its secrets are sealed, yet its manifest's seal is gone; nothing was changed",
            "do not restore it: use another copy, and find out who could write where the "
            "backups are kept")
    if unverified:
        return False
    older = manifest.get("format", 1) < 2
    why = ("it was written by an older release, whose backups have no seal over their "
           "contents" if older else "it was taken without a passphrase")
    raise BackupRefused(
        "backup_unsealed", f"the backup {path} carries no seal ({why}): nothing proves its "
        "database is the one the box wrote; nothing was changed",
        "if the file has been where no one else could change it, repeat with --unverified; "
        "take backups with a passphrase from now on (--passphrase-file, backup.passphrase_file)")


def extract(verified: Verified, folder: Path) -> OpenedBackup:
    """Extract every member into `folder`, each bounded by the size its (checked) manifest
    gives and checked against its sha256 as it is written; the total must fit the disk
    first. Raises `BackupRefused` naming the damage (the caller discards `folder`)."""
    path, files = verified.path, verified.manifest["files"]
    total = sum(int(entry["bytes"]) for entry in files.values())
    free = shutil.disk_usage(folder).free
    if total + SPACE_MARGIN > free:
        raise ApplianceError(
            "restore_no_space", f"the backup {path} holds {total:,} bytes, and "
            f"{folder.parent} has {free:,} free; nothing was changed",
            f"free space on the state directory's volume (about {total + SPACE_MARGIN:,} "
            "bytes), then restore", exit_code=EX_DATAERR)
    done: set[str] = set()
    try:
        with tarfile.open(path, mode="r:*") as tar:
            for info in tar:
                if info.name in (bk.MANIFEST, bk.MAC_MEMBER) and info.name not in done:
                    done.add(info.name)
                    continue
                if not info.isfile() or not safe_name(info.name):
                    raise damaged(path, f"it holds {info.name!r}, which no backup holds")
                expected = files.get(info.name)
                if expected is None or info.name in done:
                    raise damaged(path, f"{info.name} is not listed in its {bk.MANIFEST}")
                if info.size != expected["bytes"]:
                    raise damaged(path, f"{info.name} is {info.size:,} bytes in the file, "
                                   f"{expected['bytes']:,} in its {bk.MANIFEST}")
                handle = tar.extractfile(info)
                assert handle is not None
                digest, size = _extract(handle, folder / info.name, expected["bytes"])
                if size != expected["bytes"] or digest != expected["sha256"]:
                    raise damaged(path, f"{info.name} does not match its checksum (expected "
                                   f"{expected['bytes']} bytes, sha256 "
                                   f"{str(expected['sha256'])[:16]}…; found {size} bytes, "
                                   f"sha256 {digest[:16]}…)")
                done.add(info.name)
    except (tarfile.TarError, EOFError, zlib.error, OSError) as exc:
        raise _tar_errors(path, exc) from None
    missing = sorted(set(files) - done)
    if missing:
        raise damaged(path, f"{', '.join(missing)} listed in its {bk.MANIFEST} is missing")
    return OpenedBackup(path, folder, verified.manifest, verified.sealed)


def open_backup(path: Path, folder: Path, passphrase: str | None = None, *,
                unverified: bool = False) -> OpenedBackup:
    """`read_manifest`, then `extract` into `folder`."""
    return extract(read_manifest(path, passphrase, unverified=unverified), folder)


def _extract(handle: IO[bytes], target: Path, limit: int) -> tuple[str, int]:
    """Copy at most `limit` bytes (and one more, to tell a longer member) to `target`."""
    target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    digest, size = hashlib.sha256(), 0
    with target.open("wb") as out:
        while size <= limit and (chunk := handle.read(min(CHUNK, limit + 1 - size))):
            digest.update(chunk)
            size += len(chunk)
            out.write(chunk)
    return digest.hexdigest(), size
