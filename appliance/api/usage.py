"""Usage reports through the admin API: what the gateway's users sent, per key, over time.

Every route takes the same range and key parameters: `range=24h|7d|30d` (default 24h), or
`from=` (and `to=`, default now) as ISO dates or times in UTC; `key=PREFIX` limits the report
to one gateway key. Spans up to three days are counted by hour, longer ones by UTC day.

- `GET /api/v1/usage/` — the range, the key, the totals, a row per key, the series, and per
  service class what its requests got of its promise (`classes`; of the key, when given).
- `GET /api/v1/usage/export.csv?granularity=request|hour|day` — per-request rows (kept
  `gateway.usage_retention_days`) or the hourly/daily roll-ups, streamed, with a header row.
- `GET /api/v1/usage/chart.svg` — the chart of tokens and requests over time.

A bad parameter is a 400 (an unknown key prefix a 404) naming the parameter and the values it
allows, checked before anything streams. Keys appear by name and prefix only. The console's
Usage page uses the helpers here, so both doors answer the same way.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import AsyncIterator
from functools import partial
from typing import Annotated, Any

from litestar import Request, Response, Router, get
from litestar.params import QueryParameter
from litestar.response import Stream

from appliance.api.tuning import SVG_HEADERS
from appliance.auth.accounts import Admin
from appliance.auth.guards import password_current
from appliance.auth.middleware import AuthInfo
from appliance.errors import ApplianceError
from appliance.gateway.report import (
    KeyLabel,
    Report,
    Span,
    check_prefix,
    find_key,
    key_labels,
    load_report,
    resolve_span,
    rollup_rows,
)
from appliance.gateway.usage import ClassCount, class_counts
from appliance.gateway.usage_chart import render_usage_chart
from appliance.gateway.usage_csv import (
    PAGE,
    REQUEST_COLUMNS,
    csv_line,
    export_filename,
    request_lines,
    request_page,
    rollup_csv,
)
from appliance.runtime import Runtime, runtime_of

AdminRequest = Request[Admin, AuthInfo, Any]
API = "/api/v1/usage"
GRANULARITIES = ("request", "hour", "day")
CSV_HEADERS = {"X-Content-Type-Options": "nosniff", "Cache-Control": "no-store"}

RangeQuery = Annotated[str | None, QueryParameter(
    name="range", description="24h, 7d or 30d (default 24h); or give from/to instead")]
FromQuery = Annotated[str | None, QueryParameter(
    name="from", description="start: an ISO date or time (UTC when no zone)")]
ToQuery = Annotated[str | None, QueryParameter(
    name="to", description="end (excluded; a bare date includes that day); default now")]
KeyQuery = Annotated[str | None, QueryParameter(
    name="key", description="a gateway key's 8-character prefix: only its usage")]
GranularityQuery = Annotated[str | None, QueryParameter(
    name="granularity", description="request (per-request rows), hour or day (roll-ups)")]


# --- shared with the console ------------------------------------------------------------------


def span_of(runtime: Runtime, range_name: str | None, start: str | None,
            end: str | None) -> Span:
    """The span asked for, counted back from the runtime's clock (400 when malformed)."""
    return resolve_span(range_name, start, end, runtime.clock.now())


async def report_for(runtime: Runtime, span: Span, key: str | None) -> Report:
    """The report over `span`, of the key with prefix `key` when given (404 if unknown)."""
    prefix = check_prefix(key) if key else ""
    return await runtime.db.run(lambda s: load_report(s, span, prefix))


async def classes_for(runtime: Runtime, report: Report) -> list[ClassCount]:
    """Per service class, what the report's requests got of its promise (of its key only,
    when it has one), kept for good in the roll-ups (`class_counts`)."""
    span, key_id = report.span, report.key.id if report.key else None
    return await runtime.db.run(lambda s: class_counts(s, span.start, span.end, key_id))


