"""Qualification end to end: a live daemon supervising the real engine emulator (a
subprocess), qualified through the real admin API and the real `appliance qualify` CLI code
(its parser and its HTTP calls to the daemon), over a real database.

Covers: the confirmation (nothing starts, the gateway stays open, the estimate is given), a
short ladder that qualifies at its top, a floor the engine cannot hold (not qualified, exit
1), the ledger and the chart, and a cancel mid-run that leaves the gateway admitting users.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from appliance.cli import build_parser
from appliance.engine.publish import read_published
from appliance.qualify import cli as qualify_cli
from tests.conftest import Console, LiveServer, add_admin, csrf
from tests.test_engine_api import engine_server, post_action, wait_state, wait_until

API = "/api/v1/qualify"
SHORT = ["--ladder", "1,2,4", "--repeats", "1", "--input-tokens", "64", "--output-tokens",
         "30", "--wedge-seconds", "30"]


@pytest.fixture
def ready_box(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest,
              ) -> Iterator[tuple[LiveServer, Console]]:
    """A daemon whose engine emulator is READY, and a logged-in console session. An indirect
    parameter (a dict) sets FAKE_SGLANG_* for the emulator and APPLIANCE_* for the box."""
    env: dict[str, str] = getattr(request, "param", {})
    for name, value in env.items():
        if name.startswith("FAKE_SGLANG_"):
            monkeypatch.setenv(name, value)
    with engine_server(tmp_path, monkeypatch, **{k: v for k, v in env.items()
                                                if k.startswith("APPLIANCE_")}) as live:
        add_admin(live.runtime)
        console = Console(live.base_url)
        assert console.login().status_code == 303
        started = post_action(console, "start")
        assert started.status_code == 202, started.text
        wait_state(console.http, "ready")
        try:
            yield live, console
        finally:
            console.close()


def cli(live: LiveServer, capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    """`appliance qualify ARGV` through the real parser and the CLI's own daemon client."""
    args = build_parser().parse_args(["qualify", *argv])
    try:
        code = qualify_cli.run(args, live.runtime.config)
    except Exception as exc:  # an ApplianceError: main() prints it and exits with its code
        code = getattr(exc, "exit_code", 99)
        print(f"error: {exc}")
    return code, capsys.readouterr().out


def gateway_closed(live: LiveServer) -> bool:
    published = live.runtime.db.call(read_published)
    return published is not None and published.qualifying(dt.datetime.now(dt.UTC))


