"""Login throttling per (username, client address), on the monotonic clock.

After `max_failures` failed logins for the same user from the same address within `window`
seconds, further attempts are refused with a Retry-After until the oldest failure leaves the
window. Keyed per address, so an attacker elsewhere cannot lock the admin out of their own
desk; measured on the monotonic clock, so a stepped wall clock neither extends nor lifts a
lock. In memory: one daemon process serves the console.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from appliance.clock import Clock

MAX_TRACKED = 10_000  # bound memory under a spray of distinct usernames/addresses


@dataclass
class LoginThrottle:
    clock: Clock
    max_failures: int = 5
    window: float = 60.0
    _failures: dict[tuple[str, str], deque[float]] = field(default_factory=dict)

    def retry_after(self, username: str, address: str) -> int:
        """Seconds until another attempt is allowed; 0 if allowed now."""
        failures = self._prune((username.lower(), address))
        if len(failures) < self.max_failures:
            return 0
        wait = failures[0] + self.window - self.clock.monotonic()
        return max(1, math.ceil(wait))

    def failed(self, username: str, address: str) -> None:
        key = (username.lower(), address)
        if key not in self._failures and len(self._failures) >= MAX_TRACKED:
            self._evict()
        self._failures.setdefault(key, deque()).append(self.clock.monotonic())

    def succeeded(self, username: str, address: str) -> None:
        self._failures.pop((username.lower(), address), None)

    def _prune(self, key: tuple[str, str]) -> deque[float]:
        failures = self._failures.get(key, deque())
        horizon = self.clock.monotonic() - self.window
        while failures and failures[0] <= horizon:
            failures.popleft()
        if not failures:
            self._failures.pop(key, None)
        return failures

    def _evict(self) -> None:
        for key in list(self._failures):
            self._prune(key)
        while len(self._failures) >= MAX_TRACKED:
            self._failures.pop(next(iter(self._failures)))
