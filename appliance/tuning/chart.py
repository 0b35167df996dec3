"""The Tuning page's chart as a self-contained SVG string: concurrent requests against ratio.

Pure and deterministic (the same inputs give the same bytes, so it can be golden-tested): no
scripts, no styles from outside (presentation attributes only, so it reads the same inlined
in a page or served as `image/svg+xml`), every text escaped.

What it draws, over a log-scale x axis of `--mamba-full-memory-ratio` from 0.02 to 50 and a
linear y axis of concurrent requests:

- the state-slot limit (rises with the ratio) and the KV limit (falls with it) as two curves,
  the KV one dashed so the two differ without colour;
- the requests the workload gets (the lower of the two, 0 where the longest request does not
  fit) as a shaded area;
- their crossing, the balanced ratio, as a ringed point; the current and recommended ratios as
  vertical lines; the target concurrency as a dashed horizontal line;
- axis ticks and labels, a legend, and `<title>`/`<desc>` for screen readers.

The y axis ends a little above the best the workload can get (or the target), so the region
that matters fills the plot; the KV curve, which runs to thousands at low ratios, leaves the
top and is clipped.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from html import escape

from appliance.svg import num, text_element
from appliance.tuning.recommend import CurvePoint

X_LOW = 0.02
X_HIGH = 50.0
X_TICKS = (0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0)
HEADROOM = 1.3  # the y axis reaches 30 % above the best point (or the target)

STATE_COLOUR = "#6639ba"
KV_COLOUR = "#b45309"
SERVED_COLOUR = "#0b5cad"
CURRENT_COLOUR = "#1d232a"
RECOMMENDED_COLOUR = "#0b5cad"
BALANCED_COLOUR = "#1a7f37"
GRID_COLOUR = "#e4e7eb"
AXIS_COLOUR = "#8a949e"


@dataclass(frozen=True)
class Frame:
    """Where the plot sits in the picture, and its scales."""

    width: int = 760
    height: int = 380
    left: int = 60
    right: int = 20
    top: int = 88
    bottom: int = 52
    y_max: float = 100.0

    @property
    def plot_width(self) -> float:
        return self.width - self.left - self.right

    @property
    def plot_height(self) -> float:
        return self.height - self.top - self.bottom

    @property
    def baseline(self) -> float:
        return self.top + self.plot_height

    def x(self, ratio: float) -> float:
        ratio = min(max(ratio, X_LOW), X_HIGH)
        share = math.log(ratio / X_LOW) / math.log(X_HIGH / X_LOW)
        return self.left + share * self.plot_width

    def y(self, value: float) -> float:
        return self.baseline - value / self.y_max * self.plot_height


def nice_ceiling(value: float) -> tuple[float, float]:
    """(top, step): the smallest 1/2/2.5/5 x 10^k step giving at most 6 intervals to reach
    `value`, and that top."""
    value = max(value, 1.0)
    magnitude = 10 ** math.floor(math.log10(value / 6))
    for factor in (1, 2, 2.5, 5, 10):
        step = factor * magnitude
        if step < 1:
            continue
        if math.ceil(value / step) <= 6:
            return math.ceil(value / step) * step, step
    raise AssertionError("unreachable: a factor of 10 always fits")


def ratio_text(ratio: float) -> str:
    """0.02, 0.9, 3.77, 50 — as the flag is typed."""
    return f"{ratio:g}" if ratio >= 0.01 else f"{ratio:.3g}"


def _polyline(frame: Frame, kind: str, points: Sequence[tuple[float, float]], colour: str, *,
              dash: str = "") -> str:
    coords = " ".join(f"{num(frame.x(r))},{num(frame.y(v))}" for r, v in points)
    dashed = f' stroke-dasharray="{dash}"' if dash else ""
    return (f'<polyline class="{kind}" points="{coords}" fill="none" stroke="{colour}" '
            f'stroke-width="2.5" stroke-linejoin="round"{dashed}/>')


def value_at(points: Sequence[CurvePoint], ratio: float, attr: str) -> float | None:
    """`attr` of the curve at `ratio`, linear in log(ratio) between the two nearest points;
    None outside the points."""
    ordered = sorted(points, key=lambda p: p.ratio)
    for left, right in itertools.pairwise(ordered):
        if left.ratio <= ratio <= right.ratio:
            if right.ratio == left.ratio:
                return float(getattr(left, attr))
            share = math.log(ratio / left.ratio) / math.log(right.ratio / left.ratio)
            low, high = float(getattr(left, attr)), float(getattr(right, attr))
            return low + share * (high - low)
    if ordered and ordered[0].ratio == ratio:
        return float(getattr(ordered[0], attr))
    return None


@dataclass(frozen=True)
class _Label:
    x: float
    text: str
    colour: str
    row: int = 0


def _place(labels: Sequence[_Label], frame: Frame, *, gap: float = 8.0) -> list[_Label]:
    """Marker labels in rows above the plot: each in the first row where it does not overlap
    the one before it (text width estimated at 6.4 px a character at 12 px)."""
    placed: list[_Label] = []
    ends: list[float] = []
    for label in sorted(labels, key=lambda item: item.x):
        half = len(label.text) * 3.2
        centre = min(max(label.x, frame.left + half), frame.width - frame.right - half)
        row = next((i for i, end in enumerate(ends) if centre - half >= end + gap), len(ends))
        if row == len(ends):
            ends.append(0.0)
        ends[row] = centre + half
        placed.append(_Label(centre, label.text, label.colour, row))
    return placed


def render_chart(points: Sequence[CurvePoint], *, current: float | None,
                 recommended: float | None, balanced: float | None,
                 target: int | None = None, current_concurrent: int | None = None,
                 recommended_concurrent: int | None = None,
                 title: str = "Concurrent requests against the memory ratio",
                 id_prefix: str = "tuning-chart", width: int = 760,
                 height: int = 380) -> str:
    """The chart as an `<svg>` element (no XML declaration, so it can be inlined in HTML).

    `points` are the curve (any order; sorted here); `current`, `recommended` and `balanced`
    are ratios to mark (None: not marked); `target` draws the concurrency target; the
    `*_concurrent` figures label the markers and place their dots on the served area."""
    ordered = sorted(points, key=lambda p: p.ratio)
    peak = max((p.concurrent for p in ordered), default=0)
    top, step = nice_ceiling(max(peak, target or 0, current_concurrent or 0,
                                 recommended_concurrent or 0) * HEADROOM)
    frame = Frame(width=width, height=height, y_max=top)
    pid = escape(id_prefix)
    words = describe(ordered, current=current, balanced=balanced, recommended=recommended,
                     target=target, current_concurrent=current_concurrent,
                     recommended_concurrent=recommended_concurrent)
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" '
        f'width="100%" role="img" aria-labelledby="{pid}-title {pid}-desc" '
        f'class="tuning-chart" font-family="system-ui, -apple-system, Segoe UI, sans-serif" '
        f'data-y-max="{num(top)}">',
        f'<title id="{pid}-title">{escape(title)}</title>',
        f'<desc id="{pid}-desc">{escape(words)}</desc>',
        f'<clipPath id="{pid}-clip"><rect x="{frame.left}" y="{frame.top}" '
        f'width="{num(frame.plot_width)}" height="{num(frame.plot_height)}"/></clipPath>',
        f'<rect x="{frame.left}" y="{frame.top}" width="{num(frame.plot_width)}" '
        f'height="{num(frame.plot_height)}" fill="#fbfcfd"/>',
    ]
    out += _axes(frame, step)
    out += _legend(frame, target)
    if not ordered:
        out.append(text_element(
            frame.left + frame.plot_width / 2, frame.top + frame.plot_height / 2,
            "No ratio from 0.02 to 50 leaves room for both pools in this budget",
            anchor="middle", size=13))
        out.append("</svg>")
        return "\n".join(out)
    out.append(f'<g clip-path="url(#{pid}-clip)" class="curves">')
    served = [(p.ratio, float(p.concurrent)) for p in ordered]
    area = " ".join(
        [f"{num(frame.x(ordered[0].ratio))},{num(frame.baseline)}"]
        + [f"{num(frame.x(r))},{num(frame.y(v))}" for r, v in served]
        + [f"{num(frame.x(ordered[-1].ratio))},{num(frame.baseline)}"])
    out.append(f'<polygon class="served" points="{area}" fill="{SERVED_COLOUR}" '
               'fill-opacity="0.12" stroke="none"/>')
    if target:
        y = frame.y(target)
        out.append(f'<line class="target" x1="{frame.left}" x2="{num(frame.width - frame.right)}" '
                   f'y1="{num(y)}" y2="{num(y)}" stroke="{AXIS_COLOUR}" stroke-width="1.5" '
                   'stroke-dasharray="2 4"/>')
    out.append(_polyline(frame, "state-limit", [(p.ratio, p.state_limit) for p in ordered],
                         STATE_COLOUR))
    out.append(_polyline(frame, "kv-limit", [(p.ratio, p.kv_limit) for p in ordered],
                         KV_COLOUR, dash="7 4"))
    out.append("</g>")
    if target:
        y = frame.y(target)
        if frame.top + 10 <= y <= frame.baseline:
            out.append(text_element(frame.left + 6, y - 5, f"target {target}", size=11,
                                    extra=' class="target-label" stroke="#fff" stroke-width="3" '
                                    'paint-order="stroke"'))
    out += _markers(frame, ordered, current=current, recommended=recommended,
                    balanced=balanced, current_concurrent=current_concurrent,
                    recommended_concurrent=recommended_concurrent)
    out.append("</svg>")
    return "\n".join(out)


def _axes(frame: Frame, step: float) -> list[str]:
    out = ['<g class="axes">']
    value = 0.0
    while value <= frame.y_max + 1e-9:
        y = frame.y(value)
        out.append(f'<line x1="{frame.left}" x2="{num(frame.width - frame.right)}" '
                   f'y1="{num(y)}" y2="{num(y)}" stroke="{GRID_COLOUR}" stroke-width="1"/>')
        out.append(text_element(frame.left - 8, y + 4, f"{value:g}", anchor="end", size=11))
        value += step
    for tick in X_TICKS:
        x = frame.x(tick)
        out.append(f'<line x1="{num(x)}" x2="{num(x)}" y1="{frame.top}" '
                   f'y2="{num(frame.baseline)}" stroke="{GRID_COLOUR}" stroke-width="1"/>')
        out.append(f'<line x1="{num(x)}" x2="{num(x)}" y1="{num(frame.baseline)}" '
                   f'y2="{num(frame.baseline + 5)}" stroke="{AXIS_COLOUR}" stroke-width="1"/>')
        out.append(text_element(x, frame.baseline + 18, ratio_text(tick), anchor="middle", size=11))
    out.append(f'<line x1="{frame.left}" x2="{num(frame.width - frame.right)}" '
               f'y1="{num(frame.baseline)}" y2="{num(frame.baseline)}" '
               f'stroke="{AXIS_COLOUR}" stroke-width="1"/>')
    out.append(f'<line x1="{frame.left}" x2="{frame.left}" y1="{frame.top}" '
               f'y2="{num(frame.baseline)}" stroke="{AXIS_COLOUR}" stroke-width="1"/>')
    out.append(text_element(frame.left + frame.plot_width / 2, frame.height - 10,
                            "--mamba-full-memory-ratio (state : KV, log scale)", anchor="middle",
                            size=12))
    middle = frame.top + frame.plot_height / 2
    out.append(text_element(16, middle, "concurrent requests", anchor="middle", size=12,
                            extra=f' transform="rotate(-90 16 {num(middle)})"'))
    out.append("</g>")
    return out


def _legend(frame: Frame, target: int | None) -> list[str]:
    out = ['<g class="legend">']
    x, y = float(frame.left), 16.0
    entries: list[tuple[str, str]] = [
        ("state", "State-slot limit"), ("kv", "KV limit"), ("served", "Requests served"),
    ]
    if target:
        entries.append(("target", "Target"))
    for kind, label in entries:
        if kind == "served":
            out.append(f'<rect x="{num(x)}" y="{num(y - 7)}" width="22" height="10" '
                       f'fill="{SERVED_COLOUR}" fill-opacity="0.12" stroke="{SERVED_COLOUR}" '
                       'stroke-opacity="0.3"/>')
        else:
            colour, dash, stroke = {
                "state": (STATE_COLOUR, "", "2.5"), "kv": (KV_COLOUR, "7 4", "2.5"),
                "target": (AXIS_COLOUR, "2 4", "1.5")}[kind]
            dashed = f' stroke-dasharray="{dash}"' if dash else ""
            out.append(f'<line x1="{num(x)}" x2="{num(x + 22)}" y1="{num(y - 2)}" '
                       f'y2="{num(y - 2)}" stroke="{colour}" stroke-width="{stroke}"{dashed}/>')
        out.append(text_element(x + 28, y + 2, label, size=12))
        x += 28 + len(label) * 6.6 + 20
    out.append("</g>")
    return out


def _markers(frame: Frame, ordered: Sequence[CurvePoint], *, current: float | None,
             recommended: float | None, balanced: float | None,
             current_concurrent: int | None,
             recommended_concurrent: int | None) -> list[str]:
    out: list[str] = ['<g class="markers">']
    labels: list[_Label] = []
    for kind, ratio, concurrent, colour, dash in (
            ("current", current, current_concurrent, CURRENT_COLOUR, "4 3"),
            ("recommended", recommended, recommended_concurrent, RECOMMENDED_COLOUR, "")):
        if ratio is None:
            continue
        x = frame.x(ratio)
        dashed = f' stroke-dasharray="{dash}"' if dash else ""
        out.append(f'<line class="{kind}" x1="{num(x)}" x2="{num(x)}" y1="{frame.top}" '
                   f'y2="{num(frame.baseline)}" stroke="{colour}" stroke-width="2"{dashed}/>')
        if concurrent is not None and concurrent <= frame.y_max:
            out.append(f'<circle class="{kind}-point" cx="{num(x)}" '
                       f'cy="{num(frame.y(concurrent))}" r="4" fill="{colour}"/>')
        figure = f" · {concurrent}" if concurrent is not None else ""
        labels.append(_Label(x, f"{kind} {ratio_text(ratio)}{figure}", colour))
    if balanced is not None:
        x = frame.x(balanced)
        level = value_at(ordered, balanced, "state_limit")
        if level is not None and level <= frame.y_max:
            out.append(f'<circle class="balanced" cx="{num(x)}" cy="{num(frame.y(level))}" '
                       f'r="6" fill="#fff" stroke="{BALANCED_COLOUR}" stroke-width="2.5"/>')
        out.append(f'<line class="balanced-tick" x1="{num(x)}" x2="{num(x)}" '
                   f'y1="{num(frame.baseline - 6)}" y2="{num(frame.baseline)}" '
                   f'stroke="{BALANCED_COLOUR}" stroke-width="2.5"/>')
        labels.append(_Label(x, f"balanced {ratio_text(balanced)}", BALANCED_COLOUR))
    for label in _place(labels, frame):
        y = frame.top - 10 - label.row * 16
        out.append(text_element(label.x, y, label.text, anchor="middle", size=12,
                                colour=label.colour, weight="600"))
    out.append("</g>")
    return out


def describe(points: Sequence[CurvePoint], *, current: float | None, balanced: float | None,
             recommended: float | None, target: int | None = None,
             current_concurrent: int | None = None,
             recommended_concurrent: int | None = None) -> str:
    """The chart in words (its `<desc>`)."""
    if not points:
        return "No ratio from 0.02 to 50 leaves room for both pools in this budget."
    first, last = points[0], points[-1]
    parts = [
        f"The state-slot limit rises from {first.state_limit} concurrent requests at ratio "
        f"{ratio_text(first.ratio)} to {last.state_limit} at {ratio_text(last.ratio)}; the KV "
        f"limit falls from {first.kv_limit} to {last.kv_limit}."]
    if balanced is not None:
        parts.append(f"They cross at the balanced ratio {ratio_text(balanced)}.")
    else:
        parts.append("They do not cross between 0.02 and 50.")
    if current is not None:
        figure = f" gives {current_concurrent} concurrent requests" \
            if current_concurrent is not None else " is marked"
        parts.append(f"The current ratio {ratio_text(current)}{figure}.")
    if recommended is not None:
        figure = f" gives {recommended_concurrent}" if recommended_concurrent is not None \
            else " is marked"
        parts.append(f"The recommended ratio {ratio_text(recommended)}{figure}.")
    if target:
        parts.append(f"The target is {target} concurrent requests.")
    return " ".join(parts)
