"""When a scheduled backup is due, when one is overdue, and the health check that says so.

Pure: every function takes `now` (the runtime's clock) and the box's time zone, never reads
the wall clock. `backup.schedule` is "off" or "daily HH:MM" in the box's local time.

- An occurrence is one day's HH:MM. The job takes a backup when the latest occurrence at or
  before now is later than its last attempt and than the moment the schedule was armed (so a
  new box, or a schedule just turned on, does not back up for a time before it existed). A
  daemon that was down at 03:00 backs up once when it is up again.
- A backup is overdue when an occurrence at least GRACE old has no success after it.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

from appliance.config import BACKUP_SCHEDULE_RE
from appliance.health.model import CheckResult, Level
from appliance.ops.backup import BackupStatus

GRACE = dt.timedelta(hours=2)  # a backup of a large database (pg_dump) takes a while
CHECK_ID = "host.backup"


@dataclass(frozen=True)
class Daily:
    hour: int
    minute: int

    def text(self) -> str:
        return f"{self.hour:02d}:{self.minute:02d}"


def parse(schedule: str) -> Daily | None:
    """None for "off" (config validation allows nothing else but "daily HH:MM")."""
    match = BACKUP_SCHEDULE_RE.fullmatch(schedule)
    return Daily(int(match["hour"]), int(match["minute"])) if match else None


def latest_occurrence(daily: Daily, now: dt.datetime, tz: dt.tzinfo | None = None) -> dt.datetime:
    """The last HH:MM (box time, or `tz`) at or before `now`, as an aware datetime."""
    local = now.astimezone(tz)
    at = local.replace(hour=daily.hour, minute=daily.minute, second=0, microsecond=0)
    if at > local:
        at -= dt.timedelta(days=1)
    return at


def is_due(schedule: str, status: BackupStatus, now: dt.datetime,
           tz: dt.tzinfo | None = None) -> bool:
    daily = parse(schedule)
    if daily is None or status.armed_at is None:
        return False
    at = latest_occurrence(daily, now, tz)
    if at <= status.armed_at:
        return False
    return status.last_attempt_at is None or status.last_attempt_at < at


def overdue_since(schedule: str, status: BackupStatus, now: dt.datetime,
                  tz: dt.tzinfo | None = None) -> dt.datetime | None:
    """The occurrence whose backup is missing, once GRACE has passed; None when not overdue."""
    daily = parse(schedule)
    if daily is None or status.armed_at is None:
        return None
    at = latest_occurrence(daily, now - GRACE, tz)
    if at <= status.armed_at:
        return None
    if status.last_success_at is not None and status.last_success_at >= at:
        return None
    return at


def _age(since: dt.datetime, now: dt.datetime) -> str:
    hours = (now - since).total_seconds() / 3600
    return f"{hours:.0f} hours" if hours < 48 else f"{hours / 24:.0f} days"


def last_backup_line(status: BackupStatus, now: dt.datetime) -> str:
    """One line for the dashboard."""
    if status.last_success_at is None:
        line = "none yet"
    else:
        secrets = "with secrets" if status.last_success_secrets else "without secrets"
        line = (f"{status.last_success_at:%Y-%m-%d %H:%M} UTC ({_age(status.last_success_at, now)}"
                f" ago, {secrets})")
    if status.last_failure_at is not None and (
            status.last_success_at is None or status.last_failure_at > status.last_success_at):
        line += f"; the last attempt failed: {status.last_failure}"
    return line


def backup_check(schedule: str, status: BackupStatus, now: dt.datetime,
                 tz: dt.tzinfo | None = None) -> CheckResult:
    """WARN when the scheduled backup is overdue (see the module docstring)."""
    title = "Backup"
    daily = parse(schedule)
    if daily is None:
        return CheckResult(CHECK_ID, "host", title, Level.OK,
                           "scheduled backups are off (backup.schedule); last backup: "
                           + last_backup_line(status, now))
    missing = overdue_since(schedule, status, now, tz)
    if missing is None:
        return CheckResult(CHECK_ID, "host", title, Level.OK,
                           f"daily at {daily.text()}; last backup: "
                           + last_backup_line(status, now))
    failed = (f"; the last attempt failed: {status.last_failure}"
              if status.last_failure_at is not None and status.last_failure_at >= missing
              else "")
    last = ("no backup has succeeded yet" if status.last_success_at is None
            else f"the last success was {_age(status.last_success_at, now)} ago")
    return CheckResult(
        CHECK_ID, "host", title, Level.WARN,
        f"the backup due at {missing:%Y-%m-%d %H:%M} (box time) has not succeeded: "
        f"{last}{failed}",
        "take one now (`appliance backup`), then look at the daemon's log and events for why "
        "the scheduled one failed (space in backup.dir, the passphrase file)")
