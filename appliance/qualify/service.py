"""The qualification service: one qualification at a time, off the request path.

idle → running → done | cancelled | failed (and `interrupted`, written at the next start, for
one a daemon stop or crash cut short). A run needs a READY engine and a confirmation: it
closes the gateway to users for its whole duration, which the plan estimates first.

Closing the gateway is a lease on the engine status row (`publish.write_qualifying`): the
daemon renews it every few seconds while the run lasts and clears it when the run ends, how
ever it ends. A daemon that dies without clearing it leaves it to lapse within
`LEASE_SECONDS`, and the next start clears it at once, so no restart leaves users refused.

The run: wait for the engine to finish what users had in flight, then climb the ladder; every
step is repeated, each repeat after a prefix-cache flush. A step that fails (or a wedge)
ends the climb: the qualified point is below it. Steps are saved as they finish.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from appliance.clock import Clock
from appliance.config import Config, engine_url
from appliance.db.database import Database
from appliance.db.journal import add_event
from appliance.db.models import UsageRequest
from appliance.engine.publish import write_qualifying
from appliance.engine.states import EngineState
from appliance.engine.supervisor import Supervisor
from appliance.errors import ApplianceError
from appliance.qualify import ledger, plan
from appliance.qualify.runner import LoadRunner
from appliance.qualify.verdict import Round, Step, judge, qualified_point, round_of, verdict_words
from appliance.secrets import read_engine_api_key

log = logging.getLogger(__name__)
LEASE_SECONDS = 30.0
RENEW_SECONDS = 5.0
DRAIN_SECONDS = 120.0   # users' requests already in the engine get this long to finish
REPLAY_DAYS = 7
REPLAY_ROWS = 10_000

RunnerFactory = Callable[[plan.Settings], LoadRunner]


@dataclass(frozen=True)
class Request:
    """What an operator asks for (the API body, the CLI flags, the console form)."""

    floor: float = plan.DEFAULT_FLOOR
    ttft_p90_max: float | None = None
    repeats: int = plan.DEFAULT_REPEATS
    ladder: tuple[int, ...] | None = None
    workload: str = "harsh"                 # harsh | profile:NAME | replay
    input_tokens: int | None = None         # the harsh load's prompt (default 8,192)
    output_tokens: int | None = None        # the harsh load's answer (default 1,000)
    wedge_seconds: float = plan.DEFAULT_WEDGE_SECONDS


@dataclass(frozen=True)
class Planned:
    settings: plan.Settings
    estimate_seconds: float
    spec_hash: str
    engine_version: str

    def to_dict(self) -> dict[str, Any]:
        return {"settings": self.settings.to_dict(), "estimate_seconds": round(
            self.estimate_seconds), "spec_hash": self.spec_hash,
            "engine_version": self.engine_version, "summary": summary(self)}


def summary(planned: Planned) -> str:
    """What a run will do, in words, for the confirmation."""
    s = planned.settings
    steps = ", ".join(str(c) for c in s.ladder)
    minutes = max(1, round(planned.estimate_seconds / 60))
    repeats = "once" if s.repeats == 1 else f"{s.repeats} times"
    return (f"{s.workload.describe()}; {len(s.ladder)} steps ({steps} concurrent users), each "
            f"run {repeats} after flushing the prefix cache; about {minutes} min at most. "
            "The gateway refuses users (503) for the whole run.")


@dataclass(frozen=True)
class Progress:
    """The running qualification, for the status answers (frozen: replaced, not edited)."""

    qid: int
    started_at: dt.datetime
    estimate_seconds: float
    phase: str = "starting"
    concurrency: int | None = None
    repeat: int | None = None
    steps_done: int = 0
    steps_total: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.qid, "started_at": self.started_at.isoformat(),
                "estimate_seconds": round(self.estimate_seconds), "phase": self.phase,
                "concurrency": self.concurrency, "repeat": self.repeat,
                "steps_done": self.steps_done, "steps_total": self.steps_total}


class QualifyService:
    def __init__(self, config: Config, db: Database, clock: Clock, supervisor: Supervisor,
                 *, runner_factory: RunnerFactory | None = None) -> None:
        self.config, self.db, self.clock, self.supervisor = config, db, clock, supervisor
        self._factory = runner_factory or self._default_runner
        self._task: asyncio.Task[None] | None = None
        self._cancel = asyncio.Event()
        self._progress: Progress | None = None

    def _default_runner(self, settings: plan.Settings) -> LoadRunner:
        return LoadRunner(engine_url(self.config),
                          api_key=read_engine_api_key(self.config.paths.state_dir),
                          model=self.config.engine.served_model_name,
                          wedge_seconds=settings.wedge_seconds)

    # --- life ----------------------------------------------------------------------------

    async def start_service(self) -> None:
        """A run the last daemon left is over: close it as interrupted, open the gateway."""
        now = self.clock.now()

        def recover(s: Session) -> None:
            if ledger.interrupt_running(s, now):
                add_event(s, at=now, severity="warning", source="qualify",
                          message="a qualification was interrupted by a daemon restart; the "
                                  "gateway admits users again")
            write_qualifying(s, None)

        await self.db.run(recover)

    async def stop_service(self) -> None:
        """The daemon stops: end a run now (recorded as interrupted), gateway opened."""
        task = self._task
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    # --- reading -------------------------------------------------------------------------

    @property
    def progress(self) -> Progress | None:
        return self._progress if self.running else None

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def spec_hash(self) -> str | None:
        """The running engine's launch-spec hash (what a qualification belongs to)."""
        return self.supervisor.running_spec_hash

    async def current(self) -> ledger.Record | None:
        """The running spec's qualification (None: unqualified, or no engine running)."""
        spec = self.spec_hash()
        if spec is None:
            return None
        return await self.db.run(lambda s: ledger.qualification_for(s, spec))

    async def history(self) -> list[ledger.Record]:
        return await self.db.run(ledger.list_qualifications)

    async def get(self, qid: int) -> ledger.Record:
        record = await self.db.run(lambda s: ledger.get_qualification(s, qid))
        if record is None:
            raise ApplianceError("qualification_not_found", f"no qualification {qid}",
                                 "list them with `appliance qualify list`", status=404)
        return record

    async def status(self) -> dict[str, Any]:
        """The state, the progress of a run, and the running spec's standing."""
        spec = self.spec_hash()
        current = await self.current()
        latest = await self.db.run(lambda s: ledger.list_qualifications(s, 1))
        state = "running" if self.running else (latest[0].state if latest else "idle")
        return {"state": state, "progress": self.progress.to_dict() if self.progress else None,
                "spec_hash": spec, "engine_state": self.supervisor.status.state.value,
                "qualified": current.qualified if current else None,
                "qualification": current.to_dict(steps=False) if current else None,
                "standing": standing(spec, current)}

    # --- planning and running -------------------------------------------------------------

    async def preview(self, request: Request) -> Planned:
        """The settings a run would use on this engine now, and how long it would take."""
        state = self.supervisor.status.state
        spec = self.spec_hash()
        if state is not EngineState.READY or spec is None:
            raise ApplianceError(
                "engine_not_ready", f"the engine is {state.label}; a qualification measures a "
                "serving engine", "start the engine and wait for READY, then qualify",
                status=409)
        info = await self.supervisor.client.server_info() or {}
        limit = _capacity(info)
        version = str(info.get("version", ""))[:64]
        workload = await self._workload(request)
        try:
            steps = (plan.custom_ladder(request.ladder, limit) if request.ladder
                     else plan.ladder(limit or 0))
            settings = plan.Settings(workload, steps, request.floor, request.ttft_p90_max,
                                     request.repeats, request.wedge_seconds, limit)
        except plan.PlanError as exc:
            raise ApplianceError("qualify_invalid", exc.message if exc.field == "workload"
                                 else f"{exc.field}: {exc.message}",
                                 "correct it and ask again", status=422) from None
        return Planned(settings, plan.estimate_seconds(settings), spec, version)

    async def _workload(self, request: Request) -> plan.Workload:
        name = request.workload.strip()
        try:
            if name == "harsh":
                return plan.harsh(request.input_tokens or plan.HARSH_INPUT,
                                  request.output_tokens or plan.HARSH_OUTPUT)
            if name.startswith("profile:"):
                from appliance.tuning.store import find_profile

                profile = await self.db.run(lambda s: find_profile(s, name[8:]))
                return plan.from_profile(profile)
            if name == "replay":
                since = self.clock.now() - dt.timedelta(days=REPLAY_DAYS)
                return plan.from_usage(await self.db.run(lambda s: _usage_pairs(s, since)))
        except plan.PlanError as exc:
            raise ApplianceError("qualify_invalid", exc.message, "choose another workload",
                                 status=422) from None
        except ApplianceError as exc:
            raise replace_status(exc, 422) from None
        raise ApplianceError("qualify_invalid", f"unknown workload {name!r}",
                             "give harsh, profile:NAME (a tuning profile) or replay",
                             status=422)

    async def start(self, request: Request, *, actor: str, confirm: bool) -> ledger.Record:
        """Start a qualification (refused without `confirm`: the gateway refuses users)."""
        if self.running:
            which = f" {self._progress.qid}" if self._progress is not None else ""
            raise ApplianceError("qualify_running", f"qualification{which} is already running",
                                 "wait for it, or cancel it", status=409)
        planned = await self.preview(request)
        if not confirm:
            raise ApplianceError("confirmation_required", summary(planned),
                                 "repeat with confirm=true (`--yes`; the console asks for you)",
                                 status=409)
        now = self.clock.now()
        tuning = await self.db.run(_tuning_words)
        record = await self.db.run(lambda s: ledger.open_qualification(
            s, spec_hash=planned.spec_hash, at=now, by=actor,
            engine_version=planned.engine_version, tuning=tuning, settings=planned.settings))
        await self._close_gateway(now + dt.timedelta(seconds=planned.estimate_seconds))
        self._cancel = asyncio.Event()
        self._progress = Progress(record.id, now, planned.estimate_seconds,
                                  steps_total=len(planned.settings.ladder))
        self._task = asyncio.get_running_loop().create_task(self._run(record, planned.settings))
        return record

    async def cancel(self) -> bool:
        """Ask the running qualification to stop (it ends its round and opens the gateway);
        False when none runs."""
        if not self.running:
            return False
        self._cancel.set()
        return True

    async def wait(self) -> None:
        """Until the running qualification (if any) has ended (tests, the daemon's stop)."""
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(self._task)

    # --- the run ---------------------------------------------------------------------------

    async def _close_gateway(self, ends_at: dt.datetime | None = None) -> None:
        """Take or renew the lease; `ends_at` (at the start): when the run should end, which
        the gateway's refusals tell users."""
        until = self.clock.now() + dt.timedelta(seconds=LEASE_SECONDS)
        await self.db.run(lambda s: write_qualifying(s, until, ends_at))

    async def _renew(self) -> None:
        while True:
            await asyncio.sleep(RENEW_SECONDS)
            try:
                await self._close_gateway()
            except Exception:
                log.exception("could not renew the gateway's qualification lease")

    async def _run(self, record: ledger.Record, settings: plan.Settings) -> None:
        steps: list[Step] = []
        state, error = "done", ""
        renew = asyncio.get_running_loop().create_task(self._renew())
        runner = self._factory(settings)
        try:
            await self._event("info", f"qualification {record.id} started: "
                              f"{settings.workload.describe()}")
            await self._drain()
            state = await self._climb(record.id, settings, runner, steps)
        except asyncio.CancelledError:
            state, error = "interrupted", "the daemon stopped while it ran"
            raise
        except Exception as exc:
            log.exception("qualification %s failed", record.id)
            state, error = "failed", str(exc) or type(exc).__name__
        finally:
            renew.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await renew
            await self._finish(record.id, settings, tuple(steps), state, error)
            await runner.aclose()

    async def _drain(self) -> None:
        """Users' requests already in the engine finish before the first flush."""
        deadline = self.clock.monotonic() + DRAIN_SECONDS
        self._set(phase="waiting for users' requests to finish")
        while True:
            left = await self.supervisor.client.in_flight()
            if not left:
                return
            if self.clock.monotonic() > deadline or self._cancel.is_set():
                if self._cancel.is_set():
                    return
                raise RuntimeError(f"{left} users' requests were still running in the engine "
                                   f"after {DRAIN_SECONDS:.0f} s")
            await asyncio.sleep(0.5)

    async def _climb(self, qid: int, settings: plan.Settings, runner: LoadRunner,
                     steps: list[Step]) -> str:
        for index, concurrency in enumerate(settings.ladder):
            rounds: list[Round] = []
            for repeat in range(1, settings.repeats + 1):
                if self._cancel.is_set():
                    return "cancelled"
                if self.supervisor.status.state is not EngineState.READY:
                    raise RuntimeError(f"the engine left READY (it is "
                                       f"{self.supervisor.status.state.label})")
                self._set(phase="flushing the prefix cache", concurrency=concurrency,
                          repeat=repeat)
                await runner.flush_cache(self._cancel)
                self._set(phase="measuring")
                result = await runner.run_round(settings.workload, concurrency,
                                                f"q{qid}c{concurrency}r{repeat}", self._cancel)
                if result.cancelled:
                    return "cancelled"
                rounds.append(round_of(concurrency, repeat, result.samples, result.seconds,
                                       wedged=result.wedged, kv_peak=result.kv_peak,
                                       state_peak=result.state_peak))
                if result.wedged:
                    break  # back off: no more load on a wedged engine
            step = judge(concurrency, rounds, floor=settings.floor,
                         ttft_p90_max=settings.ttft_p90_max, repeats=settings.repeats)
            steps.append(step)
            self._set(steps_done=index + 1)
            await self.db.run(partial(ledger.save_steps, qid=qid, steps=tuple(steps)))
            if not step.passed:
                break
        return "done"

    async def _finish(self, qid: int, settings: plan.Settings, steps: tuple[Step, ...],
                      state: str, error: str) -> None:
        """Record the end and open the gateway, whatever happened (shielded: a daemon stop
        that cancelled the run must still get here)."""
        point = qualified_point(steps) if state == "done" else None
        words = (verdict_words(point, settings.floor, settings.ttft_p90_max, steps)
                 if state == "done" else f"{state}: {error}" if error else state)
        now = self.clock.now()

        def close(s: Session) -> None:
            ledger.close_qualification(s, qid, state=state, at=now, steps=steps,
                                       qualified=point, verdict=words, error=error)
            write_qualifying(s, None)
            add_event(s, at=now, severity="info" if state == "done" else "warning",
                      source="qualify", message=f"qualification {qid} {state}: {words}; the "
                      "gateway admits users again")

        try:
            await asyncio.shield(self.db.run(close))
        except Exception:
            log.exception("could not record the end of qualification %s", qid)
        self._progress = None

    def _set(self, **changes: Any) -> None:
        if self._progress is not None:
            self._progress = replace(self._progress, **changes)

    async def _event(self, severity: str, message: str) -> None:
        now = self.clock.now()
        await self.db.run(lambda s: add_event(s, at=now, severity=severity, source="qualify",
                                              message=message))


