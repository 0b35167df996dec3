"""The inverse of the calculator: capacity at a workload, the ratio sweep, the balanced ratio,
pins, caps and the words, on K3's geometry and the budget of the sample startup log."""

from __future__ import annotations

import datetime as dt
import itertools
import json
import math
import random
from dataclasses import replace
from pathlib import Path

import pytest

from appliance.tuning.budget import budget_from_log
from appliance.tuning.calculator import Launch, size_pools
from appliance.tuning.geometry import load_geometry
from appliance.tuning.profiles import BUILTIN, K, LengthDistribution, M, builtin_profile
from appliance.tuning.recommend import (
    RecommendError,
    capacity,
    curve,
    ratio_grid,
    recommend,
)
from tests.conftest import run_cli
from tests.test_server import write_config

DATA = Path(__file__).parent / "data"
K3 = load_geometry(DATA / "tuning" / "kimi-k3.config.json")
_budget = budget_from_log((DATA / "engine_logs" / "k3_startup.sample.log").read_text())
assert _budget is not None
BUDGET = _budget.bytes          # ~52.4 GiB per GPU: what the sample K3 startup measured
LAUNCH = Launch()               # TP8, DCP8, fp8 KV, fp32 SSM, no speculative decoding
CAPPED = replace(LAUNCH, max_running_requests=64)  # the sample log's own launch
GRID = ratio_grid()
AGENT = builtin_profile("coding-agent")
CHAT = builtin_profile("chat")
DOCS = builtin_profile("long-document")
assert AGENT and CHAT and DOCS


def test_grid_is_fine_and_geometric() -> None:
    assert GRID[0] == 0.02 and GRID[-1] == 50
    steps = [b / a for a, b in itertools.pairwise(GRID)]
    assert max(steps) < 1.035 and min(steps) > 1.0  # ~2.4 % steps, strictly increasing


def test_capacity_is_the_documented_model() -> None:
    sizing = size_pools(K3, LAUNCH, BUDGET, 0.9)
    cap = capacity(sizing, AGENT.lengths)
    assert cap.state_limit == sizing.max_running_requests == sizing.max_mamba_cache_size // 5
    assert cap.kv_limit == math.floor(sizing.logical_tokens / AGENT.lengths.mean())
    assert cap.concurrent == min(cap.state_limit, cap.kv_limit)
    assert cap.fits_longest and cap.binding == "state"   # DCP8 makes K3's KV pool huge
    assert cap.logical_tokens == sizing.mla_rows_per_rank * 8
    # A request longer than the whole KV pool: nothing fits, and KV is the pool to blame.
    huge = LengthDistribution.of([(50, 1_000), (100, sizing.logical_tokens + 1)])
    none = capacity(sizing, huge)
    assert (none.concurrent, none.fits_longest, none.binding) == (0, False, "kv")


@pytest.mark.parametrize("profile", BUILTIN, ids=lambda p: p.name)
@pytest.mark.parametrize("launch", [LAUNCH, CAPPED], ids=["plain", "capped64"])
def test_curve_shapes_and_capacity_never_exceeds_a_limit(profile: object, launch: Launch) -> None:
    assert hasattr(profile, "lengths")
    points = curve(K3, launch, BUDGET, profile.lengths, GRID)  # type: ignore[attr-defined]
    assert len(points) == len(GRID)
    for a, b in itertools.pairwise(points):
        assert b.state_limit >= a.state_limit     # more ratio: never fewer state slots
        assert b.kv_limit <= a.kv_limit           # ... nor more KV
    for p in points:
        assert p.concurrent <= p.state_limit and p.concurrent <= p.kv_limit
        assert p.concurrent in (0, min(p.state_limit, p.kv_limit))


@pytest.mark.parametrize("profile", BUILTIN, ids=lambda p: p.name)
def test_recommendation_is_the_best_grid_point_and_the_lowest_among_equals(
        profile: object) -> None:
    lengths = profile.lengths  # type: ignore[attr-defined]
    rec = recommend(K3, LAUNCH, BUDGET, lengths, target_concurrency=8, current_ratio=0.9)
    points = curve(K3, LAUNCH, BUDGET, lengths, GRID)
    best = rec.recommended.concurrent
    assert best >= max(p.concurrent for p in points)
    assert all(p.concurrent < best for p in points if p.ratio < rec.ratio)
    # The recommendation is what the calculator says at that ratio.
    again = capacity(size_pools(K3, LAUNCH, BUDGET, rec.ratio), lengths)
    assert again == rec.recommended and rec.sizing.ratio == rec.ratio
    assert rec.gain == best - rec.current.concurrent
    assert rec.meets_target == (best >= 8)
    json.dumps(rec.to_dict())  # the API and --json can print it as is


