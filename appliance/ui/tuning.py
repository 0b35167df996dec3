"""The Tuning page: how K3's memory is split between recurrent state and KV, per workload.

For the profile picked (`?profile=`), the panel (`partials/tuning_panel.html`) shows the
length distribution and target, the pool budget (measured, or an estimate, said so), the
current ratio and what it gives, the recommendation and what it gives up, the balanced ratio,
the chart (server-rendered SVG, `appliance.tuning.chart`) and the applied choice. Picking a
profile swaps the panel (htmx) and pushes `/tuning?profile=NAME`. On a box of a cell the panel
says which role the split is sized for and why (a prefill box: the few requests it prefills at
once, with the `--max-running-requests` to start it with), and a prefill box's RAM plan (its
host cache against the weights' page cache, appliance.weights.ram_plan).

The profile editor sits outside the panel, so a swap never wipes what is typed; each change
re-renders the panel as a preview of the unsaved draft. Saving, editing and deleting answer
with the editor (inline errors naming the field) and, out of band, the picker and the panel.

Applying is two steps: the form answers with a confirmation that states what the split gives
and what the restart costs (now, in a maintenance window, or at the next start); confirming
records it and restarts or schedules the engine (`appliance.api.tuning.apply_split`). Every
change is audited with `via: console`, refusals as denied.
"""

from __future__ import annotations

import datetime as dt
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from litestar import delete, get, post, put
from litestar.params import FromPath, FromQuery, URLEncodedBody
from litestar.response import Template
from markupsafe import Markup

from appliance.api.tuning import (
    apply_split,
    audit_profile,
    capacity_at,
    chart_for,
    check_restart,
    observed_profile,
    preview_view,
)
from appliance.auditing import audit
from appliance.auth.middleware import client_address
from appliance.engine.schedule import list_scheduled
from appliance.engine.states import LIVE
from appliance.errors import ApplianceError
from appliance.gateway.qualified import after_new_spec
from appliance.qualify.compare import Measured, measured
from appliance.qualify.ledger import list_qualifications
from appliance.runtime import Runtime, runtime_of
from appliance.tuning.chart import ratio_text
from appliance.tuning.profiles import (
    BUILTIN_NAMES,
    K,
    LengthDistribution,
    M,
    Profile,
    ProfileError,
    format_tokens,
    make_profile,
)
from appliance.tuning.service import DEFAULT_PROFILE
from appliance.ui.login import AdminRequest
from appliance.ui.pages import GUARDED
from appliance.ui.weights import sentence

PERCENTILES = (25.0, 50.0, 75.0, 90.0, 99.0)  # the editor's rows, besides minimum and max
_TOKENS = re.compile(r"(\d+(?:\.\d+)?)\s*([kKmM]?)")
BINDING = {"state": "the state pool", "kv": "the KV cache"}


def tokens_text(tokens: int) -> str:
    """An exact, typeable token count: 49152 -> 48K, 1048576 -> 1M, 6000 -> 6000."""
    for unit, scale in (("M", M), ("K", K)):
        if tokens >= scale and tokens % scale == 0:
            return f"{tokens // scale}{unit}"
    return str(tokens)


def parse_tokens(text: str, field: str) -> int:
    """`48K` (binary, as context lengths are quoted), `1.5M`, `6000` or `6,000` -> tokens."""
    match = _TOKENS.fullmatch(text.replace(",", "").replace("_", "").strip())
    if not match:
        raise ProfileError(field, f"{text!r} is not a token count",
                           "give whole tokens, e.g. 6000, 48K or 1M (K = 1024)")
    scale = {"": 1, "k": K, "m": M}[match.group(2).lower()]
    value = float(match.group(1)) * scale
    if value != int(value):
        raise ProfileError(field, f"{text!r} is not a whole number of tokens", "round it")
    return int(value)


def label(p: float) -> str:
    return f"p{p:g}"


