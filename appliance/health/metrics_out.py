"""The control plane's Prometheus exposition, as a pure function of frozen inputs.

`families(inputs)` turns what the daemon knows at one moment (the health monitor's snapshot,
the supervisor's status, cached weights and usage figures) into Prometheus metric families;
the per-GPU ones are in `metrics_gpu`; `metrics_route` gathers the inputs and serves them at
`GET /metrics`.

Conventions (https://prometheus.io/docs/practices/naming/):
- every name starts `appliance_` and ends in its base unit: `_celsius`, `_watts`, `_bytes`,
  `_seconds`, `_ratio` (0..1); everything here is a gauge, so nothing ends `_total`;
- labels stay low-cardinality: a GPU index and its UUID, a check id (a fixed set per box),
  an enum's value, an outcome code; never a key, a model name or a path;
- a value that is unknown (not read, not polled yet, unsupported) is left out, never sent
  as 0: an absent series reads "unknown", a 0 would read "measured zero";
- enums are exported the node_exporter way: one series per possible value, 1 for the
  current one and 0 for the others, so every value is always present.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from prometheus_client.core import GaugeMetricFamily, Metric

from appliance.engine.states import EngineState
from appliance.health.metrics_gpu import gpu_families
from appliance.health.model import EngineFigures, HealthSnapshot, HostFigures
from appliance.weights.views import Activity


@dataclass(frozen=True)
class WeightsFigures:
    """The weights service's state, reduced to numbers: `activity` is an `Activity` value;
    bytes are over the active set's files (0 when there is no active set)."""

    activity: str
    ready: bool
    total_bytes: int
    done_bytes: int
    verified_bytes: int
    rate_bytes_per_second: float


@dataclass(frozen=True)
class UsageFigures:
    """Requests the gateway answered over the last `window_seconds`, from the usage table:
    counts by outcome ("ok", "client_closed", or the error code sent) and token sums by
    kind ("prompt", "completion", "cached"; cached tokens are part of the prompt tokens)."""

    window_seconds: float
    requests: Mapping[str, int] = field(default_factory=dict)
    tokens: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class MetricsInputs:
    """Everything one scrape exports. `engine_state`/`load_percent`/`eta_seconds` come from
    the supervisor (live), the rest of the engine figures from the monitor's snapshot.
    `weights`/`usage` are None when they could not be read (left out, not zeroed)."""

    version: str
    started_at: dt.datetime
    gpus_expected: int
    health: HealthSnapshot
    engine_state: EngineState
    load_percent: float | None = None
    eta_seconds: float | None = None
    weights: WeightsFigures | None = None
    usage: UsageFigures | None = None


def families(inputs: MetricsInputs) -> list[Metric]:
    """Every metric family with at least one sample, in a stable order."""
    found = [
        *_daemon(inputs),
        *gpu_families(inputs.health.gpus, inputs.gpus_expected),
        *_engine(inputs),
        *_checks(inputs.health),
        *_host(inputs.health.host),
        *_weights(inputs.weights),
        *_usage(inputs.usage),
    ]
    return [family for family in found if family.samples]


class InputsCollector:
    """A prometheus_client collector over a function that returns the current inputs; it
    is called once per scrape, from the scraping thread, and must not block."""

    def __init__(self, read: Callable[[], MetricsInputs]) -> None:
        self._read = read

    def collect(self) -> Iterable[Metric]:
        return families(self._read())


# --- the families ------------------------------------------------------------------------------


def _gauge(name: str, doc: str, value: float | None = None) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc)
    if value is not None:
        family.add_metric([], float(value))
    return family


def _enum(name: str, doc: str, label: str, values: Iterable[str],
          current: str) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=[label])
    for value in values:
        family.add_metric([value], 1.0 if value == current else 0.0)
    return family


