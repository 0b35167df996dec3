"""The health monitor on a real database with fake GPUs and a controllable clock: transitions
recorded once, samples per poll, mutes, NVML hung or missing, a failing check, the engine
policy (pure table, then applied through a stand-in supervisor), and the scheduled jobs."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from appliance.config import Config
from appliance.db.database import Database
from appliance.db.journal import EventRecord, list_audit, list_events
from appliance.engine.states import Command, EngineState
from appliance.engine.supervisor import EngineStatus
from appliance.errors import ApplianceError
from appliance.gpu.nvml import NvmlGpus
from appliance.gpu.port import GpuPort
from appliance.health import history, model
from appliance.health.alerts import Alerts
from appliance.health.jobs import JOB_IDS, schedule_health
from appliance.health.model import CanaryResult, CheckResult, EngineFigures, HostFigures, Level
from appliance.health.monitor import HealthMonitor
from appliance.health.policy import Decision, EngineView, decide
from appliance.runtime import build_runtime
from appliance.testing.clock import FakeClock
from appliance.testing.fake_gpus import FakeGpus
from tests.test_health_alerts import Receiver
from tests.test_health_host import roomy_host

GIB = 1 << 30
TEMP_3 = "gpu.3.temperature"


class StandInSupervisor:
    """The supervisor's face to the monitor, recording what it is told."""

    def __init__(self, state: EngineState = EngineState.STOPPED) -> None:
        self.status = EngineStatus(state=state)
        self.degraded_seconds: float | None = None
        self.reports: list[tuple[str, str | None]] = []
        self.submitted: list[tuple[Command, str]] = []

    def engine_pids(self) -> frozenset[int]:
        return frozenset()

    async def report_health(self, source: str, failure: str | None, hint: str = "") -> None:
        self.reports.append((source, failure))

    def submit(self, command: Command, actor: str,
               attempt: int = 1) -> asyncio.Future[EngineStatus]:
        self.submitted.append((command, actor))
        future: asyncio.Future[EngineStatus] = asyncio.get_running_loop().create_future()
        future.set_result(self.status)
        return future


class StandInWatcher:
    """Engine figures as the test sets them: `ready`, and the last canary's outcome."""

    def __init__(self) -> None:
        self.ready: bool | None = True
        self.canary_ok: bool | None = None  # None: no probe yet

    async def poll(self, state: EngineState, now: dt.datetime) -> EngineFigures:
        canary = None if self.canary_ok is None else CanaryResult(
            at=now, ok=self.canary_ok, ttft_seconds=0.1, error="" if self.canary_ok else
            "/health_generate timed out after 60 s")
        return EngineFigures(at=now, state=state.value, ready=self.ready, running_requests=0,
                             queued_requests=0, token_usage=0.1, canary=canary)


def with_health(config: Config, **changes: Any) -> Config:
    return dataclasses.replace(config, health=dataclasses.replace(config.health, **changes))


def make_monitor(config: Config, db: Database, clock: FakeClock, *,
                 gpus: GpuPort | None = None, supervisor: StandInSupervisor | None = None,
                 watcher: StandInWatcher | None = None,
                 read_host: Callable[[dt.datetime], HostFigures] = roomy_host,
                 url: str = "") -> HealthMonitor:
    alerts = Alerts(db=db, clock=clock, url=url, retries=1, box="box", version="t",
                    base_delay=0.01)
    return HealthMonitor(config=config, db=db, clock=clock, gpus=gpus or FakeGpus(),
                         supervisor=supervisor or StandInSupervisor(),
                         watcher=watcher or StandInWatcher(), read_host=read_host,
                         alerts=alerts)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def health_events(db: Database) -> list[EventRecord]:
    return list(reversed(db.call(lambda s: list_events(s, source="health")).items))


def transitions_of(db: Database, check_id: str) -> list[history.TransitionView]:
    return list(reversed(db.call(lambda s: history.transitions(s, check_id))))


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    server = Receiver()
    yield server
    server.close()


# --- transitions: once per change, not per poll ------------------------------------------------


