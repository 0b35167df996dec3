"""The Usage page's chart as a self-contained SVG string: tokens and requests over time.

Pure and deterministic (the same series gives the same bytes): no scripts, no styles from
outside (presentation attributes only, so it reads the same inlined in a page or served as
`image/svg+xml`), every text escaped. Same conventions as `appliance.tuning.chart`.

Two panels share one time axis (a bar per hour or per UTC day of the report's span), so the
two quantities keep scales of their own without a second y axis:

- tokens: prompt tokens with the part served from the prefix cache in a lighter shade, and
  completion tokens stacked on top;
- requests: the ones that succeeded, with errors stacked on top in red.

Every non-empty bar carries a `<title>` (a tooltip with its figures); the picture has a
legend, axis labels, and a `<title>`/`<desc>` that says the totals in words.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass
from html import escape

from appliance.gateway.report import Granularity, SeriesPoint
from appliance.svg import num, text_element
from appliance.tuning.chart import nice_ceiling

CACHED_COLOUR = "#8fb8e6"
PROMPT_COLOUR = "#0b5cad"
COMPLETION_COLOUR = "#b45309"
OK_COLOUR = "#5b6672"
ERROR_COLOUR = "#b42318"
GRID_COLOUR = "#e4e7eb"
AXIS_COLOUR = "#8a949e"
MAX_LABELS = 12
HOUR_STEPS = (1, 2, 3, 4, 6, 12, 24)
DAY_STEPS = (1, 2, 3, 5, 7, 14, 30, 61)


@dataclass(frozen=True)
class Panel:
    """One plot of the chart: where it sits, and its y scale."""

    top: float
    height: float
    y_max: float

    @property
    def baseline(self) -> float:
        return self.top + self.height

    def y(self, value: float) -> float:
        return self.baseline - value / self.y_max * self.height

    def bar(self, low: float, high: float) -> tuple[float, float]:
        """(y, height) of a bar from `low` to `high`; at least 1 px when it is not empty."""
        y_low, y_high = self.y(low), self.y(high)
        if high > low and y_low - y_high < 1:
            y_high = y_low - 1
        return y_high, y_low - y_high


@dataclass(frozen=True)
class Frame:
    width: int = 760
    height: int = 400
    left: int = 64
    right: int = 20
    count: int = 1

    @property
    def plot_width(self) -> float:
        return self.width - self.left - self.right

    @property
    def slot(self) -> float:
        return self.plot_width / max(self.count, 1)

    def centre(self, index: int) -> float:
        return self.left + (index + 0.5) * self.slot

    @property
    def bar_width(self) -> float:
        return max(self.slot * 0.7, 1.0)


def compact(value: float) -> str:
    """1234 -> 1.23K, 2500000 -> 2.5M: token and request counts on an axis."""
    for scale, unit in ((1e9, "G"), (1e6, "M"), (1e3, "K")):
        if abs(value) >= scale:
            return f"{value / scale:.3g}{unit}"
    return f"{value:g}"


def _rect(cls: str, x: float, y: float, width: float, height: float, colour: str) -> str:
    return (f'<rect class="{cls}" x="{num(x)}" y="{num(y)}" width="{num(width)}" '
            f'height="{num(height)}" fill="{colour}"/>')


def bucket_text(bucket: dt.datetime, granularity: Granularity) -> str:
    at = bucket.astimezone(dt.UTC)
    return at.strftime("%Y-%m-%d %H:00") if granularity == "hour" else at.strftime("%Y-%m-%d")


def label_step(count: int, granularity: Granularity) -> int:
    """Buckets between two x labels: the smallest step giving at most MAX_LABELS labels."""
    steps = HOUR_STEPS if granularity == "hour" else DAY_STEPS
    return next((s for s in steps if count / s <= MAX_LABELS), steps[-1])


def render_usage_chart(points: Sequence[SeriesPoint], *, granularity: Granularity,
                       title: str = "Tokens and requests over time",
                       id_prefix: str = "usage-chart", width: int = 760,
                       height: int = 400) -> str:
    """The chart as an `<svg>` element (no XML declaration, so it can be inlined in HTML).
    `points` are the report's series, one per bucket (any order; sorted here)."""
    ordered = sorted(points, key=lambda p: p.bucket)
    frame = Frame(width=width, height=height, count=len(ordered))
    token_top, token_step = nice_ceiling(max((p.tokens for p in ordered), default=0))
    request_top, request_step = nice_ceiling(max((p.requests for p in ordered), default=0))
    # Legend and the tokens heading above (72 px), the requests heading between the panels
    # (40), the time labels and the axis title below (58): the rest is split 0.565 : 0.435.
    plot = height - 170
    tokens = Panel(top=72, height=round(plot * 0.565), y_max=token_top)
    requests = Panel(top=tokens.baseline + 40, height=plot - tokens.height, y_max=request_top)
    pid = escape(id_prefix)
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" '
        f'width="100%" role="img" aria-labelledby="{pid}-title {pid}-desc" '
        f'class="usage-chart" font-family="system-ui, -apple-system, Segoe UI, sans-serif" '
        f'data-tokens-max="{num(token_top)}" data-requests-max="{num(request_top)}" '
        f'data-buckets="{len(ordered)}">',
        f'<title id="{pid}-title">{escape(title)}</title>',
        f'<desc id="{pid}-desc">{escape(describe(ordered, granularity))}</desc>',
    ]
    out += _legend(frame)
    for panel, step, name in ((tokens, token_step, "Tokens"),
                              (requests, request_step, "Requests")):
        out += _panel_axes(frame, panel, step, name)
    out += _time_axis(frame, ordered, granularity, tokens, requests)
    if not any(p.requests or p.tokens for p in ordered):
        middle = (tokens.top + requests.baseline) / 2
        out.append(text_element(frame.left + frame.plot_width / 2, middle,
                                "No requests in this range", anchor="middle", size=13,
                                extra=' class="empty"'))
        out.append("</svg>")
        return "\n".join(out)
    out.append('<g class="bars">')
    for index, point in enumerate(ordered):
        if point.requests or point.tokens:
            out += _bars(frame, index, point, granularity, tokens, requests)
    out.append("</g>")
    out.append("</svg>")
    return "\n".join(out)


