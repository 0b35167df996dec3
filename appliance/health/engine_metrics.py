"""SGLang 0.5.23's Prometheus `/metrics` text, read into a frozen `MetricsReading`, and the
figures of the window between two readings. Pure: no IO, no clock.

Names are `observability/metrics_collector.py`'s (shared/reference/sglang-0.5.23.md §4).
How label sets are combined:
- scheduler gauges (`num_running_reqs`, `num_queue_reqs`, `token_usage`, `mamba_usage`,
  `cache_hit_rate`, `gen_throughput`) come from TP rank 0 by default; with
  `--enable-metrics-for-all-schedulers` every TP rank repeats the same batch, so only
  samples whose `tp_rank` is "0" (or that carry none) count. What remains differs by
  data-parallel rank or model: counts and throughput are summed, `token_usage` and
  `mamba_usage` take the fullest pool, `cache_hit_rate` the mean;
- tokenizer counters and histograms are summed over every label set (`cache_source` splits
  `cached_tokens_total`, `is_streaming` splits time to first token, tokenizer workers split
  everything).

Windows (`figures_between`) follow Prometheus' `rate()` and `histogram_quantile()`: a counter
that went down was reset (the engine restarted), so its whole current value is the window's
increase, never a negative one; percentiles interpolate linearly inside the bucket that holds
the rank. A window without requests has no percentiles (None), not zeros.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

PREFIX = "sglang:"
RANK_LABEL = "tp_rank"


class MetricsFormatError(ValueError):
    """The text is not Prometheus exposition text."""


@dataclass(frozen=True)
class Histogram:
    """One histogram summed over label sets: cumulative counts per upper bound, ascending,
    the last bound +Inf."""

    buckets: tuple[tuple[float, float], ...]
    count: float
    sum: float

    def since(self, earlier: Histogram | None) -> Histogram:
        """The observations made after `earlier`. A reset (fewer observations than before, or
        other buckets: the engine restarted) makes the whole of `self` the window."""
        if earlier is None or self.count < earlier.count \
                or [b for b, _ in self.buckets] != [b for b, _ in earlier.buckets]:
            return self
        return Histogram(
            tuple((bound, max(0.0, now - then))
                  for (bound, now), (_, then) in zip(self.buckets, earlier.buckets, strict=True)),
            self.count - earlier.count, max(0.0, self.sum - earlier.sum))

    def quantile(self, q: float) -> float | None:
        """Prometheus' `histogram_quantile`: None without observations; a rank in the +Inf
        bucket answers the highest finite bound."""
        if not self.buckets or not 0.0 <= q <= 1.0:
            return None
        total = self.buckets[-1][1]
        if total <= 0:
            return None
        rank = q * total
        lower, below = 0.0, 0.0
        for bound, cumulative in self.buckets:
            if cumulative >= rank and cumulative > below:
                if math.isinf(bound):
                    return lower
                if lower == 0.0 and bound <= 0.0:
                    return bound
                return lower + (bound - lower) * (rank - below) / (cumulative - below)
            lower, below = bound, max(below, cumulative)
        return lower


@dataclass(frozen=True)
class MetricsReading:
    """What one scrape said; None where the engine did not export the series."""

    running_requests: int | None = None
    queued_requests: int | None = None
    token_usage: float | None = None
    state_usage: float | None = None
    cache_hit_rate: float | None = None
    gen_throughput: float | None = None
    prompt_tokens: float | None = None
    generation_tokens: float | None = None
    cached_tokens: float | None = None
    requests: float | None = None
    aborted_requests: float | None = None
    time_to_first_token: Histogram | None = None
    e2e_latency: Histogram | None = None


@dataclass(frozen=True)
class WindowFigures:
    """The engine's figures over the window between two readings; None when unknown."""

    generation_tokens_per_second: float | None
    ttft_p50_seconds: float | None
    ttft_p90_seconds: float | None
    cache_hit_rate: float | None
    e2e_p50_seconds: float | None
    requests_in_window: float | None


Samples = Mapping[str, list[tuple[dict[str, str], float]]]


def _samples(text: str) -> Samples:
    found: dict[str, list[tuple[dict[str, str], float]]] = defaultdict(list)
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if math.isnan(sample.value):
                    continue
                found[sample.name].append((dict(sample.labels), float(sample.value)))
    except (ValueError, IndexError, KeyError, TypeError) as exc:
        raise MetricsFormatError(f"not Prometheus text: {exc}") from None
    return found


def _rank_zero(rows: list[tuple[dict[str, str], float]]) -> list[float]:
    return [value for labels, value in rows if labels.get(RANK_LABEL, "0") == "0"]


def _gauge(samples: Samples, name: str, how: str) -> float | None:
    values = _rank_zero(samples.get(PREFIX + name, []))
    if not values:
        return None
    if how == "sum":
        return sum(values)
    if how == "max":
        return max(values)
    return sum(values) / len(values)


