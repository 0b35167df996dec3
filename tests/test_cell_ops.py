"""Operating the cell from its head (issue 17): the rolling restart's planner and executor,
the router's metrics (scrapes of the real sglang-router 0.3.2 in tests/data/router_metrics/),
a member's role change (refused without confirmation, with its cost; kept; the engine
restarted by its supervisor), the head's actions through a real member app on loopback, the
Cell page for a viewer and an operator, and the cell's gauges on /metrics.

The executor runs over `FakeCell`, a real port whose engines follow scripted states; every
wait is bounded (deadlines of seconds, polls of milliseconds).
"""

# The two-box rig's fixture is imported from tests.test_cell_membership; tests name it again.
# ruff: noqa: F811

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime as dt
import http.server
import io
import json
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy.orm import Session

from appliance.auth.accounts import create_admin
from appliance.auth.tokens import create_token
from appliance.cell import cli as cell_cli
from appliance.cell.membership import Member
from appliance.cell.ops import cell_ops_of
from appliance.cell.overview import (
    UsageWindow,
    build_overview,
    health_words,
    overview_json,
    usage_window,
)
from appliance.cell.role_choice import stored_role
from appliance.cell.rolling import (
    Engine,
    Plan,
    Progress,
    RollingRefused,
    RollingRestart,
    Seen,
    Step,
    plan_rolling,
    step_refusal,
    wait_verdict,
)
from appliance.cell.router_metrics import (
    RouterMetricsReader,
    RouterReading,
    parse_router_metrics,
    rates_between,
    worker_for,
)
from appliance.cell.view import EngineFacts, Observed, build_view
from appliance.cli import build_parser
from appliance.clock import SystemClock
from appliance.db.database import Database
from appliance.db.journal import list_audit
from appliance.db.models import UsageRequest
from appliance.db.schema import migrate
from appliance.errors import ApplianceError
from appliance.resources import migrations_dir
from appliance.runtime import Runtime, build_runtime
from appliance.testing.fake_gpus import FakeGpus
from tests.conftest import PASSWORD, Console, LiveServer, problem, wait_for
from tests.test_cell_membership import Box, add, boxes, join_token  # noqa: F401 - a fixture
from tests.test_engine_api import engine_server, kill_engine
from tests.test_engine_lifecycle import engine_config, prove_weights

DATA = Path(__file__).parent / "data" / "router_metrics"
PREFILL, DECODE1, DECODE2 = ("http://127.0.0.1:48891", "http://127.0.0.1:37631",
                             "http://127.0.0.1:55885")


def engine(member_id: int | None, role: str, state: str | None = "ready") -> Engine:
    key = "head" if member_id is None else f"member-{member_id}"
    label = "this box (the head)" if member_id is None else f"member {member_id}"
    return Engine(key, label, role, state, member_id)


# --------------------------------------------------------------------------- the planner


def test_a_role_with_one_ready_member_is_refused_saying_so() -> None:
    cell = [engine(1, "prefill"), engine(2, "decode"), engine(3, "decode", "loading_weights")]
    with pytest.raises(RollingRefused) as refused:
        plan_rolling("decode", cell)
    assert refused.value.status == 409
    assert refused.value.message.startswith("decode has 1 READY member (of 2)")
    assert "it would take the last READY decode member down" in refused.value.message
    with pytest.raises(RollingRefused, match="prefill has 1 READY member"):
        plan_rolling("prefill", cell)
    with pytest.raises(RollingRefused, match="decode has 0 READY members"):
        plan_rolling("decode", [engine(2, "decode", None)])
    with pytest.raises(ApplianceError, match="not a role a rolling restart takes"):
        plan_rolling("unified", cell)


def test_the_plan_takes_the_roles_ready_engines_in_order_and_never_the_other_role() -> None:
    cell = [engine(None, "decode"), engine(4, "decode"), engine(1, "prefill"),
            engine(2, "decode"), engine(3, "decode", "failed"), engine(5, "decode", None),
            engine(6, "unified")]
    plan = plan_rolling("decode", cell)
    assert [e.key for e in plan.steps] == ["member-2", "member-4", "head"]  # the head last
    assert [(e.key, why) for e, why in plan.skipped] == [
        ("member-3", "not ready (failed): restart it on its own if needed"),
        ("member-5", "not reachable")]
    assert all(e.role == "decode" for e in plan.steps)


def test_a_step_is_refused_when_no_other_engine_of_its_role_is_ready() -> None:
    one, two = engine(1, "decode"), engine(2, "decode")
    assert step_refusal(one, [one, two, engine(3, "prefill", None)]) is None
    why = step_refusal(one, [one, engine(2, "decode", "warming"), engine(3, "prefill")])
    assert why == ("restarting member 1 now would take the last serving decode member down "
                   "(member 2 not ready (warming))")
    # Issue 25: READY on its box but not sent requests by the router is not serving.
    unrouted = dataclasses.replace(two, routed=False)
    assert step_refusal(one, [one, unrouted]) == (
        "restarting member 1 now would take the last serving decode member down (member 2 "
        "ready, but the router does not send to it)")
    assert step_refusal(one, [one, dataclasses.replace(two, routed=True)]) is None
    assert step_refusal(one, [one]) == "member 1 is the only decode member left"
    assert step_refusal(one, [engine(1, "decode", "stopped"), two]) == (
        "member 1 is no longer READY (stopped)")
    assert step_refusal(one, [engine(1, "prefill"), two]) == (
        "member 1 is no longer a decode member of the cell")


