"""Files under the state directory that must stay private: written 0600, atomically.

`write_private` is the one way to put a secret on disk: an atomic write (see
`appliance.atomic`) of a file created 0600 in a 0700 directory, so a crash leaves the old
file or the new, never a half-written or world-readable one.

Two secrets live in `state_dir/secrets/` (0700, the `appliance` user's: the daemon and the
gateway): `server.key`, the HMAC key for stored credentials, and `engine-api.key`, the key
SGLang's HTTP port demands (`--api-key`), so that only the daemon and the gateway can use the
engine and nobody else on the box bypasses the gateway's keys, limits and usage. The engine
runs as another user (`appliance-engine`) that cannot see `secrets/`; it gets its key from
`engine_auth_path` (`state_dir/engine/engine-auth.yaml`, 0640, group `appliance`), an SGLang
`--config` file the daemon writes, so the key is never on the engine's command line (argv is
world-readable in /proc).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import secrets
from pathlib import Path

from appliance.atomic import write_atomic

# Never a leading "-": SGLang turns the --config file into `--api-key VALUE` for argparse,
# which would read such a value as an option.
ENGINE_KEY_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_-]{31,127}")


def write_private(path: Path, data: bytes) -> None:
    write_atomic(path, data, mode=0o600, dir_mode=0o700)


def _create_private(path: Path, data: bytes) -> None:
    """Create `path` (0600) with `data` unless it exists: the daemon and the gateway may both
    make the engine key at a first boot, and both must end up with the same one. The file is
    written whole under a temporary name, then linked into place, which fails when another
    process got there first (its key stays)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.new")
    write_private(tmp, data)
    try:
        os.link(tmp, path)
    except FileExistsError:
        pass
    finally:
        tmp.unlink(missing_ok=True)


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


def engine_key_path(state_dir: Path) -> Path:
    """Where the engine API key lives (the router's spec and a cell's key hand-over name it
    too)."""
    return state_dir / "secrets" / "engine-api.key"


def engine_api_key(state_dir: Path) -> str:
    """The engine port's API key (state_dir/secrets/engine-api.key, 0600), created on first
    use. The daemon and the gateway (both the `appliance` user) send it as
    `Authorization: Bearer` on every engine call."""
    path = engine_key_path(state_dir)
    if not path.exists():
        _create_private(path, secrets.token_hex(32).encode())  # hex: no leading "-"
    key = path.read_text().strip()
    if not ENGINE_KEY_RE.fullmatch(key):
        raise ValueError(f"{path} does not hold an engine API key; delete it (a new one is "
                         "made at the next start) and restart the daemon, then the engine")
    return key


def read_engine_api_key(state_dir: Path) -> str | None:
    """The engine key when this process may read it, else None (`appliance doctor` run by
    a user who cannot read the secrets: its probes then go without, and answer what they
    can)."""
    return read_key_file(engine_key_path(state_dir))


def read_key_file(path: Path) -> str | None:
    """The engine key a file holds, or None when it cannot be read or holds none."""
    try:
        key = path.read_text().strip()
    except OSError:
        return None
    return key if ENGINE_KEY_RE.fullmatch(key) else None


def engine_auth_path(state_dir: Path) -> Path:
    """Where the engine's `--config` file lies: beside the launch spec, the one part of the
    state directory the engine unit sees (BindReadOnlyPaths=/var/lib/appliance/engine)."""
    return state_dir / "engine" / "engine-auth.yaml"


def write_engine_auth(state_dir: Path) -> str:
    """Write the engine's `--config` file with the engine key, and return the key.

    SGLang 0.5.23 reads `--api-key` only from its command line or from a YAML `--config` file
    (server_args.py `prepare_server_args`, utils/server_args_config_parser.py), never from the
    environment; the file keeps the key out of `ps`. 0640 in a 0750 directory: the engine's
    user reads it through the `appliance` group, nobody else. JSON is YAML, so the key is
    written as a JSON string (no YAML quoting rules to get wrong). Rewritten only when it
    differs, so a running engine's file never changes under it."""
    key = engine_api_key(state_dir)
    path = engine_auth_path(state_dir)
    text = json.dumps({"api-key": key}) + "\n"
    try:
        current = path.read_text()
    except OSError:
        current = None
    if current != text:
        write_atomic(path, text.encode(), mode=0o640, dir_mode=0o750)
    return key
