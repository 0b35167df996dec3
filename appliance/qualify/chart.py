"""A qualification's chart as a self-contained SVG string (pure, deterministic, escaped).

Over the measured steps (x: concurrent users, one column per step, evenly spaced), it draws
the per-user decode speed the floor is judged on (the slowest repeat's p10, left axis) with
the floor as a dashed line, the box's output throughput (mean of the repeats, right axis) as
a second, dotted line, failing steps as hollow points, and the qualified point as a vertical
line. `<title>` and `<desc>` say the same for screen readers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from html import escape

from appliance.qualify.ledger import Record
from appliance.svg import num, text_element

WIDTH, HEIGHT = 760, 360
LEFT, RIGHT, TOP, BOTTOM = 64, 72, 70, 50
SPEED_COLOUR = "#0b5cad"
THROUGHPUT_COLOUR = "#b45309"
FLOOR_COLOUR = "#cf222e"
POINT_COLOUR = "#1a7f37"
GRID_COLOUR = "#e4e7eb"
AXIS_COLOUR = "#8a949e"


def nice_max(value: float) -> float:
    """A round axis top at or above `value` (1, 2 or 5 times a power of ten)."""
    if value <= 0:
        return 1.0
    power = 10 ** math.floor(math.log10(value))
    for step in (1, 2, 5, 10):
        if value <= step * power:
            return float(step * power)
    return float(10 * power)


def _ticks(top: float) -> list[float]:
    return [top * k / 4 for k in range(5)]


def _label(value: float) -> str:
    return f"{value:,.0f}" if value >= 10 or value == 0 else f"{value:g}"


def render_chart(record: Record) -> str:
    steps = record.steps
    floor = record.settings.floor
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    base = TOP + plot_h
    speeds = [s.decode_p10 for s in steps]
    tputs = [s.mean("output_tps") for s in steps]
    speed_top = nice_max(max([floor * 1.25, *(v for v in speeds if v is not None)]))
    tput_top = nice_max(max([1.0, *(v for v in tputs if v is not None)]))
    count = max(1, len(steps))

    def x(index: int) -> float:
        return LEFT + plot_w * (index + 0.5) / count

    def y_speed(value: float) -> float:
        return base - min(value, speed_top) / speed_top * plot_h

    def y_tput(value: float) -> float:
        return base - min(value, tput_top) / tput_top * plot_h

    title = f"Qualification {record.id}: per-user speed and throughput against concurrency"
    desc = describe(record)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {HEIGHT}" '
           f'width="{WIDTH}" height="{HEIGHT}" role="img" font-family="sans-serif">',
           f"<title>{escape(title)}</title>", f"<desc>{escape(desc)}</desc>",
           f'<rect x="0" y="0" width="{WIDTH}" height="{HEIGHT}" fill="#ffffff"/>',
           text_element(LEFT, 22, title, size=14, weight="600")]
    for value in _ticks(speed_top):
        yy = y_speed(value)
        out.append(f'<line x1="{LEFT}" y1="{num(yy)}" x2="{LEFT + plot_w}" y2="{num(yy)}" '
                   f'stroke="{GRID_COLOUR}"/>')
        out.append(text_element(LEFT - 6, yy + 4, _label(value), anchor="end", size=11))
    for value in _ticks(tput_top):
        out.append(text_element(LEFT + plot_w + 6, y_tput(value) + 4, _label(value), size=11,
                                colour=THROUGHPUT_COLOUR))
    out.append(f'<line x1="{LEFT}" y1="{base}" x2="{LEFT + plot_w}" y2="{base}" '
               f'stroke="{AXIS_COLOUR}"/>')
    out.append(text_element(16, TOP + plot_h / 2, "tokens/s per user (p10)", anchor="middle",
                            size=11, extra=f' transform="rotate(-90 16 {num(TOP + plot_h / 2)})"'))
    right_x = WIDTH - 12
    out.append(text_element(right_x, TOP + plot_h / 2, "output tokens/s, whole box",
                            anchor="middle", size=11, colour=THROUGHPUT_COLOUR,
                            extra=f' transform="rotate(90 {right_x} {num(TOP + plot_h / 2)})"'))
    for index, step in enumerate(steps):
        out.append(text_element(x(index), base + 16, str(step.concurrency), anchor="middle",
                                size=11))
    out.append(text_element(LEFT + plot_w / 2, HEIGHT - 12, "concurrent users",
                            anchor="middle", size=11))
    fy = y_speed(floor)
    out.append(f'<line x1="{LEFT}" y1="{num(fy)}" x2="{LEFT + plot_w}" y2="{num(fy)}" '
               f'stroke="{FLOOR_COLOUR}" stroke-dasharray="6 4"/>')
    out.append(text_element(LEFT + 4, fy - 5, f"floor {floor:g} tokens/s", size=11,
                            colour=FLOOR_COLOUR))
    if record.qualified is not None:
        at = next((i for i, s in enumerate(steps) if s.concurrency == record.qualified), None)
        if at is not None:
            qx = x(at)
            out.append(f'<line x1="{num(qx)}" y1="{TOP}" x2="{num(qx)}" y2="{base}" '
                       f'stroke="{POINT_COLOUR}" stroke-width="2"/>')
            out.append(text_element(qx, TOP - 6, f"qualified: {record.qualified}",
                                    anchor="middle", size=11, colour=POINT_COLOUR,
                                    weight="600"))
    out += _series([(x(i), y_tput(v)) if v is not None else None for i, v in enumerate(tputs)],
                   THROUGHPUT_COLOUR, dash="2 3", passed=[s.passed for s in steps])
    out += _series([(x(i), y_speed(v)) if v is not None else None for i, v in enumerate(speeds)],
                   SPEED_COLOUR, dash="", passed=[s.passed for s in steps])
    out.append(text_element(LEFT + plot_w, 44, "— per-user speed (p10)", anchor="end", size=11,
                            colour=SPEED_COLOUR))
    out.append(text_element(LEFT + plot_w, 58, "··· throughput", anchor="end", size=11,
                            colour=THROUGHPUT_COLOUR))
    if not steps:
        out.append(text_element(LEFT + plot_w / 2, TOP + plot_h / 2, "no step measured",
                                anchor="middle", size=13))
    out.append("</svg>")
    return "\n".join(out)


def _series(points: Sequence[tuple[float, float] | None], colour: str, *, dash: str,
            passed: Sequence[bool]) -> list[str]:
    drawn = [p for p in points if p is not None]
    out = []
    if len(drawn) > 1:
        path = " ".join(f"{num(px)},{num(py)}" for px, py in drawn)
        extra = f' stroke-dasharray="{dash}"' if dash else ""
        out.append(f'<polyline points="{path}" fill="none" stroke="{colour}" '
                   f'stroke-width="2"{extra}/>')
    for point, ok in zip(points, passed, strict=False):
        if point is not None:
            fill = colour if ok else "#ffffff"
            out.append(f'<circle cx="{num(point[0])}" cy="{num(point[1])}" r="4" fill="{fill}" '
                       f'stroke="{colour}" stroke-width="2"/>')
    return out


def describe(record: Record) -> str:
    """The chart in words: every step's per-user speed and throughput, and the verdict."""
    parts = []
    for step in record.steps:
        speed = step.decode_p10
        tput = step.mean("output_tps")
        users = "user" if step.concurrency == 1 else "users"
        parts.append(f"{step.concurrency} {users}: "
                     + (f"{speed:.1f} tokens/s per user" if speed is not None else "unmeasured")
                     + (f", {tput:,.0f} tokens/s in all" if tput is not None else "")
                     + ("" if step.passed else " (failed)"))
    words = record.verdict or record.state
    return "; ".join(parts) + (". " if parts else "") + words[:1].upper() + words[1:] + "."
