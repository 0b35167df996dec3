"""Qualification per class (issue 24): a qualification holds a TTFT SLO (p90) beside the
decode floor, by default the interactive class's, stops at the step where the first token
comes too late, says which promise failed, and keeps both figures in the ledger; admission
takes the point as the total and each class's share caps its part of it.

The live test runs the calibrated emulator (k3-b300: 8K prompts prefill at about 0.6 s each,
one after another), so the time to first token grows with the users while every user still
decodes far above a floor of 5 tokens/s: the step that fails is the TTFT one.
"""
# ruff: noqa: F811 - pytest fixtures imported from another test module

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import pytest

from appliance.cli import build_parser
from appliance.gateway.admission import Admission
from appliance.gateway.class_gate import ClassGate
from appliance.gateway.classes import BATCH, INTERACTIVE, effective, parse_classes
from appliance.gateway.errors import GatewayError
from appliance.gateway.metrics import GatewayMetrics
from appliance.gateway.qualified import QualifiedPoint, admission_limit, point_of
from appliance.qualify import cli as qualify_cli
from appliance.qualify import ledger, plan
from appliance.qualify.climb import Climbed
from appliance.qualify.outcome import outcome
from appliance.qualify.promises import DECODE, TTFT, broken, class_ttft, ttft_for
from appliance.qualify.verdict import Round, Step, judge
from tests.conftest import Console, LiveServer, csrf
from tests.test_engine_api import wait_until
from tests.test_qualify_run import ready_box  # noqa: F401 - the fixture, given the classes

API = "/api/v1/qualify"
AT = dt.datetime(2026, 12, 2, 7, 0, tzinfo=dt.UTC)
CLASSES = {"interactive": {"ttft_slo_seconds": 1.5, "decode_floor_tps": 5}}


def a_round(concurrency: int, *, ttft_p90: float, decode_p10: float) -> Round:
    return Round(concurrency, 1, concurrency, 0, False, 10.0, 30 * concurrency, 64,
                 1.0, 1.0, ttft_p90 / 2, ttft_p90, ttft_p90, 0.01, 0.01, 0.01, decode_p10)


# -- the rules, pure --------------------------------------------------------------------------

def test_the_ttft_slo_defaults_to_the_interactive_classes_and_can_be_declined() -> None:
    configured = parse_classes(CLASSES)
    assert class_ttft(configured) == 1.5
    assert class_ttft({}) is None  # unconfigured: the floor alone, as before classes
    assert ttft_for(None, True, configured) == 1.5
    assert ttft_for(3.0, True, configured) == 3.0  # the operator's own wins
    assert ttft_for(None, False, configured) is None  # declined: the floor alone


def test_a_step_fails_on_ttft_and_the_verdict_names_that_promise() -> None:
    ok = judge(1, [a_round(1, ttft_p90=0.7, decode_p10=90)], floor=5, ttft_p90_max=1.5,
               repeats=1)
    late = judge(4, [a_round(4, ttft_p90=2.4, decode_p10=60)], floor=5, ttft_p90_max=1.5,
                 repeats=1)
    slow = judge(8, [a_round(8, ttft_p90=1.0, decode_p10=3)], floor=5, ttft_p90_max=1.5,
                 repeats=1)
    assert ok.passed and broken(ok, 5, 1.5) == ()
    assert not late.passed and broken(late, 5, 1.5) == (TTFT,)
    assert broken(slow, 5, 1.5) == (DECODE,)
    settings = plan.Settings(plan.harsh(64, 30), (1, 4), floor=5, ttft_p90_max=1.5,
                             repeats=1)
    state, point, words = outcome(settings, [ok, late], Climbed("done"), "")
    assert (state, point) == ("done", 1)
    assert words == ("qualified at 1 concurrent user: every user at or above 5 tokens/s and "
                     "sees a first token within 1.5 s (p90); at 4 concurrent users the time "
                     "to first token (2.40 s at p90, over the SLO of 1.5 s) failed")
    _, _, floor_words = outcome(settings, [ok, slow], Climbed("done"), "")
    assert floor_words.endswith("; at 8 concurrent users the decode floor (3.0 tokens/s at "
                                "p10, under 5) failed")


