"""`GET /metrics` on the control plane: gathers the inputs `metrics_out` exports.

One `ControlPlaneMetrics` per runtime (made on the first scrape, kept on `app.state`) owns a
`CollectorRegistry` of its own with one collector. A scrape reads in-memory state only (the
health monitor's latest snapshot, the supervisor's status) plus two figures that need the
database — the weights service's status and the gateway's usage over the last hour — which
are read through `runtime.db.run` (a worker thread, never on the loop) and cached for
`SLOW_MAX_AGE_SECONDS`, so a scrape every few seconds costs at most one read every ten.

Access: `/metrics` is public when `config.health.metrics_public` is true (the app lists it
among the auth middleware's public paths); otherwise the middleware asks for an admin
session or an admin API bearer token like any other route. Nothing here checks it.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from dataclasses import dataclass
from typing import Any

from litestar import Request, Response, get
from litestar.handlers import HTTPRouteHandler
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from appliance.cell.cell_metrics import cell_exposition
from appliance.cell.ops import cell_ops_of
from appliance.db.models import UsageRequest
from appliance.health.metrics_out import (
    InputsCollector,
    MetricsInputs,
    UsageFigures,
    WeightsFigures,
)
from appliance.runtime import Runtime, runtime_of
from appliance.weights.views import FileState, WeightsView

log = logging.getLogger(__name__)

# Prometheus text format 0.0.4, which every scraper reads. Litestar appends the charset to a
# text/* media type itself, so the handler names it without one.
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4
MEDIA_TYPE = CONTENT_TYPE.removesuffix("; charset=utf-8")
SLOW_MAX_AGE_SECONDS = 10.0
USAGE_WINDOW = dt.timedelta(hours=1)
STATE_KEY = "appliance_metrics"


# --- the database figures (pure over a session or a view) ------------------------------------


def usage_since(session: Session, since: dt.datetime, window_seconds: float) -> UsageFigures:
    """Requests and tokens of the usage rows that started at or after `since`, by outcome.
    One grouped query over the `started_at` index."""
    rows = session.execute(
        select(UsageRequest.outcome, func.count(),
               func.coalesce(func.sum(UsageRequest.prompt_tokens), 0),
               func.coalesce(func.sum(UsageRequest.completion_tokens), 0),
               func.coalesce(func.sum(UsageRequest.cached_tokens), 0))
        .where(UsageRequest.started_at >= since)
        .group_by(UsageRequest.outcome))
    requests: dict[str, int] = {}
    tokens = {"prompt": 0, "completion": 0, "cached": 0}
    for outcome, count, prompt, completion, cached in rows:
        requests[str(outcome)] = int(count)
        tokens["prompt"] += int(prompt)
        tokens["completion"] += int(completion)
        tokens["cached"] += int(cached)
    return UsageFigures(window_seconds, requests, tokens)


def weights_figures(view: WeightsView) -> WeightsFigures:
    verified = sum(f.size for f in view.files if f.state == FileState.VERIFIED)
    return WeightsFigures(activity=view.activity, ready=view.ready_for_engine,
                          total_bytes=view.total_bytes, done_bytes=view.done_bytes,
                          verified_bytes=verified, rate_bytes_per_second=view.rate_bps)


@dataclass(frozen=True)
class SlowFigures:
    """The figures read from the database; None: the read failed (left out of the scrape)."""

    weights: WeightsFigures | None = None
    usage: UsageFigures | None = None


# --- the exporter ------------------------------------------------------------------------------


class ControlPlaneMetrics:
    """The control plane's registry over one runtime. `render()` refreshes the database
    figures when older than `max_age` seconds (on the runtime's monotonic clock), then
    writes the exposition; the collector itself only reads memory."""

    def __init__(self, runtime: Runtime, *, max_age: float = SLOW_MAX_AGE_SECONDS) -> None:
        self.runtime = runtime
        self.max_age = max_age
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(InputsCollector(self.inputs))
        self._slow = SlowFigures()
        self._slow_at: float | None = None
        self._lock = asyncio.Lock()  # concurrent scrapes share one refresh

    def inputs(self) -> MetricsInputs:
        runtime = self.runtime
        status = runtime.supervisor.status
        return MetricsInputs(
            version=runtime.version, started_at=runtime.started_at,
            gpus_expected=runtime.config.gpu.expected_count, health=runtime.health.latest,
            engine_state=status.state, load_percent=status.percent,
            eta_seconds=status.eta_seconds, weights=self._slow.weights, usage=self._slow.usage)

    async def render(self) -> bytes:
        await self.refresh()
        return generate_latest(self.registry)

    async def refresh(self) -> None:
        async with self._lock:
            now = self.runtime.clock.monotonic()
            if self._slow_at is not None and now - self._slow_at < self.max_age:
                return
            self._slow = SlowFigures(await self._weights(), await self._usage())
            self._slow_at = now

    async def _weights(self) -> WeightsFigures | None:
        try:
            return weights_figures(await self.runtime.weights.status())
        except Exception:
            log.exception("metrics: could not read the weights status")
            return None

    async def _usage(self) -> UsageFigures | None:
        since = self.runtime.clock.now() - USAGE_WINDOW
        window = USAGE_WINDOW.total_seconds()
        try:
            return await self.runtime.db.run(lambda s: usage_since(s, since, window))
        except Exception:
            log.exception("metrics: could not read the usage figures")
            return None


def exporter_of(request: Request[Any, Any, Any]) -> ControlPlaneMetrics:
    """The app's exporter for its runtime, made on first use (nothing at import or wiring)."""
    runtime = runtime_of(request)
    state = request.app.state
    exporter: ControlPlaneMetrics | None = state.get(STATE_KEY)
    if exporter is None or exporter.runtime is not runtime:
        exporter = ControlPlaneMetrics(runtime)
        state[STATE_KEY] = exporter
    return exporter


def metrics_handler(path: str = "/metrics") -> HTTPRouteHandler:
    """A fresh `GET path` handler serving the exposition (Prometheus text format 0.0.4).
    Left out of the OpenAPI schema; never cached by a proxy."""

    @get(path, include_in_schema=False, media_type=MEDIA_TYPE)
    async def metrics(request: Request[Any, Any, Any]) -> Response[bytes]:
        body = await exporter_of(request).render()
        # A cell head's figures (members, router), after the daemon's own (cell_metrics).
        body += await cell_exposition(cell_ops_of(request.app.state, runtime_of(request)))
        return Response(body, media_type=MEDIA_TYPE, headers={"Cache-Control": "no-store"})

    return metrics