def _daemon(inputs: MetricsInputs) -> Iterable[Metric]:
    build = GaugeMetricFamily("appliance_build_info",
                              "Always 1; the label carries the appliance's version",
                              labels=["version"])
    build.add_metric([inputs.version], 1.0)
    yield build
    yield _gauge("appliance_daemon_start_time_seconds",
                 "When the control plane started, in seconds since the Unix epoch",
                 inputs.started_at.timestamp())


def _engine(inputs: MetricsInputs) -> Iterable[Metric]:
    yield _enum("appliance_engine_state",
                "The engine's lifecycle state as the supervisor sees it: 1 for the current "
                "state, 0 for every other", "state", (s.value for s in EngineState),
                inputs.engine_state.value)
    yield _gauge("appliance_engine_load_progress_ratio",
                 "How far the engine's start has got (0..1); absent when not starting",
                 None if inputs.load_percent is None else inputs.load_percent / 100.0)
    yield _gauge("appliance_engine_eta_seconds",
                 "Estimated seconds until the engine is ready; absent when unknown",
                 inputs.eta_seconds)
    yield from _engine_figures(inputs.health.engine)


def _engine_figures(figures: EngineFigures | None) -> Iterable[Metric]:
    if figures is None:
        return
    yield _gauge("appliance_engine_ready",
                 "1 when the engine's /ready answered 200 at the last probe, 0 when not",
                 None if figures.ready is None else int(figures.ready))
    yield _gauge("appliance_engine_running_requests",
                 "Requests the engine is running (SGLang sglang:num_running_reqs)",
                 figures.running_requests)
    yield _gauge("appliance_engine_queued_requests",
                 "Requests waiting in the engine's queue (SGLang sglang:num_queue_reqs)",
                 figures.queued_requests)
    yield _gauge("appliance_engine_token_usage_ratio",
                 "Fraction of the KV-cache token pool in use (0..1)", figures.token_usage)
    yield _gauge("appliance_engine_state_usage_ratio",
                 "Fraction of the recurrent-state (mamba) pool in use (0..1)",
                 figures.state_usage)
    yield _gauge("appliance_engine_cache_hit_ratio",
                 "Prefix-cache hit rate (0..1)", figures.cache_hit_rate)
    yield _gauge("appliance_engine_generation_tokens_per_second",
                 "Tokens generated per second, over the window since the previous poll",
                 figures.generation_tokens_per_second)
    ttft = GaugeMetricFamily(
        "appliance_engine_ttft_seconds",
        "Time to first token at the given quantile, over the window since the previous poll",
        labels=["quantile"])
    for quantile, value in (("0.5", figures.ttft_p50_seconds),
                            ("0.9", figures.ttft_p90_seconds)):
        if value is not None:
            ttft.add_metric([quantile], value)
    yield ttft
    canary = figures.canary
    if canary is not None:
        yield _gauge("appliance_engine_canary_ok",
                     "1 when the last latency canary (a small generation) succeeded",
                     int(canary.ok))
        yield _gauge("appliance_engine_canary_ttft_seconds",
                     "The last canary's time to first token", canary.ttft_seconds)
        yield _gauge("appliance_engine_canary_decode_tokens_per_second",
                     "The last canary's decode rate", canary.decode_tokens_per_second)
        yield _gauge("appliance_engine_canary_timestamp_seconds",
                     "When the last canary ran, in seconds since the Unix epoch",
                     canary.at.timestamp())