@pytest.mark.parametrize("profile", BUILTIN, ids=lambda p: p.name)
def test_balanced_ratio_lies_where_the_curves_cross(profile: object) -> None:
    lengths = profile.lengths  # type: ignore[attr-defined]
    rec = recommend(K3, LAUNCH, BUDGET, lengths, target_concurrency=1, current_ratio=0.9)
    assert rec.balanced_ratio is not None
    points = curve(K3, LAUNCH, BUDGET, lengths, GRID)
    crossings = [(a.ratio, b.ratio) for a, b in itertools.pairwise(points)
                 if a.state_limit < a.kv_limit and b.state_limit >= b.kv_limit]
    assert len(crossings) == 1
    low, high = crossings[0]
    assert low < rec.balanced_ratio <= high
    # The state limit has reached the KV limit there, and not at the 3-digit ratio before it.
    at = capacity(size_pools(K3, LAUNCH, BUDGET, rec.balanced_ratio), lengths)
    assert at.state_limit >= at.kv_limit
    step = 10 ** (math.floor(math.log10(rec.balanced_ratio)) - 2)
    below = capacity(size_pools(K3, LAUNCH, BUDGET, rec.balanced_ratio - step), lengths)
    assert below.state_limit < below.kv_limit


def _random_lengths(rng: random.Random) -> LengthDistribution:
    tokens = sorted(rng.randint(200, 700 * K) for _ in range(4))
    return LengthDistribution.of(list(zip((25, 50, 90, 100), tokens, strict=True)),
                                 minimum=rng.randint(1, tokens[0]))


@pytest.mark.parametrize("launch", [LAUNCH, CAPPED], ids=["plain", "capped64"])
def test_longer_workloads_never_get_a_higher_ratio(launch: Launch) -> None:
    rng = random.Random(5)
    shapes = [p.lengths for p in BUILTIN] + [_random_lengths(rng) for _ in range(4)]
    for lengths in shapes:
        previous = math.inf
        for factor in (0.25, 0.5, 1, 1.5, 2, 4):
            rec = recommend(K3, launch, BUDGET, lengths.scaled(factor), target_concurrency=16,
                            current_ratio=0.9)
            assert rec.ratio <= previous, (lengths.describe(), factor)
            previous = rec.ratio


def test_words_for_k3_profiles() -> None:
    agent = recommend(K3, LAUNCH, BUDGET, AGENT.lengths, target_concurrency=32,
                      current_ratio=0.9)
    assert agent.ratio > 0.9 and agent.binding == "state" and agent.gain > 0
    assert agent.summary.startswith(
        f"ratio 0.9 fits {agent.current.concurrent} concurrent requests averaging 72K tokens "
        f"(longest 400K); ratio {agent.ratio:g} fits {agent.recommended.concurrent} "
        f"(+{agent.gain})")
    assert "target 32: met" in agent.summary
    assert agent.gives_up.startswith("KV capacity drops from 16M to")
    assert "1M context" in agent.gives_up  # a single 1M request still fits

    docs = recommend(K3, LAUNCH, BUDGET, DOCS.lengths, target_concurrency=4, current_ratio=0.9)
    assert docs.ratio < 0.9 and docs.current.binding == "kv"
    assert docs.gives_up.startswith("the most requests the state pool admits at once drops "
                                    f"from {docs.current.state_limit} to")

    chat = recommend(K3, LAUNCH, BUDGET, CHAT.lengths, target_concurrency=256,
                     current_ratio=0.9)
    assert not chat.meets_target and chat.target_range is None
    assert "target 256: not met" in chat.summary
    assert chat.gives_up.startswith("the longest single request it can hold drops from 1M to")

    same = recommend(K3, LAUNCH, BUDGET, AGENT.lengths, target_concurrency=32,
                     current_ratio=agent.ratio)
    assert same.gain == 0 and same.gives_up == "nothing: it is the current setting"
    assert "already the best ratio" in same.summary


