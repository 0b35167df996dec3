"""The engine's status as plain data for the API, the CLI and the console (JSON-ready)."""

from __future__ import annotations

from typing import Any

from appliance.engine.args import LaunchSpec
from appliance.engine.logreport import render_json
from appliance.engine.records import RunRecord
from appliance.engine.supervisor import EngineStatus


def status_dict(status: EngineStatus) -> dict[str, Any]:
    return {
        "state": status.state.value,
        "since": status.since.isoformat() if status.since else None,
        "message": status.message,
        "admits_requests": status.admits_requests,
        "run_id": status.run_id,
        "attempt": status.attempt,
        "adopted": status.adopted,
        "percent": status.percent,
        "eta_seconds": status.eta_seconds,
        "eta_basis": status.eta_basis,
        "stalled_seconds": status.stalled_seconds,
        "bytes_read": status.bytes_read,
        "weights_bytes": status.weights_bytes,
        "gpu_bytes_used": status.gpu_bytes_used,
        "reason": status.reason,
        "hint": status.hint,
        "next_retry_at": status.next_retry_at.isoformat() if status.next_retry_at else None,
        "pending": status.pending,
        "rollback_available": status.rollback_available,
        "expected_start_seconds": status.expected_start_seconds,
        "log": _log_dict(status),
    }


def _log_dict(status: EngineStatus) -> dict[str, Any] | None:
    """The log's figures, with the engine run (the daemon's run id) they were read from: a
    reader never has to guess whether they belong to the run the status describes."""
    if status.log is None:
        return None
    return {**render_json(status.log), "engine_run_id": status.run_id}


def run_dict(run: RunRecord) -> dict[str, Any]:
    return {
        "id": run.id,
        "started_at": run.started_at.isoformat(),
        "runner": run.runner,
        "spec_hash": run.spec_hash,
        "attempt": run.attempt,
        "adopted": run.adopted,
        "state": run.state,
        "phases": [list(p) for p in run.phases],
        "ready_at": run.ready_at.isoformat() if run.ready_at else None,
        "ready_seconds": run.ready_seconds,
        "ended_at": run.ended_at.isoformat() if run.ended_at else None,
        "exit_code": run.exit_code,
        "reason": run.reason,
        "hint": run.hint,
    }


def spec_rows(spec: LaunchSpec) -> list[dict[str, Any]]:
    """Each flag of a launch spec with its value, its origin and what it replaced."""
    return [
        {"flag": a.flag,
         "value": " ".join(v for v in (a.value, *a.more_values) if v is not None) or None,
         "origin": a.origin.value, "note": a.note}
        for a in spec.args
    ]
