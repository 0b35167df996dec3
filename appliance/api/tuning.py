"""Memory-ratio tuning through the admin API: the view per profile, profiles, apply, chart.

`GET /api/v1/tuning/?profile=NAME` answers what the Tuning page shows: the profile, the pool
budget (measured or estimated, and said which), the current ratio and what it gives, the
recommendation (ratio or `--max-mamba-cache-size` pin), the curve and the applied choice.
Custom profiles are created, replaced and deleted under `profiles/`; built-ins are read-only.

`POST apply` records the split and restarts the engine with it — now, or in a maintenance
window (`at`) — or only records it (`restart: false`; the next start uses it). The restart
follows the engine's rule: ending a live engine, or scheduling, needs `"confirm": true`, and
without it the answer is 409 with the cost of the restart. Every check runs before anything is
recorded, so a refused apply changes nothing. Every change is audited (`tuning.*`, and the
engine's own `engine.restart` or `engine.schedule`).

The helpers the console shares (the chart of a view, the restart rule, apply, the preview of an
unsaved profile, what one split gives, the observed workload as a profile) live here too, so
both doors answer the same way.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, replace
from typing import Any

from litestar import Request, Response, Router, delete, get, post, put
from litestar.params import FromPath, FromQuery, JSONBody

from appliance.auditing import audit
from appliance.auth.accounts import Admin
from appliance.auth.guards import password_current
from appliance.auth.middleware import AuthInfo, client_address
from appliance.engine.actions import cost_sentence, run_action
from appliance.engine.states import LIVE, Command, refusal
from appliance.errors import ApplianceError
from appliance.runtime import Runtime, runtime_of
from appliance.tuning.calculator import CalculatorError, size_pools
from appliance.tuning.chart import render_chart
from appliance.tuning.profiles import LengthDistribution, Profile, make_profile
from appliance.tuning.recommend import Capacity, capacity
from appliance.tuning.service import TuningView
from appliance.tuning.store import Choice

AdminRequest = Request[Admin, AuthInfo, Any]
SVG_HEADERS = {"Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'",
               "X-Content-Type-Options": "nosniff", "Cache-Control": "no-store"}


@dataclass(frozen=True)
class LengthsBody:
    """Tokens per live request: `[[50, 16384], [90, 98304], [100, 262144]]` (percentile,
    tokens), ending at 100; `minimum` is the shortest request (default 1)."""

    percentiles: list[list[float]]
    minimum: int | None = None

    def distribution(self) -> LengthDistribution:
        return LengthDistribution.of(self.percentiles, self.minimum)


@dataclass(frozen=True)
class ProfileBody:
    name: str
    title: str
    lengths: LengthsBody
    target_concurrency: int
    description: str = ""


@dataclass(frozen=True)
class ProfileEditBody:
    """A whole custom profile but its name (the name is its identity)."""

    title: str
    lengths: LengthsBody
    target_concurrency: int
    description: str = ""


@dataclass(frozen=True)
class ApplyBody:
    profile: str
    ratio: float | None = None     # default: the profile's recommended ratio
    pin: int | None = None         # --max-mamba-cache-size (state slots); the ratio then idles
    restart: bool = True           # false: only record it; the next start uses it
    confirm: bool = False          # needed to end a live engine, and to schedule
    at: dt.datetime | None = None  # restart in a maintenance window instead of now


# --- shared with the console ------------------------------------------------------------------


def chart_for(view: TuningView) -> str:
    """The view's chart (`appliance.tuning.chart`), the same for the API and the page."""
    rec = view.recommendation
    return render_chart(
        view.curve, current=view.current_ratio, recommended=rec.ratio,
        balanced=rec.balanced_ratio, target=view.profile.target_concurrency,
        current_concurrent=view.current.concurrent,
        recommended_concurrent=rec.recommended.concurrent,
        title=f"Concurrent requests of the {view.profile.title} profile against "
              "--mamba-full-memory-ratio")


