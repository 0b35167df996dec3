"""A rolling restart of one role of the cell: its engines restarted one box at a time, each
back to READY before the next goes down, so the role never loses its last serving member.

The pure part plans and judges:

- `plan_rolling(role, engines)`: the READY engines of `role` (prefill or decode) in order, by
  member id with the head's own engine last; the role's other engines are skipped with the
  reason; the other role is never in a plan. With fewer than 2 READY engines of the role it
  refuses: restarting one would take the role's last READY member down.
- `step_refusal(step, engines)`: before each step, why taking `step` down now would leave the
  role without a serving engine (READY and, where the cell has a router, sent requests by
  it: healthy and its circuit closed), or None (the cell may have changed since the plan).
- `wait_verdict(before, seen, went_down)`: whether a restarted engine is back (READY in a
  state entered after the restart, and taken back by the router), still on its way, or
  failed. Only then does the next engine go down: issue 25's restart took the second decode
  down while the router still had the first one out, and the cell answered 503.

`RollingRestart` runs a plan over an `EnginePort` (the head's peer client for members, its
own supervisor for its own engine): restart, then poll until READY again within
`deadline_seconds` (generous by default: a K3 start takes about 90 minutes), then the next.
It stops at the first failure and says which engine and why; `cancel()` stops it before the
next step (an engine restart already asked for goes on on its box). Its progress is a frozen
`Progress`, replaced at every change and handed to `report` (the API keeps it and audits).
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Final, Protocol

from appliance.errors import EX_USAGE, ApplianceError
from appliance.sizes import duration_text

ROLLING_ROLES: Final = ("prefill", "decode")
READY: Final = "ready"
# Engine states that end a wait at once: the restarted engine crashed or gave up.
FAILED_STATES: Final = frozenset({"failed", "backoff"})
DEFAULT_DEADLINE_SECONDS: Final = 3 * 3600.0  # a K3 start is ~90 minutes; twice that and more
DEFAULT_POLL_SECONDS: Final = 10.0
STOPPED_GRACE_SECONDS: Final = 60.0  # a restart's stop-to-start gap is far shorter


@dataclass(frozen=True)
class Engine:
    """One engine of the cell as a plan sees it. `key` is unique in the cell ("member-3",
    "head"); `state` is its engine state's value, None when its box did not answer."""

    key: str
    label: str
    role: str
    state: str | None
    member_id: int | None = None
    routed: bool | None = None  # the router sends to it (None: no router to ask)

    @property
    def serving(self) -> bool:
        return self.state == READY and self.routed is not False


@dataclass(frozen=True)
class Seen:
    """An engine's state as read once: `since` is when it entered that state (as its box
    says; compared, never parsed), `message` its box's sentence. `state` None: no answer.
    `routed`: whether the head's router counts it healthy (None: the router does not say)."""

    state: str | None
    since: str | None = None
    message: str = ""
    routed: bool | None = None

    def words(self) -> str:
        if self.state is None:
            return "no answer"
        if self.state == READY and self.routed is False:
            return "ready, not yet taken back by the router"
        return self.state.replace("_", " ")


@dataclass(frozen=True)
class Plan:
    role: str
    steps: tuple[Engine, ...]
    skipped: tuple[tuple[Engine, str], ...] = ()


class RollingRefused(ApplianceError):
    status = 409


def _order(engine: Engine) -> tuple[int, int]:
    return (1, 0) if engine.member_id is None else (0, engine.member_id)


def _not_ready(engine: Engine) -> str:
    if engine.state is None:
        return "not reachable"
    return f"not ready ({engine.state.replace('_', ' ')}): restart it on its own if needed"


def plan_rolling(role: str, engines: Sequence[Engine]) -> Plan:
    """The steps of a rolling restart of `role`, or a refusal that says why."""
    if role not in ROLLING_ROLES:
        raise ApplianceError(
            "rolling_role_invalid", f"{role[:40]!r} is not a role a rolling restart takes",
            "use prefill or decode (a unified box serves alone: restart it on its own)",
            status=422, exit_code=EX_USAGE)
    mine = sorted((e for e in engines if e.role == role), key=_order)
    ready = [e for e in mine if e.state == READY]
    if len(ready) < 2:
        raise RollingRefused(
            "rolling_restart_refused",
            f"{role} has {len(ready)} READY {'member' if len(ready) == 1 else 'members'} "
            f"(of {len(mine)}); a rolling restart needs at least 2, so that one keeps serving "
            f"while another restarts: it would take the last READY {role} member down",
            f"restart the {role} member on its own (with its cost), or wait until another "
            f"{role} member is READY")
    return Plan(role, tuple(ready), tuple((e, _not_ready(e)) for e in mine if e.state != READY))


