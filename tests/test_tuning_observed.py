"""The observed workload: SGLang 0.5.23's batch lines and gateway records, turned into a length
distribution, a peak, the pool that saturated first, and advice in words."""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from appliance.tuning.budget import budget_from_log
from appliance.tuning.calculator import Launch, size_pools
from appliance.tuning.geometry import load_geometry
from appliance.tuning.observed import (
    ObservedError,
    advise,
    from_log,
    from_records,
    observe,
    parse_batch_line,
    parse_batches,
    weighted_distribution,
)

DATA = Path(__file__).parent / "data"
K3 = load_geometry(DATA / "tuning" / "kimi-k3.config.json")
_budget = budget_from_log((DATA / "engine_logs" / "k3_startup.sample.log").read_text())
assert _budget is not None
BUDGET = _budget.bytes
LAUNCH = Launch()  # TP8 DCP8 fp8, no cap beyond SGLang's own

# Lines as metrics_reporter.py / pool_stats_observer.py write them for a hybrid model.
DECODE = ("[2026-12-05 11:02:51 TP0] Decode batch, #running-req: 12, #full token: 181440, "
          "full token usage: 0.07, mamba num: 60, mamba usage: 0.18, cuda graph: True, "
          "gen throughput (token/s): 812.34, #queue-req: 0")
DECODE_SPEC = ("[2026-12-05 11:02:52 TP0] Decode batch [4120], #running-req: 3, #full token: "
               "90000, full token usage: 0.03, mamba num: 15, mamba usage: 0.05, accept len: "
               "3.10, accept rate: 0.30, cuda graph: True, gen throughput (token/s): 402.10, "
               "#queue-req: 2")
PREFILL = ("[2026-11-30 10:26:24 TP0] Prefill batch, #new-seq: 2, #new-token: 8192, "
           "#cached-token: 4096, full token usage: 0.01, mamba usage: 0.03, #running-req: 5, "
           "#queue-req: 1, #pending-token: 0, cuda graph: False, input throughput (token/s): "
           "12000.00")
PLAIN = ("[2026-12-05 11:02:53] Decode batch, #running-req: 4, #token: 4000, token usage: "
         "0.01, cuda graph: True, gen throughput (token/s): 100.00, #queue-req: 0")


def test_parse_the_real_line_formats() -> None:
    d = parse_batch_line(DECODE)
    assert d is not None
    assert (d.kind, d.at, d.running, d.queued) == ("decode", "2026-12-05 11:02:51", 12, 0)
    assert (d.full_tokens, d.full_usage, d.mamba_slots, d.mamba_usage) == (181440, 0.07, 60,
                                                                            0.18)
    assert d.tokens_per_request() == 15120
    s = parse_batch_line(DECODE_SPEC)
    assert s is not None and (s.running, s.full_tokens, s.queued) == (3, 90000, 2)
    p = parse_batch_line(PREFILL)
    assert p is not None and p.kind == "prefill"
    assert (p.new_seqs, p.new_tokens, p.cached_tokens, p.running, p.queued) == (2, 8192, 4096,
                                                                                 5, 1)
    assert p.full_tokens is None and p.mamba_usage == 0.03
    plain = parse_batch_line(PLAIN)
    assert plain is not None and plain.full_tokens == 4000 and plain.mamba_usage is None
    for junk in ("", "Decode batch", "[2026-12-05 11:02:51 TP0] Load weight begin.",
                 "Decode batch, #running-req: many"):
        assert parse_batch_line(junk) is None
    # Split on \r too, like tqdm-ridden logs; lines come back in order.
    assert [b.kind for b in parse_batches(f"{PREFILL}\r{DECODE}\nnoise\n{DECODE_SPEC}")] == [
        "prefill", "decode", "decode"]


def test_usage_fraction_times_capacity_when_no_count_is_printed() -> None:
    line = ("[2026-12-05 11:00:00 TP0] Decode batch, #running-req: 4, full token usage: 0.50, "
            "mamba usage: 0.10, cuda graph: True, #queue-req: 0")
    sample = parse_batch_line(line)
    assert sample is not None and sample.full_tokens is None
    assert sample.tokens_per_request() is None
    assert sample.tokens_per_request(kv_capacity=1_000_000) == 125_000
    observed = from_log(line, kv_capacity=1_000_000)
    assert observed.lengths.max == 125_000


def test_weighted_percentiles() -> None:
    d = weighted_distribution([(3000, 2), (1000, 1), (2000, 1)])
    assert d.minimum == 1000
    assert [t for _, t in d.points] == [1000, 1000, 2000, 3000, 3000, 3000, 3000, 3000]
    flat = weighted_distribution([(5000, 1), (5000, 3)])
    assert flat.minimum == flat.max == 5000 and flat.mean() == 5000


