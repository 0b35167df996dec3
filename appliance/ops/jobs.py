"""The scheduled backup on the daemon's scheduler.

    backup_tick  every TICK_MINUTES  arms the schedule, takes the backup when one is due
                                     (appliance.ops.schedule), then keeps `backup.keep`

A tick rather than a cron trigger: whether a backup is due is decided by the runtime's clock
against the recorded status (so a daemon down at 03:00 backs up when it is up again, and tests
drive it with a fake clock). The backup itself runs in a worker thread; one tick at a time
(the scheduler's max_instances=1). A failure is recorded (status file, an error event) and
surfaces as the overdue health check; the next occurrence tries again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import logging

from appliance.config import Config
from appliance.db.database import Database
from appliance.ops import backup as bk
from appliance.ops.schedule import is_due
from appliance.runtime import Runtime

log = logging.getLogger(__name__)

JOB_ID = "backup_tick"
TICK_MINUTES = 5


def arm(status: bk.BackupStatus, schedule: str, now: dt.datetime) -> bk.BackupStatus | None:
    """The status with the schedule armed now, or None when it is armed already."""
    if status.armed_schedule == schedule:
        return None
    return dataclasses.replace(status, armed_at=now, armed_schedule=schedule)


def tick(config: Config, db: Database, now: dt.datetime,
         tz: dt.tzinfo | None = None) -> bk.BackupResult | None:
    """One tick (blocking): arm, and back up when due. Returns the backup taken, if any."""
    from appliance.db.journal import add_event
    from appliance.ops.crypto import read_passphrase_file

    state_dir = config.paths.state_dir
    status = bk.read_status(state_dir)
    armed = arm(status, config.backup.schedule, now)
    if armed is not None:
        bk.write_status(state_dir, armed)
        status = armed
    if not is_due(config.backup.schedule, status, now, tz):
        return None
    directory = bk.backup_dir(config)
    try:
        with bk.recording(state_dir, now) as done:
            file = config.backup.passphrase_file
            passphrase = read_passphrase_file(file) if file is not None else None
            result = bk.create_backup(config, directory / bk.backup_name(now),
                                      passphrase=passphrase, now=now)
            done.append(result)
    except Exception as exc:
        log.exception("the scheduled backup failed")
        message = f"the scheduled backup failed: {getattr(exc, 'message', None) or exc}"
        db.call(lambda s: add_event(s, at=now, severity="error", source="backup",
                                    message=message))
        return None
    removed = bk.prune(directory, config.backup.keep)
    secrets = "with the secrets" if result.manifest["secrets"]["included"] else (
        "WITHOUT the secrets and unsealed, so a restore needs --unverified "
        "(backup.passphrase_file is unset)")
    db.call(lambda s: add_event(
        s, at=now, severity="info", source="backup",
        message=f"scheduled backup written to {result.path} ({result.size:,} bytes, {secrets})",
        detail={"removed": [p.name for p in removed]}))
    return result


async def backup_tick(runtime: Runtime) -> None:
    await asyncio.to_thread(tick, runtime.config, runtime.db, runtime.clock.now())


def schedule_backups(runtime: Runtime) -> None:
    """Add the tick to the daemon's scheduler, its first run at once (with backups "off",
    each tick returns at once)."""
    runtime.scheduler.add_job(backup_tick, "interval", minutes=TICK_MINUTES, args=[runtime],
                              id=JOB_ID, replace_existing=True,
                              next_run_time=dt.datetime.now(dt.UTC))
