"""The Tuning page's chart (`appliance.tuning.chart`), pure: golden fragments of a small
hand-made curve (every coordinate derived below), the structure a browser and a screen reader
rely on, escaping, determinism, label placement, and the real K3 curve of the sample startup.

The scales, for the default 760 x 380 frame (left 60, right 20, top 88, bottom 52):
x(r) = 60 + 680 * ln(r / 0.02) / ln(2500); y(v) = 328 - 240 * v / y_max.
"""

from __future__ import annotations

import math
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from appliance.tuning.budget import budget_from_log
from appliance.tuning.calculator import Launch
from appliance.tuning.chart import (
    X_TICKS,
    Frame,
    describe,
    nice_ceiling,
    render_chart,
    value_at,
)
from appliance.tuning.geometry import load_geometry
from appliance.tuning.profiles import builtin_profile
from appliance.tuning.recommend import CurvePoint, curve, ratio_grid, recommend

SVG = "{http://www.w3.org/2000/svg}"
DATA = Path(__file__).parent / "data"

# Three ratios: 0.02 (the left edge), 1 and 50 (the right edge). The state limit rises
# 10 -> 100 -> 200, the KV limit falls 400 -> 100 -> 20, so they cross exactly at ratio 1.
SMALL = [CurvePoint(0.02, 10, 400, 10), CurvePoint(1.0, 100, 100, 100),
         CurvePoint(50.0, 200, 20, 20)]


def render_small(**overrides: object) -> str:
    args: dict[str, object] = {"current": 0.9, "recommended": 1.0, "balanced": 1.0,
                               "target": 64, "current_concurrent": 90,
                               "recommended_concurrent": 100}
    args.update(overrides)
    return render_chart(SMALL, **args)  # type: ignore[arg-type]


def parse(svg: str) -> ET.Element:
    return ET.fromstring(svg)  # noqa: S314 - our own output, parsed to check it


def by_class(root: ET.Element, tag: str, cls: str) -> list[ET.Element]:
    return [e for e in root.iter(f"{SVG}{tag}") if e.get("class") == cls]


def texts(root: ET.Element) -> list[str]:
    return [e.text or "" for e in root.iter(f"{SVG}text")]


# --- golden ---------------------------------------------------------------------------------


def test_golden_coordinates_of_a_hand_made_curve() -> None:
    """y_max: the peak 100 x 1.3 = 130; nice_ceiling takes the smallest 1/2/2.5/5 x 10^k step
    that reaches it in at most 6 intervals (10 needs 13, 20 needs 7, 25 needs 6): top 150.
    x(1) = 60 + 680 * ln 50 / ln 2500 = 60 + 680 / 2 = 400 exactly.
    y(10) = 328 - 240 * 10/150 = 312; y(100) = 168; y(200) = 8; y(400) = -312; y(20) = 296."""
    svg = render_small()
    assert 'data-y-max="150"' in svg
    assert ('<polyline class="state-limit" points="60,312 400,168 740,8" fill="none" '
            'stroke="#6639ba" stroke-width="2.5" stroke-linejoin="round"/>') in svg
    assert ('<polyline class="kv-limit" points="60,-312 400,168 740,296" fill="none" '
            'stroke="#b45309" stroke-width="2.5" stroke-linejoin="round" '
            'stroke-dasharray="7 4"/>') in svg
    # What the workload gets: the lower curve, closed down to the baseline (y = 328).
    assert 'points="60,328 60,312 400,168 740,296 740,328"' in svg
    # The crossing at ratio 1, on both curves (y(100) = 168).
    assert ('<circle class="balanced" cx="400" cy="168" r="6" fill="#fff" stroke="#1a7f37" '
            'stroke-width="2.5"/>') in svg
    # The target, 64 requests: y = 328 - 240 * 64/150 = 225.6.
    assert 'y1="225.6" y2="225.6"' in svg
    # Current 0.9: x = 60 + 680 * ln 45 / ln 2500 = 390.8; its dot at y(90) = 184.
    assert '<line class="current" x1="390.8" x2="390.8" y1="88" y2="328"' in svg
    assert '<circle class="current-point" cx="390.8" cy="184" r="4"' in svg
    assert '<line class="recommended" x1="400" x2="400" y1="88" y2="328"' in svg