def _bars(frame: Frame, index: int, p: SeriesPoint, granularity: Granularity,
          tokens: Panel, requests: Panel) -> list[str]:
    x = frame.centre(index) - frame.bar_width / 2
    w = frame.bar_width
    cached = min(p.cached_tokens, p.prompt_tokens)
    tip = (f"{bucket_text(p.bucket, granularity)} UTC: {p.requests:,} requests, "
           f"{p.errors:,} errors; {p.prompt_tokens:,} prompt tokens ({cached:,} cached), "
           f"{p.completion_tokens:,} completion tokens")
    out = [f'<g class="bucket" data-bucket="{escape(p.bucket.isoformat())}">',
           f"<title>{escape(tip)}</title>"]
    for cls, low, high, colour in (
            ("cached", 0, cached, CACHED_COLOUR),
            ("prompt", cached, p.prompt_tokens, PROMPT_COLOUR),
            ("completion", p.prompt_tokens, p.tokens, COMPLETION_COLOUR)):
        if high > low:
            out.append(_rect(cls, x, *_column(tokens, low, high, w), colour))
    ok = p.requests - p.errors
    for cls, low, high, colour in (("ok", 0, ok, OK_COLOUR),
                                   ("errors", ok, p.requests, ERROR_COLOUR)):
        if high > low:
            out.append(_rect(cls, x, *_column(requests, low, high, w), colour))
    out.append("</g>")
    return out


def _column(panel: Panel, low: float, high: float, width: float) -> tuple[float, float, float]:
    y, h = panel.bar(low, high)
    return y, width, h


