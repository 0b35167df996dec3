"""The box's real workload, from the engine's batch lines and the gateway's request records.

Two sources, both pure inputs:

- **Engine log.** SGLang 0.5.23's TP0 scheduler logs a `Decode batch` line every
  `--decode-log-interval` (40) decode steps and a `Prefill batch` line per prefill
  (`srt/managers/scheduler_components/metrics_reporter.py:753-790, 963-1043`; the usage parts
  from `srt/mem_cache/pool_stats_observer.py:104-149`). For a hybrid linear-attention model:

      Decode batch, #running-req: 12, #full token: 181440, full token usage: 0.07,
        mamba num: 60, mamba usage: 0.18, [accept len: .., accept rate: .., ]cuda graph: True,
        gen throughput (token/s): 812.34, #queue-req: 0
      Prefill batch, #new-seq: 1, #new-token: 7, #cached-token: 0, full token usage: 0.00,
        mamba usage: 0.00, #running-req: 0, #queue-req: 0, #pending-token: 0, cuda graph: ..,
        input throughput (token/s): 0.00

  (`Decode batch [N]` with SGLANG_LOG_FORWARD_ITERS; `#token:`/`token usage:` for a model
  without a state pool.) `#full token` counts KV tokens held by requests (cached-but-evictable
  prefixes excluded) in the allocator's logical units, i.e. per-rank rows x DCP. Each decode
  sample gives the mean context of its running requests, `#full token / #running-req`; when
  only the usage fraction is printed, tokens = usage x the KV capacity (from the same log's
  startup lines, or given).
- **Gateway records** (`RequestRecord`): prompt, completion and cached tokens and the start and
  end of each request: exact lengths and concurrency over time.

Weighting: a decode line stands for 40 decode steps of its N running requests, so its mean is
weighted by N (request-steps); a record is weighted by how long it was live (request-time).
Either way the distribution is "the context of a live request at a random moment", which is
what fills the KV pool. From decode lines the percentiles are of per-sample means, so the tail
is understated (the mean, which sizes the KV limit, is exact); records give true per-request
percentiles. The source note says which.

Evidence: `samples` counts the observations the lengths rest on (gateway requests, or decode
samples when the log gives the lengths) and `span_seconds` the time they cover; `advise`
states both beside its recommendation ("from 1,284 requests over 3 days") and refuses to
recommend any change below `min_samples` (the configuration's `tuning.min_observed_requests`),
saying how many it has and needs: a ratio drawn from 20 samples is noise.

Saturation: a sample is *busy* when a pool is at `high_water` (0.9). The KV
pool is at high water when `full token usage >= high_water`; the state pool when
`mamba usage >= high_water` or the running requests reached the scheduler's
`max_running_requests` (SGLang caps running requests by state slots before the pool itself
reads full). Per busy sample the fuller pool "saturated first"; the majority names the pool.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from appliance.engine import logparse
from appliance.errors import EX_DATAERR, ApplianceError
from appliance.tuning.calculator import Launch
from appliance.tuning.geometry import Geometry
from appliance.tuning.profiles import LengthDistribution, format_tokens
from appliance.tuning.recommend import Recommendation, recommend

HIGH_WATER = 0.9
PERCENTILES = (10.0, 25.0, 50.0, 75.0, 90.0, 95.0, 99.0, 100.0)
Pool = Literal["kv", "state"]
# Where lengths and concurrency came from: the engine log alone, the gateway's records alone
# (no pool levels, so nothing about saturation), or records with the log's saturation.
Source = Literal["log", "records", "records+log"]


class ObservedError(ApplianceError):
    """Nothing in the input describes the workload."""

    exit_code = EX_DATAERR

    def __init__(self, message: str, hint: str) -> None:
        super().__init__("workload_unobserved", message, hint, status=422)


@dataclass(frozen=True)
class BatchSample:
    """One `Decode batch` / `Prefill batch` line; counts absent from the line are None."""

    kind: Literal["decode", "prefill"]
    at: str | None          # the log timestamp as printed (the engine's local time)
    running: int
    queued: int
    full_tokens: int | None
    full_usage: float | None
    mamba_slots: int | None
    mamba_usage: float | None
    new_seqs: int | None = None
    new_tokens: int | None = None
    cached_tokens: int | None = None

    def tokens_per_request(self, kv_capacity: int | None = None) -> float | None:
        """Mean context of the running requests, or None when it cannot be told."""
        if self.running <= 0:
            return None
        tokens: float | None = self.full_tokens
        if tokens is None and self.full_usage is not None and kv_capacity:
            tokens = self.full_usage * kv_capacity
        return None if tokens is None else tokens / self.running


_HEADER = re.compile(r"(Decode|Prefill) batch(?: \[\d+\])?, ")
_STAMP = re.compile(r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(?:[.,]\d{1,6})?)[^\]]{0,120}\] ?")
_FIELD = re.compile(r"([#A-Za-z][^:,]{0,60}): ([^,]{1,40})")


def parse_batch_line(line: str) -> BatchSample | None:
    """A sample from one log line, or None when it is not a batch line (never raises)."""
    header = _HEADER.search(line)
    if header is None:
        return None
    stamp = _STAMP.match(line)
    fields = {m.group(1).strip(): m.group(2).strip()
              for m in _FIELD.finditer(line, header.end())}
    running = _int(fields.get("#running-req"))
    if running is None:
        return None
    full_tokens = _int(fields.get("#full token", fields.get("#token")))
    full_usage = _float(fields.get("full token usage", fields.get("token usage")))
    kind: Literal["decode", "prefill"] = "decode" if header.group(1) == "Decode" else "prefill"
    return BatchSample(
        kind=kind, at=stamp.group(1) if stamp else None, running=running,
        queued=_int(fields.get("#queue-req")) or 0, full_tokens=full_tokens,
        full_usage=full_usage, mamba_slots=_int(fields.get("mamba num")),
        mamba_usage=_float(fields.get("mamba usage")), new_seqs=_int(fields.get("#new-seq")),
        new_tokens=_int(fields.get("#new-token")),
        cached_tokens=_int(fields.get("#cached-token")))


def parse_batches(text: str) -> tuple[BatchSample, ...]:
    """Every batch line of a log text, in order (tqdm's `\\r` separates records too)."""
    samples = (parse_batch_line(line) for line in re.split(r"[\r\n]", text) if "batch" in line)
    return tuple(s for s in samples if s is not None)


class RequestRecord(Protocol):
    """What the gateway records per request (the gateway issue implements it)."""

    @property
    def prompt_tokens(self) -> int: ...
    @property
    def completion_tokens(self) -> int: ...
    @property
    def cached_tokens(self) -> int: ...
    @property
    def started_at(self) -> dt.datetime: ...
    @property
    def ended_at(self) -> dt.datetime | None: ...


@dataclass(frozen=True)
class ObservedWorkload:
    """The workload as observed: its length distribution, peak concurrency and which pool ran
    out first (None when no sample was busy, or the source has no pool figures).

    `samples` counts the observations behind `lengths` (decode lines or records);
    `busy_samples`, `kv_first`, `state_first` count the saturation evidence;
    `concurrency` is (time as printed or ISO 8601, live requests) in time order;
    `source` says which input `lengths` and the saturation came from (`source_note`, in words);
    `span_seconds` is the time from the first observation behind `lengths` to the last (None
    when the input carries no times).
    """

    lengths: LengthDistribution
    peak_concurrency: int
    samples: int
    saturated_first: Pool | None
    source_note: str
    busy_samples: int = 0
    kv_first: int = 0
    state_first: int = 0
    concurrency: tuple[tuple[str, int], ...] = ()
    source: Source = "log"
    span_seconds: float | None = None

    @property
    def unit(self) -> str:
        """What `samples` counts, in words."""
        return "decode samples" if self.source == "log" else "requests"

    def evidence(self) -> str:
        """"from 1,284 requests over 3 days"."""
        over = f" over {duration_words(self.span_seconds)}" if self.span_seconds else ""
        return f"from {self.samples:,} {self.unit}{over}"

    def to_dict(self) -> dict[str, Any]:
        data = dict(self.__dict__)
        data["unit"] = self.unit
        data["lengths"] = self.lengths.to_dict()
        data["concurrency"] = [list(point) for point in self.concurrency]
        return data


def weighted_distribution(values: Sequence[tuple[float, float]]) -> LengthDistribution:
    """A `LengthDistribution` from (tokens, weight) pairs: weighted percentiles at
    `PERCENTILES` (the smallest value whose cumulative weight reaches p %)."""
    pairs = sorted((max(1.0, v), w) for v, w in values if w > 0)
    if not pairs:
        raise ValueError("no positive weight")
    total = sum(w for _, w in pairs)
    points: list[tuple[float, int]] = []
    cumulative, index = 0.0, 0
    for p in PERCENTILES:
        goal = total * p / 100
        while index < len(pairs) - 1 and cumulative + pairs[index][1] < goal * (1 - 1e-12):
            cumulative += pairs[index][1]
            index += 1
        points.append((p, max(1, round(pairs[index][0]))))
    points[-1] = (100.0, max(points[-1][1], round(pairs[-1][0])))
    return LengthDistribution(tuple(points), min(max(1, round(pairs[0][0])), points[0][1]))


def from_log(text: str, *, kv_capacity: int | None = None,
             max_running_requests: int | None = None,
             high_water: float = HIGH_WATER) -> ObservedWorkload:
    """The workload of one engine run's log (one startup: pool sizes differ between runs).
    `kv_capacity` (logical tokens) and `max_running_requests` default to what the log's own
    startup lines say, when present."""
    samples = parse_batches(text)
    if kv_capacity is None or max_running_requests is None:
        startup = logparse.parse_text(text)
        kv_capacity = kv_capacity or startup.kv_token_capacity
        if max_running_requests is None and startup.figures is not None:
            max_running_requests = startup.figures.max_running_requests
    decodes = [s for s in samples if s.kind == "decode"]
    values = [(v, float(s.running)) for s in decodes
              if (v := s.tokens_per_request(kv_capacity)) is not None]
    if not values:
        raise ObservedError(
            "the log has no `Decode batch` line with running requests and a token count",
            "give a log from a run that served traffic (TP0's lines, SGLang's default "
            "--decode-log-interval), or the KV capacity when only usage fractions are printed")
    busy, kv_first, state_first = _saturation(samples, max_running_requests, high_water)
    peak = max(s.running + (s.new_seqs or 0) if s.kind == "prefill" else s.running
               for s in samples)
    note = (f"{len(values)} decode samples (mean context per running request, weighted by "
            "running requests); percentiles are of sample means, so the tail is understated")
    return ObservedWorkload(
        lengths=weighted_distribution(values), peak_concurrency=peak, samples=len(values),
        saturated_first=_majority(kv_first, state_first), source_note=note,
        busy_samples=busy, kv_first=kv_first, state_first=state_first,
        concurrency=tuple((s.at or "", s.running) for s in decodes),
        span_seconds=_log_span([s.at for s in decodes if s.tokens_per_request(kv_capacity)
                                is not None]))


def from_records(records: Iterable[RequestRecord]) -> ObservedWorkload:
    """The workload of gateway records: each request's final context (prompt + completion,
    the most KV it held), weighted by how long it was live; concurrency from start/end times.
    A record without an end counts as live until the latest time seen."""
    items = list(records)
    if not items:
        raise ObservedError("there are no request records to learn from",
                            "let the gateway serve traffic for a while, then look again")
    latest = max(max(r.started_at, r.ended_at or r.started_at) for r in items)
    spans = [(r, ((r.ended_at or latest) - r.started_at).total_seconds()) for r in items]
    timed = any(seconds > 0 for _, seconds in spans)
    values = [(float(r.prompt_tokens + r.completion_tokens), max(0.0, s) if timed else 1.0)
              for r, s in spans]
    if timed and not any(w > 0 for _, w in values):
        values = [(v, 1.0) for v, _ in values]
    concurrency = _concurrency(items, latest)
    prompt = sum(r.prompt_tokens for r in items)
    cached = sum(r.cached_tokens for r in items)
    share = f"; {cached / prompt:.0%} of prompt tokens were prefix-cache hits" if prompt else ""
    note = (f"{len(items)} gateway requests (final context, weighted by time live){share}; "
            "the capacity model assumes no prefix sharing, so it errs on the safe side")
    return ObservedWorkload(
        lengths=weighted_distribution(values),
        peak_concurrency=max((n for _, n in concurrency), default=0), samples=len(items),
        saturated_first=None, source_note=note, concurrency=concurrency, source="records",
        span_seconds=(latest - min(r.started_at for r in items)).total_seconds())


def observe(*, log_text: str | None = None, records: Iterable[RequestRecord] | None = None,
            kv_capacity: int | None = None, max_running_requests: int | None = None,
            high_water: float = HIGH_WATER) -> ObservedWorkload:
    """Both sources together: lengths and concurrency from the records when there are any
    (exact), saturation from the log; the peak is the larger of the two. A log without decode
    lines does not hide the records."""
    items = list(records or ())
    from_engine: ObservedWorkload | None = None
    if log_text is not None:
        try:
            from_engine = from_log(log_text, kv_capacity=kv_capacity,
                                   max_running_requests=max_running_requests,
                                   high_water=high_water)
        except ObservedError:
            if not items:
                raise
    if not items:
        if from_engine is None:
            raise ObservedError("no engine log and no request records were given",
                                "give the engine log, the gateway's records, or both")
        return from_engine
    gateway = from_records(items)
    if from_engine is None:
        return gateway
    return ObservedWorkload(
        lengths=gateway.lengths,
        peak_concurrency=max(gateway.peak_concurrency, from_engine.peak_concurrency),
        samples=gateway.samples, saturated_first=from_engine.saturated_first,
        source_note=f"{gateway.source_note}; saturation from {from_engine.samples} decode "
                    "samples of the engine log",
        busy_samples=from_engine.busy_samples, kv_first=from_engine.kv_first,
        state_first=from_engine.state_first, concurrency=gateway.concurrency,
        source="records+log", span_seconds=gateway.span_seconds)


@dataclass(frozen=True)
class Advice:
    """A recommendation for the observed workload, and the sentence to show.

    `recommendation` is None when the evidence is too thin (`observed.samples < needed`):
    then `refusal` says so with both counts, and nothing is recommended.
    """

    observed: ObservedWorkload
    recommendation: Recommendation | None
    summary: str
    needed: int = 0

    @property
    def enough(self) -> bool:
        return self.observed.samples >= self.needed

    @property
    def refusal(self) -> str | None:
        """"too few requests to recommend a change (20 of the 200 needed)", or None."""
        if self.enough:
            return None
        return (f"too few {self.observed.unit} to recommend a change "
                f"({self.observed.samples:,} of the {self.needed:,} needed)")

    def to_dict(self) -> dict[str, Any]:
        return {"observed": self.observed.to_dict(),
                "recommendation": self.recommendation.to_dict() if self.recommendation
                else None,
                "summary": self.summary,
                "evidence": {"samples": self.observed.samples, "unit": self.observed.unit,
                             "span_seconds": self.observed.span_seconds,
                             "needed": self.needed, "enough": self.enough,
                             "words": self.observed.evidence(), "refusal": self.refusal}}


def advise(observed: ObservedWorkload, geometry: Geometry, launch: Launch, budget_bytes: int,
           current_ratio: float, *, min_samples: int) -> Advice:
    """What to change, in words a person can act on, e.g. "the KV pool saturated first in 38 of
    40 busy samples; ratio 0.4 would fit 20 concurrent requests at the observed lengths
    instead of 6 (from 1,284 requests over 3 days)". The target is the observed peak (at
    least 1). Below `min_samples` observations nothing is recommended: the summary says how
    many there are and how many are needed."""
    parts = []
    if observed.saturated_first is not None:
        pool = "KV" if observed.saturated_first == "kv" else "state"
        count = observed.kv_first if observed.saturated_first == "kv" else observed.state_first
        parts.append(f"the {pool} pool saturated first in {count} of {observed.busy_samples} "
                     "busy samples")
    elif observed.source == "records":
        parts.append(f"peak {observed.peak_concurrency} concurrent requests in "
                     f"{observed.samples} gateway requests (their records carry no pool levels)")
    elif observed.busy_samples == 0 and observed.kv_first == observed.state_first == 0:
        parts.append(f"no pool reached high water (peak {observed.peak_concurrency} "
                     "concurrent requests)")
    if observed.samples < min_samples:
        refused = Advice(observed, None, "", min_samples)
        parts.append(str(refused.refusal))
        return Advice(observed, None, "; ".join(parts), min_samples)
    rec = recommend(geometry, launch, budget_bytes, observed.lengths,
                    target_concurrency=max(1, observed.peak_concurrency),
                    current_ratio=current_ratio)
    at = (f"at the observed lengths (mean {format_tokens(rec.mean_tokens)}, longest "
          f"{format_tokens(rec.longest_tokens)})")
    if rec.recommended.concurrent > rec.current.concurrent:
        parts.append(f"ratio {rec.ratio:g} would fit {rec.recommended.concurrent} concurrent "
                     f"requests {at} instead of {rec.current.concurrent}")
    else:
        parts.append(f"the current ratio {rec.current_ratio:g} already fits the most, "
                     f"{rec.current.concurrent} concurrent requests {at}")
    if rec.pin is not None:
        parts.append(f"a pin of --max-mamba-cache-size {rec.pin} would fit "
                     f"{rec.pin_capacity.concurrent if rec.pin_capacity else 0}")
    return Advice(observed, rec, f"{'; '.join(parts)} ({observed.evidence()})", min_samples)


def duration_words(seconds: float) -> str:
    """A span in the largest whole unit that fits at least twice: "45 seconds", "3 minutes",
    "5 hours", "3 days" ("1 second" for a moment)."""
    for unit, size in (("day", 86_400), ("hour", 3_600), ("minute", 60)):
        if seconds >= 2 * size:
            count = int(seconds // size)
            return f"{count:,} {unit}s"
    count = max(1, round(seconds))
    return f"{count} second{'s' if count != 1 else ''}"


# --- helpers ------------------------------------------------------------------------------


def _saturation(samples: Sequence[BatchSample], max_running: int | None,
                high_water: float) -> tuple[int, int, int]:
    busy = kv = state = 0
    for s in samples:
        kv_level = s.full_usage or 0.0
        state_level = s.mamba_usage or 0.0
        if max_running and s.running >= max_running:
            state_level = max(state_level, 1.0)  # the scheduler's cap is the state pool's limit
        if max(kv_level, state_level) < high_water:
            continue  # a queue alone is no pool's doing (the prefill token budget also queues)
        busy += 1
        if kv_level >= state_level:
            kv += 1
        else:
            state += 1
    return busy, kv, state


def _log_span(stamps: Sequence[str | None]) -> float | None:
    """Seconds from the first to the last stamp (the log's local time), None without two."""
    times = []
    for stamp in stamps:
        if stamp:
            try:
                times.append(dt.datetime.fromisoformat(stamp.replace(",", ".")))
            except ValueError:
                continue
    if len(times) < 2:
        return None
    return (max(times) - min(times)).total_seconds()


def _majority(kv: int, state: int) -> Pool | None:
    if kv == state == 0:
        return None
    return "kv" if kv >= state else "state"


def _concurrency(items: Sequence[RequestRecord],
                 latest: dt.datetime) -> tuple[tuple[str, int], ...]:
    events = sorted([(r.started_at, 1) for r in items]
                    + [(r.ended_at or latest, -1) for r in items if r.ended_at is not None],
                    key=lambda e: (e[0], e[1]))  # ends before starts at the same instant
    points: list[tuple[str, int]] = []
    live = 0
    for at, change in events:
        live += change
        stamp = at.isoformat()
        if points and points[-1][0] == stamp:
            points[-1] = (stamp, live)
        else:
            points.append((stamp, live))
    return tuple(points)


def _int(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def _float(text: str | None) -> float | None:
    try:
        return float(text) if text is not None else None
    except ValueError:
        return None
