"""The gateway's composition root: `build_gateway(config, **overrides)` chooses every adapter
the data plane uses (database, clock, engine URL), and `GatewayParts` starts and stops the
background work: the poll of keys and engine state, and the usage writer. Admission's limit
is set here and only here (`_apply_limit`), from what the poll learns: the running spec's
qualified point from the ledger, else the engine's capacity (`appliance.gateway.qualified`).

The poll runs every `poll_interval` (half a second) while the gateway has work, and backs off
to `idle_poll_interval` once nothing has come for `idle_after` seconds, so an idle gateway
costs the box almost nothing. Freshness does not suffer: the first request after an idle
spell (a `/health` probe too) wakes the poll and waits for it (`fresh`), so it is judged on
keys and an engine state read after it arrived, as during traffic; polls are never closer
than `poll_interval`, however many requests wake it.

On the head of a cell the same poll reads the cell's row (`appliance.cell.published`) in the
same transaction, and the gate routes by it (`appliance.gateway.engine_gate.decide`): to the
cell's router, admitting up to the cell's capacity.

Tests and the benchmark swap adapters by passing them here, never by patching imports.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.orm import Session

from appliance.cell.published import CellPublished, read_cell_published
from appliance.clock import Clock, SystemClock
from appliance.config import Config
from appliance.config import engine_url as local_engine_url
from appliance.db.database import Database
from appliance.engine.publish import Published, read_published
from appliance.gateway.admission import Admission
from appliance.gateway.auth_throttle import AuthFailures
from appliance.gateway.engine_gate import EngineGate
from appliance.gateway.history import HistoryTracker
from appliance.gateway.keycache import KeyCache
from appliance.gateway.limits import KeyLimiter
from appliance.gateway.metrics import GatewayMetrics
from appliance.gateway.polls import PollCount
from appliance.gateway.qualified import (
    FALLBACK_LIMIT,
    QUALIFIED,
    AdmissionLimit,
    QualifiedPoint,
    QualifiedReader,
    admission_limit,
)
from appliance.gateway.recorder import Recorder
from appliance.gateway.upstream import Upstream
from appliance.gateway.usage import tokens_today
from appliance.secrets import engine_api_key, server_secret

log = logging.getLogger(__name__)
IDLE_AFTER = 5.0  # seconds without a request before the poll backs off
IDLE_POLL_INTERVAL = 5.0  # the idle poll: an engine state or key change seen within this
FRESH_WAIT_MAX = 2.0  # the longest a request waits for the woken poll (a stalled database)


def free_kv_tokens(loads: Any) -> int | None:
    """Free KV tokens over all data-parallel ranks from SGLang's `/v1/loads` (None when the
    report is not one)."""
    entries = loads.get("loads") if isinstance(loads, dict) else None
    if not isinstance(entries, list) or not entries:
        return None
    free = 0
    for entry in entries:
        total = entry.get("max_total_num_tokens") if isinstance(entry, dict) else None
        used = entry.get("num_used_tokens") if isinstance(entry, dict) else None
        if not isinstance(total, int) or not isinstance(used, int) or total <= 0:
            return None
        free += max(0, total - used)
    return free


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
    idle_poll_interval: float = IDLE_POLL_INTERVAL
    idle_after: float = IDLE_AFTER
    created: int = field(default_factory=lambda: int(time.time()))
    _poller: asyncio.Task[None] | None = None
    _last_active: float = field(default=-1e9)  # monotonic, the last request's arrival
    _polled_at: float = field(default=-1e9)  # monotonic, the start of the last good poll
    _backed_off: bool = False  # the poll is in its idle wait
    _wake: asyncio.Event | None = None
    _polls: PollCount = field(default_factory=PollCount)  # good polls so far
    kv_readings: int = 0  # readings of the engine's KV use so far
    qualified_reader: QualifiedReader = field(default_factory=QualifiedReader)
    qualified: QualifiedPoint | None = None  # the running spec's, as the last poll read it
    admission_limit: AdmissionLimit = field(
        default_factory=lambda: AdmissionLimit(FALLBACK_LIMIT, "unqualified: engine "
                                               "max_running_requests"))

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
        """One transaction for all four: the key table's fingerprint (and the keys, when it
        moved), the engine's published state, the cell's (on a head), and the running spec's
        qualified point."""

        def read(session: Session) -> tuple[Published | None, CellPublished | None]:
            self.keys.refresh_in(session)
            published = read_published(session)
            cell = read_cell_published(session)
            # in a cell the head's qualified point is not looked up: it does not apply there
            # (appliance.gateway.qualified.cell_limit), and Retry-After must not use it either
            spec = None if published is None or (cell and cell.active) else published.spec_hash
            self.qualified = self.qualified_reader.read(session, spec)
            return published, cell

        started = asyncio.get_running_loop().time()
        ticket = self.keys.poll_started()
        try:
            published, cell = await self.db.run(read)
        finally:
            self.keys.poll_done(ticket)  # failing keys wait for this (keycache)
        await self.gate.refresh(published, cell)
        self._apply_limit()
        await self._read_kv()
        self._polled_at = started
        self._polls.advance()

    def _apply_limit(self) -> None:
        """The one place admission's limit is set (every poll; a change is logged): the
        operator's override, else the running spec's qualified point less the margin, else
        the engine's capacity as the gate learned it; through a cell, the cell's (the
        route's: the override, else the capacity the head published)."""
        gateway = self.config.gateway
        decided = self.gate.route.admission or admission_limit(
            self.gate.engine_limit, self.qualified, margin=gateway.qualified_margin,
            override=gateway.max_concurrency)
        if decided == self.admission_limit:
            return
        self.admission_limit = decided
        self.admission.set_limit(decided.limit)
        point = decided.qualified if decided.source == QUALIFIED else None
        self.admission.service_prior = point.batch_seconds if point else None
        log.info("%s", decided.words())

    async def _read_kv(self) -> None:
        """The engine's free KV tokens for admission to weigh requests by, read while there
        is work (an idle engine's pool is free; nothing is read then), forgotten while the
        gate is closed. `/v1/loads` is SGLang's JSON load report (no --enable-metrics
        needed): per data-parallel rank, `max_total_num_tokens` and `num_used_tokens`.
        Through a cell nothing is read, and admission weighs by count alone: the router
        speaks for one worker at best, and no one engine's pool is the cell's."""
        admission = self.admission
        if not self.gate.open or self.gate.route.through_cell:
            admission.set_kv_free(None)
            return
        if not admission.in_use and not admission.waiting:
            return
        admission.set_kv_free(free_kv_tokens(await self._get_loads()))
        self.kv_readings += 1

    async def _get_loads(self) -> Any:
        try:
            return await self.upstream.get_json("/v1/loads?include=core")
        except Exception as exc:  # an old engine, a hiccup: admit by count alone meanwhile
            log.debug("could not read the engine's KV use: %s", exc)
            return None

    @property
    def backed_off(self) -> bool:
        """Whether the poll is in its idle wait now."""
        return self._backed_off

    @property
    def idle(self) -> bool:
        """Nothing admitted, nothing queued, and no request for `idle_after` seconds."""
        quiet = asyncio.get_running_loop().time() - self._last_active >= self.idle_after
        return quiet and not self.admission.in_use and not self.admission.waiting

    async def fresh(self, *, active: bool = True) -> None:
        """Called as a request arrives (`active=False` for a health probe, which does not
        keep the poll busy). While the poll has backed off, wake it, and when its last read
        is older than `poll_interval` wait for the next one (at most FRESH_WAIT_MAX)."""
        loop = asyncio.get_running_loop()
        if active:
            self._last_active = loop.time()
        if not self._backed_off:
            return
        if self._wake is not None:
            self._wake.set()
        if loop.time() - self._polled_at < self.poll_interval:
            return
        # a failed poll does not count; the deadline bounds the wait
        await self._polls.wait_past(self._polls.value + 1, FRESH_WAIT_MAX)

    async def _pause(self) -> None:
        """Until the next poll: `poll_interval` at least, up to `idle_poll_interval` while
        idle unless a request wakes it."""
        loop = asyncio.get_running_loop()
        began = loop.time()
        await asyncio.sleep(self.poll_interval)
        remaining = began + self.idle_poll_interval - loop.time()
        if remaining <= 0 or not self.idle:
            return
        self._wake = asyncio.Event()
        self._backed_off = True
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), remaining)
        finally:
            self._backed_off = False
            self._wake = None

    async def _poll(self) -> None:
        while True:
            await self._pause()
            try:
                await self.poll_once()
            except Exception as exc:  # a database hiccup must not end the poll
                log.warning("gateway poll failed: %s", exc)


