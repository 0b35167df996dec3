"""Whether the gateway may forward, and how many at once: the engine's state as the control
plane publishes it (`appliance.engine.publish`), plus the engine's own capacity.

Fed by the gateway's half-second poll (`GatewayParts.poll_once`). While the published state
admits requests (READY only: a DEGRADED engine is alive but failing) and the engine's
figures are known, requests go through; otherwise each gets a 503 with Retry-After and a
message that says the state and, during a start, the ETA. When the state turns serving,
the gateway asks the engine for its effective `max_running_requests` (`/server_info`,
summed over data-parallel ranks) and its context length (`/v1/models` `max_model_len`); an
operator's `gateway.max_concurrency` overrides the first. How many are admitted at once is
decided from these with the qualified point (`appliance.gateway.qualified`).

While a qualification runs (`Published.qualifying`) every request gets a 503 too, saying the
box is being qualified and until when; the qualification's own load goes to the engine
directly, never through here.
"""

from __future__ import annotations

import datetime as dt
import logging
import math
from typing import Any

from appliance.clock import Clock, SystemClock
from appliance.engine.publish import Published
from appliance.gateway.errors import GatewayError
from appliance.gateway.qualified import FALLBACK_LIMIT
from appliance.gateway.upstream import Upstream

log = logging.getLogger(__name__)
QUALIFYING_RETRY_MIN, QUALIFYING_RETRY_MAX = 5, 3600


def engine_capacity(server_info: Any) -> int | None:
    states = server_info.get("internal_states") if isinstance(server_info, dict) else None
    if isinstance(states, list) and states:
        values = [s.get("effective_max_running_requests_per_dp") or s.get("max_running_requests")
                  for s in states if isinstance(s, dict)]
        counts = [v for v in values if isinstance(v, int) and v > 0]
        if counts and len(counts) == len(values):
            return sum(counts)
    value = server_info.get("max_running_requests") if isinstance(server_info, dict) else None
    return value if isinstance(value, int) and value > 0 else None


def context_length(models: Any) -> int | None:
    data = models.get("data") if isinstance(models, dict) else None
    if isinstance(data, list) and data and isinstance(data[0], dict):
        value = data[0].get("max_model_len")
        if isinstance(value, int) and value > 0:
            return value
    return None


def unavailable(published: Published | None) -> GatewayError:
    if published is None:
        return GatewayError(503, "engine_unavailable",
                            "the engine's state is not known yet: the control plane "
                            "(appliance.service) has not published it", retry_after=10)
    retry = 30
    message = f"the engine is {published.state.replace('_', ' ')}: {published.message}"
    if published.eta_seconds is not None and published.eta_seconds > 0:
        retry = min(3600, max(5, math.ceil(published.eta_seconds)))
        minutes = max(1, round(published.eta_seconds / 60))
        message += f"; ready in about {minutes} min"
    return GatewayError(503, "engine_unavailable", message + "; retry later", retry_after=retry)


def qualifying(published: Published, now: dt.datetime) -> GatewayError:
    """The refusal while the box is being qualified: until the run's expected end when the
    daemon published one (else the lease's), Retry-After the seconds to it."""
    until = published.qualifying_ends_at or published.qualifying_until or now
    if published.qualifying_until is not None and until < published.qualifying_until:
        until = published.qualifying_until  # ran over its estimate: the lease is renewed
    retry = min(QUALIFYING_RETRY_MAX,
                max(QUALIFYING_RETRY_MIN, math.ceil((until - now).total_seconds())))
    return GatewayError(503, "engine_qualifying",
                        f"the box is being qualified (until {until:%H:%M:%S} UTC): its "
                        "capacity is measured without users; retry then", retry_after=retry)


class EngineGate:
    def __init__(self, upstream: Upstream, override_limit: int,
                 clock: Clock | None = None) -> None:
        self.upstream, self.override_limit = upstream, override_limit
        self.clock = clock or SystemClock()
        self.published: Published | None = None
        self.limit: int | None = None  # the override, else the engine's, else a guess
        self.engine_limit: int | None = None  # the engine's max_running_requests, as it said
        self.context_len: int | None = None
        self.open = False

    def refusal(self) -> GatewayError | None:
        published = self.published
        if published is not None and published.qualifying(self.clock.now()):
            return qualifying(published, self.clock.now())
        return None if self.open else unavailable(published)

    async def refresh(self, published: Published | None) -> bool:
        """Take the newest published state (the poll reads it); True when the concurrency
        limit changed."""
        self.published = published
        serving = self.published is not None and self.published.admits_requests
        if not serving:
            self.open = False
            return False
        if self.open:
            return False
        before = self.limit
        await self._learn_capacity()
        self.open = True
        return self.limit != before

    async def _learn_capacity(self) -> None:
        limit = None
        try:
            limit = engine_capacity(await self.upstream.get_json("/server_info"))
            self.context_len = context_length(await self.upstream.get_json("/v1/models"))
        except Exception as exc:
            log.warning("could not read the engine's capacity (%s); using %s", exc,
                        self.override_limit or FALLBACK_LIMIT)
        self.engine_limit = limit
        self.limit = self.override_limit or limit or FALLBACK_LIMIT
