"""The CSRF token: minted and verified as Litestar's CSRF middleware does, under the server secret.

A token is 64 random hex characters followed by their HMAC-SHA256 (hex) keyed with the secret
`app.py` gives `CSRFConfig` (the server secret in hex: `csrf_secret(runtime.secret)`). Only this
server can mint one, so a pair an attacker chose themselves (say a cookie planted through a
sibling subdomain and the same value in the header) is refused: equal is not enough, both must
be signed and carry the same random part. The console's forms are checked by Litestar's own
middleware; the JSON API's session callers by `tokens_match` here, with the same rule.
"""

from __future__ import annotations

import hmac

from litestar.datastructures import Cookie
from litestar.middleware.csrf import CSRF_SECRET_LENGTH, generate_csrf_hash, generate_csrf_token

CSRF_COOKIE = "appliance_csrf"
CSRF_HEADER = "x-csrf-token"


def csrf_secret(secret: bytes) -> str:
    """The key `CSRFConfig(secret=...)` is given; tokens minted here must verify there."""
    return secret.hex()


def mint_token(secret: bytes) -> str:
    return generate_csrf_token(csrf_secret(secret))


def _random_part(token: str, secret: bytes) -> str | None:
    """The random part of a token this server signed, else None."""
    if len(token) <= CSRF_SECRET_LENGTH:
        return None
    random_part, signature = token[:CSRF_SECRET_LENGTH], token[CSRF_SECRET_LENGTH:]
    expected = generate_csrf_hash(random_part, csrf_secret(secret))
    return random_part if hmac.compare_digest(signature, expected) else None


def tokens_match(presented: str, cookie: str, secret: bytes) -> bool:
    """True when the header and the cookie are both server-signed and carry the same token."""
    header_part = _random_part(presented, secret)
    cookie_part = _random_part(cookie, secret)
    if header_part is None or cookie_part is None:
        return False
    return hmac.compare_digest(header_part, cookie_part)


def fresh_csrf_cookie(token: str, *, secure: bool) -> Cookie:
    """The CSRF cookie for a newly minted `token`, set at login so a token known before it
    (planted, or read off a shared machine) is worthless afterwards. Attributes as
    `CSRFConfig` in app.py sets them, so this cookie replaces the middleware's."""
    return Cookie(key=CSRF_COOKIE, value=token, path="/", httponly=True, samesite="strict",
                  secure=secure)
