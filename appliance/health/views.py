"""What the dashboard and the Health page show, computed from frozen values. Pure.

The console's adapters (`appliance.ui.pages`, `appliance.ui.health`) read the monitor's
latest `HealthSnapshot`, the mutes, the recorded transitions and the last hour of samples
(`appliance.health.history`), and hand them here; templates only lay the results out.

Invariants:
- a check's `muted` says whether a mute is in force at `now`; a muted check keeps its level
  on every row but never counts in the overall status (as `HealthSnapshot.overall`);
- a GPU's `level` is the worst of its unmuted per-GPU checks (ids "gpu.<index>.<what>"),
  CRITICAL for a GPU that does not answer and has no check yet; a cell is marked with the
  level of the check named after it ("gpu.3.temperature" marks GPU 3's temperature cell);
- every figure is a ready-made text: a dash when unknown, never "None" or a zero invented.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from appliance.gpu.port import GpuInfo
from appliance.health.history import MuteView, TransitionView
from appliance.health.model import (
    ENGINE_THROUGHPUT,
    ENGINE_TOKEN_USAGE,
    GPU_POWER,
    GPU_TEMPERATURE,
    GPU_UTILIZATION,
    GROUPS,
    CheckResult,
    EngineFigures,
    HealthSnapshot,
    Level,
)
from appliance.health.sparkline import Box, Point, Spark, render_sparkline

GROUP_TITLES = {"gpu": "GPUs", "engine": "Engine", "host": "Host"}
DASH = "—"
GIB = 1 << 30
_GPU_CHECK = re.compile(r"gpu\.(\d+)\.(.+)")
# A per-GPU check marks the table cell of its own name ("gpu.3.power"), or the one named here.
CELLS = {"memory_errors": "ecc"}

Series = Mapping[tuple[str, str], Sequence[Point]]  # (name, subject) -> points


# --- formatting -----------------------------------------------------------------------------


def number(value: float | None, unit: str = "", digits: int = 0) -> str:
    """1234.5 -> "1,235 unit"; a dash when unknown."""
    if value is None:
        return DASH
    text = f"{value:,.{digits}f}"
    return f"{text} {unit}" if unit else text


def share(value: float | None) -> str:
    """A 0..1 fraction as a percentage: 0.423 -> "42.3 %"."""
    return DASH if value is None else f"{value * 100:.1f} %"


def seconds(value: float | None) -> str:
    """0.35 -> "350 ms", 2.5 -> "2.50 s"."""
    if value is None:
        return DASH
    return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.2f} s"


def gib(value: int | None) -> str:
    return DASH if value is None else f"{value / GIB:,.1f} GiB"


# --- checks ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class CheckRow:
    """One check as a row: its verdict, whether it is muted (and how), since when it has
    had this level (None: no change recorded) and its recent changes, newest first."""

    id: str
    group: str
    title: str
    level: Level
    summary: str
    hint: str
    mute: MuteView | None
    since: dt.datetime | None
    changes: tuple[TransitionView, ...] = ()

    @property
    def muted(self) -> bool:
        return self.mute is not None

    @property
    def counts(self) -> bool:
        """Whether it counts in the overall status (failing and not muted)."""
        return self.level is not Level.OK and not self.muted


@dataclass(frozen=True)
class Overall:
    level: Level
    checked_at: dt.datetime | None
    failing: tuple[CheckRow, ...]  # counted (unmuted) failures, worst first
    muted: int  # checks muted now
    total: int


def active_mutes(mutes: Iterable[MuteView], now: dt.datetime) -> dict[str, MuteView]:
    return {m.check_id: m for m in mutes if m.active(now)}


def check_rows(snapshot: HealthSnapshot, mutes: Mapping[str, MuteView],
               changes: Sequence[TransitionView] = ()) -> list[CheckRow]:
    """Every check of the snapshot, in its order. `changes` are newest first (as
    `history.transitions` returns them); a check's `since` is its newest change."""
    by_check: dict[str, list[TransitionView]] = {}
    for change in changes:
        by_check.setdefault(change.check_id, []).append(change)
    rows = []
    for r in snapshot.results:
        own = by_check.get(r.id, [])
        since = own[0].at if own and own[0].level is r.level else None
        rows.append(CheckRow(r.id, r.group, r.title, r.level, r.summary, r.hint,
                             mutes.get(r.id), since, tuple(own)))
    return rows


def overall(snapshot: HealthSnapshot, rows: Sequence[CheckRow]) -> Overall:
    failing = sorted((row for row in rows if row.counts), key=lambda row: -row.level)
    level = max((row.level for row in failing), default=Level.OK)
    return Overall(level, snapshot.at, tuple(failing), sum(row.muted for row in rows),
                   len(rows))


