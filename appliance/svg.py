"""What the console's server-rendered SVG pictures share (the tuning and usage charts, the
health sparklines): how a coordinate is written and how a text is drawn.

Pure; each picture keeps its own layout and palette. Coordinates are written with one decimal
at most (finer is invisible and only makes the markup longer), so the same inputs give the
same bytes.
"""

from __future__ import annotations

from html import escape

TEXT_COLOUR = "#3b4550"


def num(value: float) -> str:
    """A coordinate or length for an SVG attribute: one decimal, none when it is whole."""
    text = f"{value:.1f}"
    return text[:-2] if text.endswith(".0") else text


def text_element(x: float, y: float, content: str, *, anchor: str = "start", size: int = 12,
                 colour: str = TEXT_COLOUR, weight: str = "", extra: str = "") -> str:
    """A `<text>` at (x, y), its content escaped; `extra` is more attributes, already
    written (with a leading space)."""
    bold = f' font-weight="{weight}"' if weight else ""
    return (f'<text x="{num(x)}" y="{num(y)}" text-anchor="{anchor}" font-size="{size}" '
            f'fill="{colour}"{bold}{extra}>{escape(content)}</text>')
