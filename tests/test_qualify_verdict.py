"""The qualification's pure parts: the ladder, the workloads, the estimate, per-round
statistics from samples, the step rule and the qualified point."""

from __future__ import annotations

import pytest

from appliance.qualify import plan
from appliance.qualify.verdict import (
    Sample,
    Step,
    judge,
    lower_bound,
    percentile,
    qualified_point,
    round_of,
    steps_from,
    verdict_words,
)
from appliance.tuning.profiles import builtin_profile


def user(rate: float, *, ttft: float = 0.5, tokens: int = 101, error: str = "") -> Sample:
    """A finished request whose tokens after the first came at `rate` per second."""
    first = 10.0 + ttft
    end = first + (tokens - 1) / rate
    gap = 1 / rate
    return Sample(sent_at=10.0, first_token_at=first, end_at=None if error else end,
                  output_tokens=tokens, input_tokens=1000, gaps=(gap,) * (tokens - 1),
                  error=error)


def test_ladder_climbs_the_issue_steps_and_ends_at_the_engine_limit() -> None:
    assert plan.ladder(94) == (1, 2, 4, 8, 16, 24, 32, 48, 64, 94)
    assert plan.ladder(64) == (1, 2, 4, 8, 16, 24, 32, 48, 64)
    assert plan.ladder(20) == (1, 2, 4, 8, 16, 20)
    assert plan.ladder(1) == (1,)
    assert plan.ladder(300) == (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 300)
    with pytest.raises(plan.PlanError):
        plan.ladder(0)


def test_custom_ladder_is_sorted_distinct_and_within_the_engine_limit() -> None:
    assert plan.custom_ladder([4, 1, 2, 2], 64) == (1, 2, 4)
    with pytest.raises(plan.PlanError, match="above the engine's limit of 62"):
        plan.custom_ladder([1, 64], 62)
    with pytest.raises(plan.PlanError, match="start at 1"):
        plan.custom_ladder([0, 2], 62)


def test_workloads_harsh_profile_and_replay() -> None:
    harsh = plan.harsh()
    assert harsh.shape(0) == harsh.shape(7) == plan.Shape(8192, 1000)
    chat = builtin_profile("chat")
    assert chat is not None
    workload = plan.from_profile(chat, samples=8)
    assert workload.name == "profile:chat" and len(workload.shapes) == 8
    assert all(1 <= s.output_tokens <= 1000 for s in workload.shapes)
    lengths = [s.input_tokens + s.output_tokens for s in workload.shapes]
    assert lengths == sorted(lengths)  # evenly spaced percentiles, ascending
    replay = plan.from_usage([(100, 10), (5000, 500), (0, 5), (300, 0)] * 4, samples=4)
    assert {(s.input_tokens, s.output_tokens) for s in replay.shapes} <= {(100, 10), (5000, 500)}
    with pytest.raises(plan.PlanError, match="no answered request"):
        plan.from_usage([(0, 0)])


def test_estimate_counts_every_repeat_at_the_floor_speed() -> None:
    settings = plan.Settings(plan.harsh(2000, 320), (1, 2), floor=32.0, repeats=3)
    # per round: flush 2 s + prompts / 20,000 tok/s + 320 tokens at 32 tok/s = 10 s
    expected = 3 * (2 + 2000 / 20_000 + 10) + 3 * (2 + 4000 / 20_000 + 10)
    assert plan.estimate_seconds(settings) == pytest.approx(expected)
    assert plan.Settings.from_dict(settings.to_dict()) == settings


def test_percentile_interpolates_between_ranks() -> None:
    assert percentile([], 10) is None
    assert percentile([5.0], 10) == 5.0
    assert percentile([10.0, 20.0, 30.0, 40.0, 50.0, 60.0, 70.0, 80.0, 90.0, 100.0], 10) \
        == pytest.approx(19.0)
    assert percentile([1.0, 3.0], 50) == 2.0


def test_decode_rate_is_tokens_after_the_first_over_first_to_last() -> None:
    sample = user(40.0, ttft=3.0)
    assert sample.decode_rate == pytest.approx(40.0)  # the TTFT does not slow it
    assert user(40.0, error="HTTP 500").decode_rate is None
    assert Sample(0, 1, 2, 1, 10).decode_rate is None  # one token: nothing to time


def test_round_statistics_from_samples() -> None:
    samples = [user(r) for r in (20.0, 40.0, 40.0, 40.0, 40.0, 40.0, 40.0, 40.0, 40.0, 40.0)]
    r = round_of(10, 1, samples, seconds=5.0, kv_peak=0.4, state_peak=0.1)
    assert r.requests == 10 and r.failures == 0 and not r.wedged
    assert r.output_tokens == 1010 and r.output_tps == pytest.approx(202.0)
    assert r.total_tps == pytest.approx((1010 + 10_000) / 5.0)
    assert r.decode_p10 == pytest.approx(38.0)  # 20 and 40 interpolated at rank 0.9
    assert r.ttft_p50 == pytest.approx(0.5) and r.itl_p50 == pytest.approx(0.025)
    assert r.kv_peak == 0.4 and r.state_peak == 0.1