@dataclass(frozen=True)
class Group:
    name: str
    title: str
    rows: tuple[CheckRow, ...]

    @property
    def level(self) -> Level:
        return max((row.level for row in self.rows if not row.muted), default=Level.OK)

    @property
    def attention(self) -> tuple[CheckRow, ...]:
        """Failing or muted rows, worst first (shown open); the others pass (folded)."""
        return tuple(sorted((r for r in self.rows if r.level is not Level.OK or r.muted),
                            key=lambda r: -r.level))

    @property
    def passing(self) -> tuple[CheckRow, ...]:
        return tuple(r for r in self.rows if r.level is Level.OK and not r.muted)


def groups(rows: Sequence[CheckRow]) -> list[Group]:
    return [Group(g, GROUP_TITLES[g], tuple(r for r in rows if r.group == g)) for g in GROUPS]


# --- GPUs -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class GpuRow:
    """One GPU of the dashboard's table. A lost GPU has `error` and `hint` and dashes."""

    index: int
    name: str
    error: str
    hint: str
    temperature: str
    power: str
    utilization: str
    memory: str
    ecc: str
    nvlink: str
    processes: str
    level: Level
    marks: Mapping[str, Level]  # cell ("temperature", "power", ...) -> its check's level
    failing: tuple[str, ...]  # summaries of its unmuted failing checks

    def mark(self, cell: str) -> str:
        """The CSS class of a cell: "" when fine, else "level-warn"/"level-critical"."""
        level = self.marks.get(cell, Level.OK)
        return "" if level is Level.OK else f"level-{level.label}"


def _ecc_text(gpu: GpuInfo) -> str:
    if gpu.ecc_enabled is False:
        return "off"
    parts = []
    if gpu.ecc_uncorrected_volatile is not None:
        parts.append(f"{gpu.ecc_uncorrected_volatile:,} uncorrected")
    if gpu.remapped_rows_uncorrectable:
        parts.append(f"{gpu.remapped_rows_uncorrectable:,} rows remapped")
    if gpu.remap_pending:
        parts.append("remap pending")
    if gpu.remap_failed:
        parts.append("remap failed")
    return ", ".join(parts) or DASH


def _nvlink_text(gpu: GpuInfo) -> str:
    if gpu.nvlink_total is None:
        return DASH
    up = DASH if gpu.nvlink_up is None else str(gpu.nvlink_up)
    return f"{up}/{gpu.nvlink_total} up"


def _power_text(gpu: GpuInfo) -> str:
    if gpu.power_w is None:
        return DASH
    limit = f" / {gpu.power_limit_w:,.0f}" if gpu.power_limit_w is not None else ""
    return f"{gpu.power_w:,.0f}{limit} W"


def _processes_text(gpu: GpuInfo) -> str:
    if not gpu.processes:
        return "none"
    return ", ".join(f"{p.name or 'pid'} {p.pid}" for p in gpu.processes)


def gpu_rows(snapshot: HealthSnapshot, mutes: Mapping[str, MuteView]) -> list[GpuRow]:
    """A row per GPU NVML reported, with its checks' levels (empty when NVML failed)."""
    per_gpu: dict[int, list[tuple[str, CheckResult]]] = {}
    for r in snapshot.results:
        if r.group == "gpu" and (match := _GPU_CHECK.fullmatch(r.id)):
            per_gpu.setdefault(int(match.group(1)), []).append((match.group(2), r))
    rows = []
    for gpu in snapshot.gpus.gpus if snapshot.gpus else ():
        own = per_gpu.get(gpu.index, [])
        checks = [(cell, r) for cell, r in own if r.id not in mutes]
        marks = {CELLS.get(cell, cell): r.level for cell, r in checks}
        level = max((r.level for _, r in checks), default=Level.OK)
        failing = tuple(r.summary for _, r in checks if r.failing)
        if gpu.error is not None:
            # A GPU that does not answer is critical unless its checks say (or were muted).
            rows.append(GpuRow(gpu.index, gpu.name or DASH, gpu.error, gpu.hint, DASH, DASH,
                               DASH, DASH, DASH, DASH, DASH,
                               level if own else Level.CRITICAL, marks, failing))
            continue
        rows.append(GpuRow(
            gpu.index, gpu.name, "", "", number(gpu.temperature_c, "°C"), _power_text(gpu),
            number(gpu.utilization_pct, "%"),
            f"{gpu.memory_used_bytes / GIB:,.1f} / {gib(gpu.memory_total_bytes)}", _ecc_text(gpu),
            _nvlink_text(gpu), _processes_text(gpu), level, marks, failing))
    return rows


# --- sparklines -----------------------------------------------------------------------------

TEMPERATURE = Spark("temperature", lambda v: f"{v:.0f} °C", min_span=10.0, lower=0.0)
POWER = Spark("power", lambda v: f"{v:,.0f} W", min_span=50.0, lower=0.0)
UTILIZATION = Spark("utilisation", lambda v: f"{v:.0f} %", min_span=10.0, lower=0.0,
                    upper=100.0)
TOKEN_USAGE = Spark("KV cache in use", lambda v: f"{v * 100:.0f} %", min_span=0.1, lower=0.0,
                    upper=1.0)
