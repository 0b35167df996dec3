"""Recording admin actions from any delivery layer (console, API, CLI) in one shape."""

from __future__ import annotations

from typing import Any

from appliance.db.journal import add_audit
from appliance.runtime import Runtime


async def audit(
    runtime: Runtime,
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
