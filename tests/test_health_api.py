"""The health admin API (`/api/v1/health`) over real loopback HTTP.

A live server whose runtime has eight fake GPUs (`FakeGpus`, GPU 3 running hot), a fixed
engine reading (a stand-in watcher: serving, figures known) and a fixed host reading, under
the real `HealthMonitor`; a console session (cookie + X-CSRF-Token). Covers the snapshot's
shape, "check now", the history and the series, muting and unmuting (audited, counted out of
the overall status), and each bad input refused with a clear 4xx that changes nothing.

`rig` and `seed_hour` are shared with the UI and browser tests.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from appliance.config import Config
from appliance.db.database import Database
from appliance.db.journal import list_audit
from appliance.health import history
from appliance.health.alerts import Alerts
from appliance.health.model import (
    ENGINE_THROUGHPUT,
    ENGINE_TOKEN_USAGE,
    GPU_POWER,
    GPU_TEMPERATURE,
    GPU_UTILIZATION,
    EngineFigures,
    Sample,
)
from appliance.health.monitor import HealthMonitor
from appliance.runtime import Runtime, build_runtime
from appliance.testing.clock import FakeClock
from appliance.testing.fake_gpus import FakeGpus
from tests.conftest import Console, csrf, problem
from tests.test_health_host import roomy_host

API = "/api/v1/health"
GIB = 1 << 30
HOT = 3  # GPU 3 runs hot in every test here


class FixedWatcher:
    """The engine as the monitor sees it: serving, with figures (a stand-in for
    `EngineWatcher`, which needs a live engine)."""

    async def poll(self, state: Any, now: dt.datetime) -> EngineFigures:
        return EngineFigures(at=now, state="ready", ready=True, running_requests=3,
                             queued_requests=1, token_usage=0.42, cache_hit_rate=0.63,
                             generation_tokens_per_second=1234.0, ttft_p50_seconds=0.35,
                             ttft_p90_seconds=1.2)


def rig(config: Config, db: Database, clock: FakeClock, gpus: FakeGpus) -> Runtime:
    """A runtime whose monitor reads `gpus`, the fixed engine and the fixed host."""
    runtime = build_runtime(config, clock=clock, db=db, gpus=gpus)
    alerts = Alerts(db=db, clock=clock, url="", retries=0, box="test", version="test")
    runtime.health = HealthMonitor(
        config=config, db=db, clock=clock, gpus=gpus, supervisor=runtime.supervisor,
        watcher=FixedWatcher(), read_host=roomy_host, alerts=alerts)
    return runtime


def seed_hour(runtime: Runtime) -> None:
    """An hour of samples every 30 s for every GPU and the engine, with a 10-minute gap
    (the daemon was down) twenty minutes ago."""
    now = runtime.clock.now()

    def write(s: Any) -> None:
        for step in range(120):
            at = now - dt.timedelta(seconds=30 * (119 - step))
            if now - dt.timedelta(minutes=30) < at < now - dt.timedelta(minutes=20):
                continue
            samples = [Sample(ENGINE_TOKEN_USAGE, "", 0.2 + step / 400),
                       Sample(ENGINE_THROUGHPUT, "", 800.0 + step * 3)]
            for gpu in range(8):
                hot = 30.0 if gpu == HOT else 0.0
                samples += [Sample(GPU_TEMPERATURE, str(gpu), 55.0 + hot + step % 5),
                            Sample(GPU_POWER, str(gpu), 600.0 + step),
                            Sample(GPU_UTILIZATION, str(gpu), float(step % 100))]
            history.record_samples(s, at, samples)

    runtime.db.call(write)


@pytest.fixture
def gpus() -> FakeGpus:
    fake = FakeGpus(8)
    for index in range(8):
        fake.set_fields(index, temperature_c=55.0 + index, power_w=700.0, utilization_pct=80.0)
    fake.set_fields(HOT, temperature_c=95.0)
    return fake


@pytest.fixture
def runtime(config: Config, db: Database, clock: FakeClock, gpus: FakeGpus) -> Runtime:
    return rig(config, db, clock, gpus)


@pytest.fixture
def checked(logged_in: Console) -> Console:
    """Logged in, with every check run once."""
    response = logged_in.http.post(f"{API}/check", headers=csrf(logged_in))
    assert response.status_code == 200, response.text
    return logged_in


def audit(runtime: Runtime) -> list[tuple[str, str, str, dict[str, Any]]]:
    entries = runtime.db.call(lambda s: list_audit(s, action="health.", per_page=500)).items
    return [(a.action, a.actor, a.target, a.detail) for a in reversed(entries)]


def mutes(runtime: Runtime) -> list[history.MuteView]:
    return runtime.db.call(history.mutes)


def check(body: dict[str, Any], check_id: str) -> dict[str, Any]:
    found: dict[str, Any] = next(c for c in body["checks"] if c["id"] == check_id)
    return found


# --- reading ----------------------------------------------------------------------------------


def test_the_snapshot(checked: Console, clock: FakeClock) -> None:
    response = checked.http.get(API)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["at"] == clock.now().isoformat().replace("+00:00", "Z")
    assert body["overall"] == "critical"  # GPU 3 at 95 °C
    hot = check(body, f"gpu.{HOT}.temperature")
    assert hot["level"] == "critical" and hot["group"] == "gpu" and not hot["muted"]
    assert "95" in hot["summary"] and hot["hint"]
    assert check(body, "gpu.0.temperature")["level"] == "ok"
    assert {c["group"] for c in body["checks"]} == {"gpu", "engine", "host", "weights"}
    assert check(body, "engine.ready")["level"] == "ok"
    assert check(body, "engine.ready")["checked"] is True  # this rig's engine serves
    assert len(body["gpus"]["gpus"]) == 8
    assert body["gpus"]["gpus"][HOT]["temperature_c"] == 95.0
    assert body["engine"]["generation_tokens_per_second"] == 1234.0
    assert body["engine"]["ttft_p90_seconds"] == 1.2
    assert body["host"]["models_free_bytes"] == 2000 * GIB


def test_check_now_runs_the_checks_again(checked: Console, gpus: FakeGpus,
                                         clock: FakeClock) -> None:
    gpus.set_fields(HOT, temperature_c=60.0)
    clock.advance(30)
    response = checked.http.post(f"{API}/check", headers=csrf(checked))
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["at"] == clock.now().isoformat().replace("+00:00", "Z")
    assert check(body, f"gpu.{HOT}.temperature")["level"] == "ok"


def test_history(checked: Console, gpus: FakeGpus, clock: FakeClock) -> None:
    gpus.set_fields(HOT, temperature_c=60.0)
    clock.advance(60)
    checked.http.post(f"{API}/check", headers=csrf(checked))
    body = checked.http.get(f"{API}/history", params={"check": f"gpu.{HOT}.temperature"}).json()
    assert [(t["kind"], t["previous_level"], t["level"]) for t in body] == [
        ("recovery", "critical", "ok"), ("failure", "ok", "critical")]
    assert body[1]["check"] == f"gpu.{HOT}.temperature" and "95" in body[1]["summary"]
    every = checked.http.get(f"{API}/history", params={"limit": 1}).json()
    assert len(every) == 1 and every[0]["kind"] == "recovery"
    later = (clock.now() + dt.timedelta(seconds=-30)).isoformat()
    recent = checked.http.get(f"{API}/history", params={"since": later}).json()
    assert [t["kind"] for t in recent] == ["recovery"]
    # A check that exists but never changed: an empty list, not a 404.
    assert checked.http.get(f"{API}/history", params={"check": "gpu.0.temperature"}).json() == []


def test_series(checked: Console, runtime: Runtime, clock: FakeClock) -> None:
    seed_hour(runtime)
    body = checked.http.get(f"{API}/series", params={"name": GPU_TEMPERATURE,
                                                     "subject": str(HOT)}).json()
    assert body["name"] == GPU_TEMPERATURE and body["subject"] == str(HOT)
    assert 90 < len(body["points"]) <= 121
    assert all(p["value"] >= 85 for p in body["points"])
    engine = checked.http.get(f"{API}/series", params={"name": ENGINE_THROUGHPUT}).json()
    assert engine["subject"] == "" and engine["points"][-1]["value"] == 800.0 + 119 * 3


# --- mutes ------------------------------------------------------------------------------------


def test_mute_and_unmute(checked: Console, runtime: Runtime, clock: FakeClock) -> None:
    hot = f"gpu.{HOT}.temperature"
    response = checked.http.post(f"{API}/mutes", headers=csrf(checked),
                                 json={"check": hot, "minutes": 60, "reason": "fan swap"})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["id"] == hot and body["muted"] is True and body["level"] == "critical"
    assert body["mute"]["by"] == "alice" and body["mute"]["reason"] == "fan swap"
    until = dt.datetime.fromisoformat(body["mute"]["until"])
    assert until == clock.now() + dt.timedelta(hours=1)
    snapshot = checked.http.get(API).json()
    assert check(snapshot, hot)["muted"] is True
    # Only the muted check was critical: the box is OK (the hot GPU's power may warn).
    assert snapshot["overall"] in ("ok", "warn")

    response = checked.http.post(f"{API}/mutes", headers=csrf(checked),
                                 json={"check": hot, "minutes": None})
    assert response.json()["mute"]["until"] is None  # replaced: until unmuted
    response = checked.http.delete(f"{API}/mutes/{hot}", headers=csrf(checked))
    assert response.status_code == 200, response.text
    assert response.json()["muted"] is False
    assert checked.http.get(API).json()["overall"] == "critical"
    again = checked.http.delete(f"{API}/mutes/{hot}", headers=csrf(checked))
    assert again.status_code == 200  # idempotent
    assert [(a, who, target) for a, who, target, _ in audit(runtime)] == [
        ("health.mute", "alice", hot), ("health.mute", "alice", hot),
        ("health.unmute", "alice", hot), ("health.unmute", "alice", hot)]
    assert mutes(runtime) == []


def test_a_mute_expires(checked: Console, clock: FakeClock) -> None:
    hot = f"gpu.{HOT}.temperature"
    checked.http.post(f"{API}/mutes", headers=csrf(checked), json={"check": hot, "minutes": 1})
    assert check(checked.http.get(API).json(), hot)["muted"] is True
    clock.advance(61)
    assert check(checked.http.get(API).json(), hot)["muted"] is False


@pytest.mark.parametrize(("body", "status", "code"), [
    ({"check": "gpu.3.temperature", "minutes": -5}, 400, "health_mute_invalid"),
    ({"check": "gpu.3.temperature", "minutes": 0}, 400, "health_mute_invalid"),
    ({"check": "gpu.3.temperature", "minutes": 10**9}, 400, "health_mute_invalid"),
    ({"check": "gpu.3.temperature", "minutes": True}, 400, None),
    ({"check": "gpu.3.temperature"}, 400, None),  # minutes must be given (null: forever)
    ({"check": "gpu.3.temperature", "minutes": 60, "muted": True}, 400, None),
    ({"check": "gpu.3.temperature", "minutes": 60, "reason": "x" * 501}, 400,
     "health_mute_invalid"),
    ({"check": "gpu.42.temperature", "minutes": 60}, 404, "health_check_unknown"),
    ({"check": "", "minutes": 60}, 404, "health_check_unknown"),
])
def test_bad_mutes_change_nothing(checked: Console, runtime: Runtime, body: dict[str, Any],
                                  status: int, code: str | None) -> None:
    response = checked.http.post(f"{API}/mutes", headers=csrf(checked), json=body)
    answer = problem(response, status, code)
    if status == 404:
        assert "GET /api/v1/health lists the checks" in answer["hint"]
    assert mutes(runtime) == [] and audit(runtime) == []
    assert checked.http.get(API).json()["overall"] == "critical"


def test_unmuting_an_unknown_check_is_a_404(checked: Console, runtime: Runtime) -> None:
    problem(checked.http.delete(f"{API}/mutes/gpu.42.power", headers=csrf(checked)), 404,
            "health_check_unknown")
    assert audit(runtime) == []


@pytest.mark.parametrize(("path", "params", "code"), [
    ("/history", {"since": "yesterday"}, "health_since_invalid"),
    ("/history", {"since": "2999-01-01"}, "health_since_invalid"),
    ("/history", {"limit": "0"}, None),
    ("/history", {"limit": "5000"}, None),
    ("/history", {"check": "gpu.42.power"}, "health_check_unknown"),
    ("/series", {"name": "gpu.fan_rpm", "subject": "0"}, "health_series_unknown"),
    ("/series", {"name": GPU_TEMPERATURE}, "health_series_subject"),
    ("/series", {"name": GPU_TEMPERATURE, "subject": "x"}, "health_series_subject"),
    ("/series", {"name": ENGINE_THROUGHPUT, "subject": "0"}, "health_series_subject"),
    ("/series", {}, None),
])
def test_bad_queries(checked: Console, path: str, params: dict[str, str],
                     code: str | None) -> None:
    response = checked.http.get(f"{API}{path}", params=params)
    assert response.status_code in (400, 404), response.text
    problem(response, response.status_code, code)


def test_the_door_is_closed_without_a_login(server: Any, tmp_path: Path) -> None:
    with httpx.Client(base_url=server.base_url) as anonymous:
        assert anonymous.get(API).status_code == 401
        assert anonymous.post(f"{API}/check").status_code == 401
        assert anonymous.post(f"{API}/mutes", json={"check": "x", "minutes": 1}
                              ).status_code == 401


def test_unsafe_methods_need_the_csrf_header(checked: Console, runtime: Runtime) -> None:
    response = checked.http.post(f"{API}/mutes", json={"check": "gpu.3.temperature",
                                                       "minutes": 60})
    assert response.status_code == 403
    assert mutes(runtime) == []


def test_a_hung_nvml_never_stops_the_daemon_answering(logged_in: Console, runtime: Runtime,
                                                      gpus: FakeGpus) -> None:
    """Fault case 9 (an NVML call that hangs), over real HTTP: while "check now" waits on a
    hung GPU read, the console, the API and /healthz keep answering; the check returns once
    NVML does (or, after health.nvml_timeout_seconds, with gpu.nvml CRITICAL: see the
    monitor's tests)."""
    runtime.health.config = dataclasses.replace(runtime.config, health=dataclasses.replace(
        runtime.config.health, nvml_timeout_seconds=600))
    gpus.hang()
    outcome: list[httpx.Response] = []
    # A client of its own (same session): httpx clients are not shared across threads.
    other = httpx.Client(base_url=str(logged_in.http.base_url), cookies=logged_in.http.cookies)
    check_now = threading.Thread(target=lambda: outcome.append(
        other.post(f"{API}/check", headers=csrf(logged_in), timeout=120)))
    check_now.start()
    try:
        for path in ("/healthz", API, "/health", "/"):
            assert logged_in.http.get(path).status_code == 200, path
        assert check_now.is_alive()  # the hung read is still in flight: it held nothing up
    finally:
        gpus.unhang()
        check_now.join(timeout=60)
        other.close()
    assert outcome and outcome[0].status_code == 200
