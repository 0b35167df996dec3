"""The qualification ledger: every qualification, with the launch spec it ran on (its hash),
its settings, its steps and its verdict. Typed frozen records out, never ORM rows.

A qualification belongs to its spec: the box is qualified only by a finished qualification
(`done`) whose spec hash is the running engine's. A `running` row left by a daemon that
stopped is closed as `interrupted` at the next start (`interrupt_running`).
"""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from appliance.db.models import Qualification
from appliance.qualify.plan import Settings
from appliance.qualify.verdict import Step, lower_bound, steps_from

STATES = ("running", "done", "cancelled", "failed", "interrupted")
LIST_LIMIT = 50


@dataclass(frozen=True)
class Record:
    id: int
    spec_hash: str
    state: str
    started_at: dt.datetime
    ended_at: dt.datetime | None
    started_by: str
    engine_version: str
    tuning: str
    settings: Settings
    steps: tuple[Step, ...]
    qualified: int | None
    verdict: str
    error: str

    @property
    def lower_bound(self) -> bool:
        """A finished run whose point is only a lower bound (`verdict.lower_bound`): the
        ladder can be continued from it (`Request.continue_from`)."""
        return self.state == "done" and lower_bound(
            self.qualified, self.steps, self.settings.max_running_requests)

    @property
    def ttft_at_point(self) -> float | None:
        """The time to first token measured at the qualified point (p90, its worst repeat):
        kept beside the SLO it was held to (`settings.ttft_p90_max`), both in the stored
        settings and steps, so no column repeats them."""
        step = next((s for s in self.steps if s.concurrency == self.qualified), None)
        return None if step is None else step.ttft_p90

    def to_dict(self, *, steps: bool = True) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": self.id, "spec_hash": self.spec_hash, "state": self.state,
            "started_at": self.started_at.isoformat(),
            "ended_at": self.ended_at.isoformat() if self.ended_at else None,
            "started_by": self.started_by, "engine_version": self.engine_version,
            "tuning": self.tuning, "settings": self.settings.to_dict(),
            "qualified": self.qualified, "lower_bound": self.lower_bound,
            "ttft_slo": self.settings.ttft_p90_max, "ttft_at_point": self.ttft_at_point,
            "verdict": self.verdict, "error": self.error}
        if steps:
            body["steps"] = [s.to_dict() for s in self.steps]
        return body


def _record(row: Qualification) -> Record:
    return Record(row.id, row.spec_hash, row.state, row.started_at, row.ended_at,
                  row.started_by, row.engine_version, row.tuning,
                  Settings.from_dict(json.loads(row.settings_json)),
                  steps_from(json.loads(row.steps_json)), row.qualified, row.verdict, row.error)


def open_qualification(session: Session, *, spec_hash: str, at: dt.datetime, by: str,
                       engine_version: str, tuning: str, settings: Settings) -> Record:
    row = Qualification(spec_hash=spec_hash, state="running", started_at=at, started_by=by[:128],
                        engine_version=engine_version[:64], tuning=tuning[:200],
                        settings_json=json.dumps(settings.to_dict()), steps_json="[]",
                        verdict="", error="")
    session.add(row)
    session.flush()
    return _record(row)


def save_steps(session: Session, qid: int, steps: tuple[Step, ...]) -> None:
    """The steps so far (written after each step, so a restart keeps what was measured)."""
    row = session.get(Qualification, qid)
    if row is not None:
        row.steps_json = json.dumps([s.to_dict() for s in steps])


def close_qualification(session: Session, qid: int, *, state: str, at: dt.datetime,
                        steps: tuple[Step, ...], qualified: int | None, verdict: str,
                        error: str = "") -> Record | None:
    if state not in STATES or state == "running":
        raise ValueError(f"{state!r} is not a final qualification state")
    row = session.get(Qualification, qid)
    if row is None:
        return None
    row.state, row.ended_at, row.qualified = state, at, qualified
    row.steps_json = json.dumps([s.to_dict() for s in steps])
    row.verdict, row.error = verdict, error[:4000]
    session.flush()
    return _record(row)


def interrupt_running(session: Session, at: dt.datetime) -> int:
    """Close every `running` row as `interrupted` (the daemon that ran it is gone)."""
    rows = session.scalars(select(Qualification).where(Qualification.state == "running")).all()
    for row in rows:
        row.state, row.ended_at = "interrupted", at
        row.error = "the daemon stopped while it ran; nothing after the last step was kept"
    return len(rows)


def get_qualification(session: Session, qid: int) -> Record | None:
    row = session.get(Qualification, qid)
    return None if row is None else _record(row)


def list_qualifications(session: Session, limit: int = LIST_LIMIT) -> list[Record]:
    rows = session.scalars(select(Qualification).order_by(Qualification.id.desc()).limit(limit))
    return [_record(r) for r in rows]


def qualification_for(session: Session, spec_hash: str) -> Record | None:
    """The newest finished qualification of this spec (None: the box is unqualified)."""
    row = session.scalars(
        select(Qualification)
        .where(Qualification.spec_hash == spec_hash, Qualification.state == "done")
        .order_by(Qualification.id.desc()).limit(1)).first()
    return None if row is None else _record(row)
