"""The tuning admin API (`/api/v1/tuning/`) over real loopback HTTP.

A live server over the dev box with K3's `config.json` in the model folder (no engine start
yet, so the budget is an estimate and says so), a console session (cookie + CSRF header) and
an admin API token. Covers the view per profile, the chart, the profiles (create, replace,
delete; built-ins read-only; refusals naming the field), applying (record only, a maintenance
window with its confirmation rule, refusals that record nothing) and the audit trail. The last
test drives the engine emulator: the budget measured from its startup, "restart needed" after a
split applied without a restart, and a confirmed apply that relaunches it with the new ratio.
"""

from __future__ import annotations

import datetime as dt
import json
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import httpx
import pytest

from appliance.config import Config
from appliance.engine.args import model_dir
from appliance.runtime import Runtime
from appliance.testing.checkpoint import k3_config
from tests.conftest import Console, LiveServer, add_admin, csrf, problem
from tests.test_engine_api import (
    audit,
    engine_server,
    new_token,
    wait_state,
    wait_until,
)

API = "/api/v1/tuning"
AGENTS = {"name": "support-bots", "title": "Support bots", "description": "Ticket triage.",
          "lengths": {"minimum": 500, "percentiles": [[50, 3000], [90, 12000], [100, 40000]]},
          "target_concurrency": 120}


def write_k3(config: Config) -> Path:
    folder = model_dir(config.paths.models_dir, config.engine.model)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(k3_config()))
    return folder


@pytest.fixture
def k3(config: Config) -> Path:
    return write_k3(config)


@pytest.fixture
def api(k3: Path, logged_in: Console) -> Console:
    return logged_in


def post(console: Console, path: str, body: dict[str, Any]) -> httpx.Response:
    return console.http.post(f"{API}{path}", json=body, headers=csrf(console))


def trail(console: Console, action: str) -> list[tuple[str, str, str, dict[str, Any]]]:
    return [(a["actor"], a["target"], a["outcome"], a["detail"])
            for a in reversed(audit(console, action))]


# --- reading ----------------------------------------------------------------------------------


def test_view_per_profile_with_an_estimated_budget(api: Console) -> None:
    view = api.http.get(f"{API}/")
    assert view.status_code == 200, view.text
    body = view.json()
    assert body["profile"]["name"] == "balanced"  # nothing applied yet
    assert body["budget"]["measured"] is False
    assert body["budget"]["detail"].startswith("estimate:")
    assert any("estimate" in p for p in body["problems"])
    assert body["choice"] is None and body["restart_needed"] is False
    assert body["current_ratio"] == 0.9
    rec = body["recommendation"]
    assert rec["ratio"] > 0 and rec["balanced_ratio"] > 0 and rec["summary"]
    assert rec["recommended"]["concurrent"] >= body["current"]["concurrent"]
    assert len(body["curve"]) > 20
    assert {"ratio", "state_limit", "kv_limit", "concurrent"} == set(body["curve"][0])
    assert body["chart"] == f"{API}/chart.svg?profile=balanced"
    assert "minutes" in body["restart_cost"]

    # A longer workload never gets a higher ratio.
    docs = api.http.get(f"{API}/", params={"profile": "long-document"}).json()
    chat = api.http.get(f"{API}/", params={"profile": "chat"}).json()
    assert docs["profile"]["target_concurrency"] == 4
    assert docs["recommendation"]["ratio"] < rec["ratio"] < chat["recommendation"]["ratio"]

    missing = api.http.get(f"{API}/", params={"profile": "nope"})
    assert "nope" in problem(missing, 404, "profile_not_found")["detail"]


def test_chart_is_a_standalone_svg(api: Console) -> None:
    response = api.http.get(f"{API}/chart.svg", params={"profile": "coding-agent"})
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("image/svg+xml")
    assert response.headers["x-content-type-options"] == "nosniff"
    assert "default-src 'none'" in response.headers["content-security-policy"]
    root = ET.fromstring(response.text)  # noqa: S314 - our own answer, parsed to check it
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    assert "Coding agent" in (root.findtext("{http://www.w3.org/2000/svg}title") or "")
    assert "<script" not in response.text


