"""The head's view of its cell, from what it knows of each engine. Pure: no IO, no clock.

Inputs: the head's own engine (`EngineFacts`, which a member also reports of itself through
its peer status), and each member as registered (`membership.Member`, with what the head last
stored of it) plus this poll's outcome (`Observed`). Output: a frozen `CellView`:

- the router's **workers**: every prefill or decode engine with an address the head's router
  can use (the head's own engine too, when its role is prefill or decode). A member that does
  not answer keeps the engine address it last reported, so its place in the router (whose
  health checks take it out) and the router's spec do not move;
- **active**: at least one prefill and one decode worker: the gateway then forwards to the
  router;
- **serving**: active, the router process up, and at least one prefill and one decode worker
  *ready*: its engine READY, its daemon answering this head, its engine running with the
  head's engine key (the router sends that key to every worker), and, while the router runs,
  the router counting it healthy with its circuit closed (`router_metrics.routing_problem`,
  from the router's latest scrape): a member READY on its box is not serving until the
  router sends to it (issue 25);
- **capacity**: the sum of the ready decode workers' effective `max_running_requests` (None
  when one of them did not say);
- **message** and **eta_seconds**: while not serving, the refusal in the operator's words
  ("no decode member is ready: member 2 (10.0.0.6) is loading, about 40 minutes left; member
  3 (10.0.0.7) does not answer") and the smallest ETA among the loading engines of each
  missing role (the larger of the two when both roles are missing). Every ETA is rounded up
  to tens of seconds (`shown_eta`) before it is put in words, so the words, the published
  ETA and the gateway's Retry-After say the same number, and a few seconds left never
  rounds to 0 ("no ETA": issue 25's "about 4 seconds left" beside Retry-After 30).

Unified members serve alone: they are listed but are never workers.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Final
from urllib.parse import urlsplit

from appliance.cell.membership import Member
from appliance.cell.router import Worker, worker_url
from appliance.cell.router_metrics import RouterScrape, routing_problem, worker_for
from appliance.engine.states import STARTING, EngineState
from appliance.sizes import duration_text, plural

PD_ROLES: Final = ("prefill", "decode")
STARTING_WORDS: Final = frozenset(s.value for s in STARTING)
READY: Final = EngineState.READY.value
# A worker's URL -> why the router would not send to it now, or None (None: not judged, the
# router is not running).
RouterCheck = Callable[[str], str | None]


@dataclass(frozen=True)
class GpuSummary:
    """A box's GPUs in one line: how many, the hottest, the mean utilisation, memory."""

    count: int
    hottest_c: float | None
    utilization_pct: float | None
    memory_used_bytes: int
    memory_total_bytes: int

    def to_json(self) -> dict[str, Any]:
        return {"count": self.count, "hottest_c": self.hottest_c,
                "utilization_pct": self.utilization_pct,
                "memory_used_bytes": self.memory_used_bytes,
                "memory_total_bytes": self.memory_total_bytes}

    @classmethod
    def from_json(cls, data: Any) -> GpuSummary | None:
        if not isinstance(data, dict) or not isinstance(data.get("count"), int):
            return None
        return cls(data["count"], _number(data.get("hottest_c")),
                   _number(data.get("utilization_pct")),
                   _int(data.get("memory_used_bytes")) or 0,
                   _int(data.get("memory_total_bytes")) or 0)


@dataclass(frozen=True)
class EngineFacts:
    """One box's engine as its own daemon knows it. `url` is where the router reaches it
    (the engine's listen address and port); `bootstrap_port` is set for a prefill only;
    `key` and `key_running` are fingerprints (appliance.cell.engine_key) of the box's key
    file and of the key its engine accepts (None: not known)."""

    role: str
    state: str
    message: str = ""
    url: str | None = None
    bootstrap_port: int | None = None
    capacity: int | None = None
    eta_seconds: float | None = None
    percent: float | None = None
    spec_hash: str | None = None
    key: str | None = None
    key_running: str | None = None

    @property
    def reachable_from_cell(self) -> bool:
        return self.url is not None and not is_loopback(urlsplit(self.url).hostname or "")

    def engine_json(self) -> dict[str, Any]:
        """The `engine` object of the peer status (what a head reads back)."""
        return {"state": self.state, "message": self.message, "url": self.url,
                "reachable_from_cell": self.reachable_from_cell,
                "bootstrap_port": self.bootstrap_port, "capacity": self.capacity,
                "eta_seconds": self.eta_seconds, "percent": self.percent,
                "spec_hash": self.spec_hash}


