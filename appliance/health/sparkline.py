"""Sparklines: one series over a fixed window (the last hour) as a small inline SVG string.

Pure and deterministic (the same points give the same bytes), in the conventions of
`appliance.gateway.usage_chart`: no scripts, presentation attributes only, every text escaped,
an accessible `<title>` saying the figures in words.

What it draws:

- the samples inside the window (finite ones: a NaN counts as missing) as a line, x by time
  across the whole window (so an hour with samples only in its last ten minutes looks like
  that);
- a break in the line where samples are missing: a gap longer than `GAP_INTERVALS` times the
  series' usual interval (the median spacing) starts a new segment; a lone sample between
  two gaps is a dot;
- the y scale from the window's minimum to its maximum, but never shorter than the series'
  `min_span` (a temperature wobbling by 0.3 °C stays a flat line instead of a zigzag filling
  the box) and kept inside its `lower`/`upper` bounds (utilisation stays within 0-100 %);
- the last value, as the series formats it, to the right of the line, with a dot on it.

An empty window draws "no data" instead of a line.
"""

from __future__ import annotations

import datetime as dt
import itertools
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from html import escape

from appliance.svg import TEXT_COLOUR, num

Point = tuple[dt.datetime, float]

WINDOW = dt.timedelta(hours=1)
GAP_INTERVALS = 3.0
LINE_COLOUR = "#0b5cad"
MUTED_COLOUR = "#8a949e"


@dataclass(frozen=True)
class Spark:
    """How one series is drawn: its name for people, how a value reads, its y floor.

    `min_span` is the smallest height of the y scale, in the series' unit; `lower`/`upper`,
    when set, bound the scale (no value is ever outside them)."""

    title: str
    fmt: Callable[[float], str]
    min_span: float
    lower: float | None = None
    upper: float | None = None


@dataclass(frozen=True)
class Box:
    """The picture's size: the line's area, then the label's on its right."""

    width: int = 150
    height: int = 28
    label: int = 58
    pad: float = 3.0

    @property
    def plot_width(self) -> float:
        return self.width - self.label - self.pad


def y_range(values: Sequence[float], spark: Spark) -> tuple[float, float]:
    """(low, high) of the y scale: the values' range, widened to `min_span` around its
    middle, then moved (not squeezed) inside the bounds."""
    low, high = min(values), max(values)
    if high - low < spark.min_span:
        middle = (low + high) / 2
        low, high = middle - spark.min_span / 2, middle + spark.min_span / 2
    if spark.lower is not None and low < spark.lower:
        low, high = spark.lower, high + (spark.lower - low)
    if spark.upper is not None and high > spark.upper:
        low, high = low - (high - spark.upper), spark.upper
        if spark.lower is not None:
            low = max(low, spark.lower)
    if high <= low:  # min_span 0 and a flat series: any non-empty range will do
        high = low + 1.0
    return low, high


def segments(points: Sequence[Point]) -> list[list[Point]]:
    """The points (in time order) cut where a gap exceeds GAP_INTERVALS usual intervals."""
    if not points:
        return []
    steps = [(b[0] - a[0]).total_seconds() for a, b in itertools.pairwise(points)]
    positive = [s for s in steps if s > 0]
    usual = statistics.median(positive) if positive else 0.0
    out = [[points[0]]]
    for step, point in zip(steps, points[1:], strict=True):
        if usual and step > GAP_INTERVALS * usual:
            out.append([point])
        else:
            out[-1].append(point)
    return out


def _clock(at: dt.datetime) -> str:
    return at.astimezone(dt.UTC).strftime("%H:%M UTC")


def describe(points: Sequence[Point], spark: Spark, gaps: int) -> str:
    """The sparkline in words (its `<title>`)."""
    if not points:
        return f"{spark.title}, last hour: no samples"
    values = [v for _, v in points]
    last_at, last = points[-1]
    where = f"{spark.title}, last hour: from {spark.fmt(min(values))} to {spark.fmt(max(values))}"
    missing = f", {gaps} gap{'s' if gaps != 1 else ''} without samples" if gaps else ""
    return f"{where}, latest {spark.fmt(last)} at {_clock(last_at)}{missing}"


def render_sparkline(points: Sequence[Point], spark: Spark, *, end: dt.datetime,
                     id_prefix: str, window: dt.timedelta = WINDOW, box: Box | None = None,
                     colour: str = LINE_COLOUR) -> str:
    """An `<svg>` element (inlinable in HTML) of the samples in (end - window, end].

    `id_prefix` must be unique on the page (it names the `<title>` for aria-labelledby)."""
    box = box or Box()
    start = end - window
    inside = sorted((p for p in points if start < p[0] <= end and math.isfinite(p[1])),
                    key=lambda p: p[0])
    parts = segments(inside)
    pid = escape(id_prefix)
    title = describe(inside, spark, max(len(parts) - 1, 0))
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {box.width} {box.height}" '
           f'width="{box.width}" height="{box.height}" role="img" '
           f'aria-labelledby="{pid}-title" class="sparkline" '
           f'font-family="system-ui, -apple-system, Segoe UI, sans-serif" '
           f'data-points="{len(inside)}" data-segments="{len(parts)}">',
           f'<title id="{pid}-title">{escape(title)}</title>']
    middle = box.height / 2
    if not inside:
        out.append(f'<line x1="{num(box.pad)}" x2="{num(box.plot_width)}" '
                   f'y1="{num(middle)}" y2="{num(middle)}" stroke="{MUTED_COLOUR}" '
                   'stroke-width="1" stroke-dasharray="2 3"/>')
        out.append(_label(box, middle, "no data", MUTED_COLOUR))
        out.append("</svg>")
        return "\n".join(out)
    low, high = y_range([v for _, v in inside], spark)
    span = window.total_seconds()

    def xy(point: Point) -> tuple[float, float]:
        x = box.pad + (point[0] - start).total_seconds() / span * (box.plot_width - box.pad)
        y = box.height - box.pad - (point[1] - low) / (high - low) * (box.height - 2 * box.pad)
        return x, y

    for part in parts:
        if len(part) == 1:
            x, y = xy(part[0])
            out.append(f'<circle class="lone" cx="{num(x)}" cy="{num(y)}" r="1.5" '
                       f'fill="{colour}"/>')
            continue
        path = " ".join(f"{'M' if i == 0 else 'L'}{num(x)} {num(y)}"
                        for i, (x, y) in enumerate(map(xy, part)))
        out.append(f'<path class="line" d="{path}" fill="none" stroke="{colour}" '
                   'stroke-width="1.5" stroke-linejoin="round" stroke-linecap="round"/>')
    x, y = xy(inside[-1])
    out.append(f'<circle class="last" cx="{num(x)}" cy="{num(y)}" r="2" fill="{colour}"/>')
    out.append(_label(box, middle, spark.fmt(inside[-1][1]), TEXT_COLOUR))
    out.append("</svg>")
    return "\n".join(out)


def _label(box: Box, middle: float, text: str, colour: str) -> str:
    return (f'<text class="value" x="{num(box.plot_width + 5)}" y="{num(middle + 4)}" '
            f'font-size="11" fill="{colour}">{escape(text)}</text>')
