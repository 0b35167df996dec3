"""OpenID Connect sign-in to the console: authorization code flow with PKCE (S256).

The flow, from the browser's side: `/login/sso` discovers the provider from its issuer URL,
starts a `Flow` (random state, nonce and PKCE verifier, the local page to land on) and sends
the browser to the provider; the provider sends it back to `/login/sso/callback` with a code.
The flow travels in a short-lived cookie that this server signed (HMAC with the server secret,
SameSite=Lax so the provider's redirect back carries it), so nothing is kept server-side for
an abandoned sign-in. The callback checks the returned `state` against the cookie's, exchanges
the code (with the verifier and the client secret) at the token endpoint, and verifies the
ID token with joserfc (Authlib's JOSE library) against the provider's JWKS: signature,
issuer, audience = our client id, exp/nbf/iat with `LEEWAY` of clock skew, and our nonce.

Only then are the groups read (`oidc.groups_claim`) and mapped to a role (`oidc.role_map`, the
highest wins). A signed-in user becomes a local shadow account (source "oidc", found by issuer
and subject) carrying the mapped role, and gets the ordinary session, so CSRF, audit and role
checks work unchanged. No mapped group is a refusal, and it takes the shadow account's role
away (`refuse_shadow`: `accounts.NO_ROLE`), so no session or API token of it acts any more; a
lower mapped role lowers its tokens' (they never act above their owner's role). A shadow
account has no usable password, and its username always contains "@", which local usernames
cannot.

Discovery and the JWKS are read at every sign-in (with `HTTP_TIMEOUT`): sign-ins are rare,
and the provider's key rotation then needs nothing from us.
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import hmac
import json
import secrets
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlencode, urlsplit

import httpx
from authlib.integrations.httpx_client import AsyncOAuth2Client
from authlib.oauth2 import OAuth2Error
from authlib.oauth2.rfc7636 import create_s256_code_challenge
from joserfc import jwt
from joserfc.errors import JoseError
from joserfc.jwk import KeySet
from sqlalchemy import select
from sqlalchemy.orm import Session

from appliance.auth.accounts import NO_ROLE, Admin, get_admin
from appliance.config import ROLES, OidcConfig
from appliance.db.models import AdminSession, AdminUser

FLOW_COOKIE = "appliance_sso"
FLOW_PATH = "/login/sso"
FLOW_TTL = dt.timedelta(minutes=10)
HTTP_TIMEOUT = 5.0
LEEWAY = 60  # seconds of clock skew between the provider and this box
ALGORITHMS = ["RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384"]
SOURCE = "oidc"
UNUSABLE_HASH = "!oidc"  # not an argon2 hash: a local login as this account never verifies
SUBJECT_MAX = 255


class SsoError(Exception):
    """A sign-in that did not happen. `message` is for the person (cause and next step);
    `reason` is a short code for the audit log."""

    def __init__(self, reason: str, message: str, status: int = 401) -> None:
        super().__init__(message)
        self.reason, self.message, self.status = reason, message, status


@dataclass(frozen=True)
class Provider:
    """What discovery told us about the provider."""

    issuer: str
    authorization_endpoint: str
    token_endpoint: str
    jwks_uri: str


@dataclass(frozen=True)
class Flow:
    """One sign-in in progress; sealed into the flow cookie."""

    state: str
    nonce: str
    verifier: str
    next: str
    expires: int  # unix seconds


@dataclass(frozen=True)
class Identity:
    """A verified user: who, from where, with which groups and (if any) role."""

    issuer: str
    subject: str
    name: str
    groups: tuple[str, ...]
    role: str | None


def _unavailable(config: OidcConfig, cause: str) -> SsoError:
    return SsoError(
        "provider_unreachable",
        f"Single sign-on is unavailable: {config.display_name} ({config.issuer}) {cause}. "
        "Try again in a while, or log in with a local break-glass account below.", 503)


async def discover(config: OidcConfig, transport: httpx.AsyncBaseTransport | None = None
                   ) -> Provider:
    """Read `<issuer>/.well-known/openid-configuration`; its issuer must be ours exactly."""
    url = config.issuer.rstrip("/") + "/.well-known/openid-configuration"
    try:
        async with httpx.AsyncClient(timeout=HTTP_TIMEOUT, transport=transport) as client:
            response = await client.get(url)
    except httpx.HTTPError as exc:
        raise _unavailable(config, f"did not answer ({type(exc).__name__})") from None
    if response.status_code != 200:
        raise _unavailable(config, f"answered {response.status_code} for its discovery document")
    try:
        body = response.json()
        provider = Provider(str(body["issuer"]), str(body["authorization_endpoint"]),
                            str(body["token_endpoint"]), str(body["jwks_uri"]))
    except (ValueError, KeyError, TypeError):
        raise _unavailable(config, "sent a discovery document without the endpoints") from None
    if provider.issuer != config.issuer:
        raise SsoError(
            "issuer_mismatch",
            f"The provider's discovery document names the issuer {provider.issuer!r}, not "
            f"{config.issuer!r}; set oidc.issuer to exactly the provider's value.", 502)
    return provider


def _mac(secret: bytes, payload: bytes) -> str:
    key = hashlib.sha256(b"appliance oidc flow\0" + secret).digest()
    return base64.urlsafe_b64encode(hmac.new(key, payload, hashlib.sha256).digest()).decode()


def new_flow(next_path: str, now: dt.datetime) -> Flow:
    # 43 characters of verifier: within RFC 7636's 43-128, from its unreserved alphabet.
    return Flow(state=secrets.token_urlsafe(24), nonce=secrets.token_urlsafe(24),
                verifier=secrets.token_urlsafe(32), next=next_path,
                expires=int((now + FLOW_TTL).timestamp()))


def seal(flow: Flow, secret: bytes) -> str:
    payload = base64.urlsafe_b64encode(json.dumps(asdict(flow)).encode())
    return f"{payload.decode()}.{_mac(secret, payload)}"


def unseal(value: str, secret: bytes, now: dt.datetime) -> Flow:
    """The flow a cookie carries, if this server sealed it and it has not expired."""
    again = SsoError("flow_missing", "This sign-in was not started in this browser, or took "
                     "longer than 10 minutes. Start again from the login page.", 400)
    payload, _, mac = value.partition(".")
    if not payload or not hmac.compare_digest(mac.encode(), _mac(secret, payload.encode())
                                              .encode()):
        raise again
    try:
        flow = Flow(**json.loads(base64.urlsafe_b64decode(payload)))
    except (ValueError, TypeError):
        raise again from None
    if flow.expires <= now.timestamp():
        raise again
    return flow


def read_client_secret(path: Path | None) -> str:
    try:
        if path is None:
            raise FileNotFoundError
        secret = path.read_text(encoding="utf-8").splitlines()[0].strip()
    except (OSError, IndexError, UnicodeDecodeError):
        raise SsoError("client_secret_unreadable",
                       f"The client secret file ({path}) cannot be read or is empty; an admin "
                       "must fix oidc.client_secret_file (docs/operations.md).", 500) from None
    return secret


def _client(config: OidcConfig, client_secret: str, redirect_uri: str,
            transport: httpx.AsyncBaseTransport | None) -> AsyncOAuth2Client:
    return AsyncOAuth2Client(
        client_id=config.client_id, client_secret=client_secret, scope=config.scopes,
        redirect_uri=redirect_uri, code_challenge_method="S256", timeout=HTTP_TIMEOUT,
        transport=transport)


def authorization_url(config: OidcConfig, provider: Provider, flow: Flow,
                      redirect_uri: str) -> str:
    """Where the browser goes to sign in (nothing is sent from here, so no secret)."""
    query = urlencode({
        "response_type": "code", "client_id": config.client_id, "redirect_uri": redirect_uri,
        "scope": config.scopes, "state": flow.state, "nonce": flow.nonce,
        "code_challenge": create_s256_code_challenge(flow.verifier),
        "code_challenge_method": "S256",
    })
    endpoint = provider.authorization_endpoint
    return f"{endpoint}{'&' if '?' in endpoint else '?'}{query}"


async def exchange_code(config: OidcConfig, provider: Provider, client_secret: str, code: str,
                        flow: Flow, redirect_uri: str,
                        transport: httpx.AsyncBaseTransport | None = None) -> str:
    """The ID token the token endpoint gives for `code` (and our PKCE verifier)."""
    async with _client(config, client_secret, redirect_uri, transport) as client:
        try:
            token = await client.fetch_token(provider.token_endpoint, code=code,
                                             code_verifier=flow.verifier)
        except httpx.HTTPError as exc:
            raise _unavailable(config, f"did not answer the code exchange "
                               f"({type(exc).__name__})") from None
        except OAuth2Error as exc:
            raise SsoError("code_refused", f"{config.display_name} refused the sign-in code "
                           f"({exc.error}: {exc.description or 'no reason given'}). Start "
                           "again from the login page.") from None
    id_token = token.get("id_token") if isinstance(token, Mapping) else None
    if not isinstance(id_token, str):
        raise SsoError("no_id_token", f"{config.display_name} returned no ID token; check "
                       "that the scopes include openid (oidc.scopes).")
    return id_token


async def fetch_keys(config: OidcConfig, provider: Provider,
                     transport: httpx.AsyncBaseTransport | None = None) -> KeySet:
    try:
        async with httpx.AsyncClient(timeout=HTTP_TIMEOUT, transport=transport) as client:
            response = await client.get(provider.jwks_uri)
        response.raise_for_status()
        return KeySet.import_key_set(response.json())
    except httpx.HTTPError as exc:
        raise _unavailable(config, f"did not give its signing keys ({type(exc).__name__})"
                           ) from None
    except (ValueError, TypeError, KeyError, JoseError):
        raise _unavailable(config, "sent signing keys (JWKS) that cannot be read") from None


def verify_id_token(id_token: str, keys: KeySet, *, issuer: str, client_id: str, nonce: str,
                    now: dt.datetime) -> dict[str, Any]:
    """The ID token's claims, once its signature, issuer, audience, times and nonce hold."""
    try:
        token = jwt.decode(id_token, keys, algorithms=ALGORITHMS)
        registry = jwt.JWTClaimsRegistry(
            now=int(now.timestamp()), leeway=LEEWAY,
            iss={"essential": True, "value": issuer},
            aud={"essential": True, "value": client_id},
            sub={"essential": True},
            exp={"essential": True},
            iat={"essential": True},
            nonce={"essential": True, "value": nonce},
        )
        registry.validate(token.claims)
    except JoseError as exc:
        raise SsoError("id_token_invalid", "The identity provider's ID token failed "
                       f"verification ({exc.error}: {exc.description or exc}). Nobody was "
                       "signed in; start again, and if it repeats, check the provider's "
                       "client settings and this box's clock.") from None
    except ValueError:  # not a JWT at all
        raise SsoError("id_token_invalid", "The identity provider's ID token is not a "
                       "readable JWT. Nobody was signed in.") from None
    claims = dict(token.claims)
    audience = claims["aud"]
    # OIDC Core 3.1.3.7: several audiences need an authorized party, and it must be us.
    if isinstance(audience, list) and len(audience) > 1 and claims.get("azp") != client_id:
        raise SsoError("id_token_invalid", "The ID token is meant for several clients and does "
                       "not name this console as its authorized party. Nobody was signed in.")
    if len(str(claims["sub"])) > SUBJECT_MAX:
        raise SsoError("id_token_invalid", "The ID token's subject is too long.")
    return claims