@dataclass(frozen=True)
class Report:
    """A member's peer status as its head read it (a tolerant reading: a field missing or
    of another type is unknown, never an error)."""

    engine: EngineFacts
    hostname: str = ""
    version: str = ""
    health: str | None = None
    gpus: GpuSummary | None = None
    failing: tuple[str, ...] = ()  # the checks that warn or are critical, by title


def _failing(health: object) -> tuple[str, ...]:
    """The failing checks' titles (a member before them sends ids only)."""
    if not isinstance(health, dict):
        return ()
    named = health.get("failing_titles", health.get("failing"))
    return tuple(str(n) for n in named) if isinstance(named, list) else ()


def read_report(answer: Mapping[str, Any]) -> Report:
    engine = answer.get("engine")
    engine = engine if isinstance(engine, dict) else {}
    health = answer.get("health")
    facts = EngineFacts(
        role=_str(answer.get("role")) or "unified", state=_str(engine.get("state")) or "unknown",
        message=_str(engine.get("message")) or "", url=_str(engine.get("url")),
        bootstrap_port=_int(engine.get("bootstrap_port")),
        capacity=_int(engine.get("capacity")), eta_seconds=_number(engine.get("eta_seconds")),
        percent=_number(engine.get("percent")), spec_hash=_str(engine.get("spec_hash")),
        key=_str(answer.get("engine_key")), key_running=_str(answer.get("engine_key_running")))
    return Report(facts, _str(answer.get("hostname")) or "", _str(answer.get("version")) or "",
                  _str(health.get("overall")) if isinstance(health, dict) else None,
                  GpuSummary.from_json(answer.get("gpus")), _failing(health))


@dataclass(frozen=True)
class Observed:
    """A member and this poll's outcome: `status` is ok (then `answer` is its peer status),
    unreachable, revoked, refused or no_credential (then `error` says why, `hint` what to
    do)."""

    member: Member
    status: str
    error: str = ""
    hint: str = ""
    answer: Mapping[str, Any] | None = None

    @cached_property  # read once per poll, though the watch asks for it several times
    def report(self) -> Report | None:
        return read_report(self.answer) if self.answer is not None else None


@dataclass(frozen=True)
class MemberView:
    """One member on the head's Cell page. Engine fields are this poll's answer, or what the
    head last stored when the member did not answer (`seen_at` says when that was).
    `worker_url` is the address the router uses (None: not a worker); `ready` whether the
    router can use it now; `problem` why not, in words ("" when ready or not a worker)."""

    id: int
    address: str
    name: str  # "member 2 (10.0.0.6)"
    registered_role: str
    role: str
    status: str
    reachable: bool
    error: str
    state: str | None
    engine_url: str | None
    worker_url: str | None
    bootstrap_port: int | None
    capacity: int | None
    eta_seconds: float | None
    percent: float | None
    health: str | None
    gpus: GpuSummary | None
    hostname: str
    version: str
    seen_at: dt.datetime | None
    key: str | None
    key_running: str | None
    ready: bool
    problem: str
    failing: tuple[str, ...] = ()  # its failing health checks, by title


@dataclass(frozen=True)
class CellView:
    at: dt.datetime
    own: EngineFacts
    members: tuple[MemberView, ...]
    workers: tuple[Worker, ...]
    active: bool
    serving: bool
    router_running: bool
    capacity: int | None
    capacity_total: int | None  # the decode capacity with every decode worker ready
    message: str
    eta_seconds: float | None

    def member(self, member_id: int) -> MemberView | None:
        return next((m for m in self.members if m.id == member_id), None)


@dataclass(frozen=True)
class _Candidate:
    """A prefill or decode engine: the head's own or a member's."""

    name: str
    role: str
    url: str | None
    bootstrap_port: int | None
    state: str | None
    capacity: int | None
    eta_seconds: float | None
    ready: bool
    problem: str
    own: bool = False


def shown_eta(seconds: float | None) -> float | None:
    """An engine's ETA as the cell says it: rounded up to tens of seconds (fewer rewrites of
    the gateway's row than a figure that moves every poll); None when unknown or past."""
    if seconds is None or seconds <= 0:
        return None
    return math.ceil(seconds / 10) * 10.0


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def cell_url(engine_url: str | None, member_address: str) -> tuple[str | None, str]:
    """The address the head's router reaches a member's engine at, or None and why not.

    An engine on every interface (0.0.0.0) is reached at the member's console host. One on
    loopback only is reachable from the head only when the member is on the head's own
    loopback (a demo or a test on one machine)."""
    if engine_url is None:
        return None, "has not said where its engine listens"
    parts = urlsplit(engine_url)
    host, port = parts.hostname or "", parts.port
    member_host = urlsplit(member_address).hostname or ""
    if port is None:
        return None, f"reported an engine address without a port ({engine_url})"
    if host in ("0.0.0.0", "::"):  # noqa: S104 - an address read, not bound
        return worker_url(member_host, port), ""
    if is_loopback(host) and not is_loopback(member_host):
        return None, ("has its engine on 127.0.0.1 only: set cell.listen_address there to its "
                      "address on the cell network, then restart its engine")
    return engine_url, ""


