"""A daemon restart costs users nothing (issue 15).

A kill -9 of the daemon under load gave 503 `engine_unavailable` ("the engine is stopped"):
the restarted supervisor published its initial STOPPED, then ADOPTED, before it had adopted
the engine, and the gateway closed on anything but READY. Now nothing is published until the
new supervisor's first reconcile has finished. Checked with real processes: the daemon, the
engine emulator it launched, the gateway, and a bounded load of streams through it.
"""

from __future__ import annotations

import asyncio
import collections
import datetime as dt
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from appliance.db.database import Database
from appliance.engine.publish import StatusPublisher, read_published
from appliance.engine.states import EngineState
from appliance.engine.supervisor import EngineStatus
from appliance.testing.clock import FakeClock
from tests.conftest import REPO, free_port, run_cli, wait_for
from tests.gateway_rig import auth, chat_body, publish
from tests.test_engine_daemon import box_config, emulators, engine_cli, wait_state
from tests.test_server import Daemon

STREAMS = 16
LOAD_LIMIT_SECONDS = 240.0  # the load's hard bound, whatever happens


def test_nothing_is_published_before_the_first_reconcile(db: Database,
                                                         clock: FakeClock) -> None:
    publish(db, "ready", "serving")  # what the daemon that died had published

    async def scenario() -> None:
        publisher = StatusPublisher(db, clock, interval=0.01)
        publisher.listen(EngineStatus(reconciled=False))  # the initial STOPPED guess
        publisher.listen(EngineStatus(state=EngineState.ADOPTED, message="adopted",
                                      reconciled=False))
        await asyncio.sleep(0.05)
        published = db.call(read_published)
        assert published is not None and published.state == "ready"
        publisher.listen(EngineStatus(state=EngineState.READY, message="ready again"))
        await publisher.stop()
        final = db.call(read_published)
        assert final is not None and final.message == "ready again"

        quiet = StatusPublisher(db, clock)
        quiet.listen(EngineStatus(reconciled=False))
        await quiet.stop()  # a daemon stopped before it reconciled writes nothing
        assert db.call(read_published).message == "ready again"  # type: ignore[union-attr]

    asyncio.run(scenario())


class Load:
    """STREAMS concurrent streaming chats through the gateway until stopped (bounded)."""

    def __init__(self, url: str, key: str) -> None:
        self.url, self.key = url, key
        self.statuses: collections.Counter[int | str] = collections.Counter()
        self.refusals: list[str] = []
        self.stop = threading.Event()
        self.deadline = time.monotonic() + LOAD_LIMIT_SECONDS
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    @property
    def done(self) -> int:
        return sum(self.statuses.values())

    async def _run(self) -> None:
        limits = httpx.Limits(max_connections=STREAMS * 2)
        async with httpx.AsyncClient(timeout=60, limits=limits) as client:
            await asyncio.gather(*(self._worker(client, i) for i in range(STREAMS)))

    async def _worker(self, client: httpx.AsyncClient, index: int) -> None:
        turn = 0
        while not self.stop.is_set() and time.monotonic() < self.deadline:
            turn += 1
            body = chat_body(f"stream {index} turn {turn}", max_tokens=12, stream=True)
            try:
                async with client.stream("POST", f"{self.url}/v1/chat/completions",
                                         headers=auth(self.key), json=body) as reply:
                    data = await reply.aread()
                    self.statuses[reply.status_code] += 1
                    if reply.status_code != 200:
                        self.refusals.append(f"{reply.status_code} "
                                             f"{reply.headers.get('retry-after')} {data[:200]!r}")
                        await asyncio.sleep(0.1)
            except httpx.HTTPError as exc:
                self.statuses[type(exc).__name__] += 1
                await asyncio.sleep(0.1)


def start_gateway(config: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    with config.open("a") as handle:
        handle.write(f'\n[gateway]\nhost = "127.0.0.1"\nport = {port}\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("APPLIANCE_")}
    log = (config.parent / "gateway.log").open("wb")
    proc = subprocess.Popen([sys.executable, "-m", "appliance", "--config", str(config),
                             "gateway"], stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    return proc, f"http://127.0.0.1:{port}"


def serving(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_kill_9_of_the_daemon_under_load_refuses_nobody(tmp_path: Path) -> None:
    config = box_config(tmp_path / "box")
    assert run_cli("--config", str(config), "migrate").returncode == 0
    models = config.parent / "models"
    imported = run_cli("--config", str(config), "weights", "import",
                       str(models / "moonshotai--Kimi-K3"), "--manifest",
                       str(config.parent / "manifest-moonshotai--Kimi-K3.json"))
    assert imported.returncode == 0, imported.stdout + imported.stderr
    created = run_cli("--config", str(config), "admin", "create", "--username", "ops",
                      "--password-stdin", input="a sturdy passphrase\n")
    assert created.returncode == 0, created.stderr
    made = run_cli("--config", str(config), "keys", "create", "--name", "load")
    assert made.returncode == 0, made.stderr
    key = made.stdout.strip()

    env = {"FAKE_SGLANG_LOAD_SECONDS": "1"}
    first = Daemon(config, env=env)
    daemons = [first]
    gateway: subprocess.Popen[bytes] | None = None
    port = first.settings.engine.port
    load: Load | None = None
    db = Database(first.settings.database_url)
    try:
        first.wait_ready(60)
        engine_cli(config, "start")
        wait_state(config, {"ready"})
        gateway, url = start_gateway(config)
        wait_for(lambda: serving(url), "the gateway to admit", 60)

        load = Load(url, key)
        load.thread.start()
        wait_for(lambda: load is not None and load.done >= STREAMS * 2,
                 "the load to be under way", 60)

        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait(timeout=10)
        restarted_at = dt.datetime.now(dt.UTC)
        second = Daemon(config, env=env)
        daemons.append(second)
        second.wait_ready(60)
        status = wait_state(config, {"ready"})
        assert status["adopted"] is True

        # The new daemon has written the row (what it found) and the gateway has polled it
        # since: the requests finished after that are the ones the old code refused.
        def republished() -> bool:
            row = db.call(read_published)
            return row is not None and row.updated_at >= restarted_at

        wait_for(republished, "the restarted daemon to publish the engine's state", 60)
        after = load.done
        wait_for(lambda: load is not None and load.done >= after + STREAMS * 4,
                 "more requests after the restart", 90)
        load.stop.set()
        load.thread.join(timeout=90)
        assert not load.thread.is_alive()
        assert set(load.statuses) == {200}, (dict(load.statuses), load.refusals[:5])
        assert emulators(port) and len(emulators(port)) == 1  # the same engine serves
    finally:
        if load is not None:
            load.stop.set()
            load.thread.join(timeout=90)
        if gateway is not None:
            gateway.send_signal(signal.SIGTERM)
            gateway.wait(timeout=30)
        for daemon in daemons:
            if daemon.proc.poll() is None:
                daemon.stop()
        db.dispose()
        for pid in emulators(port):
            os.killpg(pid, signal.SIGKILL)