def test_a_restarted_engine_is_back_when_ready_again_and_taken_back_by_the_router() -> None:
    before = Seen("ready", "t0")
    assert wait_verdict(before, Seen("ready", "t0"), went_down=False) is None  # not gone yet
    assert wait_verdict(before, Seen("loading_weights", "t1"), went_down=True) is None
    assert wait_verdict(before, Seen("ready", "t2"), went_down=False) == "ready"
    assert wait_verdict(before, Seen("ready", "t0"), went_down=True) == "ready"
    assert wait_verdict(before, Seen("ready", "t2", routed=False), went_down=True) is None
    assert wait_verdict(before, Seen("ready", "t2", routed=True), went_down=True) == "ready"
    assert wait_verdict(before, Seen(None), went_down=True) is None  # its daemon is busy
    failed = wait_verdict(before, Seen("failed", "t3", "weights_error"), went_down=True)
    assert failed == "its engine is failed: weights_error"
    # A restart passes through STOPPED; only a lasting stop is a failure.
    assert wait_verdict(before, Seen("stopped"), went_down=True, stopped_seconds=1) is None
    assert "stopped instead" in str(wait_verdict(before, Seen("stopped"), went_down=True,
                                                 stopped_seconds=60))


# --------------------------------------------------------------------------- the executor


class FakeCell:
    """The executor's port over engines that follow a script: a restart makes the engine
    go through `path` (one state per read), then READY with a new `since` (or stay in the
    last state of `path` when `back` is False). The router takes an engine back only
    `router_lag` reads after it is READY."""

    def __init__(self, engines: list[Engine], *, path: tuple[str, ...] = ("draining", "warming"),
                 back: bool = True, router_lag: int = 0) -> None:
        self.engines_now = {e.key: e for e in engines}
        self.path, self.back, self.router_lag = path, back, router_lag
        self.step_messages: list[str] = []  # what each reported step said, in order
        self.restarted: list[str] = []
        self.refuse: dict[str, str] = {}
        self.fail_at: dict[str, str] = {}  # key -> the state its restart ends in
        self.down_with: dict[str, str] = {}  # key -> another engine that goes down with it
        self.fails_once_back: set[str] = set()  # engines that fail again right after coming back
        self._script: dict[str, list[Seen]] = {}
        self._since: dict[str, int] = {}
        self.reads = 0

    async def engines(self) -> list[Engine]:
        return list(self.engines_now.values())

    async def seen(self, e: Engine) -> Seen:
        self.reads += 1
        script = self._script.get(e.key)
        if script:
            seen = script.pop(0) if len(script) > 1 else script[0]
            if seen.state is not None:
                self._set(e.key, seen.state)
            if seen.routed and e.key in self.fails_once_back:
                self._script.pop(e.key)
                self._set(e.key, "failed")
            return seen
        now = self.engines_now[e.key]
        return Seen(now.state, f"since-{self._since.get(e.key, 0)}")

    def _set(self, key: str, state: str) -> None:
        old = self.engines_now[key]
        self.engines_now[key] = Engine(old.key, old.label, old.role, state, old.member_id)

    async def restart(self, e: Engine) -> None:
        if e.key in self.refuse:
            raise ApplianceError("engine_command_refused", self.refuse[e.key])
        self.restarted.append(e.key)
        self._since[e.key] = self._since.get(e.key, 0) + 1
        since = f"since-{self._since[e.key]}"
        script = [Seen(state, since) for state in self.path]
        if e.key in self.fail_at:
            script.append(Seen(self.fail_at[e.key], since, "crashed while loading"))
        elif self.back:
            script += [Seen("ready", since, routed=False)] * self.router_lag
            script.append(Seen("ready", since, routed=True))
        self._script[e.key] = script
        if e.key in self.down_with:
            self._set(self.down_with[e.key], "stopped")


def run_rolling(cell: FakeCell, plan: Plan, *, deadline: float = 5.0, grace: float = 60.0,
                cancel_after_reads: int | None = None) -> tuple[Progress, list[tuple[str, str]]]:
    reports: list[tuple[str, str]] = []

    async def report(progress: Progress, step: Step | None) -> None:
        reports.append((progress.state, f"{step.label}: {step.status}" if step else "-"))
        if step is not None:
            cell.step_messages.append(step.message)

    async def main() -> Progress:
        rolling = RollingRestart(plan, cell, started_by="alice", report=report,
                                 deadline_seconds=deadline, poll_seconds=0.01,
                                 stopped_grace_seconds=grace)
        task = asyncio.create_task(rolling.run())
        if cancel_after_reads is not None:
            for _ in range(500):  # bounded: 5 s of 10 ms polls
                if cell.reads >= cancel_after_reads or task.done():
                    break
                await asyncio.sleep(0.01)
            rolling.cancel("bob")
        return await asyncio.wait_for(task, 30)

    return asyncio.run(main()), reports


