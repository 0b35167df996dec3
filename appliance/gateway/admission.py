"""Admission: a global concurrency limit in front of the engine, with a bounded queue that is
fair across API keys.

At most `limit` weight units are admitted at once (a request weighs its `n`). A request that
cannot start at once waits in its key's own FIFO; slots freed are handed out round-robin over
the keys that are waiting, so one busy key cannot starve the others however many requests it
queues. Nobody jumps the queue: while anyone waits, a new arrival waits too. The queue holds
at most `queue_max` requests over all keys (`QueueFull` beyond), and a request waits at most
its timeout (`QueueTimeout`). A waiter that is cancelled (its client went away) leaves the
queue at once, and a slot granted to it in the same instant is handed back.

Requests are also weighed by size against the engine's KV pool, once the gateway knows how
much of it is free (`set_kv_free`, fed by the poll while there is work; None: unknown, not
weighed). A request whose estimated prompt (`estimate_prompt_tokens`) is larger than its share
of the free KV tokens (the free tokens divided among the requests that share the pool now: the
ones admitted and itself) waits in the queue, as a request over the limit does, instead of
being sent into a pool it would overflow (SGLang would retract running requests or let it
wait inside the engine, where no timeout or fairness of ours applies). Each admitted prompt
is taken off the free figure until the next reading. A request always starts when nothing
else is admitted, so a large prompt waits for room but never forever (only up to its queue
timeout).

Runs on the event loop; no locks, because nothing here awaits between reading and writing
the counters.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field

# Bytes of request body per prompt token: OpenAI's rule of thumb for English text (about four
# characters a token). The body's JSON punctuation and parameters make it an overestimate,
# which errs on the side of waiting.
BYTES_PER_TOKEN = 4


def estimate_prompt_tokens(body: bytes) -> int:
    """A cheap prompt-size estimate from the request body's length (no tokenizer here)."""
    return len(body) // BYTES_PER_TOKEN


class QueueFull(Exception):
    pass


class QueueTimeout(Exception):
    pass


@dataclass(eq=False)
class _Waiter:
    key: int
    weight: int
    future: asyncio.Future[None]
    tokens: int = 0
    queued: bool = field(default=True)


class Admission:
    def __init__(self, limit: int, queue_max: int) -> None:
        self.limit = max(1, limit)
        self.queue_max = queue_max
        self.in_use = 0
        self.waiting = 0
        self._queues: dict[int, deque[_Waiter]] = {}
        self._ring: deque[int] = deque()  # keys with waiters, in round-robin order
        self.kv_free: int | None = None  # free KV tokens less prompts admitted since read

    def set_limit(self, limit: int) -> None:
        """A new limit (the engine's capacity changed); a raise admits waiters at once."""
        self.limit = max(1, limit)
        self._grant()

    def set_kv_free(self, tokens: int | None) -> None:
        """A new reading of the engine's free KV tokens (None: unknown, do not weigh)."""
        self.kv_free = None if tokens is None else max(0, tokens)
        self._grant()

    def kv_share(self) -> int | None:
        """The prompt tokens the next request may bring: the free KV tokens divided among the
        requests that would share them (those admitted, and this one); None: not weighed.

        Not divided among the empty slots: on an idle box with a limit of 62 that gave each
        request 1/62 of the pool, less than one 8K prompt, and 8K prompts started one at a
        time (48.8 output tok/s at 20 users where the engine alone served 404). The running
        requests' own growth is what a full pool takes from a newcomer."""
        if self.kv_free is None:
            return None
        return self.kv_free // (self.in_use + 1)

    def _fits(self, weight: int, tokens: int) -> bool:
        if self.in_use + weight > self.limit:
            return False
        share = self.kv_share()
        return share is None or self.in_use == 0 or tokens <= share

    def _take(self, weight: int, tokens: int) -> None:
        self.in_use += weight
        if self.kv_free is not None:
            self.kv_free = max(0, self.kv_free - tokens)

    def try_acquire(self, weight: int = 1, tokens: int = 0) -> bool:
        """Admit at once if a slot is free, the prompt fits its KV share and nobody is
        waiting (the fast path)."""
        if not self.waiting and self._fits(weight, tokens):
            self._take(weight, tokens)
            return True
        return False

    async def acquire(self, key: int, weight: int, timeout: float, tokens: int = 0) -> None:
        """Wait for a slot; raises QueueFull, QueueTimeout, or CancelledError (nothing held)."""
        if self.try_acquire(weight, tokens):
            return
        if self.waiting >= self.queue_max:
            raise QueueFull
        loop = asyncio.get_running_loop()
        waiter = _Waiter(key, min(weight, self.limit), loop.create_future(), tokens)
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
            if not self._fits(head.weight, head.tokens):
                return
            queue.popleft()
            head.queued = False
            self.waiting -= 1
            self._take(head.weight, head.tokens)
            self._ring.popleft()
            if queue:
                self._ring.append(key)  # back of the line: the next key goes first
            else:
                del self._queues[key]
            if not head.future.done():
                head.future.set_result(None)
