"""The head's Cell page and `GET /api/v1/cell`: the cell's view (appliance.cell.view) with
the router's figures beside each engine, the cell's traffic, the rolling restart's progress,
and the actions each member offers in its state.

Pure, apart from `usage_window`, which is pure over a database session. The page's words are
made here, through appliance/sizes.py, so the page and the CLI say the same; `overview_json`
is the API's shape of the same model.

- **The router's view** of an engine comes from `sglang-router`'s per-worker figures
  (appliance.cell.router_metrics): healthy or taken out by its health checks, its circuit
  breaker, the requests running through it there.
- **Traffic**: routed requests per second and the router's mean request time, from two
  scrapes of its counters; generated tokens per second and the time to first token from the
  head gateway's usage rows of the last `USAGE_WINDOW` (sglang-router 0.3.2 measures time to
  first token only for gRPC workers, never over HTTP).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

from sqlalchemy import select
from sqlalchemy.orm import Session

from appliance.cell.rolling import Progress
from appliance.cell.router_metrics import RouterReading, WorkerFigures, worker_for
from appliance.cell.view import PD_ROLES, CellView, GpuSummary, MemberView, capacity_words
from appliance.db.models import UsageRequest
from appliance.engine.states import LIVE, STARTING, EngineState
from appliance.sizes import duration_text, gib_text, plural, when_text

USAGE_WINDOW: Final = dt.timedelta(minutes=5)
USAGE_ROWS_READ: Final = 20_000  # the newest rows of the window; enough for percentiles
_LIVE: Final = frozenset(s.value for s in LIVE)
_STARTING: Final = frozenset(s.value for s in STARTING | {EngineState.ADOPTED})
HEALTH_WORDS: Final = {"ok": "every check passes", "warn": "a check warns",
                       "critical": "a check is critical"}


@dataclass(frozen=True)
class UsageWindow:
    """The head gateway's answers over the last `seconds`: ok answers, the tokens they
    generated, and their time to first token (milliseconds; None without one)."""

    seconds: float
    requests: int
    completion_tokens: int
    ttft_p50_ms: float | None
    ttft_p90_ms: float | None


def _percentile(values: Sequence[float], share: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


def usage_window(session: Session, now: dt.datetime,
                 window: dt.timedelta = USAGE_WINDOW) -> UsageWindow:
    since = now - window
    rows = session.execute(
        select(UsageRequest.completion_tokens, UsageRequest.ttft_ms)
        .where(UsageRequest.started_at >= since, UsageRequest.outcome == "ok")
        .order_by(UsageRequest.started_at.desc()).limit(USAGE_ROWS_READ)).all()
    ttfts = [float(t) for _, t in rows if t is not None]
    return UsageWindow(window.total_seconds(), len(rows), sum(int(c) for c, _ in rows),
                       _percentile(ttfts, 0.5), _percentile(ttfts, 0.9))


# --- words ------------------------------------------------------------------------------------


def member_actions(state: str | None, reachable: bool) -> tuple[str, ...]:
    """The engine actions a member's card offers in `state`: what its supervisor accepts and
    what makes sense (as on the Engine page); none for a member that does not answer."""
    if not reachable or state is None:
        return ()
    if state in ("stopped", "failed"):
        return ("start",)
    if state == "backoff":
        return ("start", "stop")
    if state in ("draining", "stopping", "preflight"):
        return ()
    if state in _STARTING:
        return ("stop",)
    return ("stop", "restart")


def engine_words(state: str | None, percent: float | None, eta: float | None) -> str:
    if state is None:
        return "not reported yet"
    words = state.replace("_", " ")
    if state in _STARTING:
        if percent is not None:
            words += f", {percent:.0f}% loaded"
        if eta:
            words += f", about {duration_text(eta)} left"
    return words


def gpu_words(gpus: GpuSummary | None) -> str:
    if gpus is None:
        return "not reported"
    parts = [plural(gpus.count, "GPU")]
    if gpus.hottest_c is not None:
        parts.append(f"hottest {gpus.hottest_c:.0f} °C")
    if gpus.utilization_pct is not None:
        parts.append(f"{gpus.utilization_pct:.0f}% busy")
    if gpus.memory_total_bytes:
        parts.append(f"{gib_text(gpus.memory_used_bytes)} of "
                     f"{gib_text(gpus.memory_total_bytes)} memory used")
    return ", ".join(parts)


def router_words(role: str, worker_url: str | None, figures: WorkerFigures | None,
                 router: RouterReading | None) -> str:
    """How the router sees one engine, in a line."""
    if role not in PD_ROLES:
        return "not in the router: a unified box serves alone"
    if worker_url is None:
        return "not in the router (it has no address the router can use)"
    if router is None or not router.up:
        return "the router's figures are not available"
    if figures is None:
        return "not among the router's workers yet"
    words = [("healthy" if figures.healthy else "taken out by its health checks")
             if figures.healthy is not None else "health not reported"]
    if figures.circuit == "open":
        words.append("circuit open: the router sends it nothing for now")
    elif figures.circuit is not None:
        words.append(f"circuit {figures.circuit}")
    if figures.running is not None:
        words.append(f"{plural(figures.running, 'request')} running")
    return ", ".join(words)


def _seconds(ms: float | None) -> str:
    if ms is None:
        return "—"
    return f"{ms:.0f} ms" if ms < 1000 else f"{ms / 1000:.2f} s"


def traffic_words(router: RouterReading | None, usage: UsageWindow | None) -> list[str]:
    lines = []
    if usage is not None:
        span = duration_text(usage.seconds)
        if usage.requests:
            lines.append(f"{usage.completion_tokens / usage.seconds:,.1f} tokens/s generated "
                         f"over the last {span} ({plural(usage.requests, 'answer')})")
            if usage.ttft_p50_ms is not None:
                lines.append(f"First token after {_seconds(usage.ttft_p50_ms)} (median), "
                             f"{_seconds(usage.ttft_p90_ms)} for the slowest tenth, over the "
                             f"last {span}")
        else:
            lines.append(f"No answers through the gateway in the last {span}")
    if router is not None and router.rates is not None:
        rates = router.rates
        line = (f"{rates.requests_per_second:,.2f} requests/s routed over the last "
                f"{duration_text(rates.seconds)}")
        if rates.mean_request_seconds is not None:
            line += f", {rates.mean_request_seconds:,.2f} s each on average"
        if rates.errors_per_second:
            line += f", {rates.errors_per_second:,.2f}/s answered with an error"
        lines.append(line)
    return lines


def rolling_words(progress: Progress) -> str:
    state = {"running": "running", "done": "finished", "failed": "stopped",
             "cancelled": "cancelled"}[progress.state]
    words = (f"Rolling restart of the {progress.role} members, started by "
             f"{progress.started_by} at {when_text(progress.started_at)}: {state}, "
             f"{progress.done} of {plural(len(progress.steps), 'engine')} restarted")
    current = progress.current
    if current is not None:
        words += f"; now {current.label}"
    return words + "."


# --- the model ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class MemberCard:
    member: MemberView
    router: WorkerFigures | None
    engine: str
    health: str
    gpus: str
    router_line: str
    actions: tuple[str, ...]


@dataclass(frozen=True)
class HeadCard:
    role: str
    state: str
    engine: str
    in_router: bool
    router: WorkerFigures | None
    router_line: str


@dataclass(frozen=True)
class Overview:
    view: CellView
    head: HeadCard
    members: tuple[MemberCard, ...]
    capacity: str
    router: RouterReading | None
    usage: UsageWindow | None
    traffic: tuple[str, ...]
    rolling: Progress | None
    rolling_line: str

    @property
    def is_head(self) -> bool:
        return bool(self.view.members)


def health_words(overall: str | None, failing: Sequence[str]) -> str:
    """A member's health in words, naming what fails: "a check warns: Weights"; "2 checks
    warn or are critical: GPU 3 temperature, Weights"; at most three named."""
    if overall is None or overall not in HEALTH_WORDS:
        return "not reported"
    if overall == "ok" or not failing:
        return HEALTH_WORDS[overall]
    named = ", ".join(failing[:3]) + (f" and {len(failing) - 3} more" if len(failing) > 3
                                      else "")
    if len(failing) == 1:
        return f"{HEALTH_WORDS[overall]}: {named}"
    return f"{len(failing)} checks warn or are critical: {named}"