@dataclass(frozen=True)
class Draft:
    """The editor's fields as typed (strings), and the profile they make when valid."""

    fields: Mapping[str, str]
    editing: str = ""  # the name of the custom profile being edited ("" for a new one)

    @classmethod
    def of(cls, profile: Profile, *, editing: bool) -> Draft:
        fields = {"name": profile.name if editing else "",
                  "title": profile.title if editing else f"{profile.title} (copy)",
                  "description": profile.description,
                  "minimum": tokens_text(profile.lengths.minimum),
                  "target": str(profile.target_concurrency)}
        for p, tokens in profile.lengths.points:
            fields["max" if p == 100 else label(p)] = tokens_text(tokens)
        return cls(fields, profile.name if editing else "")

    def rows(self) -> list[tuple[str, str]]:
        """(field, heading) for the percentile rows: the fixed ones and any the profile has."""
        extra = {k for k in self.fields if re.fullmatch(r"p\d+(?:\.\d+)?", k)}
        keys = sorted({label(p) for p in PERCENTILES} | extra, key=lambda k: float(k[1:]))
        return [("minimum", "min"), *[(k, k) for k in keys], ("max", "max")]

    def get(self, key: str) -> str:
        return self.fields.get(key, "")

    def profile(self, *, preview: bool = False) -> Profile:
        points: list[tuple[float, int]] = []
        for key, _ in self.rows()[1:]:
            if text := self.get(key).strip():
                points.append((100.0 if key == "max" else float(key[1:]),
                               parse_tokens(text, key)))
        if not self.get("max").strip():
            raise ProfileError("max", "the longest request is missing",
                               "give the longest request in tokens, e.g. 256K")
        minimum = self.get("minimum").strip()
        lengths = LengthDistribution.of(
            points, parse_tokens(minimum, "minimum") if minimum else None)
        target = self.get("target").strip()
        if not target.isdigit():
            raise ProfileError("target", f"{target!r} is not a whole number",
                               "give the number of requests you expect at the same time")
        name = self.editing or self.get("name").strip()
        title = self.get("title")
        if preview:
            name = name if re.fullmatch(r"[a-z][a-z0-9-]{1,39}", name) else "draft"
            title = title.strip() or "Unsaved profile"
        return make_profile(name, title, self.get("description"), lengths, int(target))


def field_of(error: ProfileError) -> str:
    """The editor input an error is about: `lengths.p100` -> `max`, `target_concurrency` ->
    `target`, `lengths.p90` -> `p90`."""
    key = error.field.removeprefix("lengths.").split("[", 1)[0]
    return {"p100": "max", "target_concurrency": "target", "percentiles": "max"}.get(key, key)


# --- the panel ----------------------------------------------------------------------------------


