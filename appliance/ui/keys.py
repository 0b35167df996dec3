"""The API keys page: the gateway keys of the box's users, with their status, last use, expiry
and limits and service class; creating a key (shown once), editing its limits and class
inline, revoking it.

The create form sits outside the key table, so what is typed survives a refusal; creating
answers with the outcome next to the form (the new key in a read-only field, selected for
copying, with the warning that it is not shown again) and, out of band, the fresh table.
Editing limits swaps one row for a form and back (a refusal keeps the form, with what was
typed and why). Revoking asks first (hx-confirm) and answers with the table. Without htmx the
forms post normally: creating (and any refusal) answers with the whole page, revoking and
saving limits redirect to it. Every change is audited like the API's
(`keys.*`, `via: console`), through the same functions (`appliance.api.keys`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from typing import Any

from litestar import get, post
from litestar.params import FromPath, URLEncodedBody
from litestar.response import Redirect, Template

from appliance.api.keys import (
    KeyView,
    change_class,
    change_limits,
    class_names,
    issue_key,
    key_views,
    parse_expiry,
    withdraw_key,
)
from appliance.auth.middleware import client_address
from appliance.errors import ApplianceError
from appliance.gateway.classes import INTERACTIVE, effective
from appliance.gateway.keys import LIMIT_MAX, KeyLimits, check_class, get_key
from appliance.runtime import runtime_of
from appliance.ui.login import AdminRequest
from appliance.ui.pages import GUARDED

# The limits as the forms and the table name them: (field, label, unit shown in the table).
LIMITS = (("max_concurrency", "Concurrent requests", "concurrent"),
          ("requests_per_minute", "Requests per minute", "requests/min"),
          ("tokens_per_day", "Tokens per day", "tokens/day"),
          ("max_tokens", "Max tokens per request", "max_tokens"))
NO_STORE = {"Cache-Control": "no-store"}  # an answer may carry a new key
_WHOLE = re.compile(r"-?[0-9]{1,20}")  # longer is out of range anyway


@dataclass
class LimitsForm:
    max_concurrency: str = ""
    requests_per_minute: str = ""
    tokens_per_day: str = ""
    max_tokens: str = ""
    service_class: str = INTERACTIVE

    @classmethod
    def of(cls, limits: KeyLimits, service_class: str = INTERACTIVE) -> LimitsForm:
        typed = ["" if getattr(limits, name) is None else str(getattr(limits, name))
                 for name, _, _ in LIMITS]
        form = cls(*typed)
        form.service_class = service_class
        return form

    def limits(self) -> KeyLimits:
        """The limits typed: empty is no limit; anything but a whole number is refused,
        naming the field (the store refuses those below 1)."""
        values: dict[str, int | None] = {}
        for name, label, _ in LIMITS:
            typed = getattr(self, name).strip()
            text = typed.replace(",", "").replace("_", "")
            if not text:
                values[name] = None
                continue
            if not _WHOLE.fullmatch(text) or not 1 <= int(text) <= LIMIT_MAX[name]:
                raise ApplianceError(
                    "key_limits_invalid", f"{label}: {typed!r} is not a whole number from 1 "
                    f"to {LIMIT_MAX[name]:,}", "give a whole number of at least 1, or leave "
                    "it empty for no limit", status=422)
            values[name] = int(text)
        return KeyLimits(**values)


@dataclass
class KeyForm(LimitsForm):
    name: str = ""
    owner: str = ""
    expires: str = ""


@dataclass(frozen=True)
class Outcome:
    """What creating answered: the key (shown this once), or why not."""

    key: str = ""
    view: KeyView | None = None
    error: str = ""
    hint: str = ""
    status: int = 200


def limit_texts(limits: KeyLimits) -> list[str]:
    """The limits a key has, as short phrases for the table ("60 requests/min")."""
    return [f"{value:,} {unit}" if name != "max_tokens" else f"{unit} {value:,}"
            for name, _, unit in LIMITS if (value := getattr(limits, name)) is not None]


def _htmx(request: AdminRequest) -> bool:
    return bool(request.headers.get("hx-request"))


def _context(request: AdminRequest, keys: list[KeyView], **extra: Any) -> dict[str, Any]:
    runtime = runtime_of(request)
    classes = effective(runtime.config.gateway.classes)
    return {"keys": keys, "limit_texts": limit_texts, "limit_fields": LIMITS,
            "classes": [(name, c.words()) for name, c in classes.items()],
            "gateway_port": runtime.config.gateway.port, "nav": "keys", "editing": "",
            "edit_form": None, "edit_error": None, "form": KeyForm(), "r": None,
            "oob": False, **extra}


async def _page(request: AdminRequest, status_code: int = 200, **extra: Any) -> Template:
    keys = await key_views(runtime_of(request))
    return Template("pages/keys.html", status_code=status_code, headers=NO_STORE,
                    context=_context(request, keys, **extra))


async def _table(request: AdminRequest, status_code: int = 200) -> Template:
    keys = await key_views(runtime_of(request))
    return Template("partials/keys_table.html", status_code=status_code,
                    context=_context(request, keys))


@get("/keys", **GUARDED)
async def keys_page(request: AdminRequest) -> Template:
    return await _page(request)


@post("/keys", **GUARDED)
async def keys_create_ui(request: AdminRequest, data: URLEncodedBody[KeyForm]) -> Template:
    runtime = runtime_of(request)
    now = runtime.clock.now()
    try:
        key, info = await issue_key(
            runtime, name=data.name.strip(), owner=data.owner.strip(),
            expires_at=parse_expiry(data.expires, now), limits=data.limits(),
            actor=request.user.username, address=client_address(request), via="console",
            service_class=data.service_class)
        outcome = Outcome(key=key, view=KeyView.of(info, now))
    except ApplianceError as exc:
        outcome = Outcome(error=exc.message, hint=exc.hint, status=exc.status)
    # After a success the form starts empty again; after a refusal it keeps what was typed.
    form = KeyForm() if outcome.key else data
    if not _htmx(request):
        return await _page(request, status_code=outcome.status, r=outcome, form=form)
    keys = await key_views(runtime)
    return Template("partials/keys_created.html", status_code=outcome.status,
                    headers=NO_STORE,
                    context=_context(request, keys, r=outcome, oob=True))


@post("/keys/{prefix:str}/revoke", **GUARDED)
async def keys_revoke_ui(request: AdminRequest,
                         prefix: FromPath[str]) -> Template | Redirect:
    await withdraw_key(runtime_of(request), prefix, actor=request.user.username,
                       address=client_address(request), via="console")
    return await _table(request) if _htmx(request) else Redirect("/keys", status_code=303)


async def _row(request: AdminRequest, prefix: str) -> KeyView:
    runtime = runtime_of(request)
    info = await runtime.db.run(lambda s: get_key(s, prefix))
    return KeyView.of(info, runtime.clock.now())


@get("/keys/{prefix:str}/row", **GUARDED)
async def keys_row_ui(request: AdminRequest, prefix: FromPath[str]) -> Template:
    """One row of the table, as shown (what Cancel in the limits editor swaps back)."""
    if not _htmx(request):
        return await _page(request)
    return Template("partials/keys_row.html",
                    context=_context(request, [], k=await _row(request, prefix)))


@get("/keys/{prefix:str}/limits", **GUARDED)
async def keys_limits_form(request: AdminRequest, prefix: FromPath[str]) -> Template:
    """The row of one key as a form to edit its limits."""
    key = await _row(request, prefix)
    form = LimitsForm.of(key.limits, key.service_class)
    if not _htmx(request):
        return await _page(request, editing=prefix, edit_form=form)
    return Template("partials/keys_row_edit.html",
                    context=_context(request, [], k=key, edit_form=form))


@post("/keys/{prefix:str}/limits", **GUARDED)
async def keys_limits_ui(request: AdminRequest, prefix: FromPath[str],
                         data: URLEncodedBody[LimitsForm]) -> Template | Redirect:
    runtime = runtime_of(request)
    try:
        limits = data.limits()
        check_class(data.service_class, class_names(runtime))  # before anything changes
        changes = {f.name: getattr(limits, f.name) for f in fields(limits)}
        who = {"actor": request.user.username, "address": client_address(request),
               "via": "console"}
        info = await change_limits(runtime, prefix, changes, **who)
        if info.service_class != data.service_class:
            await change_class(runtime, prefix, data.service_class, **who)
    except ApplianceError as exc:
        if exc.status == 404:
            raise
        error = Outcome(error=exc.message, hint=exc.hint, status=exc.status)
        if not _htmx(request):
            return await _page(request, status_code=exc.status, editing=prefix,
                               edit_form=data, edit_error=error)
        return Template("partials/keys_row_edit.html", status_code=exc.status,
                        context=_context(request, [], k=await _row(request, prefix),
                                         edit_form=data, edit_error=error))
    if not _htmx(request):
        return Redirect("/keys", status_code=303)
    return Template("partials/keys_row.html",
                    context=_context(request, [], k=await _row(request, prefix), saved=True))