CELL = [engine(1, "prefill"), engine(2, "decode"), engine(3, "decode"), engine(4, "decode")]


def test_the_rolling_restart_restarts_one_engine_at_a_time_and_reports_each() -> None:
    cell = FakeCell(CELL, router_lag=2)
    progress, reports = run_rolling(cell, plan_rolling("decode", CELL))
    assert cell.restarted == ["member-2", "member-3", "member-4"]  # never the prefill
    assert progress.state == "done" and progress.done == 3 and progress.ended_at is not None
    assert progress.message == "every READY decode member was restarted and is READY again"
    assert reports[0] == ("running", "-") and reports[-1] == ("done", "-")
    steps = [r for _, r in reports[1:-1]]
    # each engine is READY twice before it is done: the router takes it back only then, and
    # the step says that it waits for the router meanwhile (once)
    assert steps == ["member 2: restarting"] * 2 + ["member 2: done"] + \
        ["member 3: restarting"] * 2 + ["member 3: done"] + \
        ["member 4: restarting"] * 2 + ["member 4: done"]
    waited = [m for m in cell.step_messages if "waiting for the router" in m]
    assert waited == [f"member {n} is READY again; waiting for the router to send to it"
                      for n in (2, 3, 4)]


def test_it_stops_at_the_first_failure_and_says_which_and_why() -> None:
    cell = FakeCell(CELL)
    cell.fail_at["member-3"] = "failed"
    progress, _ = run_rolling(cell, plan_rolling("decode", CELL))
    assert cell.restarted == ["member-2", "member-3"]
    assert progress.state == "failed"
    assert progress.message == ("stopped at member 3: member 3: its engine is failed: crashed "
                                "while loading; 1 not restarted")
    assert [s.status for s in progress.steps] == ["done", "failed", "not started"]

    stops = FakeCell(CELL)
    stops.fail_at["member-2"] = "stopped"  # it stays stopped (its preflight refused, say)
    progress, _ = run_rolling(stops, plan_rolling("decode", CELL), grace=0.1)
    assert stops.restarted == ["member-2"] and progress.state == "failed"
    assert "member 2: its engine stopped instead of starting again" in progress.message


def test_a_refused_restart_and_a_missed_deadline_stop_it_too() -> None:
    cell = FakeCell(CELL)
    cell.refuse["member-2"] = "cannot restart the engine: the engine is warming"
    progress, _ = run_rolling(cell, plan_rolling("decode", CELL))
    assert cell.restarted == [] and progress.state == "failed"
    assert "member 2 refused the restart: cannot restart the engine" in progress.message

    slow = FakeCell(CELL, back=False)
    progress, _ = run_rolling(slow, plan_rolling("decode", CELL), deadline=0.2)
    assert slow.restarted == ["member-2"] and progress.state == "failed"
    assert "member 2 was not READY again within 0 seconds (last seen: warming)" in \
        progress.message


def test_a_step_that_would_take_the_last_ready_engine_down_is_not_taken() -> None:
    cell = FakeCell(CELL[:3])
    cell.fails_once_back.add("member-2")  # back, then crashes before member 3's turn
    progress, _ = run_rolling(cell, plan_rolling("decode", CELL[:3]))
    assert cell.restarted == ["member-2"]
    assert progress.state == "failed"
    assert progress.message == (
        "stopped at member 3: restarting member 3 now would take the last serving decode member "
        "down (member 2 not ready (failed))")

    gone = FakeCell(CELL[:3])
    gone.down_with["member-2"] = "member-3"  # member 3 stops while member 2 restarts
    progress, _ = run_rolling(gone, plan_rolling("decode", CELL[:3]))
    assert gone.restarted == ["member-2"]
    assert progress.message == "stopped at member 3: member 3 is no longer READY (stopped)"


def test_cancel_stops_it_before_the_next_step() -> None:
    cell = FakeCell(CELL, path=("draining",) * 50)  # the first restart takes a while
    progress, reports = run_rolling(cell, plan_rolling("decode", CELL), cancel_after_reads=5)
    assert cell.restarted == ["member-2"]
    assert progress.state == "cancelled"
    assert progress.message.startswith("cancelled by bob; 2 not restarted; member 2's restart "
                                       "was already asked for")
    assert [s.status for s in progress.steps] == ["cancelled", "not started", "not started"]
    assert reports[-1] == ("cancelled", "-")


# --------------------------------------------------------------------------- the router


def scrape(name: str) -> str:
    return (DATA / f"{name}.txt").read_text()


