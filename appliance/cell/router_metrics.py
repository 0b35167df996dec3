"""The head's router as it sees the cell: `sglang-router` 0.3.2's Prometheus text, read from
its metrics port (loopback, `appliance.cell.router.METRICS_PORT`).

What 0.3.2 exposes in HTTP PD mode, and what is used here (tests/data/router_metrics/ holds
scrapes of the real router over engine emulators):

- per worker (`worker` label: the engine's URL, as the router spec names it):
  `smg_worker_health` (1 healthy, 0 taken out by its health checks),
  `smg_worker_cb_state` (circuit breaker: 0 closed, 1 open, 2 half open),
  `smg_worker_requests_active` (requests running through the router on it),
  `smg_worker_cb_consecutive_failures`;
- per role: `smg_worker_pool_size{worker_type}`;
- the cell's traffic: `smg_router_requests_total` (routed requests, a counter),
  `smg_http_responses_total{status_code}` and the `smg_router_request_duration_seconds`
  histogram's sum and count.

The router's `smg_router_ttft_seconds` and `smg_router_tokens_total` are gRPC-only (its own
help text says so): over HTTP workers it never writes them, so the cell's time to first token
comes from the head gateway's usage rows instead (appliance.cell.overview).

Pure parsing and arithmetic, plus `RouterMetricsReader`, the thin adapter that scrapes and
keeps the last minute of scrapes so that rates come from two of them.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Final, Protocol

import httpx
from prometheus_client.parser import text_string_to_metric_families

from appliance.cell.router import METRICS_PORT

CIRCUIT: Final = {0: "closed", 1: "open", 2: "half open"}
RATE_WINDOW_SECONDS: Final = 60.0
MIN_RATE_SPAN_SECONDS: Final = 2.0
TIMEOUT: Final = httpx.Timeout(2.0, connect=1.0)
DEFAULT_URL: Final = f"http://127.0.0.1:{METRICS_PORT}/metrics"


@dataclass(frozen=True)
class WorkerFigures:
    """One engine as the router sees it; None where the router did not say."""

    url: str
    healthy: bool | None = None
    circuit: str | None = None
    running: int | None = None
    consecutive_failures: int | None = None


@dataclass(frozen=True)
class RouterScrape:
    workers: dict[str, WorkerFigures] = field(default_factory=dict)
    pool_sizes: dict[str, int] = field(default_factory=dict)  # by role
    requests_total: float = 0.0
    responses_total: float = 0.0
    errors_total: float = 0.0  # answers with a 5xx status
    duration_sum: float = 0.0
    duration_count: float = 0.0


@dataclass(frozen=True)
class RouterRates:
    """Figures over the span between two scrapes."""

    seconds: float
    requests_per_second: float
    errors_per_second: float
    mean_request_seconds: float | None


@dataclass(frozen=True)
class RouterReading:
    """One look at the router: `up` False with `error` when its metrics port did not
    answer; `rates` None until two scrapes lie far enough apart."""

    up: bool
    error: str = ""
    scrape: RouterScrape | None = None
    rates: RouterRates | None = None


def parse_router_metrics(text: str) -> RouterScrape:
    """The figures above from the router's exposition; unknown families are ignored.
    Raises ValueError on text that is not Prometheus's format."""
    workers: dict[str, dict[str, float]] = {}
    pools: dict[str, int] = {}
    totals = {"requests": 0.0, "responses": 0.0, "errors": 0.0, "sum": 0.0, "count": 0.0}
    per_worker = {"smg_worker_health": "health", "smg_worker_cb_state": "circuit",
                  "smg_worker_requests_active": "running",
                  "smg_worker_cb_consecutive_failures": "failures"}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name, labels, value = sample.name, sample.labels, float(sample.value)
            if name in per_worker and "worker" in labels:
                workers.setdefault(labels["worker"], {})[per_worker[name]] = value
            elif name == "smg_worker_pool_size" and "worker_type" in labels:
                role = labels["worker_type"]
                pools[role] = pools.get(role, 0) + int(value)
            elif name == "smg_router_requests_total":
                totals["requests"] += value
            elif name == "smg_http_responses_total":
                totals["responses"] += value
                if labels.get("status_code", "").startswith("5"):
                    totals["errors"] += value
            elif name == "smg_router_request_duration_seconds_sum":
                totals["sum"] += value
            elif name == "smg_router_request_duration_seconds_count":
                totals["count"] += value
    return RouterScrape(
        workers={url: _worker(url, figures) for url, figures in workers.items()},
        pool_sizes=pools, requests_total=totals["requests"],
        responses_total=totals["responses"], errors_total=totals["errors"],
        duration_sum=totals["sum"], duration_count=totals["count"])


