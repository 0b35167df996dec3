"""The box's cell role as its head last set it, over the configuration's `cell.role`.

A head changes a member's role through the member's peer API (`POST /api/v1/cell/peer/role`);
the member keeps the choice in `state_dir/cell/role` (one word, written atomically), so it
outlives a daemon restart, and the launch spec's role layer uses it from then on
(`Supervisor.role`, read at the composition root). The configuration's `cell.role` is the
role of a box no head has changed; removing the file (or choosing the configured role again)
returns to it. The role changes the engine's flags only: the address the engine binds is
`cell.listen_address` whatever the role (appliance.config.engine_host).
"""

from __future__ import annotations

from pathlib import Path

from appliance.atomic import write_atomic
from appliance.config import CELL_ROLES, Config

ROLES = CELL_ROLES


def role_file(state_dir: Path) -> Path:
    return state_dir / "cell" / "role"


def stored_role(state_dir: Path) -> str | None:
    """The head's choice, or None when there is none (or the file holds no role: a file
    edited by hand to something else is ignored, never half-applied)."""
    try:
        word = role_file(state_dir).read_text().strip()
    except OSError:
        return None
    return word if word in ROLES else None


def effective_role(config: Config) -> str:
    """The role the next engine launch uses."""
    return stored_role(config.paths.state_dir) or config.cell.role


def store_role(config: Config, role: str) -> None:
    """Keep `role` for the next launches; the configured role removes the file."""
    if role not in ROLES:
        raise ValueError(f"{role!r} is not a cell role (unified, prefill or decode)")
    path = role_file(config.paths.state_dir)
    if role == config.cell.role:
        path.unlink(missing_ok=True)
        return
    write_atomic(path, (role + "\n").encode(), mode=0o640, dir_mode=0o750)
