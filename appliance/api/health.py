"""Health through the admin API, `/api/v1/health`: every check, the readings, history, mutes.

- `GET /` — the latest snapshot: overall status (over unmuted checks), every check with its
  level, summary, hint and mute, the GPUs, the engine's and the host's figures.
- `GET /history?check=&since=&limit=` — recorded level changes, newest first (of one check
  when `check` is given; `since` an ISO date or time, default 24 hours ago).
- `GET /series?name=&subject=&since=` — one sample series (`subject`: the GPU index for the
  `gpu.*` series, empty for the others; `since` default one hour ago).
- `POST /check` — run every check now; answers the new snapshot like `GET /`.
- `POST /mutes` `{"check": ID, "minutes": N | null, "reason": ""}` — mute a check for N
  minutes, or until unmuted (null); a muted check still shows its level but raises no alert
  and does not count in the overall status. `DELETE /mutes/{check}` unmutes (idempotent).
  Both are audited by the monitor.

Bodies with unknown fields are refused (400); an unknown check id is a 404 naming where the
ids are listed; a bad number or time is a 400; a refusal changes nothing. The console's
dashboard and Health page read through `load_board` here, and mute through `mute_check` and
`unmute_check`, so both doors agree.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Annotated, Any

import msgspec
from litestar import Request, Router, delete, get, post
from litestar.params import FromPath, FromQuery, JSONBody, QueryParameter
from sqlalchemy.orm import Session

from appliance.auth.accounts import Admin
from appliance.auth.guards import password_current
from appliance.auth.middleware import AuthInfo, client_address
from appliance.errors import ApplianceError
from appliance.gpu.port import GpuSnapshot
from appliance.health import model
from appliance.health.dashboard_views import wanted_series
from appliance.health.history import (
    MuteView,
    TransitionView,
    mutes,
    recent_series,
    series,
    transitions,
)
from appliance.health.model import EngineFigures, HealthSnapshot, HostFigures
from appliance.health.sparkline import Point
from appliance.health.views import active_mutes
from appliance.runtime import Runtime, runtime_of

AdminRequest = Request[Admin, AuthInfo, Any]
API = "/api/v1/health"
MAX_MUTE_MINUTES = 366 * 24 * 60  # past a year, "until unmuted" is what is meant
MAX_REASON = 500

CheckQuery = Annotated[str | None, QueryParameter(
    description="a check id (see GET /api/v1/health): only its changes")]
SinceQuery = Annotated[str | None, QueryParameter(
    description="an ISO date or time (UTC when no zone)")]
LimitQuery = Annotated[int, QueryParameter(ge=1, le=1000, description="at most this many")]


# --- what the API answers ---------------------------------------------------------------------


@dataclass(frozen=True)
class MuteOut:
    until: dt.datetime | None  # None: until unmuted
    by: str
    at: dt.datetime
    reason: str

    @classmethod
    def of(cls, mute: MuteView) -> MuteOut:
        return cls(mute.until, mute.created_by, mute.created_at, mute.reason)


@dataclass(frozen=True)
class CheckOut:
    id: str
    group: str
    title: str
    level: str  # ok, warn, critical
    summary: str
    hint: str
    muted: bool
    mute: MuteOut | None
    checked: bool = True  # False: it did not run this time (the level is not a verdict)


@dataclass(frozen=True)
class HealthOut:
    """`at` is None (and `checks` empty) until the monitor has run once."""

    at: dt.datetime | None
    overall: str
    checks: list[CheckOut]
    gpus: GpuSnapshot | None
    engine: EngineFigures | None
    host: HostFigures | None


@dataclass(frozen=True)
class TransitionOut:
    at: dt.datetime
    check: str
    group: str
    title: str
    kind: str  # failure, recovery, change
    level: str
    previous_level: str
    summary: str
    hint: str
    muted: bool

    @classmethod
    def of(cls, t: TransitionView) -> TransitionOut:
        return cls(t.at, t.check_id, t.group, t.title, t.kind, t.level.label,
                   t.previous_level.label, t.summary, t.hint, t.muted)


@dataclass(frozen=True)
class PointOut:
    at: dt.datetime
    value: float


@dataclass(frozen=True)
class SeriesOut:
    name: str
    subject: str
    since: dt.datetime
    until: dt.datetime
    points: list[PointOut]


class MuteBody(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`minutes`: how long (1 to a year's worth), or null for until unmuted; it must be
    given, so a forgotten duration never mutes a check for good."""

    check: str
    minutes: int | None
    reason: str = ""