def test_failure_change_and_recovery_each_record_one_transition_and_event(
        config: Config, db: Database, clock: FakeClock) -> None:
    gpus = FakeGpus()
    monitor = make_monitor(config, db, clock, gpus=gpus)

    async def polls(times: int) -> None:
        for _ in range(times):
            await monitor.check_gpus()
            clock.advance(15)

    async def scenario() -> None:
        await polls(2)
        gpus.set_fields(3, temperature_c=88.0)  # over the 85 °C warning line
        await polls(3)
        gpus.set_fields(3, temperature_c=95.0)  # over the 92 °C critical line
        await polls(3)
        gpus.set_fields(3, temperature_c=60.0)
        await polls(3)
        await monitor.close()

    run(scenario())
    assert [(t.previous_level, t.level, t.kind) for t in transitions_of(db, TEMP_3)] == [
        (Level.OK, Level.WARN, "failure"), (Level.WARN, Level.CRITICAL, "change"),
        (Level.CRITICAL, Level.OK, "recovery")]
    mine = [e for e in health_events(db) if e.detail.get("check") == TEMP_3]
    assert [e.severity for e in mine] == ["warning", "critical", "info"]
    assert monitor.latest.result(TEMP_3).level is Level.OK  # type: ignore[union-attr]


def test_samples_are_written_at_every_poll(config: Config, db: Database,
                                           clock: FakeClock) -> None:
    gpus = FakeGpus()
    monitor = make_monitor(config, db, clock, gpus=gpus)
    start = clock.now()

    async def scenario() -> None:
        for temperature in (50.0, 55.0, 60.0):
            gpus.set_fields(3, temperature_c=temperature)
            await monitor.check_gpus()
            await monitor.check_host()
            clock.advance(15)

    run(scenario())
    temps = db.call(lambda s: history.series(s, model.GPU_TEMPERATURE, "3", start, clock.now()))
    assert [v for _, v in temps] == [50.0, 55.0, 60.0]
    assert [at for at, _ in temps] == [start + dt.timedelta(seconds=15 * i) for i in range(3)]
    memory = db.call(lambda s: history.series(s, model.HOST_MEMORY_AVAILABLE, "", start,
                                              clock.now()))
    assert [v for _, v in memory] == [2000.0 * GIB] * 3


def test_a_vanished_check_is_not_a_recovery(config: Config, db: Database,
                                            clock: FakeClock) -> None:
    gpus = FakeGpus()
    monitor = make_monitor(config, db, clock, gpus=gpus)
    gpus.set_fields(3, temperature_c=95.0)

    async def scenario() -> None:
        await monitor.check_gpus()
        gpus.hang()  # NVML stops answering: every per-GPU check disappears
        try:
            await monitor.check_gpus()
        finally:
            gpus.unhang()
        for _ in range(200):  # bounded: until the released NVML call has returned
            snapshot = await monitor.check_gpus()  # back, still hot: nothing new
            if snapshot.result(TEMP_3) is not None:
                break
            await asyncio.sleep(0.01)

    monitor.config = with_health(config, nvml_timeout_seconds=1)
    run(scenario())
    assert [t.kind for t in transitions_of(db, TEMP_3)] == ["failure"]
    assert [t.kind for t in transitions_of(db, "gpu.nvml")] == ["failure", "recovery"]


def test_a_restarted_daemon_does_not_record_ongoing_failures_again(
        config: Config, db: Database, clock: FakeClock) -> None:
    gpus = FakeGpus()
    gpus.set_fields(3, temperature_c=95.0)
    run(make_monitor(config, db, clock, gpus=gpus).check_gpus())
    run(make_monitor(config, db, clock, gpus=gpus).check_gpus())  # a new daemon, same box
    assert len(transitions_of(db, TEMP_3)) == 1


# --- NVML hung or missing, and a check that raises -----------------------------------------


def test_a_hung_nvml_is_critical_after_the_timeout_and_the_loop_keeps_running(
        config: Config, db: Database, clock: FakeClock) -> None:
    gpus = FakeGpus()
    monitor = make_monitor(with_health(config, nvml_timeout_seconds=1), db, clock, gpus=gpus)
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    async def scenario() -> None:
        beat = asyncio.create_task(ticker())
        gpus.hang()
        try:
            snapshot = await monitor.check_gpus()
        finally:
            gpus.unhang()
            beat.cancel()
        nvml = snapshot.result("gpu.nvml")
        assert nvml is not None and nvml.level is Level.CRITICAL
        assert "did not answer within 1 s" in nvml.summary and "dmesg" in nvml.hint

    run(scenario())
    assert ticks >= 2  # the event loop kept running other tasks through the hang


