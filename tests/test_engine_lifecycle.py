"""The supervisor driving the engine emulator as a real detached process.

Covers: full lifecycle (launch, progress, READY, stop with drain), crash → BACKOFF → retry,
repeated crashes → FAILED with rollback, bad argument → FAILED at once, hang detected only
after the no-progress window (fake clock), SIGTERM drain of an in-flight streaming request,
and fault 19 (engine port held by a stranger: refused, never killed).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from appliance.clock import SystemClock
from appliance.config import Config
from appliance.db.database import Database
from appliance.db.journal import list_events
from appliance.db.schema import migrate
from appliance.engine.args import model_dir
from appliance.engine.records import list_runs
from appliance.engine.states import START_ORDER, Command, EngineState
from appliance.engine.supervisor import Supervisor
from appliance.errors import ApplianceError
from appliance.resources import migrations_dir
from appliance.runtime import build_runtime
from appliance.secrets import engine_api_key
from appliance.testing.checkpoint import write_checkpoint
from appliance.testing.clock import FakeClock
from appliance.testing.fake_gpus import FakeGpus
from appliance.weights.importer import manifest_from_dir
from appliance.weights.service import WeightsService
from tests.conftest import free_port, make_config

DEADLINE = 90.0  # seconds any single wait may take on a loaded 2-core machine


def write_model(models_dir: Path, model: str = "moonshotai/Kimi-K3", shards: int = 4) -> Path:
    """A tiny checkpoint (config.json, index, well-formed safetensors shards) and, beside the
    models folder, its manifest (`<models_dir>/../manifest-<org>--<name>.json`)."""
    target = models_dir / model.replace("/", "--")
    write_checkpoint(target, shards=shards, shard_bytes=256 * 1024)
    manifest = manifest_from_dir(target, model)
    (models_dir.parent / f"manifest-{model.replace('/', '--')}.json").write_text(
        manifest.to_json())
    return target


def prove_weights(config: Config, db: Database) -> None:
    """Import the model folder in place with its manifest, through the real weights service:
    the engine refuses weights that are not proven."""
    directory = model_dir(config.paths.models_dir, config.engine.model)
    manifest = config.paths.models_dir.parent / (
        f"manifest-{config.engine.model.replace('/', '--')}.json")

    async def run() -> None:
        service = WeightsService(config, db, SystemClock())
        await service.import_dir(directory, actor="test", manifest_file=manifest)
        await service.wait_idle()
        view = await service.status()
        await service.stop_service()
        assert view.ready_for_engine, view.message

    with ThreadPoolExecutor(1) as pool:  # callers may already run an event loop
        pool.submit(asyncio.run, run()).result()


def engine_config(root: Path, **env: str) -> Config:
    config = make_config(root, APPLIANCE_ENGINE_PORT=str(free_port()), **env)
    write_model(config.paths.models_dir, config.engine.model)
    return config


@pytest.fixture
def emulator_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """The emulator reads these from the environment the runner passes on."""
    state = tmp_path / "gpus.json"
    monkeypatch.setenv("FAKE_SGLANG_LOAD_SECONDS", "3")
    monkeypatch.setenv("FAKE_SGLANG_GPU_STATE", str(state))
    monkeypatch.delenv("FAKE_SGLANG_FAULT", raising=False)
    return state


def supervisor_for(config: Config, db: Database, gpu_state: Path, *, clock: Any = None,
                   retries: int | None = None) -> Supervisor:
    if retries is not None:
        import dataclasses

        config = dataclasses.replace(
            config, engine=dataclasses.replace(config.engine, max_retries=retries))
    runtime = build_runtime(config, db=db, clock=clock or SystemClock(),
                            gpus=FakeGpus(state_file=gpu_state), engine_poll_seconds=0.1,
                            engine_backoff_seconds=0.2)
    runtime.supervisor.ready_interval = 0.2
    return runtime.supervisor


async def wait_for(check: Callable[[], bool], what: str, timeout: float = DEADLINE) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not check():
        if loop.time() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def serving(supervisor: Supervisor) -> AsyncIterator[Supervisor]:
    await supervisor.start_service()
    try:
        yield supervisor
    finally:
        live = supervisor._live
        await supervisor.stop_service()
        if live is not None:  # never leave an emulator behind
            supervisor.runner.kill(live.ident)
        await supervisor.client.aclose()


def run(coro: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(coro())


def group_gone(pgid: int) -> bool:
    """No live member of the process group is left (zombies count as gone: this sandbox's
    PID 1 does not reap orphans, so they can linger after a group is killed)."""
    for proc in psutil.process_iter(["pid", "status"]):
        try:
            if os.getpgid(proc.pid) == pgid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                return False
        except ProcessLookupError:
            continue
    return True


def migrated_box(root: Path, **env: str) -> tuple[Config, Database]:
    """A dev-profile box (process runner, emulator command) with a migrated database."""
    config = engine_config(root, **env)
    database = Database(config.database_url)
    migrate(database, migrations_dir(), config.paths.state_dir / "backups", SystemClock().now())
    prove_weights(config, database)
    return config, database


@pytest.fixture
def box(tmp_path: Path, emulator_env: Path) -> Iterator[tuple[Config, Database]]:
    config, database = migrated_box(tmp_path / "box")
    yield config, database
    database.dispose()


def events(db: Database) -> list[str]:
    return [e.message for e in db.call(lambda s: list_events(s, source="engine",
                                                             per_page=200)).items]


def test_full_lifecycle_reaches_ready_and_stops(box: tuple[Config, Database],
                                                emulator_env: Path) -> None:
    config, db = box
    supervisor = supervisor_for(config, db, emulator_env)
    seen: list[EngineState] = []
    supervisor.on_change(lambda s: seen.append(s.state) if not seen or seen[-1] != s.state
                         else None)

    async def scenario() -> None:
        async with serving(supervisor):
            await supervisor.submit(Command.START, "tester")
            await wait_for(lambda: supervisor.status.state is EngineState.READY, "READY")
            status = supervisor.status
            assert status.log is not None and status.log.ready
            assert status.log.shards_total == 4 and status.log.shards_done == 4
            assert status.log.ranks and status.log.ranks[0].kv_tokens
            assert supervisor._live is not None
            pid = supervisor._live.ident.pid
            await supervisor.submit(Command.STOP, "tester")
            assert supervisor.status.state is EngineState.STOPPED
            assert group_gone(pid)

    run(scenario)
    assert seen[:3] == [EngineState.STOPPED, EngineState.PREFLIGHT, EngineState.LAUNCHING] or \
        seen[:2] == [EngineState.PREFLIGHT, EngineState.LAUNCHING]
    start = [s for s in seen if s in START_ORDER]
    assert start == sorted(start, key=START_ORDER.index)  # never backwards
    assert EngineState.LOADING_WEIGHTS in start and start[-1] is EngineState.READY
    assert seen[-3:] == [EngineState.DRAINING, EngineState.STOPPING, EngineState.STOPPED]
    runs = db.call(lambda s: list_runs(s))
    assert len(runs) == 1
    assert runs[0].ready_seconds is not None and runs[0].reason == "stopped"
    phases = [p[0] for p in runs[0].phases]
    assert phases[0] == "launching" and "loading_weights" in phases and "ready" in phases
    assert any("engine ready after" in m for m in events(db))


def test_crash_backs_off_and_retries_then_fails_with_rollback(
    box: tuple[Config, Database], emulator_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fault 6: a good start first (so a rollback exists), then a crash at 60% of the load,
    retried with backoff, until the retry limit leaves it FAILED with a rollback offered."""
    config, db = box
    supervisor = supervisor_for(config, db, emulator_env, retries=1)
    states: list[EngineState] = []
    supervisor.on_change(lambda s: states.append(s.state))

    async def scenario() -> None:
        async with serving(supervisor):
            await supervisor.submit(Command.START, "tester")
            await wait_for(lambda: supervisor.status.state is EngineState.READY, "READY")
            await supervisor.submit(Command.STOP, "tester")
            monkeypatch.setenv("FAKE_SGLANG_FAULT", "crash_at=60")
            states.clear()
            await supervisor.submit(Command.START, "tester")
            await wait_for(lambda: supervisor.status.state is EngineState.FAILED, "FAILED")
            assert EngineState.BACKOFF in states
            status = supervisor.status
            assert status.rollback_available
            assert status.reason not in ("bad_argument", "weights_error")
            monkeypatch.delenv("FAKE_SGLANG_FAULT")
            await supervisor.submit(Command.ROLLBACK, "tester")
            await wait_for(lambda: supervisor.status.state is EngineState.READY, "READY again")
            await supervisor.submit(Command.STOP, "tester")

    run(scenario)
    runs = db.call(lambda s: list_runs(s))
    attempts = [r.attempt for r in reversed(runs)]
    assert attempts == [1, 1, 2, 1]  # good start, crash, one retry, rollback
    assert runs[1].reason == runs[2].reason and runs[1].exit_code not in (None, 0)
    assert any("FAILED" in m for m in events(db))