def test_the_real_routers_metrics_give_each_workers_health_circuit_and_load() -> None:
    ok = parse_router_metrics(scrape("ok"))
    assert set(ok.workers) == {PREFILL, DECODE1, DECODE2}
    assert all(w.healthy and w.circuit == "closed" and w.running == 0
               for w in ok.workers.values())
    assert ok.pool_sizes == {"prefill": 1, "decode": 2}
    assert (ok.requests_total, ok.errors_total) == (7.0, 0.0)
    assert ok.duration_count == 7.0 and ok.duration_sum > 0

    down = parse_router_metrics(scrape("one_decode_down"))
    assert down.workers[DECODE2].healthy is False
    assert down.workers[DECODE2].consecutive_failures == 1
    assert down.workers[DECODE1].healthy and down.workers[PREFILL].healthy

    none = parse_router_metrics(scrape("no_decode"))
    assert [w.healthy for w in (none.workers[DECODE1], none.workers[DECODE2])] == [False, False]
    assert none.errors_total == 6.0  # 503 server_selection_failed
    rates = rates_between(ok, none, 10.0)
    assert rates is not None
    assert rates.requests_per_second == pytest.approx((none.requests_total - 7) / 10)
    assert rates.errors_per_second == pytest.approx(0.6)
    assert rates_between(none, ok, 10.0) is None  # counters went back: a new router
    assert rates_between(ok, none, 1.0) is None  # too short a span


def test_an_open_circuit_and_a_worker_named_with_a_slash() -> None:
    text = scrape("ok").replace(f'smg_worker_cb_state{{worker="{DECODE1}"}} 0',
                                f'smg_worker_cb_state{{worker="{DECODE1}"}} 1')
    parsed = parse_router_metrics(text)
    assert parsed.workers[DECODE1].circuit == "open"
    found = worker_for(parsed, (None, DECODE1 + "/"))
    assert found is not None and found.circuit == "open"
    assert worker_for(parsed, ("http://10.0.0.9:30000",)) is None
    with pytest.raises(ValueError):
        parse_router_metrics("smg_worker_health{worker= 1\n")


class MetricsServer:
    """The captured scrape served over loopback HTTP, as the router's metrics port."""

    def __init__(self, body: str) -> None:
        self.body = body.encode()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.end_headers()
                self.wfile.write(outer.body)

            def log_message(self, *args: object) -> None:
                return

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/metrics"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def metrics_port() -> Iterator[MetricsServer]:
    served = MetricsServer(scrape("ok"))
    yield served
    served.close()


def test_the_reader_scrapes_and_takes_rates_over_its_window(metrics_port: MetricsServer) -> None:
    ticks = iter([100.0, 110.0])
    reader = RouterMetricsReader(metrics_port.url, monotonic=lambda: next(ticks))
    first = asyncio.run(reader.read())
    assert first.up and first.rates is None and first.scrape is not None
    metrics_port.body = scrape("no_decode").encode()
    second = asyncio.run(reader.read())
    assert second.rates is not None and second.rates.seconds == 10.0
    assert second.rates.errors_per_second == pytest.approx(0.6)
    metrics_port.close()
    gone = asyncio.run(reader.read())
    assert not gone.up and gone.error.startswith("its metrics port did not answer")


# --------------------------------------------------------------------------- a member's role


def api_client(runtime: Runtime, base_url: str, username: str = "alice",
               role: str = "admin") -> httpx.Client:
    """An API client with a token of a new account `username` of `role`."""
    now = runtime.clock.now()

    def made(s: Session) -> str:
        account = create_admin(s, username, PASSWORD, now, role=role)
        token, _ = create_token(s, runtime.secret, account, f"test {username}", now)
        return token

    token = runtime.db.call(made)
    return httpx.Client(base_url=base_url, timeout=30,
                        headers={"Authorization": f"Bearer {token}"})


def engine_now(api: httpx.Client) -> dict[str, Any]:
    answer = api.get("/api/v1/engine")
    assert answer.status_code == 200, answer.text
    body: dict[str, Any] = answer.json()
    return body


