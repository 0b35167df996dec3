"""The health monitor's shared values: levels, check results, readings and snapshots.

Pure and frozen. Every check module returns `CheckResult`s; the monitor gathers them into a
`HealthSnapshot`; pages, the API, `/metrics` and `appliance doctor` read snapshots only.

Invariants:
- a `CheckResult.id` is stable across polls and unique within a snapshot ("gpu.3.temperature",
  "engine.ready", "host.models_disk"): transitions, mutes and history are keyed by it;
- `level` is OK, WARN or CRITICAL; a check that could not run says so in its summary with the
  level its absence deserves (NVML missing is CRITICAL, an engine check skipped while the
  engine loads is OK with "not checked while loading");
- a muted check still appears with its level; it only stops alerts and does not count in
  `overall`.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from appliance.gpu.port import GpuSnapshot


class Level(enum.IntEnum):
    """Ordered so that `max()` is the worst."""

    OK = 0
    WARN = 1
    CRITICAL = 2

    @property
    def label(self) -> str:
        return self.name.lower()

    @classmethod
    def parse(cls, text: str) -> Level:
        return cls[text.upper()]


GROUPS = ("gpu", "engine", "host", "weights")


@dataclass(frozen=True)
class CheckResult:
    """One check's verdict. `summary` is a sentence a person understands ("GPU 3 is at 91 °C,
    above the 85 °C warning line"); `hint` names the next step when the level is not OK."""

    id: str
    group: str  # one of GROUPS
    title: str  # short, for tables: "GPU 3 temperature"
    level: Level
    summary: str
    hint: str = ""
    # False: the check did not run this time (an engine check while the engine is not
    # serving). Shown, but it neither starts a failure nor ends one.
    judged: bool = True

    @property
    def failing(self) -> bool:
        return self.level is not Level.OK


# --- readings --------------------------------------------------------------------------------


@dataclass(frozen=True)
class CanaryResult:
    """A small generation timed end to end: time to first token and decode rate."""

    at: dt.datetime
    ok: bool
    ttft_seconds: float | None = None
    decode_tokens_per_second: float | None = None
    error: str = ""


@dataclass(frozen=True)
class EngineFigures:
    """What the engine's `/metrics` (SGLang 0.5.23 names) and probes said at `at`. Rates and
    percentiles are over the window since the previous scrape; None when unknown."""

    at: dt.datetime
    state: str  # the supervisor's EngineState value at the time
    ready: bool | None = None  # /ready answered 200; None: not probed
    running_requests: int | None = None
    queued_requests: int | None = None
    token_usage: float | None = None  # 0..1, KV pool in use
    state_usage: float | None = None  # 0..1, K3's recurrent-state (mamba) pool in use
    cache_hit_rate: float | None = None  # 0..1
    generation_tokens_per_second: float | None = None
    ttft_p50_seconds: float | None = None
    ttft_p90_seconds: float | None = None
    canary: CanaryResult | None = None


@dataclass(frozen=True)
class HostFigures:
    """Host readings; bytes throughout, None when a path could not be read."""

    at: dt.datetime
    models_free_bytes: int | None
    models_total_bytes: int | None
    state_free_bytes: int | None
    state_total_bytes: int | None
    shm_free_bytes: int | None
    shm_total_bytes: int | None
    memory_available_bytes: int
    memory_total_bytes: int
    load1: float
    cpu_count: int
    daemon_rss_bytes: int
    load5: float | None = None  # the check judges this one: a one-minute spike is no finding


# --- snapshots -------------------------------------------------------------------------------


@dataclass(frozen=True)
class HealthSnapshot:
    """Everything the monitor knows at `at` (None: nothing has run yet)."""

    at: dt.datetime | None
    results: tuple[CheckResult, ...] = ()
    gpus: GpuSnapshot | None = None
    engine: EngineFigures | None = None
    host: HostFigures | None = None
    muted: frozenset[str] = field(default_factory=frozenset)

    def overall(self) -> Level:
        """The worst level over checks that are not muted; OK when nothing has run."""
        return max((r.level for r in self.results if r.id not in self.muted), default=Level.OK)

    def by_group(self) -> Mapping[str, tuple[CheckResult, ...]]:
        return {g: tuple(r for r in self.results if r.group == g) for g in GROUPS}

    def result(self, check_id: str) -> CheckResult | None:
        return next((r for r in self.results if r.id == check_id), None)


def merge(previous: HealthSnapshot, at: dt.datetime, group: str,
          results: Iterable[CheckResult], **readings: Any) -> HealthSnapshot:
    """`previous` with one group's results replaced (groups are polled on their own
    schedules) and the given readings (`gpus=`, `engine=`, `host=`) updated."""
    kept = tuple(r for r in previous.results if r.group != group)
    fresh = tuple(results)
    if any(r.group != group for r in fresh):
        raise ValueError(f"a {group} check returned another group's result")
    return dataclasses.replace(previous, at=at, results=kept + fresh, **readings)


# --- time series -------------------------------------------------------------------------------

# Sample names kept as history (fine for a day, hourly for a month) and drawn as sparklines.
# Per-GPU series use the GPU index as the subject; engine and host series use "".
GPU_TEMPERATURE = "gpu.temperature_c"
GPU_POWER = "gpu.power_w"
GPU_UTILIZATION = "gpu.utilization_pct"
GPU_MEMORY_USED = "gpu.memory_used_bytes"
# The driver's uncorrectable ECC count: kept so that `appliance doctor`, a one-off process,
# can judge new errors against the monitor's last reading instead of seeing no "before".
GPU_ECC_UNCORRECTED = "gpu.ecc_uncorrected"
ENGINE_TOKEN_USAGE = "engine.token_usage"  # noqa: S105 - a series name, not a secret
ENGINE_STATE_USAGE = "engine.state_usage"
ENGINE_THROUGHPUT = "engine.generation_tps"
ENGINE_RUNNING = "engine.running"
ENGINE_QUEUED = "engine.queued"
ENGINE_CACHE_HIT = "engine.cache_hit_rate"
ENGINE_TTFT_P50 = "engine.ttft_p50_s"
HOST_MODELS_FREE = "host.models_free_bytes"
HOST_MEMORY_AVAILABLE = "host.memory_available_bytes"
SAMPLE_NAMES = (  # every one of them
    GPU_TEMPERATURE, GPU_POWER, GPU_UTILIZATION, GPU_MEMORY_USED, GPU_ECC_UNCORRECTED,
    ENGINE_TOKEN_USAGE,
    ENGINE_STATE_USAGE, ENGINE_THROUGHPUT, ENGINE_RUNNING, ENGINE_QUEUED, ENGINE_CACHE_HIT,
    ENGINE_TTFT_P50, HOST_MODELS_FREE, HOST_MEMORY_AVAILABLE)


@dataclass(frozen=True)
class Sample:
    name: str
    subject: str
    value: float
