"""The engine admin API over real loopback HTTP, driving the engine emulator.

A live server (uvicorn in a thread) whose runtime supervises `appliance.testing.fake_sglang`
as a real detached process (process runner, dev profile, tiny model, 3 s start). Callers are
a logged-in console session (cookie + `X-CSRF-Token` from the `appliance_csrf` cookie) and an
admin API token. Covers status, launch spec, start → READY, runs with phases, log tail and its
filters, the log as server-sent events, the confirmation rule for stop (409 with the cost),
unknown actions, the audit trail, and CSRF refusal.

Every test stops its engine: the fixture kills the engine's process group on teardown, so no
emulator outlives a test even when an assertion fails half-way.
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from appliance.clock import SystemClock
from appliance.db.database import Database
from appliance.db.schema import migrate
from appliance.engine.logtail import line_level, line_rank
from appliance.engine.runner import EngineIdentity
from appliance.resources import migrations_dir
from appliance.runtime import Runtime, build_runtime
from appliance.testing.fake_gpus import FakeGpus
from tests.conftest import Console, LiveServer, add_admin, csrf
from tests.test_engine_lifecycle import engine_config, group_gone, prove_weights

DEADLINE = 90.0  # any single wait, on a loaded 2-core CI box
ENGINE = "/api/v1/engine"


# --- a live server whose supervisor drives the emulator ------------------------------------


@contextlib.contextmanager
def engine_server(root: Path, monkeypatch: pytest.MonkeyPatch,
                  load_seconds: str = "3", **env: str) -> Iterator[LiveServer]:
    """A live server over a dev box (process runner, emulator command, tiny model, free
    ports). On exit the daemon stops and then the engine's process group is killed."""
    gpu_state = root / "gpus.json"
    monkeypatch.setenv("FAKE_SGLANG_LOAD_SECONDS", load_seconds)
    monkeypatch.setenv("FAKE_SGLANG_GPU_STATE", str(gpu_state))
    monkeypatch.delenv("FAKE_SGLANG_FAULT", raising=False)
    config = engine_config(root / "box", **env)  # env: extra APPLIANCE_* values
    db = Database(config.database_url)
    migrate(db, migrations_dir(), config.paths.state_dir / "backups", SystemClock().now())
    prove_weights(config, db)
    runtime = build_runtime(config, db=db, gpus=FakeGpus(state_file=gpu_state),
                            engine_poll_seconds=0.1, engine_backoff_seconds=0.2)
    runtime.supervisor.ready_interval = 0.2
    live = LiveServer(runtime)
    try:
        live.start()
        yield live
    finally:
        kill_engine(runtime, live)
        db.dispose()


def kill_engine(runtime: Runtime, live: LiveServer) -> None:
    """Stop the daemon (the engine survives that by design), then kill the engine's group."""
    supervisor = runtime.supervisor
    idents: list[EngineIdentity] = []
    if supervisor._live is not None:
        idents.append(supervisor._live.ident)
    if live.thread.is_alive():
        live.stop()
    if supervisor._live is not None:  # launched while the daemon was stopping
        idents.append(supervisor._live.ident)
    found = supervisor.runner.find()
    if found is not None:
        idents.append(found)
    for ident in idents:
        supervisor.runner.kill(ident)
    end = time.monotonic() + 10
    while not all(group_gone(i.pid) for i in idents) and time.monotonic() < end:
        time.sleep(0.05)
    assert all(group_gone(i.pid) for i in idents), "an engine emulator outlived its test"


