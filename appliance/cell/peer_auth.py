"""A member's check of a head's peer credential, for the auth middleware.

A bearer value with the peer prefix (`acp_`) is never an admin token: it is resolved against
the member's peer credentials only, and a live one opens exactly `tokens.PEER_ROUTES` (by
method and Litestar path template, so no spelling of a path reaches another route). Every
refusal is audited on the member (`cell.peer.refused`), with the caller's address.

Unauthenticated cell attempts are throttled per address (`runtime.cell_attempts`, the
gateway's `AuthFailures`: bounded in addresses and in times kept per address): an unknown
peer credential here and a refused join token (`api/cell.py`) each count one failure, and an
address past the limit gets 429 with Retry-After before anything is looked up, and no audit
row (its failures that led there are audited), so a flood cannot grow the audit log faster
than the limit allows; housekeeping deletes the failed attempts' rows by retention. A
revoked credential does not count: it is one this box issued, and the head that still holds
it must go on hearing "revoked" (401), not 429.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from litestar.connection import ASGIConnection
from litestar.exceptions import (
    NotAuthorizedException,
    PermissionDeniedException,
    TooManyRequestsException,
)

from appliance.auditing import audit
from appliance.cell.tokens import PEER_ROUTES, resolve_peer
from appliance.runtime import Runtime, runtime_of


def refuse_if_throttled(runtime: Runtime, address: str, what: str) -> None:
    """429 with Retry-After when `address` made too many failed cell attempts lately; `what`
    names them for the caller ("join tokens", "peer credentials")."""
    attempts = runtime.cell_attempts
    wait = attempts.blocked(address, runtime.clock.monotonic())
    if wait is not None:
        raise TooManyRequestsException(
            f"this address sent {attempts.max_failures} wrong cell {what} within "
            f"{attempts.window:.0f} s; retry in {wait} s with a valid one (on the member, "
            "`appliance cell join-token` makes a new join token)",
            headers={"Retry-After": str(wait)})


def count_failure(runtime: Runtime, address: str) -> None:
    """One failed cell attempt from `address` (see the module's docstring)."""
    runtime.cell_attempts.failed(address, runtime.clock.monotonic())


@dataclass(frozen=True)
class CellPeer:
    """The caller behind a live peer credential: a head, acting with the cell scope only.

    `role` is what the role table's guard reads: admin, because the peer routes a head uses
    to hand over its engine key and to change the member's role are admin routes for a
    person; the middleware keeps this caller off every route but `PEER_ROUTES` whatever its
    role says."""

    username: str
    prefix: str
    head: str
    role: str = "admin"
    must_change_password: bool = False


async def authenticate_peer(connection: ASGIConnection[Any, Any, Any, Any],
                            presented: str) -> CellPeer:
    runtime = runtime_of(connection)
    now = runtime.clock.now()
    address = connection.client.host if connection.client else ""
    method = str(connection.scope.get("method", "GET"))
    template = str(connection.scope.get("path_template", ""))
    target = f"{method} {connection.url.path}"[:255]
    refuse_if_throttled(runtime, address, "peer credentials")
    found = await runtime.db.run(lambda s: resolve_peer(s, runtime.secret, presented, now))
    if isinstance(found, str):
        if found != "revoked":
            count_failure(runtime, address)
        await audit(runtime, actor="cell head", address=address, action="cell.peer.refused",
                    outcome="denied", target=target, detail={"reason": found})
        if found == "revoked":
            raise NotAuthorizedException("this member revoked the head's cell credential")
        raise NotAuthorizedException("unknown cell peer credential")
    peer = CellPeer(f"cell head {found.prefix}", found.prefix, found.head)
    if (method, template) not in PEER_ROUTES:
        await audit(runtime, actor=peer.username, address=address, action="cell.peer.refused",
                    outcome="denied", target=target, detail={"reason": "not a cell peer route"})
        raise PermissionDeniedException(
            "a cell peer credential works only on this member's cell peer API "
            "(/api/v1/cell/peer/…); use an admin token or session for anything else")
    return peer