def test_a_step_passes_only_when_every_repeat_holds_everything() -> None:
    good = round_of(4, 1, [user(40.0)] * 4, 5.0)
    slow = round_of(4, 2, [user(40.0)] * 3 + [user(10.0)], 5.0)
    failed = round_of(4, 3, [user(40.0)] * 3 + [user(40.0, error="HTTP 503 busy")], 5.0)
    wedged = round_of(4, 3, [user(40.0)] * 4, 5.0, wedged=True)
    assert judge(4, [good, good, good], floor=32, ttft_p90_max=None, repeats=3).passed
    slow_step = judge(4, [good, slow, good], floor=32, ttft_p90_max=None, repeats=3)
    assert not slow_step.passed and "under the floor of 32" in slow_step.reasons[0]
    fail_step = judge(4, [good, good, failed], floor=32, ttft_p90_max=None, repeats=3)
    assert not fail_step.passed and "1 request failed (HTTP 503 busy)" in fail_step.reasons[0]
    assert not judge(4, [good, good, wedged], floor=32, ttft_p90_max=None, repeats=3).passed
    assert not judge(4, [good, good], floor=32, ttft_p90_max=None, repeats=3).passed
    ttft = judge(4, [good], floor=32, ttft_p90_max=0.2, repeats=1)
    assert not ttft.passed and "over the ceiling of 0.2 s" in ttft.reasons[0]


def test_the_qualified_point_is_the_highest_step_with_every_lower_one_passing() -> None:
    def step(c: int, rate: float) -> Step:
        return judge(c, [round_of(c, 1, [user(rate)] * c, 5.0)], floor=32,
                     ttft_p90_max=None, repeats=1)

    steps = [step(1, 60), step(2, 50), step(4, 40), step(8, 20), step(16, 40)]
    assert qualified_point(steps) == 4  # 16 passed, but 8 did not: not trusted at 16
    assert qualified_point([step(1, 10)]) is None
    assert qualified_point([]) is None
    assert steps_from([s.to_dict() for s in steps]) == tuple(steps)
    assert verdict_words(4, 32, None, steps) == (
        "qualified at 4 concurrent users: every user at or above 32 tokens/s")
    assert verdict_words(1, 32, None, steps[:2]).startswith("qualified at 1 concurrent user:")
    # Every step passed: the ladder's top is only a lower bound, below the engine's ceiling.
    assert verdict_words(2, 32, None, steps[:2], max_running=64).startswith(
        "qualified for at least 2 concurrent users (the ladder stopped at 2; no step failed")
    assert lower_bound(2, steps[:2], 64) and not lower_bound(4, steps, 64)
    assert not lower_bound(2, steps[:2], 2)  # the engine's own ceiling: all there is
    assert verdict_words(2, 32, None, steps[:2], max_running=2).startswith(
        "qualified at 2 concurrent users:")
    assert verdict_words(None, 32, None, [step(1, 10)]).startswith(
        "not qualified: already at 1 concurrent user, repeat 1: the slowest users decoded at "
        "10.0 tokens/s")


def test_how_a_run_ends_in_words() -> None:
    """The state, the point and the verdict of every way a run ends (service.outcome)."""
    from appliance.qualify.climb import Climbed
    from appliance.qualify.outcome import outcome

    def step(c: int, rate: float) -> Step:
        return judge(c, [round_of(c, 1, [user(rate)] * c, 5.0)], floor=32,
                     ttft_p90_max=None, repeats=1)

    settings = plan.Settings(plan.harsh(), (1, 2, 4), max_running_requests=64)
    passed = (step(1, 60), step(2, 50))
    assert outcome(settings, passed, Climbed("done"), "")[:2] == ("done", 2)
    state, point, words = outcome(settings, passed, Climbed(
        "done", "the engine left READY at 4 concurrent users and was not READY again "
        "within 5 min; not measured: 4", retried=1), "")
    assert (state, point) == ("done", 2)
    assert words == (
        "qualified for at least 2 concurrent users (the ladder stopped at 2: the engine left "
        "READY at 4 concurrent users and was not READY again within 5 min; not measured: 4): "
        "every user at or above 32 tokens/s; the gateway admits at 2 (1 round was measured "
        "again after the engine left READY)")
    # Stopped before any step passed: failed, so an earlier qualification still stands.
    assert outcome(settings, (), Climbed("done", "at 1 concurrent user, the engine would "
                                                 "not flush"), "")[:2] == ("failed", None)
    failed = outcome(settings, (), Climbed("failed"), "2 users' requests were still running")
    assert failed == ("failed", None, "not qualified: the run failed: 2 users' requests were "
                      "still running")
    assert outcome(settings, passed, Climbed("cancelled"), "") == ("cancelled", None,
                                                                    "cancelled")
    scaled = plan.Settings(plan.harsh(), (1, 2, 4, 8), time_scale=0.25)
    assert outcome(scaled, (*passed, step(4, 10)), Climbed("done"), "")[2].endswith(
        "(in the engine's time: its time scale is 0.25)")
    for _, _, text in (failed, outcome(settings, (), Climbed("interrupted"), "gone")):
        assert "failed: failed" not in text
