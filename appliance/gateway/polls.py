"""A count of finished polls that requests can wait on: the gateway's key cache (a failing key
is checked again after the next poll) and its engine-state poll (a request to a backed-off
gateway waits for a fresh read) both need "until the count passes N, at most T seconds".

Runs on the event loop; one Event at a time, created by the first waiter and replaced after
each `advance`, so an idle gateway holds none.
"""

from __future__ import annotations

import asyncio
import contextlib


class PollCount:
    def __init__(self) -> None:
        self.value = 0
        self._event: asyncio.Event | None = None

    def advance(self, to: int | None = None) -> None:
        """A poll finished: the count moves to `to` (never back), or on by one; wake waiters."""
        self.value = self.value + 1 if to is None else max(self.value, to)
        if self._event is not None:
            self._event.set()
            self._event = None

    async def wait_past(self, target: int, timeout: float) -> None:
        """Until the count reaches `target`, or `timeout` seconds passed (no error either way)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.value < target:
            remaining = deadline - loop.time()
            if remaining <= 0:
                return
            if self._event is None:
                self._event = asyncio.Event()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._event.wait(), remaining)