def test_nvml_missing_is_a_critical_finding_with_a_hint(config: Config, db: Database,
                                                        clock: FakeClock) -> None:
    import pynvml

    class NoLibrary:
        """A binding whose library is not installed (no NVIDIA driver on the box)."""

        def __getattr__(self, name: str) -> object:
            return getattr(pynvml, name)

        def nvmlInit(self) -> None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    monitor = make_monitor(config, db, clock, gpus=NvmlGpus(nvml=NoLibrary()))
    snapshot = run(monitor.check_gpus())
    nvml = snapshot.result("gpu.nvml")
    assert nvml is not None and nvml.level is Level.CRITICAL
    assert "libnvidia-ml" in nvml.summary and "install the NVIDIA datacenter driver" in nvml.hint
    assert snapshot.overall() is Level.CRITICAL
    (event,) = [e for e in health_events(db) if e.detail.get("check") == "gpu.nvml"]
    assert event.severity == "critical"


def test_a_check_that_raises_becomes_critical_and_recovers(config: Config, db: Database,
                                                           clock: FakeClock) -> None:
    broken = [True]

    def flaky_host(now: dt.datetime) -> HostFigures:
        if broken[0]:
            raise OSError("/proc went away")
        return roomy_host(now)

    monitor = make_monitor(config, db, clock, read_host=flaky_host)
    snapshot = run(monitor.check_host())
    failure = snapshot.result("health.monitor.host")
    assert failure is not None and failure.level is Level.CRITICAL
    assert "OSError: /proc went away" in failure.summary
    broken[0] = False
    snapshot = run(monitor.check_host())
    assert snapshot.result("health.monitor.host") is None
    assert snapshot.result("host.models_disk") is not None
    assert [t.kind for t in transitions_of(db, "health.monitor.host")] == [
        "failure", "recovery"]
    broken[0] = True  # and a second breakage is recorded afresh
    run(monitor.check_host())
    assert [t.kind for t in transitions_of(db, "health.monitor.host")] == [
        "failure", "recovery", "failure"]


# --- mutes ---------------------------------------------------------------------------------


def test_a_muted_check_sends_nothing_and_unmute_restores(
        config: Config, db: Database, clock: FakeClock, receiver: Receiver) -> None:
    gpus = FakeGpus()
    monitor = make_monitor(config, db, clock, gpus=gpus, url=receiver.url)

    async def scenario() -> None:
        await monitor.mute(TEMP_3, until=None, by="alice", reason="fan being replaced")
        gpus.set_fields(3, temperature_c=95.0)
        snapshot = await monitor.check_gpus()
        assert TEMP_3 in snapshot.muted
        assert snapshot.result(TEMP_3).level is Level.CRITICAL  # type: ignore[union-attr]
        await monitor.alerts.drain()
        assert receiver.bodies == []
        await monitor.unmute(TEMP_3, by="alice")
        gpus.set_fields(3, temperature_c=60.0)
        await monitor.check_gpus()
        await monitor.alerts.drain()
        await monitor.close()

    run(scenario())
    assert [(b["check"], b["kind"]) for b in receiver.bodies] == [(TEMP_3, "recovery")]
    assert [t.muted for t in transitions_of(db, TEMP_3)] == [True, False]  # both kept
    assert [e.severity for e in health_events(db) if e.detail.get("check") == TEMP_3] == [
        "info"]
    audit = db.call(lambda s: list_audit(s, action="health.")).items
    assert [(a.action, a.target, a.actor) for a in reversed(audit)] == [
        ("health.mute", TEMP_3, "alice"), ("health.unmute", TEMP_3, "alice")]
    assert audit[1].detail["reason"] == "fan being replaced"


def test_a_mute_expires(config: Config, db: Database, clock: FakeClock,
                        receiver: Receiver) -> None:
    gpus = FakeGpus()
    monitor = make_monitor(config, db, clock, gpus=gpus, url=receiver.url)

    async def scenario() -> None:
        await monitor.mute(TEMP_3, until=clock.now() + dt.timedelta(minutes=10), by="alice")
        assert monitor.latest.muted == {TEMP_3}
        clock.advance(11 * 60)
        assert monitor.latest.muted == frozenset()
        gpus.set_fields(3, temperature_c=95.0)
        await monitor.check_gpus()
        await monitor.alerts.drain()
        pruned = await monitor.prune()
        assert pruned.mutes == 1
        await monitor.close()

    run(scenario())
    assert [(b["check"], b["level"]) for b in receiver.bodies] == [(TEMP_3, "critical")]
    assert db.call(history.mutes) == []


