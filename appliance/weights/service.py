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
import datetime as dt
import logging
import os
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import psutil

from appliance.clock import Clock
from appliance.config import Config
from appliance.db.database import Database
from appliance.db.journal import add_event
from appliance.engine.args import model_dir
from appliance.errors import ApplianceError
from appliance.weights import records
from appliance.weights.downloader import (
    DiskFull,
    RateLimiter,
    Transfer,
    TransferFailed,
    TransferPolicy,
    part_path,
)
from appliance.weights.live import LiveFile, RateMeter, eta
from appliance.weights.manifest import Manifest, Needs, needs, space_problem
from appliance.weights.quick import QuickReport, quick_verify
from appliance.weights.sources import HubSource, SourceError
from appliance.weights.views import Activity, FileState, FileView, Verdict, WeightsView

log = logging.getLogger("appliance.weights")
PERSIST_SECONDS = 2.0
SPACE_RECHECK_SECONDS = 15.0
WARM_FOR_SECONDS = 600.0  # a prewarm (or a full verification keeping pages) this recent counts


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
        self.on_ready: Callable[[], Awaitable[None]] | None = None
        # An operator's new pull refuses outright when the volume is short; a pull resumed
        # after a restart (or short mid-way) waits for space instead.
        self._fresh = False
        self.space_recheck_seconds = SPACE_RECHECK_SECONDS  # how often a paused pull looks
        self._warm_at: float | None = None  # loop time of the last prewarm

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
            await self._event("info", f"carrying on with the weights {control.job} recorded "
                                      f"by {control.updated_by} (the daemon started)")
            self._launch(control.job, control.job_args)
        self._persister = asyncio.create_task(self._persist_loop())

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

    # --- commands ---------------------------------------------------------------------------

    async def pull(self, *, actor: str, repo: str | None = None, revision: str | None = None,
                   endpoint: str | None = None) -> WeightsView:
        weights = self.config.weights
        args = {"repo": repo or self.config.weights_repo,
                "revision": revision or weights.revision,
                "endpoint": (endpoint or weights.endpoint).rstrip("/")}
        await self._begin("pull", args, actor,
                          f"pull of {args['repo']}@{args['revision']} from {args['endpoint']}")
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
        self._set_activity(Activity.IDLE, f"{job or 'job'} cancelled by {actor}; partial "
                           "files are kept and a new pull resumes them")
        await self._event("info", f"weights {job or 'job'} cancelled by {actor}")
        await self._persist()
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
        record = await self.db.run(_active_set)
        if record is None or record.repo_id != engine_repo:
            return Verdict(None, f"no manifest of {engine_repo} is recorded, so the files "
                           "cannot be proven", "pull the weights (`appliance weights pull`), "
                           "or import a copy with its manifest (`appliance weights import DIR`)")
        if record.full_verified_at is None:
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
                           "the damaged files were marked for download; run `appliance "
                           "weights pull` (or re-import them), then start again")
        return Verdict(True, f"{engine_repo}@{record.commit[:12]} verified "
                       f"{record.full_verified_at:%Y-%m-%d %H:%M} UTC, quick check passed now")

    async def prewarm_for_launch(self, report: Callable[[str], None]) -> str | None:
        """Before a launch: read every shard into the page cache, in parallel, so the
        engine's 80-minute load reads memory rather than disk. Only when weights.prewarm is
        on and host RAM is at least 1.25 times the model (the B300 box has 3 TiB for 1.56 TB);
        skipped right after a full verification that kept the pages. `report` gets a line
        every second; the result (GB and GB/s) is returned and recorded as an event."""
        from appliance.weights.hashing import prewarm, should_prewarm
        from appliance.weights.importer import in_thread

        record = await self.db.run(_active_set)
        if not self.config.weights.prewarm or record is None:
            return None
        memory = (await asyncio.to_thread(psutil.virtual_memory)).total
        if not should_prewarm(record.total_bytes, memory):
            return None
        loop = asyncio.get_running_loop()
        if self._warm_at is not None and loop.time() - self._warm_at < WARM_FOR_SECONDS:
            return None
        files = await self.db.run(lambda s: records.set_files(s, record.id))
        paths = [self.dir_for(record.repo_id) / f.path for f in files]
        total = sum(f.size for f in files)
        done = [0]
        started = loop.time()

        def count(nbytes: int) -> None:  # from worker threads; a list cell, summed loosely
            done[0] += nbytes

        async def narrate() -> None:
            while True:
                await asyncio.sleep(1.0)
                rate = done[0] / max(loop.time() - started, 1e-6)
                report(f"warming the page cache: {100 * done[0] / max(total, 1):.0f}% of "
                       f"{total / 1e9:.1f} GB at {rate / 1e9:.2f} GB/s")

        narrator = asyncio.create_task(narrate())
        try:
            result = await in_thread(self, lambda cancel: prewarm(
                paths, workers=self.config.weights.hash_workers, on_progress=count,
                cancel=cancel))
        finally:
            narrator.cancel()
        self._warm_at = loop.time()
        rate = result.bytes_read / max(result.seconds, 1e-6)
        message = (f"page cache warmed before the launch: {result.bytes_read / 1e9:.2f} GB in "
                   f"{result.seconds:.1f} s ({rate / 1e9:.2f} GB/s)")
        await self._event("info", message)
        return message

    def note_warm(self) -> None:
        """A full verification that kept its pages cached doubles as the prewarm."""
        self._warm_at = asyncio.get_running_loop().time()

    async def export_manifest(self) -> Manifest:
        control = await self.db.run(records.get_control)
        if control.active_set_id is None:
            raise _no_manifest()
        set_id = control.active_set_id
        return await self.db.run(lambda s: records.load_manifest(s, set_id))

    def dir_for(self, repo_id: str) -> Path:
        return model_dir(self.config.paths.models_dir, repo_id)

    # --- status -----------------------------------------------------------------------------

    async def status(self) -> WeightsView:
        record = await self.db.run(_active_set)
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
        ready = bool(record and record.full_verified_at and record.repo_id ==
                     self.config.engine.model and (quick is None or quick.ok))
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
            if quick else (), ready_for_engine=ready)

    # --- job plumbing -----------------------------------------------------------------------

    async def _begin(self, job: str, args: dict[str, Any], actor: str, what: str) -> None:
        if self._task is not None and not self._task.done():
            raise JobBusy(self._job)
        now = self.clock.now()
        await self.db.run(lambda s: records.set_control(s, at=now, by=actor, job=job,
                                                        job_args=args))
        await self._event("info", f"weights {what} requested by {actor}")
        self._fresh = True
        self._launch(job, args)

    def _launch(self, job: str, args: dict[str, Any]) -> None:
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
        self._set_activity(first, f"starting the {job}")
        self._task = asyncio.create_task(self._guard(job, runners[job](args)))

    async def _guard(self, job: str, work: Awaitable[None]) -> None:
        """Run a job; its end (success, failure, cancel) is recorded, never raised."""
        try:
            await work
        except asyncio.CancelledError:
            raise
        except ApplianceError as exc:
            await self._finish_job(failed=f"{exc.message}", hint=exc.hint)
        except Exception as exc:
            log.exception("weights %s failed", job)
            await self._finish_job(failed=f"{type(exc).__name__}: {exc}",
                                   hint="see the daemon log; the job can be started again")
        finally:
            await self._persist()

    async def _finish_job(self, *, failed: str | None = None, hint: str = "",
                          message: str = "") -> None:
        now = self.clock.now()
        await self.db.run(lambda s: records.set_control(s, at=now, by="weights", job=""))
        job, self._job = self._job, ""
        if failed:
            self._set_activity(Activity.FAILED, f"{job} failed: {failed}", hint)
            await self._event("error", f"weights {job} failed: {failed}")
        else:
            self._set_activity(Activity.IDLE, message)
            await self._event("info", f"weights {job} finished: {message}")

    def _set_activity(self, activity: Activity, message: str, hint: str = "") -> None:
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

    # --- pull -------------------------------------------------------------------------------

    async def _run_pull(self, args: dict[str, Any]) -> None:
        repo, revision, endpoint = args["repo"], args["revision"], args["endpoint"]
        source = HubSource(endpoint, repo, self._token())
        async with self._client() as client:
            manifest = await self._resolve(client, source, repo, revision)
            record = await self._adopt_manifest(manifest, source.description)
            await self._download_all(client, source, record, manifest)

    def _token(self) -> str:
        weights = self.config.weights
        if weights.token:
            return weights.token
        if weights.token_file is not None:
            try:
                return weights.token_file.read_text().strip()
            except OSError as exc:
                raise ApplianceError(
                    "weights_token_unreadable", f"cannot read weights.token_file "
                    f"{weights.token_file}: {exc.strerror or exc}",
                    "make the file readable by the appliance user (mode 0600)") from None
        return ""

    def _client(self) -> httpx.AsyncClient:
        limits = httpx.Limits(max_connections=self.config.weights.concurrency + 4,
                              max_keepalive_connections=self.config.weights.concurrency)
        return httpx.AsyncClient(transport=self._transport, limits=limits, max_redirects=5)

    async def _resolve(self, client: httpx.AsyncClient, source: HubSource, repo: str,
                       revision: str) -> Manifest:
        """The manifest, retried (with backoff) for as long as the source fails transiently."""
        known = await self.db.run(lambda s: _stored_manifest(s, repo, revision))
        if known is not None:
            return known  # a pinned commit already recorded: no network needed
        policy = TransferPolicy.from_config(self.config.weights)
        failures = 0
        while True:
            self._set_activity(Activity.RESOLVING, f"reading the file list of {repo}@{revision} "
                               f"from {source.endpoint}")
            try:
                return await source.manifest(client, repo, revision)
            except SourceError as exc:
                if not exc.retryable:
                    raise
                failures += 1
                delay = policy.backoff(failures)
                self._set_activity(Activity.RESOLVING, f"retrying in {delay:.0f} s: "
                                   f"{exc.message}", exc.hint)
                await self._event("warning", f"weights manifest: {exc.message}; retry "
                                  f"{failures} in {delay:.0f} s")
                await asyncio.sleep(delay)

    async def _adopt_manifest(self, manifest: Manifest, source: str) -> records.SetRecord:
        now = self.clock.now()

        def store(s: Any) -> records.SetRecord:
            record = records.store_manifest(s, manifest, source, now)
            records.set_control(s, at=now, by="weights", active_set_id=record.id)
            return record

        record = await self.db.run(store)
        await self._event("info", f"weights manifest of {manifest.repo_id}@"
                          f"{manifest.commit[:12]}: {len(manifest.files)} files, "
                          f"{manifest.total_bytes / 1e9:.2f} GB")
        return record

    async def _download_all(self, client: httpx.AsyncClient, source: HubSource,
                            record: records.SetRecord, manifest: Manifest) -> None:
        target_dir = self.dir_for(manifest.repo_id)
        while True:
            pending = await self._reconcile(record, manifest, target_dir)
            if not pending:
                break
            if not await self._space_ok(manifest, target_dir):
                continue
            self._set_activity(Activity.DOWNLOADING, f"downloading {len(pending)} files of "
                               f"{manifest.repo_id}@{manifest.commit[:12]} from {source.endpoint}")
            try:
                await self._transfers(client, source, record, manifest, pending, target_dir)
            except DiskFull as exc:
                await self._event("error", f"weights pull paused: {exc.message}")
                self._set_activity(Activity.PAUSED, exc.message, exc.hint)
                await asyncio.sleep(self.space_recheck_seconds)
        await self._complete(record, manifest)

    async def _transfers(self, client: httpx.AsyncClient, source: HubSource,
                         record: records.SetRecord, manifest: Manifest, pending: list[str],
                         target_dir: Path) -> None:
        weights = self.config.weights
        policy = TransferPolicy.from_config(weights)
        limiter = RateLimiter(weights.bandwidth_limit_mib_s * 1024 * 1024)
        slots = asyncio.Semaphore(weights.concurrency)
        listener = _Listener(self, record.id)
        failed: list[str] = []

        async def one(path: str) -> None:
            item = manifest.file(path)
            assert item is not None
            async with slots:
                transfer = Transfer(client, source, manifest.commit, item, target_dir / path,
                                    policy, limiter, listener, self.executor)
                try:
                    await transfer.run()
                except TransferFailed as exc:
                    failed.append(path)
                    listener.failed(path, exc.message)
                    await self._event("error", f"weights: {path}: {exc.message}")

        try:
            async with asyncio.TaskGroup() as group:  # one failure stops the others
                for path in pending:
                    group.create_task(one(path))
        except* DiskFull as full:  # pauses the whole pull (the caller waits for space)
            raise full.exceptions[0] from None
        except* Exception as other:
            raise other.exceptions[0] from None
        if failed:
            raise TransferFailed(f"{len(failed)} file(s) could not be fetched: "
                                 f"{', '.join(failed[:5])}",
                                 "see each file's error on the Weights page; fix the cause and "
                                 "pull again (finished files are kept)")

    async def _space_ok(self, manifest: Manifest, target_dir: Path) -> bool:
        """True when the volume can take the rest; otherwise PAUSED for a while (False)."""
        need, free = await asyncio.to_thread(self._needs, manifest, target_dir)
        problem = space_problem(need, free, self.config.weights.reserve_gib << 30)
        fresh, self._fresh = self._fresh, False
        if problem is None:
            return True
        if fresh:
            raise ApplianceError("weights_disk_short", f"not starting the pull: {problem}",
                                 "free space on the models volume (old revisions, stray "
                                 "files) or lower weights.reserve_gib, then pull again",
                                 status=507)
        if self._activity != Activity.PAUSED:
            await self._event("error", f"weights pull paused: {problem}")
        self._set_activity(Activity.PAUSED, problem, "free space on the models volume (or "
                           "lower weights.reserve_gib); the pull resumes by itself")
        await asyncio.sleep(self.space_recheck_seconds)
        return False

    def _needs(self, manifest: Manifest, target_dir: Path) -> tuple[Needs, int]:
        verified = {p for p, live in self._live.items() if live.state == FileState.VERIFIED}
        partials = {}
        for item in manifest.files:
            with contextlib.suppress(OSError):
                partials[item.path] = part_path(target_dir / item.path).stat().st_size
        return needs(manifest, verified, partials), free_bytes(target_dir)

    async def _complete(self, record: records.SetRecord, manifest: Manifest) -> None:
        from appliance.weights.importer import remove_quarantine

        await asyncio.to_thread(remove_quarantine, self.dir_for(manifest.repo_id))
        now = self.clock.now()
        await self.db.run(lambda s: records.set_full_verified(s, record.id, now))
        report = await self.quick_verify()
        if report is not None and not report.ok:
            raise ApplianceError("weights_quick_failed", "every file matched its hash but the "
                                 "checkpoint's structure check failed: " + "; ".join(
                                     f"{p.path}: {p.message}" for p in report.problems[:3]),
                                 "the source publishes a broken checkpoint; report it upstream")
        await self._finish_job(message=f"{manifest.repo_id}@{manifest.commit[:12]}: all "
                               f"{len(manifest.files)} files verified "
                               f"({manifest.total_bytes / 1e9:.2f} GB)")
        if self.on_ready is not None:
            await self.on_ready()

    # --- reconcile what is on disk with the records ---------------------------------------

    async def _reconcile(self, record: records.SetRecord, manifest: Manifest,
                         target_dir: Path) -> list[str]:
        """Files still to fetch. A file recorded verified stays so while its size and mtime
        are unchanged; a file present but unproven (a copy, an older commit's identical file)
        is hashed and adopted when it matches; anything else is queued."""
        from appliance.weights.importer import adopt_in_place

        files = await self.db.run(lambda s: records.set_files(s, record.id))
        self._live_set = record.id
        self._live = {f.path: LiveFile(size=f.size, state=f.state, bytes_done=f.bytes_done,
                                       attempts=f.attempts, last_error=f.last_error)
                      for f in files}
        self._set_activity(Activity.VERIFYING, "checking the files already on disk")
        results = await adopt_in_place(self, record.id, files, target_dir)
        return [f.path for f in files if not results.get(f.path)]

    # --- verify and import -------------------------------------------------------------------

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

    async def _event(self, severity: str, message: str) -> None:
        at = self.clock.now()
        await self.db.run(lambda s: add_event(s, at=at, severity=severity, source="weights",
                                              message=message))

    async def _persist_loop(self) -> None:
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


