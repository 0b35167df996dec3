"""A qualification that survives a blip (issue 23): a live daemon qualifying the real engine
emulator while the engine stops answering for a while (its whole process group is stopped
with SIGSTOP, so its /ready probe times out and the supervisor turns it DEGRADED, then
continued with SIGCONT: READY again).

- a loss of READY at the last step pauses that step and measures it again: the run
  finishes `done` with every earlier step kept, and says the round was measured again;
- a loss that outlasts the pause (`ready_wait`) ends the climb: the steps that passed are
  kept, the verdict says the box is admitted at the last of them ("at least") and which
  steps were not measured;
- neither is logged as an error with a traceback, and no verdict says "failed: failed:".

Waits on states (the qualification's phase, the engine's state), every wait bounded.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.conftest import Console, LiveServer, csrf
from tests.test_engine_api import wait_until
from tests.test_qualify_run import API, ready_box

__all__ = ["ready_box"]  # the fixture, shared with test_qualify_run

# 100 tokens at 10 ms each: a round lasts about a second, long enough to be caught measuring.
LADDER = {"ladder": [1, 2, 4], "repeats": 2, "input_tokens": 32, "output_tokens": 100,
          "floor": 5, "wedge_seconds": 60, "confirm": True}
BLIP_SECONDS = 5.0  # how long the engine stays away once the supervisor has seen it go


def engine_group(live: LiveServer) -> int:
    followed = live.runtime.supervisor._live
    assert followed is not None, "no engine is followed"
    return os.getpgid(followed.ident.pid)


@pytest.fixture
def stopped_group() -> Iterator[list[int]]:
    """Process groups a test stopped; each is continued at the end, whatever happened."""
    groups: list[int] = []
    yield groups
    for group in groups:
        os.killpg(group, signal.SIGCONT)


def progress_of(console: Console) -> dict[str, Any] | None:
    body: dict[str, Any] = console.http.get(f"{API}/").json()
    return body["progress"]


def measuring_at(console: Console, concurrency: int) -> bool:
    progress = progress_of(console)
    return progress is not None and progress["concurrency"] == concurrency \
        and progress["phase"] == "measuring"


def engine_state(live: LiveServer) -> str:
    return live.runtime.supervisor.status.state.value


def ended(console: Console, qid: int) -> dict[str, Any]:
    wait_until(lambda: console.http.get(f"{API}/{qid}").json()["state"] != "running",
               "the qualification to end", timeout=180)
    record: dict[str, Any] = console.http.get(f"{API}/{qid}").json()
    return record


def stop_at_the_last_step(live: LiveServer, console: Console,
                          stopped: list[int]) -> tuple[int, int]:
    """Start the ladder; once its last step measures, stop the engine's process group.
    Returns the qualification's id and the group (listed in `stopped` until continued)."""
    started = console.http.post(f"{API}/run", headers=csrf(console), json=LADDER)
    assert started.status_code == 202, started.text
    wait_until(lambda: measuring_at(console, 4), "the last step to be measuring")
    group = engine_group(live)
    os.killpg(group, signal.SIGSTOP)
    stopped.append(group)
    return int(started.json()["id"]), group


def no_traceback(caplog: pytest.LogCaptureFixture) -> None:
    bad = [r for r in caplog.records if r.name.startswith("appliance.qualify")
           and (r.levelno >= logging.ERROR or r.exc_info)]
    assert not bad, [r.getMessage() for r in bad]


def test_a_loss_of_ready_at_the_last_step_is_measured_again_and_the_run_finishes(
        ready_box: tuple[LiveServer, Console], stopped_group: list[int],
        caplog: pytest.LogCaptureFixture) -> None:
    live, console = ready_box
    caplog.set_level(logging.INFO)
    qid, group = stop_at_the_last_step(live, console, stopped_group)
    wait_until(lambda: engine_state(live) == "degraded", "the engine to turn DEGRADED")
    wait_until(lambda: "paused" in str((progress_of(console) or {}).get("phase")),
               "the step to pause")
    time.sleep(BLIP_SECONDS)  # the blip's length, not a wait for a state
    os.killpg(group, signal.SIGCONT)
    stopped_group.remove(group)

    record = ended(console, qid)
    assert record["state"] == "done", record
    assert [s["concurrency"] for s in record["steps"]] == [1, 2, 4]
    assert all(s["passed"] for s in record["steps"]), [s["reasons"] for s in record["steps"]]
    assert all(len(s["rounds"]) == 2 for s in record["steps"])  # the blip's round not kept
    assert record["qualified"] == 4
    assert "measured again after the engine left READY" in record["verdict"]
    events = live.runtime.db.call(lambda s: _events(s))
    assert any(f"qualification {qid} paused at 4 concurrent users" in e for e in events)
    assert any(f"qualification {qid} ended — qualified for at least 4" in e for e in events)
    assert not any("failed: failed:" in e for e in events)
    no_traceback(caplog)


def test_a_loss_that_outlasts_the_pause_keeps_the_passed_steps(
        ready_box: tuple[LiveServer, Console], stopped_group: list[int],
        caplog: pytest.LogCaptureFixture) -> None:
    live, console = ready_box
    live.runtime.qualify.ready_wait = 1.0  # the pause runs out while the engine is away
    qid, group = stop_at_the_last_step(live, console, stopped_group)
    record = ended(console, qid)
    os.killpg(group, signal.SIGCONT)
    stopped_group.remove(group)

    assert record["state"] == "done", record
    assert [s["concurrency"] for s in record["steps"]] == [1, 2]  # kept, all passed
    assert record["qualified"] == 2
    assert record["verdict"].startswith(
        "qualified for at least 2 concurrent users (the ladder stopped at 2: the engine left "
        "READY at 4 concurrent users and was not READY again within 1 s; not measured: 4)")
    assert record["verdict"].count("; the gateway admits at 2") == 1
    assert "not measured: 4" in record["error"]
    wait_until(lambda: engine_state(live) == "ready", "the engine to be READY again")
    status = console.http.get(f"{API}/").json()
    assert status["qualified"] == 2 and status["qualification"]["lower_bound"] is True
    no_traceback(caplog)


def _events(session: Any) -> list[str]:
    from sqlalchemy import select

    from appliance.db.models import Event

    return list(session.scalars(select(Event.message).where(Event.source == "qualify")))