def test_qualify_a_short_ladder_through_the_cli_and_the_api(
        ready_box: tuple[LiveServer, Console], capsys: pytest.CaptureFixture[str]) -> None:
    live, console = ready_box
    http = console.http
    status = http.get(f"{API}/").json()
    spec = status["spec_hash"]
    assert spec == live.runtime.supervisor.running_spec_hash and status["qualified"] is None
    assert status["standing"] == (f"unqualified: the running engine (launch configuration "
                                  f"{spec[:12]}) has never been qualified")

    page = http.get("/qualify")
    assert page.status_code == 200 and "Qualification</a>" in page.text
    assert (f"Unqualified: the running engine (launch configuration {spec[:12]}) has never "
            "been qualified.") in page.text and "Run a qualification…" in page.text
    # The console's first press shows what it will do and how long; nothing starts.
    asked = http.post("/qualify/run", data={"floor": "32", "repeats": "1", "ladder": "1,2,4",
                                            "workload": "harsh"}, headers=csrf(console))
    assert asked.status_code == 200, asked.text
    assert "Refuse users and qualify now" in asked.text and "about 2 min" in asked.text

    # Without a confirmation nothing starts: the estimate and what it does, the gateway open.
    refused = http.post(f"{API}/run", json={"ladder": [1, 2, 4]}, headers=csrf(console))
    assert refused.status_code == 409, refused.text
    assert refused.json()["code"] == "confirmation_required"
    assert "The gateway refuses users (503) for the whole run" in refused.json()["detail"]
    code, out = cli(live, capsys, "run", *SHORT)
    assert code != 0 and "would qualify the running engine" in out and "about 1 min" in out
    assert http.get(f"{API}/").json()["history"] == [] and not gateway_closed(live)

    # The emulator gives each user a token every 10 ms (about 100 tokens/s): a floor of 5
    # holds at every step, so the top of this ladder is the qualified point.
    code, out = cli(live, capsys, "run", *SHORT, "--floor", "5", "--yes", "--json")
    assert code == 0, out
    record = json.loads(out[out.index("{"):])
    assert record["state"] == "done" and record["qualified"] == 4, record
    assert record["spec_hash"] == spec and record["engine_version"]
    assert [s["concurrency"] for s in record["steps"]] == [1, 2, 4]
    for step in record["steps"]:
        assert step["passed"] and step["failures"] == 0 and not step["wedged"]
        (only,) = step["rounds"]
        assert only["requests"] == step["concurrency"]
        assert only["output_tokens"] == 30 * step["concurrency"]
        assert only["decode_p10"] >= 5 and only["ttft_p90"] is not None
        assert only["kv_peak"] is not None  # scraped from the emulator's /metrics
    # No step failed: 4 is the ladder's top, not the box's point, and every place says so.
    assert record["verdict"] == (
        "qualified for at least 4 concurrent users (the ladder stopped at 4; no step failed, "
        "so more may pass: continue the ladder to find the point): every user at or above 5 "
        "tokens/s")
    assert record["lower_bound"] is True and not gateway_closed(live)

    status = http.get(f"{API}/").json()
    assert status["qualified"] == 4 and status["standing"] == record["verdict"]
    code, out = cli(live, capsys, "status")
    assert code == 0 and "at least 4" in out and "run --continue" in out
    page = http.get("/qualify").text
    assert "Continue the ladder from 4…" in page and 'name="continue_from"' in page
    asked = http.post("/qualify/run", data={"continue_from": str(record["id"])},
                      headers=csrf(console))
    assert asked.status_code == 200 and "Refuse users and continue now" in asked.text
    assert f"continues qualification {record['id']} from 4 concurrent users" in asked.text

    # Continued from 4: the measured steps are kept, only the step above is run.
    code, out = cli(live, capsys, "run", "--continue", "--ladder", "6", "--yes", "--json")
    assert code == 0, out
    more = json.loads(out[out.index("{"):])
    assert [s["concurrency"] for s in more["steps"]] == [1, 2, 4, 6]
    assert more["steps"][:3] == record["steps"] and more["qualified"] == 6
    assert more["settings"]["continues"] == record["id"]
    assert more["settings"]["floor"] == 5 and "at least 6" in more["verdict"]

    # A floor no user can hold: not qualified, and the CLI says so with exit status 1.
    code, out = cli(live, capsys, "run", *SHORT, "--floor", "5000", "--yes")
    assert code == 1, out
    assert "not qualified: already at 1 concurrent user" in out and "under the floor" in out
    # The newest finished qualification is the spec's standing; the ledger keeps both.
    code, out = cli(live, capsys, "list")
    assert code == 0 and out.splitlines()[1].split()[2] == "done"
    history = http.get(f"{API}/").json()["history"]
    assert [h["qualified"] for h in history] == [None, 6, 4]
    assert http.get(f"{API}/").json()["standing"].startswith("not qualified: already at 1")
    chart = http.get(f"{API}/{record['id']}/chart.svg")
    assert chart.status_code == 200 and chart.headers["content-type"].startswith("image/svg")
    assert "qualified: 4" in chart.text and "floor 5 tokens/s" in chart.text
    code, out = cli(live, capsys, "show", str(record["id"]))
    assert code == 0 and "pass  per-user p10" in out

    page = http.get("/qualify").text
    assert "Not qualified: already at 1 concurrent user" in page and "did not hold" in page
    assert "Qualified for at least 4 concurrent users (the ladder stopped at 4" in page
    one = http.get(f"/qualify/{record['id']}")
    assert one.status_code == 200 and "<svg" in one.text and " UTC by alice" in one.text
    assert "every user at or above 5 tokens/s." in one.text