def build_overview(view: CellView, router: RouterReading | None, usage: UsageWindow | None,
                   rolling: Progress | None) -> Overview:
    scrape = router.scrape if router is not None else None
    cards = []
    for m in view.members:
        figures = worker_for(scrape, (m.worker_url, m.engine_url))
        cards.append(MemberCard(
            member=m, router=figures, engine=engine_words(m.state, m.percent, m.eta_seconds),
            health=health_words(m.health, m.failing), gpus=gpu_words(m.gpus),
            router_line=router_words(m.role, m.worker_url, figures, router),
            actions=member_actions(m.state, m.reachable)))
    own = view.own
    own_figures = worker_for(scrape, (own.url,))
    in_router = own.role in PD_ROLES and any(w.url == own.url for w in view.workers)
    head = HeadCard(role=own.role, state=own.state,
                    engine=engine_words(own.state, own.percent, own.eta_seconds),
                    in_router=in_router, router=own_figures,
                    router_line=router_words(own.role, own.url if in_router else None,
                                             own_figures, router))
    return Overview(
        view=view, head=head, members=tuple(cards),
        capacity=capacity_words(view) if view.active else "",
        router=router, usage=usage, traffic=tuple(traffic_words(router, usage)),
        rolling=rolling, rolling_line=rolling_words(rolling) if rolling else "")


