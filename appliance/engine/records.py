"""Engine runs and the desired state in the database. Callers get frozen records."""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from appliance.db.models import EngineControl, EngineRun


@dataclass(frozen=True)
class RunRecord:
    id: int
    started_at: dt.datetime
    runner: str
    spec_hash: str
    spec_json: str
    identity_json: str | None
    attempt: int
    adopted: bool
    state: str
    phases: list[tuple[str, str]]
    ready_at: dt.datetime | None
    ready_seconds: float | None
    ended_at: dt.datetime | None
    exit_code: int | None
    reason: str | None
    hint: str
    figures: dict[str, Any]
    log_path: str


def _record(row: EngineRun) -> RunRecord:
    return RunRecord(
        row.id, row.started_at, row.runner, row.spec_hash, row.spec_json, row.identity_json,
        row.attempt, row.adopted, row.state, [(p[0], p[1]) for p in json.loads(row.phases)],
        row.ready_at, row.ready_seconds, row.ended_at, row.exit_code, row.reason, row.hint,
        json.loads(row.figures), row.log_path,
    )


def open_run(
    session: Session, *, at: dt.datetime, runner: str, spec_hash: str, spec_json: str,
    attempt: int, state: str, log_path: str, identity_json: str | None = None,
    adopted: bool = False,
) -> RunRecord:
    row = EngineRun(
        started_at=at, runner=runner, spec_hash=spec_hash, spec_json=spec_json,
        identity_json=identity_json, attempt=attempt, adopted=adopted, state=state,
        phases=json.dumps([[state, at.isoformat()]]), hint="", figures="{}", log_path=log_path,
    )
    session.add(row)
    session.flush()
    return _record(row)


def update_run(session: Session, run_id: int, **changes: Any) -> RunRecord:
    """Apply changes; `phase=(state, at)` appends to the phase list when the state is new."""
    row = session.get(EngineRun, run_id)
    assert row is not None, f"engine run {run_id} vanished"
    phase = changes.pop("phase", None)
    if phase is not None:
        phases = json.loads(row.phases)
        if not phases or phases[-1][0] != phase[0]:
            phases.append([phase[0], phase[1].isoformat()])
            row.phases = json.dumps(phases)
        row.state = phase[0]
    if "figures" in changes:
        changes["figures"] = json.dumps(changes["figures"])
    for key, value in changes.items():
        setattr(row, key, value)
    return _record(row)


def latest_open_run(session: Session) -> RunRecord | None:
    row = session.scalar(
        select(EngineRun).where(EngineRun.ended_at.is_(None)).order_by(EngineRun.id.desc())
    )
    return _record(row) if row else None


def list_runs(session: Session, limit: int = 20) -> list[RunRecord]:
    rows = session.scalars(select(EngineRun).order_by(EngineRun.id.desc()).limit(limit))
    return [_record(r) for r in rows]


def past_ready_seconds(session: Session, limit: int = 10) -> list[float]:
    """How long recent starts on this box took to reach READY (for ETAs and restart costs)."""
    rows = session.scalars(
        select(EngineRun.ready_seconds).where(EngineRun.ready_seconds.is_not(None))
        .order_by(EngineRun.id.desc()).limit(limit)
    )
    return [float(v) for v in rows if v is not None]


@dataclass(frozen=True)
class Desired:
    running: bool
    last_good_spec_json: str | None
    updated_at: dt.datetime | None
    updated_by: str


def get_desired(session: Session) -> Desired:
    row = session.get(EngineControl, 1)
    if row is None:
        return Desired(False, None, None, "")
    return Desired(row.desired == "running", row.last_good_spec_json, row.updated_at,
                   row.updated_by)


def set_desired(session: Session, *, running: bool | None = None, at: dt.datetime,
                by: str, last_good_spec_json: str | None = None) -> None:
    row = session.get(EngineControl, 1)
    if row is None:
        row = EngineControl(id=1, desired="stopped", updated_at=at, updated_by=by)
        session.add(row)
    if running is not None:
        row.desired = "running" if running else "stopped"
        row.updated_at = at
        row.updated_by = by
    if last_good_spec_json is not None:
        row.last_good_spec_json = last_good_spec_json
