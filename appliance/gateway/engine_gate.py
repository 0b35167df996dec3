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

On the head of a prefill/decode cell (issue 17) the daemon also publishes the cell's row
(`appliance.cell.published`). While it is active, the gateway forwards to the cell's router
instead of the local engine, with the same engine key (the router demands it), and opens and
closes on the cell's word: it admits while the cell serves, up to the cell's capacity, and
refuses with the cell's reason and ETA while it does not. The qualification lease still
closes it. `decide` is that choice, pure: a `Route` per poll.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import math
import re
from dataclasses import dataclass
from typing import Any

from appliance.cell.published import CellPublished
from appliance.clock import Clock, SystemClock
from appliance.engine.publish import Published
from appliance.gateway.errors import GatewayError, rewrap_engine_error
from appliance.gateway.qualified import (
    FALLBACK_LIMIT,
    AdmissionLimit,
    cell_limit,
    qualifying_until,
)
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
    return _not_serving("engine_unavailable",
                        f"the engine is {published.state.replace('_', ' ')}: "
                        f"{published.message}", published.eta_seconds)


def cell_unavailable(cell: CellPublished) -> GatewayError:
    """The refusal while the cell does not serve: the head's reason (which role has no member
    READY, and why, with the ETA in its words) and Retry-After that same ETA (the head rounds
    it up to tens of seconds, appliance.cell.view.shown_eta), 30 s when none is known. No
    "ready in about N min" is added: the head's words already say when, and a rounding of
    their own would contradict them."""
    eta = cell.eta_seconds
    retry = min(3600, max(5, math.ceil(eta))) if eta is not None and eta > 0 else 30
    return GatewayError(503, "cell_unavailable", "the cell is not serving: " + (
        cell.message or "no prefill or no decode member is ready") + "; retry later",
        retry_after=retry)


# What the cell's router says of its engines (`Decode server error: error sending request for
# url (http://10.0.0.6:30000/...)`) names internal addresses: never shown to a user.
_URL = re.compile(r"\b(?:https?|grpc)://[^\s)\"',;]+")
ROUTER_FAILED = ("a prefill or decode engine did not answer the cell's router (it is being "
                 "restarted, or was lost: the head is checking its members)")
ROUTER_DOWN = "the cell's router does not answer (the head starts it again within seconds)"
ROUTER_RETRY = 5  # seconds: the head's watch sees a lost engine within a few polls


def router_failure(cell: CellPublished, why: str) -> GatewayError:
    """The gateway's own 503 for a request the cell's router could not serve (its 502, 503
    or 504, or no answer): the head's reason and ETA when it already says the cell does not
    serve, else `why` with a short Retry-After."""
    if not cell.serving:
        return cell_unavailable(cell)
    return GatewayError(503, "cell_unavailable", f"the cell is not serving: {why}; retry "
                        "later", retry_after=ROUTER_RETRY)


def without_urls(text: str) -> str:
    return _URL.sub("an engine of the cell", text)


def _not_serving(code: str, message: str, eta_seconds: float | None) -> GatewayError:
    """A 503 saying why, and when it should serve again: Retry-After the ETA (5 s to an
    hour), 30 s when none is known."""
    retry = 30
    if eta_seconds is not None and eta_seconds > 0:
        retry = min(3600, max(5, math.ceil(eta_seconds)))
        minutes = max(1, round(eta_seconds / 60))
        message += f"; ready in about {minutes} min"
    return GatewayError(503, code, message + "; retry later", retry_after=retry)


def qualifying(published: Published, now: dt.datetime) -> GatewayError:
    """The refusal while the box is being qualified: until the run's expected end when the
    daemon published one (else the lease's), Retry-After the seconds to it."""
    until = qualifying_until(published, now) or now
    retry = min(QUALIFYING_RETRY_MAX,
                max(QUALIFYING_RETRY_MIN, math.ceil((until - now).total_seconds())))
    return GatewayError(503, "engine_qualifying",
                        f"the box is being qualified (until {until:%H:%M:%S} UTC): its "
                        "capacity is measured without users; retry then", retry_after=retry)


