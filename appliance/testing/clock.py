"""A clock the test controls: wall and monotonic time move independently, as in life."""

from __future__ import annotations

import datetime as dt


class FakeClock:
    def __init__(self, start: dt.datetime | None = None) -> None:
        self._wall = start or dt.datetime(2026, 11, 30, 12, 0, tzinfo=dt.UTC)
        self._mono = 1000.0

    def now(self) -> dt.datetime:
        return self._wall

    def monotonic(self) -> float:
        return self._mono

    def advance(self, seconds: float) -> None:
        """Time passes: both clocks move."""
        self._mono += seconds
        self._wall += dt.timedelta(seconds=seconds)

    def jump_wall(self, seconds: float) -> None:
        """The wall clock is stepped (NTP, an operator); monotonic time does not move."""
        self._wall += dt.timedelta(seconds=seconds)
