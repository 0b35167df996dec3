"""Gateway API keys through the admin API, `/api/v1/keys`: the credentials of the box's users.

`GET /` lists the keys (newest first), `POST /` creates one and answers 201 with the key itself
under `"key"` — the only time it is ever shown — beside its record; `GET /{prefix}` reads one,
`PATCH /{prefix}` edits its limits (`{"limits": {...}}`: a limit left out is kept, `null`
clears it) and its service class (`{"service_class": "batch"}`, one the configuration
defines) and `POST /{prefix}/revoke` revokes it (idempotent). Records never carry the key,
only its 8-character prefix.

The audited actions are here as functions over one database session, shared with the console
(`appliance.ui.keys`) and the CLI (`appliance.gateway.keys_cli`): each writes its change and
its audit entry (`keys.create`, `keys.revoke`, `keys.limits`; `via` names the door) in one
transaction, so the three doors record the same thing. The key itself is never audited.
Refused input (a bad name, a past expiry, a limit below 1, an unknown prefix) changes nothing
and answers 4xx with the cause and the next step.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import msgspec
from litestar import Request, Router, get, patch, post
from litestar.datastructures import CacheControlHeader
from litestar.params import FromPath, JSONBody
from msgspec import UNSET, UnsetType
from sqlalchemy.orm import Session

from appliance.auth.accounts import Admin
from appliance.auth.guards import password_current
from appliance.auth.middleware import AuthInfo, client_address
from appliance.db.journal import add_audit
from appliance.errors import ApplianceError
from appliance.gateway.classes import INTERACTIVE, effective
from appliance.gateway.keys import (
    KeyInfo,
    KeyLimits,
    check_class,
    create_key,
    get_key,
    list_keys,
    revoke_key,
    update_class,
    update_limits,
)
from appliance.runtime import Runtime, runtime_of

AdminRequest = Request[Admin, AuthInfo, Any]
LIMIT_FIELDS = tuple(f.name for f in dataclasses.fields(KeyLimits))
MAX_DAYS = 36525  # a hundred years: past that, "never" is what is meant
_DAYS = re.compile(r"([0-9]{1,9})\s*d(?:ays?)?")
_DATE = re.compile(r"\d{4}-\d{2}-\d{2}")


# --- what the API answers ---------------------------------------------------------------------


@dataclass(frozen=True)
class KeyView:
    """A key as the API, the console and `appliance keys list --json` show it (never the key
    itself). `status` is "active", "expired" or "revoked" at the time of the answer."""

    id: int
    name: str
    owner: str
    prefix: str
    status: str
    created_at: dt.datetime
    created_by: str
    last_used_at: dt.datetime | None
    expires_at: dt.datetime | None
    revoked_at: dt.datetime | None
    revoked_by: str
    limits: KeyLimits
    service_class: str

    @classmethod
    def of(cls, info: KeyInfo, now: dt.datetime) -> KeyView:
        return cls(info.id, info.name, info.owner, info.prefix, info.status(now),
                   info.created_at, info.created_by, info.last_used_at, info.expires_at,
                   info.revoked_at, info.revoked_by, info.limits, info.service_class)


@dataclass(frozen=True)
class KeyCreated(KeyView):
    """The new key's record and, under `key`, the key itself: shown this once, never again."""

    key: str


def created_view(key: str, info: KeyInfo, now: dt.datetime) -> KeyCreated:
    view = KeyView.of(info, now)
    return KeyCreated(**{f.name: getattr(view, f.name) for f in dataclasses.fields(view)},
                      key=key)


# --- what the API takes (unknown fields are refused, so a misspelt limit is never ignored) ---