@dataclass(frozen=True)
class Route:
    """Where the gateway forwards now, and on whose word it opens: the local engine's
    (`cell` None) or the active cell's. `admission` is the cell's limit; None on the local
    engine, whose limit needs its own figures (`EngineGate` learns them)."""

    base_url: str
    published: Published | None
    cell: CellPublished | None = None
    admission: AdmissionLimit | None = None

    @property
    def through_cell(self) -> bool:
        return self.cell is not None

    @property
    def upstream_name(self) -> str:
        """What the users' errors call the upstream."""
        return "the cell's router" if self.cell is not None else "the engine"

    @property
    def target(self) -> tuple[str, bool]:
        """Whom requests go to: a new target's figures are learned before it is used."""
        return self.base_url, self.cell is not None

    @property
    def serving(self) -> bool:
        if self.cell is not None:
            return self.cell.serving
        return self.published is not None and self.published.admits_requests

    def upstream_error(self, status: int, body: bytes, anthropic: bool) -> GatewayError:
        """The error a user gets for the upstream's error answer. The engine's own is
        passed on in the client's shape. Through the cell, the router's 502, 503 and 504
        (an engine it could not reach, none it may send to, a timeout) are the gateway's own
        `cell_unavailable` with Retry-After and the head's reason, and any other error's
        words lose the internal addresses the router puts in them (issue 25)."""
        if self.cell is None:
            return rewrap_engine_error(status, body, anthropic)
        if status in (502, 503, 504):
            return router_failure(self.cell, ROUTER_FAILED)
        error = rewrap_engine_error(status, body, anthropic)
        return dataclasses.replace(error, message=without_urls(error.message))

    def unserved(self, path: str, anthropic: bool) -> GatewayError | None:
        """The 404 for a path this upstream has no route for, or None: the cell's router
        (sglang-router 0.3.2, src/server.rs) has no Anthropic Messages route, so such a
        request is answered here and never sent on."""
        if self.cell is None or not anthropic:
            return None
        return GatewayError(
            404, "not_served_in_cell", f"{path} is not served while this box heads a cell: "
            "the cell's router (sglang-router 0.3.2) has no Anthropic Messages route; send "
            "the conversation to /v1/chat/completions (OpenAI's format), which the cell serves")

    def unreachable(self, exc: Exception) -> GatewayError:
        """The error for an upstream that could not be reached at all."""
        if self.cell is not None:
            return router_failure(self.cell, ROUTER_DOWN)
        return GatewayError(502, "engine_unreachable", f"could not reach {self.upstream_name} "
                            f"({exc}); it may be restarting", retry_after=5)

    def refusal(self, now: dt.datetime) -> GatewayError | None:
        """The 503 a request gets now, or None. A qualification of the head closes the
        gateway in a cell too: its engine is measured without users, and the lease is the
        daemon's word that the box is not the users' now."""
        published = self.published
        if published is not None and published.qualifying(now):
            return qualifying(published, now)
        if self.serving:
            return None
        return unavailable(published) if self.cell is None else cell_unavailable(self.cell)


def decide(published: Published | None, cell: CellPublished | None, local_url: str,
           override: int = 0) -> Route:
    """The route for what the daemon published: the cell's router while the cell's row is
    active (its capacity sizing admission, `override` first), else the local engine."""
    if cell is not None and cell.active:
        return Route(cell.upstream_url.rstrip("/"), published, cell,
                     cell_limit(cell.capacity, override=override))
    return Route(local_url, published)


class EngineGate:
    """The route the gateway forwards by, kept open only once its target's figures are
    read: `open` is true exactly while `route` serves."""

    def __init__(self, upstream: Upstream, override_limit: int,
                 clock: Clock | None = None) -> None:
        self.upstream, self.override_limit = upstream, override_limit
        self.clock = clock or SystemClock()
        self.local_url = upstream.base_url
        self.route = decide(None, None, self.local_url)
        self.limit: int | None = None  # the override, else the engine's (cell's), else a guess
        self.engine_limit: int | None = None  # the engine's max_running_requests, as it said
        self.context_len: int | None = None

    @property
    def published(self) -> Published | None:
        return self.route.published

    @property
    def open(self) -> bool:
        return self.route.serving

    def refusal(self) -> GatewayError | None:
        return self.route.refusal(self.clock.now())

    async def refresh(self, published: Published | None,
                      cell: CellPublished | None = None) -> None:
        """Take the newest published state (the poll reads both rows). A route that serves a
        target not served before is taken only after that target's figures are read, so
        requests meanwhile keep going where they went."""
        route = decide(published, cell, self.local_url, self.override_limit)
        if route.serving and not (self.open and route.target == self.route.target):
            await self._learn(route)
        self.route = route
        if route.admission is not None:
            self.limit = route.admission.limit

    async def _learn(self, route: Route) -> None:
        if route.through_cell:
            await self._learn_cell(route.base_url)
            return
        limit = None
        try:
            limit = engine_capacity(await self.upstream.get_json("/server_info"))
            self.context_len = context_length(await self.upstream.get_json("/v1/models"))
        except Exception as exc:
            log.warning("could not read the engine's capacity (%s); using %s", exc,
                        self.override_limit or FALLBACK_LIMIT)
        self.engine_limit = limit
        self.limit = self.override_limit or limit or FALLBACK_LIMIT

    async def _learn_cell(self, router_url: str) -> None:
        """The context length through the router, once as it turns serving. Its
        `/server_info` is not read: it speaks for one worker at best, and the cell's capacity
        is the daemon's (the decode members' sum, in the row)."""
        self.engine_limit = None
        try:
            self.context_len = context_length(
                await self.upstream.get_json("/v1/models", base_url=router_url))
        except Exception as exc:
            self.context_len = None  # the local engine's need not be the cell members'
            log.warning("could not read the model's context length through the cell's router "
                        "(%s); prompts are left to the engines to check", exc)