def test_the_point_is_the_total_and_each_classes_share_caps_its_part() -> None:
    """A point of 6 held at a 1.5 s SLO: the gateway admits 6 in all; batch (half the slots)
    holds at most 3 of them, interactive may take every slot batch leaves."""
    held = QualifiedPoint(9, 6, 5.0, AT, 4.0, ttft_slo=1.5)
    limit = admission_limit(64, held)
    assert limit.limit == 6 and "first token within 1.5 s" in limit.words()
    assert limit.to_dict()["qualification"] == {
        "id": 9, "point": 6, "floor": 5.0, "at": AT.isoformat(), "batch_seconds": 4.0,
        "ttft_slo": 1.5}
    classes = effective(parse_classes(CLASSES))
    gate = ClassGate(Admission(limit.limit, 16), classes, 30.0, GatewayMetrics())
    batch, interactive = gate.of(BATCH), gate.of(INTERACTIVE)
    assert [gate.try_acquire(batch, 1, 0) for _ in range(4)] == [True, True, True, False]
    assert [gate.try_acquire(interactive, 1, 0) for _ in range(4)] == [True, True, True, False]
    assert gate.admission.in_use == 6  # never above the point
    gate.release(batch, 1)
    assert gate.try_acquire(batch, 1, 0)  # its freed slot is batch's again
    # A new point moves both: at 2, batch's half is 1 slot and the total 2.
    gate.admission.set_limit(admission_limit(64, QualifiedPoint(9, 2, 5.0, AT, 4.0)).limit)
    assert gate.admission.group_slots(batch.share) == 1 and gate.admission.limit == 2


def test_before_it_has_served_anything_the_estimate_uses_the_qualified_batch_time() -> None:
    """Right after a start the gateway has measured nothing: with the point's full batch (40
    s at 2) as the service time of the two requests just admitted, an interactive request
    that finds both slots taken is refused at once; unqualified it is admitted to the queue
    as before; once served, the gateway's own figure wins."""
    classes = effective(parse_classes({"interactive": {"ttft_slo_seconds": 5}}))
    gate = ClassGate(Admission(2, 16), classes, 30.0, GatewayMetrics())
    interactive = gate.of(INTERACTIVE)
    assert gate.try_acquire(interactive, 1, 0) and gate.try_acquire(interactive, 1, 0)
    gate.refuse_early(interactive, 0)  # nothing measured, no prior: no evidence, no refusal
    gate.admission.service_prior = 40.0  # what the gateway's poll sets at a qualified point
    with pytest.raises(GatewayError) as refused:
        gate.refuse_early(interactive, 0)
    assert refused.value.status == 429 and "about 40 s for a slot" in str(refused.value)
    gate.served(INTERACTIVE, held_seconds=2.0, prompt_tokens=0, engine_ttft_seconds=None)
    gate.refuse_early(interactive, 0)  # its own 2 s per request: 2 s to a slot, admitted


def test_the_ledger_keeps_the_slo_and_the_ttft_measured_at_the_point() -> None:
    ok = judge(1, [a_round(1, ttft_p90=0.7, decode_p10=90)], floor=5, ttft_p90_max=1.5,
               repeats=1)
    late = judge(4, [a_round(4, ttft_p90=2.4, decode_p10=60)], floor=5, ttft_p90_max=1.5,
                 repeats=1)
    settings = plan.Settings(plan.harsh(64, 30), (1, 4), floor=5, ttft_p90_max=1.5, repeats=1)
    record = ledger.Record(3, "a" * 64, "done", AT, AT, "tests", "", "", settings,
                           (ok, late), 1, "words", "")
    body = record.to_dict()
    assert body["ttft_slo"] == 1.5 and body["ttft_at_point"] == 0.7
    back = ledger.Record(3, "a" * 64, "done", AT, AT, "tests", "", "",
                         plan.Settings.from_dict(json.loads(json.dumps(settings.to_dict()))),
                         tuple(Step(s.concurrency, s.rounds, s.passed, s.reasons)
                               for s in (ok, late)), 1, "words", "")
    assert point_of(back) is not None and point_of(back).ttft_slo == 1.5  # type: ignore[union-attr]