def test_cancel_mid_run_leaves_the_gateway_admitting(
        ready_box: tuple[LiveServer, Console]) -> None:
    live, console = ready_box
    http = console.http
    # Long answers (20 s at 10 ms a token): the run is still measuring when it is cancelled.
    started = http.post(f"{API}/run", headers=csrf(console), json={
        "ladder": [1, 2], "repeats": 1, "input_tokens": 32, "output_tokens": 2000,
        "floor": 5, "confirm": True})
    assert started.status_code == 202, started.text
    qid = started.json()["id"]

    def measuring() -> bool:
        progress: dict[str, Any] | None = http.get(f"{API}/").json()["progress"]
        return progress is not None and progress["phase"] == "measuring"

    wait_until(measuring, "the qualification to measure its first step")
    assert gateway_closed(live)  # users are refused while it runs
    assert http.get(f"{API}/").json()["state"] == "running"
    again = http.post(f"{API}/run", headers=csrf(console), json={"confirm": True})
    assert again.status_code == 409 and again.json()["code"] == "qualify_running"

    cancelled = http.post(f"{API}/cancel", headers=csrf(console))
    assert cancelled.status_code == 200 and cancelled.json()["cancelled"] is True

    def ended() -> bool:
        return bool(http.get(f"{API}/{qid}").json()["state"] != "running")

    wait_until(ended, "the cancelled qualification to end")
    record = http.get(f"{API}/{qid}").json()
    assert record["state"] == "cancelled" and record["qualified"] is None
    assert not gateway_closed(live)
    published = live.runtime.db.call(read_published)
    assert published is not None and published.qualifying_until is None
    assert http.get(f"{API}/").json()["standing"].startswith("unqualified")
    # The engine is idle again (the cancelled streams were closed, not left running).
    engine = httpx.get(f"http://127.0.0.1:{live.runtime.config.engine.port}/emulator/stats",
                       timeout=5).json()
    wait_until(lambda: httpx.get(
        f"http://127.0.0.1:{live.runtime.config.engine.port}/emulator/stats",
        timeout=5).json()["running"] == 0, "the engine to be idle")
    assert engine["max_running_requests"] >= 2


# -- the calibrated emulator (FAKE_SGLANG_PERF=k3-b300) -----------------------------------------
SCALE = 0.5  # real seconds per modelled second: the ladder below takes about 75 s


def modelled_p10(concurrency: int) -> float:
    """The calibrated model's per-user decode p10 (model tokens/s) for one harsh round: every
    user sends 8,192 tokens at once and decodes 1,000, simulated in model time over the
    emulator's own scheduler."""
    from appliance.qualify.verdict import percentile
    from appliance.testing.fake_sglang.perfmodel import K3_B300
    from appliance.testing.fake_sglang.scheduler import Scheduler, Seq

    scheduler = Scheduler(K3_B300, 64)
    for user in range(concurrency):
        scheduler.add(Seq(key=str(user), prompt=8192, target=1000, arrived=0.0), 0.0)
    now, first, last, made = 0.0, {}, {}, {}
    for _ in range(1_000_000):
        step = scheduler.step(now)
        if step is None:
            break
        now = step.ends
        for key, count in step.tokens.items():
            made[key] = made.get(key, 0) + count
            first.setdefault(key, now)
            last[key] = now
    rates = [(made[k] - 1) / (last[k] - first[k]) for k in made if last[k] > first[k]]
    p10 = percentile(rates, 10)
    assert p10 is not None
    return p10


def test_the_model_crosses_the_32_floor_between_12_and_16_users() -> None:
    """What the live test below is held to: with the k3-b300 constants the slowest tenth of
    users decode at about 36 tokens/s with 12 users at once and about 31 with 16 (the other
    users' 8K prefills, 0.6 s a chunk, stall everyone's decode; a step costs 27 ms plus
    1.08 ms a user and yields 1.8 tokens)."""
    assert modelled_p10(8) > 40 and modelled_p10(12) > 34
    assert 29 < modelled_p10(16) < 32


