"""The gateway's Prometheus series, on a registry of its own (served at `GET /metrics`).

Labels stay low-cardinality on purpose: the endpoint, the HTTP status and the outcome code,
never the key or the model, so a scrape stays small however many keys exist (per-key figures
are on the console's Usage page).
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300,
                   900)


class _KeptChildren:
    """`labels(...)` answered from a dict of the children already made. prometheus_client's
    own checks the values, converts each to str and takes a lock on every call, and the
    gateway labels each request's counts several times over a handful of combinations (the
    labels are low-cardinality, so the dict stays small). Positional values only; the
    children are never removed."""

    def labels(self, *values: Any, **named: Any) -> Any:
        if named:
            return super().labels(*values, **named)  # type: ignore[misc]
        kept: dict[tuple[Any, ...], Any] = self.__dict__.setdefault("_kept", {})
        child = kept.get(values)
        if child is None:
            child = kept[values] = super().labels(*values)  # type: ignore[misc]
        return child


class _Counter(_KeptChildren, Counter):
    pass


class _Histogram(_KeptChildren, Histogram):
    pass


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = registry = CollectorRegistry(auto_describe=True)
        self.requests = _Counter("appliance_gateway_requests", "Requests answered",
                                ["endpoint", "status", "outcome"], registry=registry)
        self.tokens = _Counter("appliance_gateway_tokens", "Tokens metered", ["kind"],
                              registry=registry)
        self.queue_depth = Gauge("appliance_gateway_queue_depth",
                                 "Requests waiting for an admission slot", registry=registry)
        self.queue_wait = Histogram("appliance_gateway_queue_wait_seconds",
                                    "Time waited for an admission slot",
                                    buckets=LATENCY_BUCKETS, registry=registry)
        self.admitted = Gauge("appliance_gateway_admitted",
                              "Requests admitted to the engine now", registry=registry)
        self.limit = Gauge("appliance_gateway_concurrency_limit",
                           "Requests the engine may run at once (admission limit)",
                           registry=registry)
        self.ttft = Histogram("appliance_gateway_time_to_first_token_seconds",
                              "Arrival to the engine's first response byte",
                              buckets=LATENCY_BUCKETS, registry=registry)
        self.duration = _Histogram("appliance_gateway_request_duration_seconds",
                                  "Arrival to the last byte sent", ["endpoint"],
                                  buckets=LATENCY_BUCKETS, registry=registry)

        self.slo = _Counter("appliance_gateway_slo_requests", "Requests judged against their "
                           "service class's promise: met, refused (reason: the code sent), "
                           "missed_ttft, missed_decode", ["class", "result", "reason"],
                           registry=registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)
