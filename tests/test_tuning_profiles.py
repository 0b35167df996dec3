"""Workload profiles: length distributions (validation, quantiles, mean) and the built-ins."""

from __future__ import annotations

import pytest

from appliance.tuning.profiles import (
    BUILTIN,
    BUILTIN_NAMES,
    K,
    LengthDistribution,
    M,
    ProfileError,
    builtin_profile,
    format_tokens,
    make_profile,
    validate_name,
    with_changes,
)

AGENT = LengthDistribution.of([(50, 6_000), (90, 60_000), (99, 200_000), (100, 262_144)])


def test_quantile_is_piecewise_linear_from_the_minimum() -> None:
    d = LengthDistribution.of([(50, 100), (100, 300)], minimum=20)
    assert d.quantile(0) == 20
    assert d.quantile(25) == 60          # halfway from (0, 20) to (50, 100)
    assert d.quantile(50) == 100
    assert d.quantile(75) == 200
    assert d.quantile(100) == d.max == 300
    with pytest.raises(ValueError):
        d.quantile(101)


def test_mean_is_the_area_under_the_quantile_function() -> None:
    # (0,20)-(50,100): mean 60 over half; (50,100)-(100,300): mean 200 over half.
    assert LengthDistribution.of([(50, 100), (100, 300)], minimum=20).mean() == 130
    flat = LengthDistribution.of([(100, 4096)], minimum=4096)
    assert flat.mean() == flat.max == 4096
    assert AGENT.minimum <= AGENT.mean() <= AGENT.max
    # The tail matters: the same median with a longer tail has a larger mean.
    assert AGENT.mean() > LengthDistribution.of([(50, 6_000), (100, 60_000)]).mean()


def test_scaled_scales_every_percentile() -> None:
    doubled = AGENT.scaled(2)
    assert [t for _, t in doubled.points] == [12_000, 120_000, 400_000, 524_288]
    assert doubled.mean() == pytest.approx(AGENT.mean() * 2, rel=1e-6)


@pytest.mark.parametrize(("points", "minimum", "field"), [
    ([], None, "lengths.percentiles"),
    ([(50, 10), (100, 5)], None, "lengths.p100"),           # tokens decrease
    ([(90, 10), (50, 20), (100, 30)], None, "lengths.p50"),  # percentiles out of order
    ([(0, 10), (100, 20)], None, "lengths.p0"),               # p must be > 0
    ([(50, 10), (150, 20)], None, "lengths.p150"),
    ([(50, 0), (100, 20)], None, "lengths.p50"),              # tokens >= 1
    ([(50, 10), (90, 20)], None, "lengths.p100"),             # must reach the max
    ([(50, 10), (100, 20)], 0, "lengths.minimum"),
    ([(50, 10), (100, 20)], 11, "lengths.p50"),               # below the minimum
    ([(50, 2.5), (100, 20)], None, "lengths.p50"),            # whole tokens
    ([(50, 10, 3), (100, 20)], None, "lengths[0]"),
])
def test_invalid_distributions_name_the_field(points: list[tuple[float, ...]],
                                              minimum: int | None, field: str) -> None:
    with pytest.raises(ProfileError) as caught:
        LengthDistribution.of(points, minimum)
    assert caught.value.field == field
    assert caught.value.hint
    assert field in caught.value.message


def test_json_round_trip_and_bad_json() -> None:
    again = LengthDistribution.from_json(AGENT.to_json())
    assert again == AGENT
    with pytest.raises(ProfileError) as caught:
        LengthDistribution.from_json("{nope")
    assert caught.value.field == "lengths"
    with pytest.raises(ProfileError) as caught:
        LengthDistribution.from_mapping({"percentiles": "p50=1"})
    assert caught.value.field == "lengths.percentiles"


def test_format_tokens_uses_binary_k_and_m() -> None:
    assert format_tokens(900) == "900"
    assert format_tokens(128 * K) == "128K"
    assert format_tokens(6_000) == "5.9K"
    assert format_tokens(M) == "1M"
    assert format_tokens(1_258_291) == "1.2M"
    assert AGENT.describe() == "p50 5.9K, p90 59K, p99 195K, max 256K"


@pytest.mark.parametrize("name", ["a", "Chat", "my_profile", "-x", "x-", "a--b", "1abc",
                                  "x" * 41])
def test_bad_names(name: str) -> None:
    with pytest.raises(ProfileError) as caught:
        validate_name(name)
    assert caught.value.field == "name"


def test_make_profile_validates_each_field() -> None:
    ok = make_profile("support-bots", "Support bots", "", AGENT, 12)
    assert ok.name == "support-bots" and not ok.builtin
    for kwargs, field in (({"title": " "}, "title"), ({"target_concurrency": 0},
                          "target_concurrency"), ({"target_concurrency": 2.5},
                          "target_concurrency"), ({"description": "x" * 3000}, "description")):
        with pytest.raises(ProfileError) as caught:
            with_changes(ok, **kwargs)
        assert caught.value.field == field


def test_builtins_are_the_documented_shapes() -> None:
    assert [p.name for p in BUILTIN] == ["coding-agent", "chat", "long-document", "balanced"]
    assert {p.name for p in BUILTIN} == BUILTIN_NAMES
    assert all(p.builtin for p in BUILTIN)
    agent, chat, document, balanced = BUILTIN
    # coding agent: median tens of K, tail to 256K and beyond
    assert 16 * K <= agent.lengths.quantile(50) <= 96 * K and agent.lengths.max >= 256 * K
    # chat: median ~2K, p99 ~16K, many users
    assert chat.lengths.quantile(50) == 2 * K and chat.lengths.quantile(99) == 16 * K
    assert chat.target_concurrency > agent.target_concurrency > document.target_concurrency
    # long documents: 500K+ typical, up to the 1M context
    assert document.lengths.quantile(50) >= 500_000 and document.lengths.max == M
    assert chat.lengths.mean() < balanced.lengths.mean() < agent.lengths.mean()
    assert builtin_profile("chat") is chat and builtin_profile("nope") is None
    assert agent.to_dict()["lengths"]["max"] == agent.lengths.max
