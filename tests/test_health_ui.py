"""The dashboard's health part and the Health page over real loopback HTTP, without a browser;
and the pure view models behind them (`appliance.health.views`, `.dashboard_views`).

The rig is `tests.test_health_api`'s: eight fake GPUs with GPU 3 at 95 °C, a serving engine
with known figures, a roomy host, the real monitor. Covers the overall badge with the failing
checks, the GPU table (a hot GPU's row and cell marked, a lost GPU's row saying so with its
hint, NVML missing), the engine figures, the sparklines, the htmx refresh; the Health page's
groups, hints, since-when and recent changes; "Check now"; muting and unmuting through the
forms (CSRF, audited, counted out of the overall status) and refusals that change nothing.
"""

# The rig's fixtures are imported from tests.test_health_api; the tests name them again.
# ruff: noqa: F811

from __future__ import annotations

import datetime as dt
import re

from appliance.app import create_app
from appliance.gpu.nvml import GPU_IS_LOST
from appliance.gpu.port import GpuInfo, GpuSnapshot
from appliance.health.dashboard_views import dashboard, gpu_rows
from appliance.health.history import MuteView, TransitionView
from appliance.health.model import CheckResult, EngineFigures, HealthSnapshot, Level
from appliance.health.views import check_rows, health_page, overall
from appliance.runtime import Runtime
from appliance.testing.clock import FakeClock
from appliance.testing.fake_gpus import FakeGpus
from tests.conftest import Console
from tests.test_health_api import (  # noqa: F401 - fixtures
    HOT,
    audit,
    checked,
    gpus,
    mutes,
    runtime,
    seed_hour,
)
from tests.test_usage_ui import text_of

HTMX = {"HX-Request": "true"}
HOT_ID = f"gpu.{HOT}.temperature"


def gpu_row(html: str, index: int) -> str:
    match = re.search(rf'<tr data-gpu="{index}" class="[^"]*".*?</tr>', html, re.S)
    assert match, html
    return match.group(0)


def check_row(html: str, check_id: str) -> str:
    match = re.search(rf'<tr id="check-{re.escape(check_id)}".*?</tr>', html, re.S)
    assert match, f"no row for {check_id}"
    return match.group(0)


# --- the dashboard ----------------------------------------------------------------------------


def test_dashboard(checked: Console, runtime: Runtime) -> None:
    seed_hour(runtime)
    response = checked.http.get("/")
    assert response.status_code == 200, response.text
    html = response.text
    words = text_of(html)
    assert '<a href="/health">Health</a>' in html  # live in the nav now
    assert re.search(r'id="overall-status">CRITICAL<', html)
    assert f'<a href="/health#check-{HOT_ID}">GPU {HOT} temperature</a>' in html
    assert "Every check on the Health page" in words
    # Eight GPU rows; the hot one marked as a row and in its temperature cell.
    table = re.search(r'<table class="figures gpu-table".*?</table>', html, re.S)
    assert table and table.group(0).count("<tr data-gpu=") == 8
    hot = gpu_row(html, HOT)
    assert 'class="level-critical"' in hot
    assert '<td class="level-critical">95 °C</td>' in hot
    assert "NVIDIA B300 SXM6 AC" in hot and "18/18 up" in hot
    cool = gpu_row(html, 0)
    assert 'class="level-ok"' in cool and '<td class="">55 °C</td>' in cool
    assert "700 / 1,100 W" in cool and "80 %" in cool
    # Engine figures and the sparklines (three per GPU, two for the engine).
    assert "Throughput 1,234 tokens/s" in words
    assert "Time to first token p50 350 ms · p90 1.20 s" in words
    assert "Prefix cache hit rate 63.0 %" in words and "3 running, 1 queued" in words
    assert html.count('class="sparkline"') == 8 * 3 + 2
    assert f'aria-labelledby="spark-gpu{HOT}-gpu.temperature_c-title"' in html
    # The seeded hour (85-89 °C, a gap) and the monitor's own reading of 95 °C.
    assert "GPU 3 temperature, last hour: from 85 °C to 95 °C" in html
    assert "1 gap without samples" in html
    # What the dashboard said before stays.
    assert "Control plane" in words and "Volumes" in words and "Recent events" in words


def test_the_htmx_refresh_is_the_status_part(checked: Console) -> None:
    response = checked.http.get("/", headers=HTMX)
    assert response.status_code == 200
    html = response.text
    assert "<html" not in html and "Recent events" not in html
    assert 'id="gpu-table"' in html and "Control plane" in html
    assert 'id="overall-status">CRITICAL<' in html
    assert html.count('class="sparkline"') == 26  # the monitor's first samples