def step_refusal(step: Engine, engines: Sequence[Engine]) -> str | None:
    """Why `step` is not to be restarted now, or None: it is no longer a READY engine of
    its role, or restarting it would leave the role with no READY engine."""
    now = next((e for e in engines if e.key == step.key), None)
    if now is None or now.role != step.role:
        return f"{step.label} is no longer a {step.role} member of the cell"
    if now.state != READY:
        return f"{step.label} is no longer READY ({(now.state or 'no answer').replace('_', ' ')})"
    others = [e for e in engines if e.role == step.role and e.key != step.key]
    if any(e.serving for e in others):
        return None
    if not others:
        return f"{step.label} is the only {step.role} member left"
    states = ", ".join(f"{e.label} {_not_serving(e)}" for e in others)
    return (f"restarting {step.label} now would take the last serving {step.role} member "
            f"down ({states})")


def _not_serving(engine: Engine) -> str:
    if engine.state == READY:
        return "ready, but the router does not send to it"
    return _not_ready(engine).split(":")[0]


def wait_verdict(before: Seen, seen: Seen, went_down: bool, stopped_seconds: float = 0.0,
                 stopped_grace: float = STOPPED_GRACE_SECONDS) -> str | None:
    """"ready" when the restarted engine is back, None while it is on its way, else the
    failure in a sentence. Back means READY in a state entered after the restart (seen
    leaving READY, or READY with another `since` than before the restart) and, where the
    router says, taken back by the router's health checks: only then does the next engine
    go down, so the role never has no worker the router sends to. A restart passes through
    STOPPED between its stop and its start: only an engine stopped for `stopped_grace`
    seconds (`stopped_seconds` so far) has stopped instead of starting again."""
    if seen.state == READY and (went_down or seen.since != before.since):
        return READY if seen.routed is not False else None
    if seen.state in FAILED_STATES:
        return f"its engine is {seen.state}: {seen.message or 'no message'}"
    if seen.state == "stopped" and went_down and stopped_seconds >= stopped_grace:
        return f"its engine stopped instead of starting again: {seen.message or 'no message'}"
    return None


# --- the executor ------------------------------------------------------------------------------


class EnginePort(Protocol):
    """How the executor reaches the cell's engines (adapters: the API's peer client)."""

    async def engines(self) -> list[Engine]:
        """Every engine of the cell as it stands now."""
        ...

    async def seen(self, engine: Engine) -> Seen:
        """`engine`'s state now (Seen(None, …) when its box does not answer)."""
        ...

    async def restart(self, engine: Engine) -> None:
        """Ask for a confirmed restart; raises ApplianceError when its box refuses."""
        ...


@dataclass(frozen=True)
class Step:
    key: str
    label: str
    status: str = "waiting"  # waiting, restarting, done, failed, cancelled, not started
    message: str = ""
    started_at: dt.datetime | None = None
    ended_at: dt.datetime | None = None


@dataclass(frozen=True)
class Progress:
    """A rolling restart as it stands: `state` running, done, failed or cancelled."""

    role: str
    started_by: str
    started_at: dt.datetime
    steps: tuple[Step, ...]
    skipped: tuple[str, ...] = ()
    state: str = "running"
    message: str = ""
    ended_at: dt.datetime | None = None

    @property
    def current(self) -> Step | None:
        return next((s for s in self.steps if s.status == "restarting"), None)

    @property
    def done(self) -> int:
        return sum(1 for s in self.steps if s.status == "done")


Report = Callable[[Progress, Step | None], Awaitable[None]]


def _utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