def test_a_member_changes_its_role_when_confirmed_and_its_supervisor_restarts_the_engine(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with engine_server(tmp_path, monkeypatch, load_seconds="1") as live:
        runtime = live.runtime
        with api_client(runtime, live.base_url) as api:
            assert api.post("/api/v1/engine/start").status_code == 202
            first = wait_for(lambda: (e := engine_now(api))["state"] == "ready" and e,
                             "the engine to be ready", 90)
            asked = api.post("/api/v1/cell/peer/role", json={"role": "decode"})
            body = problem(asked, 409, "confirmation_required")
            assert body["detail"] == ("changing this box's role from unified to decode restarts "
                                      f"its engine; {runtime.supervisor.start_cost()}")
            assert stored_role(runtime.state_dir) is None and runtime.supervisor.role is None

            done = api.post("/api/v1/cell/peer/role", json={"role": "decode", "confirm": True})
            assert done.status_code == 200, done.text
            assert (done.json()["changed"], done.json()["restarted"]) == (True, True)
            assert stored_role(runtime.state_dir) == "decode"
            assert runtime.supervisor.role == "decode"
            wait_for(lambda: (e := engine_now(api))["state"] == "ready"
                     and e["run_id"] != first["run_id"], "the engine's restart", 90)
            argv = api.get("/api/v1/engine/spec").json()["argv"]
            assert argv[argv.index("--disaggregation-mode") + 1] == "decode"
            [restart] = [e for e in audit_entries(runtime, "engine.restart")]
            assert restart.detail["via"] == "api:token"

            # In a maintenance window: the role is kept now, the restart scheduled then; a
            # window in the past is refused and keeps nothing.
            running = engine_now(api)["run_id"]
            past = api.post("/api/v1/cell/peer/role",
                            json={"role": "prefill", "at": "2020-01-01T00:00:00Z"})
            problem(past, 422, "schedule_in_past")
            assert stored_role(runtime.state_dir) == "decode"
            window = dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)
            later = api.post("/api/v1/cell/peer/role",
                             json={"role": "prefill", "at": window.isoformat()})
            assert later.status_code == 200, later.text
            assert (later.json()["changed"], later.json()["restarted"]) == (True, False)
            assert "maintenance window" in later.json()["message"]
            assert stored_role(runtime.state_dir) == "prefill"
            [pending] = api.get("/api/v1/engine/scheduled").json()
            assert (pending["command"], pending["status"]) == ("restart", "pending")
            assert engine_now(api)["run_id"] == running  # nothing restarted now

            # A stopped engine takes the role at its next start: nothing to confirm.
            stop = api.post("/api/v1/engine/stop", json={"confirm": True})
            assert stop.status_code == 202, stop.text
            wait_for(lambda: engine_now(api)["state"] == "stopped", "the engine to stop", 90)
            kept = api.post("/api/v1/cell/peer/role", json={"role": "unified"})
            assert kept.status_code == 200, kept.text
            assert kept.json()["restarted"] is False
            assert "at its next start" in kept.json()["message"]
            assert stored_role(runtime.state_dir) is None  # the configured role again
            bad = api.post("/api/v1/cell/peer/role", json={"role": "both"})
            problem(bad, 400, "member_role_invalid")
        roles = [(e.outcome, e.detail["to"], e.detail.get("restarted"))
                 for e in reversed(audit_entries(runtime, "cell.peer.role"))]
        assert roles == [("denied", "decode", None), ("ok", "decode", True),
                         ("denied", "prefill", None), ("ok", "prefill", False),
                         ("ok", "unified", False)]


def audit_entries(runtime: Runtime, action: str) -> list[Any]:
    entries = runtime.db.call(lambda s: list_audit(s, action=action, per_page=100))
    return [e for e in entries.items if e.action == action]


# --------------------------------------------------------------------------- the head's actions


def watched(head: Box, check: Any, what: str) -> dict[str, Any]:
    """GET /api/v1/cell until `check(overview)` holds (the head's watch polls every 3 s)."""
    def ready() -> dict[str, Any] | None:
        answer = head.api.get("/api/v1/cell")
        assert answer.status_code == 200, answer.text
        body: dict[str, Any] = answer.json()
        return body if check(body) else None
    found: dict[str, Any] = wait_for(ready, what, 30)
    return found


def test_the_head_drives_a_member_through_its_peer_api(boxes: tuple[Box, Box]) -> None:
    head, member = boxes
    record = add(head, member, join_token(member)).json()
    cell = watched(head, lambda c: c["members"] and c["members"][0]["status"] == "ok",
                   "the head's watch to read the member")
    [seen] = cell["members"]
    assert cell["is_head"] and not cell["active"] and cell["router"] is None
    assert (seen["role"], seen["engine"]["state"], seen["actions"]) == ("unified", "stopped",
                                                                         ["start"])
    assert cell["head"]["role"] == "unified" and cell["rolling_restart"] is None

    # A role change of a stopped engine: kept on the member, and in the head's row.
    changed = head.api.post("/api/v1/cell/members/1/role", json={"role": "decode"})
    assert changed.status_code == 200, changed.text
    assert changed.json()["restarted"] is False and changed.json()["role"] == "decode"
    assert stored_role(member.runtime.state_dir) == "decode"
    assert member.runtime.supervisor.role == "decode"
    [row] = head.api.get("/api/v1/cell/members").json()
    assert row["role"] == "decode"
    [by_head] = head.audit("cell.member.role")
    assert (by_head.outcome, by_head.target, by_head.detail["role"]) == ("ok", member.url,
                                                                         "decode")
    [served] = member.audit("cell.peer.role")
    assert served.detail["via"] == f"cell peer {record['credential']}"
    assert ("POST", "/api/v1/cell/peer/role", "ok") in [
        (c.detail["method"], c.detail["path"], c.outcome) for c in head.audit("cell.call")]

    # The member's own refusal comes back as it said it; an unknown action never leaves.
    refused = problem(head.api.post("/api/v1/cell/members/1/engine/stop"), 409)
    assert refused["detail"] == (f"member 1 ({member.url}) refused: cannot stop the engine: "
                                 "the engine is already stopped")
    assert head.audit("cell.member.engine")[0].outcome == "failed"
    problem(head.api.post("/api/v1/cell/members/1/engine/reboot"), 404, "engine_action_unknown")
    problem(head.api.post("/api/v1/cell/members/9/engine/start"), 404, "member_not_found")

    # A rolling restart of a role without two READY members is refused, saying so.
    watched(head, lambda c: c["members"][0]["role"] == "decode", "the member's new role")
    rolling = problem(head.api.post("/api/v1/cell/rolling-restart",
                                    json={"role": "decode", "confirm": True}),
                      409, "rolling_restart_refused")
    assert rolling["detail"].startswith("decode has 0 READY members (of 1)")
    problem(head.api.post("/api/v1/cell/rolling-restart/cancel"), 409, "no_rolling_restart")


