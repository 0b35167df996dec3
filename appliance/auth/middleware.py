"""Who is calling: an admin session cookie (the console), a bearer API token (scripts), or a
cell head's peer credential (`acp_…`: only the cell peer API, appliance.cell.peer_auth).

Runs on every request except the public paths. Session-authenticated unsafe requests to the
JSON API must also carry the CSRF token in `X-CSRF-Token`: one this server signed, equal to the
CSRF cookie's (auth/csrf.py; the console's forms are covered by Litestar's CSRF middleware;
bearer tokens are not ambient credentials and need none). Any unsafe request whose Origin names
another site is refused outright.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

from litestar.connection import ASGIConnection
from litestar.exceptions import NotAuthorizedException, PermissionDeniedException
from litestar.middleware import AbstractAuthenticationMiddleware, AuthenticationResult

from appliance.auth.csrf import CSRF_COOKIE, CSRF_HEADER, tokens_match
from appliance.auth.sessions import COOKIE_NAME, resolve_session
from appliance.auth.tokens import resolve_token
from appliance.cell.peer_auth import authenticate_peer
from appliance.cell.tokens import is_peer_credential
from appliance.runtime import runtime_of

__all__ = ["CSRF_COOKIE", "CSRF_HEADER", "PUBLIC_PATHS", "AdminAuthMiddleware", "AuthInfo",
           "client_address"]
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
# Each is a path or a folder of paths (the app anchors them: /api/v1/cell/join is public,
# /api/v1/cell/join-tokens is not).
PUBLIC_PATHS = ("/login", "/login/sso", "/static", "/healthz", "/api/v1/schema", "/favicon.ico",
                "/api/v1/cell/join")  # a head joining: the body's join token is its proof


@dataclass(frozen=True)
class AuthInfo:
    kind: str  # "session", "token" or "peer" (a cell head: appliance.cell.peer_auth)
    session_token: str = ""
    token_prefix: str = ""


def client_address(connection: ASGIConnection) -> str:  # type: ignore[type-arg]
    return connection.client.host if connection.client else ""


def _origin_matches(connection: ASGIConnection) -> bool:  # type: ignore[type-arg]
    origin = connection.headers.get("origin")
    if not origin or origin == "null":
        return origin is None
    return urlsplit(origin).netloc == connection.headers.get("host", "")


class AdminAuthMiddleware(AbstractAuthenticationMiddleware):
    async def authenticate_request(
        self, connection: ASGIConnection  # type: ignore[type-arg]
    ) -> AuthenticationResult:
        runtime = runtime_of(connection)
        method = connection.scope.get("method", "GET")
        if method not in SAFE_METHODS and not _origin_matches(connection):
            raise PermissionDeniedException("cross-origin request refused")
        now = runtime.clock.now()
        authorization = connection.headers.get("authorization", "")
        if authorization.lower().startswith("bearer "):
            presented = authorization[7:].strip()
            if is_peer_credential(presented):  # a cell head's: its own routes, nothing else
                peer = await authenticate_peer(connection, presented)
                return AuthenticationResult(user=peer, auth=AuthInfo("peer",
                                                                     token_prefix=peer.prefix))
            found = await runtime.db.run(
                lambda s: resolve_token(s, runtime.secret, presented, now)
            )
            if found is None:
                raise NotAuthorizedException("invalid, expired or revoked API token")
            admin, info = found
            auth = AuthInfo("token", token_prefix=info.prefix)
            return AuthenticationResult(user=admin, auth=auth)
        cookie = connection.cookies.get(COOKIE_NAME)
        if not cookie:
            raise NotAuthorizedException("login required")
        policy = runtime.session_policy
        live = await runtime.db.run(lambda s: resolve_session(s, cookie, now, policy))
        if live is None:
            raise NotAuthorizedException("your session has expired; log in again")
        if method not in SAFE_METHODS and connection.url.path.startswith("/api/"):
            header = connection.headers.get(CSRF_HEADER, "")
            expected = connection.cookies.get(CSRF_COOKIE, "")
            if not tokens_match(header, expected, runtime.secret):
                raise PermissionDeniedException("CSRF token missing or wrong (X-CSRF-Token)")
        auth = AuthInfo("session", session_token=cookie)
        return AuthenticationResult(user=live.admin, auth=auth)
