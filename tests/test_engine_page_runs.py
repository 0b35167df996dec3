"""The Engine page shows one run's figures, labelled, and a card that fits the state.

Part one renders the status card (the real template, the console's filters) for each state:
a load's progress only while a start is under way, the stop's facts instead while draining,
stopping or stopped (a stopping engine's 100 % bar from the load is not shown), and only the
actions that state accepts.

Part two is the issue's scenario over real HTTP: a log holding two runs of different sizes (a
DSPARK start with 66 state slots and a "capped to 13" warning, then a start without
speculative decoding, caught while it allocates its 332 slots), a daemon that restarts and
adopts the engine still running, and the Engine page: the latest run's figures only, labelled
with the run they came from. Then a stop from the console: the stop's facts, Start alone.
The engine here is a runner whose process is a record (a real class behind the runner port):
the adoption, the log parse and the page are the production code.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from litestar.plugins.jinja import JinjaTemplateEngine

from appliance.clock import SystemClock
from appliance.config import Config
from appliance.db.database import Database
from appliance.engine.args import LaunchSpec
from appliance.engine.records import RunRecord, open_run
from appliance.engine.runner import EngineIdentity
from appliance.engine.states import EngineState
from appliance.engine.supervisor import EngineStatus
from appliance.engine.views import status_dict
from appliance.resources import templates_dir
from appliance.runtime import Runtime, build_runtime
from appliance.testing.fake_gpus import FakeGpus
from appliance.ui.engine import card_actions, restarting, stop_facts
from appliance.ui.templating import configure_templates
from tests.conftest import Console, make_config, wait_for

LOGS = Path(__file__).parent / "data" / "engine_logs"
AT = dt.datetime(2026, 12, 1, 12, 0, 5, tzinfo=dt.UTC)
MIB = 1 << 20


def _card(status: EngineStatus, runs: list[RunRecord] | None = None) -> str:
    engine = JinjaTemplateEngine(directory=templates_dir())
    configure_templates(engine)
    runs = runs or []
    context: dict[str, Any] = {
        "engine": status, "cost": "a start takes about 90 minutes", "error": "",
        "error_hint": "", "runs": runs, "oob_runs": False,
        "shows_progress": status.state in {EngineState.LOADING_WEIGHTS, EngineState.ADOPTED},
        "actions_offered": card_actions(status),
        "stop_facts": stop_facts(status, runs[0] if runs else None, drain_seconds=300,
                                 kill_after_seconds=60),
        "restarting": restarting(status),
        "log_run": None,
        # an operator's page (the role guard's `can()` reads the signed-in user)
        "request": SimpleNamespace(scope={"user": SimpleNamespace(role="operator")})}
    return engine.engine.get_template("partials/engine_status.html").render(context)


def _buttons(html: str) -> list[str]:
    return re.findall(r"<button[^>]*>([^<]+)</button>", html)


def _run(**changes: Any) -> RunRecord:
    base = RunRecord(
        id=7, started_at=AT, runner="process", spec_hash="h", spec_json="{}",
        identity_json=None, attempt=1, adopted=True, state="stopped", phases=[],
        ready_at=None, ready_seconds=None, ended_at=AT + dt.timedelta(seconds=42),
        exit_code=-15, reason="stopped", hint="stopped by alice", figures={}, log_path="x")
    return dataclasses.replace(base, **changes)


# --- the card, state by state ------------------------------------------------------------------

LOADED = {"percent": 100.0, "bytes_read": int(100.9 * MIB), "weights_bytes": int(96.1 * MIB),
          "run_id": 7, "adopted": True}


def test_a_stopping_engine_shows_the_stop_not_the_load_and_offers_nothing() -> None:
    status = EngineStatus(state=EngineState.STOPPING, since=AT, message="stopping: SIGTERM sent",
                          **LOADED)
    html = _card(status)
    assert "<progress" not in html and "read" not in html and "100%" not in html
    assert "SIGTERM sent at 2026-12-01 12:00:05 UTC" in html
    assert "up to 60 s to exit" in html
    assert _buttons(html) == []
    assert "No action while the engine stops" in html


def test_a_draining_engine_says_since_when_and_how_many_are_in_flight() -> None:
    status = EngineStatus(state=EngineState.DRAINING, since=AT,
                          message="draining: 3 requests in flight", **LOADED)
    html = _card(status)
    assert "<progress" not in html
    assert "draining since 2026-12-01 12:00:05 UTC" in html and "after 300 s" in html
    assert "Now: draining: 3 requests in flight." in html
    assert _buttons(html) == []


def test_a_stopped_engine_tells_how_its_run_ended_and_offers_start_alone() -> None:
    status = EngineStatus(state=EngineState.STOPPED, since=AT, message="stopped", run_id=7,
                          adopted=True)
    html = _card(status, [_run()])
    assert ("Run 7 (adopted after a daemon restart), started 2026-12-01 12:00:05 UTC, ended "
            "2026-12-01 12:00:47 UTC: stopped by alice; killed by SIGTERM.") in html
    # The adoption belongs to the run it describes, not to the stopped state's heading.
    heading = re.search(r"<h2>(.*?)</h2>", html, re.S)
    assert heading and "adopted" not in heading.group(1)
    assert _buttons(html) == ["Start"]
    assert "T12:00" not in html and "+00:00" not in html  # no raw ISO times


@pytest.mark.parametrize("state", [EngineState.DRAINING, EngineState.STOPPING,
                                   EngineState.STOPPED])
def test_a_restart_under_way_shows_the_restart_and_offers_no_start(state: EngineState) -> None:
    """Issue 23: between a restart's stop and its start the card said "Stopped — restart in
    progress" beside a Start button, a second start the restart does by itself."""
    status = EngineStatus(state=state, since=AT, message="stopped", pending="restart",
                          run_id=7)
    html = _card(status, [_run()])
    assert _buttons(html) == []
    assert "Restart under way: the engine" in html and "No action while the engine restarts" in html
    assert "restart in progress" not in html
    # A plain stop still offers its Start once stopped.
    assert _buttons(_card(EngineStatus(state=EngineState.STOPPED, since=AT, message="stopped"),
                          [_run()])) == ["Start"]


