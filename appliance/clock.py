"""Time as a port: wall-clock time for records, monotonic time for every timeout.

Timeouts, windows and backoff always use `monotonic()`, so a clock step (NTP, an operator
fixing the date) never fires or cancels one. Wall time is only for what a person reads and
for values that must survive a restart (session expiry).
"""

from __future__ import annotations

import datetime as dt
import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> dt.datetime:
        """Aware UTC wall-clock time."""
        ...

    def monotonic(self) -> float:
        """Seconds on a clock that never jumps."""
        ...


class SystemClock:
    def now(self) -> dt.datetime:
        return dt.datetime.now(dt.UTC)

    def monotonic(self) -> float:
        return time.monotonic()