def build_gateway(config: Config, *, clock: Clock | None = None, db: Database | None = None,
                  engine_url: str | None = None, poll_interval: float = 0.5,
                  idle_poll_interval: float = IDLE_POLL_INTERVAL,
                  idle_after: float = IDLE_AFTER,
                  auth_failures: AuthFailures | None = None) -> GatewayParts:
    clock = clock or SystemClock()
    # connections kept open: the gateway runs a few small transactions a second (its polls,
    # the usage writer) and never replaces the database file
    db = db or Database(config.database_url, kept_connections=2)
    gateway = config.gateway
    upstream = Upstream(engine_url or local_engine_url(config),
                        float(gateway.first_byte_timeout_seconds),
                        engine_api_key(config.paths.state_dir))
    return GatewayParts(
        config=config, clock=clock, db=db,
        keys=KeyCache(db, server_secret(config.paths.state_dir)),
        gate=EngineGate(upstream, gateway.max_concurrency, clock),
        admission=Admission(gateway.max_concurrency or FALLBACK_LIMIT, gateway.queue_max),
        limiter=KeyLimiter(), recorder=Recorder(db, clock, gateway.usage_retention_days),
        metrics=GatewayMetrics(), history=HistoryTracker(), upstream=upstream,
        auth_failures=auth_failures or AuthFailures(), poll_interval=poll_interval,
        idle_poll_interval=idle_poll_interval, idle_after=idle_after)
