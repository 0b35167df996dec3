"""The gateway's composition root: `build_gateway(config, **overrides)` chooses every adapter
the data plane uses (database, clock, engine URL), and `GatewayParts` starts and stops the
background work: the half-second poll of keys and engine state, and the usage writer.

Tests and the benchmark swap adapters by passing them here, never by patching imports.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field

from sqlalchemy.orm import Session

from appliance.clock import Clock, SystemClock
from appliance.config import Config
from appliance.db.database import Database
from appliance.engine.publish import Published, read_published
from appliance.gateway.admission import Admission
from appliance.gateway.auth_throttle import AuthFailures
from appliance.gateway.engine_gate import FALLBACK_LIMIT, EngineGate
from appliance.gateway.history import HistoryTracker
from appliance.gateway.keycache import KeyCache
from appliance.gateway.limits import KeyLimiter
from appliance.gateway.metrics import GatewayMetrics
from appliance.gateway.recorder import Recorder
from appliance.gateway.upstream import Upstream
from appliance.gateway.usage import tokens_today
from appliance.secrets import engine_api_key, server_secret

log = logging.getLogger(__name__)


@dataclass
class GatewayParts:
    config: Config
    clock: Clock
    db: Database
    keys: KeyCache
    gate: EngineGate
    admission: Admission
    limiter: KeyLimiter
    recorder: Recorder
    metrics: GatewayMetrics
    history: HistoryTracker
    upstream: Upstream
    auth_failures: AuthFailures = field(default_factory=AuthFailures)
    poll_interval: float = 0.5
    created: int = field(default_factory=lambda: int(time.time()))
    _poller: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.upstream.start()
        self.metrics.limit.set_function(lambda: self.admission.limit)
        self.metrics.admitted.set_function(lambda: self.admission.in_use)
        self.metrics.queue_depth.set_function(lambda: self.admission.waiting)
        now = self.clock.now()
        self.limiter.seed_tokens(await self.db.run(lambda s: tokens_today(s, now)), now)
        await self.poll_once()
        self.recorder.start()
        self._poller = asyncio.get_running_loop().create_task(self._poll())

    async def stop(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        await self.recorder.stop()
        await self.upstream.close()

    async def poll_once(self) -> None:
        """One transaction for both: the key table's fingerprint (and the keys, when it
        moved) and the engine's published state."""

        def read(session: Session) -> Published | None:
            self.keys.refresh_in(session)
            return read_published(session)

        ticket = self.keys.poll_started()
        try:
            published = await self.db.run(read)
        finally:
            self.keys.poll_done(ticket)  # failing keys wait for this (keycache)
        if await self.gate.refresh(published) and self.gate.limit:
            self.admission.set_limit(self.gate.limit)
            log.info("admitting up to %d requests at once", self.gate.limit)

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.poll_interval)
            try:
                await self.poll_once()
            except Exception as exc:  # a database hiccup must not end the poll
                log.warning("gateway poll failed: %s", exc)


def build_gateway(config: Config, *, clock: Clock | None = None, db: Database | None = None,
                  engine_url: str | None = None, poll_interval: float = 0.5,
                  auth_failures: AuthFailures | None = None) -> GatewayParts:
    clock = clock or SystemClock()
    db = db or Database(config.database_url)
    gateway = config.gateway
    upstream = Upstream(engine_url or f"http://127.0.0.1:{config.engine.port}",
                        float(gateway.first_byte_timeout_seconds),
                        engine_api_key(config.paths.state_dir))
    return GatewayParts(
        config=config, clock=clock, db=db,
        keys=KeyCache(db, server_secret(config.paths.state_dir)),
        gate=EngineGate(upstream, gateway.max_concurrency),
        admission=Admission(gateway.max_concurrency or FALLBACK_LIMIT, gateway.queue_max),
        limiter=KeyLimiter(), recorder=Recorder(db, clock, gateway.usage_retention_days),
        metrics=GatewayMetrics(), history=HistoryTracker(), upstream=upstream,
        auth_failures=auth_failures or AuthFailures(), poll_interval=poll_interval)
