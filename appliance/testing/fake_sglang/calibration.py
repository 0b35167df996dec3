"""The performance model's calibration: the field figures it reproduces, and a discrete-event
simulation of a benchmark client against the emulator's own scheduler, in model time (no
sleeping, no HTTP). A test and demo instrument (`appliance.testing.fake_sglang`). Pure.

Field figures (one B300x8, SGLang, Kimi K3, `bench_serving` random load: 200 prompts of
~8,192 tokens in and ~1,024 out, by client concurrency):

    concurrency  output tok/s  ITL median  TTFT median  TTFT p90  failed
    10           376.9         37.9 ms     -            1.1 s     0
    20           515.8         50.9 ms     -            1.9 s     0
    30           605.4         60.4 ms     -            6.3 s     0
    40           649.7         70.5 ms     -            12.4 s    0
    50           367.2         -           10.9 s       46.7 s    119 of 200

That engine had 313 state slots (62 requests). A second team measured 37.7 tok/s per user
(decode p10) at 16 users under 8,192-in/1,000-out with the prefix cache flushed.

`simulate` runs the same `Scheduler` the emulator serves with: `concurrency` clients, each
sending its next prompt when the last one ends (finished or failed), as `bench_serving
--max-concurrency` does; it measures what that client measures: output tok/s over successful
requests and the whole run, TTFT from sending to the first chunk, ITL as the gap between
chunks (one chunk per engine step). `benchmarks/emulator_calibration.py` prints the
comparison; `tests/test_emulator_perf.py` holds the model to it (within 15% for ITL and
output tok/s at 10-40, the collapse at 50).
"""

from __future__ import annotations

from dataclasses import dataclass

from appliance.testing.fake_sglang.perfmodel import K3_B300, PerfModel
from appliance.testing.fake_sglang.scheduler import Scheduler, Seq

FIELD_STATE_SLOTS = 313
FIELD_MAX_RUNNING = FIELD_STATE_SLOTS // 5  # 5 slots a request (radix cache, extra_buffer)


@dataclass(frozen=True)
class FieldPoint:
    """One row of the field table (None: not reported)."""

    concurrency: int
    output_tps: float
    itl_median_ms: float | None
    ttft_median_s: float | None
    ttft_p90_s: float
    failed: int


FIELD = (
    FieldPoint(10, 376.9, 37.9, None, 1.1, 0),
    FieldPoint(20, 515.8, 50.9, None, 1.9, 0),
    FieldPoint(30, 605.4, 60.4, None, 6.3, 0),
    FieldPoint(40, 649.7, 70.5, None, 12.4, 0),
    FieldPoint(50, 367.2, None, 10.9, 46.7, 119),
)


@dataclass(frozen=True)
class LoadResult:
    """What the benchmark client saw, in model seconds."""

    concurrency: int
    completed: int
    failed: int
    duration: float
    output_tps: float
    itl_median: float
    ttft_median: float
    ttft_p90: float
    retracted: int


def percentile(values: list[float], q: float) -> float:
    """numpy's default (linear) percentile, as bench_serving reports them; 0.0 when empty."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def simulate(concurrency: int, model: PerfModel = K3_B300, *, prompts: int = 200,
             input_len: int = 8192, output_len: int = 1024,
             max_running: int = FIELD_MAX_RUNNING) -> LoadResult:
    """A closed-loop benchmark of `prompts` requests at `concurrency`, in model time."""
    scheduler = Scheduler(model, max_running)
    now = 0.0
    sent = 0
    sent_at: dict[str, float] = {}
    first_at: dict[str, float] = {}
    last_at: dict[str, float] = {}
    gaps: dict[str, list[float]] = {}
    produced: dict[str, int] = {}
    ttfts: list[float] = []
    itls: list[float] = []
    output_tokens = completed = failed = 0

    def send() -> None:
        nonlocal sent
        while sent < prompts and len(sent_at) < concurrency:
            key = str(sent)
            sent += 1
            sent_at[key] = now
            gaps[key], produced[key] = [], 0
            scheduler.add(Seq(key=key, prompt=input_len, target=output_len, arrived=now), now)

    send()
    while sent_at:
        step = scheduler.step(now)
        if step is None:  # cannot happen while requests are in flight; never spin
            break
        for key in step.failed:
            failed += 1
            del sent_at[key]
        now = step.ends
        for key, count in step.tokens.items():
            produced[key] += count
            if key not in first_at:
                first_at[key] = now
            else:
                gaps[key].append(now - last_at[key])
            last_at[key] = now
        for key in step.finished:
            completed += 1
            output_tokens += produced[key]
            ttfts.append(first_at[key] - sent_at[key])
            itls.extend(gaps[key])
            del sent_at[key]
        send()
    return LoadResult(concurrency=concurrency, completed=completed, failed=failed,
                      duration=now, output_tps=output_tokens / now if now else 0.0,
                      itl_median=percentile(itls, 50), ttft_median=percentile(ttfts, 50),
                      ttft_p90=percentile(ttfts, 90), retracted=scheduler.retracted_total)