def test_bad_argument_fails_at_once_without_retry(tmp_path: Path, emulator_env: Path) -> None:
    config, db = migrated_box(tmp_path / "bad",
                              APPLIANCE_ENGINE_EXTRA_ARGS="--mem-fraction-statc,0.9")
    supervisor = supervisor_for(config, db, emulator_env)

    async def scenario() -> None:
        async with serving(supervisor):
            with pytest.raises(ApplianceError) as caught:
                await supervisor.submit(Command.START, "tester")
            assert "did you mean --mem-fraction-static" in str(caught.value)
            assert supervisor.status.state is EngineState.FAILED
            assert supervisor.status.reason == "bad_argument"

    run(scenario)
    assert db.call(lambda s: list_runs(s)) == []  # nothing was launched, nothing retried
    db.dispose()


def test_engine_rejecting_its_argv_is_not_retried(
    box: tuple[Config, Database], emulator_env: Path
) -> None:
    """If the engine itself exits on a bad argument (exit 2), that is FAILED, not BACKOFF."""
    from appliance.engine.states import decide_after_crash

    decision = decide_after_crash("bad_argument", "fix it", attempt=1, max_retries=5)
    assert not decision.retry
    decision = decide_after_crash("weights_error", "verify", attempt=1, max_retries=5)
    assert not decision.retry
    decision = decide_after_crash("scheduler_died", "", attempt=1, max_retries=5)
    assert decision.retry and decision.delay_seconds > 0


