"""Sparklines (`appliance.health.sparkline`): valid SVG, the window, gaps, scaling, labels,
flat and empty series, escaping."""

from __future__ import annotations

import datetime as dt
import re
import xml.etree.ElementTree as ET

from appliance.health.sparkline import Spark, render_sparkline, segments, y_range

NS = {"svg": "http://www.w3.org/2000/svg"}
END = dt.datetime(2026, 3, 1, 12, 0, tzinfo=dt.UTC)
TEMP = Spark("GPU 3 temperature", lambda v: f"{v:.0f} °C", min_span=10.0, lower=0.0)
UTIL = Spark("GPU 3 utilisation", lambda v: f"{v:.0f} %", min_span=10.0, lower=0.0,
             upper=100.0)


def series(values: list[float], *, every: int = 15, last_at: dt.datetime = END,
           ) -> list[tuple[dt.datetime, float]]:
    """`values` sampled every `every` seconds, the last at `last_at`."""
    n = len(values)
    return [(last_at - dt.timedelta(seconds=every * (n - 1 - i)), v)
            for i, v in enumerate(values)]


def parse(svg: str) -> ET.Element:
    return ET.fromstring(svg)  # noqa: S314 - our own output


def ys(svg: ET.Element) -> list[float]:
    out = []
    for path in svg.findall("svg:path", NS):
        out += [float(y) for y in re.findall(r"[ML][\d.]+ ([\d.]+)", path.get("d", ""))]
    return out


def test_a_steady_hour_is_one_line_with_the_last_value_labelled() -> None:
    points = series([40 + (i % 7) for i in range(240)])
    svg = parse(render_sparkline(points, TEMP, end=END, id_prefix="t"))
    assert svg.get("role") == "img" and svg.get("aria-labelledby") == "t-title"
    assert svg.get("data-points") == "240" and svg.get("data-segments") == "1"
    [path] = svg.findall("svg:path", NS)
    assert path.get("d", "").count("M") == 1 and path.get("d", "").count("L") == 239
    assert svg.find("svg:text", NS).text == f"{points[-1][1]:.0f} °C"  # type: ignore[union-attr]
    title = svg.find("svg:title", NS).text  # type: ignore[union-attr]
    assert title == ("GPU 3 temperature, last hour: from 40 °C to 46 °C, latest "
                     f"{points[-1][1]:.0f} °C at 12:00 UTC")
    assert svg.find("svg:circle[@class='last']", NS) is not None


def test_samples_outside_the_window_are_left_out() -> None:
    old = [(END - dt.timedelta(hours=2), 99.0), (END - dt.timedelta(minutes=61), 99.0)]
    future = [(END + dt.timedelta(minutes=1), 99.0)]
    points = old + series([50.0, 51.0, 52.0]) + future + [(END, float("nan"))]
    svg = parse(render_sparkline(points, TEMP, end=END, id_prefix="w"))
    assert svg.get("data-points") == "3"
    assert "99" not in (svg.find("svg:title", NS).text or "")  # type: ignore[union-attr]


def test_a_gap_breaks_the_line() -> None:
    before = series([50.0] * 20, last_at=END - dt.timedelta(minutes=30))
    after = series([60.0] * 20)
    svg_text = render_sparkline(before + after, TEMP, end=END, id_prefix="g")
    svg = parse(svg_text)
    assert svg.get("data-segments") == "2"
    [path_a, path_b] = svg.findall("svg:path", NS)
    assert path_a.get("d", "").startswith("M") and path_b.get("d", "").startswith("M")
    assert "1 gap without samples" in (svg.find("svg:title", NS).text or "")  # type: ignore[union-attr]
    # A spacing of up to three intervals is not a gap.
    points = [(END - dt.timedelta(seconds=s), 1.0) for s in (0, 15, 30, 75, 90)]  # 45 s: 3x
    assert len(segments(sorted(points))) == 1
    points = [(END - dt.timedelta(seconds=s), 1.0) for s in (0, 15, 30, 90, 105)]  # 60 s: 4x
    assert len(segments(sorted(points))) == 2


def test_a_lone_sample_between_gaps_is_a_dot() -> None:
    lone = (END - dt.timedelta(minutes=20), 55.0)
    points = [*series([50.0] * 10, last_at=END - dt.timedelta(minutes=40)), lone,
              *series([52.0] * 10)]
    svg = parse(render_sparkline(points, TEMP, end=END, id_prefix="d"))
    assert svg.get("data-segments") == "3"
    assert len(svg.findall("svg:path", NS)) == 2
    assert len(svg.findall("svg:circle[@class='lone']", NS)) == 1


def test_a_flat_series_sits_in_the_middle_not_at_an_edge() -> None:
    svg = parse(render_sparkline(series([45.0] * 30), TEMP, end=END, id_prefix="f"))
    heights = set(ys(svg))
    assert len(heights) == 1
    assert heights.pop() == 14.0  # the middle of a 28 px box
    assert y_range([45.0, 45.2], TEMP) == (40.1, 50.1)


def test_scaling_keeps_the_floor_and_the_bounds() -> None:
    assert y_range([0.0, 1.0], UTIL) == (0.0, 10.0)  # widened upwards, not below 0
    assert y_range([99.0, 100.0], UTIL) == (90.0, 100.0)  # widened downwards, not above 100
    assert y_range([20.0, 80.0], UTIL) == (20.0, 80.0)  # a wide range is its own
    flat = Spark("x", str, min_span=0.0)
    assert y_range([3.0, 3.0], flat) == (3.0, 4.0)
    svg = parse(render_sparkline(series([0.0, 100.0, 0.0, 100.0]), UTIL, end=END,
                                 id_prefix="u"))
    heights = ys(svg)
    assert min(heights) == 3.0 and max(heights) == 25.0  # the padding, top and bottom


def test_an_empty_window_says_no_data() -> None:
    svg = parse(render_sparkline([], TEMP, end=END, id_prefix="e"))
    assert svg.get("data-points") == "0" and svg.get("data-segments") == "0"
    assert svg.find("svg:path", NS) is None
    assert svg.find("svg:text", NS).text == "no data"  # type: ignore[union-attr]
    title = svg.find("svg:title", NS).text  # type: ignore[union-attr]
    assert title == "GPU 3 temperature, last hour: no samples"


def test_text_is_escaped_and_the_output_deterministic() -> None:
    nasty = Spark('<b>"GPU" & co</b>', lambda v: f"<{v:g}>", min_span=1.0)
    points = series([1.0, 2.0])
    text = render_sparkline(points, nasty, end=END, id_prefix='a"b<c')
    svg = parse(text)  # still well-formed
    assert "<b>" not in text and "<2>" not in text
    assert svg.find("svg:text", NS).text == "<2>"  # type: ignore[union-attr]
    assert svg.find("svg:title", NS).text.startswith('<b>"GPU" & co</b>')  # type: ignore[union-attr]
    assert text == render_sparkline(list(reversed(points)), nasty, end=END, id_prefix='a"b<c')
