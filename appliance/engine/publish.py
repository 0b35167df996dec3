"""The engine's state, published for the gateway (a process of its own) through the database.

The supervisor is the only writer of engine state; this module copies what matters to the
gateway (state, message, ETA) into the one-row `engine_status` table whenever it changes.
Writes are coalesced: the first change is written at once, later ones at most once per
`interval` seconds, and the newest always wins, so a 90-minute load with a moving percentage
costs one small write a second. The gateway polls the row (`read_published`).

A restarted daemon costs users nothing: the row keeps the last state while no daemon runs, and
nothing is written until the new supervisor's first reconcile has finished
(`EngineStatus.reconciled`): its initial STOPPED, and the ADOPTED it passes through while it
adopts a live engine, are guesses the gateway must not act on. The first write is then what
it found: READY for an adopted engine that answers, STOPPED when there is none.

The row also names the launch spec of the engine followed (`spec_hash`, from its run record),
which the gateway looks its qualification up by (`appliance.gateway.qualified`): admission
follows the qualified point of the spec that is running, never of one that ran before.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sqlalchemy.orm import Session

from appliance.clock import Clock
from appliance.db.database import Database
from appliance.db.models import EngineRun, EngineStatusRow
from appliance.engine.states import EngineState, admits_requests

if TYPE_CHECKING:  # the gateway imports this module; it must not load the supervisor
    from appliance.engine.supervisor import EngineStatus

log = logging.getLogger(__name__)
ROW_ID = 1


@dataclass(frozen=True)
class Published:
    """The engine's state as the gateway sees it."""

    state: str
    message: str
    eta_seconds: float | None
    updated_at: dt.datetime
    # A qualification runs (appliance.qualify): refuse users (503) until then; None: open.
    qualifying_until: dt.datetime | None = None
    # The running engine's launch spec (None: none followed, or a row from before 0012).
    spec_hash: str | None = None
    # When the running qualification is expected to end (None: not known, or none runs).
    qualifying_ends_at: dt.datetime | None = None

    def qualifying(self, now: dt.datetime) -> bool:
        """Whether the gateway must refuse users now because the box is being qualified (the
        daemon renews the lease while it runs; one that lapsed means the daemon is gone)."""
        return self.qualifying_until is not None and now < self.qualifying_until

    @property
    def admits_requests(self) -> bool:
        try:
            return admits_requests(EngineState(self.state))
        except ValueError:
            return False


def write_published(session: Session, state: str, message: str, eta_seconds: float | None,
                    at: dt.datetime, spec_hash: str | None = None) -> None:
    row = session.get(EngineStatusRow, ROW_ID)
    if row is None:
        session.add(EngineStatusRow(id=ROW_ID, state=state, message=message,
                                    eta_seconds=eta_seconds, updated_at=at, spec_hash=spec_hash))
        return
    row.state, row.message, row.eta_seconds, row.updated_at = state, message, eta_seconds, at
    row.spec_hash = spec_hash


def run_spec_hash(session: Session, run_id: int | None) -> str | None:
    """The launch-spec hash of the engine run the supervisor follows (None: none)."""
    run = None if run_id is None else session.get(EngineRun, run_id)
    return None if run is None else run.spec_hash


def read_published(session: Session) -> Published | None:
    row = session.get(EngineStatusRow, ROW_ID)
    if row is None:
        return None
    return Published(row.state, row.message, row.eta_seconds, row.updated_at,
                     row.qualifying_until, row.spec_hash, row.qualifying_ends_at)


def write_qualifying(session: Session, until: dt.datetime | None,
                     ends_at: dt.datetime | None = None) -> None:
    """Close the gateway to users until `until` (a qualification's lease), or open it (None).
    `ends_at`: when the run is expected to end, for the refusal's words (kept while the lease
    is renewed without one). Without a row the engine was never published and the gateway
    refuses everyone anyway."""
    row = session.get(EngineStatusRow, ROW_ID)
    if row is not None:
        row.qualifying_until = until
        if until is None or ends_at is not None:
            row.qualifying_ends_at = ends_at


class StatusPublisher:
    """Listens to the supervisor and keeps `engine_status` current (see the module doc)."""

    def __init__(self, db: Database, clock: Clock, interval: float = 1.0) -> None:
        self.db, self.clock, self.interval = db, clock, interval
        self._latest: tuple[str, str, float | None, int | None] | None = None
        self._written: tuple[str, str, float | None, int | None] | None = None
        self._task: asyncio.Task[None] | None = None
        self._reconciled = False  # nothing is written before the supervisor's first reconcile

    def listen(self, status: EngineStatus) -> None:
        """The supervisor's on_change listener (runs on the event loop)."""
        eta = None if status.eta_seconds is None else round(status.eta_seconds)
        self._latest = (status.state.value, status.message, eta, status.run_id)
        if not status.reconciled:
            return  # an initial guess: the row keeps the last known state (module doc)
        self._reconciled = True
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._flush())

    async def _flush(self) -> None:
        while self._latest is not None and self._latest != self._written:
            latest = self._latest
            try:
                await self._write(latest)
            except Exception:
                log.exception("could not publish the engine state for the gateway")
            await asyncio.sleep(self.interval)

    async def stop(self) -> None:
        """Write the newest state now (the daemon is stopping) and end the flusher."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._reconciled and self._latest is not None and self._latest != self._written:
            await self._write(self._latest)

    async def _write(self, latest: tuple[str, str, float | None, int | None]) -> None:
        at = self.clock.now()
        state, message, eta, run_id = latest

        def write(session: Session) -> None:
            write_published(session, state, message, eta, at, run_spec_hash(session, run_id))

        await self.db.run(write)
        self._written = latest