class _Listener:
    """Transfer callbacks → live progress, events and the verified records."""

    def __init__(self, service: WeightsService, set_id: int) -> None:
        self.service = service
        self.set_id = set_id

    def _live(self, path: str) -> LiveFile:
        live = self.service.live_file(path)
        assert live is not None, path
        return live

    def on_state(self, path: str, state: str) -> None:
        live = self._live(path)
        live.state, live.dirty = state, True
        if state == FileState.DOWNLOADING:
            live.last_progress = asyncio.get_running_loop().time()

    def on_bytes(self, path: str, bytes_done: int) -> None:
        now = asyncio.get_running_loop().time()
        self._live(path).progress(now, bytes_done)
        self.service.note_total()

    def on_retry(self, path: str, attempt: int, error: str, delay: float) -> None:
        live = self._live(path)
        live.state, live.attempts, live.last_error, live.dirty = (
            FileState.RETRYING.value, attempt, error, True)
        live.meter.reset()
        message = f"weights: {path}: {error}; retry {attempt} in {delay:.0f} s"
        log.warning("%s", message)
        task = asyncio.ensure_future(self.service._event("warning", message))
        task.add_done_callback(_ignore_result)

    def on_verified(self, path: str) -> None:
        live = self._live(path)
        live.state, live.bytes_done, live.last_error, live.dirty = (
            FileState.VERIFIED.value, live.size, "", True)
        task = asyncio.ensure_future(mark_verified(self.service, self.set_id, path))
        task.add_done_callback(_ignore_result)

    def failed(self, path: str, error: str) -> None:
        live = self._live(path)
        live.state, live.last_error, live.dirty = FileState.FAILED.value, error, True


