"""Files under the state directory that must stay private: written 0600, atomically.

`write_private` is the one way to put a secret on disk: an atomic write (see
`appliance.atomic`) of a file created 0600 in a 0700 directory, so a crash leaves the old
file or the new, never a half-written or world-readable one.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from pathlib import Path

from appliance.atomic import write_atomic


def write_private(path: Path, data: bytes) -> None:
    write_atomic(path, data, mode=0o600, dir_mode=0o700)


def server_secret(state_dir: Path) -> bytes:
    """The server's HMAC key (state_dir/secrets/server.key), created on first use."""
    path = state_dir / "secrets" / "server.key"
    if not path.exists():
        write_private(path, secrets.token_bytes(32).hex().encode())
    return bytes.fromhex(path.read_text().strip())


def keyed_hash(secret: bytes, credential: str) -> str:
    """HMAC-SHA256 of a credential (admin token, gateway key) under the server secret: what is
    stored instead of the credential, so a copy of the database cannot forge or test one."""
    return hmac.new(secret, credential.encode(), hashlib.sha256).hexdigest()
