"""The operator's words for names the code uses: audit actions, audit details, scheduled jobs.

A page shows these words; the exact name stays one hover or click away (a `title` attribute,
or a <details> holding the raw detail) for a support case, which searches logs by it. Every
function is pure and total: a name this table does not know is still shown in words
("weights.cancel" reads "Weights cancel"), never as the raw dotted name.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping

# Audit actions as the code records them (appliance/auditing.py callers), in words.
ACTIONS: Mapping[str, str] = {
    "admin.bootstrap": "First admin created",
    "admin.set_role": "Account role changed",
    "auth.login": "Logged in",
    "auth.logout": "Logged out",
    "auth.sso": "Logged in through single sign-on",
    "auth.forbidden": "Refused: the role does not allow it",
    "auth.password_change": "Password changed",
    "backup.create": "Backup made",
    "backup.restore": "Backup restored",
    "cell.call": "Cell call to a member",
    "cell.join": "Box joined the cell",
    "cell.join_token.create": "Cell join token made",
    "cell.leave": "Box left the cell",
    "cell.member.add": "Cell member added",
    "cell.member.engine": "Cell member's engine action",
    "cell.member.remove": "Cell member removed",
    "cell.member.role": "Cell member's role changed",
    "cell.peer.refused": "Cell peer refused",
    "cell.peer.role": "Cell peer's role changed",
    "cell.rolling_restart": "Rolling restart of the cell",
    "cell.rolling_restart.cancel": "Rolling restart cancelled",
    "db.migrate": "Database schema upgraded",
    "engine.start": "Engine started",
    "engine.stop": "Engine stopped",
    "engine.restart": "Engine restarted",
    "engine.rollback": "Engine started on its last good launch",
    "engine.schedule": "Engine action scheduled",
    "engine.schedule_cancel": "Scheduled engine action cancelled",
    "health.mute": "Health check muted",
    "health.unmute": "Health check unmuted",
    "keys.create": "API key created",
    "keys.limits": "API key limits changed",
    "keys.revoke": "API key revoked",
    "qualify.run": "Qualification started",
    "qualify.cancel": "Qualification cancelled",
    "support.bundle": "Support bundle made",
    "token.create": "Admin API token created",
    "token.revoke": "Admin API token revoked",
    "tuning.apply": "Memory split applied",
    "tuning.profile.create": "Workload profile created",
    "tuning.profile.update": "Workload profile changed",
    "tuning.profile.delete": "Workload profile deleted",
    "weights.pull": "Weights download started",
    "weights.verify": "Weights verification started",
    "weights.refetch": "Damaged weight files fetched again",
    "weights.cancel": "Weights job cancelled",
}

# The scheduler's jobs (appliance/health/jobs.py, housekeeping.py, ops/jobs.py,
# engine/schedule.py), in words.
JOBS: Mapping[str, str] = {
    "health_gpus": "GPU health check",
    "health_engine": "engine health check",
    "health_host": "host health check",
    "health_weights": "weights health check",
    "health_prune": "health history clean-up",
    "purge_sessions": "expired sessions clean-up",
    "purge_failed_attempts": "failed logins clean-up",
    "purge_login_failures": "failed logins clean-up",
    "backup_tick": "scheduled backups",
}

_ENGINE_ACTION = re.compile(r"engine-action-(\d+)")
_SEPARATORS = re.compile(r"[._\-]+")


def _spoken(name: str) -> str:
    """A code name in words: "weights.prewarm_cancel" -> "weights prewarm cancel"."""
    return _SEPARATORS.sub(" ", name).strip()


def action_text(action: str) -> str:
    """An audit action in words: "auth.password_change" -> "Password changed"."""
    known = ACTIONS.get(action)
    if known is not None:
        return known
    words = _spoken(action)
    return words[:1].upper() + words[1:]


def job_text(job_id: str) -> str:
    """A scheduler job in words: "health_engine" -> "engine health check"."""
    scheduled = _ENGINE_ACTION.fullmatch(job_id)
    if scheduled:
        return f"scheduled engine action #{scheduled.group(1)}"
    return JOBS.get(job_id, _spoken(job_id))


def _value_text(value: object) -> str:
    if value is True:
        return "yes"
    if value is False:
        return "no"
    if value is None or value == "":
        return "—"
    if isinstance(value, list | tuple):
        return ", ".join(_value_text(v) for v in value) or "none"
    if isinstance(value, dict):
        return "; ".join(f"{_spoken(str(k))} {_value_text(v)}" for k, v in value.items())
    return str(value)


def detail_text(detail: Mapping[str, object] | None) -> str:
    """An audit row's detail in words: {"bootstrap_file_removed": true} -> "bootstrap file
    removed: yes"; several entries are joined by "; ". Empty for no detail."""
    if not detail:
        return ""
    return "; ".join(f"{_spoken(str(key))}: {_value_text(value)}"
                     for key, value in detail.items())


def detail_raw(detail: Mapping[str, object] | None) -> str:
    """The detail exactly as recorded (JSON), for support; empty for no detail."""
    return json.dumps(detail, sort_keys=True) if detail else ""
