"""The weights service: the daemon's one owner of the weights on disk and their records.

It runs one job at a time — pull, full verification, import — as an asyncio task, with the
wish written to the database first (`weights_control.job`), so a daemon killed mid-job picks
it up again on start, by itself. Progress lives in memory for the page (rates, ETAs) and is
written to the database every few seconds; verified files are written at once.

The engine asks `launch_verdict()` before every launch: the active set must be fully verified
(every file hashed against the manifest, once) and pass the quick tier now.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime as dt
import logging
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from appliance.clock import Clock
from appliance.config import Config
from appliance.db.database import Database
from appliance.db.journal import add_audit, add_event
from appliance.engine.args import model_dir
from appliance.errors import ApplianceError
from appliance.weights import records
from appliance.weights.live import LiveFile, RateMeter, eta
from appliance.weights.manifest import Manifest
from appliance.weights.quick import QuickReport, quick_verify
from appliance.weights.ram_plan import HostCache
from appliance.weights.records import active_set
from appliance.weights.views import (
    Activity,
    FileState,
    FileView,
    Verdict,
    VerifyOutcome,
    WeightsView,
    bytes_text,
    waiting_text,
)

log = logging.getLogger("appliance.weights")
PERSIST_SECONDS = 2.0
SPACE_RECHECK_SECONDS = 15.0


class JobBusy(ApplianceError):
    def __init__(self, job: str) -> None:
        super().__init__("weights_busy", f"a weights {job} is already running",
                         "wait for it, or cancel it first (`appliance weights cancel`)",
                         status=409)


class WeightsService:
    """See the module docstring. Construct cheaply; `start_service()` starts work."""

    def __init__(self, config: Config, db: Database, clock: Clock, *,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.config = config
        self.db = db
        self.clock = clock
        self._transport = transport
        self._executor: ThreadPoolExecutor | None = None
        self._task: asyncio.Task[None] | None = None
        self._persister: asyncio.Task[None] | None = None
        self._job = ""
        self._activity = Activity.IDLE
        self._message = "no job running"
        self._hint = ""
        self._live: dict[str, LiveFile] = {}
        self._live_set: int | None = None
        self._total_meter = RateMeter()
        self._quick: QuickReport | None = None
        self._quick_at: dt.datetime | None = None
        self._quick_set: int | None = None
        self._verification: VerifyOutcome | None = None
        self._verification_set: int | None = None
        self.on_ready: Callable[[], Awaitable[None]] | None = None
        # Called when a job ends, however it ends (build_runtime wires the health monitor's
        # weights check): the Dashboard and Health carry the job's verdict at once, not at
        # the check's next scheduled poll minutes later.
        self.on_job_end: Callable[[], Awaitable[object]] | None = None
        # An operator's new pull refuses outright when the volume is short; a pull resumed
        # after a restart (or short mid-way) waits for space instead.
        self._fresh = False
        self.space_recheck_seconds = SPACE_RECHECK_SECONDS  # how often a paused pull looks
        self._warm_at: float | None = None  # loop time of the last prewarm
        # The host cache a prefill box's next launch allocates (the tuning service sets it):
        # the prewarm states the RAM plan it implies (ram_plan.py).
        self.host_cache: Callable[[], Awaitable[HostCache | None]] | None = None

    # --- life -------------------------------------------------------------------------------

    @property
    def executor(self) -> ThreadPoolExecutor:
        if self._executor is None:
            workers = self.config.weights.concurrency + self.config.weights.hash_workers + 2
            self._executor = ThreadPoolExecutor(workers, thread_name_prefix="weights")
        return self._executor

    async def start_service(self) -> None:
        """Resume the job the database says should be running (a restart mid-pull)."""
        control = await self.db.run(records.get_control)
        if control.job:
            log.info("carrying on with the weights %s recorded by %s", control.job,
                     control.updated_by)
            await self.record_event("info", f"carrying on with the weights {control.job} recorded "
                                      f"by {control.updated_by} (the daemon started)")
            self.launch_job(control.job, control.job_args)
        self._persister = asyncio.create_task(self.persist_loop())

    async def stop_service(self) -> None:
        """Stop work without changing the wish: the next start resumes it."""
        for task in (self._task, self._persister):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        await self._persist()
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

    async def wait_idle(self) -> None:
        """Until no job runs (the CLI's local mode). A job may hand over to another (a full
        verification that found damage starts the pull of those files): wait for that too."""
        while self._task is not None and not self._task.done():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(self._task)

    async def wait_job(self) -> None:
        """Until the job running now ends, not any job it hands over to (the CLI's verify
        reports its own verdict; a refetch it started carries on, or resumes later)."""
        task = self._task
        if task is not None and not task.done():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(task)

    async def observed(self, holder: str) -> WeightsView:
        """The status as another process (a CLI pull holding the state directory) last
        wrote it: read-only, no job is started or changed here."""
        control = await self.db.run(records.get_control)
        if not control.job:
            return await self.status()
        self._job = control.job  # no disk look while that process moves files
        try:
            view = await self.status()
        finally:
            self._job = ""
        activity = {"pull": Activity.DOWNLOADING, "verify": Activity.VERIFYING,
                    "import": Activity.IMPORTING}.get(control.job, Activity.RESOLVING)
        return dataclasses.replace(
            view, activity=activity.value, rate_bps=0.0, eta_seconds=None,
            message=f"a weights {control.job} is running in another process (pid {holder}, "
            f"started by {control.updated_by}); the figures are as it last wrote them",
            hint="follow it where it runs, or cancel it there (Ctrl-C)")

    # --- commands ---------------------------------------------------------------------------

    async def pull(self, *, actor: str, repo: str | None = None, revision: str | None = None,
                   endpoint: str | None = None) -> WeightsView:
        """Start a pull. An endpoint given here is pinned to the job; without one the job
        uses `weights.endpoint` as configured when it (re)starts, so a pull resumed after
        the operator moved to another mirror goes there, not to the old one."""
        weights = self.config.weights
        args = {"repo": repo or self.config.weights_repo,
                "revision": revision or weights.revision,
                "endpoint": (endpoint or "").rstrip("/")}
        shown = args["endpoint"] or weights.endpoint.rstrip("/")
        await self._begin("pull", args, actor,
                          f"pull of {args['repo']}@{args['revision']} from {shown}")
        return await self.status()

    async def refetch(self, *, actor: str, via: str = "", handover: bool = False
                      ) -> WeightsView:
        """Fetch the active set's damaged or missing files again (a pull pinned to its
        commit: files still proven are kept), from the endpoint configured now. With `via`
        ("automatic", "cli") it is audited here; the console and the API audit their own
        requests. `handover`: called from the job now ending (a verification), which the
        new job replaces."""
        from appliance.weights.importer import refetchable

        record = await self.db.run(active_set)
        if record is None:
            raise _no_manifest()
        if not refetchable(record):
            raise ApplianceError(
                "weights_not_refetchable", f"{record.repo_id}@{record.commit[:12]} was "
                f"imported from {record.source}, which no Hub serves",
                "copy the damaged files again and re-run `appliance weights import`",
                status=409)
        endpoint = self.config.weights.endpoint.rstrip("/")
        await self._begin("pull", {"repo": record.repo_id, "revision": record.commit,
                                   "endpoint": ""}, actor,
                          f"refetch of the damaged files of {record.repo_id}@"
                          f"{record.commit[:12]} from {endpoint}", handover=handover)
        if via:
            at = self.clock.now()
            await self.db.run(lambda s: add_audit(
                s, at=at, actor=actor, action="weights.refetch", target=record.repo_id,
                detail={"via": via, "commit": record.commit, "endpoint": endpoint}))
        return await self.status()

    async def verify_full(self, *, actor: str, rehash: bool = False) -> WeightsView:
        control = await self.db.run(records.get_control)
        if control.active_set_id is None:
            raise _no_manifest()
        await self._begin("verify", {"rehash": rehash}, actor, "full verification")
        return await self.status()

    async def import_dir(self, directory: Path, *, actor: str,
                         manifest_file: Path | None = None) -> WeightsView:
        from appliance.weights.importer import check_import_dir

        await asyncio.to_thread(check_import_dir, directory, manifest_file)
        args = {"directory": str(directory),
                "manifest": str(manifest_file) if manifest_file else ""}
        await self._begin("import", args, actor, f"import from {directory}")
        return await self.status()

    async def cancel(self, *, actor: str) -> WeightsView:
        job = self._job
        now = self.clock.now()
        await self.db.run(lambda s: records.set_control(s, at=now, by=actor, job=""))
        if self._task is not None and not self._task.done():
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        self.set_activity(Activity.IDLE, f"{job or 'job'} cancelled by {actor}; partial "
                          "files are kept and a new pull resumes them")
        await self.record_event("info", f"weights {job or 'job'} cancelled by {actor}")
        await self._persist()
        await self._job_ended()
        return await self.status()

    async def quick_verify(self) -> QuickReport | None:
        """Run the quick tier on the active set now (well under a second)."""
        control = await self.db.run(records.get_control)
        if control.active_set_id is None:
            return None
        set_id = control.active_set_id
        manifest = await self.db.run(lambda s: records.load_manifest(s, set_id))
        report = await asyncio.to_thread(quick_verify, self.dir_for(manifest.repo_id), manifest)
        self._quick, self._quick_at, self._quick_set = report, self.clock.now(), set_id
        if not report.ok:
            bad = {p.path for p in report.problems}
            await self.db.run(lambda s: self._demote(s, set_id, bad, report))
        return report

    async def launch_verdict(self) -> Verdict:
        """For preflight: fully verified once, and the quick tier passes now."""
        engine_repo = self.config.engine.model
        record = await self.db.run(active_set)
        # A pull running here, or wished for and about to resume (the daemon starts the
        # engine's supervisor before this service picks its job up again).
        pulling = self._job == "pull" or (
            await self.db.run(records.get_control)).job == "pull"
        if record is None or record.repo_id != engine_repo:
            if pulling:
                return Verdict(None, "waiting for the weights: the pull is reading the file "
                               "list", "the engine starts by itself once they are proven",
                               waiting=True)
            return Verdict(None, f"no manifest of {engine_repo} is recorded, so the files "
                           "cannot be proven", "pull the weights (`appliance weights pull`), "
                           "or import a copy with its manifest (`appliance weights import DIR`)")
        if record.full_verified_at is None:
            if pulling:
                return Verdict(False, waiting_text(await self.status()),
                               "the engine starts by itself once they are proven",
                               waiting=True)
            files = await self.db.run(lambda s: records.set_files(s, record.id))
            pending = [f.path for f in files if f.state != FileState.VERIFIED]
            return Verdict(False, f"{len(pending)} of {len(files)} files of "
                           f"{engine_repo}@{record.commit[:12]} are not verified yet "
                           f"(e.g. {', '.join(pending[:3])})",
                           "let the pull finish, or run `appliance weights verify --full`")
        report = await self.quick_verify()
        if report is None or not report.ok:
            shown = "; ".join(f"{p.path}: {p.message}" for p in (report.problems if report
                                                                 else ())[:3])
            return Verdict(False, f"the quick check of the weights failed: {shown}",
                           "fetch the damaged files again (`appliance weights refetch`, "
                           "or re-import them), then start again")
        return Verdict(True, f"{engine_repo}@{record.commit[:12]} verified "
                       f"{record.full_verified_at:%Y-%m-%d %H:%M} UTC, quick check passed now")

    async def prewarm_for_launch(self, report: Callable[[str], None]) -> str | None:
        """Before a launch: the shards into the page cache when RAM allows (prewarm.py)."""
        from appliance.weights.prewarm import prewarm_for_launch

        return await prewarm_for_launch(self, report)

    def note_warm(self) -> None:
        """A full verification that kept its pages cached doubles as the prewarm."""
        self._warm_at = asyncio.get_running_loop().time()

    async def export_manifest(self) -> Manifest:
        control = await self.db.run(records.get_control)
        if control.active_set_id is None:
            raise _no_manifest()
        set_id = control.active_set_id
        return await self.db.run(lambda s: records.load_manifest(s, set_id))

    def note_verification(self, set_id: int | None, outcome: VerifyOutcome | None) -> None:
        """Keep the last full verification's verdict for the status (CLI, page, API); None
        once a pull has proven the set again."""
        self._verification, self._verification_set = outcome, set_id

    def dir_for(self, repo_id: str) -> Path:
        return model_dir(self.config.paths.models_dir, repo_id)

    # --- status -----------------------------------------------------------------------------

    async def status(self) -> WeightsView:
        record = await self.db.run(active_set)
        files = await self.db.run(lambda s: records.set_files(s, record.id)) if record else []
        now = asyncio.get_running_loop().time()
        live = self._live if record and self._live_set == record.id else {}
        views = []
        for f in files:
            item = live.get(f.path)
            if item is None:
                views.append(FileView(f.path, f.size, f.bytes_done, f.state, 0.0, None,
                                      f.attempts, f.last_error, f.verified_at))
                continue
            rate = item.meter.rate(now)
            views.append(FileView(f.path, f.size, item.bytes_done, item.shown_state(now), rate,
                                  eta(f.size - item.bytes_done, rate) if item.state ==
                                  FileState.DOWNLOADING else None, item.attempts,
                                  item.last_error, f.verified_at))
        done = sum(v.bytes_done for v in views)
        total = sum(v.size for v in views)
        rate = self._total_meter.rate(now) if self._activity not in (
            Activity.IDLE, Activity.FAILED) else 0.0
        quick = self._quick if record and self._quick_set == record.id else None
        # A cheap look at the disk (a stat per file) whenever no job is moving files, so a
        # shard deleted or replaced since it was proven never reads "ready".
        disk = (await asyncio.to_thread(disk_problems, self.dir_for(record.repo_id), files)
                if record and not self._job else ())
        ready = bool(record and record.full_verified_at and record.repo_id ==
                     self.config.engine.model and (quick is None or quick.ok) and not disk)
        verification = (self._verification if record and self._verification_set == record.id
                        else None)
        damaged = any(f.state in (FileState.FAILED, FileState.MISSING) for f in files)
        refetchable = bool(record and (damaged or disk) and _refetchable(record))
        return WeightsView(
            repo_id=record.repo_id if record else None,
            revision=record.revision if record else None,
            commit=record.commit if record else None,
            source=record.source if record else None,
            model_dir=str(self.dir_for(record.repo_id if record else self.config.weights_repo)),
            activity=self._activity.value, message=self._message, hint=self._hint,
            total_bytes=total, done_bytes=done, rate_bps=rate,
            eta_seconds=eta(total - done, rate) if rate else None,
            files=tuple(views), full_verified_at=record.full_verified_at if record else None,
            quick_checked_at=self._quick_at if quick else None,
            quick_ok=quick.ok if quick else None,
            quick_problems=tuple(f"{p.path}: {p.message}" for p in quick.problems)
            if quick else (), ready_for_engine=ready, job=self._job,
            verification=verification, disk_problems=disk, refetchable=refetchable)

    # --- job plumbing -----------------------------------------------------------------------

    async def _begin(self, job: str, args: dict[str, Any], actor: str, what: str, *,
                     handover: bool = False) -> None:
        # Busy while a job is named: a job that has finished (its verdict recorded, `job`
        # empty in the status) may still be telling `on_job_end`, and is no reason to refuse.
        if not handover and self._job and self._task is not None and not self._task.done():
            raise JobBusy(self._job)
        now = self.clock.now()
        await self.db.run(lambda s: records.set_control(s, at=now, by=actor, job=job,
                                                        job_args=args))
        await self.record_event("info", f"weights {what} requested by {actor}")
        self._fresh = True
        self.launch_job(job, args)

    def launch_job(self, job: str, args: dict[str, Any]) -> None:
        runners = {"pull": self._run_pull, "verify": self._run_verify,
                   "import": self._run_import}
        if job not in runners:
            log.warning("ignoring unknown weights job %r in the database", job)
            return
        self._job = job
        # The status says what starts at once, so a caller polling right after never sees
        # "idle" for a job it just started.
        first = {"pull": Activity.RESOLVING, "verify": Activity.VERIFYING,
                 "import": Activity.IMPORTING}[job]
        self.set_activity(first, f"starting the {job}")
        self._task = asyncio.create_task(self._guard(job, runners[job](args)))

    async def _guard(self, job: str, work: Awaitable[None]) -> None:
        """Run a job; its end (success, failure, cancel) is recorded, never raised."""
        try:
            await work
        except asyncio.CancelledError:
            raise
        except ApplianceError as exc:
            await self.finish_job(failed=f"{exc.message}", hint=exc.hint)
        except Exception as exc:
            log.exception("weights %s failed", job)
            await self.finish_job(failed=f"{type(exc).__name__}: {exc}",
                                  hint="see the daemon log; the job can be started again")
        finally:
            await self._persist()

    async def finish_job(self, *, failed: str | None = None, hint: str = "",
                         message: str = "") -> None:
        # The records are final here: the check is judged again before the job reads ended,
        # so whoever sees the job's end (page, API, CLI) sees the check's new verdict too.
        await self._job_ended()
        now = self.clock.now()
        await self.db.run(lambda s: records.set_control(s, at=now, by="weights", job=""))
        job, self._job = self._job, ""
        if failed:
            self.set_activity(Activity.FAILED, f"{job} failed: {failed}", hint)
            await self.record_event("error", f"weights {job} failed: {failed}")
        else:
            self.set_activity(Activity.IDLE, message)
            await self.record_event("info", f"weights {job} finished: {message}")

    async def _job_ended(self) -> None:
        """Tell `on_job_end` (the health check) the records changed; its failure is logged,
        never the job's."""
        if self.on_job_end is None:
            return
        try:
            await self.on_job_end()
        except Exception:
            log.exception("could not re-judge the weights check after a job")

    def set_activity(self, activity: Activity, message: str, hint: str = "") -> None:
        self._activity, self._message, self._hint = activity, message, hint
        if activity in (Activity.IDLE, Activity.FAILED):
            self._settle()

    def _settle(self) -> None:
        """No job runs: files caught mid-flight are queued again (their .part stays), and no
        rate or ETA is shown for them."""
        in_flight = (FileState.DOWNLOADING, FileState.STALLED, FileState.RETRYING,
                     FileState.VERIFYING)
        for live in self._live.values():
            if live.state in in_flight:
                live.state, live.dirty = FileState.QUEUED.value, True
            live.meter.reset()
        self._total_meter.reset()

    # --- the jobs (pull.py, importer.py) -------------------------------------------------------

    async def _run_pull(self, args: dict[str, Any]) -> None:
        from appliance.weights.pull import run_pull

        await run_pull(self, args)

    async def _run_verify(self, args: dict[str, Any]) -> None:
        from appliance.weights.importer import run_full_verify

        await run_full_verify(self, rehash=bool(args.get("rehash")))

    async def _run_import(self, args: dict[str, Any]) -> None:
        from appliance.weights.importer import run_import

        manifest = Path(args["manifest"]) if args.get("manifest") else None
        await run_import(self, Path(args["directory"]), manifest)

    # --- helpers shared with importer.py ----------------------------------------------------

    def _demote(self, session: Any, set_id: int, paths: set[str], report: QuickReport) -> None:
        """Files the quick tier found damaged are unverified again, and so is the set."""
        for problem in report.problems:
            if problem.path in paths:
                with contextlib.suppress(Exception):
                    records.update_file(session, set_id, problem.path,
                                        state=FileState.FAILED.value, verified_at=None,
                                        verified_size=None, verified_mtime_ns=None,
                                        last_error=problem.message[:500])
        records.set_full_verified(session, set_id, None)

    async def record_event(self, severity: str, message: str) -> None:
        at = self.clock.now()
        await self.db.run(lambda s: add_event(s, at=at, severity=severity, source="weights",
                                              message=message))

    async def persist_loop(self) -> None:
        while True:
            await asyncio.sleep(PERSIST_SECONDS)
            try:
                await self._persist()
            except Exception:
                log.exception("cannot write weights progress")

    async def _persist(self) -> None:
        set_id = self._live_set
        if set_id is None:
            return
        changes = {path: {"bytes_done": live.bytes_done, "attempts": live.attempts,
                          "last_error": live.last_error[:500],
                          "state": live.state if live.state in (
                              FileState.VERIFIED, FileState.FAILED, FileState.MISSING)
                          else FileState.QUEUED.value}
                   for path, live in self._live.items() if live.dirty}
        if not changes:
            return
        for path in changes:
            self._live[path].dirty = False
        await self.db.run(lambda s: records.update_files(s, set_id, changes))

    def live_file(self, path: str) -> LiveFile | None:
        return self._live.get(path)

    def note_total(self) -> None:
        """Sample the total for the overall rate (bytes of every file of the set)."""
        now = asyncio.get_running_loop().time()
        self._total_meter.add(now, sum(f.bytes_done for f in self._live.values()))


def _refetchable(record: records.SetRecord) -> bool:
    from appliance.weights.importer import refetchable

    return refetchable(record)


def disk_problems(model_dir: Path, files: list[records.FileRecord]) -> tuple[str, ...]:
    """Files recorded verified that are gone or have another size now: one stat each, cheap
    enough for every status read. Blocking."""
    problems = []
    for f in files:
        if f.state != FileState.VERIFIED:
            continue
        try:
            size = (model_dir / f.path).stat().st_size
        except OSError:
            problems.append(f"{f.path} is missing from {model_dir}")
            continue
        if size != f.size:
            problems.append(f"{f.path} is {bytes_text(size)} on disk, the manifest says "
                            f"{bytes_text(f.size)}")
    return tuple(problems)


def _no_manifest() -> ApplianceError:
    return ApplianceError("weights_no_manifest", "no weights manifest is recorded yet",
                          "pull the weights first (`appliance weights pull`), or import a "
                          "copy with its manifest (`appliance weights import DIR`)",
                          status=409)