# --------------------------------------------------------------------------- a rolling restart


@contextlib.contextmanager
def decode_box(root: Path) -> Iterator[tuple[LiveServer, httpx.Client]]:
    """A member box in the decode role whose supervisor drives an engine emulator (1 s
    load), with an admin API client; its engine is killed on exit."""
    config = engine_config(root, APPLIANCE_CELL_ROLE="decode")
    db = Database(config.database_url)
    migrate(db, migrations_dir(), config.paths.state_dir / "backups", SystemClock().now())
    prove_weights(config, db)
    runtime = build_runtime(config, db=db, gpus=FakeGpus(), engine_poll_seconds=0.1,
                            engine_backoff_seconds=0.2)
    runtime.supervisor.ready_interval = 0.2
    live = LiveServer(runtime)
    try:
        live.start()
        with api_client(runtime, live.base_url) as api:
            yield live, api
    finally:
        kill_engine(runtime, live)
        db.dispose()


def app_state(box: Box) -> Any:
    return box.server.server.config.app.state


def test_a_rolling_restart_restarts_the_decode_members_one_at_a_time(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, boxes: tuple[Box, Box]) -> None:
    monkeypatch.setenv("FAKE_SGLANG_LOAD_SECONDS", "1")
    monkeypatch.delenv("FAKE_SGLANG_GPU_STATE", raising=False)
    monkeypatch.delenv("FAKE_SGLANG_FAULT", raising=False)
    head, _ = boxes
    ops = cell_ops_of(app_state(head), head.runtime)
    ops.rolling_poll_seconds, ops.rolling_deadline_seconds = 0.2, 90.0
    with decode_box(tmp_path / "d1") as (one, api1), decode_box(tmp_path / "d2") as (two, api2):
        for api in (api1, api2):
            assert api.post("/api/v1/engine/start").status_code == 202
        runs = {}
        for name, api in (("1", api1), ("2", api2)):
            runs[name] = wait_for(lambda a=api: (e := engine_now(a))["state"] == "ready" and e,
                                  "a decode engine to be ready", 90)["run_id"]
            token = api.post("/api/v1/cell/join-tokens").json()["token"]
            url = one.base_url if name == "1" else two.base_url
            added = head.api.post("/api/v1/cell/members", json={
                "address": url, "token": token, "role": "decode"})
            assert added.status_code == 201, added.text
        watched(head, lambda c: [m["engine"]["state"] for m in c["members"]] == ["ready"] * 2,
                "both decode members ready on the head")

        # The page asks before a member's restart, with the member's own cost sentence.
        operator = console_as(head, "opal", "operator")
        with contextlib.closing(operator.http):
            ask = operator.http.post("/cell/members/1/engine/restart",
                                     headers={"X-CSRF-Token": operator.page_token("/")})
            assert ask.status_code == 200, ask.text
            said = one.runtime.supervisor.start_cost()
            assert (f"Member 1 ({one.base_url}) says: restart ends the running engine; {said}."
                    in visible(ask.text)), ask.text
            assert "Restart member 1&#39;s engine" in ask.text and 'value="yes"' in ask.text
        assert engine_now(api1)["run_id"] == runs["1"]  # asked, not done

        asked = problem(head.api.post("/api/v1/cell/rolling-restart", json={"role": "decode"}),
                        409, "confirmation_required")
        assert asked["detail"].startswith(
            "a rolling restart restarts the 2 READY decode members one at a time (member 1 "
            "(127.0.0.1), member 2 (127.0.0.1)), each back to READY before the next goes down")
        started = head.api.post("/api/v1/cell/rolling-restart",
                                json={"role": "decode", "confirm": True})
        assert started.status_code == 202, started.text
        assert started.json()["state"] == "running"
        problem(head.api.post("/api/v1/cell/rolling-restart",
                              json={"role": "decode", "confirm": True}),
                409, "rolling_restart_running")
        cell = watched(head, lambda c: c["rolling_restart"]["state"] != "running",
                       "the rolling restart to end")
        rolling = cell["rolling_restart"]
        assert rolling["state"] == "done", rolling
        assert [s["status"] for s in rolling["steps"]] == ["done", "done"]
        for name, api in (("1", api1), ("2", api2)):
            now = engine_now(api)
            assert now["state"] == "ready" and now["run_id"] != runs[name]
        events = [e.detail["event"] for e in reversed(head.audit("cell.rolling_restart"))]
        assert events == ["start", "step", "step", "end"]
        for box in (one, two):
            [restart] = audit_entries(box.runtime, "engine.restart")
            assert restart.detail["via"].startswith("cell peer ")
        metrics = head.api.get("/metrics").text
        assert 'appliance_cell_engines{role="decode"} 2.0' in metrics
        assert "appliance_cell_rolling_restart_running 0.0" in metrics
        assert "appliance_cell_active 0.0" in metrics  # no prefill: not a PD cell