@pytest.mark.parametrize(("state", "expected"), [
    (EngineState.LOADING_WEIGHTS, ["Stop"]),
    (EngineState.PREFLIGHT, ["Stop"]),
    (EngineState.READY, ["Stop", "Restart"]),
    (EngineState.DEGRADED, ["Stop", "Restart"]),
    (EngineState.ADOPTED, ["Stop", "Restart"]),
    (EngineState.BACKOFF, ["Start now", "Stop retrying"]),
    (EngineState.FAILED, ["Start"]),
])
def test_each_state_offers_only_the_actions_it_accepts(state: EngineState,
                                                       expected: list[str]) -> None:
    assert _buttons(_card(EngineStatus(state=state, since=AT, message="m"))) == expected


def test_a_loading_engine_shows_its_progress_and_the_failed_one_its_rollback() -> None:
    loading = _card(EngineStatus(state=EngineState.LOADING_WEIGHTS, since=AT, message="loading",
                                 percent=40.0, bytes_read=40 * MIB, weights_bytes=100 * MIB))
    assert "<progress" in loading and "41.94 MB of 104.86 MB read" in loading
    failed = _card(EngineStatus(state=EngineState.FAILED, since=AT, message="failed",
                                reason="out_of_memory", hint="lower it",
                                rollback_available=True))
    assert _buttons(failed) == ["Start", "Roll back and start"]
    assert "Reason: <strong>out of memory</strong>" in failed


# --- two runs in one log, a daemon restart, the page ------------------------------------------


class RecordedEngine:
    """The runner port over an engine that is a record: running until told to stop. Nothing
    here launches; a launch would be a second engine, which adoption must never start."""

    name = "process"

    def __init__(self, ident: EngineIdentity) -> None:
        self.ident = ident
        self.running = True

    def launch(self, spec: LaunchSpec, log_path: Path) -> EngineIdentity:
        raise AssertionError("the daemon launched a second engine instead of adopting")

    def engine_log(self, log_dir: Path) -> Path:
        return Path(self.ident.log_path)

    def find(self) -> EngineIdentity | None:
        return self.ident if self.running else None

    def alive(self, ident: EngineIdentity) -> bool:
        return self.running

    def exit_status(self, ident: EngineIdentity) -> int | None:
        return None if self.running else -15

    def terminate(self, ident: EngineIdentity) -> None:
        self.running = False

    def kill(self, ident: EngineIdentity) -> None:
        self.running = False

    def forget(self) -> None:
        pass

    def read_bytes(self, ident: EngineIdentity, pids: set[int]) -> int:
        return 0


def _gone_pid() -> int:
    """A pid no process has now (a child that has exited and been reaped)."""
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           capture_output=True, text=True, check=True)
    return int(child.stdout)