def test_the_cli_asks_for_the_classes_slo_another_or_none() -> None:
    def body(*argv: str) -> dict[str, Any]:
        return qualify_cli._body(build_parser().parse_args(["qualify", "run", *argv]))

    assert body()["ttft_p90_max"] is None and body()["no_ttft_slo"] is False  # the class's
    assert body("--ttft-p90-max", "3")["ttft_p90_max"] == 3.0
    assert body("--no-ttft-slo")["no_ttft_slo"] is True


# -- live: the emulator, the API, the CLI's words ---------------------------------------------

@pytest.mark.parametrize("ready_box", [{
    "FAKE_SGLANG_PERF": "k3-b300", "APPLIANCE_GATEWAY_CLASSES": json.dumps(CLASSES)}],
    indirect=True)
def test_a_qualification_with_the_classes_ttft_slo_stops_where_the_first_token_is_late(
        ready_box: tuple[LiveServer, Console]) -> None:
    _, console = ready_box
    page = console.http.get("/qualify").text
    assert 'name="ttft_p90_max" type="number" min="0" step="any" value="1.5"' in page

    def run(**extra: object) -> dict[str, Any]:
        started = console.http.post(f"{API}/run", headers=csrf(console), json={
            "ladder": [1, 4, 8], "repeats": 1, "floor": 5, "input_tokens": 8192,
            "output_tokens": 30, "wedge_seconds": 60, "confirm": True, **extra})
        assert started.status_code == 202, started.text
        qid = started.json()["id"]
        wait_until(lambda: console.http.get(f"{API}/{qid}").json()["state"] != "running",
                   "the qualification to end", timeout=240)
        body: dict[str, Any] = console.http.get(f"{API}/{qid}").json()
        return body

    bad = console.http.post(f"{API}/run", headers=csrf(console), json={
        "ladder": [1], "ttft_p90_max": -1, "confirm": True})
    assert bad.status_code == 422 and bad.json()["code"] == "qualify_invalid", bad.text
    assert "ttft_p90_max: -1 s is not a usable ceiling" in bad.json()["detail"]
    assert console.http.get(f"{API}/").json()["history"] == []  # nothing started or kept
    record = run()  # no ttft_p90_max: the interactive class's 1.5 s
    floor_only = run(ladder=[1, 4], no_ttft_slo=True)
    shown = console.http.get(f"/qualify/{record['id']}").text
    steps = record["steps"]
    figures = [(s["concurrency"], s["ttft_p90"], s["decode_p10"], s["reasons"]) for s in steps]
    assert record["state"] == "done" and record["settings"]["ttft_p90_max"] == 1.5, figures
    assert record["qualified"] == 1, figures
    failing = steps[-1]
    assert failing["concurrency"] == 4 and not failing["passed"], figures
    assert failing["reasons"] and all("time to first token" in why
                                      for why in failing["reasons"]), figures
    assert failing["decode_p10"] >= 5 and failing["failures"] == 0  # the floor held
    assert "at 4 concurrent users the time to first token (" in str(record["verdict"])
    assert "over the SLO of 1.5 s) failed" in str(record["verdict"])
    assert record["ttft_slo"] == 1.5 and record["ttft_at_point"] == steps[0]["ttft_p90"]
    assert "First token at the point" in shown and "within its 1.5 s" in shown
    assert (f"first token at the point: {steps[0]['ttft_p90']:.2f} s (p90), SLO 1.5 s"
            in qualify_cli.describe_record(record))  # `appliance qualify show`
    # Declined: the same engine qualifies further on the floor alone.
    assert floor_only["settings"]["ttft_p90_max"] is None
    assert floor_only["qualified"] == 4 and floor_only["ttft_slo"] is None, floor_only
