"""The engine emulator's latency histograms, as SGLang 0.5.23's tokenizer-side collector keeps
them (`observability/metrics_collector.py`, `TokenizerMetricsCollector`). A test and demo
instrument (`appliance.testing.fake_sglang`): the values are the emulator's own request
timings, measured on its monotonic clock, so the health monitor and the dashboard show real
percentiles in a demo.

    sglang:time_to_first_token_seconds   arrival → first token (queue time included)
    sglang:inter_token_latency_seconds   the gap between consecutive tokens of a request
    sglang:e2e_request_latency_seconds   arrival → last token, finished requests only

The default buckets are SGLang's; `--bucket-time-to-first-token`, `--bucket-inter-token-latency`
and `--bucket-e2e-request-latency` replace them, as in SGLang. The exposition is Prometheus
text 0.0.4: cumulative `_bucket{le=...}` lines ending with `le="+Inf"`, then `_sum` and
`_count` (`+Inf` equals `_count`).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence

TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0, 10.0, 20.0, 40.0, 60.0, 80.0,
                100.0, 200.0, 400.0)
E2E_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0, 10.0, 20.0, 40.0, 60.0, 80.0,
               100.0, 200.0, 400.0, 600.0, 1200.0, 1800.0, 2400.0)
INTER_TOKEN_BUCKETS = (0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035,
                       0.040, 0.060, 0.080, 0.100, 0.200, 0.400, 0.600, 0.800, 1.0, 2.0, 4.0,
                       6.0, 8.0)


def bounds(flag_value: object, default: tuple[float, ...]) -> tuple[float, ...]:
    """The upper bounds from a `--bucket-*` flag (a list of floats), else `default`; sorted,
    without duplicates or infinities (`+Inf` is always added on output)."""
    if isinstance(flag_value, list | tuple) and flag_value:
        values = {float(v) for v in flag_value if isinstance(v, int | float)}
        finite = sorted(v for v in values if math.isfinite(v))
        if finite:
            return tuple(finite)
    return default


class Histogram:
    """Per-bucket counts (not cumulative) plus sum and count; cumulated on output."""

    def __init__(self, upper_bounds: Sequence[float]) -> None:
        self.upper_bounds = tuple(upper_bounds)
        self.counts = [0] * (len(self.upper_bounds) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        # le is "less than or equal": a value on a bound belongs to that bound's bucket
        self.counts[bisect.bisect_left(self.upper_bounds, value)] += 1
        self.sum += value
        self.count += 1

    def exposition(self, name: str, labels: str, text: str) -> list[str]:
        """The `# HELP`/`# TYPE` header and the sample lines for one label set."""
        lines = [f"# HELP {name} {text}", f"# TYPE {name} histogram"]
        cumulative = 0
        for bound, count in zip((*self.upper_bounds, math.inf), self.counts, strict=True):
            cumulative += count
            le = "+Inf" if bound == math.inf else repr(float(bound))
            lines.append(f'{name}_bucket{{{labels},le="{le}"}} {float(cumulative)}')
        lines += [f"{name}_sum{{{labels}}} {self.sum!r}", f"{name}_count{{{labels}}} "
                  f"{float(self.count)}"]
        return lines
