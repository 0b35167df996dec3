"""The supervisor: the only writer of engine state.

Start, stop and restart arrive through one queue and run one at a time; a command that is
already waiting or running is not queued twice (a double click is one action). While an
engine lives, one watcher task follows its log and its other signals, moves the state along
the start phases, declares a load hung only when no signal moved for the configured window,
classifies an exit, and applies the retry policy. Every run is recorded in the database.

The rules live in `states` and `progress` (pure); this module does the IO around them.
Blocking calls (process launch, psutil, NVML, file reads, the database) go to threads.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import dataclasses
import datetime as dt
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from appliance.clock import Clock
from appliance.config import Config
from appliance.db.database import Database
from appliance.db.journal import add_event
from appliance.engine import logparse
from appliance.engine.args import LaunchSpec, build_launch_spec, inputs_from_config
from appliance.engine.client import EngineClient
from appliance.engine.logreport import render_json
from appliance.engine.preflight import WEIGHTS_CHECKS, blocking, evaluate, gather_facts
from appliance.engine.progress import Signals, Tracker, estimate, is_hung, observe, stalled_for
from appliance.engine.records import (
    RunRecord,
    get_desired,
    latest_open_run,
    open_run,
    past_ready_seconds,
    set_desired,
    update_run,
)
from appliance.engine.runner import EngineIdentity, EngineRunner, tree_pids
from appliance.engine.states import (
    LIVE,
    SERVING,
    STARTING,
    Command,
    EngineState,
    admits_requests,
    decide_after_crash,
    later_start_phase,
    reason_from_exit,
    refusal,
    stop_outcome,
)
from appliance.engine.validate import validate_launch_spec
from appliance.errors import ApplianceError

if TYPE_CHECKING:
    from appliance.weights.views import Verdict
from appliance.gpu.port import GpuPort, snapshot_with_timeout

log = logging.getLogger(__name__)

PHASE_STATE = {
    logparse.Phase.LAUNCHING: EngineState.LAUNCHING,
    logparse.Phase.LOADING_WEIGHTS: EngineState.LOADING_WEIGHTS,
    logparse.Phase.ALLOCATING: EngineState.ALLOCATING,
    logparse.Phase.CAPTURING_GRAPHS: EngineState.CAPTURING_GRAPHS,
    logparse.Phase.WARMING: EngineState.WARMING,
    logparse.Phase.READY: EngineState.WARMING,  # READY also needs a good /health_generate
}
NVML_TIMEOUT = 10.0


@dataclass(frozen=True)
class EngineStatus:
    """What the console, the API, the CLI and the gateway read. Frozen: replaced, not edited."""

    state: EngineState = EngineState.STOPPED
    since: dt.datetime | None = None
    message: str = "stopped"
    run_id: int | None = None
    attempt: int = 0
    adopted: bool = False
    percent: float | None = None
    eta_seconds: float | None = None
    eta_basis: str = ""
    stalled_seconds: float = 0.0
    hung: bool = False
    bytes_read: int = 0
    weights_bytes: int | None = None
    gpu_bytes_used: int = 0
    log: logparse.LogState | None = None
    reason: str | None = None
    hint: str = ""
    next_retry_at: dt.datetime | None = None
    pending: str | None = None
    rollback_available: bool = False
    expected_start_seconds: float | None = None
    # False only before the daemon's first reconcile: the state is an initial guess then, and
    # the publisher keeps the last published one (a restarted daemon costs users nothing).
    reconciled: bool = True

    @property
    def admits_requests(self) -> bool:
        return admits_requests(self.state)


@dataclass
class _Live:
    """The engine being watched: its identity, its log cursor and its signals."""

    run: RunRecord
    ident: EngineIdentity
    spec: LaunchSpec | None
    splitter: logparse.LineSplitter = field(default_factory=logparse.LineSplitter)
    offset: int = 0
    parsed: logparse.LogState = field(default_factory=logparse.initial)
    tracker: Tracker | None = None
    # A UTF-8 character may straddle two reads; an incremental decoder keeps it whole.
    decoder: codecs.IncrementalDecoder = field(
        default_factory=lambda: codecs.getincrementaldecoder("utf-8")(errors="replace"))
    pids: set[int] = field(default_factory=set)
    stopping: bool = False
    view: logparse.LogState | None = None  # parsed, plus a bar state not yet terminated

    @property
    def shown(self) -> logparse.LogState:
        return self.view or self.parsed


def with_pending_bar(parsed: logparse.LogState, pending: str) -> logparse.LogState:
    """The parsed log plus the newest progress-bar state, which tqdm leaves unterminated."""
    if "% Completed |" in pending and pending.rstrip().endswith("]"):
        return logparse.feed(parsed, pending)
    return parsed


def weights_bytes(model_dir: Path) -> int | None:
    """Total size of the checkpoint's safetensors files (the load's byte target)."""
    try:
        total = sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))
    except OSError:
        return None
    return total or None


def _read_new(path: Path, offset: int, limit: int = 4 << 20) -> tuple[bytes, int]:
    try:
        with path.open("rb") as handle:
            size = handle.seek(0, 2)
            if size < offset:  # the file was truncated or replaced: start over
                offset = 0
            handle.seek(offset)
            data = handle.read(limit)
    except OSError:
        return b"", offset
    return data, offset + len(data)


class WeightsGate(Protocol):
    """The weights service's answer to "may these weights be launched?" (preflight)."""

    async def launch_verdict(self) -> Verdict: ...

    async def prewarm_for_launch(self, report: Callable[[str], None]) -> str | None: ...


