"""Recording admin actions from any delivery layer (console, API, CLI) in one shape.

It needs only a clock and the database (`Journal`), never the runtime's type: the runtime
passes itself in (`build_runtime` wires the cell's audit with it), so this module stays
below `appliance.runtime` in the import graph.
"""

from __future__ import annotations

from typing import Any, Protocol

from appliance.clock import Clock
from appliance.db.database import Database
from appliance.db.journal import add_audit


class Journal(Protocol):
    """What recording an action needs: `appliance.runtime.Runtime` is one."""

    @property
    def clock(self) -> Clock: ...
    @property
    def db(self) -> Database: ...


async def audit(
    runtime: Journal,
    *,
    actor: str,
    address: str,
    action: str,
    outcome: str = "ok",
    target: str = "",
    detail: dict[str, Any] | None = None,
) -> None:
    at = runtime.clock.now()
    await runtime.db.run(lambda s: add_audit(
        s, at=at, actor=actor, address=address, action=action, outcome=outcome, target=target,
        detail=detail,
    ))
