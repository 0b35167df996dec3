"""The qualification service: one qualification at a time, off the request path.

idle → running → done | cancelled | failed (and `interrupted`, written at the next start, for
one a daemon stop or crash cut short). A run needs a READY engine and a confirmation: it
closes the gateway to users for its whole duration, which the plan estimates first.

Closing the gateway is a lease on the engine status row (`publish.write_qualifying`): the
daemon renews it every few seconds while the run lasts and clears it when the run ends, how
ever it ends. A daemon that dies without clearing it leaves it to lapse within
`LEASE_SECONDS`, and the next start clears it at once, so no restart leaves users refused.

The run: wait for the engine to finish what users had in flight, then climb the ladder
(`appliance.qualify.climb`: every step repeated, each repeat after a prefix-cache flush; a
transient loss of READY pauses the step and measures it again, bounded). A step that fails
(or a wedge) ends the climb: the qualified point is below it. Steps are saved as they
finish. A climb the engine cut short keeps its passed steps: the box is qualified for at
least the last of them, and the verdict says what was not measured. A ladder whose every
step passed is a lower bound ("at least N"), and can be continued from N
(`Request.continue_from`).

Figures are in the engine's time: a time-scaled emulator says its scale in `/server_info`
(`emulator_time_scale`, wall seconds per engine second) and the runner's clock runs at it, so
a demo measures the modelled box, not the scale. Real SGLang: scale 1.

An expected end (the engine would not drain, a cancel) is logged as a warning in one line;
only an unforeseen error is logged with its traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
from collections.abc import Callable
from dataclasses import replace
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
from appliance.qualify.climb import READY_WAIT_SECONDS, Climbed, Climber
from appliance.qualify.outcome import (
    Planned,
    Progress,
    Request,
    outcome,
    standing,
    summary,
    time_scale_of,
)
from appliance.qualify.promises import ttft_for
from appliance.qualify.runner import LoadRunner
from appliance.qualify.verdict import Step
from appliance.secrets import read_engine_api_key

log = logging.getLogger(__name__)
LEASE_SECONDS = 30.0
RENEW_SECONDS = 5.0
DRAIN_SECONDS = 120.0   # users' requests already in the engine get this long to finish
REPLAY_DAYS = 7
REPLAY_ROWS = 10_000

RunnerFactory = Callable[[plan.Settings], LoadRunner]


class QualifyService:
    def __init__(self, config: Config, db: Database, clock: Clock, supervisor: Supervisor,
                 *, runner_factory: RunnerFactory | None = None,
                 ready_wait: float = READY_WAIT_SECONDS) -> None:
        self.config, self.db, self.clock, self.supervisor = config, db, clock, supervisor
        self.ready_wait = ready_wait  # a paused step waits this long for READY
        self._factory = runner_factory or self._default_runner
        self._task: asyncio.Task[None] | None = None
        self._cancel = asyncio.Event()
        self._progress: Progress | None = None

    def _default_runner(self, settings: plan.Settings) -> LoadRunner:
        return LoadRunner(engine_url(self.config),
                          api_key=read_engine_api_key(self.config.paths.state_dir),
                          model=self.config.engine.served_model_name,
                          wedge_seconds=settings.wedge_seconds,
                          time_scale=settings.time_scale)  # measured in the engine's time

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
        scale = time_scale_of(info)
        if request.continue_from is not None:
            return await self._continued(request, spec, limit, version, scale)
        workload = await self._workload(request)
        try:
            steps = (plan.custom_ladder(request.ladder, limit) if request.ladder
                     else plan.ladder(limit or 0))
            ttft = ttft_for(request.ttft_p90_max, request.ttft_from_class,
                            self.config.gateway.classes)
            settings = plan.Settings(workload, steps, request.floor, ttft,
                                     request.repeats, request.wedge_seconds, limit,
                                     time_scale=scale)
        except plan.PlanError as exc:
            raise _invalid(exc) from None
        return Planned(settings, plan.estimate_seconds(settings), spec, version)

    async def _continued(self, request: Request, spec: str, limit: int | None, version: str,
                         scale: float) -> Planned:
        """A run that climbs on from a lower-bound qualification of the running spec: its
        settings (else the steps would not compare), its passed steps kept, the steps above
        its top measured."""
        qid = request.continue_from
        previous = await self.get(qid) if qid is not None else None
        if previous is None or previous.spec_hash != spec or not previous.lower_bound:
            raise ApplianceError(
                "qualify_invalid", f"qualification {qid} cannot be continued: only a finished "
                "qualification of the running configuration whose every step passed can",
                "run a new qualification instead (`appliance qualify run`)", status=422)
        try:
            ladder = plan.continued([s.concurrency for s in previous.steps], limit,
                                    request.ladder)
            settings = replace(previous.settings, ladder=ladder, max_running_requests=limit,
                               time_scale=scale, continues=previous.id)
        except plan.PlanError as exc:
            raise _invalid(exc) from None
        done = [s.concurrency for s in previous.steps]
        return Planned(settings, plan.estimate_seconds(settings, done), spec, version,
                       previous.steps)

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
                                  steps_done=len(planned.carried),
                                  steps_total=len(planned.settings.ladder))
        self._task = asyncio.get_running_loop().create_task(
            self._run(record, planned.settings, list(planned.carried)))
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

    async def _run(self, record: ledger.Record, settings: plan.Settings,
                   steps: list[Step]) -> None:
        climbed = Climbed("failed")
        error = ""
        renew = asyncio.get_running_loop().create_task(self._renew())
        runner = self._factory(settings)
        try:
            await self._event("info", f"qualification {record.id} started: "
                              f"{settings.workload.describe()}")
            await self._drain()
            climbed = await self._climber(record.id, settings, runner).climb(steps)
        except asyncio.CancelledError:
            climbed, error = Climbed("interrupted"), "the daemon stopped while it ran"
            raise
        except RuntimeError as exc:  # expected: the engine would not drain
            log.warning("qualification %s could not run: %s", record.id, exc)
            error = str(exc)
        except Exception as exc:  # unforeseen: a bug, with its traceback
            log.exception("qualification %s failed", record.id)
            error = str(exc) or type(exc).__name__
        finally:
            renew.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await renew
            await self._finish(record.id, settings, tuple(steps), climbed, error)
            await runner.aclose()

    def _climber(self, qid: int, settings: plan.Settings, runner: LoadRunner) -> Climber:
        def ready() -> bool:
            return self.supervisor.status.state is EngineState.READY

        async def save(steps: tuple[Step, ...]) -> None:
            await self.db.run(partial(ledger.save_steps, qid=qid, steps=steps))

        return Climber(runner, settings, qid, self._cancel, ready=ready,
                       state_label=lambda: self.supervisor.status.state.label,
                       progress=self._set, save=save,
                       note=lambda words: self._event("warning", words),
                       monotonic=self.clock.monotonic, ready_wait=self.ready_wait)

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

    async def _finish(self, qid: int, settings: plan.Settings, steps: tuple[Step, ...],
                      climbed: Climbed, error: str) -> None:
        """Record the end and open the gateway, whatever happened (shielded: a daemon stop
        that cancelled the run must still get here)."""
        state, point, words = outcome(settings, steps, climbed, error)
        now = self.clock.now()

        def close(s: Session) -> None:
            ledger.close_qualification(s, qid, state=state, at=now, steps=steps,
                                       qualified=point, verdict=words,
                                       error=error or climbed.stopped)
            write_qualifying(s, None)
            add_event(s, at=now, severity="info" if state == "done" else "warning",
                      source="qualify", message=f"qualification {qid} ended — {words}; the "
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


def _invalid(exc: plan.PlanError) -> ApplianceError:
    return ApplianceError("qualify_invalid", exc.message if exc.field == "workload"
                          else f"{exc.field}: {exc.message}", "correct it and ask again",
                          status=422)


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
