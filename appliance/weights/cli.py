"""`appliance weights …`: pull, status, verify, refetch, import, export-manifest, cancel.

When the daemon runs (it holds the state directory's lock), commands go to its admin API and
the job runs there, surviving this terminal; Ctrl-C only stops watching. When it does not
(a box being set up), the command runs the same service in this process, holding the lock so
a daemon cannot start beside it; Ctrl-C stops the job and the next pull (or daemon) resumes
it. Every command prints a progress bar on a terminal and takes `--json`.

Read-only commands (`status`, `export-manifest`) work whoever holds the lock: `status` asks
the daemon when one answers, and otherwise (another CLI runs a job, or no admin account can
act yet) reads what the database holds. Exit status: 0 when the command did what it says;
1 when a job failed, a check found damage, or a full verification found a file that does
not match the manifest; 64 for bad input; 75 when the daemon does not answer.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

from appliance.config import Config, check_endpoint, check_repo_id
from appliance.errors import EX_USAGE, AlreadyRunning, ApplianceError
from appliance.weights.views import bytes_text, stamp

FINAL = ("idle", "failed")


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    weights = sub.add_parser("weights", parents=[common], help="download and verify weights")
    cmds = weights.add_subparsers(dest="weights_command", required=True)
    pull = cmds.add_parser("pull", parents=[common], help="download (or resume) the weights")
    pull.add_argument("--repo", help="Hub repo id (default: weights.repo, else engine.model)")
    pull.add_argument("--revision", help="branch, tag or commit (default: weights.revision)")
    pull.add_argument("--endpoint", help="Hub or mirror URL (default: weights.endpoint)")
    status = cmds.add_parser("status", parents=[common], help="manifest, progress, files")
    verify = cmds.add_parser(
        "verify", parents=[common], help="quick check, or --full hashes",
        description="Check the active set. Exit status 1 when a file is damaged: the quick "
        "check failed, or --full found a file that does not match the manifest (it is named, "
        "with the expected and found digests, and moved to the model directory's "
        ".quarantine/). Fetching it again is a separate step: `appliance weights refetch`.")
    verify.add_argument("--full", action="store_true", help="sha256 of every file")
    verify.add_argument("--rehash", action="store_true",
                        help="with --full: hash files unchanged since they were proven too")
    refetch = cmds.add_parser(
        "refetch", parents=[common], help="fetch damaged or missing files again",
        description="Fetch the active set's damaged or missing files again, pinned to its "
        "commit, from weights.endpoint as configured now. Files still proven are kept.")
    imp = cmds.add_parser("import", parents=[common], help="adopt a checkpoint from a folder")
    imp.add_argument("directory", type=Path)
    imp.add_argument("--manifest", type=Path, help="manifest JSON (default DIR/manifest.json)")
    export = cmds.add_parser("export-manifest", parents=[common],
                             help="print the manifest as JSON (for an air-gapped box)")
    export.add_argument("--out", type=Path, help="write to this file instead of stdout")
    export.add_argument("--from-dir", type=Path,
                        help="hash a trusted copy in this folder instead of the recorded set")
    export.add_argument("--repo", help="with --from-dir: the repo id (default engine.model)")
    cancel = cmds.add_parser("cancel", parents=[common], help="cancel the job in flight")
    for cmd in (pull, status, verify, refetch, imp, cancel):
        cmd.add_argument("--json", action="store_true", help="print JSON")
    for cmd in (pull, verify, refetch, imp):
        cmd.add_argument("--detach", action="store_true",
                         help="with a running daemon: return at once, do not follow")


def run(args: argparse.Namespace, config: Config) -> int:
    command = args.weights_command
    if command == "export-manifest":
        return export_manifest(args, config)
    if command == "pull":
        for key, check in (("repo", check_repo_id), ("endpoint", check_endpoint)):
            value = getattr(args, key)
            if value is not None and (expected := check(value)):
                raise ApplianceError("weights_bad_input", f"--{key} {value!r} is not "
                                     f"{expected}", f"fix --{key}", exit_code=EX_USAGE)
    with _mode(config) as local:
        if local is None:
            if command == "status":
                return _status_elsewhere(args, config)
            return _remote(args, config)
        return _local(args, config)


def _status_elsewhere(args: argparse.Namespace, config: Config) -> int:
    """Another process holds the state directory: the daemon's live view when it answers;
    else what the database holds (a CLI job elsewhere, or no admin account ready yet)."""
    try:
        return _remote(args, config)
    except ApplianceError as exc:
        if exc.code not in ("daemon_unreachable", "no_admin"):
            raise
    from appliance.clock import SystemClock
    from appliance.db.database import Database
    from appliance.weights.service import WeightsService

    try:
        holder = (config.paths.state_dir / "appliance.lock").read_text().strip() or "unknown"
    except OSError:
        holder = "unknown"
    db = Database(config.database_url)
    try:
        service = WeightsService(config, db, SystemClock())
        view = asyncio.run(service.observed(holder)).to_dict()
    finally:
        db.dispose()
    return _report(args, view)


@contextlib.contextmanager
def _mode(config: Config) -> Iterator[object | None]:
    """Yields a held lock (no daemon: run here) or None (the daemon runs: use its API)."""
    from appliance.lock import InstanceLock

    lock = InstanceLock(config.paths.state_dir)
    try:
        lock.acquire()
    except AlreadyRunning:
        yield None
        return
    try:
        yield lock
    finally:
        lock.release()


# --- through the daemon ---------------------------------------------------------------------


def _remote(args: argparse.Namespace, config: Config) -> int:
    from appliance.engine.cli import checked, daemon_api

    _checked = partial(checked, code="weights_api")
    command = args.weights_command
    with daemon_api(config, f"weights {command}") as api:
        if command == "status":
            view = _checked(api.get("/api/v1/weights/"))
        elif command == "cancel":
            view = _checked(api.post("/api/v1/weights/cancel"))
        elif command == "verify" and not args.full:
            view = _checked(api.post("/api/v1/weights/verify", json={"full": False}))
        else:
            if command == "pull":
                body = {"repo": args.repo, "revision": args.revision,
                        "endpoint": args.endpoint}
                view = _checked(api.post("/api/v1/weights/pull", json=body))
            elif command == "verify":
                view = _checked(api.post("/api/v1/weights/verify",
                                         json={"full": True, "rehash": args.rehash}))
            elif command == "refetch":
                view = _checked(api.post("/api/v1/weights/refetch"))
            else:
                view = _checked(api.post("/api/v1/weights/import", json={
                    "directory": str(args.directory.absolute()),
                    "manifest": str(args.manifest.absolute()) if args.manifest else None}))
            if not args.detach:
                view = _follow(lambda: _checked(api.get("/api/v1/weights/")), args.json,
                               job="verify" if command == "verify" else "")
    return _report(args, view)


def _follow(poll: Callable[[], dict[str, Any]], quiet: bool, job: str = "") -> dict[str, Any]:
    """Poll until the job ends; with `job`, until that job ends, not one it hands over to
    (a verification's automatic refetch runs on in the daemon)."""
    bar = ProgressBar(enabled=not quiet)
    view = poll()

    def running(view: dict[str, Any]) -> bool:
        if job:
            return bool(view.get("job") == job)
        return view["activity"] not in FINAL

    try:
        while running(view):
            bar.show(view)
            time.sleep(1.0)
            view = poll()
    except KeyboardInterrupt:
        bar.done()
        print("appliance: stopped watching; the job goes on in the daemon "
              "(`appliance weights status`)", file=sys.stderr)
        return poll()
    bar.done()
    return view


# --- in this process ------------------------------------------------------------------------


def _local(args: argparse.Namespace, config: Config) -> int:
    from appliance.clock import SystemClock
    from appliance.db.database import Database
    from appliance.db.schema import check_schema
    from appliance.resources import migrations_dir
    from appliance.weights.service import WeightsService

    db = Database(config.database_url)
    try:
        check_schema(db, migrations_dir())
        service = WeightsService(config, db, SystemClock())
        return asyncio.run(_local_main(args, service))
    finally:
        db.dispose()


async def _local_main(args: argparse.Namespace, service: Any) -> int:
    command = args.weights_command
    start: Callable[[], Awaitable[Any]] | None = None
    if command == "pull":
        start = lambda: service.pull(actor=_actor(), repo=args.repo,  # noqa: E731
                                     revision=args.revision, endpoint=args.endpoint)
    elif command == "verify" and args.full:
        start = lambda: service.verify_full(actor=_actor(), rehash=args.rehash)  # noqa: E731
    elif command == "refetch":
        start = lambda: service.refetch(actor=_actor(), via="cli")  # noqa: E731
    elif command == "import":
        start = lambda: service.import_dir(  # noqa: E731
            args.directory.absolute(), actor=_actor(),
            manifest_file=args.manifest.absolute() if args.manifest else None)
    try:
        if command == "verify" and not args.full:
            await service.quick_verify()
        elif command == "cancel":
            await service.cancel(actor=_actor())
        elif start is not None:
            await start()
            # A verification reports its own verdict: an automatic refetch it started is
            # recorded and resumes with the daemon or `appliance weights refetch`.
            await _watch_local(service, args.json,
                               service.wait_job() if command == "verify" else
                               service.wait_idle())
        view = (await service.status()).to_dict()
    finally:
        await service.stop_service()
    return _report(args, view)


async def _watch_local(service: Any, quiet: bool, until: Awaitable[None]) -> None:
    bar = ProgressBar(enabled=not quiet)
    task = asyncio.ensure_future(until)
    persist = asyncio.ensure_future(service.persist_loop())
    try:
        while not task.done():
            bar.show((await service.status()).to_dict())
            await asyncio.wait({task}, timeout=0.5)
    except (KeyboardInterrupt, asyncio.CancelledError):
        bar.done()
        print("appliance: interrupted; partial files are kept and the next `appliance "
              "weights pull` (or the daemon) resumes", file=sys.stderr)
        raise
    finally:
        persist.cancel()
        bar.done()


def _actor() -> str:
    import getpass

    try:
        return f"cli:{getpass.getuser()}"
    except Exception:
        return "cli"


# --- output ---------------------------------------------------------------------------------


def _report(args: argparse.Namespace, view: dict[str, Any]) -> int:
    command = args.weights_command
    full = command == "verify" and getattr(args, "full", False)
    verification = view.get("verification") or {}
    failed = view.get("activity") == "failed" or (
        command == "verify" and not full and view.get("quick_ok") is False) or (
        full and verification.get("ok") is False)
    if args.json:
        print(json.dumps(view, indent=2))
    else:
        print(describe(view, verdict=full))
    return 1 if failed else 0


def describe(view: dict[str, Any], *, verdict: bool = False) -> str:
    """The status for a person; `verdict`: lead with the last full verification's."""
    lines = []
    verification = view.get("verification")
    if verdict and verification:
        lines += _verdict_lines(verification)
    if view.get("repo_id"):
        lines.append(f"weights: {view['repo_id']}@{(view.get('commit') or '')[:12]} "
                     f"({view.get('revision')}) from {view.get('source')}")
        lines.append(f"  {len(view.get('files', []))} files, "
                     f"{bytes_text(view['total_bytes'])}, in {view['model_dir']}")
    else:
        lines.append("weights: no manifest recorded yet (`appliance weights pull`)")
    lines.append(f"  {view['activity']}: {view['message']}")
    if view.get("hint"):
        lines.append(f"  hint: {view['hint']}")
    counts = {k: v for k, v in (view.get("counts") or {}).items() if v}
    if counts:
        lines.append("  files: " + ", ".join(f"{v} {k}" for k, v in counts.items()))
    if view.get("full_verified_at"):
        lines.append(f"  fully verified at {_stamp(view['full_verified_at'])}")
    problems = view.get("disk_problems") or []
    if problems:
        lines.append("  changed on disk since proven:")
        lines += [f"    {p}" for p in problems[:10]]
    latest = view.get("latest_check")
    if latest:  # the newest verdict of either kind, named: never an older quick pass
        lines.append(f"  latest check: {latest['sentence']}")
        if latest["kind"] == "quick check":
            lines += [f"    {p}" for p in view.get("quick_problems", [])[3:10]]
    for item in view.get("files", []):
        if item["state"] in ("failed", "missing", "retrying", "stalled"):
            lines.append(f"  {item['state']:>9} {item['path']}: {item['last_error']}")
    lines.append("  ready for the engine: " + ("yes" if view.get("ready_for_engine") else "no"))
    return "\n".join(lines)


class ProgressBar:
    """One line on a terminal (redrawn), a line every 5 s otherwise; on stderr."""

    def __init__(self, *, enabled: bool = True) -> None:
        self.enabled = enabled
        self.tty = sys.stderr.isatty()
        self._last = 0.0
        self._drawn = False

    def show(self, view: dict[str, Any]) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if not self.tty and now - self._last < 5.0:
            return
        self._last = now
        line = render_bar(view)
        if self.tty:
            sys.stderr.write("\r\x1b[2K" + line)
            self._drawn = True
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()

    def done(self) -> None:
        if self._drawn:
            sys.stderr.write("\n")
            sys.stderr.flush()
            self._drawn = False


def render_bar(view: dict[str, Any], width: int = 30) -> str:
    percent = float(view.get("percent") or 0.0)
    filled = int(width * percent / 100)
    eta = view.get("eta_seconds")
    shown_eta = f" ETA {_duration(eta)}" if eta else ""
    rate = view.get("rate_bps") or 0
    return (f"[{'#' * filled}{'.' * (width - filled)}] {percent:5.1f}% "
            f"{bytes_text(view.get('done_bytes') or 0)}/"
            f"{bytes_text(view.get('total_bytes') or 0)} "
            f"{bytes_text(rate)}/s{shown_eta}  {view['activity']}: {view['message'][:60]}")


def _verdict_lines(verification: dict[str, Any]) -> list[str]:
    """The full verification's verdict first, one file a line: what the manifest expects,
    what was found, where the file was moved."""
    if verification["ok"]:
        return [f"verify --full: {verification['summary']}"]
    lines = [f"verify --full: FAILED: {verification['summary']}"]
    for m in verification["mismatches"]:
        lines.append(f"  {m['path']}")
        lines.append(f"    expected: {m['algorithm']} {m['expected']}")
        lines.append(f"    found:    {m['found']}")
        lines.append(f"    moved to: {m['moved_to'] or '(nothing to move)'}")
    return lines


def _stamp(iso: str) -> str:
    """A time from the JSON view as every weights message writes it (views.stamp)."""
    return stamp(dt.datetime.fromisoformat(iso))


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"


# --- export ---------------------------------------------------------------------------------


def export_manifest(args: argparse.Namespace, config: Config) -> int:
    if args.from_dir is not None:
        from appliance.weights.importer import manifest_from_dir

        repo = args.repo or config.weights_repo
        if (expected := check_repo_id(repo)):
            raise ApplianceError("weights_bad_input", f"--repo {repo!r} is not {expected}",
                                 "fix --repo", exit_code=EX_USAGE)
        manifest = manifest_from_dir(args.from_dir, repo,
                                     workers=config.weights.hash_workers)
    else:
        from appliance.db.database import Database
        from appliance.weights import records

        db = Database(config.database_url)
        try:
            set_id = db.call(lambda s: records.get_control(s).active_set_id)
            if set_id is None:
                raise ApplianceError("weights_no_manifest", "no weights manifest is recorded",
                                     "pull the weights first, or use --from-dir DIR on a "
                                     "trusted copy", exit_code=1)
            manifest = db.call(lambda s: records.load_manifest(s, set_id))
        finally:
            db.dispose()
    text = manifest.to_json()
    if args.out:
        from appliance.atomic import write_atomic

        write_atomic(args.out, text.encode())
        print(f"appliance: manifest of {manifest.repo_id}@{manifest.commit[:12]} "
              f"({len(manifest.files)} files) written to {args.out}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0