def _panel_axes(frame: Frame, panel: Panel, step: float, name: str) -> list[str]:
    right = frame.width - frame.right
    out = [f'<g class="axes {name.lower()}-axes">',
           text_element(frame.left, panel.top - 10, name, size=12, weight="600")]
    value = 0.0
    while value <= panel.y_max + 1e-9:
        y = panel.y(value)
        out.append(f'<line x1="{frame.left}" x2="{num(right)}" y1="{num(y)}" '
                   f'y2="{num(y)}" stroke="{GRID_COLOUR}" stroke-width="1"/>')
        out.append(text_element(frame.left - 8, y + 4, compact(value), anchor="end", size=11))
        value += step
    out.append(f'<line x1="{frame.left}" x2="{num(right)}" y1="{num(panel.baseline)}" '
               f'y2="{num(panel.baseline)}" stroke="{AXIS_COLOUR}" stroke-width="1"/>')
    out.append(f'<line x1="{frame.left}" x2="{frame.left}" y1="{num(panel.top)}" '
               f'y2="{num(panel.baseline)}" stroke="{AXIS_COLOUR}" stroke-width="1"/>')
    out.append("</g>")
    return out


def _time_axis(frame: Frame, ordered: Sequence[SeriesPoint], granularity: Granularity,
               tokens: Panel, requests: Panel) -> list[str]:
    out = ['<g class="axes time-axis">']
    step = label_step(len(ordered), granularity)
    for index, point in enumerate(ordered):
        at = point.bucket.astimezone(dt.UTC)
        position = at.hour if granularity == "hour" else index
        if position % step:
            continue
        x = frame.centre(index)
        for panel in (tokens, requests):
            out.append(f'<line x1="{num(x)}" x2="{num(x)}" y1="{num(panel.baseline)}" '
                       f'y2="{num(panel.baseline + 4)}" stroke="{AXIS_COLOUR}" '
                       'stroke-width="1"/>')
        y = requests.baseline + 17
        if granularity == "hour":
            out.append(text_element(x, y, at.strftime("%H:00"), anchor="middle", size=11))
            if at.hour == 0 or index < step:
                out.append(text_element(x, y + 13, at.strftime("%m-%d"), anchor="middle", size=11))
        else:
            out.append(text_element(x, y, at.strftime("%m-%d"), anchor="middle", size=11))
    unit = "hour" if granularity == "hour" else "day"
    out.append(text_element(frame.left + frame.plot_width / 2, frame.height - 8,
                            f"time (UTC), one bar per {unit}", anchor="middle", size=12))
    out.append("</g>")
    return out


def _legend(frame: Frame) -> list[str]:
    out = ['<g class="legend">']
    x, y = float(frame.left), 20.0
    for label, colour in (("Cached prompt tokens", CACHED_COLOUR),
                          ("Other prompt tokens", PROMPT_COLOUR),
                          ("Completion tokens", COMPLETION_COLOUR),
                          ("Requests", OK_COLOUR), ("Errors", ERROR_COLOUR)):
        out.append(f'<rect x="{num(x)}" y="{num(y - 9)}" width="12" height="12" '
                   f'fill="{colour}"/>')
        out.append(text_element(x + 17, y + 2, label, size=12))
        x += 17 + len(label) * 6.4 + 16
        if x > frame.width - 150:
            x, y = float(frame.left), y + 20
    out.append("</g>")
    return out


def describe(points: Sequence[SeriesPoint], granularity: Granularity) -> str:
    """The chart in words (its `<desc>`)."""
    if not points:
        return "No time range to show."
    first = bucket_text(points[0].bucket, granularity)
    last = bucket_text(points[-1].bucket, granularity)
    unit = "hour" if granularity == "hour" else "day"
    where = f"From {first} to {last} UTC, by {unit}"
    requests = sum(p.requests for p in points)
    if not requests:
        return f"{where}: no requests were recorded."
    errors = sum(p.errors for p in points)
    prompt = sum(p.prompt_tokens for p in points)
    cached = sum(p.cached_tokens for p in points)
    completion = sum(p.completion_tokens for p in points)
    busiest = max(points, key=lambda p: (p.requests, -p.bucket.timestamp()))
    share = f" ({cached / prompt:.0%} cached)" if prompt else ""
    return (f"{where}: {requests:,} requests ({errors:,} errors), {prompt:,} prompt tokens"
            f"{share} and {completion:,} completion tokens. The busiest {unit}, "
            f"{bucket_text(busiest.bucket, granularity)}, had {busiest.requests:,} requests.")