# --- the API's shape ---------------------------------------------------------------------------


def _figures_json(figures: WorkerFigures | None) -> dict[str, Any] | None:
    if figures is None:
        return None
    return {"healthy": figures.healthy, "circuit": figures.circuit,
            "running_requests": figures.running,
            "consecutive_failures": figures.consecutive_failures}


def _iso(value: dt.datetime | None) -> str | None:
    return value.isoformat() if value else None


def progress_json(progress: Progress | None) -> dict[str, Any] | None:
    if progress is None:
        return None
    return {"role": progress.role, "state": progress.state, "message": progress.message,
            "started_by": progress.started_by, "started_at": _iso(progress.started_at),
            "ended_at": _iso(progress.ended_at), "restarted": progress.done,
            "skipped": list(progress.skipped),
            "steps": [{"engine": s.key, "label": s.label, "status": s.status,
                       "message": s.message, "started_at": _iso(s.started_at),
                       "ended_at": _iso(s.ended_at)} for s in progress.steps]}


def overview_json(overview: Overview) -> dict[str, Any]:
    view = overview.view
    router = overview.router
    usage = overview.usage
    return {
        "at": view.at.isoformat(), "is_head": overview.is_head, "active": view.active,
        "serving": view.serving, "message": view.message, "eta_seconds": view.eta_seconds,
        "capacity": view.capacity, "capacity_total": view.capacity_total,
        "capacity_words": overview.capacity,
        "head": {"role": overview.head.role, "engine_state": overview.head.state,
                 "in_router": overview.head.in_router,
                 "router": _figures_json(overview.head.router)},
        "members": [{
            "id": c.member.id, "address": c.member.address, "name": c.member.name,
            "role": c.member.role, "registered_role": c.member.registered_role,
            "status": c.member.status, "error": c.member.error,
            "engine": {"state": c.member.state, "percent": c.member.percent,
                       "eta_seconds": c.member.eta_seconds, "url": c.member.engine_url},
            "health": c.member.health,
            "gpus": c.member.gpus.to_json() if c.member.gpus else None,
            "worker_url": c.member.worker_url, "ready": c.member.ready,
            "problem": c.member.problem, "seen_at": _iso(c.member.seen_at),
            "router": _figures_json(c.router), "actions": list(c.actions),
        } for c in overview.members],
        "router": None if router is None else {
            "up": router.up, "error": router.error,
            "pool_sizes": dict(router.scrape.pool_sizes) if router.scrape else {},
            **({"rates": dataclasses.asdict(router.rates)} if router.rates else {})},
        "traffic": None if usage is None else dataclasses.asdict(usage),
        "traffic_words": list(overview.traffic),
        "rolling_restart": progress_json(overview.rolling),
    }