def helpers(runtime: Runtime) -> dict[str, Any]:
    """What every tuning template uses besides its data: formatters and the engine's state."""
    state = runtime.supervisor.status.state
    return {"tokens": format_tokens, "r": ratio_text, "binding": BINDING, "cap": sentence,
            "cost": runtime.supervisor.start_cost(), "engine_live": state in LIVE,
            "engine_state": state.label,
            "admission_after": after_new_spec(runtime.config.gateway.max_concurrency),
            "now": runtime.clock.now().astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M")}


async def panel_context(runtime: Runtime, profile: str | None, *,
                        draft: Draft | None = None) -> dict[str, Any]:
    """The panel's context. A view that cannot be computed (no config.json yet, a budget
    that leaves nothing) is shown as a problem with what to do, never a 500."""
    context: dict[str, Any] = {
        **helpers(runtime), "v": None, "chart": "", "preview": draft is not None,
        "problem": None, "draft_error": None, "scheduled": [], "apply_result": None,
    }
    try:
        if draft is not None:
            try:
                view = await preview_view(runtime, draft.profile(preview=True))
            except ProfileError as exc:
                context["draft_error"] = exc
                view = await runtime.tuning.view(profile or None)
                context["preview"] = False
        else:
            view = await runtime.tuning.view(profile or None)
    except ApplianceError as exc:
        context["problem"] = exc
        return context
    actions = await runtime.db.run(list_scheduled)
    context["measured"] = await measured_capacity(runtime)
    context.update(v=view, chart=Markup(chart_for(view)),  # noqa: S704 - escaped by chart.py
                   scheduled=[a for a in actions
                              if a.command == "restart" and a.status == "pending"])
    return context


async def measured_capacity(runtime: Runtime) -> Measured:
    """The running spec's qualified point and the previous spec's (the ledger's newest)."""
    records = await runtime.db.run(list_qualifications)
    return measured(records, runtime.supervisor.running_spec_hash)


def _htmx(request: AdminRequest) -> bool:
    return bool(request.headers.get("hx-request"))


async def _page(request: AdminRequest, *, profile: str | None = None,
                draft: Draft | None = None, editor: dict[str, Any] | None = None,
                apply_result: dict[str, Any] | None = None, status_code: int = 200) -> Template:
    runtime = runtime_of(request)
    panel = await panel_context(runtime, profile)
    selected = panel["v"].profile.name if panel["v"] else (profile or DEFAULT_PROFILE)
    if draft is None:
        start = panel["v"].profile if panel["v"] else None
        draft = Draft.of(start, editing=False) if start else Draft({})
    return Template("pages/tuning.html", status_code=status_code, context={
        **panel, "nav": "tuning", "profiles": await runtime.tuning.profiles(), "selected": selected,
        "ed": {"notice": "", "error": None, "field": "", **(editor or {}), "d": draft},
        "apply_result": apply_result})


@get("/tuning", **GUARDED)
async def tuning_page(request: AdminRequest,
                      profile: FromQuery[str | None] = None) -> Template:
    return await _page(request, profile=profile or None)


@get("/tuning/panel", **GUARDED)
async def tuning_panel(request: AdminRequest) -> Template:
    """The panel of `?profile=`; with `preview=1`, of the editor's draft (its fields in the
    query). Picked from the select, the answer pushes `/tuning?profile=NAME`."""
    query = request.query_params
    draft = None
    if query.get("preview"):
        draft = Draft({k: str(v) for k, v in query.items()}, query.get("editing") or "")
    context = await panel_context(runtime_of(request), query.get("profile") or None,
                                  draft=draft)
    headers = {}
    if request.headers.get("hx-trigger-name") == "profile" and context["v"] is not None:
        headers["HX-Push-Url"] = f"/tuning?profile={context['v'].profile.name}"
    return Template("partials/tuning_panel.html", context=context, headers=headers)


@get("/tuning/editor", **GUARDED)
async def tuning_editor(request: AdminRequest, profile: FromQuery[str | None] = None,
                        mode: FromQuery[str] = "copy") -> Template:
    """The editor, filled from `profile`: to edit it (a custom one), or to start from it."""
    runtime = runtime_of(request)
    found = next((p for p in await runtime.tuning.profiles() if p.name == profile), None)
    if mode == "observed":  # a new profile from what the engine's log shows
        found = await observed_profile(runtime)
    editing = mode == "edit" and found is not None and found.name not in BUILTIN_NAMES
    draft = Draft.of(found, editing=editing) if found else Draft({})
    if mode == "observed" and found is not None:
        draft = Draft({**draft.fields, "name": "observed", "title": found.title})
    return Template("partials/tuning_editor.html", context={
        **helpers(runtime), "ed": {"d": draft, "notice": "", "error": None, "field": ""}})


# --- profile changes ----------------------------------------------------------------------------


async def _save(request: AdminRequest, *, editing: str) -> Template:
    runtime = runtime_of(request)
    form = await request.form()
    draft = Draft({k: str(v) for k, v in form.items()}, editing)
    action = "update" if editing else "create"
    actor, address = request.user.username, client_address(request)
    try:
        wanted = draft.profile()
        saved = await runtime.tuning.save_profile(
            name=wanted.name, title=wanted.title, description=wanted.description,
            lengths=wanted.lengths, target_concurrency=wanted.target_concurrency,
            actor=actor, create=not editing)
    except ApplianceError as exc:
        name = editing or draft.get("name").strip()
        await audit_profile(runtime, actor=actor, address=address, action=action,
                            name=name[:64], via="console", refused=exc.message)
        field = field_of(exc) if isinstance(exc, ProfileError) else ""
        return await _editor_answer(request, draft, status=exc.status, error=exc, field=field)
    await audit_profile(runtime, actor=actor, address=address, action=action, name=saved.name,
                        via="console", profile=saved)
    verb = "saved" if editing else "created"
    return await _editor_answer(request, Draft.of(saved, editing=True), profile=saved.name,
                                notice=f"Profile {saved.title} ({saved.name}) {verb}.")


async def _editor_answer(request: AdminRequest, draft: Draft | None, *, status: int = 200,
                         notice: str = "", error: ApplianceError | None = None,
                         field: str = "", profile: str | None = None) -> Template:
    """The editor with its outcome; on success the picker and the panel come out of band.
    `draft` None: a new profile, starting from the numbers of the profile shown."""
    editor = {"d": draft, "notice": notice, "error": error, "field": field}
    if not _htmx(request):
        return await _page(request, profile=profile, draft=draft, editor=editor,
                           status_code=status)
    runtime = runtime_of(request)
    context: dict[str, Any] = {**helpers(runtime), "ed": editor, "oob": error is None}
    if error is None:
        panel = await panel_context(runtime, profile)
        shown = panel["v"].profile if panel["v"] else None
        context.update(panel, profiles=await runtime.tuning.profiles(),
                       selected=shown.name if shown else "")
        if draft is None:
            editor["d"] = Draft.of(shown, editing=False) if shown else Draft({})
    return Template("partials/tuning_editor.html", context=context, status_code=status)


@post("/tuning/profiles", **GUARDED)
async def tuning_profile_create_ui(request: AdminRequest) -> Template:
    return await _save(request, editing="")


@put("/tuning/profiles/{name:str}", **GUARDED)
async def tuning_profile_update_ui(request: AdminRequest, name: FromPath[str]) -> Template:
    return await _save(request, editing=name)


@post("/tuning/profiles/{name:str}", **GUARDED)
async def tuning_profile_update_form(request: AdminRequest, name: FromPath[str]) -> Template:
    """The same as PUT, for a browser without htmx."""
    return await _save(request, editing=name)


async def _delete(request: AdminRequest, name: str) -> Template:
    runtime = runtime_of(request)
    actor, address = request.user.username, client_address(request)
    try:
        await runtime.tuning.delete_profile(name, actor=actor)
    except ApplianceError as exc:
        await audit_profile(runtime, actor=actor, address=address, action="delete",
                            name=name[:64], via="console", refused=exc.message)
        found = next((p for p in await runtime.tuning.profiles() if p.name == name), None)
        draft = Draft.of(found, editing=True) if found else Draft({})
        return await _editor_answer(request, draft, status=exc.status, error=exc)
    await audit_profile(runtime, actor=actor, address=address, action="delete", name=name,
                        via="console")
    return await _editor_answer(request, None, notice=f"Profile {name} deleted.")


@delete("/tuning/profiles/{name:str}", status_code=200, **GUARDED)
async def tuning_profile_delete_ui(request: AdminRequest, name: FromPath[str]) -> Template:
    return await _delete(request, name)


@post("/tuning/profiles/{name:str}/delete", **GUARDED)
async def tuning_profile_delete_form(request: AdminRequest, name: FromPath[str]) -> Template:
    """The same as DELETE, for a browser without htmx."""
    return await _delete(request, name)


# --- apply --------------------------------------------------------------------------------------


@dataclass
class ApplyForm:
    profile: str = ""
    ratio: str = ""
    pin: str = ""           # the recommended pin's slots when its box is ticked
    when: str = "now"       # now | window | none (record only: the next start uses it)
    at: str = ""            # <input type="datetime-local">, read as UTC
    confirm: str = ""       # "yes" on the confirmation's button


def _parse_apply(form: ApplyForm) -> tuple[float, int | None, dt.datetime | None]:
    try:
        ratio = float(form.ratio.strip())
    except ValueError:
        ratio = math.nan
    if not (math.isfinite(ratio) and ratio > 0):
        raise ApplianceError("tuning_bad_input", f"ratio {form.ratio!r} is not a positive "
                             "number", "give --mamba-full-memory-ratio, e.g. 0.9 or 3.7",
                             status=422)
    pin = int(form.pin) if form.pin.strip().isdigit() and int(form.pin) > 0 else None
    at = None
    if form.when == "window":
        try:
            at = dt.datetime.fromisoformat(form.at).replace(tzinfo=dt.UTC)
        except ValueError:
            raise ApplianceError("tuning_bad_input", "the maintenance window has no date and "
                                 "time", "choose a date and time (UTC), or restart now",
                                 status=422) from None
    return ratio, pin, at


@post("/tuning/apply", **GUARDED)
async def tuning_apply_ui(request: AdminRequest, data: URLEncodedBody[ApplyForm]) -> Template:
    """Without `confirm`: the confirmation (what the split gives, what the restart costs).
    With it: record, then restart or schedule; the answer is the fresh panel with the outcome
    in it (retargeted), so the applied choice shows at once."""
    runtime = runtime_of(request)
    actor, address = request.user.username, client_address(request)
    restart = data.when != "none"
    result: dict[str, Any] = {"f": data}
    try:
        ratio, pin, at = _parse_apply(data)
        result.update(ratio=ratio, pin=pin, at=at)
        if data.confirm != "yes":
            view = await runtime.tuning.view(data.profile)
            if restart:
                check_restart(runtime, confirm=True, at=at)
            gives = await capacity_at(runtime, view, ratio, pin)
            result.update(step="confirm", v=view, gives=gives)
            return await _apply_answer(request, data.profile, result)
        applied = await apply_split(runtime, profile=data.profile, ratio=ratio, pin=pin,
                                    restart=restart, confirm=True, at=at, actor=actor,
                                    address=address, via="console")
    except ApplianceError as exc:
        if data.confirm == "yes":
            await audit(runtime, actor=actor, address=address, action="tuning.apply",
                        target=data.profile[:64], outcome="denied",
                        detail={"via": "console", "ratio": data.ratio, "refused": exc.message})
        result.update(step="error", error=exc)
        return await _apply_answer(request, data.profile, result, status=exc.status)
    result.update(step="done", applied=applied)
    return await _apply_answer(request, data.profile, result)


async def _apply_answer(request: AdminRequest, profile: str, result: dict[str, Any],
                        status: int = 200) -> Template:
    if not _htmx(request):
        return await _page(request, profile=profile or None, apply_result=result,
                           status_code=status)
    runtime = runtime_of(request)
    if result["step"] == "done":
        context = await panel_context(runtime, profile)
        context.update(apply_result=result, oob_picker=True, selected=profile,
                       profiles=await runtime.tuning.profiles())
        return Template("partials/tuning_panel.html", context=context,
                        headers={"HX-Retarget": "#tuning-panel", "HX-Reswap": "innerHTML"})
    return Template("partials/tuning_apply_result.html", status_code=status,
                    context={**helpers(runtime), "ar": result})