def groups_of(claims: Mapping[str, Any], claim: str) -> tuple[str, ...]:
    value = claims.get(claim, ())
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list | tuple):
        return ()
    return tuple(str(group) for group in value)


def role_for(groups: tuple[str, ...], role_map: Mapping[str, str]) -> str | None:
    """The highest role any of the groups maps to; None when none is mapped."""
    found = [role_map[g] for g in groups if g in role_map]
    return max(found, key=ROLES.index) if found else None


def identity(claims: Mapping[str, Any], config: OidcConfig) -> Identity:
    groups = groups_of(claims, config.groups_claim)
    name = str(claims.get("preferred_username") or claims.get("email") or claims["sub"])
    return Identity(issuer=str(claims["iss"]), subject=str(claims["sub"]), name=name,
                    groups=groups, role=role_for(groups, config.role_map))


def _username(who: Identity) -> str:
    """A readable, unique-looking name that no local account can have (it contains '@')."""
    name = who.name.strip().lower()
    if "@" not in name:
        name = f"{name}@{urlsplit(who.issuer).hostname or 'sso'}"
    return name[:64]


def _shadow(session: Session, who: Identity) -> AdminUser | None:
    return session.scalar(select(AdminUser).where(
        AdminUser.external_issuer == who.issuer, AdminUser.external_subject == who.subject))


