"""The console's outermost middleware: what every console answer carries, and paths refused
before anything reads them.

- Every response gets the anti-framing and content headers of `SECURITY_HEADERS` unless it
  set its own (the SVG charts send a stricter CSP of their own). The page policy allows
  scripts and styles from the console itself only: no inline script, no eval (htmx runs with
  `allowEval` and `includeIndicatorStyles` off, see web/templates/base.html), no framing.
- A path with a control character once decoded (`/static/%00%0a...`) is answered 400 before
  any route, so it can neither fail a handler (it was a 500) nor forge a line in the log.

Plain ASGI, first in the app's middleware list. Litestar runs app middleware only for routed
requests, and answers an exception raised in middleware outside it: the app's exception
handlers therefore add the same headers (`secure`) and refuse the same paths
(`control_refusal`) for what never reaches this middleware (404, 405, 401 from the auth).
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping

from litestar.enums import ScopeType
from litestar.types import ASGIApp, Message, Receive, Scope, Send

from appliance.hostguard import refuse

CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
       "connect-src 'self'; font-src 'self'; object-src 'none'; base-uri 'none'; "
       "form-action 'self'; frame-ancestors 'none'")

SECURITY_HEADERS: Mapping[str, str] = {
    "content-security-policy": CSP,
    "x-frame-options": "DENY",
    "referrer-policy": "same-origin",
    "x-content-type-options": "nosniff",
}
_RAW_HEADERS = [(k.encode(), v.encode()) for k, v in SECURITY_HEADERS.items()]


def control_refusal(path: str) -> str | None:
    """Why `path` (decoded) is refused, or None: control characters (C0, DEL) have no place
    in a console path and would end a log line early."""
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in path):
        return (f"the path {path!r} contains a control character; "
                "remove it (a link or client encoded something it should not have)")
    return None


def secure(headers: MutableMapping[str, str]) -> None:
    """Add `SECURITY_HEADERS` to a Litestar response's headers, keeping any it already set."""
    present = {name.lower() for name in headers}
    for name, value in SECURITY_HEADERS.items():
        if name not in present:
            headers[name] = value


class ConsoleEdge:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != ScopeType.HTTP:
            await self.app(scope, receive, send)
            return

        async def send_secured(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                present = {bytes(name).lower() for name, _ in headers}
                headers.extend(h for h in _RAW_HEADERS if h[0] not in present)
                message = {**message, "headers": headers}
            await send(message)

        why = control_refusal(scope["path"])
        if why is not None:
            await refuse(send_secured, "path_invalid", why,
                         "request the page or API path without control characters")
            return
        await self.app(scope, receive, send_secured)