def test_a_lost_gpu_says_so(checked: Console, gpus: FakeGpus, runtime: Runtime) -> None:
    gpus.lose_gpu(5)
    checked.http.post("/health/check", headers=HTMX, data={"_csrf_token": checked.page_token(
        "/health")})
    row = gpu_row(checked.http.get("/").text, 5)
    assert "gpu-lost level-critical" in row
    assert GPU_IS_LOST[0][1:] in row and "What to do:" in row and "Xid 79" in row


def test_nvml_missing(checked: Console, gpus: FakeGpus) -> None:
    gpus.fail()
    checked.http.post("/health/check", headers=HTMX, data={"_csrf_token": checked.page_token(
        "/health")})
    html = checked.http.get("/").text
    assert 'id="gpu-table"' not in html
    assert "NVIDIA driver not loaded" in html and "sudo modprobe nvidia" in html
    assert "cannot read the GPUs" in html  # the failing gpu.nvml check in the overall card


# --- the Health page --------------------------------------------------------------------------


def test_health_page(checked: Console, clock: FakeClock) -> None:
    html = checked.http.get("/health").text
    words = text_of(html)
    assert '<a href="/health" aria-current="page">Health</a>' in html
    assert re.search(r'id="health-overall">CRITICAL<', html)
    for group, title in (("gpu", "GPUs"), ("engine", "Engine"), ("host", "Host")):
        assert f'id="health-{group}"' in html and f">{title} <span" in html
    hot = check_row(html, HOT_ID)
    assert "CRITICAL" in hot and "95 °C" in hot and "What to do: check the box" in hot
    assert clock.now().strftime("%Y-%m-%d %H:%M:%S UTC") in hot  # since the failure
    assert "1 recent change" in hot
    assert "Mute…" in hot and f'action="/health/checks/{HOT_ID}/mute"' in hot
    ok = check_row(html, "host.models_disk")
    assert "OK" in ok and "What to do" not in ok
    assert "Recent changes" in words
    changes = re.search(r'<table class="health-changes".*?</table>', html, re.S)
    assert changes and f"GPU {HOT} temperature" in changes.group(0)


def test_check_now(checked: Console, gpus: FakeGpus, clock: FakeClock) -> None:
    gpus.set_fields(HOT, temperature_c=50.0)
    clock.advance(60)
    token = checked.page_token("/health")
    response = checked.http.post("/health/check", headers=HTMX, data={"_csrf_token": token})
    assert response.status_code == 200, response.text
    assert "<html" not in response.text and "Every check ran just now." in response.text
    row = check_row(response.text, HOT_ID)
    assert 'class="level-ok"' in row and "CRITICAL → OK — GPU 3 is at 50 °C" in row
    # Without htmx: back to the page.
    plain = checked.http.post("/health/check", data={"_csrf_token": token})
    assert plain.status_code == 303 and plain.headers["location"] == "/health"


def test_mute_and_unmute_through_the_forms(checked: Console, runtime: Runtime,
                                           clock: FakeClock) -> None:
    token = checked.page_token("/health")
    response = checked.http.post(f"/health/checks/{HOT_ID}/mute", headers=HTMX, data={
        "_csrf_token": token, "duration": "24h", "reason": "fan swap on Tuesday"})
    assert response.status_code == 200, response.text
    row = check_row(response.text, HOT_ID)
    until = (clock.now() + dt.timedelta(hours=24)).strftime("%Y-%m-%d %H:%M:%S UTC")
    assert "muted-check" in row and f"Muted until {until} by alice" in text_of(row)
    assert "fan swap on Tuesday" in row and ">Unmute</button>" in row
    assert 'id="health-overall">CRITICAL<' not in response.text
    dash = checked.http.get("/").text
    assert f'href="/health#check-{HOT_ID}"' not in dash  # not counted
    assert "1 muted check not counted" in text_of(dash)
    [mute] = mutes(runtime)
    assert (mute.check_id, mute.until, mute.reason) == (
        HOT_ID, clock.now() + dt.timedelta(hours=24), "fan swap on Tuesday")

    response = checked.http.post(f"/health/checks/{HOT_ID}/unmute", data={"_csrf_token": token})
    assert response.status_code == 303  # without htmx: back to the page
    assert mutes(runtime) == []
    assert 'id="health-overall">CRITICAL<' in checked.http.get("/health").text
    response = checked.http.post(f"/health/checks/{HOT_ID}/mute", headers=HTMX, data={
        "_csrf_token": token, "duration": "forever"})
    assert "Muted until unmuted by alice" in text_of(check_row(response.text, HOT_ID))
    assert [(a, who, target, d.get("reason")) for a, who, target, d in audit(runtime)] == [
        ("health.mute", "alice", HOT_ID, "fan swap on Tuesday"),
        ("health.unmute", "alice", HOT_ID, None),
        ("health.mute", "alice", HOT_ID, "")]


