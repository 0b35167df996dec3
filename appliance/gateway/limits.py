"""Per-key rate limits kept in the gateway's memory: requests per minute (a sliding window)
and tokens per UTC day (seeded from the daily roll-up when the gateway starts, then counted
as requests finish). Pure apart from the times passed in.
"""

from __future__ import annotations

import datetime as dt
import math
from collections import deque


class KeyLimiter:
    def __init__(self) -> None:
        self._recent: dict[int, deque[float]] = {}
        self._day: dt.date | None = None
        self._tokens: dict[int, int] = {}

    def admit_rate(self, key: int, per_minute: int, now: float) -> int | None:
        """None and the request is counted, or the seconds until the key may send again."""
        window = self._recent.setdefault(key, deque())
        while window and window[0] <= now - 60.0:
            window.popleft()
        if len(window) >= per_minute:
            return max(1, math.ceil(window[0] + 60.0 - now))
        window.append(now)
        return None

    def seed_tokens(self, totals: dict[int, int], today: dt.datetime) -> None:
        self._day = today.date()
        self._tokens = dict(totals)

    def add_tokens(self, key: int, tokens: int, at: dt.datetime) -> None:
        self._roll(at)
        self._tokens[key] = self._tokens.get(key, 0) + tokens

    def tokens_used(self, key: int, at: dt.datetime) -> int:
        self._roll(at)
        return self._tokens.get(key, 0)

    def over_daily(self, key: int, per_day: int, at: dt.datetime) -> int | None:
        """None, or the seconds until 00:00 UTC when the key's daily tokens are spent."""
        if self.tokens_used(key, at) < per_day:
            return None
        midnight = dt.datetime.combine(at.astimezone(dt.UTC).date() + dt.timedelta(days=1),
                                       dt.time(), dt.UTC)
        return max(1, math.ceil((midnight - at).total_seconds()))

    def _roll(self, at: dt.datetime) -> None:
        day = at.astimezone(dt.UTC).date()
        if day != self._day:
            self._day, self._tokens = day, {}