def _state_words(name: str, state: str | None, eta: float | None) -> str:
    if state is None:
        return f"{name} has not reported its engine yet"
    if state in STARTING_WORDS:
        verb = "is starting" if state in ("preflight", "launching") else "is loading"
        return f"{name} {verb}" + (f", about {duration_text(eta)} left" if eta else "")
    return f"{name} is {state.replace('_', ' ')}"


def _status_words(name: str, status: str, error: str) -> str:
    return {
        "unreachable": f"{name} does not answer",
        "revoked": f"{name} revoked this head's credential",
        "no_credential": f"{name} has no credential on this head (remove it and add it again)",
    }.get(status, f"{name} refused the head's call ({error})")


def _member_view(seen: Observed, head_key: str | None,
                 check: RouterCheck | None = None) -> MemberView:
    m, report = seen.member, seen.report
    state: str | None
    if report is not None:
        facts = report.engine
        role, state, engine_url = facts.role, facts.state, facts.url
        bootstrap, capacity = facts.bootstrap_port, facts.capacity
        eta, percent = shown_eta(facts.eta_seconds), facts.percent
    else:
        role = m.reported_role or m.role
        state, engine_url, bootstrap, capacity = (m.engine_state, m.engine_url,
                                                  m.bootstrap_port, m.capacity)
        eta = percent = None
    host = urlsplit(engine_url or m.address).hostname or m.address
    name = f"member {m.id} ({host})"
    url, why = cell_url(engine_url, m.address) if role in PD_ROLES else (None, "")
    key = report.engine.key if report else None
    key_running = report.engine.key_running if report else None
    problem = ""
    if role in PD_ROLES:
        if seen.status != "ok":
            problem = _status_words(name, seen.status, seen.error)
        elif url is None:
            problem = f"{name} {why}"
        elif head_key and key_running and key_running != head_key:
            problem = f"{name}'s engine runs with another key: restart it to serve in the cell"
        elif state != READY:
            problem = _state_words(name, state, eta)
        elif check is not None and (unrouted := check(url)) is not None:
            problem = f"{name} is ready, but {unrouted}"
    ready = role in PD_ROLES and not problem
    return MemberView(
        id=m.id, address=m.address, name=name, registered_role=m.role, role=role,
        status=seen.status, reachable=seen.status == "ok", error=seen.error, state=state,
        engine_url=engine_url, worker_url=url, bootstrap_port=bootstrap, capacity=capacity,
        eta_seconds=eta, percent=percent, health=report.health if report else None,
        gpus=report.gpus if report else None, hostname=report.hostname if report else "",
        version=report.version if report else "", seen_at=m.seen_at, key=key,
        key_running=key_running, ready=ready, problem=problem,
        failing=report.failing if report else ())


def _own_candidate(own: EngineFacts, check: RouterCheck | None) -> _Candidate | None:
    if own.role not in PD_ROLES:
        return None
    name = "this box (the head)"
    eta = shown_eta(own.eta_seconds)
    problem = "" if own.state == READY else _state_words(name, own.state, eta)
    if not problem and own.url is not None and check is not None \
            and (why := check(own.url)) is not None:
        problem = f"{name} is ready, but {why}"
    return _Candidate(name, own.role, own.url, own.bootstrap_port, own.state, own.capacity,
                      eta, not problem and own.url is not None, problem, own=True)


def _candidates(own: EngineFacts, members: Iterable[MemberView],
                check: RouterCheck | None) -> list[_Candidate]:
    found = [c for c in [_own_candidate(own, check)] if c is not None]
    found += [_Candidate(m.name, m.role, m.worker_url, m.bootstrap_port, m.state, m.capacity,
                         m.eta_seconds, m.ready, m.problem)
              for m in members if m.role in PD_ROLES and m.worker_url is not None]
    return found


def _sum(values: Sequence[int | None]) -> int | None:
    return None if any(v is None for v in values) else sum(v for v in values if v is not None)


