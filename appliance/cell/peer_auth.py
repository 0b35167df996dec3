"""A member's check of a head's peer credential, for the auth middleware.

A bearer value with the peer prefix (`acp_`) is never an admin token: it is resolved against
the member's peer credentials only, and a live one opens exactly `tokens.PEER_ROUTES` (by
method and Litestar path template, so no spelling of a path reaches another route). Every
refusal is audited on the member (`cell.peer.refused`), with the caller's address.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from litestar.connection import ASGIConnection
from litestar.exceptions import NotAuthorizedException, PermissionDeniedException

from appliance.auditing import audit
from appliance.cell.tokens import PEER_ROUTES, resolve_peer
from appliance.runtime import runtime_of


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
    found = await runtime.db.run(lambda s: resolve_peer(s, runtime.secret, presented, now))
    if isinstance(found, str):
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