def upsert_shadow(session: Session, who: Identity, now: dt.datetime) -> tuple[Admin, str | None]:
    """Create or update the shadow account of a verified user with a mapped role; returns
    (the account, its role before: None for a new one, `NO_ROLE` for one refused last time).
    Its tokens act with the new role at most from now on (auth/tokens.py)."""
    assert who.role is not None
    user = _shadow(session, who)
    before = user.role if user is not None else None
    wanted = _username(who)
    taken = session.scalar(select(AdminUser.id).where(AdminUser.username == wanted))
    if taken is not None and (user is None or taken != user.id):
        # Another shadow has that name (an e-mail address moved to another person): keep
        # both apart with a tag derived from the subject.
        tag = hashlib.sha256(who.subject.encode()).hexdigest()[:8]
        wanted = f"{wanted[:55]}~{tag}"
    if user is None:
        user = AdminUser(username=wanted, password_hash=UNUSABLE_HASH, must_change_password=False,
                         created_at=now, password_changed_at=now, role=who.role, source=SOURCE,
                         external_issuer=who.issuer, external_subject=who.subject)
        session.add(user)
    else:
        user.username, user.role = wanted, who.role
    session.flush()
    admin = get_admin(session, user.id)
    assert admin is not None
    return admin, before


def refuse_shadow(session: Session, who: Identity) -> tuple[str | None, int]:
    """A user who lost every mapped group keeps nothing from before: their shadow account's
    role becomes `NO_ROLE` (no access), so every API token it minted acts for no one, and its
    sessions end. Returns (its role before, None without an account; sessions ended). This
    holds even for the box's last admin: the break-glass way back is `appliance admin` as
    root."""
    user = _shadow(session, who)
    if user is None:
        return None, 0
    before, user.role = user.role, NO_ROLE
    ended = session.query(AdminSession).filter(AdminSession.user_id == user.id).delete()
    return before, ended


def refusal_text(who: Identity, config: OidcConfig) -> str:
    mapped = ", ".join(sorted(config.role_map)) or "none configured"
    return (f"{config.display_name} signed you in as {who.name}, but none of your groups has a "
            f"role on this appliance. Ask your identity administrator to add you to one of "
            f"these groups: {mapped}.")