def standing(spec: str | None, current: ledger.Record | None) -> str:
    """The box's standing in words (the console's and the CLI's first line)."""
    if spec is None:
        return "no engine is running, so nothing can be qualified"
    if current is None:
        return (f"unqualified: the running engine (spec {spec[:12]}) has never been "
                "qualified")
    return current.verdict


def replace_status(exc: ApplianceError, status: int) -> ApplianceError:
    return ApplianceError(exc.code, exc.message, exc.hint, status=status)


def _capacity(info: dict[str, Any]) -> int | None:
    from appliance.gateway.engine_gate import engine_capacity

    return engine_capacity(info)


def _usage_pairs(session: Session, since: dt.datetime) -> list[tuple[int, int]]:
    rows = session.execute(
        select(UsageRequest.prompt_tokens, UsageRequest.completion_tokens)
        .where(UsageRequest.started_at >= since, UsageRequest.status == 200,
               UsageRequest.completion_tokens > 0)
        .order_by(UsageRequest.id.desc()).limit(REPLAY_ROWS)).all()
    return [(int(p), int(c)) for p, c in rows]


def _tuning_words(session: Session) -> str:
    from appliance.tuning.store import get_choice

    choice = get_choice(session)
    if choice is None:
        return "defaults (no split applied)"
    if choice.pin is not None:
        return f"profile {choice.profile}, state pool pinned at {choice.pin} slots"
    return f"profile {choice.profile}, --mamba-full-memory-ratio {choice.ratio:g}"
