"""The dashboard's health part, computed from frozen values: the overall status, the GPU
table, the last hour's sparklines and the engine's figures. Pure.

`appliance.ui.pages` reads the monitor's latest `HealthSnapshot`, the mutes and the last hour
of the series `wanted_series` names (through `appliance.api.health.load_board`) and hands them
to `dashboard`. The pieces it shares with the Health page (check rows, the overall status,
formatting) and their invariants are in `appliance.health.views`. Besides:
- a GPU's `level` is the worst of its unmuted per-GPU checks (ids "gpu.<index>.<what>"),
  CRITICAL for a GPU that does not answer and has no check yet; a cell is marked with the
  level of the check named after it ("gpu.3.temperature" marks GPU 3's temperature cell).
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from appliance.gateway.usage import ClassCount
from appliance.gpu.port import GpuInfo
from appliance.health.history import MuteView
from appliance.health.model import (
    ENGINE_THROUGHPUT,
    ENGINE_TOKEN_USAGE,
    GPU_POWER,
    GPU_TEMPERATURE,
    GPU_UTILIZATION,
    CheckResult,
    EngineFigures,
    HealthSnapshot,
    Level,
)
from appliance.health.sparkline import Box, Point, Spark, render_sparkline
from appliance.health.views import (
    DASH,
    Overall,
    check_rows,
    gib,
    number,
    overall,
    seconds,
    share,
)
from appliance.sizes import GIB, percent_text, plural

_GPU_CHECK = re.compile(r"gpu\.(\d+)\.(.+)")
# A per-GPU check marks the table cell of its own name ("gpu.3.power"), or the one named here.
CELLS = {"memory_errors": "ecc"}

Series = Mapping[tuple[str, str], Sequence[Point]]  # (name, subject) -> points


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
THROUGHPUT = Spark("generation throughput", lambda v: f"{v:,.0f} tokens/s", min_span=10.0,
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


@dataclass(frozen=True)
class GpuSparks:
    index: int
    svgs: tuple[str, str, str]  # temperature, power, utilisation


def gpu_sparks(snapshot: HealthSnapshot, series: Series, now: dt.datetime) -> list[GpuSparks]:
    out = []
    for gpu in snapshot.gpus.gpus if snapshot.gpus else ():
        subject = str(gpu.index)
        svgs = tuple(render_sparkline(
            series.get((name, subject), ()), replace(spark, title=f"GPU {gpu.index} {spark.title}"),
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
        ("State pool in use", share(f.state_usage)),
    )
    sparks = tuple((spark.title[:1].upper() + spark.title[1:], render_sparkline(
        series.get((name, ""), ()), replace(spark, title=f"Engine {spark.title}"), end=now,
        id_prefix=f"spark-{name}", box=ENGINE_BOX)) for name, spark in ENGINE_SPARKS)
    return EnginePanel(f.state.replace("_", " "), figures.at if figures else None, rows, sparks)


# --- the dashboard --------------------------------------------------------------------------


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


GOODPUT_ALERT = 0.95  # below this share of requests served within their promise: a notice


@dataclass(frozen=True)
class GoodputLine:
    """One service class's last hour on the dashboard, in the operator's words; `low`: under
    GOODPUT_ALERT got their promise (the same line deploy/prometheus/slo-rules.yml alerts on)."""

    name: str
    words: str
    low: bool


def goodput_lines(counts: Sequence[ClassCount]) -> tuple[GoodputLine, ...]:
    """Per class: the share of its requests that met its promises, were refused at once
    (and why, by code) and missed it (first token late, stream too slow)."""
    lines = []
    for c in counts:
        whole = c.judged
        if not whole:
            continue
        missed = c.missed_ttft + c.missed_decode
        why = [plural(n, one, many) for n, one, many in (
            (c.missed_ttft, "first token late", "first tokens late"),
            (c.missed_decode, "stream too slow", "streams too slow")) if n]
        words = (f"{percent_text(c.met, whole)} got their promise ({c.met:,} of "
                 f"{plural(whole, 'request')}), {percent_text(c.refused, whole)} refused at "
                 f"once, {percent_text(missed, whole)} missed it"
                 + (f" ({', '.join(why)})" if why else ""))
        lines.append(GoodputLine(c.name, words, c.met / whole < GOODPUT_ALERT))
    return tuple(lines)