def test_same_inputs_same_bytes_in_any_order() -> None:
    assert render_small() == render_small()
    assert render_chart(list(reversed(SMALL)), current=0.9, recommended=1.0, balanced=1.0,
                        target=64, current_concurrent=90,
                        recommended_concurrent=100) == render_small()


# --- structure ------------------------------------------------------------------------------


def test_accessible_self_contained_svg() -> None:
    svg = render_small(title="Balanced profile")
    root = parse(svg)  # well-formed XML
    assert root.tag == f"{SVG}svg"
    assert root.get("viewBox") == "0 0 760 380" and root.get("role") == "img"
    title, desc = root.find(f"{SVG}title"), root.find(f"{SVG}desc")
    assert title is not None and desc is not None
    assert root.get("aria-labelledby") == f"{title.get('id')} {desc.get('id')}"
    assert title.text == "Balanced profile"
    assert desc.text is not None and "cross at the balanced ratio 1." in desc.text
    assert "The current ratio 0.9 gives 90 concurrent requests." in desc.text
    # Nothing runs, nothing loads: no script, no event handler, no link, no style sheet.
    assert "<script" not in svg and "<style" not in svg and "href" not in svg
    assert not re.search(r"\son[a-z]+=", svg)
    assert svg.startswith("<svg ") and svg.endswith("</svg>")


def test_axes_ticks_labels_and_legend() -> None:
    root = parse(render_small())
    labels = texts(root)
    for tick in X_TICKS:
        assert f"{tick:g}" in labels
    y_ticks = [e.text for e in root.iter(f"{SVG}text") if e.get("x") == "52"]
    assert y_ticks == ["0", "25", "50", "75", "100", "125", "150"]
    assert "--mamba-full-memory-ratio (state : KV, log scale)" in labels
    assert "concurrent requests" in labels
    for entry in ("State-slot limit", "KV limit", "Requests served", "Target"):
        assert entry in labels
    assert "target 64" in labels
    assert "current 0.9 · 90" in labels and "recommended 1 · 100" in labels
    assert "balanced 1" in labels


def test_curves_are_clipped_to_the_plot() -> None:
    """The KV limit runs far above the axis at low ratios: its group is clipped."""
    root = parse(render_small())
    groups = [g for g in root.iter(f"{SVG}g") if g.get("class") == "curves"]
    assert len(groups) == 1 and groups[0].get("clip-path") == "url(#tuning-chart-clip)"
    clip = root.find(f"{SVG}clipPath")
    assert clip is not None and clip.get("id") == "tuning-chart-clip"


def test_text_is_escaped() -> None:
    hostile = 'Bots <script>alert("x")</script> & "friends"'
    svg = render_small(title=hostile, id_prefix='c" onload="x')
    assert "<script>" not in svg and 'onload="x"' not in svg
    root = parse(svg)
    title = root.find(f"{SVG}title")
    assert title is not None and title.text == hostile


def test_coinciding_markers_get_their_own_rows() -> None:
    """Current, recommended and balanced all at ratio 1: three labels, three rows, no
    overlap; far-apart markers share the first row."""
    root = parse(render_small(current=1.0))
    marker_labels = [e for e in root.iter(f"{SVG}text")
                     if (e.text or "").startswith(("current", "recommended", "balanced"))]
    assert len({e.get("y") for e in marker_labels}) == 3
    root = parse(render_small(current=0.03, recommended=30.0, balanced=1.0))
    marker_labels = [e for e in root.iter(f"{SVG}text")
                     if (e.text or "").startswith(("current", "recommended", "balanced"))]
    assert len({e.get("y") for e in marker_labels}) == 1


def test_markers_are_optional_and_out_of_range_ratios_sit_on_the_edge() -> None:
    root = parse(render_small(current=None, recommended=None, balanced=None, target=None))
    for cls in ("current", "recommended", "balanced", "target"):
        assert by_class(root, "line", cls) == [] and by_class(root, "circle", cls) == []
    root = parse(render_small(current=0.001, recommended=80.0))
    assert by_class(root, "line", "current")[0].get("x1") == "60"
    assert by_class(root, "line", "recommended")[0].get("x1") == "740"