def test_a_mute_must_end_in_the_future(config: Config, db: Database, clock: FakeClock) -> None:
    monitor = make_monitor(config, db, clock)
    with pytest.raises(ApplianceError) as refused:
        run(monitor.mute(TEMP_3, until=clock.now() - dt.timedelta(minutes=1), by="alice"))
    assert refused.value.code == "health_mute_invalid"
    assert db.call(history.mutes) == []


# --- the engine policy -------------------------------------------------------------------------


def _verdicts(ready: Level = Level.OK, generate: Level = Level.OK) -> list[CheckResult]:
    return [CheckResult("engine.ready", "engine", "Engine /ready", ready, "/ready: 503", "h1"),
            CheckResult("engine.generate", "engine", "Engine generates", generate,
                        "does not generate", "h2")]


MINUTE = 60.0


@pytest.mark.parametrize(("state", "degraded", "results", "minutes", "asked", "expected"), [
    # a loading engine with a failing check: nothing, ever
    (EngineState.LOADING_WEIGHTS, None, _verdicts(Level.CRITICAL, Level.CRITICAL), 5, False,
     Decision()),
    (EngineState.WARMING, None, _verdicts(generate=Level.CRITICAL), 5, False, Decision()),
    # stopped or crashed: the supervisor's business
    (EngineState.STOPPED, None, _verdicts(Level.CRITICAL), 5, False, Decision()),
    (EngineState.BACKOFF, None, _verdicts(Level.CRITICAL), 5, False, Decision()),
    # READY and generation failing: report the failure, no restart
    (EngineState.READY, None, _verdicts(generate=Level.CRITICAL), 5, False,
     Decision(report=True, failure="does not generate", hint="h2")),
    # both failing: /ready is named
    (EngineState.READY, None, _verdicts(Level.CRITICAL, Level.CRITICAL), 0, False,
     Decision(report=True, failure="/ready: 503", hint="h1")),
    # DEGRADED and recovered: report healthy
    (EngineState.DEGRADED, 90 * MINUTE, _verdicts(), 5, False, Decision(report=True)),
    # a WARN is not a failure
    (EngineState.DEGRADED, 1.0, _verdicts(generate=Level.WARN), 0, False, Decision(report=True)),
    # DEGRADED, but not long enough yet
    (EngineState.DEGRADED, 4 * MINUTE, _verdicts(generate=Level.CRITICAL), 5, False,
     Decision(report=True, failure="does not generate", hint="h2")),
    # restart disabled: never, however long
    (EngineState.DEGRADED, 600 * MINUTE, _verdicts(generate=Level.CRITICAL), 0, False,
     Decision(report=True, failure="does not generate", hint="h2")),
    # already asked in this degraded spell: not again
    (EngineState.DEGRADED, 60 * MINUTE, _verdicts(generate=Level.CRITICAL), 5, True,
     Decision(report=True, failure="does not generate", hint="h2")),
    # nothing judged: nothing said
    (EngineState.READY, None, [], 5, False, Decision()),
])
def test_policy_table(state: EngineState, degraded: float | None, results: list[CheckResult],
                      minutes: int, asked: bool, expected: Decision) -> None:
    view = EngineView(state, degraded_seconds=degraded)
    assert decide(view, results, restart_after_minutes=minutes,
                  restart_requested=asked) == expected


def test_policy_restarts_a_long_degraded_engine_when_enabled() -> None:
    view = EngineView(EngineState.DEGRADED, degraded_seconds=6 * MINUTE)
    decision = decide(view, _verdicts(generate=Level.CRITICAL), restart_after_minutes=5,
                      restart_requested=False)
    assert decision.restart and decision.report and decision.failure == "does not generate"
    assert decision.actor == "health policy: degraded for 6 min"
    assert "restart_degraded_after_minutes = 5" in decision.reason
    # ... but never over an operator's pending command (a stop, say)
    pending = dataclasses.replace(view, pending="stop")
    assert not decide(pending, _verdicts(generate=Level.CRITICAL), restart_after_minutes=5,
                      restart_requested=False).restart