def test_a_running_request_cap_is_named_and_lifting_it_is_priced() -> None:
    rec = recommend(K3, CAPPED, BUDGET, CHAT.lengths, target_concurrency=256,
                    current_ratio=0.9)
    assert rec.recommended.concurrent == 64
    assert rec.recommended.state_limited_by == "requested"
    # The lowest ratio that reaches the cap: everything above only starves KV.
    assert rec.ratio < 0.9 and rec.gain == 0
    assert "fits the same 64" in rec.summary and "--max-running-requests 64 binds" in rec.summary
    assert rec.gives_up.startswith("nothing: the state slots it drops were unused")
    assert rec.cap_note.startswith("--max-running-requests 64 holds it at 64: with "
                                   "--max-running-requests")
    uncapped = recommend(K3, LAUNCH, BUDGET, CHAT.lengths, target_concurrency=256,
                         current_ratio=0.9)
    assert f"it would fit {uncapped.recommended.concurrent}" in rec.cap_note


def test_a_pin_is_offered_when_no_ratio_on_the_grid_matches_it() -> None:
    # Ratios of 4 and more give coding agents too little KV: the best of them is KV-bound.
    rec = recommend(K3, LAUNCH, BUDGET, AGENT.lengths, target_concurrency=32,
                    current_ratio=0.9, grid=[4.0, 8.0])
    assert rec.ratio == 4.0 and rec.binding == "kv" and rec.balanced_ratio is None
    assert rec.pin is not None and rec.pin_capacity is not None
    assert rec.pin % 5 == 0  # whole requests of 5 slots each
    assert rec.pin_capacity.concurrent > rec.recommended.concurrent
    pinned = size_pools(K3, replace(LAUNCH, max_mamba_cache_size=rec.pin), BUDGET, 1.0)
    assert capacity(pinned, AGENT.lengths) == rec.pin_capacity
    assert rec.pin_note.startswith(f"pinning --max-mamba-cache-size {rec.pin} ")
    # On the fine grid the ratio gets within a request of the exact optimum: no pin needed.
    fine = recommend(K3, LAUNCH, BUDGET, AGENT.lengths, target_concurrency=32,
                     current_ratio=0.9)
    assert fine.pin is None or (fine.pin_capacity is not None and (
        fine.pin_capacity.concurrent <= fine.recommended.concurrent + 1))


def test_a_pinned_launch_is_the_current_capacity() -> None:
    pinned = replace(LAUNCH, max_mamba_cache_size=100)
    rec = recommend(K3, pinned, BUDGET, AGENT.lengths, target_concurrency=32, current_ratio=0.9)
    assert rec.current.state_limit == 20  # 100 slots / 5 per request, whatever the ratio
    assert "the current pin (--max-mamba-cache-size 100) fits 20" in rec.summary
    free = recommend(K3, LAUNCH, BUDGET, AGENT.lengths, target_concurrency=32,
                     current_ratio=0.9)
    assert rec.ratio == free.ratio  # the sweep ignores the pin


def test_the_day_one_split_without_dcp() -> None:
    """Ratio 5 on TP8 without DCP leaves a few hundred K tokens of KV: coding agents' longest
    requests do not fit at all, and the words say why."""
    no_dcp = replace(LAUNCH, dcp=1, kv_dtype="bf16")
    rec = recommend(K3, no_dcp, BUDGET, AGENT.lengths, target_concurrency=32, current_ratio=5)
    assert rec.current.concurrent == 0 and not rec.current.fits_longest
    assert rec.ratio < 1 and rec.recommended.concurrent > 0
    assert ", as its 332K-token KV pool cannot hold the longest; ratio" in rec.summary


def test_no_fit_and_no_budget() -> None:
    beyond = LengthDistribution.of([(50, 64 * K), (100, 40 * M)])
    rec = recommend(K3, LAUNCH, BUDGET, beyond, target_concurrency=1, current_ratio=0.9)
    assert rec.recommended.concurrent == 0 and rec.ratio == GRID[0]  # the most KV
    assert rec.summary.startswith("no ratio holds the longest request (40M tokens)")
    with pytest.raises(RecommendError) as caught:
        recommend(K3, LAUNCH, 1 << 20, AGENT.lengths, target_concurrency=1, current_ratio=0.9)
    assert caught.value.code == "tuning_impossible" and caught.value.hint


