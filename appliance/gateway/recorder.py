"""Usage written in batches, off the request path.

A finished request appends one `UsageRecord` to a list in memory; a second after the first
record of a batch (so at most once a second) the list is written in one transaction
(`usage.write_batch`, with the roll-ups) on a worker thread, with
the keys' last-use times. If the database is unreachable the records wait, up to
`MAX_PENDING`, and the oldest are dropped beyond that (logged with the count), so a broken
database never grows the gateway without bound. Stopping the gateway writes what is left.
Old per-request rows are pruned once an hour (`gateway.usage_retention_days`). With nothing
to write the writer sleeps until a record comes (or the hourly prune is due): an idle gateway
does no periodic work here.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
from functools import partial

from sqlalchemy.orm import Session

from appliance.clock import Clock
from appliance.db.database import Database
from appliance.gateway import usage
from appliance.gateway.keys import touch_used
from appliance.gateway.usage import UsageRecord

log = logging.getLogger(__name__)
MAX_PENDING = 200_000
TOUCH_EVERY = dt.timedelta(seconds=60)
PRUNE_EVERY = 3600.0


class Recorder:
    def __init__(self, db: Database, clock: Clock, retention_days: int,
                 interval: float = 1.0) -> None:
        self.db, self.clock, self.interval = db, clock, interval
        self.retention = dt.timedelta(days=retention_days)
        self.pending: list[UsageRecord] = []
        self.dropped = 0
        self.written = 0
        self._touched: dict[int, dt.datetime] = {}
        self._touch: dict[int, dt.datetime] = {}
        self._task: asyncio.Task[None] | None = None
        self._last_prune = -PRUNE_EVERY
        self._work: asyncio.Event | None = None  # set when there is something to write

    def add(self, record: UsageRecord) -> None:
        self.pending.append(record)
        if self._work is not None:
            self._work.set()
        if len(self.pending) > MAX_PENDING:
            excess = len(self.pending) - MAX_PENDING
            del self.pending[:excess]
            self.dropped += excess
        key = record.key_id
        if key is not None:
            last = self._touched.get(key)
            if last is None or record.ended_at - last >= TOUCH_EVERY:
                self._touched[key] = self._touch[key] = record.ended_at

    def start(self) -> None:
        self._work = asyncio.Event()
        if self.pending or self._touch:
            self._work.set()
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.flush()

    async def _loop(self) -> None:
        assert self._work is not None
        while True:
            prune_in = self._last_prune + PRUNE_EVERY - self.clock.monotonic()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._work.wait(), max(0.0, prune_in))
            if self._work.is_set():
                await asyncio.sleep(self.interval)  # gather a second's records into one write
                self._work.clear()
                await self.flush()
                if self.pending or self._touch:
                    self._work.set()  # the write failed: try again in a second
            if self.clock.monotonic() - self._last_prune >= PRUNE_EVERY:
                self._last_prune = self.clock.monotonic()
                with contextlib.suppress(Exception):
                    await self.db.run(partial(usage.prune, before=self.clock.now() -
                                              self.retention))

    async def flush(self) -> None:
        if not self.pending and not self._touch:
            return
        batch, touch = self.pending, self._touch
        self.pending, self._touch = [], {}

        def write(session: Session) -> None:
            usage.write_batch(session, batch)
            if touch:
                touch_used(session, touch)

        try:
            await self.db.run(write)
            self.written += len(batch)
        except Exception as exc:
            log.warning("could not write %d usage records (%s); will retry", len(batch), exc)
            self.pending[:0] = batch
            for key, at in touch.items():
                self._touch.setdefault(key, at)
        if self.dropped:
            log.warning("dropped %d usage records: the database was unreachable too long",
                        self.dropped)
            self.dropped = 0