def check_restart(runtime: Runtime, *, confirm: bool, at: dt.datetime | None) -> None:
    """The engine's rule for a restart, checked before anything is recorded: a window must be
    a future time with a zone; a restart now must be possible in the engine's state; ending a
    live engine or scheduling needs `confirm`."""
    state = runtime.supervisor.status.state
    if at is not None:
        if at.tzinfo is None:
            raise ApplianceError("schedule_naive_time", "the window's time has no time zone",
                                 "give an ISO time with a zone, e.g. 2026-12-01T02:00:00Z",
                                 status=422)
        if at <= runtime.clock.now():
            raise ApplianceError("schedule_in_past", f"{at.isoformat()} is not in the future",
                                 "pick a later time, or restart now", status=422)
    elif (why := refusal(state, Command.RESTART)) is not None:
        raise ApplianceError("engine_command_refused", f"cannot restart the engine: {why}",
                             "apply it without a restart (the next start uses it), or in a "
                             "maintenance window", status=409)
    if not confirm and (state in LIVE or at is not None):
        raise ApplianceError(
            "confirmation_required",
            f"applying restarts the engine, which ends the running one; {cost_sentence(runtime)}",
            "repeat with confirm=true (the console asks for you)", status=409)


@dataclass(frozen=True)
class Applied:
    choice: Choice
    restart: str                    # "queued", "scheduled" or "not requested"
    engine: dict[str, Any] | None   # the engine's status (and the scheduled action)

    def to_dict(self) -> dict[str, Any]:
        return {"choice": self.choice.to_dict(), "restart": self.restart,
                "engine": self.engine}


async def apply_split(runtime: Runtime, *, profile: str, ratio: float, pin: int | None,
                      restart: bool, confirm: bool, at: dt.datetime | None, actor: str,
                      address: str, via: str) -> Applied:
    """Check the restart, record the split (audited `tuning.apply`), then restart or schedule
    through the engine's own action (audited there)."""
    if restart:
        check_restart(runtime, confirm=confirm, at=at)
    await capacity_at(runtime, await runtime.tuning.view(profile), ratio, pin)
    choice = await runtime.tuning.apply(profile=profile, ratio=ratio, pin=pin, actor=actor)
    when = ("not requested" if not restart else "scheduled" if at is not None else "queued")
    await audit(runtime, actor=actor, address=address, action="tuning.apply", target=profile,
                detail={"via": via, "ratio": ratio, "pin": pin, "restart": when,
                        **({"at": at.isoformat()} if at is not None and restart else {})})
    engine = None
    if restart:
        engine = await run_action(runtime, Command.RESTART, True, actor, address, via, at)
    return Applied(choice, when, engine)


async def audit_profile(runtime: Runtime, *, actor: str, address: str, action: str,
                        name: str, via: str, profile: Profile | None = None,
                        refused: str = "") -> None:
    detail: dict[str, Any] = {"via": via}
    if profile is not None:
        detail.update(title=profile.title, lengths=profile.lengths.describe(),
                      target_concurrency=profile.target_concurrency)
    if refused:
        detail["refused"] = refused
    await audit(runtime, actor=actor, address=address, action=f"tuning.profile.{action}",
                target=name, outcome="denied" if refused else "ok", detail=detail)


async def preview_view(runtime: Runtime, draft: Profile) -> TuningView:
    """The view of an unsaved profile: this box's facts, the draft's lengths and target."""
    return await runtime.tuning.view(draft)


async def capacity_at(runtime: Runtime, view: TuningView, ratio: float,
                      pin: int | None) -> Capacity:
    """What `ratio` (or the pin) gives the view's profile; refused (422) when SGLang would
    refuse that split at this budget, so it is never applied."""
    geometry = await runtime.tuning.geometry()
    launch = replace(view.launch, max_mamba_cache_size=pin)
    try:
        sizing = size_pools(geometry, launch, view.budget.bytes, ratio)
    except CalculatorError as exc:
        split = f"--max-mamba-cache-size {pin}" if pin else f"ratio {ratio:g}"
        raise ApplianceError(
            "tuning_impossible", f"SGLang would refuse {split} at this budget "
            f"({view.budget.gib:.2f} GiB per GPU): {exc.message}",
            "choose another ratio (the chart shows the ratios that work)", status=422) from None
    return capacity(sizing, view.profile.lengths)


