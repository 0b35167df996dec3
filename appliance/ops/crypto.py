"""Passphrase encryption of a backup's secrets (scrypt, then AES-256-GCM) and the seal over its
manifest (HMAC-SHA256 under a key derived from the same passphrase, `SealKey`).

The sealed form is self-describing, so a later release can still open an old backup:

    MAGIC (8) | header length (2, big endian) | header (JSON) | nonce (12) | ciphertext+tag

The header names the key derivation and its parameters (salt included). It is also the GCM
associated data: a changed header fails authentication like a changed ciphertext. GCM is
authenticated, so a wrong passphrase and a damaged file both fail cleanly with
`PassphraseWrong`; nothing half-decrypted is ever returned.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from appliance.errors import EX_DATAERR, EX_USAGE, ApplianceError

MAGIC = b"APPLSEC1"
CIPHER = "AES-256-GCM"
# scrypt at n=2**15, r=8: 32 MiB and a fraction of a second per derivation; a guessed
# passphrase costs an attacker the same.
SCRYPT = {"name": "scrypt", "n": 2**15, "r": 8, "p": 1}
MAX_PASSPHRASE = 1024
MAX_SCRYPT_N = 2**20  # 1 GiB at r=8: a bound on what a backup file may ask a restore for


class PassphraseWrong(ApplianceError):
    """The passphrase does not open the secrets (or their bytes were changed)."""


def _derive(passphrase: str, kdf: dict[str, Any]) -> bytes:
    from cryptography.hazmat.primitives.kdf.scrypt import Scrypt

    if kdf.get("name") != "scrypt":
        raise ApplianceError("backup_kdf_unknown",
                             f"the secrets are sealed with key derivation {kdf.get('name')!r}, "
                             "which this release does not know",
                             "restore with the release that took the backup, or a newer one")
    try:
        salt = bytes.fromhex(str(kdf["salt"]))
        n, r, p = int(kdf["n"]), int(kdf["r"]), int(kdf["p"])
    except (KeyError, ValueError, TypeError):
        raise ApplianceError("backup_damaged", "the backup's key derivation parameters are "
                             "not the ones this release writes",
                             "use another copy of this backup, or an older backup",
                             exit_code=EX_DATAERR) from None
    if not (2 <= n <= MAX_SCRYPT_N and 1 <= r <= 16 and 1 <= p <= 4 and len(salt) >= 16):
        # A file that asks for gigabytes of memory per guess is not one this release wrote.
        raise ApplianceError("backup_damaged", f"the backup asks for scrypt n={n}, r={r}, "
                             f"p={p}, beyond what any release writes",
                             "use another copy of this backup, or an older backup",
                             exit_code=EX_DATAERR)
    return Scrypt(salt=salt, length=32, n=n, r=r, p=p).derive(passphrase.encode())


@dataclass(frozen=True)
class SealKey:
    """A key derived once from the passphrase, for everything one backup seals: its secrets
    (AES-256-GCM, `seal`) and its manifest (HMAC-SHA256 under a key of its own, derived from
    this one with HKDF, so the two uses never share a key). `kdf` is the derivation's
    parameters (salt included), recorded in the backup so a restore derives the same key."""

    key: bytes = field(repr=False)
    kdf: dict[str, Any]

    @classmethod
    def new(cls, passphrase: str) -> SealKey:
        check_passphrase(passphrase)
        kdf: dict[str, Any] = {**SCRYPT, "salt": os.urandom(16).hex()}
        return cls(_derive(passphrase, kdf), kdf)

    @classmethod
    def of(cls, passphrase: str, kdf: dict[str, Any]) -> SealKey:
        return cls(_derive(passphrase, dict(kdf)), dict(kdf))

    def seal(self, data: bytes) -> bytes:
        """`data` sealed in the self-describing form `unseal` opens."""
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        head = json.dumps({"cipher": CIPHER, "kdf": self.kdf}, sort_keys=True).encode()
        nonce = os.urandom(12)
        sealed = AESGCM(self.key).encrypt(nonce, data, head)
        return MAGIC + len(head).to_bytes(2, "big") + head + nonce + sealed

    def _mac_key(self) -> bytes:
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.kdf.hkdf import HKDF

        return HKDF(algorithm=hashes.SHA256(), length=32, salt=None,
                    info=b"appliance backup manifest").derive(self.key)

    def mac(self, data: bytes) -> str:
        return hmac.new(self._mac_key(), data, hashlib.sha256).hexdigest()

    def check_value(self) -> str:
        """What tells a wrong passphrase from a changed manifest: a MAC of a fixed string."""
        return self.mac(b"appliance backup key check")[:16]

    def verifies(self, data: bytes, mac: str) -> bool:
        return hmac.compare_digest(self.mac(data), mac)


def seal(data: bytes, passphrase: str) -> tuple[bytes, dict[str, Any]]:
    """Encrypt `data`; returns the sealed bytes and the header (for the backup's manifest)."""
    key = SealKey.new(passphrase)
    return key.seal(data), {"cipher": CIPHER, "kdf": key.kdf}


def unseal(blob: bytes, passphrase: str, *, name: str = "secrets.enc") -> bytes:
    """Decrypt what `seal` made. Raises `PassphraseWrong` for a wrong passphrase or changed
    bytes, `ApplianceError` for something that is not a sealed file at all."""
    from cryptography.exceptions import InvalidTag
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    def damaged(why: str) -> ApplianceError:
        return ApplianceError("backup_damaged", f"{name} in the backup is not readable: {why}",
                              "use another backup (an older one from the same box)")

    if not blob.startswith(MAGIC) or len(blob) < len(MAGIC) + 2:
        raise damaged("it does not start with the sealed-secrets marker")
    size = int.from_bytes(blob[len(MAGIC):len(MAGIC) + 2], "big")
    start = len(MAGIC) + 2
    head = blob[start:start + size]
    try:
        header = json.loads(head)
        kdf = dict(header["kdf"])
    except (ValueError, KeyError, TypeError):
        raise damaged("its header is not the JSON this release writes") from None
    if header.get("cipher") != CIPHER:
        raise damaged(f"cipher {header.get('cipher')!r} is not {CIPHER}")
    nonce = blob[start + size:start + size + 12]
    sealed = blob[start + size + 12:]
    try:
        return AESGCM(_derive(passphrase, kdf)).decrypt(nonce, sealed, head)
    except (InvalidTag, ValueError):
        raise PassphraseWrong(
            "backup_passphrase_wrong",
            f"the passphrase does not open {name} (a wrong passphrase, or the file was changed)",
            "give the passphrase the backup was taken with (--passphrase-file FILE, or type it "
            "at the prompt); without it, restore with --no-secrets and issue new keys",
            exit_code=EX_DATAERR) from None


def check_passphrase(passphrase: str) -> None:
    if not passphrase:
        raise ApplianceError("backup_passphrase_empty", "the passphrase is empty",
                             "give a passphrase of at least 12 characters, or leave the "
                             "secrets out (--no-secrets)", exit_code=EX_USAGE)
    if len(passphrase) < 12 or len(passphrase) > MAX_PASSPHRASE:
        raise ApplianceError("backup_passphrase_short",
                             f"the passphrase has {len(passphrase)} characters",
                             f"use 12 to {MAX_PASSPHRASE} characters (a few random words)",
                             exit_code=EX_USAGE)


def read_passphrase_file(path: Path) -> str:
    """The first line of `path`, refusing a file anyone on the box may read: it unlocks the
    server's HMAC key and the engine key in every backup."""
    try:
        info = path.stat()
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ApplianceError("backup_passphrase_unreadable",
                             f"cannot read the passphrase file {path}: {exc.strerror or exc}",
                             "create it as root (`install -m 0640 -g appliance`), holding the "
                             "passphrase on its first line", exit_code=66) from None
    except UnicodeDecodeError:
        raise ApplianceError("backup_passphrase_unreadable",
                             f"the passphrase file {path} is not UTF-8 text",
                             "write the passphrase on its first line as plain text",
                             exit_code=EX_DATAERR) from None
    if info.st_mode & (stat.S_IROTH | stat.S_IWOTH | stat.S_IWGRP):
        raise ApplianceError("backup_passphrase_exposed",
                             f"the passphrase file {path} is readable or writable by others "
                             f"(mode {stat.S_IMODE(info.st_mode):04o})",
                             f"`chmod 0640 {path}` (owner root, group appliance)",
                             exit_code=77)
    passphrase = text.splitlines()[0] if text else ""
    check_passphrase(passphrase)
    return passphrase
