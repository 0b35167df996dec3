"""The Usage page: what the gateway's users sent, per key, over a range.

The picker (`pages/usage.html`) chooses the range (last 24 hours, 7 days, 30 days, or dates
of one's own) and optionally one key; a change swaps the report (`partials/usage_report.html`)
through htmx and pushes a clean `/usage?...` URL. Typing a date switches the range to
"custom" (and the picker comes back out of band saying so); picking a named range ignores the
dates. The report holds the totals (the errors by cause, from the per-request rows:
`appliance.gateway.error_causes`), the chart (server-rendered SVG,
`appliance.gateway.usage_chart`), the per-class SLO counts (`appliance.gateway.usage.
class_counts`, of the key picked), a row per key and the CSV downloads, all from the same
helpers as the admin API (`appliance.api.usage`). A bad parameter shows as a problem in the
report's place, with the picker still there. Before the gateway has recorded anything, the
page says so instead.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlencode

from litestar import get
from litestar.response import Template
from markupsafe import Markup

from appliance.api.usage import (
    FromQuery,
    KeyQuery,
    RangeQuery,
    ToQuery,
    chart_for,
    classes_for,
    links,
    report_for,
    span_of,
)
from appliance.errors import ApplianceError
from appliance.gateway.error_causes import CAUSES, error_causes
from appliance.gateway.report import DEFAULT_RANGE, RANGES, key_labels, usage_recorded
from appliance.runtime import runtime_of
from appliance.status import admission_standing
from appliance.ui.login import AdminRequest
from appliance.ui.pages import GUARDED

CHOICES = [*((name, title) for name, (_, title) in RANGES.items()),
           ("custom", "Dates of my own")]


def count(value: int | float) -> str:
    """12345 -> 12,345."""
    return f"{value:,.0f}"


def percent(value: float | None) -> str:
    """A rate as a percentage (0.1234 -> 12.3 %); a dash when there is nothing to divide."""
    return "—" if value is None else f"{value * 100:.1f} %"


def millis(value: float | None) -> str:
    """350 -> 350 ms, 1234 -> 1.23 s, 754000 -> 12.6 min; a dash when nothing was timed."""
    if value is None:
        return "—"
    if value < 1000:
        return f"{value:.0f} ms"
    if value < 60_000:
        return f"{value / 1000:.3g} s"
    return f"{value / 60_000:.3g} min"


def _picked(request: AdminRequest, range_name: str | None, start: str | None,
            end: str | None) -> tuple[str, str, str, bool]:
    """(range, from, to, forced): a date just typed means "custom" (forced: the picker must
    say so); a named range ignores the dates."""
    range_name = (range_name or "").strip()
    start, end = (start or "").strip(), (end or "").strip()
    forced = (request.headers.get("hx-trigger-name") in ("from", "to")
              and range_name != "custom")
    if forced:
        range_name = "custom"
    if not range_name and (start or end):
        range_name = "custom"  # an old link with only dates
    if range_name != "custom":
        start = end = ""
    return range_name or DEFAULT_RANGE, start, end, forced


@get("/usage", **GUARDED)
async def usage_page(request: AdminRequest, range_name: RangeQuery = None,
                     start: FromQuery = None, end: ToQuery = None,
                     key: KeyQuery = None) -> Template:
    """The page, or (from htmx) the report alone."""
    runtime = runtime_of(request)
    picked, start_text, end_text, forced = _picked(request, range_name, start, end)
    prefix = (key or "").strip()
    context: dict[str, Any] = {
        "nav": "usage", "choices": CHOICES, "count": count, "percent": percent,
        "millis": millis, "problem": None, "report": None, "chart": "", "links": None,
        "picked": {"range": picked, "from": start_text, "to": end_text, "key": prefix},
        "retention_days": runtime.config.gateway.usage_retention_days, "oob": forced,
        "classes": [], "cause_words": CAUSES,
    }
    recorded, labels = await runtime.db.run(lambda s: (usage_recorded(s), key_labels(s)))
    context.update(recorded=recorded, keys=sorted(labels.values(),
                                                  key=lambda k: (k.name.lower(), k.id)))
    status = 200
    try:
        span = span_of(runtime, picked, start_text or None, end_text or None)
        report = await report_for(runtime, span, prefix or None)
    except ApplianceError as exc:
        context["problem"], status = exc, exc.status
    else:
        key_id = report.key.id if report.key else None
        causes = await runtime.db.run(
            lambda s: error_causes(s, span.start, span.end, key_id))
        context["classes"] = await classes_for(runtime, report)  # of the key picked
        context.update(report=report, causes=causes,
                       links=links(span, report.key.prefix if report.key else ""),
                       chart=Markup(chart_for(report)))  # noqa: S704 - escaped by usage_chart
    if not request.headers.get("hx-request"):
        context["admission"] = await admission_standing(runtime)  # the gateway's standing
        return Template("pages/usage.html", context=context, status_code=status)
    query = {"range": picked, **({"from": start_text, "to": end_text} if picked == "custom"
                                 else {}), **({"key": prefix} if prefix else {})}
    return Template("partials/usage_report.html", context=context, status_code=status,
                    headers={"HX-Push-Url": f"/usage?{urlencode(query)}"})