def _checks(snapshot: HealthSnapshot) -> Iterable[Metric]:
    if snapshot.at is None:  # nothing has run: "OK" would be a guess
        return
    yield _gauge("appliance_health_status",
                 "The worst level over checks that are not muted: 0 OK, 1 WARN, 2 CRITICAL",
                 int(snapshot.overall()))
    yield _gauge("appliance_health_updated_timestamp_seconds",
                 "When the health monitor last updated its snapshot (seconds since the epoch)",
                 snapshot.at.timestamp())
    status = GaugeMetricFamily(
        "appliance_health_check_status",
        "One health check's level: 0 OK, 1 WARN, 2 CRITICAL (muted checks included)",
        labels=["check", "group"])
    muted = GaugeMetricFamily(
        "appliance_health_check_muted",
        "1 when an operator muted this check (it alerts no one and is left out of "
        "appliance_health_status)", labels=["check", "group"])
    for result in snapshot.results:
        status.add_metric([result.id, result.group], int(result.level))
        muted.add_metric([result.id, result.group], int(result.id in snapshot.muted))
    yield status
    yield muted


def _host(host: HostFigures | None) -> Iterable[Metric]:
    if host is None:
        return
    free = GaugeMetricFamily("appliance_host_volume_free_bytes",
                             "Free space on a volume the appliance uses (models: the weights; "
                             "state: database and logs; shm: /dev/shm)", labels=["volume"])
    size = GaugeMetricFamily("appliance_host_volume_size_bytes",
                             "Size of a volume the appliance uses", labels=["volume"])
    for volume, free_bytes, size_bytes in (
            ("models", host.models_free_bytes, host.models_total_bytes),
            ("state", host.state_free_bytes, host.state_total_bytes),
            ("shm", host.shm_free_bytes, host.shm_total_bytes)):
        if free_bytes is not None:
            free.add_metric([volume], free_bytes)
        if size_bytes is not None:
            size.add_metric([volume], size_bytes)
    yield free
    yield size
    yield _gauge("appliance_host_memory_available_bytes",
                 "Host memory available to new work without swapping", host.memory_available_bytes)
    yield _gauge("appliance_host_memory_total_bytes", "Host memory installed",
                 host.memory_total_bytes)
    yield _gauge("appliance_host_load1", "One-minute load average", host.load1)
    yield _gauge("appliance_host_cpus", "Logical CPUs", host.cpu_count)
    yield _gauge("appliance_daemon_resident_memory_bytes",
                 "The control plane's own resident memory", host.daemon_rss_bytes)


def _weights(weights: WeightsFigures | None) -> Iterable[Metric]:
    if weights is None:
        return
    yield _enum("appliance_weights_state",
                "What the weights service is doing: 1 for the current activity, 0 for others",
                "state", (a.value for a in Activity), weights.activity)
    yield _gauge("appliance_weights_ready",
                 "1 when the engine's weights are fully verified and may be launched",
                 int(weights.ready))
    yield _gauge("appliance_weights_size_bytes", "Size of the active weights set",
                 weights.total_bytes)
    yield _gauge("appliance_weights_present_bytes",
                 "Bytes of the active set on disk (downloaded or imported so far)",
                 weights.done_bytes)
    yield _gauge("appliance_weights_verified_bytes",
                 "Bytes of the active set whose files are verified against the manifest",
                 weights.verified_bytes)
    yield _gauge("appliance_weights_transfer_bytes_per_second",
                 "Current download, import or hashing rate", weights.rate_bytes_per_second)


def _usage(usage: UsageFigures | None) -> Iterable[Metric]:
    if usage is None:
        return
    window = f"{usage.window_seconds / 3600:g} h"
    requests = GaugeMetricFamily(
        "appliance_usage_requests_last_hour",
        f"Requests the gateway answered in the last {window}, by outcome (from the usage "
        "table; the gateway's own /metrics has the live counters)", labels=["outcome"])
    for outcome, count in sorted(usage.requests.items()):
        requests.add_metric([outcome], count)
    yield requests
    tokens = GaugeMetricFamily(
        "appliance_usage_tokens_last_hour",
        f"Tokens metered by the gateway in the last {window}, by kind (prompt, completion; "
        "cached is the part of prompt served from the prefix cache)", labels=["kind"])
    for kind in ("prompt", "completion", "cached"):
        tokens.add_metric([kind], usage.tokens.get(kind, 0))
    yield tokens