def _missing(role: str, candidates: Sequence[_Candidate]) -> tuple[str, float | None]:
    """Why no `role` engine is ready, and the soonest one of them should be."""
    of_role = [c for c in candidates if c.role == role]
    etas = [c.eta_seconds for c in of_role
            if c.eta_seconds is not None and c.state in STARTING_WORDS]
    reasons = "; ".join(c.problem for c in of_role)
    who = "engine" if any(c.own for c in of_role) else "member"
    return f"no {role} {who} is ready: {reasons}", min(etas) if etas else None


def router_check(router_running: bool, scrape: RouterScrape | None) -> RouterCheck | None:
    """How the view judges a READY engine by the router: not at all while the router is not
    running (the view says that instead), else by its latest scrape (none: nothing is
    confirmed)."""
    if not router_running:
        return None

    def check(url: str) -> str | None:
        if scrape is None:
            return "the router's figures are not available"
        return routing_problem(worker_for(scrape, (url,)))

    return check


def build_view(own: EngineFacts, observed: Sequence[Observed], *, router_running: bool,
               at: dt.datetime, router: RouterScrape | None = None) -> CellView:
    check = router_check(router_running, router)
    members = tuple(_member_view(seen, own.key, check)
                    for seen in sorted(observed, key=lambda o: o.member.id))
    candidates = _candidates(own, members, check)
    workers = tuple(sorted({Worker(c.role, c.url, c.bootstrap_port if c.role == "prefill"
                                   else None) for c in candidates if c.url is not None}))
    roles = {w.role for w in workers}
    active = all(r in roles for r in PD_ROLES)
    ready_roles = {c.role for c in candidates if c.ready}
    missing = [r for r in PD_ROLES if r not in ready_roles]
    decodes = [c for c in candidates if c.role == "decode"]
    capacity = _sum([c.capacity for c in decodes if c.ready])
    total = _sum([c.capacity for c in decodes]) if decodes else None
    message, eta = "", None
    if not active:
        absent = [r for r in PD_ROLES if r not in roles]
        message = ("this box heads no prefill/decode cell: it has no "
                   + " and no ".join(absent) + " engine")
    elif missing:
        found = [_missing(r, candidates) for r in missing]
        message = "; ".join(words for words, _ in found)
        etas = [e for _, e in found]
        eta = None if any(e is None for e in etas) else max(e for e in etas if e is not None)
    elif not router_running:
        message = "the cell's router is not running yet (the head starts it)"
    serving = active and not missing and router_running
    return CellView(at=at, own=own, members=members, workers=workers, active=active,
                    serving=serving, router_running=router_running,
                    capacity=capacity if active else None, capacity_total=total,
                    message=message, eta_seconds=eta)


# --- what changed since the last poll ---------------------------------------------------------


@dataclass(frozen=True)
class MemberChange:
    """A member lost (`lost`) or back: one event and one webhook each, in `sentence`."""

    member: MemberView
    lost: bool
    sentence: str


def capacity_words(view: CellView) -> str:
    """What the cell has left: "1 of 2 prefill engines ready; decode capacity now 64 of 128
    running requests"."""
    parts = []
    for role in PD_ROLES:
        of_role = [m for m in view.members if m.role == role and m.worker_url is not None]
        own = 1 if view.own.role == role else 0
        ready = sum(m.ready for m in of_role) + (own and view.own.state == READY)
        if role == "prefill" or view.capacity_total is None:
            parts.append(f"{ready} of {plural(len(of_role) + own, role + ' engine')} ready")
        else:
            parts.append(f"decode capacity now {view.capacity or 0} of "
                         f"{plural(view.capacity_total, 'running request')}")
    return "; ".join(parts)


def member_changes(up_before: Mapping[int, bool], view: CellView) -> list[MemberChange]:
    """Members that were ready and are not (lost), or were lost and are ready again (back).
    A member never seen ready records nothing: a member still loading is not a loss."""
    changes = []
    left = capacity_words(view)
    for m in view.members:
        before = up_before.get(m.id)
        if before is True and not m.ready and m.role in PD_ROLES:
            changes.append(MemberChange(m, True, f"cell member lost: {m.problem}; {left}"))
        elif before is False and m.ready:
            changes.append(MemberChange(m, False, f"cell member back: {m.name} has its "
                                                  f"{m.role} engine ready; {left}"))
    return changes


def up_now(up_before: Mapping[int, bool], view: CellView) -> dict[int, bool]:
    """Each member's up/down for the next `member_changes`: a member that has never been
    ready is not tracked yet."""
    return {m.id: m.ready for m in view.members if m.ready or m.id in up_before}


# --- small tolerant readers ---------------------------------------------------------------


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)
