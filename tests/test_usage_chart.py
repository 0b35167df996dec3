"""The Usage page's chart (`appliance.gateway.usage_chart`), pure: golden bars of a two-hour
series (every coordinate derived below), structure, escaping, determinism, time labels and
the empty chart.

The layout of the default 760 x 400 frame: x from 64 to 740 (676 px); the tokens panel from
y 72 to 202 (130 px), the requests panel from 242 to 342 (100 px). Two buckets: a slot of
338 px, bars 236.6 px wide centred at 233 and 571, so they start at 114.7 and 452.7.
"""

from __future__ import annotations

import datetime as dt
import re
import xml.etree.ElementTree as ET

import pytest

from appliance.gateway.report import SeriesPoint
from appliance.gateway.usage_chart import (
    compact,
    describe,
    label_step,
    render_usage_chart,
)

SVG = "{http://www.w3.org/2000/svg}"
UTC = dt.UTC


def hour(h: int, day: int = 30) -> dt.datetime:
    return dt.datetime(2026, 11, day, h, tzinfo=UTC)


# 10:00 - 10 requests (2 errors), 600 prompt tokens (240 cached), 600 completion: 1200 tokens.
# 11:00 - 4 requests, 300 prompt tokens, none cached, 100 completion.
TWO = [SeriesPoint(hour(10), 10, 2, 600, 600, 240), SeriesPoint(hour(11), 4, 0, 300, 100, 0)]


def parse(svg: str) -> ET.Element:
    return ET.fromstring(svg)  # noqa: S314 - our own output, parsed to check it


def rects(root: ET.Element, cls: str) -> list[dict[str, str]]:
    return [dict(e.attrib) for e in root.iter(f"{SVG}rect") if e.get("class") == cls]


def texts(root: ET.Element) -> list[str]:
    return [e.text or "" for e in root.iter(f"{SVG}text")]


def test_golden_bars() -> None:
    """Tokens top 1200 (step 200, six intervals): y(v) = 202 - 130 v / 1200, so cached 240 ->
    176 (26 px), prompt to 600 -> 137 (39 px), completion to 1200 -> 72 (65 px). Requests top
    10 (step 2): y(v) = 342 - 10 v, so 8 succeeded -> 262 (80 px), 2 errors -> 242 (20 px)."""
    svg = render_usage_chart(TWO, granularity="hour")
    assert 'data-tokens-max="1200" data-requests-max="10" data-buckets="2"' in svg
    root = parse(svg)
    assert rects(root, "cached") == [{"class": "cached", "x": "114.7", "y": "176",
                                      "width": "236.6", "height": "26", "fill": "#8fb8e6"}]
    prompt, completion = rects(root, "prompt"), rects(root, "completion")
    assert (prompt[0]["y"], prompt[0]["height"]) == ("137", "39")
    assert (completion[0]["y"], completion[0]["height"]) == ("72", "65")
    ok, errors = rects(root, "ok"), rects(root, "errors")
    assert [(r["x"], r["y"], r["height"]) for r in ok] == [("114.7", "262", "80"),
                                                            ("452.7", "302", "40")]
    assert [(r["y"], r["height"]) for r in errors] == [("242", "20")]  # none at 11:00
    assert len(rects(root, "cached")) == 1  # nothing cached at 11:00: no empty rect
    # 11:00: 300 prompt -> y 169.5 (32.5 px); 100 completion on top -> 158.7 (10.8 px).
    assert (prompt[1]["y"], prompt[1]["height"]) == ("169.5", "32.5")
    assert (completion[1]["y"], completion[1]["height"]) == ("158.7", "10.8")


def test_same_series_same_bytes_in_any_order() -> None:
    assert render_usage_chart(TWO, granularity="hour") == render_usage_chart(
        list(reversed(TWO)), granularity="hour")