def _counter(samples: Samples, name: str) -> float | None:
    rows = samples.get(PREFIX + name, [])
    return sum(value for _, value in rows) if rows else None


def _histogram(samples: Samples, name: str) -> Histogram | None:
    rows = samples.get(f"{PREFIX}{name}_bucket", [])
    if not rows:
        return None
    by_bound: dict[float, float] = defaultdict(float)
    for labels, value in rows:
        try:
            by_bound[float(labels["le"])] += value
        except (KeyError, ValueError):
            continue
    if not by_bound:
        return None
    buckets, running = [], 0.0
    for bound in sorted(by_bound):
        running = max(running, by_bound[bound])  # cumulative counts never fall
        buckets.append((bound, running))
    if not math.isinf(buckets[-1][0]):
        buckets.append((math.inf, running))
    count = _counter(samples, f"{name}_count")
    total = _counter(samples, f"{name}_sum")
    return Histogram(tuple(buckets), buckets[-1][1] if count is None else count, total or 0.0)


def _int(value: float | None) -> int | None:
    return None if value is None else round(value)


def parse_metrics(text: str) -> MetricsReading:
    """Read SGLang's exposition text; raises `MetricsFormatError` when it is not one."""
    samples = _samples(text)
    return MetricsReading(
        running_requests=_int(_gauge(samples, "num_running_reqs", "sum")),
        queued_requests=_int(_gauge(samples, "num_queue_reqs", "sum")),
        token_usage=_gauge(samples, "token_usage", "max"),
        state_usage=_gauge(samples, "mamba_usage", "max"),
        cache_hit_rate=_gauge(samples, "cache_hit_rate", "mean"),
        gen_throughput=_gauge(samples, "gen_throughput", "sum"),
        prompt_tokens=_counter(samples, "prompt_tokens_total"),
        generation_tokens=_counter(samples, "generation_tokens_total"),
        cached_tokens=_counter(samples, "cached_tokens_total"),
        requests=_counter(samples, "num_requests_total"),
        aborted_requests=_counter(samples, "num_aborted_requests_total"),
        time_to_first_token=_histogram(samples, "time_to_first_token_seconds"),
        e2e_latency=_histogram(samples, "e2e_request_latency_seconds"),
    )


def increase(previous: float | None, current: float | None) -> float | None:
    """A counter's increase over the window; after a reset, its whole current value. A
    series missing from the earlier reading was zero (prometheus_client exports a labelled
    series only from its first increment)."""
    if current is None:
        return None
    if previous is None or current < previous:
        return current
    return current - previous


def _ratio(part: float | None, whole: float | None) -> float | None:
    if part is None or whole is None or whole <= 0:
        return None
    return min(1.0, max(0.0, part / whole))


def _window(earlier: Histogram | None, current: Histogram | None) -> Histogram | None:
    return None if current is None else current.since(earlier)


def _quantiles(window: Histogram | None, qs: Iterable[float]) -> list[float | None]:
    if window is None or window.count <= 0:
        return [None for _ in qs]
    return [window.quantile(q) for q in qs]


def figures_between(previous: MetricsReading | None, current: MetricsReading,
                    elapsed_seconds: float) -> WindowFigures:
    """Rates and percentiles over the window from `previous` to `current`.

    Without a previous reading (the first scrape) there is no window: throughput is SGLang's
    own `gen_throughput` gauge, percentiles are None, the hit rate is the gauge's."""
    before = previous if previous is not None and elapsed_seconds > 0 else None
    if before is None:
        return WindowFigures(
            generation_tokens_per_second=current.gen_throughput, ttft_p50_seconds=None,
            ttft_p90_seconds=None, cache_hit_rate=current.cache_hit_rate, e2e_p50_seconds=None,
            requests_in_window=None)

    generated = increase(before.generation_tokens, current.generation_tokens)
    throughput = generated / elapsed_seconds if generated is not None else current.gen_throughput
    hit_rate = _ratio(increase(before.cached_tokens, current.cached_tokens),
                      increase(before.prompt_tokens, current.prompt_tokens))
    if hit_rate is None:  # no prompt in the window: the gauge (the last prefills') says more
        hit_rate = current.cache_hit_rate
    ttft = _window(before.time_to_first_token, current.time_to_first_token)
    p50, p90 = _quantiles(ttft, (0.5, 0.9))
    (e2e_p50,) = _quantiles(_window(before.e2e_latency, current.e2e_latency), (0.5,))
    return WindowFigures(
        generation_tokens_per_second=throughput, ttft_p50_seconds=p50, ttft_p90_seconds=p90,
        cache_hit_rate=hit_rate, e2e_p50_seconds=e2e_p50,
        requests_in_window=increase(before.requests, current.requests))