def _decode(ts: str, running: int, tokens: int, capacity: int, slots_used: int, slots: int,
            queued: int = 0) -> str:
    return (f"[2026-12-06 {ts} TP0] Decode batch, #running-req: {running}, #full token: "
            f"{tokens}, full token usage: {tokens / capacity:.2f}, mamba num: {slots_used}, "
            f"mamba usage: {slots_used / slots:.2f}, cuda graph: True, gen throughput "
            f"(token/s): {running * 31.5:.2f}, #queue-req: {queued}")


def _startup(ratio: float) -> tuple[str, int, int, int]:
    """The lines of a startup at `ratio` that matter here, and its KV tokens, slots, cap."""
    s = size_pools(K3, LAUNCH, BUDGET, ratio)
    text = "\n".join([
        "[2026-12-06 08:00:00] server_args=ServerArgs(model_path='/m', tp_size=8, dcp_size=8, "
        f"mem_fraction_static=0.93, mamba_full_memory_ratio={ratio})",
        f"[2026-12-06 09:22:33 TP0] Mamba Cache is allocated. max_mamba_cache_size: "
        f"{s.max_mamba_cache_size}, conv_state size: 0.59GB, ssm_state size: 16.83GB ",
        f"[2026-12-06 09:22:36 TP0] KV Cache is allocated. dtype: torch.float8_e4m3fn, "
        f"#tokens: {s.mla_rows_per_rank}, KV size: 8.70 GB",
        f"[2026-12-06 09:26:12 TP0] max_total_num_tokens={s.mla_rows_per_rank}, "
        "chunked_prefill_size=65536, max_prefill_tokens=16384, max_running_requests="
        f"{s.max_running_requests}, context_len=1048576, available_gpu_mem=16.21 GB",
    ])
    return text, s.logical_tokens, s.max_mamba_cache_size, s.max_running_requests


def test_day_one_ratio_five_starves_coding_agents_of_kv() -> None:
    """Ratio 5 (the day-one deployment's): the KV pool fills long before the state pool."""
    head, capacity, slots, cap = _startup(5.0)
    lines = [head]
    for i in range(10):  # a quiet morning: a few short sessions
        lines.append(_decode(f"09:{30 + i}:00", 3 + i % 2, 40_000, capacity, 9, slots))
    for i in range(38):  # agents at ~100K tokens each fill the KV pool
        running = 48 + i % 5
        lines.append(_decode(f"10:{10 + i}:00", running, int(capacity * 0.93), capacity,
                             running * 3, slots, queued=6))
    for i in range(2):  # a burst of short requests meets the running cap
        lines.append(_decode(f"11:0{i}:00", cap, int(capacity * 0.6), capacity, cap * 5,
                             slots, queued=30))
    observed = from_log("\n".join(lines))
    assert observed.samples == 50 and observed.busy_samples == 40
    assert (observed.kv_first, observed.state_first, observed.saturated_first) == (38, 2, "kv")
    assert observed.peak_concurrency == cap
    assert 80_000 < observed.lengths.quantile(50) < 120_000
    assert observed.concurrency[0] == ("2026-12-06 09:30:00", 3)
    assert "decode samples" in observed.source_note and "understated" in observed.source_note

    advice = advise(observed, K3, LAUNCH, BUDGET, current_ratio=5.0, min_samples=50)
    rec = advice.recommendation
    assert rec is not None and advice.enough and advice.refusal is None
    assert rec.ratio < 5.0 and rec.recommended.concurrent > rec.current.concurrent
    assert advice.summary.startswith(
        f"the KV pool saturated first in 38 of 40 busy samples; ratio {rec.ratio:g} would fit "
        f"{rec.recommended.concurrent} concurrent requests at the observed lengths (mean ")
    assert advice.summary.endswith(f"instead of {rec.current.concurrent} (from 50 decode "
                                   "samples over 91 minutes)")
    json.dumps(advice.to_dict())


def test_chat_at_the_running_cap_names_the_state_pool() -> None:
    head, capacity, slots, cap = _startup(0.9)
    lines = [head] + [
        _decode(f"12:{i:02d}:00", cap, cap * 3_000, capacity, cap * 3, slots, queued=40)
        for i in range(20)
    ]
    observed = from_log("\n".join(lines))
    assert (observed.saturated_first, observed.state_first, observed.busy_samples) == (
        "state", 20, 20)
    advice = advise(observed, K3, LAUNCH, BUDGET, current_ratio=0.9, min_samples=20)
    assert advice.recommendation is not None and advice.recommendation.ratio > 0.9
    assert advice.summary.startswith("the state pool saturated first in 20 of 20 busy samples")


def test_an_idle_or_empty_log_says_so() -> None:
    with pytest.raises(ObservedError) as caught:
        from_log((DATA / "engine_logs" / "k3_startup.sample.log").read_text())
    assert caught.value.code == "workload_unobserved" and caught.value.hint
    quiet = from_log(DECODE)
    assert quiet.saturated_first is None and quiet.busy_samples == 0
    advice = advise(quiet, K3, LAUNCH, BUDGET, current_ratio=0.9, min_samples=1)
    assert advice.summary.startswith("no pool reached high water (peak 12 concurrent requests)")


