"""The installer's view of the daemon's configuration file.

    python3 configfile.py default SOURCE_DIR       the text of /etc/appliance/appliance.toml
    python3 configfile.py values SOURCE_DIR FILE   KEY=VALUE lines the installer needs

`default`: the text is generated from the schema in SOURCE_DIR/appliance/config.py (the
release being installed), so it names exactly the keys that release reads, with their
defaults and docs. Every key is commented out: the daemon's built-in defaults apply until
the operator uncomments a line, so a later release's better default reaches boxes nobody
edited.

Runs on the bare system Python: appliance.config imports only the standard library at import
time, and nothing here validates values (that would import SQLAlchemy).

`values`: the directories, the console's and the gateway's addresses and the database URL
(the gateway's becomes its socket unit's ListenStream=), read from FILE (or
the defaults when FILE does not exist) for the installer's disk check, summary and purge.
The daemon checks the file properly when it starts; here an unreadable file is an error.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

HEADER = """\
# /etc/appliance/appliance.toml: the appliance daemon's configuration.
#
# Every key is listed with its built-in default, commented out: remove the leading # of a
# line to change it. Reference: docs/configuration.md. Restart after a change:
#     systemctl restart appliance.service appliance-gateway.service
# The installer never edits this file; when a release ships different defaults it writes
# them beside it as appliance.toml.new.
"""


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, Path):
        return json.dumps(str(value))
    if isinstance(value, tuple):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if value is None:
        return '""'
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{json.dumps(str(k))} = {toml_value(v)}"
                               for k, v in value.items()) + "}"
    return json.dumps(str(value))  # a TOML basic string is a JSON string for these values


def render(source: Path) -> str:
    sys.path.insert(0, str(source))
    from appliance import config

    lines = [HEADER.rstrip("\n")]
    for name, section in config.SECTIONS.items():
        lines.append("")
        doc = (section.__doc__ or "").strip().splitlines()[0]
        lines.append(f"# {doc}")
        lines.append(f"[{name}]")
        for field in dataclasses.fields(section):
            value = field.default
            if value is dataclasses.MISSING and field.default_factory is not dataclasses.MISSING:
                value = field.default_factory()  # a mapping (oidc.role_map): {} by default
            if value is dataclasses.MISSING:  # pragma: no cover - every key has a default
                raise SystemExit(f"{name}.{field.name} has no default")
            note = field.metadata.get("doc", "")
            if value is None:
                note = f"{note} (unset by default)" if note else "unset by default"
            if note:
                lines.append(f"# {note}")
            lines.append(f"#{field.name} = {toml_value(value)}")
    return "\n".join(lines) + "\n"


VALUES = (("paths", "state_dir"), ("paths", "models_dir"), ("paths", "log_dir"),
          ("server", "host"), ("server", "port"), ("server", "tls_cert"), ("database", "url"),
          ("gateway", "host"), ("gateway", "port"), ("cell", "role"))


def values(source: Path, path: Path) -> str:
    import tomllib

    sys.path.insert(0, str(source))
    from appliance import config

    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raw = {}
    out = []
    for section, key in VALUES:
        default = getattr(config.SECTIONS[section](), key)
        body = raw.get(section, {})
        value = body.get(key, default) if isinstance(body, dict) else default
        shown = "" if value is None else str(value)
        if "\n" in shown:
            raise ValueError(f"{section}.{key} spans lines")
        out.append(f"{section}_{key}={shown}")
    return "\n".join(out) + "\n"


def main(argv: list[str]) -> int:
    if len(argv) == 3 and argv[1] == "default":
        sys.stdout.write(render(Path(argv[2])))
        return 0
    if len(argv) == 4 and argv[1] == "values":
        try:
            sys.stdout.write(values(Path(argv[2]), Path(argv[3])))
        except (OSError, ValueError) as exc:  # tomllib's error is a ValueError
            print(f"cannot read {argv[3]}: {exc}", file=sys.stderr)
            return 65
        return 0
    print("usage: configfile.py default SOURCE_DIR | values SOURCE_DIR FILE", file=sys.stderr)
    return 64


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