# --------------------------------------------------------------------------- the page, the CLI


def console_as(box: Box, username: str, role: str) -> Console:
    now = box.runtime.clock.now()
    box.runtime.db.call(lambda s: create_admin(s, username, PASSWORD, now, role=role))
    console = Console(box.url)
    assert console.login(username).status_code == 303
    return console


def test_the_cell_page_shows_each_role_only_its_actions(boxes: tuple[Box, Box]) -> None:
    head, member = boxes
    add(head, member, join_token(member))
    watched(head, lambda c: c["members"] and c["members"][0]["status"] == "ok",
            "the head's watch to read the member")
    pages = {}
    for role in ("viewer", "operator", "admin"):
        console = console_as(head, f"{role[:3]}x", role)
        with contextlib.closing(console.http):
            page = console.http.get("/cell")
            assert page.status_code == 200, page.text
            pages[role] = page.text
            if role == "admin":
                changed = console.http.post("/cell/members/1/role", data={"role": "prefill"},
                                            headers={"X-CSRF-Token": console.page_token("/")})
                assert changed.status_code == 200, changed.text
                assert changed.headers["HX-Trigger"] == "cell-changed"
                assert ("Member 1: role prefill kept; the engine takes it at its next start."
                        in changed.text)
                assert console.http.get("/cell/notice").text == ""
                assert 'id="cell-member-1"' in console.http.get("/cell/status").text
    for text in pages.values():
        assert "Member 1" in text and member.url in text
        assert "every check passes" in text or "a check" in text or "not reported" in text
        for field in ("engine_state", "worker_url", "registered_role", "None"):
            assert field not in visible(text), field
    start = 'hx-post="/cell/members/1/engine/start"'
    assert start not in pages["viewer"] and "Plan a rolling restart" not in pages["viewer"]
    assert "<button" not in pages["viewer"].split('id="cell-status"')[1].split("</main>")[0]
    assert start in pages["operator"] and "Plan a rolling restart" in pages["operator"]
    assert "Make it decode" not in pages["operator"]
    assert "Make it decode" in pages["admin"] and start in pages["admin"]
    assert stored_role(member.runtime.state_dir) == "prefill"
    with contextlib.closing(console_as(member, "mia", "viewer").http) as alone:
        assert "This box heads no cell" in alone.get("/cell").text


def visible(html: str) -> str:
    return re.sub(r"<[^>]+>", " ", html)


def cli(box: Box, *words: str) -> tuple[int, str]:
    args = build_parser().parse_args(["cell", *words])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cell_cli.run(args, box.runtime.config)
    return code, out.getvalue()


def test_the_cli_reads_the_cell_and_asks_for_yes(boxes: tuple[Box, Box]) -> None:
    head, member = boxes
    add(head, member, join_token(member))
    watched(head, lambda c: c["members"] and c["members"][0]["status"] == "ok",
            "the head's watch to read the member")
    code, text = cli(head, "status")
    assert code == 0
    assert text.splitlines()[0] == "cell: not a prefill/decode cell yet — this box heads no " \
        "prefill/decode cell: it has no prefill and no decode engine"
    assert f"1\t{member.url}\tunified\tstopped" in text
    code, text = cli(head, "role", "1", "decode")
    assert code == 0 and text.startswith(f"member 1 ({member.url}): role decode kept")
    with pytest.raises(ApplianceError) as refused:
        cli(head, "rolling-restart", "decode", "--yes")
    assert refused.value.code == "rolling_restart_refused"
    assert "decode has 0 READY members" in refused.value.message


# --------------------------------------------------------------------------- the overview


def member_row(member_id: int, role: str, engine_url: str) -> Member:
    at = dt.datetime(2026, 5, 1, 12, 0, tzinfo=dt.UTC)
    return Member(member_id, f"http://127.0.0.1:{9000 + member_id}", role, True, "abcd1234", at,
                  "alice", engine_url=engine_url, reported_role=role, engine_state="ready",
                  capacity=64, seen_at=at)


def answer(role: str, url: str, state: str = "ready") -> dict[str, Any]:
    return {"role": role, "engine": {"state": state, "url": url, "capacity": 64},
            "health": {"overall": "ok"}}