def test_refused_mutes_change_nothing(checked: Console, runtime: Runtime) -> None:
    token = checked.page_token("/health")
    no_csrf = checked.http.post(f"/health/checks/{HOT_ID}/mute", headers=HTMX,
                                data={"duration": "1h"})
    assert no_csrf.status_code == 403
    bad = checked.http.post(f"/health/checks/{HOT_ID}/mute", headers=HTMX,
                            data={"_csrf_token": token, "duration": "1y"})
    assert bad.status_code == 422
    assert "Unknown duration" in bad.text and "What to do: choose 1 hour" in bad.text
    assert 'id="health-overall">CRITICAL<' in bad.text  # the board is still there
    unknown = checked.http.post("/health/checks/gpu.42.power/mute", headers=HTMX,
                                data={"_csrf_token": token, "duration": "1h"})
    assert unknown.status_code == 404 and "There is no health check" in unknown.text
    unmute = checked.http.post("/health/checks/gpu.42.power/unmute", headers=HTMX,
                               data={"_csrf_token": token})
    assert unmute.status_code == 404
    assert mutes(runtime) == [] and audit(runtime) == []


# --- the view models --------------------------------------------------------------------------

NOW = dt.datetime(2026, 3, 1, 12, 0, tzinfo=dt.UTC)


def result(check_id: str, level: Level, group: str = "gpu") -> CheckResult:
    return CheckResult(check_id, group, check_id, level, f"{check_id} is {level.label}",
                       "do this" if level else "")


def test_views_before_the_first_run() -> None:
    board = dashboard(HealthSnapshot(at=None), {}, {}, NOW)
    assert board.overall.level is Level.OK and board.overall.checked_at is None
    assert board.gpus == () and board.sparks == () and board.nvml_error == ""
    assert board.engine.state == "unknown"
    assert dict(board.engine.figures)["Throughput"] == "—"
    assert len(board.engine.sparks) == 2


def test_views_mutes_since_and_gpu_marks() -> None:
    gpu = GpuInfo(0, "u0", "B300", 100 << 30, 10 << 30, temperature_c=95.0)
    lost = GpuInfo(1, "", "", 0, 0, error="lost", hint="reset it")
    snapshot = HealthSnapshot(
        at=NOW, gpus=GpuSnapshot("580", "13.0", (gpu, lost)),
        results=(result("gpu.0.temperature", Level.CRITICAL),
                 result("gpu.0.memory_errors", Level.WARN),
                 result("host.load", Level.WARN, "host")),
        engine=EngineFigures(at=NOW, state="loading_weights"))
    muted = {"host.load": MuteView("host.load", None, NOW, "alice", "known")}
    failure = TransitionView(1, NOW - dt.timedelta(hours=2), "gpu.0.temperature", "gpu", "t",
                             Level.CRITICAL, Level.OK, "hot", "", False)
    rows = check_rows(snapshot, muted, [failure])
    assert [r.since for r in rows] == [failure.at, None, None]
    assert [r.muted for r in rows] == [False, False, True]
    o = overall(snapshot, rows)
    assert o.level is Level.CRITICAL and o.muted == 1
    assert [r.id for r in o.failing] == ["gpu.0.temperature", "gpu.0.memory_errors"]
    first, second = gpu_rows(snapshot, muted)
    assert first.mark("temperature") == "level-critical" and first.mark("ecc") == "level-warn"
    assert first.mark("power") == "" and first.temperature == "95 °C"
    assert second.level is Level.CRITICAL and second.error == "lost" and second.memory == "—"
    page = health_page(snapshot, muted, [failure])
    assert [g.level for g in page.groups] == [Level.CRITICAL, Level.OK, Level.OK, Level.OK]
    assert page.recent == (failure,)
    assert dashboard(snapshot, muted, {}, NOW).engine.state == "loading weights"


def test_the_dashboard_before_the_first_run(runtime: Runtime) -> None:
    """Rendered straight from the template: nothing has run, nothing is invented."""
    engine = create_app(runtime).template_engine
    assert engine is not None
    html = engine.get_template("partials/dashboard_health.html").render(
        health=dashboard(HealthSnapshot(at=None), {}, {}, NOW))
    words = text_of(html)
    assert "Health: OK" in words and "The health checks have not run yet." in words
    assert "No GPU reading yet." in words and "Engine: unknown" in words
    assert "Throughput —" in words and html.count('class="sparkline"') == 2