THROUGHPUT = Spark("generation throughput", lambda v: f"{v:,.0f} tok/s", min_span=10.0,
                   lower=0.0)
GPU_SPARKS = ((GPU_TEMPERATURE, TEMPERATURE), (GPU_POWER, POWER),
              (GPU_UTILIZATION, UTILIZATION))
ENGINE_SPARKS = ((ENGINE_TOKEN_USAGE, TOKEN_USAGE), (ENGINE_THROUGHPUT, THROUGHPUT))
GPU_BOX = Box(width=210, height=28, label=66)
ENGINE_BOX = Box(width=250, height=30, label=86)


def wanted_series(snapshot: HealthSnapshot) -> list[tuple[str, str]]:
    """The (name, subject) series the dashboard draws for this snapshot."""
    gpus = [str(g.index) for g in snapshot.gpus.gpus] if snapshot.gpus else []
    return ([(name, index) for index in gpus for name, _ in GPU_SPARKS]
            + [(name, "") for name, _ in ENGINE_SPARKS])


def _titled(spark: Spark, title: str) -> Spark:
    return Spark(title, spark.fmt, spark.min_span, spark.lower, spark.upper)


@dataclass(frozen=True)
class GpuSparks:
    index: int
    svgs: tuple[str, str, str]  # temperature, power, utilisation


def gpu_sparks(snapshot: HealthSnapshot, series: Series, now: dt.datetime) -> list[GpuSparks]:
    out = []
    for gpu in snapshot.gpus.gpus if snapshot.gpus else ():
        subject = str(gpu.index)
        svgs = tuple(render_sparkline(
            series.get((name, subject), ()), _titled(spark, f"GPU {gpu.index} {spark.title}"),
            end=now, id_prefix=f"spark-gpu{gpu.index}-{name}", box=GPU_BOX)
            for name, spark in GPU_SPARKS)
        out.append(GpuSparks(gpu.index, (svgs[0], svgs[1], svgs[2])))
    return out


# --- engine ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class EnginePanel:
    state: str
    at: dt.datetime | None
    figures: tuple[tuple[str, str], ...]  # (label, value)
    sparks: tuple[tuple[str, str], ...]  # (label, svg)


def engine_panel(figures: EngineFigures | None, series: Series,
                 now: dt.datetime) -> EnginePanel:
    f = figures or EngineFigures(at=now, state="unknown")  # nothing read yet: dashes
    running = DASH if f.running_requests is None else str(f.running_requests)
    queued = DASH if f.queued_requests is None else str(f.queued_requests)
    rows = (
        ("Throughput", number(f.generation_tokens_per_second, "tokens/s")),
        ("Time to first token", f"p50 {seconds(f.ttft_p50_seconds)} · "
                                f"p90 {seconds(f.ttft_p90_seconds)}"),
        ("Prefix cache hit rate", share(f.cache_hit_rate)),
        ("Requests", f"{running} running, {queued} queued"),
        ("KV cache in use", share(f.token_usage)),
    )
    sparks = tuple((spark.title[:1].upper() + spark.title[1:], render_sparkline(
        series.get((name, ""), ()), _titled(spark, f"Engine {spark.title}"), end=now,
        id_prefix=f"spark-{name}", box=ENGINE_BOX)) for name, spark in ENGINE_SPARKS)
    return EnginePanel(f.state.replace("_", " "), figures.at if figures else None, rows, sparks)


# --- pages ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Dashboard:
    """The dashboard's health part. `nvml_error`/`nvml_hint`: NVML could not be used at all
    (no GPU rows then)."""

    overall: Overall
    gpus: tuple[GpuRow, ...]
    sparks: tuple[GpuSparks, ...]
    engine: EnginePanel
    nvml_error: str
    nvml_hint: str


def dashboard(snapshot: HealthSnapshot, mutes: Mapping[str, MuteView], series: Series,
              now: dt.datetime) -> Dashboard:
    rows = check_rows(snapshot, mutes)
    gpus = snapshot.gpus
    return Dashboard(overall(snapshot, rows), tuple(gpu_rows(snapshot, mutes)),
                     tuple(gpu_sparks(snapshot, series, now)),
                     engine_panel(snapshot.engine, series, now),
                     (gpus.error or "") if gpus else "", gpus.hint if gpus else "")


@dataclass(frozen=True)
class HealthPage:
    overall: Overall
    groups: tuple[Group, ...]
    recent: tuple[TransitionView, ...]  # newest first, any check
    titles: Mapping[str, str]  # check id -> title, for the recent changes


def health_page(snapshot: HealthSnapshot, mutes: Mapping[str, MuteView],
                changes: Sequence[TransitionView], recent: int = 50) -> HealthPage:
    rows = check_rows(snapshot, mutes, changes)
    titles = {t.check_id: t.title for t in changes} | {r.id: r.title for r in rows}
    return HealthPage(overall(snapshot, rows), tuple(groups(rows)), tuple(changes[:recent]),
                      titles)
