"""Load progress you can believe, and the only definition of "hung". Pure.

The log is one signal; the others do not depend on its wording: bytes the engine's processes
have read (against the weights' total), GPU memory in use, and elapsed time against past
loads on this box. A load is hung only when *no* signal advanced for the window — there is
no fixed load timeout.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace

from appliance.engine.states import EngineState

# Share of a cold K3 start spent in each phase (89 min: ~81 loading, the rest pools and
# graphs), used to turn a phase plus an in-phase fraction into one percentage.
PHASE_SPAN: dict[EngineState, tuple[float, float]] = {
    EngineState.PREFLIGHT: (0.0, 0.0),
    EngineState.LAUNCHING: (0.0, 2.0),
    EngineState.LOADING_WEIGHTS: (2.0, 92.0),
    EngineState.ALLOCATING: (92.0, 94.0),
    EngineState.CAPTURING_GRAPHS: (94.0, 98.0),
    EngineState.WARMING: (98.0, 99.5),
    EngineState.READY: (100.0, 100.0),
}


@dataclass(frozen=True)
class Signals:
    """What can be observed of a loading engine at one moment."""

    phase: EngineState
    log_records: int = 0
    shards_done: int = 0
    shards_total: int | None = None
    bytes_read: int = 0
    gpu_bytes_used: int = 0

    def _key(self) -> tuple[int, int, int, int, int]:
        order = list(PHASE_SPAN).index(self.phase) if self.phase in PHASE_SPAN else 0
        return (order, self.log_records, self.shards_done, self.bytes_read, self.gpu_bytes_used)


@dataclass(frozen=True)
class Tracker:
    started: float  # monotonic seconds
    last_advance: float
    last: Signals | None = None

    @classmethod
    def begin(cls, now: float) -> Tracker:
        return cls(started=now, last_advance=now)


def observe(tracker: Tracker, signals: Signals, now: float) -> Tracker:
    """Record a sample; any signal that moved (in either direction) counts as progress."""
    if tracker.last is None or signals._key() != tracker.last._key():
        return replace(tracker, last=signals, last_advance=now)
    return replace(tracker, last=signals)


def stalled_for(tracker: Tracker, now: float) -> float:
    return max(0.0, now - tracker.last_advance)


def is_hung(tracker: Tracker, now: float, window_seconds: float) -> bool:
    return stalled_for(tracker, now) >= window_seconds


@dataclass(frozen=True)
class Estimate:
    percent: float
    eta_seconds: float | None
    basis: str  # how the ETA was made, for the page: "past loads", "load rate" or ""


def load_fraction(signals: Signals, weights_bytes: int | None) -> float:
    """How far the weight load is, from shards and from bytes read, whichever is further."""
    fractions = [0.0]
    if signals.shards_total:
        fractions.append(signals.shards_done / signals.shards_total)
    if weights_bytes:
        fractions.append(signals.bytes_read / weights_bytes)
    return min(1.0, max(fractions))


def estimate(
    signals: Signals, elapsed: float, weights_bytes: int | None, past_ready: list[float]
) -> Estimate:
    """Percentage of the start done and the time left.

    With past loads on this box, the ETA is their median minus the time spent, never below
    what the current rate implies; without history, it follows the load rate.
    """
    low, high = PHASE_SPAN.get(signals.phase, (0.0, 0.0))
    loading = signals.phase is EngineState.LOADING_WEIGHTS
    inner = load_fraction(signals, weights_bytes) if loading else 0.0
    percent = round(low + (high - low) * inner, 1)
    if signals.phase is EngineState.READY:
        return Estimate(100.0, 0.0, "")
    by_rate = None
    if percent >= 3.0 and elapsed > 0:
        by_rate = elapsed * (100.0 / percent - 1.0)
    if past_ready:
        typical = statistics.median(past_ready)
        remaining = max(0.0, typical - elapsed)
        if by_rate is not None:
            remaining = max(remaining, min(by_rate, typical))
        return Estimate(percent, remaining, "past loads")
    if by_rate is not None:
        return Estimate(percent, by_rate, "load rate")
    return Estimate(percent, None, "")