def test_twenty_samples_recommend_nothing_and_say_so() -> None:
    """Issue 14: ratio 42 was offered from 20 samples. Below the minimum the advice keeps what
    was seen, recommends no ratio, and states the counts; at the minimum it recommends, with
    the count beside it."""
    head, capacity, slots, cap = _startup(0.9)
    lines = [head] + [
        _decode(f"12:{i:02d}:00", cap, cap * 3_000, capacity, cap * 3, slots, queued=40)
        for i in range(20)
    ]
    observed = from_log("\n".join(lines))
    assert (observed.samples, observed.span_seconds) == (20, 19 * 60)
    advice = advise(observed, K3, LAUNCH, BUDGET, current_ratio=0.9, min_samples=200)
    assert advice.recommendation is None and not advice.enough
    assert advice.refusal == ("too few decode samples to recommend a change (20 of the 200 "
                              "needed)")
    assert advice.summary == ("the state pool saturated first in 20 of 20 busy samples; too "
                              "few decode samples to recommend a change (20 of the 200 needed)")
    shown = json.loads(json.dumps(advice.to_dict()))
    assert shown["recommendation"] is None
    assert shown["evidence"] == {
        "samples": 20, "unit": "decode samples", "span_seconds": 1140.0, "needed": 200,
        "enough": False, "words": "from 20 decode samples over 19 minutes",
        "refusal": "too few decode samples to recommend a change (20 of the 200 needed)"}

    enough = advise(observed, K3, LAUNCH, BUDGET, current_ratio=0.9, min_samples=20)
    assert enough.recommendation is not None and enough.refusal is None
    assert enough.summary.endswith("(from 20 decode samples over 19 minutes)")


def test_records_state_their_count_and_span() -> None:
    """1,284 requests over three days: "from 1,284 requests over 3 days"; 20 of them are too
    few for a minimum of 200, in the same words as the log's."""
    step = 3 * 86_400 / 1_283
    many = [Record(20_000, 1_000, 0, _at(i * step), _at(i * step + 60)) for i in range(1_284)]
    seen = from_records(many)
    assert seen.evidence() == "from 1,284 requests over 3 days"
    advice = advise(seen, K3, LAUNCH, BUDGET, current_ratio=0.9, min_samples=200)
    assert advice.recommendation is not None and "(from 1,284 requests over 3 days)" in \
        advice.summary
    few = advise(from_records(many[:20]), K3, LAUNCH, BUDGET, current_ratio=0.9,
                 min_samples=200)
    assert few.recommendation is None
    assert few.summary.endswith("too few requests to recommend a change (20 of the 200 "
                                "needed)")


@dataclass(frozen=True)
class Record:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    started_at: dt.datetime
    ended_at: dt.datetime | None


T0 = dt.datetime(2026, 12, 6, 9, 0, tzinfo=dt.UTC)


def _at(seconds: float) -> dt.datetime:
    return T0 + dt.timedelta(seconds=seconds)


RECORDS = [
    Record(1_000, 500, 0, _at(0), _at(10)),        # 1.5K for 10 s
    Record(100_000, 2_000, 90_000, _at(5), _at(65)),  # 102K for 60 s (an agent turn)
    Record(3_000, 1_000, 1_000, _at(8), _at(12)),   # 4K for 4 s
    Record(6_000, 0, 0, _at(70), None),             # still running at the end of the records
]


def test_records_give_exact_lengths_and_concurrency_over_time() -> None:
    observed = from_records(RECORDS)
    assert observed.samples == 4 and observed.saturated_first is None
    assert observed.peak_concurrency == 3
    assert observed.concurrency == (
        (_at(0).isoformat(), 1), (_at(5).isoformat(), 2), (_at(8).isoformat(), 3),
        (_at(10).isoformat(), 2), (_at(12).isoformat(), 1), (_at(65).isoformat(), 0),
        (_at(70).isoformat(), 1))
    lengths = observed.lengths
    # Weighted by time live (10 + 60 + 4 + 0 s): the agent turn dominates the median.
    assert lengths.minimum == 1_500 and lengths.max == 102_000
    assert lengths.quantile(50) == 102_000 and lengths.quantile(10) == 1_500
    assert "83% of prompt tokens were prefix-cache hits" in observed.source_note
    with pytest.raises(ObservedError):
        from_records([])


def test_both_sources_together() -> None:
    head, capacity, slots, _ = _startup(0.9)
    log = "\n".join([head, _decode("09:00:30", 5, int(capacity * 0.95), capacity, 15, slots)])
    both = observe(log_text=log, records=RECORDS)
    assert both.lengths == from_records(RECORDS).lengths          # exact lengths win
    assert (both.saturated_first, both.peak_concurrency) == ("kv", 5)  # the log's evidence
    assert "saturation from 1 decode samples" in both.source_note
    assert observe(log_text=log).samples == 1
    assert observe(records=RECORDS).samples == 4
    with pytest.raises(ObservedError):
        observe()
