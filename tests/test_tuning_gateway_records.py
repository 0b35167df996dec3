"""The Tuning view's observed workload from the gateway's own request records.

Records written the way the gateway writes them (`usage.write_batch`, real database) become the
observed lengths and concurrency once there are enough successful generations since the
engine's latest run began; the engine log's decode lines still give the saturation, and the
whole workload when the records are too few, failed, of another endpoint, or older.
"""

from __future__ import annotations

import asyncio
import datetime as dt

from appliance.config import Config
from appliance.db.database import Database
from appliance.engine.records import open_run
from appliance.gateway.usage import UsageRecord, write_batch
from appliance.runtime import Runtime
from appliance.tuning.service import MIN_RECORDS, TuningView
from tests.conftest import Console
from tests.test_tuning_api import write_k3
from tests.test_tuning_observed import _decode, _startup
from tests.test_tuning_service import box
from tests.test_tuning_ui import text_of

PROMPT, COMPLETION = 30_000, 2_000  # every recorded request ends at 32K tokens of context


def record(start: dt.datetime, *, seconds: float = 30.0, prompt: int = PROMPT,
           completion: int = COMPLETION, outcome: str = "ok",
           endpoint: str = "chat") -> UsageRecord:
    return UsageRecord(
        key_id=1, model="moonshotai/Kimi-K3", endpoint=endpoint, stream=True, status=200,
        outcome=outcome, prompt_tokens=prompt, completion_tokens=completion,
        cached_tokens=prompt // 2, started_at=start,
        ended_at=start + dt.timedelta(seconds=seconds), queue_ms=1.0, ttft_ms=200.0,
        duration_ms=seconds * 1000, history="appended")


def steady(first: dt.datetime, count: int) -> list[UsageRecord]:
    """A request every 5 s, each live 30 s: six at once at the peak."""
    return [record(first + dt.timedelta(seconds=5 * i)) for i in range(count)]


def noise(first: dt.datetime) -> list[UsageRecord]:
    """Records that are no generation the engine served: they must never count."""
    huge = {"prompt": 400_000, "completion": 0}
    return ([record(first, outcome="queue_timeout", **huge) for _ in range(MIN_RECORDS)]
            + [record(first, outcome="client_closed", **huge) for _ in range(MIN_RECORDS)]
            + [record(first, endpoint="models", **huge) for _ in range(MIN_RECORDS)])


def write(db: Database, records: list[UsageRecord]) -> None:
    db.call(lambda s: write_batch(s, records))


def busy_log(runtime: Runtime) -> None:
    """The engine's log since its last start: 20 decode lines, 50 running, KV at 95 %."""
    head, capacity, slots, _ = _startup(5.0)
    lines = [head] + [_decode(f"10:{10 + i}:00", 50, int(capacity * 0.95), capacity, 150,
                              slots, queued=4) for i in range(20)]
    runtime.supervisor.log_path.parent.mkdir(parents=True, exist_ok=True)
    runtime.supervisor.log_path.write_text("\n".join(lines) + "\n")


def view_of(runtime: Runtime) -> TuningView:
    return asyncio.run(runtime.tuning.view("coding-agent"))


