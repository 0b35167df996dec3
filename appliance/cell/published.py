"""What the head's daemon tells its gateway about the cell, through the one-row `cell_status`
table (the gateway is a process of its own and reads it on its half-second poll, beside the
engine's own row, `appliance.engine.publish`).

- `active` False, or no row: this box is not the head of a prefill/decode cell; the gateway
  forwards to the local engine exactly as before (the single-box path is unchanged).
- `active` True: the gateway forwards to `upstream_url` (the head's router, on loopback)
  instead of the local engine. It admits while `serving` (at least one prefill and one decode
  member READY) up to `capacity` (the sum over READY decode members of their effective
  `max_running_requests`); while not serving, every request gets a 503 with `message` (which
  role has no member READY, and why) and Retry-After from `eta_seconds`.

Pure over a session: the caller owns the transaction.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

from sqlalchemy.orm import Session

from appliance.cell.rows import CellStatusRow

ROW_ID = 1


@dataclass(frozen=True)
class CellPublished:
    active: bool
    upstream_url: str
    serving: bool
    message: str
    eta_seconds: float | None
    capacity: int | None
    updated_at: dt.datetime


def write_cell_published(session: Session, published: CellPublished) -> None:
    row = session.get(CellStatusRow, ROW_ID)
    if row is None:
        row = CellStatusRow(id=ROW_ID)
        session.add(row)
    row.active, row.upstream_url = published.active, published.upstream_url
    row.serving, row.message = published.serving, published.message
    row.eta_seconds, row.capacity = published.eta_seconds, published.capacity
    row.updated_at = published.updated_at


def read_cell_published(session: Session) -> CellPublished | None:
    """The head's latest word on its cell; None when never written (not a head)."""
    row = session.get(CellStatusRow, ROW_ID)
    if row is None:
        return None
    return CellPublished(row.active, row.upstream_url, row.serving, row.message,
                         row.eta_seconds, row.capacity, row.updated_at)
