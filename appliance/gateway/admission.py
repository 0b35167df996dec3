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

Service classes (appliance.gateway.classes) add two things, both off by default: a `group`
(the class's name) may hold at most its `share` of the limit at once (a waiter held back by
its share does not hold back the waiters of other groups), and a waiter of a higher
`priority` is granted before those of lower ones (round-robin over keys within a priority;
an arrival takes the fast path only when no waiter of its priority or above waits).

A class gate may also veto grants by priority (`may_grant`, the decode-floor guard of
appliance.gateway.class_gate): a request it holds waits in the queue as one over the limit
does.

Runs on the event loop; no locks, because nothing here awaits between reading and writing
the counters.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import Callable
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
    group: str = ""
    share: float = 1.0
    priority: int = 0


class Admission:
    def __init__(self, limit: int, queue_max: int) -> None:
        self.limit = max(1, limit)
        self.queue_max = queue_max
        self.in_use = 0
        self.waiting = 0
        self._queues: dict[int, deque[_Waiter]] = {}
        self._ring: deque[int] = deque()  # keys with waiters, in round-robin order
        self.kv_free: int | None = None  # free KV tokens less prompts admitted since read
        self.group_use: dict[str, int] = {}  # weight admitted per group (service class)
        # Seconds an admitted request holds its slot at the qualified point (a full batch
        # there, from the qualification): the early refusal's estimate until the gateway has
        # measured its own (None: not qualified, or the limit is not the point).
        self.service_prior: float | None = None
        # A veto on grants by priority (None: none): see the module docstring.
        self.may_grant: Callable[[int], bool] | None = None

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

    def group_slots(self, share: float) -> int:
        """The slots a group with this share of the limit may hold at once (at least 1)."""
        return max(1, math.floor(share * self.limit + 1e-9))

    def _over_share(self, weight: int, group: str, share: float) -> bool:
        return share < 1 and self.group_use.get(group, 0) + weight > self.group_slots(share)

    def waiting_at_or_above(self, priority: int) -> int:
        """The weight of the waiters that go before a new arrival of this priority."""
        return sum(w.weight for queue in self._queues.values() for w in queue
                   if w.priority >= priority)

    def _fits(self, weight: int, tokens: int, group: str = "", share: float = 1.0,
              priority: int = 0) -> bool:
        if self.in_use + weight > self.limit or self._over_share(weight, group, share):
            return False
        kv = self.kv_share()
        if kv is not None and self.in_use and tokens > kv:
            return False
        return self.may_grant is None or self.may_grant(priority)

    def _take(self, weight: int, tokens: int, group: str = "") -> None:
        self.in_use += weight
        self.group_use[group] = self.group_use.get(group, 0) + weight
        if self.kv_free is not None:
            self.kv_free = max(0, self.kv_free - tokens)

    def try_acquire(self, weight: int = 1, tokens: int = 0, group: str = "",
                    share: float = 1.0, priority: int = 0) -> bool:
        """Admit at once if a slot is free, the prompt fits its KV share and nobody of this
        priority or above is waiting (the fast path)."""
        ahead = self.waiting and self.waiting_at_or_above(priority)
        if not ahead and self._fits(weight, tokens, group, share, priority):
            self._take(weight, tokens, group)
            return True
        return False

    async def acquire(self, key: int, weight: int, timeout: float, tokens: int = 0,
                      group: str = "", share: float = 1.0, priority: int = 0) -> None:
        """Wait for a slot; raises QueueFull, QueueTimeout, or CancelledError (nothing held)."""
        if self.try_acquire(weight, tokens, group, share, priority):
            return
        if self.waiting >= self.queue_max:
            raise QueueFull
        loop = asyncio.get_running_loop()
        waiter = _Waiter(key, min(weight, self.limit), loop.create_future(), tokens,
                         group=group, share=share, priority=priority)
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
                self.release(waiter.weight, group)  # granted as we were cancelled: hand it back
            raise
        finally:
            timer.cancel()
        if waiter.weight != weight:  # a request heavier than the whole limit runs alone
            self.in_use += weight - waiter.weight
            self.group_use[group] = self.group_use.get(group, 0) + weight - waiter.weight

    def release(self, weight: int = 1, group: str = "") -> None:
        self.in_use = max(0, self.in_use - weight)
        self.group_use[group] = max(0, self.group_use.get(group, 0) - weight)
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

    def _next(self) -> _Waiter | None:
        """The head to grant next: of the keys' heads not held back by their group's share,
        the first in round-robin order of the highest priority."""
        best: _Waiter | None = None
        for key in self._ring:
            head = self._queues[key][0]
            if self._over_share(head.weight, head.group, head.share):
                continue
            if best is None or head.priority > best.priority:
                best = head
        return best

    def _grant(self) -> None:
        while self._ring:
            head = self._next()
            if head is None or not self._fits(head.weight, head.tokens, head.group, head.share,
                                              head.priority):
                return
            key = head.key
            queue = self._queues[key]
            queue.popleft()
            head.queued = False
            self.waiting -= 1
            self._take(head.weight, head.tokens, head.group)
            self._ring.remove(key)
            if queue:
                self._ring.append(key)  # back of the line: the next key goes first
            else:
                del self._queues[key]
            if not head.future.done():
                head.future.set_result(None)