async def observed_profile(runtime: Runtime) -> Profile | None:
    """The observed workload as a profile (its lengths, its peak as the target), if any."""
    try:
        advice = (await runtime.tuning.view(None)).observed
    except ApplianceError:
        return None
    if advice is None:
        return None
    seen = advice.observed
    note = f"Observed on this box: {seen.source_note}"[:2000]
    return make_profile("observed", "Observed workload", note, seen.lengths,
                        max(1, seen.peak_concurrency))


# --- routes -----------------------------------------------------------------------------------


def _via(request: AdminRequest) -> str:
    return f"api:{request.auth.kind}"


@get("/", summary="The tuning view of one profile: budget, current and recommended split, "
     "curve, applied choice")
async def tuning_view(request: AdminRequest,
                      profile: FromQuery[str | None] = None) -> dict[str, Any]:
    view = await runtime_of(request).tuning.view(profile or None)
    return {**view.to_dict(), "chart": f"/api/v1/tuning/chart.svg?profile={view.profile.name}"}


@get("/chart.svg", summary="The chart of one profile (concurrent requests against ratio), SVG")
async def tuning_chart(request: AdminRequest,
                       profile: FromQuery[str | None] = None) -> Response[str]:
    view = await runtime_of(request).tuning.view(profile or None)
    return Response(chart_for(view), media_type="image/svg+xml", headers=SVG_HEADERS)


@get("/profiles", summary="Workload profiles: the built-ins, then the custom ones")
async def tuning_profiles(request: AdminRequest) -> list[dict[str, Any]]:
    return [p.to_dict() for p in await runtime_of(request).tuning.profiles()]


@post("/profiles", status_code=201, summary="Create a custom profile")
async def tuning_profile_create(request: AdminRequest,
                                data: JSONBody[ProfileBody]) -> dict[str, Any]:
    runtime = runtime_of(request)
    profile = await runtime.tuning.save_profile(
        name=data.name, title=data.title, description=data.description,
        lengths=data.lengths.distribution(), target_concurrency=data.target_concurrency,
        actor=request.user.username, create=True)
    await audit_profile(runtime, actor=request.user.username, address=client_address(request),
                        action="create", name=profile.name, via=_via(request), profile=profile)
    return profile.to_dict()


@put("/profiles/{name:str}", summary="Replace a custom profile (built-ins are read-only)")
async def tuning_profile_update(request: AdminRequest, name: FromPath[str],
                                data: JSONBody[ProfileEditBody]) -> dict[str, Any]:
    runtime = runtime_of(request)
    profile = await runtime.tuning.save_profile(
        name=name, title=data.title, description=data.description,
        lengths=data.lengths.distribution(), target_concurrency=data.target_concurrency,
        actor=request.user.username, create=False)
    await audit_profile(runtime, actor=request.user.username, address=client_address(request),
                        action="update", name=name, via=_via(request), profile=profile)
    return profile.to_dict()


@delete("/profiles/{name:str}", status_code=200, summary="Delete a custom profile (not the "
        "applied one)")
async def tuning_profile_delete(request: AdminRequest, name: FromPath[str]) -> dict[str, Any]:
    runtime = runtime_of(request)
    await runtime.tuning.delete_profile(name, actor=request.user.username)
    await audit_profile(runtime, actor=request.user.username, address=client_address(request),
                        action="delete", name=name, via=_via(request))
    return {"deleted": name}


@post("/apply", status_code=202, summary="Apply a split (ratio or pin) and restart the engine "
      "now, in a maintenance window, or at its next start")
async def tuning_apply(request: AdminRequest, data: JSONBody[ApplyBody]) -> dict[str, Any]:
    runtime = runtime_of(request)
    ratio = data.ratio
    if ratio is None:
        ratio = (await runtime.tuning.view(data.profile)).recommendation.ratio
    applied = await apply_split(
        runtime, profile=data.profile, ratio=ratio, pin=data.pin, restart=data.restart,
        confirm=data.confirm, at=data.at, actor=request.user.username,
        address=client_address(request), via=_via(request))
    return applied.to_dict()


def tuning_router() -> Router:
    return Router(path="/api/v1/tuning", guards=[password_current], tags=["tuning"],
                  route_handlers=[tuning_view, tuning_chart, tuning_profiles,
                                  tuning_profile_create, tuning_profile_update,
                                  tuning_profile_delete, tuning_apply])
