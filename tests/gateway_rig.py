"""Test rig for the gateway: the real GatewayApp under uvicorn on 127.0.0.1 in a thread of
the test process, in front of the real engine emulator (a subprocess), over a real database.

The test stands in for the control plane where the gateway reads it: it publishes the
engine's state with `appliance.engine.publish.write_published`, exactly the row the daemon
writes, and creates keys with the key store the console uses.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import threading
import time
from typing import Any

import httpx
import pytest
import uvicorn

from appliance.config import Config
from appliance.db.database import Database
from appliance.engine.publish import write_published
from appliance.gateway.app import GatewayApp
from appliance.gateway.keys import KeyLimits, create_key
from appliance.gateway.parts import GatewayParts, build_gateway
from appliance.secrets import server_secret
from tests.conftest import wait_for
from tests.test_fake_sglang import Emulator, small_model

MODEL = "kimi-k3"


class LiveGateway:
    def __init__(self, config: Config, db: Database, engine_url: str,
                 **overrides: Any) -> None:
        self.config, self.db = config, db
        self.parts: GatewayParts = build_gateway(config, db=db, engine_url=engine_url,
                                                 poll_interval=0.1, **overrides)
        self.port = config.gateway.port
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(
            GatewayApp(self.parts), host="127.0.0.1", port=self.port, log_config=None,
            access_log=False, lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self) -> LiveGateway:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("gateway did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)

    # --- standing in for the control plane -----------------------------------------------------

    def publish(self, state: str, message: str = "", eta: float | None = None) -> None:
        publish(self.db, state, message, eta)

    def publish_cell(self, upstream_url: str, **fields: Any) -> None:
        publish_cell(self.db, upstream_url, **fields)

    def wait_admitting(self, admitting: bool = True) -> None:
        def seen() -> bool:
            body = httpx.get(f"{self.url}/health", timeout=5).json()
            return bool(body["admitting"]) is admitting
        wait_for(seen, f"the gateway to {'admit' if admitting else 'stop admitting'}")

    def key(self, name: str = "alice", **limits: int | None) -> str:
        return make_key(self.config, self.db, name, **limits)

    def usage_rows(self, count: int) -> list[Any]:
        """The usage rows, once `count` records have been written (the writer runs each
        second), in the order the requests finished."""
        from sqlalchemy import select

        from appliance.db.models import UsageRequest

        wait_for(lambda: self.parts.recorder.written >= count, f"{count} usage records", 15)
        return self.db.call(lambda s: [
            (r.key_id, r.endpoint, r.stream, r.status, r.outcome, r.prompt_tokens,
             r.completion_tokens, r.cached_tokens, r.history)
            for r in s.scalars(select(UsageRequest).order_by(UsageRequest.id))])


def publish(db: Database, state: str, message: str = "", eta: float | None = None) -> None:
    """Write the engine state row exactly as the control plane's publisher does."""
    now = dt.datetime.now(dt.UTC)
    db.call(lambda s: write_published(s, state, message or state, eta, now))


def publish_cell(db: Database, upstream_url: str, *, active: bool = True,
                 serving: bool = True, message: str = "", eta: float | None = None,
                 capacity: int | None = None) -> None:
    """Write the cell's row exactly as the head's daemon does (appliance.cell.published)."""
    from appliance.cell.published import CellPublished, write_cell_published

    row = CellPublished(active, upstream_url, serving, message, eta, capacity,
                        dt.datetime.now(dt.UTC))
    db.call(lambda s: write_cell_published(s, row))


def make_key(config: Config, db: Database, name: str = "alice", **limits: int | None) -> str:
    """A gateway API key made with the key store the console uses; returns the key."""
    secret = server_secret(config.paths.state_dir)
    now = dt.datetime.now(dt.UTC)
    key, _ = db.call(lambda s: create_key(s, secret, name=name, owner="tests", by="tests",
                                          now=now, limits=KeyLimits(**limits)))
    return key


def start_engine(tmp_path_factory: pytest.TempPathFactory, *flags: str,
                 token_seconds: float = 0.002, **env: str) -> Emulator:
    """The engine emulator serving MODEL with at most 4 running requests (`flags` come last,
    so they may change that), `env` in its environment, ready."""
    root = tmp_path_factory.mktemp("engine")
    emu = Emulator(root, [str(small_model(root / "model", 1 << 20)), "--served-model-name", MODEL,
                          "--max-running-requests", "4", "--enable-cache-report",
                          "--reasoning-parser", "kimi_k3", "--tool-call-parser", "kimi_k3",
                          "--tp-size", "8", "--dcp-size", "8", *flags],
                   FAKE_SGLANG_FAULT=f"slow_tokens={token_seconds}", **env)
    emu.wait_ready()
    return emu


def stop_engine(emu: Emulator) -> None:
    import signal

    emu.proc.send_signal(signal.SIGTERM)
    emu.kill()


def emulator_stats(engine: Emulator) -> dict[str, int]:
    return dict(httpx.get(f"{engine.url}/emulator/stats", timeout=5).json())


async def engine_at(engine: Emulator, running: int, waiting: int,
                    finished: list[str] | None = None) -> None:
    """Wait until the emulator has `running` requests running and `waiting` queued (bounded;
    its state is what is waited on). `finished`: the requests answered so far; any there
    means the queue was never set up, a failure at once."""
    for _ in range(3000):
        stats = await asyncio.to_thread(emulator_stats, engine)
        if (stats["running"], stats["waiting"]) == (running, waiting):
            return
        if finished:
            pytest.fail(f"{finished} finished before the engine's queue was set up")
        await asyncio.sleep(0.01)
    pytest.fail(f"the engine never had {running} running and {waiting} waiting")


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def chat_body(content: str = "hi", **extra: object) -> dict[str, object]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}