def test_enough_records_give_the_lengths_and_concurrency(config: Config, db: Database) -> None:
    runtime = box(config, db)
    now = runtime.clock.now()
    assert view_of(runtime).observed is None  # no log, no records: nothing observed

    # No engine run is recorded: the last 24 hours count, and only successful generations.
    write(db, steady(now - dt.timedelta(hours=30), MIN_RECORDS))  # too old
    write(db, noise(now - dt.timedelta(hours=1)))
    write(db, steady(now - dt.timedelta(hours=1), MIN_RECORDS - 1))
    assert view_of(runtime).observed is None  # one short of enough, and no log to fall back on

    write(db, [record(now - dt.timedelta(minutes=30), endpoint="completions")])
    advice = view_of(runtime).observed
    assert advice is not None
    seen = advice.observed
    assert (seen.source, seen.samples, seen.peak_concurrency) == ("records", MIN_RECORDS, 6)
    assert seen.lengths.minimum == seen.lengths.max == PROMPT + COMPLETION
    assert seen.saturated_first is None and seen.busy_samples == 0
    assert seen.source_note.startswith(f"{MIN_RECORDS} gateway requests")
    assert "50% of prompt tokens were prefix-cache hits" in seen.source_note
    assert advice.summary.startswith(
        f"peak 6 concurrent requests in {MIN_RECORDS} gateway requests (their records carry "
        "no pool levels)")
    # 50 requests are enough to show, too few to recommend from (tuning.min_observed_requests).
    assert advice.recommendation is None
    assert advice.summary.endswith("too few requests to recommend a change (50 of the 200 "
                                   "needed)")
    shown = view_of(runtime).to_dict()["observed"]
    assert shown["observed"]["source"] == "records" and shown["recommendation"] is None
    assert (shown["evidence"]["samples"], shown["evidence"]["needed"]) == (MIN_RECORDS, 200)

    write(db, steady(now - dt.timedelta(minutes=50), 200 - MIN_RECORDS))
    enough = view_of(runtime).observed
    assert enough is not None and enough.recommendation is not None
    assert enough.recommendation.longest_tokens == PROMPT + COMPLETION
    assert enough.observed.evidence().startswith("from 200 requests over ")
    assert enough.summary.endswith(f"({enough.observed.evidence()})")


def test_records_and_the_log_together_and_the_fallback(config: Config, db: Database) -> None:
    runtime = box(config, db)
    now = runtime.clock.now()
    busy_log(runtime)
    write(db, steady(now - dt.timedelta(hours=2), MIN_RECORDS - 1))

    # Too few records: the log's decode lines, as before, and the note says why.
    by_log = view_of(runtime).observed
    assert by_log is not None and by_log.observed.source == "log"
    assert by_log.observed.samples == 20 and by_log.observed.lengths.max != PROMPT + COMPLETION
    assert "decode samples" in by_log.observed.source_note
    assert f"only {MIN_RECORDS - 1} requests in this run so far" in by_log.observed.source_note
    assert by_log.summary.startswith("the KV pool saturated first in 20 of 20")

    write(db, steady(now - dt.timedelta(hours=1), 1))
    both = view_of(runtime).observed
    assert both is not None
    seen = both.observed
    assert (seen.source, seen.samples) == ("records+log", MIN_RECORDS)
    assert seen.lengths.minimum == seen.lengths.max == PROMPT + COMPLETION  # exact lengths win
    assert (seen.saturated_first, seen.kv_first, seen.busy_samples) == ("kv", 20, 20)
    assert seen.peak_concurrency == 50  # the larger of the log's and the records' peaks
    assert "saturation from 20 decode samples of the engine log" in seen.source_note
    assert both.summary.startswith("the KV pool saturated first in 20 of 20")


def test_only_records_since_the_engines_run_began_count(config: Config, db: Database) -> None:
    runtime = box(config, db)
    now = runtime.clock.now()
    busy_log(runtime)
    write(db, steady(now - dt.timedelta(hours=3), 2 * MIN_RECORDS))  # the previous run's
    started = now - dt.timedelta(hours=1)
    db.call(lambda s: open_run(s, at=started, runner="process", spec_hash="h", spec_json="{}",
                               attempt=1, state="ready", log_path="engine.log"))
    assert view_of(runtime).observed.observed.source == "log"  # type: ignore[union-attr]

    write(db, steady(started + dt.timedelta(minutes=1), MIN_RECORDS))
    seen = view_of(runtime).observed.observed  # type: ignore[union-attr]
    assert (seen.source, seen.samples, seen.peak_concurrency) == ("records+log", MIN_RECORDS,
                                                                   50)


def test_the_tuning_page_names_the_records_as_its_source(config: Config, runtime: Runtime,
                                                          logged_in: Console) -> None:
    write_k3(config)
    write(runtime.db, steady(runtime.clock.now() - dt.timedelta(hours=1), 60))
    words = text_of(logged_in.http.get("/tuning").text)
    assert "What this box really served" in words
    assert "Peak 6 concurrent requests in 60 gateway requests" in words
    assert "Ran out first not known: the gateway's records carry no pool levels" in words
    assert "Source The gateway's request records: 60 gateway requests" in words