class RollingRestart:
    """One rolling restart over `port`. `report(progress, step)` is awaited after every
    change (`step`: the step that just started or ended, None for the whole run's start and
    end). Times: `now` for what a person reads, `monotonic` for the deadline."""

    def __init__(self, plan: Plan, port: EnginePort, *, started_by: str, report: Report,
                 deadline_seconds: float = DEFAULT_DEADLINE_SECONDS,
                 poll_seconds: float = DEFAULT_POLL_SECONDS,
                 stopped_grace_seconds: float = STOPPED_GRACE_SECONDS,
                 now: Callable[[], dt.datetime] = _utcnow,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.plan = plan
        self._port = port
        self._report = report
        self._deadline = deadline_seconds
        self._poll = poll_seconds
        self._stopped_grace = stopped_grace_seconds
        self._now = now
        self._monotonic = monotonic
        self._cancelled = asyncio.Event()
        self._cancelled_by = ""
        self.progress = Progress(
            role=plan.role, started_by=started_by, started_at=now(),
            steps=tuple(Step(e.key, e.label) for e in plan.steps),
            skipped=tuple(f"{e.label}: {why}" for e, why in plan.skipped))

    def cancel(self, by: str) -> None:
        self._cancelled_by = by
        self._cancelled.set()

    async def run(self) -> Progress:
        await self._report(self.progress, None)
        for index, engine in enumerate(self.plan.steps):
            if self._cancelled.is_set():
                return await self._end("cancelled", self._cancel_words(index))
            why = step_refusal(engine, await self._port.engines())
            if why is not None:
                return await self._fail(index, why)
            outcome = await self._restart(index, engine)
            if outcome is not None:
                return outcome
        return await self._end("done", f"every READY {self.plan.role} member was restarted "
                                       "and is READY again")

    async def _restart(self, index: int, engine: Engine) -> Progress | None:
        """Restart one engine and wait for it; the run's end when it stops here."""
        before = await self._port.seen(engine)
        await self._step(index, "restarting", f"restart asked of {engine.label}",
                         started=True)
        try:
            await self._port.restart(engine)
        except ApplianceError as exc:
            return await self._fail(index, f"{engine.label} refused the restart: {exc.message}")
        went_down = False
        stopped_at: float | None = None
        end = self._monotonic() + self._deadline
        while True:
            if await self._cancel_wait():
                await self._step(index, "cancelled", "its restart was already asked for and "
                                 "goes on on its box", ended=True)
                return await self._end("cancelled", self._cancel_words(index + 1, engine))
            seen = await self._port.seen(engine)
            went_down = went_down or (seen.state is not None and seen.state != READY)
            now = self._monotonic()
            stopped_at = (stopped_at or now) if seen.state == "stopped" else None
            verdict = wait_verdict(before, seen, went_down, now - (stopped_at or now),
                                   self._stopped_grace)
            if verdict == READY:
                await self._step(index, "done", f"{engine.label} is READY again",
                                 ended=True)
                return None
            if verdict is not None:
                return await self._fail(index, f"{engine.label}: {verdict}")
            waiting = f"{engine.label} is READY again; waiting for the router to send to it"
            if seen.state == READY and seen.routed is False \
                    and self.progress.steps[index].message != waiting:
                await self._step(index, "restarting", waiting)  # the page says why it waits
            if self._monotonic() >= end:
                return await self._fail(
                    index, f"{engine.label} was not READY again within "
                           f"{duration_text(self._deadline)} (last seen: {seen.words()})")

    async def _cancel_wait(self) -> bool:
        """Wait one poll interval; True when cancelled meanwhile."""
        try:
            await asyncio.wait_for(self._cancelled.wait(), self._poll)
        except TimeoutError:
            return False
        return True

    def _cancel_words(self, next_index: int, current: Engine | None = None) -> str:
        left = len(self.plan.steps) - next_index
        words = f"cancelled by {self._cancelled_by or 'someone'}; {left} not restarted"
        if current is not None:
            words += (f"; {current.label}'s restart was already asked for and goes on there "
                      "(see its Engine page)")
        return words

    async def _step(self, index: int, status: str, message: str, *, started: bool = False,
                    ended: bool = False) -> None:
        step = self.progress.steps[index]
        step = dataclasses.replace(step, status=status, message=message,
                                   started_at=self._now() if started else step.started_at,
                                   ended_at=self._now() if ended else step.ended_at)
        steps = (*self.progress.steps[:index], step, *self.progress.steps[index + 1:])
        self.progress = dataclasses.replace(self.progress, steps=steps)
        await self._report(self.progress, step)

    async def _fail(self, index: int, why: str) -> Progress:
        await self._step(index, "failed", why, ended=True)
        left = len(self.plan.steps) - index - 1
        return await self._end("failed", f"stopped at {self.plan.steps[index].label}: {why}"
                                         + (f"; {left} not restarted" if left else ""))

    async def _end(self, state: str, message: str) -> Progress:
        steps = tuple(dataclasses.replace(s, status="not started") if s.status == "waiting"
                      else s for s in self.progress.steps)
        self.progress = dataclasses.replace(self.progress, steps=steps, state=state,
                                            message=message, ended_at=self._now())
        await self._report(self.progress, None)
        return self.progress