@pytest.fixture
def engine_box(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[LiveServer]:
    with engine_server(tmp_path, monkeypatch) as live:
        yield live


@pytest.fixture
def session(engine_box: LiveServer) -> Iterator[Console]:
    """A console session for admin `alice` (cookies kept; CSRF cookie set at /login)."""
    add_admin(engine_box.runtime)
    console = Console(engine_box.base_url)
    response = console.login()
    assert response.status_code == 303, response.text
    yield console
    console.close()


# --- helpers ---------------------------------------------------------------------------------


def post_action(console: Console, action: str, **body: Any) -> httpx.Response:
    return console.http.post(f"{ENGINE}/{action}", json=body, headers=csrf(console))


def state_of(http: httpx.Client) -> str:
    response = http.get(f"{ENGINE}/")
    assert response.status_code == 200, response.text
    state: str = response.json()["state"]
    return state


def wait_until(check: Callable[[], bool], what: str, timeout: float = DEADLINE) -> None:
    end = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < end, f"timed out after {timeout:.0f} s waiting for {what}"
        time.sleep(0.1)


def wait_state(http: httpx.Client, wanted: str, timeout: float = DEADLINE) -> list[str]:
    """Poll GET /api/v1/engine/ until `wanted`; the distinct states seen on the way."""
    seen: list[str] = []

    def reached() -> bool:
        state = state_of(http)
        if not seen or seen[-1] != state:
            seen.append(state)
        assert state != "failed", f"the engine failed on the way to {wanted}: {seen}"
        return state == wanted

    wait_until(reached, f"engine state {wanted!r} (seen {seen})", timeout)
    return seen


def append_log(path: Path, *lines: str) -> None:
    """Append whole lines to the engine log (the engine appends too: O_APPEND keeps both)."""
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    with path.open("a", encoding="utf-8") as handle:
        for line in lines:
            handle.write(line.replace("{stamp}", stamp) + "\n")


def audit(console: Console, action: str) -> list[dict[str, Any]]:
    response = console.http.get("/api/v1/audit", params={"action": action, "per_page": 100})
    assert response.status_code == 200, response.text
    items: list[dict[str, Any]] = response.json()["items"]
    return items


def new_token(console: Console) -> str:
    response = console.http.post("/api/v1/tokens", json={"name": "engine tests"},
                                 headers=csrf(console))
    assert response.status_code == 201, response.text
    token: str = response.json()["token"]
    return token


# --- tests -----------------------------------------------------------------------------------


STATUS_KEYS = {
    "state", "since", "message", "admits_requests", "run_id", "attempt", "adopted", "percent",
    "eta_seconds", "eta_basis", "stalled_seconds", "bytes_read", "weights_bytes",
    "gpu_bytes_used", "reason", "hint", "next_retry_at", "pending", "rollback_available",
    "expected_start_seconds", "log",
}


def test_stopped_engine_status_spec_unknown_action_and_csrf(
    engine_box: LiveServer, session: Console
) -> None:
    """Before any start: the status shape, the launch spec with provenance, a 404 for an
    unknown action, and a session POST without its CSRF header refused with nothing done."""
    http = session.http
    status = http.get(f"{ENGINE}/")
    assert status.status_code == 200, status.text
    body = status.json()
    assert set(body) >= STATUS_KEYS, STATUS_KEYS - set(body)
    assert body["state"] == "stopped" and body["admits_requests"] is False
    assert body["run_id"] is None and body["log"] is None and body["pending"] is None
    assert body["rollback_available"] is False and body["expected_start_seconds"] is None

    spec = http.get(f"{ENGINE}/spec")
    assert spec.status_code == 200, spec.text
    spec_body = spec.json()
    command = list(engine_box.runtime.config.engine.command)
    argv = spec_body["argv"]
    assert argv[:len(command) + 1] == [*command, "serve"], argv[:6]
    assert len(spec_body["spec_hash"]) == 64
    flags = spec_body["flags"]
    assert flags and {"flag", "value", "origin", "note"} <= set(flags[0])
    listed = [f["flag"] for f in flags]
    assert "--model-path" in listed and "--tp-size" in listed
    assert len(listed) == len(set(listed)), "a flag is listed twice"
    # Every flag of the argv is listed, each with a known origin.
    in_argv = {a.split("=", 1)[0] for a in argv[len(command) + 1:] if a.startswith("--")}
    assert in_argv == set(listed), in_argv ^ set(listed)
    assert {f["origin"] for f in flags} <= {"default", "profile", "tuning", "operator"}
    model = next(f for f in flags if f["flag"] == "--model-path")
    assert model["value"].endswith("moonshotai--Kimi-K3")

    unknown = post_action(session, "explode", confirm=True)
    assert unknown.status_code == 404, unknown.text
    assert unknown.headers["content-type"].startswith("application/problem+json")
    problem = unknown.json()
    assert problem["code"] == "engine_action_unknown" and problem["status"] == 404
    assert "explode" in problem["detail"] and problem["hint"]

    refused = http.post(f"{ENGINE}/start", json={})  # the session cookie, no X-CSRF-Token
    assert refused.status_code == 403, refused.text
    assert refused.headers["content-type"].startswith("application/problem+json")
    assert "CSRF" in refused.json()["detail"]
    wrong = http.post(f"{ENGINE}/start", json={}, headers={"X-CSRF-Token": "0" * 128})
    assert wrong.status_code == 403, wrong.text
    time.sleep(0.5)  # a queued start would have left STOPPED by now
    assert state_of(http) == "stopped"
    assert http.get(f"{ENGINE}/runs").json() == []
    assert audit(session, "engine.") == []


def test_start_ready_runs_log_stream_confirmed_stop_and_audit(
    engine_box: LiveServer, session: Console
) -> None:
    """The whole life through the API: start (session) → READY, runs and log, SSE, a stop
    refused without confirm (409 with the cost), refused without CSRF, then confirmed with
    an API token → STOPPED; both actions audited with actor and channel."""
    http = session.http
    log_path = engine_box.runtime.supervisor.log_path

    started = post_action(session, "start")
    assert started.status_code == 202, started.text
    assert started.json()["state"] in {"stopped", "preflight", "launching"}
    assert started.json()["pending"] == "start" or started.json()["state"] != "stopped"
    seen = wait_state(http, "ready")
    assert "loading_weights" in seen or "launching" in seen, seen

    status = http.get(f"{ENGINE}/").json()
    assert status["admits_requests"] is True and status["percent"] == 100.0
    assert status["run_id"] is not None and status["rollback_available"] is True
    assert status["log"]["ready"] is True and status["log"]["ranks"]
    assert status["expected_start_seconds"] and status["expected_start_seconds"] > 0

    runs = http.get(f"{ENGINE}/runs").json()
    assert len(runs) == 1, runs
    run = runs[0]
    assert run["id"] == status["run_id"] and run["attempt"] == 1 and run["ended_at"] is None
    assert run["runner"] == "process" and run["ready_seconds"] > 0
    assert run["spec_hash"] == http.get(f"{ENGINE}/spec").json()["spec_hash"]
    phases = [p[0] for p in run["phases"]]
    assert phases[0] == "launching" and "loading_weights" in phases and phases[-1] == "ready"
    assert http.get(f"{ENGINE}/runs", params={"limit": 0}).status_code == 400

    # The log tail and its filters.
    tail = http.get(f"{ENGINE}/log", params={"lines": 50}).json()["lines"]
    assert len(tail) == 50, len(tail)
    assert any("The server is fired up and ready to roll" in line for line in tail)
    ranked = http.get(f"{ENGINE}/log", params={"lines": 5000, "rank": 1}).json()["lines"]
    ranks = {line_rank(line) for line in ranked}
    assert ranks == {1, None}, ranks  # TP1 and the main process, no other rank
    assert any("TP1] Load weight end" in line for line in ranked)
    warnings = http.get(f"{ENGINE}/log", params={"lines": 5000, "level": "warning"}).json()
    assert warnings["lines"] and all(line_level(x) != "info" for x in warnings["lines"])
    assert any("is capped to" in line for line in warnings["lines"])
    append_log(log_path, "[{stamp} TP1] RuntimeError: written by the test (TP1 error)",
               "[{stamp} TP0] RuntimeError: written by the test (TP0 error)")
    errors = http.get(f"{ENGINE}/log", params={"level": "error"}).json()["lines"]
    assert [e.split("] ", 1)[1] for e in errors] == [
        "RuntimeError: written by the test (TP1 error)",
        "RuntimeError: written by the test (TP0 error)"]
    both = http.get(f"{ENGINE}/log", params={"level": "error", "rank": 1}).json()["lines"]
    assert [line_rank(e) for e in both] == [1]
    assert http.get(f"{ENGINE}/log", params={"lines": 0}).status_code == 400

    # The stream: new lines as server-sent events, filtered by rank like the tail.
    events = read_stream(session, log_path, {"rank": "1"},
                         enough=lambda got: sum("sse marker" in e for e in got) >= 2)
    assert sum("sse marker" in e for e in events) >= 2, events
    assert all(line_rank(e) in (1, None) for e in events), events
    assert not any("TP0] sse marker" in e for e in events), events

    # Stop without confirm: refused with the cost, and nothing happens.
    unconfirmed = post_action(session, "stop")
    assert unconfirmed.status_code == 409, unconfirmed.text
    assert unconfirmed.headers["content-type"].startswith("application/problem+json")
    problem = unconfirmed.json()
    assert problem["code"] == "confirmation_required"
    assert re.search(r"\d+ (seconds|minutes)", problem["detail"]), problem
    assert "start" in problem["detail"], problem
    assert "confirm" in problem["hint"]
    no_csrf = http.post(f"{ENGINE}/stop", json={"confirm": True})
    assert no_csrf.status_code == 403, no_csrf.text
    time.sleep(0.5)
    assert state_of(http) == "ready"

    # Stop with confirm, through an admin API token (no CSRF for a bearer caller).
    token = new_token(session)
    with httpx.Client(base_url=engine_box.base_url, timeout=10,
                      headers={"Authorization": f"Bearer {token}"}) as api:
        stopped = api.post(f"{ENGINE}/stop", json={"confirm": True})
        assert stopped.status_code == 202, stopped.text
        assert stopped.json()["pending"] == "stop" or stopped.json()["state"] != "ready"
        seen = wait_state(api, "stopped")
    assert "ready" not in seen[1:], seen
    final = http.get(f"{ENGINE}/runs").json()[0]
    assert final["ended_at"] is not None and final["reason"] == "stopped"
    assert final["phases"][0][0] == "launching"  # every phase: see the xfail test below

    starts, stops = audit(session, "engine.start"), audit(session, "engine.stop")
    assert [(a["actor"], a["outcome"], a["detail"]) for a in starts] == [
        ("alice", "ok", {"via": "api:session"})]
    assert [(a["actor"], a["outcome"], a["detail"]) for a in stops] == [
        ("alice", "ok", {"via": "api:token"})]  # the refused attempts are not actions
    assert starts[0]["target"] == engine_box.runtime.config.engine.served_model_name
    assert starts[0]["address"] == "127.0.0.1"


def read_stream(console: Console, log_path: Path, params: dict[str, str],
                enough: Callable[[list[str]], bool], timeout: float = 20.0,
                most: int = 500) -> list[str]:
    """Read `data:` lines from /log/stream until `enough` says so, while a writer appends
    marker lines for TP0 and TP1 (the stream starts at the end of the file, so the writer
    keeps going until the reader is done; the engine's own lines come too). Bounded by
    `most` events and by `timeout`."""
    done = threading.Event()

    def writer() -> None:
        n = 0
        while not done.wait(0.2) and n < 200:
            n += 1
            append_log(log_path, f"[{{stamp}} TP0] sse marker {n}",
                       f"[{{stamp}} TP1] sse marker {n}")

    thread = threading.Thread(target=writer, daemon=True)
    events: list[str] = []
    end = time.monotonic() + timeout
    try:
        with console.http.stream("GET", f"{ENGINE}/log/stream", params=params,
                                 timeout=httpx.Timeout(10, read=timeout)) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            thread.start()
            for line in response.iter_lines():
                if line.startswith("data:"):
                    events.append(line[5:].removeprefix(" "))
                if enough(events) or len(events) >= most or time.monotonic() > end:
                    break
    finally:
        done.set()
        if thread.is_alive():
            thread.join(timeout=5)
    return events


def test_refused_start_is_not_audited_as_done(engine_box: LiveServer, session: Console) -> None:
    """A second start while the first one loads is refused (409); the audit log must not say
    it was done."""
    assert post_action(session, "start").status_code == 202

    def launched() -> bool:  # the start command has finished (a second one while it is
        body = session.http.get(f"{ENGINE}/").json()  # pending is the same action)
        return body["pending"] is None and body["state"] not in ("stopped", "preflight")

    wait_until(launched, "a launch")
    again = post_action(session, "start")
    assert again.status_code == 409, again.text
    assert again.json()["code"] == "engine_command_refused"
    assert "already" in again.json()["detail"]
    done = [a for a in audit(session, "engine.start") if a["outcome"] == "ok"]
    assert len(done) == 1, done


def test_run_records_every_phase_in_order(engine_box: LiveServer, session: Console) -> None:
    """The run's phase list is the start order up to READY, then draining, stopping and
    stopped: a stopped run says so (it said "stopping", issue 23)."""
    assert post_action(session, "start").status_code == 202
    wait_state(session.http, "ready")
    assert post_action(session, "stop", confirm=True).status_code == 202
    wait_state(session.http, "stopped")

    def last_run() -> dict[str, Any]:
        return dict(session.http.get(f"{ENGINE}/runs").json()[0])

    # phase writes run in order but may land after the state is shown
    wait_until(lambda: [p[0] for p in last_run()["phases"]][-1:] == ["stopped"],
               "the stopped phase recorded")
    run = last_run()
    phases = [p[0] for p in run["phases"]]
    start = ["launching", "loading_weights", "allocating", "capturing_graphs", "warming",
             "ready"]
    assert phases[:phases.index("ready") + 1] == [p for p in start if p in phases], phases
    assert phases[-4:] == ["ready", "draining", "stopping", "stopped"], phases
    assert run["state"] == "stopped", run


def test_the_cli_says_a_queued_command_is_queued_not_done() -> None:
    """The API answers as soon as a command is queued: the CLI must not present the state the
    command found (a failed preflight from before, say) as its outcome."""
    from appliance.engine.cli import describe_status

    text = describe_status({"state": "stopped", "message": "preflight failed: port held",
                            "pending": "start", "reason": "preflight", "hint": "free it"})
    assert text.splitlines()[0].startswith("requested: start (queued")
    assert "engine: stopped" in text
    assert "requested" not in describe_status({"state": "ready", "message": "ready",
                                               "pending": None})