def test_a_member_card_names_the_checks_that_fail() -> None:
    warned = {"role": "decode", "engine": {"state": "ready", "url": DECODE1, "capacity": 64},
              "health": {"overall": "warn", "failing": ["weights.set"],
                         "failing_titles": ["Weights"]}}
    older = {**warned, "health": {"overall": "critical", "failing": ["gpu.3.temperature"]}}
    at = dt.datetime(2026, 5, 1, 12, 5, tzinfo=dt.UTC)
    for reply, words in ((warned, "a check warns: Weights"),
                         (older, "a check is critical: gpu.3.temperature")):
        view = build_view(EngineFacts(role="unified", state="stopped"),
                          [Observed(member_row(2, "decode", DECODE1), "ok", answer=reply)],
                          router_running=False, at=at, router=None)
        (card,) = build_overview(view, None, None, None).members
        assert card.health == words
    assert health_words("warn", ["GPU 3 temperature", "Weights", "Host load", "Shared memory"]
                        ) == ("4 checks warn or are critical: GPU 3 temperature, Weights, "
                              "Host load and 1 more")


def test_the_overview_puts_the_routers_view_beside_each_engine() -> None:
    at = dt.datetime(2026, 5, 1, 12, 5, tzinfo=dt.UTC)
    observed = [
        Observed(member_row(1, "prefill", PREFILL), "ok",
                 answer=answer("prefill", PREFILL)),
        Observed(member_row(2, "decode", DECODE1), "ok", answer=answer("decode", DECODE1)),
        Observed(member_row(3, "decode", DECODE2), "unreachable", "no answer within 5 s"),
    ]
    router = RouterReading(up=True, scrape=parse_router_metrics(scrape("one_decode_down")))
    view = build_view(EngineFacts(role="unified", state="stopped"), observed,
                      router_running=True, at=at, router=router.scrape)
    usage = UsageWindow(300.0, 12, 3000, 820.0, 1900.0)
    overview = build_overview(view, router, usage, None)
    prefill, decode1, decode2 = overview.members
    assert prefill.router_line == "healthy, circuit closed, 0 requests running"
    assert decode1.actions == ("stop", "restart") and decode1.health == "every check passes"
    assert decode2.router_line == ("taken out by its health checks, circuit closed, "
                                   "0 requests running")
    assert decode2.actions == ()  # it does not answer: nothing to offer
    assert overview.capacity == "1 of 1 prefill engine ready; decode capacity now 64 of 128 " \
        "running requests"
    assert overview.head.router_line == "not in the router: a unified box serves alone"
    assert overview.traffic == (
        "10.0 tokens/s generated over the last 5 minutes (12 answers)",
        "First token after 820 ms (median), 1.90 s for the slowest tenth, over the last 5 "
        "minutes")
    body = json.loads(json.dumps(overview_json(overview)))
    assert [m["router"]["healthy"] for m in body["members"]] == [True, True, False]
    assert body["capacity"] == 64 and body["capacity_total"] == 128
    assert body["traffic"]["ttft_p90_ms"] == 1900.0


def test_the_usage_window_reads_the_gateways_answers(db: Database) -> None:
    now = dt.datetime(2026, 5, 1, 12, 10, tzinfo=dt.UTC)

    def write(s: Session) -> None:
        for n, (ttft, outcome, ago) in enumerate([(100.0, "ok", 60), (300.0, "ok", 120),
                                                  (None, "ok", 30), (50.0, "queue_timeout", 10),
                                                  (999.0, "ok", 900)]):
            started = now - dt.timedelta(seconds=ago)
            s.add(UsageRequest(endpoint="chat", status=200, outcome=outcome,
                               completion_tokens=10 * (n + 1), started_at=started,
                               ended_at=started, ttft_ms=ttft))

    db.call(write)
    window = db.call(lambda s: usage_window(s, now))
    assert (window.requests, window.completion_tokens) == (3, 10 + 20 + 30)
    assert (window.ttft_p50_ms, window.ttft_p90_ms) == (300.0, 300.0)


def test_a_followed_rolling_restart_that_fails_exits_1(capsys: pytest.CaptureFixture[str]
                                                      ) -> None:
    """The CLI's verdict is its exit code: a rolling restart that stopped at a failure (or was
    cancelled) exits 1; one that finished exits 0; one left running unfollowed exits 0."""
    step = {"engine": "m1", "label": "member 1 (10.0.0.6)", "status": "failed",
            "message": "its engine crashed into its backoff"}

    def progress(state: str) -> dict[str, Any]:
        return {"role": "decode", "state": state, "message": "", "skipped": [],
                "steps": [{**step, "status": "done" if state != "failed" else "failed"}]}

    class Api:  # the daemon's answers, as `checked` reads them
        def __init__(self, state: str) -> None:
            self.state = state

        def post(self, path: str, json: Any) -> httpx.Response:
            return httpx.Response(202, json=progress(self.state))

    for state, code in (("failed", 1), ("cancelled", 1), ("done", 0), ("running", 0)):
        args = build_parser().parse_args(
            ["cell", "rolling-restart", "decode", "--yes"] + ["--no-wait"] * (state == "running"))
        assert cell_cli.run_ops(args, Api(state)) == code, state
    assert "member 1 (10.0.0.6): failed — its engine crashed" in capsys.readouterr().out