class Supervisor:
    def __init__(
        self,
        *,
        config: Config,
        db: Database,
        clock: Clock,
        runner: EngineRunner,
        gpus: GpuPort,
        client: EngineClient,
        weights: WeightsGate,
        poll_interval: float = 1.0,
        ready_interval: float = 5.0,
        backoff_base: float = 30.0,
    ) -> None:
        self.config = config
        self.db = db
        self.clock = clock
        self.runner = runner
        self.gpus = gpus
        self.client = client
        self.weights = weights
        self.poll_interval = poll_interval
        self.ready_interval = ready_interval
        self.backoff_base = backoff_base
        self._status = EngineStatus(since=clock.now(), reconciled=False)
        self._queue: asyncio.Queue[tuple[Command, str, int, asyncio.Future[EngineStatus]]] | None
        self._queue = None
        self._pending: dict[Command, asyncio.Future[EngineStatus]] = {}
        self._tasks: list[asyncio.Task[Any]] = []
        self._live: _Live | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._retry: asyncio.Task[None] | None = None
        self._listeners: list[Callable[[EngineStatus], None]] = []
        self._history: list[float] = []
        # Run-record writes are read-modify-write (the phase list): one at a time, in order.
        self._run_writes = asyncio.Lock()
        # The tuning layer of the launch spec (the applied memory split; tuning/service.py).
        self.tuning_args: tuple[tuple[str, str | None], ...] = ()
        # The box's cell role (appliance.cell.role_choice: the head may change it; the
        # composition root reads the stored choice), None: the configuration's cell.role.
        self.role: str | None = None
        # Why the serving engine is failing, by source ("ready": this watcher's /ready probe
        # and the first generation; "health": the health monitor). DEGRADED while any is set.
        self._failures: dict[str, tuple[str, str]] = {}
        self._degraded_at: float | None = None  # monotonic, when it last turned DEGRADED

    # --- reading ------------------------------------------------------------------------

    @property
    def status(self) -> EngineStatus:
        return self._status

    @property
    def model_dir(self) -> Path:
        return self.config.paths.models_dir / self.config.engine.model.replace("/", "--")

    @property
    def running_spec_hash(self) -> str | None:
        """The spec hash of the engine being followed now (None when none is)."""
        return self._live.run.spec_hash if self._live is not None else None

    def start_cost(self) -> str:
        """What a start costs on this box, in words (the median of recent starts)."""
        typical = self._status.expected_start_seconds
        if typical is None:
            return ("a cold start of Kimi K3 takes about 90 minutes (no start measured on "
                    "this box yet)")
        took = f"{typical:.0f} seconds" if typical < 90 else f"{typical / 60:.0f} minutes"
        return f"a start takes about {took} on this box (median of recent starts)"

    @property
    def log_path(self) -> Path:
        """The engine's output as the runner places it (the systemd unit's own directory)."""
        return self.runner.engine_log(self.config.paths.log_dir)

    def engine_pids(self) -> frozenset[int]:
        """The processes of the engine being followed (its whole tree, as seen so far)."""
        return frozenset(self._live.pids) if self._live is not None else frozenset()

    @property
    def degraded_seconds(self) -> float | None:
        """How long the engine has been DEGRADED (None when it is not)."""
        if self._status.state is not EngineState.DEGRADED or self._degraded_at is None:
            return None
        return self.clock.monotonic() - self._degraded_at

    async def report_health(self, source: str, failure: str | None, hint: str = "") -> None:
        """A check's verdict on the serving engine: `failure` says what fails, None that it
        is healthy again. READY turns DEGRADED while any source reports a failure and back
        to READY once none does. Anything but a serving engine is ignored: a check never
        changes a starting, stopping or stopped engine, and never restarts anything."""
        if self._status.state not in SERVING:
            return
        if failure is None:
            if self._failures.pop(source, None) is None:
                return
        else:
            self._failures[source] = (failure, hint)
        await self._settle()

    async def _settle(self) -> None:
        state = self._status.state
        if self._failures and state is EngineState.READY:
            failure, hint = next(iter(self._failures.values()))
            self._transition(EngineState.DEGRADED, f"alive but failing: {failure}; not "
                             "restarted", hint=hint or "look at the engine log; restart it "
                             "yourself if it does not recover")
            await self._event("warning", f"engine degraded: {failure} (alive, not restarted;"
                                         " new requests are refused until it recovers)")
        elif not self._failures and state is EngineState.DEGRADED:
            self._transition(EngineState.READY, "serving again", hint="")
            await self._event("info", "engine recovered: serving again")

    def on_change(self, listener: Callable[[EngineStatus], None]) -> None:
        self._listeners.append(listener)

    # --- service lifecycle ----------------------------------------------------------------

    async def start_service(self) -> None:
        """Adopt whatever engine is running, converge on the desired state, then serve."""
        self._queue = asyncio.Queue()
        self._history = await self.db.run(past_ready_seconds)
        desired = await self.db.run(get_desired)
        self._set(rollback_available=desired.last_good_spec_json is not None,
                  expected_start_seconds=self._typical_start())
        self._tasks.append(asyncio.create_task(self._commands()))
        try:
            await self._reconcile(desired.running)
        except ApplianceError as exc:
            # The console must come up even when the engine cannot be seen (systemctl
            # refused, a broken unit): say so, and let the operator act.
            await self._event("error", f"cannot tell whether an engine runs: {exc.message}")
            self._transition(EngineState.STOPPED, f"engine state unknown: {exc.message}",
                             reason="runner_unavailable", hint=exc.hint)
        finally:
            self._set(reconciled=True)  # the gateway may now see what was found

    async def stop_service(self) -> None:
        """The daemon is going down: stop watching. The engine keeps running (by design)."""
        for task in [*self._tasks, self._watcher, self._retry]:
            if task is not None:
                task.cancel()
        for task in [*self._tasks, self._watcher, self._retry]:
            if task is not None:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        self._tasks.clear()

    # --- commands -----------------------------------------------------------------------

    def submit(self, command: Command, actor: str,
               attempt: int = 1) -> asyncio.Future[EngineStatus]:
        """Queue a command; a command already waiting or running is the same action.

        Retries after a crash come through here too (with their attempt number), so every
        start and stop, the operator's or the supervisor's, runs one at a time in order.
        """
        assert self._queue is not None, "start_service() first"
        if command in self._pending:
            return self._pending[command]
        why = refusal(self._status.state, command)
        future: asyncio.Future[EngineStatus] = asyncio.get_running_loop().create_future()
        if why is not None:
            future.set_exception(ApplianceError(
                "engine_command_refused", f"cannot {command.value} the engine: {why}",
                "wait for the current action to finish, or look at the engine page",
                status=409))
            return future
        self._pending[command] = future
        self._queue.put_nowait((command, actor, attempt, future))
        self._set(pending=command.value)
        return future

    async def _commands(self) -> None:
        assert self._queue is not None
        while True:
            command, actor, attempt, future = await self._queue.get()
            try:
                if command is Command.START:
                    await self._start(actor, attempt=attempt)
                elif command is Command.ROLLBACK:
                    await self._start(actor, spec=await self._last_good_spec())
                elif command is Command.STOP:
                    await self._stop(actor)
                else:
                    await self._stop(actor)
                    await self._start(actor)
                if not future.done():
                    future.set_result(self._status)
            except Exception as exc:  # a command's failure is reported, never kills the queue
                if not isinstance(exc, ApplianceError):
                    log.exception("engine command %s failed", command.value)
                if not future.done():
                    future.set_exception(exc)
            finally:
                self._pending.pop(command, None)
                self._set(pending=None)

    # --- start ----------------------------------------------------------------------------

    async def _last_good_spec(self) -> LaunchSpec:
        desired = await self.db.run(get_desired)
        if desired.last_good_spec_json is None:
            raise ApplianceError(
                "no_rollback", "no launch configuration has reached READY on this box yet",
                "start the engine with the current configuration instead", status=409)
        return LaunchSpec.from_json(desired.last_good_spec_json)

    @property
    def cell_role(self) -> str:
        """The cell role the engine launches with: the head's choice, else `cell.role`."""
        return self.role or self.config.cell.role

    def current_spec(self, role: str | None = None) -> LaunchSpec:
        """The spec a start would launch now (pure: config → argv with provenance); `role`:
        the spec it would launch in that cell role instead."""
        return build_launch_spec(self.config.engine.command,
                                 inputs_from_config(self.config, tuning_args=self.tuning_args,
                                                    role=role or self.role))

    async def _start(self, actor: str, attempt: int = 1, spec: LaunchSpec | None = None) -> None:
        if self._retry is not None and not self._retry.done() and attempt == 1:
            self._retry.cancel()  # an operator's start replaces a pending retry
        now = self.clock.now()
        await self.db.run(lambda s: set_desired(s, running=True, at=now, by=actor))
        self._transition(EngineState.PREFLIGHT, "checking the box before a launch",
                         attempt=attempt, reason=None, hint="", next_retry_at=None, hung=False,
                         percent=0.0, adopted=False)
        verdict = await self.weights.launch_verdict()
        facts = await asyncio.to_thread(
            gather_facts, self.config, self.gpus, weights_verified=verdict.verified,
            weights_detail=verdict.message, weights_hint=verdict.hint, role=self.cell_role)
        problems = blocking(evaluate(facts, self.config))
        if problems and verdict.waiting and all(p.name in WEIGHTS_CHECKS for p in problems):
            # A fresh box's first start: the weights are on their way. Not a failure: the
            # engine starts by itself once they are proven (runtime.start_when_waiting).
            await self._event("info", f"the engine waits for the weights ({verdict.message})")
            self._transition(EngineState.STOPPED, verdict.message,
                             reason="waiting_for_weights", hint=verdict.hint)
            raise ApplianceError("waiting_for_weights", verdict.message, verdict.hint,
                                 status=409)
        if problems:
            summary = "; ".join(p.message for p in problems)
            hint = " ".join(p.hint for p in problems)
            await self._event("error", f"engine not started, preflight failed: {summary}")
            self._transition(EngineState.STOPPED, f"preflight failed: {summary}",
                             reason="preflight", hint=hint)
            raise ApplianceError("preflight_failed", f"preflight failed: {summary}", hint,
                                 status=409)
        spec = spec or self.current_spec()
        checked = await asyncio.to_thread(validate_launch_spec, spec, self.config.engine.venv)
        if checked.ok:  # the load reads 1.56 TB: from memory if the box has room for it
            await self.weights.prewarm_for_launch(
                lambda line: self._transition(EngineState.PREFLIGHT, line))
        if not checked.ok:
            details = "; ".join(p.message for p in checked.problems)
            hint = " ".join(p.hint for p in checked.problems if p.hint) or (
                "fix engine.extra_args or the tuning profile, then start again")
            await self._event("error", f"engine argv rejected by the {checked.method}: {details}")
            self._transition(EngineState.FAILED, f"bad argument: {details}",
                             reason="bad_argument", hint=hint)
            raise ApplianceError("engine_bad_argument", f"bad engine argument: {details}", hint,
                                 status=422)
        self._transition(EngineState.LAUNCHING, "launching the engine")
        # (the runner makes the log's directory where it may: the systemd unit's is tmpfiles')
        offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        try:
            ident = await asyncio.to_thread(self.runner.launch, spec, self.log_path)
        except (ApplianceError, OSError) as exc:
            message = exc.message if isinstance(exc, ApplianceError) else str(exc)
            hint = exc.hint if isinstance(exc, ApplianceError) else (
                "check engine.command and that the engine's program exists")
            await self._event("error", f"engine launch failed: {message}")
            self._transition(EngineState.FAILED, f"launch failed: {message}",
                             reason="launch_failed", hint=hint)
            raise ApplianceError("engine_launch_failed", f"engine launch failed: {message}",
                                 hint, status=500) from exc
        at = self.clock.now()
        run = await self.db.run(lambda s: open_run(
            s, at=at, runner=self.runner.name, spec_hash=spec.spec_hash, spec_json=spec.to_json(),
            attempt=attempt, state=EngineState.LAUNCHING.value, log_path=str(self.log_path),
            identity_json=ident.to_json()))
        await self._event("info", f"engine launched (pid {ident.pid}, attempt {attempt}, "
                                  f"{self.runner.name} runner)")
        live = _Live(run=run, ident=ident, spec=spec, offset=offset,
                     tracker=Tracker.begin(self.clock.monotonic()), pids={ident.pid})
        self._follow(live)

    def _follow(self, live: _Live) -> None:
        self._live = live
        self._failures.clear()  # a new engine: earlier verdicts were about another one
        self._set(run_id=live.run.id, log=live.parsed)
        self._watcher = asyncio.create_task(self._watch(live))

    # --- watching -------------------------------------------------------------------------

    async def _watch(self, live: _Live) -> None:
        # The byte target of the load: a directory listing, so off the event loop.
        self._set(weights_bytes=await asyncio.to_thread(weights_bytes, self.model_dir))
        last_ready_probe = -1e9
        polls = 0
        gpu_used = 0
        while True:
            await asyncio.sleep(self.poll_interval)
            polls += 1
            data, live.offset = await asyncio.to_thread(_read_new, self.log_path, live.offset)
            for record in live.splitter.feed(live.decoder.decode(data)):
                live.parsed = logparse.feed(live.parsed, record)
            live.view = with_pending_bar(live.parsed, live.splitter.pending)
            alive = await asyncio.to_thread(self.runner.alive, live.ident)
            if alive:
                live.pids.update(await asyncio.to_thread(tree_pids, live.ident.pid))
            if not alive:
                for record in live.splitter.flush():
                    live.parsed = logparse.feed(live.parsed, record)
                await self._ended(live)
                return
            if live.stopping:
                self._set(log=live.shown)
                continue
            state = self._status.state
            if state in STARTING or state is EngineState.ADOPTED:
                if polls % 5 == 1:
                    gpu_used = await self._gpu_bytes(gpu_used)
                await self._progress(live, gpu_used)
                if live.parsed.ready and self._status.state is EngineState.WARMING:
                    await self._first_ready(live)
            elif state in SERVING:
                now = self.clock.monotonic()
                if now - last_ready_probe >= self.ready_interval:
                    last_ready_probe = now
                    ok = await self.client.ready()
                    await self.report_health("ready", None if ok else "/ready fails")
                self._set(log=live.shown)

    async def _gpu_bytes(self, previous: int) -> int:
        """GPU memory in use on all GPUs; an NVML error is no reading, not zero bytes."""
        snapshot = await asyncio.to_thread(snapshot_with_timeout, self.gpus, NVML_TIMEOUT)
        if not snapshot.ok:
            return previous
        return sum(g.memory_used_bytes for g in snapshot.gpus)

    async def _progress(self, live: _Live, gpu_used: int) -> None:
        parsed = live.shown
        target = PHASE_STATE.get(parsed.phase, EngineState.LAUNCHING)
        current = self._status.state
        base = EngineState.LAUNCHING if current is EngineState.ADOPTED else current
        new_state = later_start_phase(base, target)
        bytes_read = await asyncio.to_thread(self.runner.read_bytes, live.ident, live.pids)
        signals = Signals(new_state, parsed.lines, parsed.shards_done, parsed.shards_total,
                          bytes_read, gpu_used)
        now = self.clock.monotonic()
        assert live.tracker is not None
        live.tracker = observe(live.tracker, signals, now)
        elapsed = (self.clock.now() - live.run.started_at).total_seconds()
        guess = estimate(signals, elapsed, self._status.weights_bytes, self._history)
        stalled = stalled_for(live.tracker, now)
        message = self._describe(new_state, parsed, guess.percent)
        # An adopted engine stays ADOPTED until its log shows where it is.
        moved = (new_state is not EngineState.LAUNCHING if current is EngineState.ADOPTED
                 else new_state is not current)
        if moved:
            self._transition(new_state, message)
        self._set(message=message, percent=guess.percent, eta_seconds=guess.eta_seconds,
                  eta_basis=guess.basis, stalled_seconds=stalled, bytes_read=bytes_read,
                  gpu_bytes_used=gpu_used, log=parsed)
        window = self.config.engine.hung_after_minutes * 60
        if is_hung(live.tracker, now, window):
            await self._hung(live, stalled)

    def _describe(self, state: EngineState, parsed: logparse.LogState, percent: float) -> str:
        if state is EngineState.LOADING_WEIGHTS and parsed.shards_total:
            return (f"loading weights {percent:.0f}% "
                    f"({parsed.shards_done}/{parsed.shards_total} shards)")
        return f"{state.label} {percent:.0f}%"

    async def _first_ready(self, live: _Live) -> None:
        """The log said ready: confirm with a real generation, record the run, then show it.

        The record is written before READY is shown and is shielded from cancellation, so a
        stop that follows at once cannot lose the last-good spec (the rollback target).
        """
        healthy = False
        # An engine that cannot generate (health.generation_probes off: a hybrid on a CPU,
        # whose first forward kills it) is confirmed by /ready alone, never by a generation.
        generates = self.config.health.generation_probes
        for attempt in range(3):  # the port may answer a moment after the line is written
            healthy = await (self.client.health_generate() if generates
                             else self.client.ready())
            if healthy:
                break
            await asyncio.sleep(self.poll_interval * (attempt + 1))
        at = self.clock.now()
        seconds = (at - live.run.started_at).total_seconds()
        figures = render_json(live.parsed)
        spec_json = live.spec.to_json() if live.spec is not None else None
        state = EngineState.READY if healthy else EngineState.DEGRADED

        def record(s: Any) -> None:
            update_run(s, live.run.id, ready_at=at, ready_seconds=None if live.run.adopted
                       else seconds, figures=figures, phase=(state.value, at))
            if healthy and spec_json is not None:
                set_desired(s, at=at, by="supervisor", last_good_spec_json=spec_json)

        await asyncio.shield(self._write_run(record))
        if healthy and not live.run.adopted:
            self._history = [seconds, *self._history][:10]
        self._set(rollback_available=self._status.rollback_available or healthy,
                  expected_start_seconds=self._typical_start())
        if healthy:
            self._transition(state, "ready", percent=100.0, eta_seconds=0.0)
            await self._event("info", f"engine ready after {seconds / 60:.1f} min")
        else:
            # Cleared by the next /ready that answers, as any "ready" failure is.
            probe = "/health_generate" if generates else "/ready"
            self._failures["ready"] = (f"{probe} failed after the ready line", "")
            self._transition(state, f"started but {probe} failed",
                             hint="the engine wrote its ready line but did not answer "
                                  f"{probe}; look at its log")
            await self._event("warning", f"engine started but {probe} failed")

    async def _hung(self, live: _Live, stalled: float) -> None:
        minutes = stalled / 60
        await self._event("error", f"engine load hung: no progress signal moved for "
                                   f"{minutes:.0f} min in {self._status.state.label}")
        live.stopping = True
        await self._terminate(live, grace=float(self.config.engine.kill_after_seconds))
        await self._close_run(live, exit_code=None, reason="hung",
                              hint="no log line, byte read or GPU memory change for "
                                   f"{minutes:.0f} min; the load was stopped")
        await self._after_crash(live, "hung", f"the load made no progress for {minutes:.0f} min")

    # --- ends -----------------------------------------------------------------------------

    async def _ended(self, live: _Live) -> None:
        code = await asyncio.to_thread(self.runner.exit_status, live.ident)
        if live.stopping:
            return  # _stop() records the end
        failure = live.parsed.failure
        reason, hint = (failure.reason, failure.hint) if failure else reason_from_exit(code)
        if failure is not None and failure.detail:  # the cause itself, e.g. the exception
            hint = f"{hint} The log says: {failure.detail}"
        await self._close_run(live, exit_code=code, reason=reason, hint=hint)
        await self._event("error", f"engine exited ({reason}, status {code}) in "
                                   f"{self._status.state.label}: {hint}")
        await self._after_crash(live, reason, hint)

    async def _close_run(self, live: _Live, *, exit_code: int | None, reason: str,
                         hint: str, ended_as: EngineState | None = None) -> None:
        """Record the run's end; `ended_as` is its last state (a stop's STOPPED: the state
        the run ends in comes after `_live` is gone, so no transition records it)."""
        at = self.clock.now()
        figures = render_json(live.parsed)
        phase = {"phase": (ended_as.value, at)} if ended_as is not None else {}
        await self._write_run(lambda s: update_run(
            s, live.run.id, ended_at=at, exit_code=exit_code, reason=reason, hint=hint,
            figures=figures, **phase))
        await asyncio.to_thread(self.runner.forget)
        self._live = None

    async def _after_crash(self, live: _Live, reason: str, hint: str) -> None:
        decision = decide_after_crash(reason, hint, live.run.attempt,
                                      self.config.engine.max_retries, self.backoff_base)
        if not decision.retry:
            self._transition(EngineState.FAILED, f"failed: {reason}", reason=reason,
                             hint=decision.hint)
            await self._event("critical", f"engine FAILED ({reason}); {decision.hint}")
            return
        retry_at = self.clock.now() + dt.timedelta(seconds=decision.delay_seconds)
        self._transition(EngineState.BACKOFF,
                         f"crashed ({reason}); retry {live.run.attempt + 1} at "
                         f"{retry_at:%H:%M:%S} UTC", reason=reason, hint=hint,
                         next_retry_at=retry_at)
        self._retry = asyncio.create_task(self._retry_after(decision.delay_seconds,
                                                            live.run.attempt + 1))

    async def _retry_after(self, delay: float, attempt: int) -> None:
        """Wait out the backoff, then queue the retry like any other start (a stop or an
        operator's start meanwhile cancels this wait)."""
        await asyncio.sleep(delay)
        if self._status.state is not EngineState.BACKOFF:
            return
        retry = self.submit(Command.START, "supervisor", attempt=attempt)
        retry.add_done_callback(_log_retry_failure)

    # --- stop -----------------------------------------------------------------------------

    async def _stop(self, actor: str) -> None:
        now = self.clock.now()
        await self.db.run(lambda s: set_desired(s, running=False, at=now, by=actor))
        if self._retry is not None:
            self._retry.cancel()
        live = self._live
        if live is None or self._status.state not in LIVE:
            self._transition(EngineState.STOPPED, "stopped", next_retry_at=None)
            return
        live.stopping = True
        drained = ""
        if self._status.state in SERVING:
            self._transition(EngineState.DRAINING, "draining: waiting for in-flight requests")
            drained = await self._drain(float(self.config.engine.drain_seconds))
        self._transition(EngineState.STOPPING, "stopping: SIGTERM sent")
        sent = self.clock.now().astimezone(dt.UTC).strftime("%H:%M:%S UTC")
        code = await self._terminate(live, grace=float(self.config.engine.kill_after_seconds))
        # What the stopped card says of the stop: who, the drain, the signal and when.
        await self._close_run(live, exit_code=code, reason="stopped",
                              hint=f"stopped by {actor}{drained}; SIGTERM sent at {sent}"
                                   f"{stop_outcome(code)}",
                              ended_as=EngineState.STOPPED)
        await self._confirm_gpus_free(live)
        self._transition(EngineState.STOPPED, "stopped", reason=None, hint="", percent=None,
                         eta_seconds=None)
        await self._event("info", f"engine stopped by {actor}")

    async def _drain(self, deadline: float) -> str:
        """Wait until the engine has no running or queued request, up to `deadline` s; says
        how the drain went (", after draining 3 requests in flight"), for the run's record."""
        start = self.clock.monotonic()
        first: int | None = None
        remaining: int | None = None
        while self.clock.monotonic() - start < deadline:
            remaining = await self.client.in_flight()
            first = remaining if first is None else first
            if remaining == 0:
                if not first:
                    return ", with no request in flight"
                return f", after draining {first} request{'s' if first != 1 else ''} in flight"
            self._set(message=f"draining: {remaining if remaining is not None else '?'} "
                              "requests in flight")
            await asyncio.sleep(self.poll_interval)
        await self._event("warning", f"drain deadline of {deadline:.0f} s passed with "
                                     "requests still in flight; stopping anyway")
        left = "some" if remaining is None else str(remaining)
        return f", with {left} still in flight at the {deadline:.0f} s drain deadline"

    async def _terminate(self, live: _Live, grace: float) -> int | None:
        """SIGTERM the main process, wait up to `grace` s, then SIGKILL the whole group."""
        if self._watcher is not None and self._watcher is not asyncio.current_task():
            self._watcher.cancel()
        await asyncio.to_thread(self.runner.terminate, live.ident)
        start = self.clock.monotonic()
        while self.clock.monotonic() - start < grace:
            if not await asyncio.to_thread(self.runner.alive, live.ident):
                break
            await asyncio.sleep(min(self.poll_interval, 0.5))
        await asyncio.to_thread(self.runner.kill, live.ident)
        return await asyncio.to_thread(self.runner.exit_status, live.ident)

    async def _confirm_gpus_free(self, live: _Live) -> None:
        snapshot = await asyncio.to_thread(snapshot_with_timeout, self.gpus, NVML_TIMEOUT)
        strays = [(g.index, p.pid) for g in snapshot.gpus for p in g.processes
                  if p.pid in live.pids]
        if strays:
            listing = ", ".join(f"pid {pid} on GPU {index}" for index, pid in strays)
            await self._event("warning", f"engine processes still hold GPUs after stop: "
                                         f"{listing}")

    # --- adoption -------------------------------------------------------------------------

    async def _reconcile(self, desired_running: bool) -> None:
        run = await self.db.run(latest_open_run)
        ident = await asyncio.to_thread(self.runner.find)
        if ident is not None and run is not None and ident.spec_hash == run.spec_hash:
            await self._adopt(run, ident)
            return
        if ident is not None:
            at = self.clock.now()
            adopted = await self.db.run(lambda s: open_run(
                s, at=at, runner=self.runner.name, spec_hash=ident.spec_hash, spec_json="{}",
                attempt=1, state=EngineState.ADOPTED.value, log_path=ident.log_path,
                identity_json=ident.to_json(), adopted=True))
            await self._adopt(adopted, ident)
            return
        if run is not None:
            # It ended while the daemon was away: close the record, then apply the policy.
            parsed = await asyncio.to_thread(self._parse_whole, Path(run.log_path), 0)
            failure = parsed.failure
            reason, hint = (failure.reason, failure.hint) if failure else (
                "unknown", "the engine ended while the daemon was not running; read its log")
            at = self.clock.now()
            await self.db.run(lambda s: update_run(s, run.id, ended_at=at, reason=reason,
                                                   hint=hint))
            await self._event("warning", f"the engine run {run.id} ended while the daemon "
                                         f"was away ({reason})")
            if desired_running:
                live = _Live(run=run, ident=EngineIdentity(run.runner, 0, 0.0, run.spec_hash,
                                                           run.log_path), spec=None)
                await self._after_crash(live, reason, hint)
            return
        if desired_running:
            # Its outcome (a preflight refusal, say) is an event and the status already.
            self.submit(Command.START, "supervisor").add_done_callback(_retrieve)

    def _parse_whole(self, path: Path, start: int) -> logparse.LogState:
        """The latest run in the log from `start` on: every launch appends to the same file,
        and figures folded across runs would mix one run's phases with another's memory."""
        try:
            with path.open("rb") as handle:
                handle.seek(start)
                text = handle.read().decode("utf-8", errors="replace")
        except OSError:
            return logparse.initial()
        return logparse.parse_text(text, run=-1)

    async def _adopt(self, run: RunRecord, ident: EngineIdentity) -> None:
        log_path = Path(ident.log_path)
        size = log_path.stat().st_size if log_path.exists() else 0
        # The run's log starts where this launch began appending; the file holds earlier
        # runs before it, so only its latest run (this engine's) is folded.
        parsed = await asyncio.to_thread(self._parse_whole, log_path, 0)
        spec = LaunchSpec.from_json(run.spec_json) if run.spec_json != "{}" else None
        live = _Live(run=run, ident=ident, spec=spec, offset=size, parsed=parsed,
                     tracker=Tracker.begin(self.clock.monotonic()), pids={ident.pid})
        self._transition(EngineState.ADOPTED, f"adopted the running engine (pid {ident.pid})",
                         adopted=True, attempt=run.attempt)
        await self._event("info", f"adopted the running engine (pid {ident.pid}, run {run.id});"
                                  " no second engine started")
        self._follow(live)
        # An engine that answers /ready is serving, whatever its log shows (rotated, say).
        healthy = await self.client.ready()
        if parsed.ready or healthy:
            state = EngineState.READY if healthy else EngineState.DEGRADED
            if not healthy:
                self._failures["ready"] = ("/ready fails", "")
            self._transition(state, "ready" if healthy else "adopted; /ready fails",
                             percent=100.0)

    # --- bookkeeping ----------------------------------------------------------------------

    def _typical_start(self) -> float | None:
        if not self._history:
            return None
        ordered = sorted(self._history)
        return ordered[len(ordered) // 2]

    def _set(self, **changes: Any) -> None:
        self._status = dataclasses.replace(self._status, **changes)
        for listener in self._listeners:
            listener(self._status)

    def _transition(self, state: EngineState, message: str, **changes: Any) -> None:
        previous = self._status.state
        if state is EngineState.DEGRADED and previous is not EngineState.DEGRADED:
            self._degraded_at = self.clock.monotonic()
        self._set(state=state, message=message, since=self.clock.now()
                  if state is not previous else self._status.since, **changes)
        live = self._live
        if state is not previous and live is not None:
            at = self.clock.now()
            run_id = live.run.id
            task = asyncio.get_running_loop().create_task(
                self._write_run(lambda s: update_run(s, run_id, phase=(state.value, at))))
            task.add_done_callback(_log_failure)

    async def _write_run(self, fn: Callable[[Any], Any]) -> Any:
        """Write to the run record after every earlier write (asyncio.Lock is FIFO)."""
        async with self._run_writes:
            return await self.db.run(fn)

    async def _event(self, severity: str, message: str) -> None:
        at = self.clock.now()
        log.log(logging.ERROR if severity in ("error", "critical") else logging.INFO, message)
        await self.db.run(lambda s: add_event(s, at=at, severity=severity, source="engine",
                                              message=message))


def _retrieve(future: asyncio.Future[EngineStatus]) -> None:
    """Mark a start's outcome as seen: its failure is already an event and the status."""
    if not future.cancelled():
        future.exception()


def _log_retry_failure(future: asyncio.Future[EngineStatus]) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.warning("engine retry did not start: %s", future.exception())


def _log_failure(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("could not record an engine state change: %r", task.exception())