def _worker(url: str, figures: dict[str, float]) -> WorkerFigures:
    health, circuit = figures.get("health"), figures.get("circuit")
    running, failures = figures.get("running"), figures.get("failures")
    return WorkerFigures(
        url=url, healthy=None if health is None else health >= 1,
        circuit=None if circuit is None else CIRCUIT.get(int(circuit), f"state {circuit:g}"),
        running=None if running is None else int(running),
        consecutive_failures=None if failures is None else int(failures))


def rates_between(older: RouterScrape, newer: RouterScrape, seconds: float) -> RouterRates | None:
    """Rates over `seconds` between two scrapes; None when the span is too short or a
    counter went backwards (the router restarted in between: its counters start at 0)."""
    deltas = (newer.requests_total - older.requests_total,
              newer.errors_total - older.errors_total,
              newer.duration_count - older.duration_count,
              newer.duration_sum - older.duration_sum)
    if seconds < MIN_RATE_SPAN_SECONDS or any(d < 0 for d in deltas):
        return None
    requests, errors, count, total = deltas
    return RouterRates(seconds=seconds, requests_per_second=requests / seconds,
                       errors_per_second=errors / seconds,
                       mean_request_seconds=total / count if count else None)


def worker_for(scrape: RouterScrape | None, urls: Iterable[str | None]) -> WorkerFigures | None:
    """The router's figures for the first of `urls` it names (an engine may be known by
    more than one spelling, e.g. with and without a trailing slash)."""
    if scrape is None:
        return None
    for url in urls:
        if url and (found := scrape.workers.get(url.rstrip("/"))) is not None:
            return found
    return None


def routing_problem(figures: WorkerFigures | None) -> str | None:
    """Why the router would not send this engine requests now, in words, or None when it
    would: healthy by its health checks AND its circuit closed (a half-open circuit is still
    on trial). An engine READY on its box is not yet serving until the router says so too
    (issue 25: the head admitted, and a rolling restart went on, while the router still had
    an engine out, and users got the router's 503s)."""
    if figures is None:
        return "the router does not list it yet"
    if figures.healthy is not True:
        return "the router's health checks have not taken it in yet"
    if figures.circuit not in (None, "closed"):
        return f"its circuit in the router is {figures.circuit}"
    return None


class RouterFigures(Protocol):
    """The router's figures as the head's watch reads them (`RouterMetricsReader`; tests
    and the demo may give a fake through build_runtime)."""

    async def read(self) -> RouterReading: ...


class RouterMetricsReader:
    """Scrapes the router's metrics port; keeps the scrapes of the last minute so that a
    reading carries rates over the longest span it has (a page polled every few seconds
    still reads rates over up to a minute)."""

    def __init__(self, url: str = DEFAULT_URL, *, transport: httpx.AsyncBaseTransport | None = None,
                 monotonic: Callable[[], float] | None = None) -> None:
        self.url = url
        self._transport = transport
        self._monotonic = monotonic or time.monotonic
        self._history: deque[tuple[float, RouterScrape]] = deque(maxlen=120)

    async def read(self) -> RouterReading:
        try:
            async with httpx.AsyncClient(timeout=TIMEOUT, transport=self._transport,
                                         trust_env=False) as client:
                response = await client.get(self.url)
            response.raise_for_status()
            scrape = parse_router_metrics(response.text)
        except (httpx.HTTPError, ValueError) as exc:
            return RouterReading(up=False, error=_why(exc))
        now = self._monotonic()
        while self._history and now - self._history[0][0] > RATE_WINDOW_SECONDS:
            self._history.popleft()
        rates = None
        if self._history:
            then, older = self._history[0]
            rates = rates_between(older, scrape, now - then)
            if rates is None and (now - then) >= MIN_RATE_SPAN_SECONDS:
                self._history.clear()  # counters went backwards: a new router
        self._history.append((now, scrape))
        return RouterReading(up=True, scrape=scrape, rates=rates)


def _why(exc: Exception) -> str:
    if isinstance(exc, httpx.HTTPStatusError):
        return f"its metrics port answered HTTP {exc.response.status_code}"
    if isinstance(exc, httpx.HTTPError):
        return f"its metrics port did not answer ({str(exc) or type(exc).__name__})"[:200]
    return f"its metrics are not Prometheus text ({exc})"[:200]