@pytest.fixture
def config(tmp_path: Path) -> Config:
    return make_config(tmp_path / "appliance", APPLIANCE_ENGINE_DRAIN_SECONDS="0",
                       APPLIANCE_ENGINE_KILL_AFTER_SECONDS="5")


@pytest.fixture
def engine_log(config: Config) -> Path:
    """A DSPARK run, then a run without speculative decoding cut while it allocates."""
    sample = (LOGS / "k3_startup.sample.log").read_bytes()
    allocating = sample[:sample.rindex(b"\n", 0, sample.index(b"CUDA graph begin")) + 1]
    path = config.paths.log_dir / "engine.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes((LOGS / "dspark_startup.log").read_bytes() + allocating)
    return path


@pytest.fixture
def runtime(config: Config, db: Database, engine_log: Path) -> Runtime:
    """The daemon after its restart: the run it opened before is still open in the database,
    and its engine still runs."""
    ident = EngineIdentity("process", _gone_pid(), 0.0, "spec-of-the-second-run", str(engine_log))
    db.call(lambda s: open_run(s, at=AT, runner="process", spec_hash=ident.spec_hash,
                               spec_json="{}", attempt=1, state="allocating",
                               log_path=str(engine_log), identity_json=ident.to_json()))
    return build_runtime(config, clock=SystemClock(), db=db, runner=RecordedEngine(ident),
                         gpus=FakeGpus(), engine_poll_seconds=0.1)


@pytest.fixture
def page(runtime: Runtime, logged_in: Console) -> Iterator[Console]:
    yield logged_in


def _status_card(console: Console) -> str:
    response = console.http.get("/engine/status")
    assert response.status_code == 200, response.text
    return response.text


def test_after_a_daemon_restart_the_page_shows_only_the_latest_runs_figures(
    page: Console, runtime: Runtime
) -> None:
    assert runtime.supervisor.status.adopted
    # Adopted, the engine is ADOPTED until the supervisor's first read of its log finds it
    # allocating: wait for that state (a loaded box's first poll comes late), not a time.
    wait_for(lambda: runtime.supervisor.status.state is EngineState.ALLOCATING,
             "the adopted engine's log to show it allocating")
    log = status_dict(runtime.supervisor.status)["log"]  # the API's figures say the same
    assert log["engine_run_id"] == 1 and (log["run"]["number"], log["run"]["of"]) == (2, 2)
    assert {rank["state_slots"] for rank in log["ranks"]} == {332} and log["warnings"] == []
    html = page.http.get("/engine").text
    memory = html[html.index('id="engine-log-figures"'):html.index('id="engine-runs"')]
    assert "GiB for 332 slots" in memory
    assert "66 slots" not in memory and "capped to 13" not in memory
    assert "Max running requests is reset" not in memory  # the DSPARK run's warnings
    assert ("From the log of run 1 (adopted after a daemon restart), started 2026-12-01 "
            "12:00:05 UTC: run 2 of 2 in the log file, from line 132.") in memory
    assert memory.count("<tr><td>TP") == 8
    card = html[html.index('id="engine-status"'):html.index('id="engine-log-figures"')]
    heading = re.search(r"<h2>(.*?)</h2>", card, re.S)
    assert heading and "(run 1, adopted after a daemon restart)" in heading.group(1)
    assert _buttons(card) == ["Stop"]  # allocating: a start under way

    token = page.page_token("/engine")
    stopped = page.http.post("/engine/stop", data={"confirm": "yes", "_csrf_token": token},
                             headers={"HX-Request": "true"})
    assert stopped.status_code == 200, stopped.text
    card = wait_for(lambda: (text := _status_card(page)) and "state-stopped" in text and text,
                    "the engine to stop")
    assert "<progress" not in card
    assert re.search(r"Run 1 \(adopted after a daemon restart\), started 2026-12-01 12:00:05 "
                     r"UTC, ended \d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC: stopped by alice"
                     r"[^;]*; SIGTERM sent at \d\d:\d\d:\d\d UTC; [^<]*killed by SIGTERM\.",
                     card), card
    heading = re.search(r"<h2>(.*?)</h2>", card, re.S)
    assert heading and "adopted" not in heading.group(1)
    assert _buttons(card[:card.index("</section>")]) == ["Start"]
    # The Runs table says what happened to the run: it stopped (it said "stopping", the
    # state it was in when the record was last written).
    runs = card[card.index('id="engine-runs"'):]
    row = re.search(r"<tr><td>1</td>.*?</tr>", runs, re.S)
    assert row and "<td>stopped</td>" in row.group(0) and "stopping" not in row.group(0), runs