def test_an_empty_curve_says_so() -> None:
    svg = render_chart([], current=0.9, recommended=None, balanced=None)
    root = parse(svg)
    assert "No ratio from 0.02 to 50 leaves room for both pools in this budget" in texts(root)
    assert list(root.iter(f"{SVG}polyline")) == []
    assert describe([], current=0.9, balanced=None, recommended=None).startswith("No ratio")


def test_a_target_above_every_curve_sets_the_scale() -> None:
    root = parse(render_small(target=400))
    assert float(root.get("data-y-max") or 0) >= 400 * 1.3
    assert "target 400" in texts(root)


# --- helpers --------------------------------------------------------------------------------


@pytest.mark.parametrize(("value", "top", "step"), [
    (130, 150, 25), (1, 1, 1), (6, 6, 1), (7, 8, 2), (260.0, 300, 50), (1234, 1250, 250),
    (0, 1, 1), (59, 60, 10),
])
def test_nice_ceiling(value: float, top: float, step: float) -> None:
    assert nice_ceiling(value) == (top, step)


def test_scales_and_interpolation() -> None:
    frame = Frame(y_max=150)
    assert frame.x(0.02) == 60 and frame.x(50) == 740 and math.isclose(frame.x(1), 400)
    assert frame.x(0.001) == 60 and frame.x(500) == 740
    assert frame.y(0) == 328 and frame.y(150) == 88
    assert value_at(SMALL, 1.0, "state_limit") == 100
    # Halfway between 1 and 50 in log(ratio): sqrt(50), halfway between 100 and 200.
    halfway = value_at(SMALL, math.sqrt(50), "state_limit")
    assert halfway is not None and math.isclose(halfway, 150)
    assert value_at(SMALL, 0.01, "state_limit") is None


# --- the real curve -------------------------------------------------------------------------


def test_k3_balanced_profile_on_the_sample_startup_budget() -> None:
    """K3's geometry, the budget the sample startup log measured and the Balanced profile:
    the ringed crossing sits where the curves meet, at the recommendation's balanced ratio."""
    geometry = load_geometry(DATA / "tuning" / "kimi-k3.config.json")
    budget = budget_from_log((DATA / "engine_logs" / "k3_startup.sample.log").read_text())
    assert budget is not None
    profile = builtin_profile("balanced")
    assert profile is not None
    launch = Launch()
    rec = recommend(geometry, launch, budget.bytes, profile.lengths,
                    target_concurrency=profile.target_concurrency, current_ratio=0.9)
    points = curve(geometry, launch, budget.bytes, profile.lengths, ratio_grid(per_decade=16))
    svg = render_chart(points, current=0.9, recommended=rec.ratio,
                       balanced=rec.balanced_ratio, target=profile.target_concurrency,
                       current_concurrent=rec.current.concurrent,
                       recommended_concurrent=rec.recommended.concurrent)
    root = parse(svg)
    assert rec.balanced_ratio is not None
    frame = Frame(y_max=float(root.get("data-y-max") or 0))
    ring = by_class(root, "circle", "balanced")[0]
    assert math.isclose(float(ring.get("cx") or 0), frame.x(rec.balanced_ratio), abs_tol=0.06)
    state = value_at(points, rec.balanced_ratio, "state_limit")
    kv = value_at(points, rec.balanced_ratio, "kv_limit")
    assert state is not None and kv is not None
    # The two interpolated curves meet there (to within the grid's resolution).
    assert abs(state - kv) <= 0.06 * max(state, kv)
    assert f"balanced {rec.balanced_ratio:g}" in texts(root)
    polyline = by_class(root, "polyline", "state-limit")[0]
    assert len((polyline.get("points") or "").split()) == len(points)
    # The best the workload can get is inside the plot, with room above it.
    assert max(p.concurrent for p in points) * 1.3 <= frame.y_max
