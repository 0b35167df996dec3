"""The SVG pieces the console's pictures share (`appliance.svg`)."""

from __future__ import annotations

from appliance.svg import TEXT_COLOUR, num, text_element


def test_coordinates_have_one_decimal_at_most_and_none_when_whole() -> None:
    assert [num(v) for v in (3, 3.0, 2.04, 2.36, -0.5, 1e-9, 760)] == [
        "3", "3", "2", "2.4", "-0.5", "0", "760"]


def test_a_text_is_escaped_and_placed() -> None:
    assert text_element(10, 20.25, "<a & b>") == (
        f'<text x="10" y="20.2" text-anchor="start" font-size="12" fill="{TEXT_COLOUR}">'
        "&lt;a &amp; b&gt;</text>")
    assert text_element(1.5, 2, "x", anchor="end", size=11, colour="#fff", weight="600",
                        extra=' class="k"') == (
        '<text x="1.5" y="2" text-anchor="end" font-size="11" fill="#fff" font-weight="600"'
        ' class="k">x</text>')
