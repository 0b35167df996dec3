"""The pull job: resolve the manifest, adopt what is on disk, fetch the rest, prove the set.

Functions over the `WeightsService` (its state, events and executor); the service starts them
as its "pull" job. Transfers run `weights.concurrency` at a time; a full disk pauses the whole
pull until space is back; a refusal that waiting cannot fix fails that file with its reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from appliance.errors import ApplianceError
from appliance.volumes import nearest_existing
from appliance.weights import records
from appliance.weights.downloader import (
    DiskFull,
    Transfer,
    TransferFailed,
    TransferPolicy,
    part_path,
)
from appliance.weights.fetch import UNREACHABLE, Throttle
from appliance.weights.live import LiveFile
from appliance.weights.manifest import Manifest, Needs, needs, space_problem
from appliance.weights.proven import adopt_manifest, complete, mark_verified
from appliance.weights.sources import HubSource, SourceError
from appliance.weights.views import Activity, FileState

if TYPE_CHECKING:
    from appliance.weights.service import WeightsService

log = logging.getLogger("appliance.weights")


async def run_pull(service: WeightsService, args: dict[str, Any]) -> None:
    # An endpoint pinned by the request, else the one configured now (never the one the set
    # was first pulled from: a refetch after a move to another mirror goes to the new one).
    repo, revision = args["repo"], args["revision"]
    endpoint = (args.get("endpoint") or service.config.weights.endpoint).rstrip("/")
    source = HubSource(endpoint, repo, _token(service))
    async with _client(service) as client:
        manifest = await _resolve(service, client, source, repo, revision)
        record = await adopt_manifest(service, manifest, source.description)
    await _download_all(service, source, record, manifest)


def _token(service: WeightsService) -> str:
    weights = service.config.weights
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


def _client(service: WeightsService) -> httpx.AsyncClient:
    """For the metadata calls; the files themselves go through fetch.py's threads."""
    return httpx.AsyncClient(transport=service._transport, max_redirects=5)


async def _resolve(service: WeightsService, client: httpx.AsyncClient, source: HubSource, repo: str,
                   revision: str) -> Manifest:
    """The manifest, retried (with backoff) for as long as the source fails transiently."""
    known = await service.db.run(lambda s: _stored_manifest(s, repo, revision))
    if known is not None:
        return known  # a pinned commit already recorded: no network needed
    policy = TransferPolicy.from_config(service.config.weights)
    failures = 0
    while True:
        service.set_activity(Activity.RESOLVING, f"reading the file list of {repo}@{revision} "
                             f"from {source.endpoint}")
        try:
            return await source.manifest(client, repo, revision)
        except SourceError as exc:
            if not exc.retryable:
                raise
            failures += 1
            delay = policy.backoff(failures)
            # One clear job-level line: what cannot be reached and when the next try is.
            service.set_activity(Activity.PAUSED if exc.message.startswith(UNREACHABLE)
                                 else Activity.RESOLVING, f"{exc.message}; next try in "
                                 f"{delay:.0f} s (attempt {failures + 1}; retrying until it "
                                 "answers or the pull is cancelled)", exc.hint)
            await service.record_event("warning", f"weights manifest: {exc.message}; retry "
                                       f"{failures} in {delay:.0f} s")
            await asyncio.sleep(delay)


async def _download_all(service: WeightsService, source: HubSource,
                        record: records.SetRecord, manifest: Manifest) -> None:
    target_dir = service.dir_for(manifest.repo_id)
    while True:
        pending = await _reconcile(service, record, manifest, target_dir)
        if not pending:
            break
        if not await _space_ok(service, manifest, target_dir):
            continue
        service.set_activity(
            Activity.DOWNLOADING, f"downloading {len(pending)} files of "
            f"{manifest.repo_id}@{manifest.commit[:12]} from {source.endpoint}")
        try:
            await _transfers(service, source, record, manifest, pending, target_dir)
        except DiskFull as exc:
            await service.record_event("error", f"weights pull paused: {exc.message}")
            service.set_activity(Activity.PAUSED, exc.message, exc.hint)
            await asyncio.sleep(service.space_recheck_seconds)
    await complete(service, record, manifest)


async def _transfers(service: WeightsService, source: HubSource,
                     record: records.SetRecord, manifest: Manifest, pending: list[str],
                     target_dir: Path) -> None:
    weights = service.config.weights
    policy = TransferPolicy.from_config(weights)
    throttle = Throttle(weights.bandwidth_limit_mib_s * 1024 * 1024)
    slots = asyncio.Semaphore(weights.concurrency)
    listener = _Listener(service, record.id)
    failed: list[str] = []

    async def one(path: str) -> None:
        item = manifest.file(path)
        assert item is not None
        async with slots:
            transfer = Transfer(source, manifest.commit, item, target_dir / path, policy,
                                throttle, listener, service.executor)
            try:
                await transfer.run()
            except TransferFailed as exc:
                failed.append(path)
                listener.failed(path, exc.message)
                await service.record_event("error", f"weights: {path}: {exc.message}")

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