def test_hang_is_declared_only_after_the_no_progress_window(
    box: tuple[Config, Database], emulator_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fault 7, on a controllable clock: stalled at 40%, nothing happens until the window."""
    config, db = box
    monkeypatch.setenv("FAKE_SGLANG_FAULT", "hang_at=40")
    clock = FakeClock()
    supervisor = supervisor_for(config, db, emulator_env, clock=clock, retries=0)
    window = config.engine.hung_after_minutes * 60

    async def scenario() -> None:
        async with serving(supervisor):
            await supervisor.submit(Command.START, "tester")
            await wait_for(lambda: supervisor.status.state is EngineState.LOADING_WEIGHTS
                           and supervisor.status.log is not None
                           and supervisor.status.log.shards_done >= 1, "loading")
            await asyncio.sleep(2.0)  # the emulator has stopped at 40% by now
            clock.advance(window - 60)
            await asyncio.sleep(1.0)
            assert supervisor.status.state is EngineState.LOADING_WEIGHTS  # not yet hung
            assert supervisor.status.stalled_seconds >= window - 60
            clock.advance(120)
            await wait_for(lambda: supervisor.status.state is EngineState.FAILED, "FAILED")
            assert supervisor.status.reason == "hung"

    run(scenario)
    assert any("hung" in m for m in events(db))


def test_stop_drains_an_in_flight_stream_then_the_group_is_gone(
    box: tuple[Config, Database], emulator_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config, db = box
    monkeypatch.setenv("FAKE_SGLANG_FAULT", "slow_tokens=0.05")
    supervisor = supervisor_for(config, db, emulator_env)
    url = f"http://127.0.0.1:{config.engine.port}/v1/chat/completions"

    async def scenario() -> None:
        async with serving(supervisor):
            await supervisor.submit(Command.START, "tester")
            await wait_for(lambda: supervisor.status.state is EngineState.READY, "READY")
            assert supervisor._live is not None
            pid = supervisor._live.ident.pid
            chunks: list[str] = []

            async def stream() -> None:
                key = engine_api_key(config.paths.state_dir)  # the engine demands it
                body = {"model": config.engine.served_model_name,
                        "messages": [{"role": "user", "content": "hi"}],
                        "max_tokens": 40, "stream": True}
                async with httpx.AsyncClient(
                        timeout=60, headers={"Authorization": f"Bearer {key}"}) as http, \
                        http.stream("POST", url, json=body) as response:
                    async for line in response.aiter_lines():
                        if line.startswith("data: "):
                            chunks.append(line[6:])

            reader = asyncio.create_task(stream())
            await wait_for(lambda: len(chunks) >= 2, "first tokens")
            stopping = asyncio.ensure_future(supervisor.submit(Command.STOP, "tester"))
            await wait_for(lambda: supervisor.status.state is EngineState.DRAINING, "DRAINING")
            await reader
            await stopping
            assert chunks[-1] == "[DONE]"  # the request finished before the engine stopped
            assert supervisor.status.state is EngineState.STOPPED
            assert group_gone(pid)

    run(scenario)
    # The run says how the stop went, for the Engine page's stopped card.
    [last] = db.call(lambda s: list_runs(s))
    assert last.hint.startswith("stopped by tester, after draining 1 request in flight; "
                                "SIGTERM sent at "), last.hint


def test_port_held_by_a_stranger_is_refused_and_left_alone(
    box: tuple[Config, Database], emulator_env: Path
) -> None:
    """Fault 19: a process we did not start holds the engine port: refuse, never kill it."""
    config, db = box
    supervisor = supervisor_for(config, db, emulator_env)

    async def scenario() -> None:
        with socket.socket() as stranger:
            stranger.bind(("127.0.0.1", config.engine.port))
            stranger.listen()
            async with serving(supervisor):
                with pytest.raises(ApplianceError) as caught:
                    await supervisor.submit(Command.START, "tester")
                assert str(config.engine.port) in caught.value.message
                assert f"pid {os.getpid()}" in caught.value.message
                assert supervisor.status.state is EngineState.STOPPED
            stranger.getsockname()  # still ours, still open: nobody killed or closed it

    run(scenario)
    assert db.call(lambda s: list_runs(s)) == []


def test_double_start_is_one_action(box: tuple[Config, Database], emulator_env: Path) -> None:
    config, db = box
    supervisor = supervisor_for(config, db, emulator_env)

    async def scenario() -> None:
        async with serving(supervisor):
            first = supervisor.submit(Command.START, "tester")
            second = supervisor.submit(Command.START, "tester")
            assert first is second
            await first
            await wait_for(lambda: supervisor.status.state is EngineState.READY, "READY")
            with pytest.raises(ApplianceError, match="already"):
                await supervisor.submit(Command.START, "tester")
            await supervisor.submit(Command.STOP, "tester")

    run(scenario)
    assert len(db.call(lambda s: list_runs(s))) == 1


def test_a_launch_that_cannot_start_is_failed_not_stuck(tmp_path: Path,
                                                        emulator_env: Path) -> None:
    config, db = migrated_box(tmp_path / "nolaunch",
                              APPLIANCE_ENGINE_COMMAND=str(tmp_path / "no-such-sglang"))
    supervisor = supervisor_for(config, db, emulator_env)

    async def scenario() -> None:
        async with serving(supervisor):
            with pytest.raises(ApplianceError) as caught:
                await supervisor.submit(Command.START, "tester")
            assert "no-such-sglang" in caught.value.message
            assert supervisor.status.state is EngineState.FAILED
            assert supervisor.status.reason == "launch_failed"

    run(scenario)
    db.dispose()