class LimitsBody(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Per-key limits; null (or left out) means none of that kind."""

    max_concurrency: int | None = None
    requests_per_minute: int | None = None
    tokens_per_day: int | None = None
    max_tokens: int | None = None

    def limits(self) -> KeyLimits:
        return KeyLimits(self.max_concurrency, self.requests_per_minute, self.tokens_per_day,
                         self.max_tokens)


class KeyCreateBody(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A new key. `expires_at`: an ISO 8601 date (that day, 00:00 UTC) or time (no zone: UTC);
    or `expires_in_days`; neither: the key does not expire."""

    name: str
    owner: str = ""
    expires_at: str | None = None
    expires_in_days: int | None = None
    limits: LimitsBody = msgspec.field(default_factory=LimitsBody)
    service_class: str = INTERACTIVE


class LimitsEditBody(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The limits to change: a limit left out is kept, null clears it."""

    max_concurrency: int | UnsetType | None = UNSET
    requests_per_minute: int | UnsetType | None = UNSET
    tokens_per_day: int | UnsetType | None = UNSET
    max_tokens: int | UnsetType | None = UNSET

    def changes(self) -> dict[str, int | None]:
        return {name: value for name in LIMIT_FIELDS
                if not isinstance(value := getattr(self, name), UnsetType)}


class KeyEditBody(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    limits: LimitsEditBody = msgspec.field(default_factory=LimitsEditBody)
    service_class: str | UnsetType = UNSET


# --- expiry, as the three doors take it -------------------------------------------------------


def _expiry_invalid(text: str, accepted: str) -> ApplianceError:
    return ApplianceError("key_expiry_invalid", f"the expiry {text!r} is not {accepted}",
                          "give a date such as 2027-01-31 (00:00 UTC that day), a time such "
                          "as 2027-01-31T18:00:00Z, or a number of days such as 30d",
                          status=422)


def parse_when(text: str) -> dt.datetime:
    """An ISO 8601 date (00:00 UTC that day) or time (no zone: UTC), in UTC."""
    text = text.strip()
    try:
        if _DATE.fullmatch(text):
            return dt.datetime.combine(dt.date.fromisoformat(text), dt.time(), dt.UTC)
        at = dt.datetime.fromisoformat(text)
        return at.replace(tzinfo=dt.UTC) if at.tzinfo is None else at.astimezone(dt.UTC)
    except (ValueError, OverflowError):
        raise _expiry_invalid(text, "an ISO 8601 date or time") from None


def in_days(days: int, now: dt.datetime) -> dt.datetime:
    if isinstance(days, bool) or not 1 <= days <= MAX_DAYS:
        raise ApplianceError("key_expiry_invalid", f"an expiry in {days} days is not allowed",
                             f"give 1 to {MAX_DAYS} days, or none for a key that does not "
                             "expire", status=422)
    return now + dt.timedelta(days=days)


def parse_expiry(text: str, now: dt.datetime) -> dt.datetime | None:
    """What the console and the CLI take: empty or "never" (no expiry), `30d` (days from
    now), or an ISO 8601 date or time."""
    text = text.strip()
    if text.lower() in ("", "never", "none"):
        return None
    if match := _DAYS.fullmatch(text.lower()):
        return in_days(int(match.group(1)), now)
    if not _DATE.match(text):
        raise _expiry_invalid(text, "a date, a time or a number of days")
    return parse_when(text)


def body_expiry(body: KeyCreateBody, now: dt.datetime) -> dt.datetime | None:
    if body.expires_at is not None and body.expires_in_days is not None:
        raise ApplianceError("key_expiry_ambiguous", "both expires_at and expires_in_days "
                             "were given", "give one of them (or neither: no expiry)",
                             status=422)
    if body.expires_in_days is not None:
        return in_days(body.expires_in_days, now)
    return parse_when(body.expires_at) if body.expires_at is not None else None


# --- the audited actions (one transaction each; shared with the console and the CLI) ---------


def _limits_detail(limits: KeyLimits) -> dict[str, int | None]:
    return dataclasses.asdict(limits)


def create_audited(s: Session, secret: bytes, *, name: str, owner: str,
                   expires_at: dt.datetime | None, limits: KeyLimits, now: dt.datetime,
                   actor: str, address: str, via: str, service_class: str = INTERACTIVE,
                   classes: Iterable[str] = (INTERACTIVE,)) -> tuple[str, KeyInfo]:
    """Create a key (audited `keys.create`); returns (the key, shown once; its record).
    `classes`: the service classes the configuration defines."""
    check_class(service_class, classes)
    key, info = create_key(s, secret, name=name, owner=owner, by=actor, now=now,
                           expires_at=expires_at, limits=limits, service_class=service_class)
    add_audit(s, at=now, actor=actor, address=address, action="keys.create",
              target=info.prefix, detail={
                  "via": via, "name": info.name, "owner": info.owner,
                  "expires_at": expires_at.isoformat() if expires_at else None,
                  "limits": _limits_detail(info.limits), "service_class": service_class})
    return key, info


def class_audited(s: Session, prefix: str, service_class: str, classes: Iterable[str], *,
                  now: dt.datetime, actor: str, address: str, via: str) -> KeyInfo:
    """Move a key to another service class (audited `keys.class`, with the one before)."""
    check_class(service_class, classes)
    before = get_key(s, prefix).service_class
    info = update_class(s, prefix, service_class, now=now)
    add_audit(s, at=now, actor=actor, address=address, action="keys.class", target=prefix,
              detail={"via": via, "name": info.name, "before": before,
                      "service_class": service_class})
    return info


def class_names(runtime: Runtime) -> list[str]:
    """The service classes this box's configuration defines."""
    return list(effective(runtime.config.gateway.classes))


def revoke_audited(s: Session, prefix: str, *, now: dt.datetime, actor: str, address: str,
                   via: str) -> KeyInfo:
    """Revoke a key (audited `keys.revoke`; a repeat is audited too, and says so)."""
    already = get_key(s, prefix).revoked_at is not None
    info = revoke_key(s, prefix, by=actor, now=now)
    add_audit(s, at=now, actor=actor, address=address, action="keys.revoke", target=prefix,
              detail={"via": via, "name": info.name,
                      **({"already_revoked": True} if already else {})})
    return info


def limits_audited(s: Session, prefix: str, changes: dict[str, int | None], *,
                   now: dt.datetime, actor: str, address: str, via: str) -> KeyInfo:
    """Change some of a key's limits, keeping the others (audited `keys.limits`, with the
    limits before and after)."""
    before = get_key(s, prefix).limits
    info = update_limits(s, prefix, dataclasses.replace(before, **changes), now=now)
    add_audit(s, at=now, actor=actor, address=address, action="keys.limits", target=prefix,
              detail={"via": via, "name": info.name, "before": _limits_detail(before),
                      "limits": _limits_detail(info.limits)})
    return info


async def issue_key(runtime: Runtime, *, name: str, owner: str, expires_at: dt.datetime | None,
                    limits: KeyLimits, actor: str, address: str,
                    via: str, service_class: str = INTERACTIVE) -> tuple[str, KeyInfo]:
    now = runtime.clock.now()
    return await runtime.db.run(lambda s: create_audited(
        s, runtime.secret, name=name, owner=owner, expires_at=expires_at, limits=limits,
        now=now, actor=actor, address=address, via=via, service_class=service_class,
        classes=class_names(runtime)))


async def change_class(runtime: Runtime, prefix: str, service_class: str, *, actor: str,
                       address: str, via: str) -> KeyInfo:
    now = runtime.clock.now()
    return await runtime.db.run(lambda s: class_audited(
        s, prefix, service_class, class_names(runtime), now=now, actor=actor,
        address=address, via=via))


async def withdraw_key(runtime: Runtime, prefix: str, *, actor: str, address: str,
                       via: str) -> KeyInfo:
    now = runtime.clock.now()
    return await runtime.db.run(lambda s: revoke_audited(
        s, prefix, now=now, actor=actor, address=address, via=via))


async def change_limits(runtime: Runtime, prefix: str, changes: dict[str, int | None], *,
                        actor: str, address: str, via: str) -> KeyInfo:
    now = runtime.clock.now()
    return await runtime.db.run(lambda s: limits_audited(
        s, prefix, changes, now=now, actor=actor, address=address, via=via))


async def key_views(runtime: Runtime) -> list[KeyView]:
    now = runtime.clock.now()
    return [KeyView.of(info, now) for info in await runtime.db.run(list_keys)]


# --- routes -----------------------------------------------------------------------------------


def _via(request: AdminRequest) -> str:
    return f"api:{request.auth.kind}"


@get("/", summary="Gateway API keys, newest first (never the key itself)")
async def keys_list(request: AdminRequest) -> list[KeyView]:
    return await key_views(runtime_of(request))


@post("/", status_code=201, cache_control=CacheControlHeader(no_store=True),
      summary="Create a gateway API key; the key is in this answer only, never again")
async def keys_create(request: AdminRequest, data: JSONBody[KeyCreateBody]) -> KeyCreated:
    runtime = runtime_of(request)
    now = runtime.clock.now()
    key, info = await issue_key(
        runtime, name=data.name, owner=data.owner, expires_at=body_expiry(data, now),
        limits=data.limits.limits(), actor=request.user.username,
        address=client_address(request), via=_via(request), service_class=data.service_class)
    return created_view(key, info, now)


@get("/{prefix:str}", summary="One gateway API key, by its prefix")
async def keys_get(request: AdminRequest, prefix: FromPath[str]) -> KeyView:
    runtime = runtime_of(request)
    info = await runtime.db.run(lambda s: get_key(s, prefix))
    return KeyView.of(info, runtime.clock.now())


@patch("/{prefix:str}", summary="Edit a key's limits (a limit left out is kept, null clears "
       "it) and its service class")
async def keys_edit(request: AdminRequest, prefix: FromPath[str],
                    data: JSONBody[KeyEditBody]) -> KeyView:
    runtime = runtime_of(request)
    who = {"actor": request.user.username, "address": client_address(request),
           "via": _via(request)}
    service_class = None if isinstance(data.service_class, UnsetType) else data.service_class
    if service_class is not None:  # checked first: a class the box lacks changes nothing
        check_class(service_class, class_names(runtime))
    changes = data.limits.changes()
    if service_class is not None and not changes:
        info = await change_class(runtime, prefix, service_class, **who)
    else:
        info = await change_limits(runtime, prefix, changes, **who)
        if service_class is not None:
            info = await change_class(runtime, prefix, service_class, **who)
    return KeyView.of(info, runtime.clock.now())


@post("/{prefix:str}/revoke", status_code=200,
      summary="Revoke a key (idempotent); the gateway refuses it within about a second")
async def keys_revoke(request: AdminRequest, prefix: FromPath[str]) -> KeyView:
    runtime = runtime_of(request)
    info = await withdraw_key(runtime, prefix, actor=request.user.username,
                              address=client_address(request), via=_via(request))
    return KeyView.of(info, runtime.clock.now())


def keys_router() -> Router:
    return Router(path="/api/v1/keys", guards=[password_current], tags=["keys"],
                  route_handlers=[keys_list, keys_create, keys_get, keys_edit, keys_revoke])
