"""The weights check: the one verdict on the active weight set, for the Health page and
`appliance doctor` alike.

The verdict (`weights_check`):
- WARN when no set of `engine.model` is recorded (nothing to serve yet), or when its files
  are not all verified once (a pull still running);
- CRITICAL when a file of it is damaged: recorded failed by a verification, or moved to the
  quarantine folder; the summary names up to three with what was found;
- CRITICAL when the quick tier (`appliance.weights.quick`: sizes and safetensors headers,
  seconds rather than the hour a full hash takes) fails now;
- OK otherwise, with when the set was fully verified.

Blocking (database reads, file stats): callers run it in a worker thread. The health
monitor polls it every `INTERVAL_SECONDS`, at "check now" and at the end of every weights job
(`WeightsService.on_job_end`, so a job's verdict shows at once; group "weights"); the doctor
runs it once under its own id and group ("appliance.weights", "appliance").
"""

from __future__ import annotations

from pathlib import Path

from appliance.config import Config
from appliance.db.database import Database
from appliance.health.model import CheckResult, Level

GROUP = "weights"
CHECK_ID = "weights.set"
TITLE = "Weights"
INTERVAL_SECONDS = 300  # the quick tier only stats files and reads headers: cheap, but slow-moving


def weights_check(db: Database, config: Config, *, check_id: str = CHECK_ID,
                  group: str = GROUP) -> CheckResult:
    """See the module docstring."""
    from appliance.engine.args import model_dir
    from appliance.weights import records
    from appliance.weights.quarantine import QUARANTINE, quarantined
    from appliance.weights.quick import quick_verify
    from appliance.weights.records import active_set

    def result(level: Level, summary: str, hint: str = "") -> CheckResult:
        return CheckResult(check_id, group, TITLE, level, summary,
                           hint if level is not Level.OK else "")

    wanted = config.engine.model
    record = db.call(active_set)
    if record is None or record.repo_id != wanted:
        return result(Level.WARN, f"no weight set of {wanted} is recorded yet",
                      "pull them (`appliance weights pull`) or import a copy (`appliance "
                      "weights import DIR`); the engine cannot start without them")
    name = f"{wanted}@{record.commit[:12]}"
    files = db.call(lambda s: records.set_files(s, record.id))
    directory = model_dir(config.paths.models_dir, wanted)
    # A file a verification found damaged (quarantined, or recorded failed) is CRITICAL for
    # serving, named with what was found, not folded into "not verified yet".
    moved = set(quarantined(directory, [f.path for f in files]))
    damaged = [f for f in files if f.state == "failed" or f.path in moved]
    if damaged:
        shown = "; ".join(_damage(f.path, f.last_error, directory / QUARANTINE / f.path)
                          for f in damaged[:3])
        more = f" (and {len(damaged) - 3} more)" if len(damaged) > 3 else ""
        return result(Level.CRITICAL,
                      f"{len(damaged)} file(s) of {name} are damaged or failed: {shown}{more}",
                      "fetch them again (`appliance weights refetch`, or the Weights page) or "
                      "re-import them; the engine refuses to start on them")
    if record.full_verified_at is None:
        pending = sum(f.state != "verified" for f in files)
        return result(Level.WARN, f"{pending} of {len(files)} files of {name} are not "
                      "verified yet",
                      "let the pull finish, or run `appliance weights verify --full`")
    manifest = db.call(lambda s: records.load_manifest(s, record.id))
    report = quick_verify(directory, manifest)
    if not report.ok:
        shown = "; ".join(p.message for p in report.problems[:3])
        return result(Level.CRITICAL, f"{name} fails the quick check: {shown}",
                      "fetch the damaged files again (`appliance weights refetch`, or the "
                      "Weights page) or re-import them; the engine refuses to start on them")
    return result(Level.OK, f"{name} verified {record.full_verified_at:%Y-%m-%d %H:%M} UTC; "
                  "the quick check passes now")


def _damage(path: str, error: str, quarantined_at: Path) -> str:
    """One damaged file in a sentence that starts with its name."""
    if not error:
        return f"{path}: moved to {quarantined_at}"
    return error if error.startswith(path) else f"{path}: {error}"
