"""What a backup keeps out of the clear (appliance.ops.backup): the payload sealed into
secrets.enc (state_dir/secrets and the configuration file as it is), the configuration's plain
copy with each secret value replaced by "[sealed: <what>]", and the SQLite copy's text
columns scrubbed of the box's secrets (`SCRUBBED_COLUMNS`).

Invariant: what `config_copy` returns as the plain copy parses as TOML and holds none of the
values `appliance.ops.redact.secret_keys` names; else there is no plain copy at all.
"""

from __future__ import annotations

import base64
import json
import sqlite3
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from appliance.config import Config

if TYPE_CHECKING:
    from appliance.ops.redact import Redactor


def secrets_payload(state_dir: Path, config_file: bytes | None = None) -> bytes:
    """Every file under state_dir/secrets as JSON {relative path: base64}: the server's HMAC
    key (without it no stored API key or admin token matches again) and the engine key; and
    the configuration file as it is (`config_file`), whose secret values the backup's plain
    copy leaves out."""
    root = state_dir / "secrets"
    files: dict[str, str] = {}
    if root.is_dir():
        for path in sorted(root.rglob("*")):
            if path.is_file() and not path.name.startswith("."):
                files[path.relative_to(root).as_posix()] = base64.b64encode(
                    path.read_bytes()).decode()
    body: dict[str, Any] = {"files": files}
    if config_file is not None:
        body["config"] = base64.b64encode(config_file).decode()
    return json.dumps(body, sort_keys=True).encode()


# Text columns a secret can reach (an event quoting a webhook URL, a run's reason quoting a
# key): scrubbed in the backup's copy of the database.
SCRUBBED_COLUMNS = (("events", ("message", "detail")), ("audit_log", ("target", "detail")),
                    ("engine_runs", ("reason", "hint")))


def removed(label: str) -> str:
    return f"[removed from the backup: {label}]"


def sealed(label: str) -> str:
    return f"[sealed: {label}]"


def scrub_rows(copy: Path, clean: Callable[[str], str]) -> dict[str, int]:
    """Replace in the SQLite file `copy` every secret `clean` finds in `SCRUBBED_COLUMNS`;
    then VACUUM with secure_delete, so no free page keeps the old text. Returns the rows
    changed per table."""
    changed: dict[str, int] = {}
    con = sqlite3.connect(copy)
    try:
        con.execute("PRAGMA secure_delete=ON")
        tables = {row[0] for row in con.execute("SELECT name FROM sqlite_master")}
        for table, columns in SCRUBBED_COLUMNS:
            if table not in tables:
                continue
            picked = ", ".join(columns)
            for rowid, *values in con.execute(f"SELECT rowid, {picked} FROM {table}").fetchall():  # noqa: S608 - names from the table above
                cleaned = [clean(v) if isinstance(v, str) else v for v in values]
                if cleaned != values:
                    sets = ", ".join(f"{c} = ?" for c in columns)
                    con.execute(f"UPDATE {table} SET {sets} WHERE rowid = ?",  # noqa: S608
                                (*cleaned, rowid))
                    changed[table] = changed.get(table, 0) + 1
        con.commit()
        if changed:
            con.execute("VACUUM")
    finally:
        con.close()
    return changed


def config_copy(config: Config, redactor: Redactor) -> tuple[bytes | None, bytes | None,
                                                              list[str]]:
    """The configuration file for a backup: (its plain copy with every secret value replaced by
    "[sealed: <what>]", the file as it is, the settings whose values were in it). The plain
    copy is None when its scrubbed form would not parse (it is then only in secrets.enc)."""
    from appliance.ops.redact import secret_keys

    source = Path(config.source)
    if not (source.is_absolute() and source.is_file()):
        return None, None, []
    original = source.read_bytes()
    text = original.decode("utf-8", errors="replace")
    keys = secret_keys(config)
    present = [key for key, value in keys if value in text]
    scrubbed = redactor.credentials(text, sealed)
    try:
        parsed = json.dumps(tomllib.loads(scrubbed))
    except tomllib.TOMLDecodeError:
        return None, original, present
    if any(json.dumps(value)[1:-1] in parsed for _, value in keys):
        return None, original, present
    return scrubbed.encode(), original, present