def test_profiles_created_replaced_deleted_and_audited(api: Console) -> None:
    builtins = api.http.get(f"{API}/profiles").json()
    assert [p["name"] for p in builtins] == ["coding-agent", "chat", "long-document",
                                            "balanced"]
    assert all(p["builtin"] for p in builtins)

    created = post(api, "/profiles", AGENTS)
    assert created.status_code == 201, created.text
    assert created.json()["lengths"]["max"] == 40000 and created.json()["builtin"] is False
    names = [p["name"] for p in api.http.get(f"{API}/profiles").json()]
    assert names[-1] == "support-bots"
    view = api.http.get(f"{API}/", params={"profile": "support-bots"}).json()
    assert view["profile"]["title"] == "Support bots"
    assert view["recommendation"]["target_concurrency"] == 120

    problem(post(api, "/profiles", AGENTS), 409, "profile_exists")
    problem(post(api, "/profiles", {**AGENTS, "name": "chat"}), 409, "profile_builtin")
    bad = post(api, "/profiles", {**AGENTS, "name": "other", "lengths": {
        "percentiles": [[50, 9000], [90, 4000], [100, 40000]]}})
    assert "lengths.p90" in problem(bad, 422, "profile_invalid")["detail"]
    problem(post(api, "/profiles", {**AGENTS, "name": "Bad Name"}), 422, "profile_invalid")
    assert post(api, "/profiles", {"name": "x"}).status_code == 400  # not a profile at all

    edit = {"title": "Support bots (peak)", "description": "",
            "lengths": {"percentiles": [[50, 4000], [100, 64000]]}, "target_concurrency": 200}
    replaced = api.http.put(f"{API}/profiles/support-bots", json=edit, headers=csrf(api))
    assert replaced.status_code == 200, replaced.text
    assert replaced.json()["target_concurrency"] == 200
    assert replaced.json()["lengths"]["percentiles"] == [[50, 4000], [100, 64000]]
    problem(api.http.put(f"{API}/profiles/chat", json=edit, headers=csrf(api)), 409,
            "profile_builtin")
    problem(api.http.put(f"{API}/profiles/ghost", json=edit, headers=csrf(api)), 404,
            "profile_not_found")

    deleted = api.http.delete(f"{API}/profiles/support-bots", headers=csrf(api))
    assert deleted.status_code == 200 and deleted.json() == {"deleted": "support-bots"}
    problem(api.http.delete(f"{API}/profiles/support-bots", headers=csrf(api)), 404,
            "profile_not_found")
    problem(api.http.delete(f"{API}/profiles/balanced", headers=csrf(api)), 409,
            "profile_builtin")

    assert [(actor, target, outcome) for actor, target, outcome, _ in
            trail(api, "tuning.profile.")] == [
        ("alice", "support-bots", "ok"), ("alice", "support-bots", "ok"),
        ("alice", "support-bots", "ok")]
    create, update, delete = trail(api, "tuning.profile.")
    assert create[3] == {"via": "api:session", "title": "Support bots",
                         "lengths": "p50 2.9K, p90 12K, max 39K", "target_concurrency": 120}
    assert update[3]["target_concurrency"] == 200 and delete[3] == {"via": "api:session"}
    assert [a["action"] for a in reversed(audit(api, "tuning.profile."))] == [
        "tuning.profile.create", "tuning.profile.update", "tuning.profile.delete"]


def test_session_writes_need_the_csrf_header(api: Console) -> None:
    refused = api.http.post(f"{API}/profiles", json=AGENTS)
    assert refused.status_code == 403, refused.text
    refused = api.http.post(f"{API}/apply", json={"profile": "chat", "restart": False})
    assert refused.status_code == 403, refused.text
    assert api.http.get(f"{API}/").json()["choice"] is None
    assert audit(api, "tuning.") == []


# --- applying -----------------------------------------------------------------------------------


def test_apply_record_only_then_a_window_with_its_confirmation(
    api: Console, runtime: Runtime
) -> None:
    # Record only: the recommendation (no ratio given) becomes the launch's.
    chat = api.http.get(f"{API}/", params={"profile": "chat"}).json()
    applied = post(api, "/apply", {"profile": "chat", "restart": False})
    assert applied.status_code == 202, applied.text
    body = applied.json()
    assert body["restart"] == "not requested" and body["engine"] is None
    assert body["choice"]["profile"] == "chat"
    assert body["choice"]["ratio"] == chat["recommendation"]["ratio"]
    assert body["choice"]["spec_hash"] == runtime.supervisor.current_spec().spec_hash
    view = api.http.get(f"{API}/").json()  # the applied choice's profile is now the default
    assert view["profile"]["name"] == "chat" and view["choice"]["ratio"] == body["choice"][
        "ratio"]
    assert view["current_ratio"] == body["choice"]["ratio"]  # what a start would launch
    assert view["restart_needed"] is False  # no engine runs
    flags = api.http.get("/api/v1/engine/spec").json()["flags"]
    ratio_flag = next(f for f in flags if f["flag"] == "--mamba-full-memory-ratio")
    assert float(ratio_flag["value"]) == body["choice"]["ratio"]
    assert ratio_flag["origin"] == "tuning"

    # A maintenance window needs confirm; refused, nothing is recorded or scheduled.
    at = (runtime.clock.now() + dt.timedelta(days=30)).replace(microsecond=0)
    window = {"profile": "coding-agent", "ratio": 2.5, "at": at.isoformat()}
    refused = post(api, "/apply", window)
    body409 = problem(refused, 409, "confirmation_required")
    assert "restart" in body409["detail"] and "minutes" in body409["detail"]
    past = post(api, "/apply", {**window, "confirm": True,
                                "at": (runtime.clock.now() - dt.timedelta(hours=1)).isoformat()})
    problem(past, 422, "schedule_in_past")
    impossible = post(api, "/apply", {"profile": "chat", "ratio": 1e-6, "restart": False})
    assert "SGLang would refuse" in problem(impossible, 422, "tuning_impossible")["detail"]
    problem(post(api, "/apply", {"profile": "ghost", "ratio": 1.0, "restart": False}), 404,
            "profile_not_found")
    assert api.http.get(f"{API}/").json()["choice"]["profile"] == "chat"
    assert api.http.get("/api/v1/engine/scheduled").json() == []

    scheduled = post(api, "/apply", {**window, "confirm": True})
    assert scheduled.status_code == 202, scheduled.text
    planned = scheduled.json()
    assert planned["restart"] == "scheduled"
    assert planned["engine"]["scheduled"]["command"] == "restart"
    assert planned["choice"] == {**planned["choice"], "profile": "coding-agent", "ratio": 2.5,
                                 "pin": None}
    actions = api.http.get("/api/v1/engine/scheduled").json()
    assert [(a["command"], a["status"], a["run_at"]) for a in actions] == [
        ("restart", "pending", at.isoformat())]

    # A profile in use cannot be deleted.
    assert post(api, "/profiles", AGENTS).status_code == 201
    assert post(api, "/apply", {"profile": "support-bots", "ratio": 3.0,
                                "restart": False}).status_code == 202
    problem(api.http.delete(f"{API}/profiles/support-bots", headers=csrf(api)), 409,
            "profile_in_use")

    assert [(t, o, d) for _, t, o, d in trail(api, "tuning.apply")] == [
        ("chat", "ok", {"via": "api:session", "ratio": chat["recommendation"]["ratio"],
                        "pin": None, "restart": "not requested"}),
        ("coding-agent", "ok", {"via": "api:session", "ratio": 2.5, "pin": None,
                                "restart": "scheduled", "at": at.isoformat()}),
        ("support-bots", "ok", {"via": "api:session", "ratio": 3.0, "pin": None,
                                "restart": "not requested"})]
    assert [a["detail"]["run_at"] for a in audit(api, "engine.schedule")] == [at.isoformat()]