def test_accessible_self_contained_svg_with_tooltips() -> None:
    svg = render_usage_chart(TWO, granularity="hour", title="Last 24 hours")
    root = parse(svg)
    assert root.get("viewBox") == "0 0 760 400" and root.get("role") == "img"
    title, desc = root.find(f"{SVG}title"), root.find(f"{SVG}desc")
    assert title is not None and desc is not None and title.text == "Last 24 hours"
    assert root.get("aria-labelledby") == f"{title.get('id')} {desc.get('id')}"
    assert desc.text == (
        "From 2026-11-30 10:00 to 2026-11-30 11:00 UTC, by hour: 14 requests (2 errors), "
        "900 prompt tokens (27% cached) and 700 completion tokens. The busiest hour, "
        "2026-11-30 10:00, had 10 requests.")
    tips = [g.findtext(f"{SVG}title") for g in root.iter(f"{SVG}g") if g.get("class") == "bucket"]
    assert tips[0] == ("2026-11-30 10:00 UTC: 10 requests, 2 errors; 600 prompt tokens "
                       "(240 cached), 600 completion tokens")
    assert "<script" not in svg and "<style" not in svg and "href" not in svg
    assert not re.search(r"\son[a-z]+=", svg)
    labels = texts(root)
    for entry in ("Cached prompt tokens", "Other prompt tokens", "Completion tokens",
                  "Requests", "Errors", "Tokens", "time (UTC), one bar per hour"):
        assert entry in labels
    # y ticks: the tokens axis in compact numbers, the requests axis by 2.
    y_ticks = [e.text for e in root.iter(f"{SVG}text") if e.get("x") == "56"]
    assert y_ticks == ["0", "200", "400", "600", "800", "1K", "1.2K",
                       "0", "2", "4", "6", "8", "10"]


def test_text_is_escaped() -> None:
    hostile = 'Key <script>alert("x")</script> & "friends"'
    svg = render_usage_chart(TWO, granularity="hour", title=hostile, id_prefix='c" onload="x')
    assert "<script>" not in svg and 'onload="x"' not in svg
    title = parse(svg).find(f"{SVG}title")
    assert title is not None and title.text == hostile


def test_hour_labels_follow_the_clock_and_mark_midnight() -> None:
    points = [SeriesPoint(hour(13, 29) + dt.timedelta(hours=i), 0, 0, 0, 0, 0)
              for i in range(24)]
    labels = texts(parse(render_usage_chart(points, granularity="hour")))
    assert label_step(24, "hour") == 2
    hours = [t for t in labels if re.fullmatch(r"\d\d:00", t)]
    assert hours == ["14:00", "16:00", "18:00", "20:00", "22:00", "00:00", "02:00", "04:00",
                     "06:00", "08:00", "10:00", "12:00"]
    assert [t for t in labels if re.fullmatch(r"\d\d-\d\d", t)] == ["11-29", "11-30"]


def test_day_labels() -> None:
    points = [SeriesPoint(hour(0, 1) + dt.timedelta(days=i), 1, 0, 1, 1, 0)
              for i in range(30)]
    root = parse(render_usage_chart(points, granularity="day"))
    assert label_step(30, "day") == 3
    days = [t for t in texts(root) if re.fullmatch(r"\d\d-\d\d", t)]
    assert days[:3] == ["11-01", "11-04", "11-07"] and len(days) == 10
    assert "time (UTC), one bar per day" in texts(root)
    assert len(rects(root, "ok")) == 30


def test_an_empty_range_says_so() -> None:
    points = [SeriesPoint(hour(h), 0, 0, 0, 0, 0) for h in range(3)]
    root = parse(render_usage_chart(points, granularity="hour"))
    assert "No requests in this range" in texts(root)
    assert [g for g in root.iter(f"{SVG}g") if g.get("class") == "bars"] == []
    assert describe(points, "hour").endswith("no requests were recorded.")
    assert "No requests in this range" in render_usage_chart([], granularity="day")


def test_a_tiny_bar_is_still_visible() -> None:
    points = [SeriesPoint(hour(10), 1000, 0, 0, 0, 0), SeriesPoint(hour(11), 1, 1, 0, 0, 0)]
    root = parse(render_usage_chart(points, granularity="hour"))
    assert rects(root, "errors")[0]["height"] == "1"  # 0.1 px drawn as 1


@pytest.mark.parametrize(("value", "text"), [
    (0, "0"), (950, "950"), (1000, "1K"), (1250, "1.25K"), (2_500_000, "2.5M"),
    (3_000_000_000, "3G"),
])
def test_compact(value: float, text: str) -> None:
    assert compact(value) == text
