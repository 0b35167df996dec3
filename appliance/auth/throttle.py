"""Login throttling per (username, client address), on the monotonic clock.

After `max_failures` failed logins for the same user from the same address within `window`
seconds, further attempts are refused with a Retry-After until the oldest failure leaves the
window. Keyed per address, so an attacker elsewhere cannot lock the admin out of their own
desk; measured on the monotonic clock, so a stepped wall clock neither extends nor lifts a
lock. In memory: one daemon process serves the console.

Memory is bounded whatever a caller sends: a key is the sha256 of the lowercased username
(32 bytes, however long the name was) with the address, each key keeps at most `max_failures`
times, and the table holds at most `max_tracked` keys, evicting the least recently failed.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from appliance.clock import Clock

MAX_TRACKED = 4096  # (user, address) pairs remembered; a spray of names evicts the oldest

Key = tuple[bytes, str]


def throttle_key(username: str, address: str) -> Key:
    return hashlib.sha256(username.lower().encode()).digest(), address[:64]


@dataclass
class LoginThrottle:
    clock: Clock
    max_failures: int = 5
    window: float = 60.0
    max_tracked: int = MAX_TRACKED
    _failures: OrderedDict[Key, deque[float]] = field(default_factory=OrderedDict)

    def retry_after(self, username: str, address: str) -> int:
        """Seconds until another attempt is allowed; 0 if allowed now."""
        failures = self._prune(throttle_key(username, address))
        if len(failures) < self.max_failures:
            return 0
        wait = failures[0] + self.window - self.clock.monotonic()
        return max(1, math.ceil(wait))

    def failed(self, username: str, address: str) -> None:
        key = throttle_key(username, address)
        failures = self._failures.get(key)
        if failures is None:
            while len(self._failures) >= self.max_tracked:
                self._failures.popitem(last=False)  # the least recently failed pair
            # Older failures than the last max_failures never decide a wait: keep no more.
            failures = self._failures[key] = deque(maxlen=self.max_failures)
        else:
            self._failures.move_to_end(key)
        failures.append(self.clock.monotonic())

    def succeeded(self, username: str, address: str) -> None:
        self._failures.pop(throttle_key(username, address), None)

    def tracked(self) -> int:
        """How many (user, address) pairs are remembered (for tests and diagnostics)."""
        return len(self._failures)

    def _prune(self, key: Key) -> deque[float]:
        failures = self._failures.get(key, deque())
        horizon = self.clock.monotonic() - self.window
        while failures and failures[0] <= horizon:
            failures.popleft()
        if not failures:
            self._failures.pop(key, None)
        return failures