def chart_for(report: Report) -> str:
    """The report's chart (`appliance.gateway.usage_chart`), the same for the API and the
    page."""
    whose = f" of key {report.key.name} ({report.key.prefix})" if report.key else ""
    return render_usage_chart(report.series, granularity=report.span.granularity,
                              title=f"Tokens and requests{whose}, {report.span.title}")


def links(span: Span, prefix: str = "") -> dict[str, Any]:
    """Where the chart and the CSV exports of this span (and key) are."""
    query = span.query(prefix)
    return {"chart": f"{API}/chart.svg?{query}",
            "csv": {g: f"{API}/export.csv?granularity={g}&{query}" for g in GRANULARITIES}}


# --- routes -----------------------------------------------------------------------------------


@get("/", summary="Usage over a range: totals, a row per key, and the series (by hour up "
     "to three days, else by UTC day)")
async def usage_report(request: AdminRequest, range_name: RangeQuery = None,
                       start: FromQuery = None, end: ToQuery = None,
                       key: KeyQuery = None) -> dict[str, Any]:
    runtime = runtime_of(request)
    span = span_of(runtime, range_name, start, end)
    report = await report_for(runtime, span, key)
    classes = [c.to_dict() for c in await classes_for(runtime, report)]
    return {**report.to_dict(), "classes": classes,
            "links": links(span, report.key.prefix if report.key else "")}


@get("/chart.svg", summary="Tokens and requests over the range, SVG")
async def usage_chart(request: AdminRequest, range_name: RangeQuery = None,
                      start: FromQuery = None, end: ToQuery = None,
                      key: KeyQuery = None) -> Response[str]:
    runtime = runtime_of(request)
    report = await report_for(runtime, span_of(runtime, range_name, start, end), key)
    return Response(chart_for(report), media_type="image/svg+xml", headers=SVG_HEADERS)


@get("/export.csv", summary="Usage as CSV: per-request rows or hourly/daily roll-ups")
async def usage_export(request: AdminRequest, granularity: GranularityQuery = None,
                       range_name: RangeQuery = None, start: FromQuery = None,
                       end: ToQuery = None, key: KeyQuery = None) -> Stream:
    runtime = runtime_of(request)
    what = (granularity or "").strip()
    if what not in GRANULARITIES:
        raise ApplianceError(
            "usage_granularity_invalid",
            f"granularity: {what!r} is not one of {', '.join(GRANULARITIES)}",
            "use granularity=request for a row per request, hour or day for the roll-ups",
            status=400)
    span = span_of(runtime, range_name, start, end)
    prefix = check_prefix(key) if key else ""
    found, labels = await runtime.db.run(
        lambda s: (find_key(s, prefix) if prefix else None, key_labels(s)))
    key_id = found.id if found else None
    if what == "request":
        lines: Any = _request_stream(runtime, span, key_id, labels)
    else:
        lines = rollup_csv(await runtime.db.run(
            lambda s: rollup_rows(s, span.start, span.end, "hour" if what == "hour" else "day",
                                  key_id)), labels)
    filename = export_filename(what, span, prefix)
    return Stream(lines, media_type="text/csv; charset=utf-8", headers={
        **CSV_HEADERS, "Content-Disposition": f'attachment; filename="{filename}"'})


async def _request_stream(runtime: Runtime, span: Span, key_id: int | None,
                          labels: dict[int, KeyLabel]) -> AsyncIterator[str]:
    """The per-request export, a page of rows at a time (each page read in a thread)."""
    yield csv_line(REQUEST_COLUMNS)
    after: tuple[dt.datetime, int] | None = None
    while True:
        page = await runtime.db.run(partial(request_page, start=span.start, end=span.end,
                                            key_id=key_id, after=after))
        if page:
            yield "".join(request_lines(page, labels))
        if len(page) < PAGE:
            return
        after = (page[-1].record.started_at, page[-1].id)


def usage_router() -> Router:
    return Router(path=API, guards=[password_current], tags=["usage"],
                  route_handlers=[usage_report, usage_chart, usage_export])