def test_monitor_applies_the_policy_and_restarts_once(config: Config, db: Database,
                                                      clock: FakeClock) -> None:
    supervisor = StandInSupervisor(EngineState.READY)
    watcher = StandInWatcher()
    monitor = make_monitor(with_health(config, restart_degraded_after_minutes=5), db, clock,
                           supervisor=supervisor, watcher=watcher)

    async def scenario() -> None:
        await monitor.check_engine()  # healthy
        watcher.canary_ok = False  # alive, not generating
        await monitor.check_engine()
        supervisor.status = EngineStatus(state=EngineState.DEGRADED)
        supervisor.degraded_seconds = 60.0
        await monitor.check_engine()  # degraded, not long enough
        supervisor.degraded_seconds = 6 * MINUTE
        for _ in range(3):
            await monitor.check_engine()  # restart once, not at every poll
        await asyncio.sleep(0)

    run(scenario())
    failure = "the engine is alive but does not generate: /health_generate timed out after 60 s"
    assert supervisor.reports == [("health", None)] + [("health", failure)] * 5
    assert supervisor.submitted == [(Command.RESTART, "health policy: degraded for 6 min")]
    (why,) = [e for e in health_events(db) if e.message.startswith("restarting the engine")]
    assert why.severity == "warning" and "degraded for 6 min" in why.message


def test_monitor_leaves_a_loading_engine_alone(config: Config, db: Database,
                                               clock: FakeClock) -> None:
    supervisor = StandInSupervisor(EngineState.LOADING_WEIGHTS)
    watcher = StandInWatcher()
    watcher.ready, watcher.canary_ok = False, False
    monitor = make_monitor(with_health(config, restart_degraded_after_minutes=1), db, clock,
                           supervisor=supervisor, watcher=watcher)
    for _ in range(3):
        run(monitor.check_engine())
    assert supervisor.reports == [] and supervisor.submitted == []


# --- the runtime and the scheduled jobs ------------------------------------------------------


def test_runtime_wiring_checks_everything_and_never_probes_a_stopped_engine(
        config: Config, db: Database, clock: FakeClock) -> None:
    requests: list[httpx.Request] = []

    def engine(request: httpx.Request) -> httpx.Response:
        requests.append(request)
        return httpx.Response(200)

    runtime = build_runtime(config, clock=clock, db=db, gpus=FakeGpus(),
                            engine_transport=httpx.MockTransport(engine))
    assert runtime.health.latest.at is None

    async def scenario() -> model.HealthSnapshot:
        snapshot = await runtime.health.check_all()
        await runtime.health.close()
        return snapshot

    snapshot = run(scenario())
    groups = snapshot.by_group()
    assert all(groups[g] for g in model.GROUPS)
    assert snapshot.gpus is not None and len(snapshot.gpus.gpus) == 8
    assert requests == []  # the engine is stopped: nothing is sent to it


def test_jobs_run_once_at_start_then_on_their_intervals(config: Config, db: Database,
                                                        clock: FakeClock) -> None:
    runtime = build_runtime(config, clock=clock, db=db, gpus=FakeGpus())

    async def scenario() -> dict[str, Any]:
        schedule_health(runtime)
        jobs = {job.id: job for job in runtime.scheduler.get_jobs()}
        runtime.scheduler.start()
        try:
            for _ in range(500):  # bounded: the first runs happen at start
                if all(runtime.health.latest.by_group()[g] for g in model.GROUPS):
                    break
                await asyncio.sleep(0.02)
        finally:
            runtime.scheduler.shutdown(wait=False)
            await runtime.health.close()
        return jobs

    jobs = run(scenario())
    assert set(JOB_IDS) <= set(jobs)
    seconds = {i: jobs[i].trigger.interval.total_seconds() for i in JOB_IDS}
    assert seconds == {"health_gpus": 15, "health_engine": 10, "health_host": 30,
                       "health_weights": 300, "health_prune": 3600}
    assert all(g for g in runtime.health.latest.by_group().values())


def test_a_failing_engine_that_stops_is_not_a_recovery(config: Config, db: Database,
                                                       clock: FakeClock) -> None:
    """Engine checks of an engine that is not serving are not judged: a failure followed by
    a crash (BACKOFF) records nothing more; the recovery is recorded once it serves well."""
    supervisor = StandInSupervisor(EngineState.READY)
    watcher = StandInWatcher()
    watcher.canary_ok = False
    monitor = make_monitor(config, db, clock, supervisor=supervisor, watcher=watcher)

    async def scenario() -> None:
        await monitor.check_engine()  # alive, not generating: a failure
        supervisor.status = EngineStatus(state=EngineState.BACKOFF)
        await monitor.check_engine()
        result = monitor.latest.result("engine.generate")
        assert result is not None and not result.judged
        assert "not checked while backoff" in result.summary
        supervisor.status = EngineStatus(state=EngineState.READY)
        watcher.canary_ok = True
        await monitor.check_engine()

    run(scenario())
    assert [t.level for t in transitions_of(db, "engine.generate")] == [Level.CRITICAL,
                                                                         Level.OK]
