"""Refuse requests whose Host header names a site this box does not answer to.

Guards the admin console against DNS rebinding: a page on evil.example that resolves its
name to 127.0.0.1 can reach the console, but its requests carry `Host: evil.example`.
Compares the host name only (any port), so `localhost:8080` matches `localhost`. `*` in the
list disables the check. More than one Host header is refused whatever the list says: this
guard and the Origin check could each read a different one (the servers' protocol refuses it
first, appliance.headbounds; this covers an app served without it). Plain ASGI, placed
before the auth middleware.
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
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        hosts = [value for name, value in scope["headers"] if name.lower() == b"host"]
        if len(hosts) > 1:
            await refuse(send, "host_repeated", "the request has more than one Host header",
                          "send exactly one Host header")
            return
        host = host_name(hosts[0].decode("latin-1") if hosts else "")
        if self.any or host in self.allowed:
            await self.app(scope, receive, send)
            return
        await refuse(send, "host_not_allowed",
                      f"this console does not answer to the host name {host!r}",
                      "use an address listed in server.allowed_hosts, or add this name there")


async def refuse(send: Send, code: str, detail: str, hint: str) -> None:
    """Answer 400 with a problem+json naming `code`, before any app code ran (the console's
    outermost middlewares refuse this way: a foreign or repeated Host, a bad path)."""
    body = json.dumps({
        "type": f"urn:appliance:error:{code}", "title": code.replace("_", " "), "status": 400,
        "code": code, "detail": detail, "hint": hint,
    }).encode()
    start: HTTPResponseStartEvent = {
        "type": "http.response.start", "status": 400, "headers": [
            (b"content-type", b"application/problem+json"),
            (b"content-length", str(len(body)).encode())]}
    await send(start)
    end: HTTPResponseBodyEvent = {"type": "http.response.body", "body": body, "more_body": False}
    await send(end)
