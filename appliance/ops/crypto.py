"""Passphrase encryption of a backup's secrets: scrypt, then AES-256-GCM.

The sealed form is self-describing, so a later release can still open an old backup:

    MAGIC (8) | header length (2, big endian) | header (JSON) | nonce (12) | ciphertext+tag

The header names the key derivation and its parameters (salt included). It is also the GCM
associated data: a changed header fails authentication like a changed ciphertext. GCM is
authenticated, so a wrong passphrase and a damaged file both fail cleanly with
`PassphraseWrong`; nothing half-decrypted is ever returned.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from appliance.errors import EX_DATAERR, EX_USAGE, ApplianceError

MAGIC = b"APPLSEC1"
CIPHER = "AES-256-GCM"
# scrypt at n=2**15, r=8: 32 MiB and a fraction of a second per derivation; a guessed
# passphrase costs an attacker the same.
SCRYPT = {"name": "scrypt", "n": 2**15, "r": 8, "p": 1}
MAX_PASSPHRASE = 1024


class PassphraseWrong(ApplianceError):
    """The passphrase does not open the secrets (or their bytes were changed)."""


def _derive(passphrase: str, kdf: dict[str, Any]) -> bytes:
    from cryptography.hazmat.primitives.kdf.scrypt import Scrypt

    if kdf.get("name") != "scrypt":
        raise ApplianceError("backup_kdf_unknown",
                             f"the secrets are sealed with key derivation {kdf.get('name')!r}, "
                             "which this release does not know",
                             "restore with the release that took the backup, or a newer one")
    salt = bytes.fromhex(str(kdf["salt"]))
    n, r, p = int(kdf["n"]), int(kdf["r"]), int(kdf["p"])
    return Scrypt(salt=salt, length=32, n=n, r=r, p=p).derive(passphrase.encode())


def seal(data: bytes, passphrase: str) -> tuple[bytes, dict[str, Any]]:
    """Encrypt `data`; returns the sealed bytes and the header (for the backup's manifest)."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    check_passphrase(passphrase)
    kdf: dict[str, Any] = {**SCRYPT, "salt": os.urandom(16).hex()}
    header = {"cipher": CIPHER, "kdf": kdf}
    head = json.dumps(header, sort_keys=True).encode()
    nonce = os.urandom(12)
    sealed = AESGCM(_derive(passphrase, kdf)).encrypt(nonce, data, head)
    return MAGIC + len(head).to_bytes(2, "big") + head + nonce + sealed, header


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