# --- shared with the console ------------------------------------------------------------------


@dataclass(frozen=True)
class Board:
    """What the console draws from: the latest snapshot, the mutes in force, recent changes
    (newest first) and, when asked, the last hour of the dashboard's series."""

    now: dt.datetime
    snapshot: HealthSnapshot
    mutes: dict[str, MuteView]
    changes: list[TransitionView] = field(default_factory=list)
    series: dict[tuple[str, str], list[Point]] = field(default_factory=dict)


async def load_board(runtime: Runtime, *, changes: int = 0, hour: bool = False) -> Board:
    """The board, read in one database session off the event loop."""
    now = runtime.clock.now()
    snapshot = runtime.health.latest
    wanted = wanted_series(snapshot) if hour else []
    since = now - dt.timedelta(hours=1)

    def read(s: Session) -> Board:
        return Board(now, snapshot, active_mutes(mutes(s, now), now),
                     transitions(s, None, now - dt.timedelta(days=31), changes) if changes
                     else [],
                     recent_series(s, wanted, since, now))

    board: Board = await runtime.db.run(read)
    return board


def health_out(board: Board) -> HealthOut:
    snap = board.snapshot
    checks = [CheckOut(r.id, r.group, r.title, r.level.label, r.summary, r.hint,
                       r.id in board.mutes,
                       MuteOut.of(board.mutes[r.id]) if r.id in board.mutes else None,
                       r.judged)
              for r in snap.results]
    level = max((r.level for r in snap.results if r.id not in board.mutes),
                default=model.Level.OK)
    return HealthOut(snap.at, level.label, checks, snap.gpus, snap.engine, snap.host)


def unknown_check(check: str) -> ApplianceError:
    return ApplianceError("health_check_unknown", f"there is no health check {check!r}",
                          "GET /api/v1/health lists the checks by id (the Health page shows "
                          "them too); if the monitor has not run yet, POST "
                          "/api/v1/health/check first", status=404)


def known_check(runtime: Runtime, check: str) -> str:
    """`check` when the latest snapshot has it; 404 otherwise."""
    if runtime.health.latest.result(check) is None:
        raise unknown_check(check)
    return check


def mute_until(minutes: int | None, now: dt.datetime) -> dt.datetime | None:
    """The end of a mute of `minutes` from `now` (None: until unmuted); 400 when out of
    range."""
    if minutes is None:
        return None
    if isinstance(minutes, bool) or not 1 <= minutes <= MAX_MUTE_MINUTES:
        raise ApplianceError("health_mute_invalid", f"a mute of {minutes} minutes is not "
                             "allowed", f"give 1 to {MAX_MUTE_MINUTES:,} minutes, or null to "
                             "mute until unmuted", status=400)
    return now + dt.timedelta(minutes=minutes)


async def mute_check(runtime: Runtime, check: str, minutes: int | None, reason: str, *,
                     by: str, address: str) -> None:
    """Mute `check` for `minutes` (None: until unmuted), both doors' way: a bad duration or
    reason is a 400, an unknown check a 404, and a refusal changes nothing."""
    until = mute_until(minutes, runtime.clock.now())
    reason = check_reason(reason)
    known_check(runtime, check)
    await runtime.health.mute(check, until=until, by=by, reason=reason, address=address)


async def unmute_check(runtime: Runtime, check: str, *, by: str, address: str) -> None:
    """Unmute `check` (idempotent); a 404 only when it is neither muted nor a known check
    (a muted check may have left the snapshot)."""
    board = await load_board(runtime)
    if check not in board.mutes:
        known_check(runtime, check)
    await runtime.health.unmute(check, by=by, address=address)


def check_reason(reason: str) -> str:
    reason = reason.strip()
    if len(reason) > MAX_REASON:
        raise ApplianceError("health_mute_invalid", f"the reason is {len(reason)} characters "
                             "long", f"keep it to {MAX_REASON} characters", status=400)
    return reason


