"""An engine that is alive but failing: DEGRADED, new requests refused, never restarted.

Fault case 8 of deploy-and-reliability.md §4.2 (engine hung while serving: process alive,
/health_generate times out) with the real engine emulator, and the health monitor's verdicts
(`Supervisor.report_health`) on a serving and on a starting engine.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from appliance.config import Config
from appliance.db.database import Database
from appliance.engine.records import list_runs
from appliance.engine.states import Command, EngineState, admits_requests
from tests.test_engine_lifecycle import (
    box,  # noqa: F401 - a fixture
    emulator_env,  # noqa: F401 - a fixture
    events,
    run,
    serving,
    supervisor_for,
    wait_for,
)


def test_degraded_refuses_new_requests_and_ready_admits() -> None:
    assert admits_requests(EngineState.READY)
    assert not admits_requests(EngineState.DEGRADED)
    assert not admits_requests(EngineState.DRAINING)


def test_engine_hung_while_serving_is_degraded_not_restarted(
        box: tuple[Config, Database], emulator_env: Path,  # noqa: F811
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The emulator's scheduler wedges after ready: /health_generate times out (after 1 s
    here) and /ready turns 503. The process stays alive; the supervisor shows DEGRADED, the
    engine refuses admission, and it is the same engine (same pid, one run) polls later."""
    monkeypatch.setenv("FAKE_SGLANG_FAULT", "unhealthy")
    monkeypatch.setenv("SGLANG_HEALTH_CHECK_TIMEOUT", "1")
    config, db = box
    supervisor = supervisor_for(config, db, emulator_env)

    async def scenario() -> None:
        async with serving(supervisor):
            await supervisor.submit(Command.START, "tester")
            await wait_for(lambda: supervisor.status.state is EngineState.DEGRADED,
                           f"DEGRADED (at {supervisor.status})", timeout=40)
            assert supervisor._live is not None
            pid = supervisor._live.ident.pid
            assert not supervisor.status.admits_requests
            assert supervisor.degraded_seconds is not None
            # Many /ready probes later (0.2 s apart) it is still the same, living engine.
            await asyncio.sleep(2.0)
            assert supervisor.status.state is EngineState.DEGRADED
            assert supervisor._live is not None and supervisor._live.ident.pid == pid
            assert supervisor.runner.alive(supervisor._live.ident)
            # A healthy verdict from the monitor does not clear the watcher's own failure.
            await supervisor.report_health("health", None)
            assert supervisor.status.state is EngineState.DEGRADED

    run(scenario)
    assert len(db.call(lambda s: list_runs(s))) == 1  # never restarted
    assert any("/health_generate failed" in m for m in events(db))


def test_health_verdicts_degrade_and_recover_a_serving_engine_only(
        box: tuple[Config, Database], emulator_env: Path) -> None:  # noqa: F811
    config, db = box
    supervisor = supervisor_for(config, db, emulator_env)

    async def scenario() -> None:
        async with serving(supervisor):
            started = supervisor.submit(Command.START, "tester")
            await wait_for(lambda: supervisor.status.state is EngineState.LOADING_WEIGHTS
                           or supervisor.status.state is EngineState.READY, "a start")
            if supervisor.status.state is not EngineState.READY:
                # A starting engine: a failing verdict changes nothing, now or later.
                await supervisor.report_health("health", "the canary failed")
                assert supervisor.status.state is not EngineState.DEGRADED
            await started
            await wait_for(lambda: supervisor.status.state is EngineState.READY, "READY")
            assert supervisor.status.state is EngineState.READY
            assert supervisor.engine_pids()

            await supervisor.report_health("health", "the canary failed", "read the log")
            assert supervisor.status.state is EngineState.DEGRADED
            assert "the canary failed" in supervisor.status.message
            assert supervisor.status.hint == "read the log"
            await supervisor.report_health("health", "the canary failed", "read the log")
            await asyncio.sleep(0.6)  # /ready keeps answering: still DEGRADED
            assert supervisor.status.state is EngineState.DEGRADED

            await supervisor.report_health("health", None)
            assert supervisor.status.state is EngineState.READY
            assert supervisor.degraded_seconds is None

    run(scenario)
    messages = events(db)
    assert sum("engine degraded: the canary failed" in m for m in messages) == 1
    assert sum("engine recovered" in m for m in messages) == 1
    assert len(db.call(lambda s: list_runs(s))) == 1


def test_a_ready_engine_that_dies_takes_the_supervisors_crash_path(
        box: tuple[Config, Database], emulator_env: Path,  # noqa: F811
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Dead is not DEGRADED: a scheduler killed after ready takes the whole engine down, and
    the supervisor's own watcher records the crash with its reason (no health check is
    involved, and none could keep a dead engine "degraded")."""
    monkeypatch.setenv("FAKE_SGLANG_FAULT", "scheduler_death=1")
    config, db = box
    supervisor = supervisor_for(config, db, emulator_env, retries=0)

    async def scenario() -> None:
        async with serving(supervisor):
            await supervisor.submit(Command.START, "tester")
            await wait_for(lambda: supervisor.status.state is EngineState.FAILED,
                           f"FAILED (at {supervisor.status})", timeout=60)

    run(scenario)
    runs = db.call(lambda s: list_runs(s))
    assert len(runs) == 1 and runs[0].ready_seconds is not None  # it had served
    assert any(m.startswith("engine exited") for m in events(db))