async def _space_ok(service: WeightsService, manifest: Manifest, target_dir: Path) -> bool:
    """True when the volume can take the rest; otherwise PAUSED for a while (False)."""
    need, free = await asyncio.to_thread(_needs, service, manifest, target_dir)
    problem = space_problem(need, free, service.config.weights.reserve_gib << 30)
    fresh, service._fresh = service._fresh, False
    if problem is None:
        return True
    if fresh:
        raise ApplianceError("weights_disk_short", f"not starting the pull: {problem}",
                             "free space on the models volume (old revisions, stray "
                             "files) or lower weights.reserve_gib, then pull again",
                             status=507)
    if service._activity != Activity.PAUSED:
        await service.record_event("error", f"weights pull paused: {problem}")
    service.set_activity(Activity.PAUSED, problem, "free space on the models volume (or "
                         "lower weights.reserve_gib); the pull resumes by itself")
    await asyncio.sleep(service.space_recheck_seconds)
    return False


def _needs(service: WeightsService, manifest: Manifest, target_dir: Path) -> tuple[Needs, int]:
    verified = {p for p, live in service._live.items() if live.state == FileState.VERIFIED}
    partials = {}
    for item in manifest.files:
        with contextlib.suppress(OSError):
            partials[item.path] = part_path(target_dir / item.path).stat().st_size
    return needs(manifest, verified, partials), free_bytes(target_dir)


# --- reconcile what is on disk with the records ------------------------------------------------


async def _reconcile(service: WeightsService, record: records.SetRecord, manifest: Manifest,
                     target_dir: Path) -> list[str]:
    """Files still to fetch. A file recorded verified stays so while its size and mtime
    are unchanged; a file present but unproven (a copy, an older commit's identical file)
    is hashed and adopted when it matches; anything else is queued."""
    from appliance.weights.importer import adopt_in_place

    files = await service.db.run(lambda s: records.set_files(s, record.id))
    service._live_set = record.id
    service._live = {f.path: LiveFile(size=f.size, state=f.state, bytes_done=f.bytes_done,
                                      attempts=f.attempts, last_error=f.last_error)
                     for f in files}
    service.set_activity(Activity.VERIFYING, "checking the files already on disk")
    results = await adopt_in_place(service, record.id, files, target_dir)
    return [f.path for f in files if not results.get(f.path)]


class _Listener:
    """Transfer callbacks → live progress, events and the verified records."""

    def __init__(self, service: WeightsService, set_id: int) -> None:
        self.service = service
        self.set_id = set_id
        self.message = service._message  # the job's line while bytes flow
        self.unreachable: set[str] = set()  # files whose last try could not connect

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
        live = self._live(path)
        moved = bytes_done > live.bytes_done
        live.progress(now, bytes_done)
        self.service.note_total()
        if moved and path in self.unreachable:
            self.unreachable.discard(path)
            if self.service._activity == Activity.PAUSED:
                self.service.set_activity(Activity.DOWNLOADING, self.message)

    def on_retry(self, path: str, attempt: int, error: str, delay: float) -> None:
        live = self._live(path)
        live.state, live.attempts, live.last_error, live.dirty = (
            FileState.RETRYING.value, attempt, error, True)
        live.meter.reset()
        if error.startswith(UNREACHABLE):
            # The source, not this file: say it once for the job, not as a table of errors.
            self.unreachable.add(path)
            self.service.set_activity(
                Activity.PAUSED, f"{error}; next try in {delay:.0f} s (retrying until it "
                "answers or the pull is cancelled)", "check the network, a proxy, or "
                "weights.endpoint (another mirror: change it and run `appliance weights "
                "refetch`, or pull again)")
        elif path in self.unreachable:
            self.unreachable.discard(path)
        message = f"weights: {path}: {error}; retry {attempt} in {delay:.0f} s"
        log.warning("%s", message)
        task = asyncio.ensure_future(self.service.record_event("warning", message))
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


def free_bytes(path: Path) -> int:
    """Free bytes for unprivileged writers on the volume of `path` (or its nearest parent)."""
    usage = os.statvfs(nearest_existing(path))
    return usage.f_bavail * usage.f_frsize


def _stored_manifest(session: Any, repo: str, revision: str) -> Manifest | None:
    for record in records.list_sets(session):
        if record.repo_id == repo and record.commit == revision:
            return records.load_manifest(session, record.id)
    return None
