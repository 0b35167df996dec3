"""Refuse requests whose Host header names a site this box does not answer to.

Guards the admin console against DNS rebinding: a page on evil.example that resolves its
name to 127.0.0.1 can reach the console, but its requests carry `Host: evil.example`.
Compares the host name only (any port), so `localhost:8080` matches `localhost`. `*` in the
list disables the check. Plain ASGI, placed outermost so nothing else runs first.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from litestar.types import (
    ASGIApp,
    HTTPResponseBodyEvent,
    HTTPResponseStartEvent,
    Receive,
    Scope,
    Send,
)


def host_name(header: str) -> str:
    header = header.strip().lower()
    if header.startswith("["):  # [::1]:8080
        return header[1 : header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


class HostGuard:
    def __init__(self, app: ASGIApp, allowed: Iterable[str]) -> None:
        self.app = app
        self.allowed = {a.strip().lower().strip("[]") for a in allowed}
        self.any = "*" in self.allowed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or self.any:
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        host = host_name(headers.get(b"host", b"").decode("latin-1"))
        if host in self.allowed:
            await self.app(scope, receive, send)
            return
        body = json.dumps({
            "type": "urn:appliance:error:host_not_allowed", "title": "host not allowed",
            "status": 400, "code": "host_not_allowed",
            "detail": f"this console does not answer to the host name {host!r}",
            "hint": "use an address listed in server.allowed_hosts, or add this name there",
        }).encode()
        start: HTTPResponseStartEvent = {
            "type": "http.response.start", "status": 400, "headers": [
                (b"content-type", b"application/problem+json"),
                (b"content-length", str(len(body)).encode())]}
        await send(start)
        end: HTTPResponseBodyEvent = {
            "type": "http.response.body", "body": body, "more_body": False}
        await send(end)
