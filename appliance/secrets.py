"""Files under the state directory that must stay private: written 0600, atomically.

`write_private` is the one way to put a secret on disk: a sibling temp file created 0600,
fsync, rename, fsync of the directory, so a crash leaves the old file or the new, never a
half-written or world-readable one.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path


def write_private(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def server_secret(state_dir: Path) -> bytes:
    """The server's HMAC key (state_dir/secrets/server.key), created on first use."""
    path = state_dir / "secrets" / "server.key"
    if not path.exists():
        write_private(path, secrets.token_bytes(32).hex().encode())
    return bytes.fromhex(path.read_text().strip())