def test_qualify_the_calibrated_emulator_with_the_harsh_load(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The harsh load (8,192 in, 1,000 out, cache flushed) against the emulator serving like
    the field box on a 2x clock, floor 32 tokens/s in the engine's (model) time, which the
    qualification measures by (64 tokens/s on the wall clock).
    The model puts the crossing between 12 and 16 users (test above). On a fast clock every
    emulator step also costs its real scheduling overhead, which only lowers the speeds seen
    (15-25 % at 4-5x on a busy 2-core box, so this runs at 2x): 12 users (model p10 12 %
    above the floor) may fall under it, 8 (33 % above) holds, and 16 (already under in the
    model) never passes."""
    monkeypatch.setenv("FAKE_SGLANG_PERF", "k3-b300")
    monkeypatch.setenv("FAKE_SGLANG_TIME_SCALE", str(SCALE))
    with engine_server(tmp_path, monkeypatch) as live:
        add_admin(live.runtime)
        console = Console(live.base_url)
        try:
            assert console.login().status_code == 303
            assert post_action(console, "start").status_code == 202
            wait_state(console.http, "ready")
            started = console.http.post(f"{API}/run", headers=csrf(console), json={
                # from 4: the steps below take a minute of CI and prove nothing the short
                # ladder test does not
                # the floor in the engine's time: the emulator says its scale in
                # /server_info and the qualification measures by the engine's clock
                "ladder": [4, 8, 12, 16, 24], "repeats": 1, "floor": 32,
                "wedge_seconds": 60, "confirm": True})
            assert started.status_code == 202, started.text
            qid = started.json()["id"]
            wait_until(lambda: console.http.get(f"{API}/{qid}").json()["state"] != "running",
                       "the qualification to end", timeout=240)
            record = console.http.get(f"{API}/{qid}").json()
        finally:
            console.close()
    assert record["state"] == "done", record
    assert record["settings"]["time_scale"] == SCALE
    assert f"in the engine's time: its time scale is {SCALE:g}" in record["verdict"]
    assert record["qualified"] in (8, 12), [(s["concurrency"], s["decode_p10"], s["reasons"])
                                            for s in record["steps"]]
    steps = {s["concurrency"]: s for s in record["steps"]}
    assert all(steps[c]["passed"] for c in (4, 8) if c <= record["qualified"])
    failing = record["steps"][-1]
    assert not failing["passed"] and failing["concurrency"] in (12, 16)
    assert failing["failures"] == 0 and not failing["wedged"]  # slow, not broken
    assert all("under the floor" in why for why in failing["reasons"])


def test_qualify_run_yes_follows_past_its_tokens_lifetime_and_exits_with_the_verdict(
        ready_box: tuple[LiveServer, Console], capsys: pytest.CaptureFixture[str]) -> None:
    """The CLI's per-call token lasts `server.cli_token_seconds` (2 minutes; 3 s here): a run
    that outlasts it is still followed to its end (the token is minted again before it
    lapses), the exit status is the run's verdict, and no token is left behind."""
    import dataclasses

    from sqlalchemy import func, select

    from appliance.auth.tokens import CLI_TOKEN_PREFIX
    from appliance.db.models import ApiToken

    live, _ = ready_box
    config = live.runtime.config
    short = dataclasses.replace(config, server=dataclasses.replace(config.server,
                                                                   cli_token_seconds=3))
    args = build_parser().parse_args([
        "qualify", "run", "--ladder", "1,2", "--repeats", "2", "--input-tokens", "32",
        "--output-tokens", "300", "--floor", "5", "--yes", "--json"])
    code = qualify_cli.run(args, short)
    out = capsys.readouterr().out
    record = json.loads(out[out.index("{"):])
    assert code == 0 and record["state"] == "done" and record["qualified"] == 2, out
    took = (dt.datetime.fromisoformat(record["ended_at"])
            - dt.datetime.fromisoformat(record["started_at"])).total_seconds()
    assert took > 3, "the run did not outlast the token: the test proves nothing"
    left = live.runtime.db.call(lambda s: s.scalar(select(func.count()).select_from(
        ApiToken).where(ApiToken.name.startswith(CLI_TOKEN_PREFIX))))
    assert left == 0