def test_api_token_reads_and_applies(api: Console, server: LiveServer) -> None:
    token = new_token(api)
    with httpx.Client(base_url=server.base_url, timeout=10,
                      headers={"Authorization": f"Bearer {token}"}) as bearer:
        assert bearer.get(f"{API}/profiles").status_code == 200
        applied = bearer.post(f"{API}/apply", json={"profile": "balanced", "ratio": 1.5,
                                                    "restart": False})
        assert applied.status_code == 202, applied.text
    assert trail(api, "tuning.apply")[0][3]["via"] == "api:token"


def test_without_a_model_config_the_view_says_what_is_missing(logged_in: Console) -> None:
    response = logged_in.http.get(f"{API}/")
    body = problem(response, 422, "geometry_invalid")
    assert "config.json" in body["detail"]


# --- with the engine emulator ---------------------------------------------------------------


def test_measured_budget_restart_needed_and_a_confirmed_apply_relaunches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with engine_server(tmp_path, monkeypatch) as live:
        add_admin(live.runtime)
        console = Console(live.base_url)
        try:
            assert console.login().status_code == 303
            assert console.http.post("/api/v1/engine/start", json={},
                                     headers=csrf(console)).status_code == 202
            wait_state(console.http, "ready")
            view = console.http.get(f"{API}/").json()
            assert view["budget"]["measured"] is True, view["budget"]
            assert view["budget"]["detail"].startswith("measured from the engine's last startup")
            assert view["problems"] == []

            # Recorded without a restart: the running engine does not use it yet.
            assert post(console, "/apply", {"profile": "coding-agent", "ratio": 2.5,
                                            "restart": False}).status_code == 202
            view = console.http.get(f"{API}/").json()
            assert view["restart_needed"] is True and view["current_ratio"] == 2.5

            # Restarting a live engine needs confirm; then it relaunches with the ratio.
            problem(post(console, "/apply", {"profile": "coding-agent", "ratio": 2.5}), 409,
                    "confirmation_required")
            restarted = post(console, "/apply", {"profile": "coding-agent", "ratio": 2.5,
                                                 "confirm": True})
            assert restarted.status_code == 202, restarted.text
            assert restarted.json()["restart"] == "queued"
            runs: list[dict[str, Any]] = []

            def relaunched() -> bool:
                runs[:] = console.http.get("/api/v1/engine/runs").json()
                return len(runs) == 2 and console.http.get(
                    "/api/v1/engine/").json()["state"] == "ready"

            wait_until(relaunched, "the engine relaunched and ready")
            spec = console.http.get("/api/v1/engine/spec").json()
            assert runs[0]["spec_hash"] == spec["spec_hash"]
            ratio = next(f for f in spec["flags"] if f["flag"] == "--mamba-full-memory-ratio")
            assert float(ratio["value"]) == 2.5 and ratio["origin"] == "tuning"
            view = console.http.get(f"{API}/").json()
            assert view["restart_needed"] is False and view["budget"]["measured"] is True
            assert [a["detail"] for a in audit(console, "engine.restart")] == [
                {"via": "api:session"}]
        finally:
            console.close()