def _ignore_result(task: asyncio.Future[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("weights bookkeeping failed: %s", task.exception())


async def mark_verified(service: WeightsService, set_id: int, path: str) -> None:
    """Record a file as proven, with the size and mtime it was proven at."""
    record = await service.db.run(lambda s: records.get_set(s, set_id))
    assert record is not None
    target = service.dir_for(record.repo_id) / path
    stat = await asyncio.to_thread(target.stat)
    now = service.clock.now()
    await service.db.run(lambda s: records.update_file(
        s, set_id, path, state=FileState.VERIFIED.value, bytes_done=stat.st_size,
        verified_at=now, verified_size=stat.st_size, verified_mtime_ns=stat.st_mtime_ns,
        last_error=""))


def free_bytes(path: Path) -> int:
    """Free bytes for unprivileged writers on the volume of `path` (or its nearest parent)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    usage = os.statvfs(path)
    return usage.f_bavail * usage.f_frsize


def _active_set(session: Any) -> records.SetRecord | None:
    set_id = records.get_control(session).active_set_id
    return records.get_set(session, set_id) if set_id is not None else None


def _stored_manifest(session: Any, repo: str, revision: str) -> Manifest | None:
    for record in records.list_sets(session):
        if record.repo_id == repo and record.commit == revision:
            return records.load_manifest(session, record.id)
    return None


def _no_manifest() -> ApplianceError:
    return ApplianceError("weights_no_manifest", "no weights manifest is recorded yet",
                          "pull the weights first (`appliance weights pull`), or import a "
                          "copy with its manifest (`appliance weights import DIR`)",
                          status=409)
