"""A fresh box's first start is not an error: while a pull brings the weights, the engine
waits for them (STOPPED, reason waiting_for_weights, an info event), the dashboard says so
with the pull's progress, and the engine starts by itself once they are proven."""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import Callable
from pathlib import Path

import jinja2
import pytest

from appliance.clock import SystemClock
from appliance.db.database import Database
from appliance.db.journal import list_events
from appliance.db.schema import migrate
from appliance.engine.states import EngineState
from appliance.errors import ApplianceError
from appliance.health.dashboard_views import dashboard as health_dashboard
from appliance.health.model import HealthSnapshot
from appliance.resources import migrations_dir, templates_dir
from appliance.ui.templating import duration, size, when
from appliance.weights.service import WeightsService
from appliance.weights.views import Verdict
from tests.conftest import make_config
from tests.test_engine_lifecycle import migrated_box, run, supervisor_for

WAITING = "waiting for the weights: 3 of 96 files proven, 2.10 TB to go"


class PullingWeights:
    """The weights gate of a box whose pull is still under way (a real class, not a mock)."""

    async def launch_verdict(self) -> Verdict:
        return Verdict(False, WAITING, "the engine starts by itself once they are proven",
                       waiting=True)

    async def prewarm_for_launch(self, report: Callable[[str], None]) -> str | None:
        return None


def test_a_start_while_the_weights_arrive_waits_and_is_no_error(tmp_path: Path) -> None:
    config, db = migrated_box(tmp_path / "box")
    supervisor = supervisor_for(config, db, tmp_path / "gpus.json")
    supervisor.weights = PullingWeights()

    async def go() -> None:
        with pytest.raises(ApplianceError) as refused:
            await supervisor._start("operator")
        assert refused.value.code == "waiting_for_weights"
        assert refused.value.message == WAITING
        status = supervisor.status
        assert (status.state, status.reason) == (EngineState.STOPPED, "waiting_for_weights")
        assert status.message == WAITING
        await supervisor.client.aclose()

    run(go)
    events = db.call(lambda s: list_events(s, per_page=20)).items
    said = [(e.severity, e.message) for e in events]
    assert ("info", f"the engine waits for the weights ({WAITING})") in said
    assert not any(sev == "error" for sev, _ in said), said
    db.dispose()


def test_the_weights_service_says_waiting_only_while_a_pull_runs(tmp_path: Path) -> None:
    config = make_config(tmp_path / "fresh")
    db = Database(config.database_url)
    migrate(db, migrations_dir(), config.paths.state_dir / "backups", SystemClock().now())
    service = WeightsService(config, db, SystemClock())
    idle = asyncio.run(service.launch_verdict())
    service._job = "pull"  # a pull has started and not yet recorded a manifest
    pulling = asyncio.run(service.launch_verdict())
    assert not idle.waiting and "no manifest" in idle.message  # nothing coming: act
    assert pulling.waiting and pulling.message.startswith("waiting for the weights")
    db.dispose()


def test_the_dashboard_says_why_the_engine_is_not_serving() -> None:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(templates_dir()), autoescape=True)
    env.filters.update(when=when, size=size, duration=duration)
    health = health_dashboard(HealthSnapshot(None), {}, {}, dt.datetime.now(dt.UTC))
    html = env.get_template("partials/dashboard_health.html").render(
        health=health, engine_why="Waiting for the weights: 3 of 96 files proven, 2.10 TB to "
        "go; the engine starts by itself once they are proven.")
    assert 'id="engine-why"' in html and "3 of 96 files proven, 2.10 TB to go" in html
