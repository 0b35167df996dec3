"""A check that did not run is shown as not checked (grey), never as a green OK; the Health
page opens with what fails, above the groups, and folds the rest."""

from __future__ import annotations

import datetime as dt
from types import SimpleNamespace

import jinja2

from appliance.health.model import CheckResult, HealthSnapshot, Level
from appliance.health.views import health_page
from appliance.resources import templates_dir
from appliance.ui.templating import can, filters

AT = dt.datetime(2026, 12, 1, 12, 0, tzinfo=dt.UTC)
SNAPSHOT = HealthSnapshot(AT, (
    CheckResult("gpu.0.temperature", "gpu", "GPU 0 temperature", Level.OK, "GPU 0 at 41 °C"),
    CheckResult("gpu.3.temperature", "gpu", "GPU 3 temperature", Level.CRITICAL,
                "GPU 3 at 95 °C", "check its fans"),
    CheckResult("engine.ready", "engine", "Engine /ready", Level.OK,
                "not checked while loading weights", judged=False),
    CheckResult("engine.canary", "engine", "Engine canary", Level.OK,
                "not checked while loading weights", judged=False),
    CheckResult("host.load", "host", "Host load", Level.OK, "load 1.0"),
))


def render(page: object) -> str:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(templates_dir()), autoescape=True)
    env.filters.update(filters())
    env.globals["can"] = can  # the board hides the mute forms from a viewer
    operator = SimpleNamespace(scope={"user": SimpleNamespace(role="operator")})
    return env.get_template("partials/health_board.html").render(
        page=page, durations=(), error=None, notice="", csrf_input="", request=operator)


def test_unchecked_rows_are_grey_and_counted_apart() -> None:
    page = health_page(SNAPSHOT, {}, ())
    rows = {r.id: r for g in page.groups for r in g.rows}
    assert rows["engine.ready"].shown == "unchecked"
    assert rows["engine.ready"].shown_label == "NOT CHECKED"
    assert rows["gpu.0.temperature"].shown == "ok"
    assert page.overall.unchecked == 2 and page.overall.passing == 2
    engine = next(g for g in page.groups if g.name == "engine")
    assert engine.unchecked == 2 and not engine.attention


def test_the_page_says_not_checked_and_opens_with_what_fails() -> None:
    html = render(health_page(SNAPSHOT, {}, ()))
    row = html[html.index('id="check-engine.ready"'):]
    row = row[:row.index("</tr>")]
    assert "level-unchecked" in row and "NOT CHECKED" in row and ">OK<" not in row
    assert "2 not checked this time" in html
    assert html.index('id="health-failing"') < html.index('id="health-gpu"')
    failing = html[html.index('id="health-failing"'):]
    assert "GPU 3 temperature" in failing[:failing.index("</ul>")]
    assert "<details class=\"health-passing\" open" not in html  # the rest folded
