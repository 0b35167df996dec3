"""Capacity planning for a cell and tuning per role (issue 17).

Pure: a prefill box is sized for the few requests it prefills at once (not the profile's
concurrency), a decode box like a unified one, and a unified box exactly as before; the RAM
plan's verdicts (a host cache that fits beside the weights, one that squeezes them, one SGLang
would refuse); the planner's mixes and its measured/predicted labels (this box's qualification,
the field figures, the model). Then on a live daemon: `GET /api/v1/cell/plan` as a viewer,
before and after a qualification is in the ledger; `appliance cell plan`'s table; the Tuning
page of a prefill box; and the prewarm stating the RAM plan.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import re
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import jinja2
import psutil
import pytest

from appliance.auth.accounts import create_admin
from appliance.cell.plan import (
    DEFAULT_MIXES,
    FIELD_K3,
    MAX_BOXES,
    Mix,
    PlanInputError,
    PlanInputs,
    Point,
    cache_hit,
    decode_rate,
    measured_point,
    measured_prefill_rate,
    parse_mix,
    parse_mixes,
    plan_cell,
)
from appliance.cell.plan_cli import add_plan_parser, run_plan
from appliance.cell.role_choice import store_role
from appliance.clock import SystemClock
from appliance.config import Config
from appliance.db.database import Database
from appliance.db.journal import list_events
from appliance.db.schema import migrate
from appliance.qualify import ledger, plan
from appliance.qualify.verdict import Sample, judge, qualified_point, round_of, verdict_words
from appliance.resources import migrations_dir, templates_dir
from appliance.runtime import Runtime, build_runtime
from appliance.testing.fake_gpus import FakeGpus
from appliance.tuning.budget import budget_from_log
from appliance.tuning.calculator import Launch
from appliance.tuning.geometry import load_geometry
from appliance.tuning.profiles import BUILTIN, builtin_profile
from appliance.tuning.recommend import recommend
from appliance.tuning.roles import (
    DEFAULT_CHUNKED_PREFILL,
    PREFILL_PIPELINE,
    prefill_concurrency,
    request_shape,
    role_target,
)
from appliance.ui.templating import filters
from appliance.weights.ram_plan import (
    HOST_RESERVE_BYTES,
    HostCache,
    host_cache_size,
    plan_ram,
)
from tests.conftest import PASSWORD, Console, LiveServer, make_config, problem
from tests.test_tuning_api import write_k3
from tests.test_weights_pull import box as weights_box
from tests.test_weights_pull import hub, pulled, repo  # noqa: F401 - fixtures for the prewarm

DATA = Path(__file__).parent / "data"
K3 = load_geometry(DATA / "tuning" / "kimi-k3.config.json")
_budget = budget_from_log((DATA / "engine_logs" / "k3_startup.sample.log").read_text())
assert _budget is not None
BUDGET = _budget.bytes
TB = 10**12
NOW = dt.datetime(2026, 12, 8, 9, 30, tzinfo=dt.UTC)


# --- tuning per role (pure) -------------------------------------------------------------------


@pytest.mark.parametrize("profile", BUILTIN, ids=lambda p: p.name)
def test_unified_and_decode_recommend_exactly_as_a_box_alone(profile: object) -> None:
    assert hasattr(profile, "lengths")
    p = profile
    plain = recommend(K3, Launch(), BUDGET, p.lengths,  # type: ignore[attr-defined]
                      target_concurrency=p.target_concurrency,  # type: ignore[attr-defined]
                      current_ratio=0.9)
    for role in ("unified", "decode"):
        target = role_target(role, p.lengths, p.target_concurrency)  # type: ignore[attr-defined]
        assert target.max_running_requests is None
        assert target.concurrency == p.target_concurrency  # type: ignore[attr-defined]
        tuned = recommend(K3, Launch(), BUDGET, p.lengths,  # type: ignore[attr-defined]
                          target_concurrency=p.target_concurrency,  # type: ignore[attr-defined]
                          current_ratio=0.9, role=target)
        assert tuned.role == target and tuned.to_dict()["role"]["role"] == role
        assert {k: v for k, v in tuned.to_dict().items() if k != "role"} == \
            {k: v for k, v in plain.to_dict().items() if k != "role"}


@pytest.mark.parametrize("name", ["coding-agent", "chat", "balanced", "long-document"])
def test_a_prefill_box_is_sized_for_its_few_prefills_with_the_rest_to_kv(name: str) -> None:
    profile = builtin_profile(name)
    assert profile is not None
    target = role_target("prefill", profile.lengths, profile.target_concurrency)
    prompt, answer = request_shape(profile.lengths)
    assert answer <= 1000 and prompt > answer  # a ninth is answer, as qualification splits
    per_batch = max(1, int(DEFAULT_CHUNKED_PREFILL // prompt))
    assert target.concurrency == per_batch * PREFILL_PIPELINE == target.max_running_requests
    assert target.concurrency < 64 and "chunked-prefill-size" in target.basis
    decode = recommend(K3, Launch(), BUDGET, profile.lengths,
                       target_concurrency=profile.target_concurrency, current_ratio=0.9,
                       role=role_target("decode", profile.lengths, profile.target_concurrency))
    prefill = recommend(K3, Launch(), BUDGET, profile.lengths,
                        target_concurrency=profile.target_concurrency, current_ratio=0.9,
                        role=target)
    # Holds every request it prefills (and the longest prompt), with far more KV than a
    # decode box keeps, at a lower ratio: the state pool is all a decode box is short of.
    assert prefill.recommended.concurrent == target.concurrency and prefill.meets_target
    assert prefill.recommended.fits_longest
    assert prefill.ratio < decode.ratio
    assert prefill.recommended.logical_tokens > decode.recommended.logical_tokens
    assert prefill.target_concurrency == target.concurrency
    assert prefill.recommended.state_limited_by == "requested"  # --max-running-requests holds


def test_the_prefill_batch_follows_the_chunk_budget_and_the_prompts() -> None:
    chat = builtin_profile("chat")
    agent = builtin_profile("coding-agent")
    assert chat and agent
    assert prefill_concurrency(chat.lengths, 4096) < prefill_concurrency(chat.lengths, 65536)
    assert prefill_concurrency(agent.lengths, 16384) == PREFILL_PIPELINE  # one long prompt
    bigger = role_target("prefill", chat.lengths, 256, chunked_prefill=65536)
    assert bigger.concurrency > role_target("prefill", chat.lengths, 256).concurrency
    assert "--chunked-prefill-size" in bigger.basis and "default" not in bigger.basis
    with pytest.raises(ValueError, match="not a cell role"):
        role_target("router", chat.lengths, 256)


# --- the RAM plan (pure) ----------------------------------------------------------------------


def test_the_host_cache_is_the_ratio_times_the_gpu_pools_and_sglangs_default_fits_ram() -> None:
    pools = 31 * 10**9  # per rank
    explicit = host_cache_size(pools, 8, 12.0, 4 * TB)
    assert explicit.bytes == 12 * pools * 8 and explicit.configured == 12.0
    assert "--hicache-ratio 12" in explicit.basis
    roomy = host_cache_size(pools, 8, None, 4 * TB)  # SGLang's 2.0 fits: taken as is
    assert roomy.ratio == 2.0 and roomy.bytes == 2 * pools * 8 and roomy.configured is None
    tight = host_cache_size(pools, 8, 0.0, 400 * 10**9)  # 0: unset, lowered to fit the RAM
    assert tight.ratio < 2.0 and "lowered" in tight.basis
    assert tight.bytes <= (400 * 10**9 - HOST_RESERVE_BYTES) * 0.8 * 0.95 + 8


def test_the_ram_plan_says_what_each_gets() -> None:
    weights = 1_560 * 10**9
    fits = plan_ram(4 * TB, weights, HostCache(3 * TB // 2, 6.0, 6.0, "given"))
    assert fits.verdict == "fits" and fits.cold_bytes == 0 and fits.prewarm
    assert fits.sentence == "host cache 1.50 TB, weights prewarm 1.56 TB of 4.00 TB RAM: both fit"
    squeezed = plan_ram(4 * TB, weights, HostCache(3 * TB, 12.0, 12.0, "given"))
    assert squeezed.verdict == "squeezed" and squeezed.prewarm  # the load still reads memory
    left = 4 * TB - HOST_RESERVE_BYTES - 3 * TB
    assert squeezed.warm_bytes == left and squeezed.cold_bytes == weights - left
    assert squeezed.cold_percent == round(100 * (weights - left) / weights) == 37
    assert "leaves 989.26 GB of 4.00 TB RAM" in squeezed.sentence
    assert "37% of the weights (570.74 GB) go cold" in squeezed.sentence
    refused = plan_ram(4 * TB, weights, HostCache(5 * TB, 20.0, 20.0, "given"))
    assert refused.verdict == "refused" and "refuse to start" in refused.sentence
    none = plan_ram(4 * TB, weights, None)
    assert none.verdict == "no_cache" and none.cold_bytes == 0
    assert none.sentence == "no host cache: the weights prewarm (1.56 TB) has the 4.00 TB of RAM"
    small = plan_ram(TB, weights, None)
    assert not small.prewarm and "no prewarm" in small.sentence
    for p in (fits, squeezed, refused, none, small):
        assert p.warm_bytes + p.cold_bytes == weights
        assert json.dumps(p.to_dict())  # the API's answer


# --- the planner (pure) -----------------------------------------------------------------------


def test_mixes_are_parsed_bounded_and_the_defaults_come_first() -> None:
    assert parse_mix("1U") == Mix(unified=1) and parse_mix(" 1p + 3d ") == Mix(0, 1, 3)
    assert [m.label for m in parse_mixes(())] == ["1 unified", "1P+1D", "1P+2D", "2 unified"]
    assert len(parse_mixes(())) == len(DEFAULT_MIXES)
    assert parse_mixes(["1P+3D,3U", "1P+1D"])[4:] == (Mix(0, 1, 3), Mix(unified=3))
    for bad in ("", "1P", "0U", "1P+0D", "2 boxes", f"1P+{MAX_BOXES}D", "1U;rm"):
        with pytest.raises(PlanInputError) as refused:
            parse_mix(bad)
        assert refused.value.status == 422 and refused.value.hint
    with pytest.raises(PlanInputError, match="at most"):
        parse_mixes([f"{n}U" for n in range(3, 9)])


def inputs(**changes: object) -> PlanInputs:
    base = PlanInputs(
        profile="balanced", profile_title="Balanced", prompt_tokens=8192, output_tokens=1000,
        floor=32.0, unified_capacity=150, prefill_fits=True, prefill_rate=20_000,
        prefill_rate_basis="assumed", decode_rate=2048.0, decode_rate_basis="field",
        budget_basis="budget measured")
    return PlanInputs(**{**base.__dict__, **changes})  # type: ignore[arg-type]


def test_without_a_measurement_every_figure_is_predicted_and_the_model_holds_together() -> None:
    result = plan_cell(inputs(), parse_mixes(["1P+3D"]))
    rows = {r.mix.label: r for r in result.rows}
    for row in result.rows:
        for f in (row.users, row.output_tps, row.ttft_seconds):
            assert f.kind == "predicted" and f.model is None
        users, output = row.users.value, row.output_tps.value
        assert users is not None and output is not None
        assert 0 < output <= users * 32 + 1e-6  # nobody above the floor is counted
    one, two = rows["1 unified"], rows["2 unified"]
    assert two.users.value == 2 * (one.users.value or 0)
    pair, more = rows["1P+1D"], rows["1P+2D"]
    # 8K prompts: one prefill box feeds 68 users, a decode box holds 64 at 32 tokens/s.
    assert pair.users.value == 64 and "speed" in pair.limited_by
    assert more.users.value == 68 and "prefill" in more.limited_by
    assert rows["1P+3D"].users.value == more.users.value  # a third decode box adds nothing
    assert (pair.output_tps.value or 0) > (one.output_tps.value or 0)  # P/D beats one box
    assert (more.ttft_seconds.value or 0) > (pair.ttft_seconds.value or 0)  # prefill busier
    assert "8,192 tokens in" in result.basis and "20,000 prompt tokens/s" in result.basis
    body = result.to_dict()
    assert [m["mix"] for m in body["mixes"]][:4] == ["1 unified", "1P+1D", "1P+2D", "2 unified"]
    assert body["assumptions"] and json.dumps(body)


def test_without_a_decode_speed_memory_and_prefill_limit_and_say_so() -> None:
    result = plan_cell(inputs(decode_rate=None, unified_capacity=20,
                              decode_rate_basis="no qualification yet"), parse_mixes(()))
    rows = {r.mix.label: r for r in result.rows}
    assert rows["1P+1D"].users.value == 20 and "memory" in rows["1P+1D"].limited_by
    assert "speed unknown (no qualification yet)" in result.basis
    blocked = plan_cell(inputs(prefill_fits=False), parse_mixes(()))
    pd = {r.mix.label: r for r in blocked.rows}["1P+1D"]
    assert pd.users.value == 0 and "longest prompt" in pd.limited_by


def measured_record(floor: float = 32.0) -> ledger.Record:
    def sample(rate: float) -> Sample:
        return Sample(0.0, 0.5, 0.5 + 99 / rate, 100, 512, (1 / rate,) * 99)

    steps = tuple(judge(c, [round_of(c, 1, [sample(r)] * c, 4.0)], floor=floor,
                        ttft_p90_max=None, repeats=1)
                  for c, r in ((1, 60.0), (2, 45.0), (4, 40.0), (8, 20.0)))
    point = qualified_point(steps)
    return ledger.Record(7, "a" * 64, "done", NOW, NOW, "alice", "0.5.23", "ratio 0.9",
                         plan.Settings(plan.harsh(512, 100), (1, 2, 4, 8), floor=floor,
                                       repeats=1),
                         steps, point, verdict_words(point, floor, None, steps), "")


def test_a_qualification_makes_the_unified_figures_measured_and_the_rest_scale_from_it() -> None:
    record = measured_record()
    point = measured_point(record, 32.0)
    assert point is not None and point.users == 4 and point.floor_held
    assert point.output_tps == record.steps[2].mean("output_tps")
    assert point.ttft_seconds == 0.5 and "qualification #7" in point.source
    assert measured_prefill_rate(record) == 512 / 0.5  # one user's prompt over its TTFT
    assert measured_point(record, 40.0) is None  # it held 32, not 40: not a measure at 40
    result = plan_cell(inputs(measured=point), parse_mixes(()))
    rows = {r.mix.label: r for r in result.rows}
    one = rows["1 unified"]
    for f in (one.users, one.output_tps, one.ttft_seconds):
        assert f.kind == "measured" and "qualification #7" in f.basis and f.model is not None
    assert one.users.value == 4
    two = rows["2 unified"]
    assert two.users.kind == "predicted" and two.users.value == 8
    assert two.users.basis.startswith("2 x the figure of one box")
    assert rows["1P+1D"].users.kind == "predicted"  # no pair measured on this box


def test_the_field_figures_are_cited_beside_the_rows_never_in_them() -> None:
    result = plan_cell(inputs(field=FIELD_K3), parse_mixes(["1P+3D"]))
    for row in result.rows:  # measured elsewhere, on another workload: not this profile's
        assert all(f.kind == "predicted" for f in (row.users, row.output_tps, row.ttft_seconds))
    cited = [r.to_dict() for r in result.references]
    assert [(r["mix"], r["users"], r["output_tps"], r["floor_held"]) for r in cited] == [
        ("1 unified", 64, 552.0, False), ("1P+1D", 64, 1163.0, True)]
    assert all(r["kind"] == "measured" and "in the field" in r["basis"]
               and "issue" not in r["basis"] and "not on this box" in r["basis"] for r in cited)
    assert plan_cell(inputs(), parse_mixes(())).references == ()
    mine = Point(8, 300.0, 1.0, True, 32.0, "measured on this box")
    both = plan_cell(inputs(field=FIELD_K3, measured=mine), parse_mixes(()))
    assert {r.mix.label: r for r in both.rows}["1 unified"].output_tps.value == 300.0


def test_prefix_cache_hits_measured_on_this_box_make_prefill_cheaper() -> None:
    def record(prompt: int, cached: int) -> SimpleNamespace:
        return SimpleNamespace(prompt_tokens=prompt, completion_tokens=100,
                               cached_tokens=cached, started_at=NOW)

    few, basis = cache_hit([record(1000, 900)] * 10)
    assert few == 0.0 and "10 requests recorded" in basis
    share, basis = cache_hit([record(1000, 900)] * 60)
    assert share == pytest.approx(0.9) and "60 requests" in basis
    assert cache_hit([record(1000, 1000)] * 60)[0] < 1  # never free
    agent = inputs(prompt_tokens=72_000)
    cold = {r.mix.label: r for r in plan_cell(agent, parse_mixes(())).rows}
    warm_inputs = inputs(prompt_tokens=72_000, cache_hit=share, cache_hit_basis=basis)
    warm_plan = plan_cell(warm_inputs, parse_mixes(()))
    warm = {r.mix.label: r for r in warm_plan.rows}
    assert "prefill" in cold["1P+2D"].limited_by  # 72K prompts, none cached: prefill binds
    assert (warm["1P+2D"].users.value or 0) > 5 * (cold["1P+2D"].users.value or 0)
    assert (warm["1P+1D"].ttft_seconds.value or 0) < (cold["1P+1D"].ttft_seconds.value or 0)
    assert "90% of each prompt found in the prefix cache (measured on this box" in \
        warm_plan.basis


def render_plan(**context: object) -> str:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(templates_dir()), autoescape=True)
    env.filters.update(filters())
    return env.get_template("partials/cell_plan.html").render(**context)


def test_the_cell_pages_partial_shows_each_figure_with_its_label_and_basis() -> None:
    mine = Point(8, 300.0, 1.25, True, 32.0, "measured on this box: qualification #3")
    html = render_plan(plan=plan_cell(inputs(measured=mine, field=FIELD_K3),
                                      parse_mixes(["1P+3D"])), plan_problem=None)
    rows = re.findall(r"<tr><th scope=\"row\">(.*?)</th>(.*?)</tr>", html, re.S)
    assert [label for label, _ in rows] == ["1 unified", "1P+1D", "1P+2D", "2 unified", "1P+3D"]
    one = dict(rows)["1 unified"]
    assert "300" in one and "1.2 s" in one and one.count(">measured<") == 3
    assert "Measured elsewhere:</strong> 1P+1D served 1,163 output tokens/s at 64 users" in html
    assert "model:" in one  # the prediction beside the measurement
    assert ">predicted<" in dict(rows)["1P+2D"] and ">measured<" not in dict(rows)["1P+2D"]
    assert "Measured:</strong> measured on this box: qualification #3." in html
    assert "Predicted:</strong> 2 x the figure of one box" in html
    assert "Predicted:</strong> predicted from the tuning model" in html
    assert "The model assumes: every box is like this one" in html
    problem_html = render_plan(plan=None, plan_problem=PlanInputError("no model", "pull it"))
    assert "The plan cannot be computed yet: no model" in problem_html
    assert "What to do: pull it" in problem_html


def test_a_decode_box_speed_is_its_throughput_not_users_times_the_floor() -> None:
    one = Point(32, 2387.0, 0.8, True, 32.0, "measured on this box: qualification #5")
    rate, basis = decode_rate(one, FIELD_K3)
    assert rate == 2387.0 and "2,387 tokens/s this box sustained at its 32" in basis
    field_rate, field_basis = decode_rate(None, FIELD_K3)
    assert field_rate == 1163.0 and "issue" not in field_basis
    decoding = Point(48, 3100.0, None, True, 32.0, "measured on this box: qualification #9")
    assert decode_rate(one, FIELD_K3, decoding) == (
        3100.0, "3,100 tokens/s sustained by a decode box at 48 users (measured on this box: "
        "qualification #9)")


def test_more_boxes_never_predict_less_than_the_measured_box_without_saying_why() -> None:
    """The issue's page: one box measured at 32 users and 2,387 tokens/s beside 1P+2D
    predicted at 64 users and 2,045 tokens/s, three boxes below one. With the decode speed a
    throughput, the pair and the 1P+2D serve more; where the model still limits a mix below
    the measured box (a slow assumed prefill), its row says so."""
    one = Point(32, 2387.0, 0.8, True, 32.0, "measured on this box: qualification #5")
    rate, basis = decode_rate(one, None)
    result = plan_cell(inputs(measured=one, decode_rate=rate, decode_rate_basis=basis,
                              unified_capacity=94, prefill_rate=60_000), parse_mixes(()))
    rows = {r.mix.label: r for r in result.rows}
    for label in ("1P+2D", "2 unified"):
        users, output = rows[label].users.value or 0, rows[label].output_tps.value or 0
        assert users >= 32 and output >= 2387.0, (label, users, output)
        assert "below the one box" not in rows[label].limited_by
    # one decode box at the measured box's speed, less the users' waits for their first
    # token: a hair below one box, and said so
    pair = rows["1P+1D"]
    assert (pair.users.value or 0) > 32 and (pair.output_tps.value or 0) < 2387.0
    assert "in output tokens/s" in pair.limited_by and "only a lower bound" in pair.limited_by
    slow = plan_cell(inputs(measured=one, decode_rate=rate, decode_rate_basis=basis,
                            prefill_rate=2_000, unified_capacity=94), parse_mixes(()))
    pair = {r.mix.label: r for r in slow.rows}["1P+1D"]
    assert (pair.users.value or 0) < 32 and "in users and output tokens/s" in pair.limited_by
    assert "below the one box measured here (32 users, 2,387 tokens/s)" in pair.limited_by
    assert "prefill" in pair.limited_by and "trust the measured box" in pair.limited_by


def test_before_a_qualification_the_page_says_every_figure_is_the_models() -> None:
    html = render_plan(plan=plan_cell(inputs(field=FIELD_K3), parse_mixes(())),
                       plan_problem=None)
    assert "Predicted only:</strong> nothing in this table is measured on this box yet" in html
    assert "issue 17" not in html and "(issue" not in html
    one = dict(re.findall(r"<tr><th scope=\"row\">(.*?)</th>(.*?)</tr>", html, re.S))[
        "1 unified"]
    assert "nothing is measured on this box yet" in one  # each figure's own basis says so
    measured = render_plan(plan=plan_cell(inputs(measured=Point(
        8, 300.0, 1.0, True, 32.0, "measured on this box")), parse_mixes(())), plan_problem=None)
    assert "Predicted only" not in measured


# --- on a live daemon -------------------------------------------------------------------------


@pytest.fixture
def prefill_box(tmp_path: Path) -> Iterator[tuple[Config, Database]]:
    """A prefill member carrying a host cache of ratio 12 (the production pair's)."""
    config = make_config(tmp_path / "prefill", APPLIANCE_CELL_ROLE="prefill",
                         APPLIANCE_CELL_HIERARCHICAL_CACHE="true",
                         APPLIANCE_CELL_HICACHE_RATIO="12")
    database = Database(config.database_url)
    migrate(database, migrations_dir(), config.paths.state_dir / "backups", NOW)
    yield config, database
    database.dispose()


def viewer(runtime: Runtime, server: LiveServer) -> Console:
    runtime.db.call(lambda s: create_admin(s, "vera", PASSWORD, runtime.clock.now(),
                                           role="viewer"))
    console = Console(server.base_url)
    assert console.login("vera").status_code == 303
    return console


def qualify_unified(runtime: Runtime) -> None:
    """A finished qualification of this box's own spec (a unified box) in the ledger."""
    record = measured_record()
    spec = runtime.supervisor.current_spec().spec_hash
    opened = runtime.db.call(lambda s: ledger.open_qualification(
        s, spec_hash=spec, at=NOW, by="alice", engine_version="0.5.23", tuning="ratio 0.9",
        settings=record.settings))
    runtime.db.call(lambda s: ledger.close_qualification(
        s, opened.id, state="done", at=NOW, steps=record.steps, qualified=record.qualified,
        verdict=record.verdict))


def test_the_plan_route_answers_a_viewer_measured_once_qualified(
        runtime: Runtime, config: Config, server: LiveServer) -> None:
    from appliance.api.cell_plan import unified_spec_hash

    write_k3(config)
    console = viewer(runtime, server)
    try:
        first = console.http.get("/api/v1/cell/plan", params={"profile": "chat"})
        assert first.status_code == 200, first.text
        body = first.json()
        assert body["profile"] == "chat" and body["floor"] == 32
        assert [m["mix"] for m in body["mixes"]] == ["1 unified", "1P+1D", "1P+2D",
                                                     "2 unified"]
        assert all(f["kind"] == "predicted" for m in body["mixes"]
                   for f in (m["users"], m["output_tps"], m["ttft_seconds"]))
        assert [r["mix"] for r in body["references"]] == ["1 unified", "1P+1D"]  # K3 on 8
        assert "estimate" in body["basis"]  # no startup measured: the budget says so
        assert "no prefix-cache hits counted" in body["basis"] and body["cache_hit"] == 0

        assert unified_spec_hash(runtime) == runtime.supervisor.current_spec().spec_hash
        qualify_unified(runtime)
        again = console.http.get("/api/v1/cell/plan",
                                 params=[("profile", "chat"), ("mix", "1P+3D"), ("floor", 30)])
        assert again.status_code == 200, again.text
        rows = {m["mix"]: m for m in again.json()["mixes"]}
        assert rows["1 unified"]["users"] == {**rows["1 unified"]["users"],
                                              "kind": "measured", "value": 4}
        assert rows["1 unified"]["output_tps"]["basis"].startswith("measured on this box")
        assert "Harsh load, not this profile" in rows["1 unified"]["output_tps"]["basis"]
        assert rows["2 unified"]["users"]["value"] == 8
        assert "1P+3D" in rows and rows["1P+3D"]["decode"] == 3
        assert "qualification #" in again.json()["basis"]  # the prefill rate measured here

        problem(console.http.get("/api/v1/cell/plan", params={"mix": "9X"}), 422,
                "cell_plan_invalid")
        problem(console.http.get("/api/v1/cell/plan", params={"floor": 0}), 422,
                "cell_plan_invalid")
        problem(console.http.get("/api/v1/cell/plan", params={"profile": "nope"}), 404)
    finally:
        console.close()


def test_appliance_cell_plan_prints_the_table_with_its_labels(
        runtime: Runtime, config: Config, capsys: pytest.CaptureFixture[str]) -> None:
    write_k3(config)
    runtime.db.call(lambda s: create_admin(s, "vera", PASSWORD, NOW, role="viewer"))
    parser = argparse.ArgumentParser()
    common = argparse.ArgumentParser(add_help=False)
    add_plan_parser(parser.add_subparsers(dest="cell_command"), common)
    live = LiveServer(runtime).start()
    try:
        args = parser.parse_args(["plan", "--profile", "coding-agent", "--mix", "1P+3D"])
        assert run_plan(args, config) == 0
        out = capsys.readouterr().out
        lines = out.splitlines()
        assert lines[0].startswith("cell plan for Coding agent (coding-agent)")
        table = "\n".join(lines[2:8])
        for mix in ("1 unified", "1P+1D", "1P+2D", "2 unified", "1P+3D"):
            assert f"\n{mix} " in f"\n{table}"
        assert "(predicted)" in table and "(measured)" not in table  # not qualified yet
        assert "measured elsewhere: 1P+1D: 1,163 output tok/s at 64 users (measured in " \
            "the field on Kimi K3" in out
        assert "predicted: predicted from the tuning model" in out
        assert "assumptions: every box is like this one" in out
        assert run_plan(parser.parse_args(["plan", "--json"]), config) == 0
        body = json.loads(capsys.readouterr().out)
        assert body["profile"] == "balanced" and len(body["mixes"]) == 4
    finally:
        live.stop()


def test_the_tuning_page_of_a_prefill_box_says_what_it_tuned_for_and_the_ram_plan(
        prefill_box: tuple[Config, Database]) -> None:
    config, db = prefill_box
    write_k3(config)
    runtime = build_runtime(config, db=db, clock=SystemClock(), gpus=FakeGpus())

    async def views() -> None:
        view = await runtime.tuning.view("chat")
        assert view.role is not None and view.role.role == "prefill"
        assert view.recommendation.role == view.role
        assert view.recommendation.target_concurrency == view.role.concurrency < 256
        assert view.ram is not None and view.ram.host_cache is not None
        assert view.ram.host_cache.configured == 12.0
        assert view.ram.ram_bytes == psutil.virtual_memory().total
        assert view.ram.verdict in ("fits", "squeezed", "refused")
        assert view.to_dict()["ram_plan"]["sentence"] == view.ram.sentence
        assert await runtime.tuning.host_cache() == view.ram.host_cache
        await runtime.tuning.start_service()
        assert runtime.weights.host_cache is not None  # the prewarm states the plan

    asyncio.run(views())
    runtime.db.call(lambda s: create_admin(s, "alice", PASSWORD, NOW))
    live = LiveServer(runtime).start()
    console = Console(live.base_url)
    try:
        assert console.login().status_code == 303
        page = console.http.get("/tuning", params={"profile": "chat"})
        assert page.status_code == 200, page.text
        assert "Tuned for a prefill box" in page.text
        assert "--max-running-requests" in page.text
        assert "Host memory: the host cache against the weights" in page.text
        assert "--hicache-ratio 12" in page.text
    finally:
        console.close()
        live.stop()


def test_the_role_a_head_chose_is_the_one_tuned_for(config: Config, db: Database) -> None:
    write_k3(config)
    unified = build_runtime(config, db=db, clock=SystemClock(), gpus=FakeGpus())
    store_role(config, "prefill")  # what a head's role change leaves on the member
    prefill = build_runtime(config, db=db, clock=SystemClock(), gpus=FakeGpus())

    async def views() -> None:
        alone = await unified.tuning.view("chat")
        assert alone.role is not None and alone.role.role == "unified"
        assert alone.role.concurrency == 256 and alone.ram is None
        chosen = await prefill.tuning.view("chat")
        assert chosen.role is not None and chosen.role.role == "prefill"
        assert chosen.recommendation.ratio < alone.recommendation.ratio
        # No hierarchical cache configured: the RAM plan is the prewarm's alone.
        assert chosen.ram is not None and chosen.ram.verdict == "no_cache"
        assert await prefill.tuning.host_cache() is None

    asyncio.run(views())


def test_the_prewarm_states_the_ram_plan_and_warns_of_a_host_cache_sglang_would_refuse(
        tmp_path: Path, hub: object) -> None:  # noqa: F811 - the hub fixture
    config, db = weights_box(tmp_path / "box", hub)  # type: ignore[arg-type]
    from appliance.weights.service import WeightsService

    ram = psutil.virtual_memory().total
    sizes = iter([ram // 10, 2 * ram])

    async def host() -> HostCache:
        size = next(sizes)
        return HostCache(size, 12.0, 12.0, "--hicache-ratio 12 x the GPU pools")

    async def scenario() -> None:
        service = WeightsService(config, db, SystemClock())
        service.host_cache = host
        await pulled(service)
        lines: list[str] = []
        message = await service.prewarm_for_launch(lines.append)
        assert message is not None and "page cache warmed before the launch" in message
        assert "; RAM plan: host cache" in message and "both fit" in message
        await service.stop_service()
        later = WeightsService(config, db, SystemClock())  # a later launch, after a restart
        later.host_cache = host
        again = await later.prewarm_for_launch(lines.append)
        assert again is not None and "refuse to start" in again
        await later.stop_service()

    asyncio.run(scenario())
    warnings = db.call(lambda s: list_events(s, severity="warning", per_page=50)).items
    assert any(e.message.startswith("RAM plan: host cache") and "refuse" in e.message
               for e in warnings)
