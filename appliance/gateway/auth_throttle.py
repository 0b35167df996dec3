"""Failed API keys per client address: after `max_failures` 401s within `window` seconds, an
address gets 429 with Retry-After until its oldest failure leaves the window. Pure apart from
the times passed in.

It slows a key guesser to `max_failures` tries a minute per address, and answers a blocked
address before any key is looked at, so a blocked guesser learns nothing more (a right key
from that address waits too; other addresses are not affected). Memory is bounded: at most
`max_addresses` addresses are tracked, each with at most `max_failures` timestamps; when the
table is full the address seen least recently is forgotten first.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque

MAX_FAILURES = 10
WINDOW_SECONDS = 60.0
MAX_ADDRESSES = 4096


class AuthFailures:
    def __init__(self, max_failures: int = MAX_FAILURES, window: float = WINDOW_SECONDS,
                 max_addresses: int = MAX_ADDRESSES) -> None:
        self.max_failures, self.window, self.max_addresses = max_failures, window, max_addresses
        self._failures: OrderedDict[str, deque[float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._failures)

    def blocked(self, address: str, now: float) -> int | None:
        """None when `address` may try a key, else the seconds until it may again."""
        times = self._failures.get(address)
        if times is None:
            return None
        self._expire(times, now)
        if not times:
            del self._failures[address]
            return None
        if len(times) < self.max_failures:
            return None
        return max(1, math.ceil(times[0] + self.window - now))

    def failed(self, address: str, now: float) -> None:
        """Count one failed key from `address`."""
        times = self._failures.get(address)
        if times is None:
            while len(self._failures) >= self.max_addresses:
                self._failures.popitem(last=False)
            times = self._failures[address] = deque(maxlen=self.max_failures)
        else:
            self._failures.move_to_end(address)
        self._expire(times, now)
        times.append(now)

    def _expire(self, times: deque[float], now: float) -> None:
        while times and times[0] <= now - self.window:
            times.popleft()