# --- `appliance tune recommend` / `tune profiles`, as real subprocesses ------------------------

CONFIG = DATA / "tuning" / "kimi-k3.config.json"
LOG = DATA / "engine_logs" / "k3_startup.sample.log"


@pytest.fixture
def box(tmp_path: Path) -> Path:
    """A configuration whose state directory has no database (never migrated)."""
    return write_config(tmp_path / "box")


def tune(box: Path, *args: str) -> tuple[int, str, str]:
    result = run_cli("--config", str(box), "tune", *args)
    return result.returncode, result.stdout, result.stderr


def test_cli_recommend_json_from_the_sample_log(box: Path) -> None:
    code, out, err = tune(box, "recommend", "--profile", "coding-agent", "--model-config",
                          str(CONFIG), "--from-log", str(LOG), "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["profile"]["name"] == "coding-agent" and data["budget"]["measured"] is True
    assert data["launch"]["max_running_requests"] == 64  # the logged run's own launch
    rec = data["recommendation"]
    assert rec["current_ratio"] == 0.9  # engine.mamba_full_memory_ratio, not the log's 0.5
    assert rec["recommended"]["concurrent"] == 64 and rec["ratio"] < 0.9
    for key in ("balanced_ratio", "binding", "gain", "gives_up", "summary", "pin", "sizing"):
        assert key in rec
    assert not (box.parent / "state" / "appliance.db").exists()  # no database was created


@pytest.mark.parametrize("profile", [p.name for p in BUILTIN])
def test_cli_recommend_text_for_each_builtin(box: Path, profile: str) -> None:
    code, out, err = tune(box, "recommend", "--profile", profile, "--model-config",
                          str(CONFIG), "--budget-gib", "52.38", "--current-ratio", "5")
    assert code == 0, err
    assert f"profile {profile} (" in out
    for label in ("recommended ratio", "current ratio            5 ", "balanced ratio",
                  "gives up:", "ratio 5 fits"):
        assert label in out


def test_cli_errors_name_the_next_step(box: Path) -> None:
    code, _, err = tune(box, "recommend", "--profile", "chat", "--budget-gib", "50")
    assert code == 64
    assert "config.json does not exist" in err and "--model-config" in err
    code, _, err = tune(box, "recommend", "--profile", "nope", "--model-config", str(CONFIG),
                        "--budget-gib", "50")
    assert code == 65 and "'nope' is not a built-in profile" in err
    assert "appliance migrate" in err


def test_cli_profiles_and_a_custom_profile_from_the_database(box: Path) -> None:
    code, out, err = tune(box, "profiles")
    assert code == 0, err
    assert [line.split()[0] for line in out.splitlines()[1:5]] == [p.name for p in BUILTIN]
    assert "custom profiles not shown" in out
    code, out, _ = tune(box, "profiles", "chat", "--json")
    assert code == 0 and json.loads(out)["lengths"]["max"] == 32 * K

    assert run_cli("--config", str(box), "migrate").returncode == 0
    from appliance.config import load_config
    from appliance.db.database import Database
    from appliance.tuning.store import create_profile

    db = Database(load_config(box, env={}).database_url)
    lengths = LengthDistribution.of([(50, 30_000), (100, 120_000)], minimum=1_000)
    db.call(lambda s: create_profile(s, name="nightly-evals", title="Nightly evals",
                                     description="", lengths=lengths, target_concurrency=100,
                                     at=dt.datetime.now(dt.UTC), by="test"))
    db.dispose()
    code, out, err = tune(box, "profiles")
    assert code == 0, err
    assert any(line.split()[:2] == ["nightly-evals", "custom"] for line in out.splitlines())
    assert "custom profiles not shown" not in out
    code, out, err = tune(box, "recommend", "--profile", "nightly-evals", "--model-config",
                          str(CONFIG), "--budget-gib", "52.38", "--json")
    assert code == 0, err
    assert json.loads(out)["recommendation"]["target_concurrency"] == 100