def parse_since(text: str | None, default: dt.datetime, now: dt.datetime) -> dt.datetime:
    """An ISO date (00:00 UTC) or time (no zone: UTC), not in the future; `default` when
    empty."""
    text = (text or "").strip()
    if not text:
        return default
    try:
        at = dt.datetime.fromisoformat(text)
    except ValueError:
        raise ApplianceError("health_since_invalid", f"since: {text!r} is not an ISO date or "
                             "time", "give e.g. since=2026-03-01 or since=2026-03-01T12:00:00Z",
                             status=400) from None
    at = at.replace(tzinfo=dt.UTC) if at.tzinfo is None else at.astimezone(dt.UTC)
    if at > now:
        raise ApplianceError("health_since_invalid", f"since: {text!r} is in the future",
                             "give a time in the past", status=400)
    return at


# --- routes -----------------------------------------------------------------------------------


@get("/", summary="Every health check, the overall status, and the GPU, engine and host "
     "readings")
async def health_get(request: AdminRequest) -> HealthOut:
    return health_out(await load_board(runtime_of(request)))


@post("/check", status_code=200, summary="Run every check now; answers the new snapshot")
async def health_check_now(request: AdminRequest) -> HealthOut:
    runtime = runtime_of(request)
    await runtime.health.check_all()
    return health_out(await load_board(runtime))


@get("/history", summary="Recorded level changes of the checks, newest first")
async def health_history(request: AdminRequest, check: CheckQuery = None,
                         since: SinceQuery = None, limit: LimitQuery = 100,
                         ) -> list[TransitionOut]:
    runtime = runtime_of(request)
    now = runtime.clock.now()
    start = parse_since(since, now - dt.timedelta(hours=24), now)
    check_id = (check or "").strip() or None
    found = await runtime.db.run(lambda s: transitions(s, check_id, start, limit))
    if check_id and not found and runtime.health.latest.result(check_id) is None:
        raise unknown_check(check_id)
    return [TransitionOut.of(t) for t in found]


@get("/series", summary="One sample series (the dashboard's sparklines), oldest first")
async def health_series(request: AdminRequest, name: FromQuery[str], subject: FromQuery[str] = "",
                        since: SinceQuery = None) -> SeriesOut:
    runtime = runtime_of(request)
    now = runtime.clock.now()
    if name not in model.SAMPLE_NAMES:
        raise ApplianceError("health_series_unknown", f"name: {name!r} is not a series",
                             "use one of " + ", ".join(model.SAMPLE_NAMES), status=400)
    per_gpu = name.startswith("gpu.")
    if per_gpu and not subject.isdigit():
        raise ApplianceError("health_series_subject", f"subject: {subject!r} is not a GPU "
                             "index", f"{name} is per GPU: give subject=0 to 7", status=400)
    if not per_gpu and subject:
        raise ApplianceError("health_series_subject", f"subject: {name} has none",
                             "leave subject out", status=400)
    start = parse_since(since, now - dt.timedelta(hours=1), now)
    points = await runtime.db.run(lambda s: series(s, name, subject, start, now))
    return SeriesOut(name, subject, start, now, [PointOut(at, value) for at, value in points])


@post("/mutes", status_code=200, summary="Mute a check for some minutes, or until unmuted "
      "(minutes: null)")
async def health_mute(request: AdminRequest, data: JSONBody[MuteBody]) -> CheckOut:
    runtime = runtime_of(request)
    await mute_check(runtime, data.check, data.minutes, data.reason,
                     by=request.user.username, address=client_address(request))
    return await _check_out(runtime, data.check)


@delete("/mutes/{check:str}", status_code=200, summary="Unmute a check (idempotent)")
async def health_unmute(request: AdminRequest, check: FromPath[str]) -> CheckOut:
    runtime = runtime_of(request)
    await unmute_check(runtime, check, by=request.user.username,
                       address=client_address(request))
    return await _check_out(runtime, check)


async def _check_out(runtime: Runtime, check: str) -> CheckOut:
    out = health_out(await load_board(runtime))
    found = next((c for c in out.checks if c.id == check), None)
    if found is None:  # a muted check that has since left the snapshot
        return CheckOut(check, "", check, "ok", "not in the latest snapshot", "", False, None)
    return found


def health_router() -> Router:
    return Router(path=API, guards=[password_current], tags=["health"],
                  route_handlers=[health_get, health_check_now, health_history, health_series,
                                  health_mute, health_unmute])
