"""Admission: a global concurrency limit in front of the engine, with a bounded queue that is
fair across API keys.

At most `limit` weight units are admitted at once (a request weighs its `n`). A request that
cannot start at once waits in its key's own FIFO; slots freed are handed out round-robin over
the keys that are waiting, so one busy key cannot starve the others however many requests it
queues. Nobody jumps the queue: while anyone waits, a new arrival waits too. The queue holds
at most `queue_max` requests over all keys (`QueueFull` beyond), and a request waits at most
its timeout (`QueueTimeout`). A waiter that is cancelled (its client went away) leaves the
queue at once, and a slot granted to it in the same instant is handed back.

Runs on the event loop; no locks, because nothing here awaits between reading and writing
the counters.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field


class QueueFull(Exception):
    pass


class QueueTimeout(Exception):
    pass


@dataclass(eq=False)
class _Waiter:
    key: int
    weight: int
    future: asyncio.Future[None]
    queued: bool = field(default=True)


class Admission:
    def __init__(self, limit: int, queue_max: int) -> None:
        self.limit = max(1, limit)
        self.queue_max = queue_max
        self.in_use = 0
        self.waiting = 0
        self._queues: dict[int, deque[_Waiter]] = {}
        self._ring: deque[int] = deque()  # keys with waiters, in round-robin order

    def set_limit(self, limit: int) -> None:
        """A new limit (the engine's capacity changed); a raise admits waiters at once."""
        self.limit = max(1, limit)
        self._grant()

    def try_acquire(self, weight: int = 1) -> bool:
        """Admit at once if a slot is free and nobody is waiting (the fast path)."""
        if not self.waiting and self.in_use + weight <= self.limit:
            self.in_use += weight
            return True
        return False

    async def acquire(self, key: int, weight: int, timeout: float) -> None:
        """Wait for a slot; raises QueueFull, QueueTimeout, or CancelledError (nothing held)."""
        if self.try_acquire(weight):
            return
        if self.waiting >= self.queue_max:
            raise QueueFull
        loop = asyncio.get_running_loop()
        waiter = _Waiter(key, min(weight, self.limit), loop.create_future())
        queue = self._queues.get(key)
        if queue is None:
            queue = self._queues[key] = deque()
            self._ring.append(key)
        queue.append(waiter)
        self.waiting += 1
        timer = loop.call_later(timeout, self._expire, waiter)
        try:
            await waiter.future
        except asyncio.CancelledError:
            if waiter.queued:
                self._remove(waiter)
            elif waiter.future.done() and not waiter.future.cancelled() \
                    and waiter.future.exception() is None:
                self.release(waiter.weight)  # granted as we were cancelled: hand it back
            raise
        finally:
            timer.cancel()
        if waiter.weight != weight:  # a request heavier than the whole limit runs alone
            self.in_use += weight - waiter.weight

    def release(self, weight: int = 1) -> None:
        self.in_use = max(0, self.in_use - weight)
        self._grant()

    def _expire(self, waiter: _Waiter) -> None:
        if waiter.queued and not waiter.future.done():
            self._remove(waiter)
            waiter.future.set_exception(QueueTimeout())

    def _remove(self, waiter: _Waiter) -> None:
        queue = self._queues[waiter.key]
        queue.remove(waiter)
        waiter.queued = False
        self.waiting -= 1
        if not queue:
            del self._queues[waiter.key]
            self._ring.remove(waiter.key)
        self._grant()  # a heavy head that left may unblock lighter requests behind it

    def _grant(self) -> None:
        while self._ring:
            key = self._ring[0]
            queue = self._queues[key]
            head = queue[0]
            if self.in_use + head.weight > self.limit:
                return
            queue.popleft()
            head.queued = False
            self.waiting -= 1
            self.in_use += head.weight
            self._ring.popleft()
            if queue:
                self._ring.append(key)  # back of the line: the next key goes first
            else:
                del self._queues[key]
            if not head.future.done():
                head.future.set_result(None)
