"""Live progress of the job in flight: bytes, rates and ETAs, kept in memory.

Rates are measured over a sliding window of recent samples (not since the start, so a resumed
file does not report its restored prefix as speed). These are the numbers the page shows
every second; the database gets bytes and states every few seconds (the truth after a restart
is the length of each .part file anyway).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

RATE_WINDOW = 10.0
STALLED_AFTER = 10.0  # seconds without a byte before a downloading file shows "stalled"


class RateMeter:
    """Bytes per second over the last `window` seconds of (time, cumulative bytes) samples."""

    def __init__(self, window: float = RATE_WINDOW) -> None:
        self.window = window
        self._samples: deque[tuple[float, int]] = deque()

    def add(self, now: float, total: int) -> None:
        self._samples.append((now, total))
        while len(self._samples) > 2 and self._samples[1][0] <= now - self.window:
            self._samples.popleft()

    def reset(self) -> None:
        self._samples.clear()

    def rate(self, now: float) -> float:
        if len(self._samples) < 2:
            return 0.0
        (t0, b0), (t1, b1) = self._samples[0], self._samples[-1]
        if now - t1 > self.window:  # nothing for a whole window
            return 0.0
        span = max(now, t1) - t0
        return max(0.0, (b1 - b0) / span) if span > 0 else 0.0


@dataclass
class LiveFile:
    """One file's progress in this process."""

    size: int
    state: str
    bytes_done: int = 0
    attempts: int = 0
    last_error: str = ""
    last_progress: float = 0.0
    meter: RateMeter = field(default_factory=RateMeter)
    dirty: bool = True

    def progress(self, now: float, bytes_done: int) -> None:
        if bytes_done != self.bytes_done:
            self.last_progress = now
        self.bytes_done = bytes_done
        self.meter.add(now, bytes_done)
        self.dirty = True

    def shown_state(self, now: float) -> str:
        if self.state == "downloading" and self.last_progress and (
                now - self.last_progress > STALLED_AFTER):
            return "stalled"
        return self.state


def eta(remaining: int, rate: float) -> float | None:
    """Seconds left at `rate`; None when nothing moves (an ETA of infinity helps no one)."""
    if remaining <= 0:
        return 0.0
    return remaining / rate if rate > 1.0 else None
