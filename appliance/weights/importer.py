"""The jobs that read files already on disk: adoption, full verification, import.

- Adoption (the start of every pull): a file recorded verified stays verified while its size
  and mtime are unchanged; a file present but unproven is hashed and kept if it matches; a
  mismatch is quarantined, so only that file is fetched again.
- Full verification: sha256 (or the git blob id) of every file against the manifest, in
  parallel, off the event loop, skipping files unchanged since they were proven unless asked
  to re-hash. A mismatch is quarantined; for a Hub set, a pull then fetches only those files.
- Import from a directory or mounted disk: files that match are adopted without copying
  twice (hashed in place, then hard-linked when on the same volume, or copied once while
  hashing when not); the rest are reported missing.

All hashing runs in threads; asyncio cancellation sets the cancel token the threads watch.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import errno
import os
import re
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import psutil
from sqlalchemy.orm import Session

from appliance.errors import EX_USAGE, ApplianceError
from appliance.sizes import rate_text
from appliance.weights import records
from appliance.weights.downloader import DiskFull, part_path
from appliance.weights.hashing import Digest, HashResult, hash_files, should_prewarm
from appliance.weights.live import LiveFile
from appliance.weights.manifest import Manifest, ManifestFile, manifest_from_json
from appliance.weights.proven import adopt_manifest, complete, mark_verified
from appliance.weights.quarantine import QUARANTINE, quarantine
from appliance.weights.sources import read_manifest_file
from appliance.weights.views import (
    Activity,
    FileState,
    Mismatch,
    VerifyOutcome,
    bytes_text,
)

if TYPE_CHECKING:
    from appliance.weights.service import WeightsService

T = TypeVar("T")
COPY_CHUNK = 8 << 20


async def in_thread(service: WeightsService, fn: Callable[[threading.Event], T]) -> T:
    """Run `fn(cancel)` on the service's executor; cancelling the awaiting task sets
    `cancel`, which the hashing loops check every chunk."""
    cancel = threading.Event()
    loop = asyncio.get_running_loop()
    future = loop.run_in_executor(service.executor, fn, cancel)
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        cancel.set()
        with contextlib.suppress(Exception):
            await future
        raise


def progress_sink(service: WeightsService) -> Callable[[str, int], None]:
    """A thread-safe `on_progress(path, nbytes)` that adds to the live counters on the loop."""
    loop = asyncio.get_running_loop()

    def add(path: str, nbytes: int) -> None:
        live = service.live_file(path)
        if live is not None:
            live.progress(loop.time(), live.bytes_done + nbytes)
            service.note_total()

    def sink(path: str, nbytes: int) -> None:
        loop.call_soon_threadsafe(add, path, nbytes)

    return sink


def _unchanged(record: records.FileRecord, target: Path) -> bool:
    try:
        st = target.stat()
    except OSError:
        return False
    return (record.state == FileState.VERIFIED and record.verified_size == st.st_size
            == record.size and record.verified_mtime_ns == st.st_mtime_ns)


async def _hash_and_record(service: WeightsService, set_id: int, target_dir: Path,
                           todo: Sequence[records.FileRecord], *, drop_cache: bool = True,
                           moved: dict[str, Path] | None = None) -> dict[str, HashResult]:
    """Hash `todo` in place; matches are recorded verified, mismatches (wrong bytes, or a
    wrong size) quarantined, with where each went in `moved`."""
    if not todo:
        return {}
    for f in todo:
        live = service.live_file(f.path)
        if live is not None:
            live.state, live.bytes_done, live.dirty = FileState.VERIFYING.value, 0, True
    items = [(target_dir / f.path, f.manifest_file()) for f in todo]
    sink = progress_sink(service)
    results = await in_thread(service, lambda cancel: hash_files(
        items, workers=service.config.weights.hash_workers, on_progress=sink, cancel=cancel,
        drop_cache=drop_cache))
    await asyncio.sleep(0)  # let queued progress callbacks land before the verdicts
    for result in results:
        live = service.live_file(result.path)
        if result.ok:
            await mark_verified(service, set_id, result.path)
            if live is not None:
                live.state, live.last_error, live.dirty = FileState.VERIFIED.value, "", True
            continue
        error = result.message
        size = await asyncio.to_thread(_size_of, target_dir / result.path)
        if result.actual is not None or size is not None:
            # Readable but wrong (bytes or size): keep it out of the engine's way.
            to = await asyncio.to_thread(quarantine, target_dir, result.path)
            if to is not None:
                error += f" (moved to {to})"
                if moved is not None:
                    moved[result.path] = to
        if live is not None:
            live.state, live.bytes_done, live.last_error, live.dirty = (
                FileState.FAILED.value, 0, error, True)
        await service.db.run(_mark_failed(set_id, result.path, error))
        await service.record_event("error", f"weights verification: {error}")
    return {r.path: r for r in results}


def _mark_failed(set_id: int, path: str, error: str) -> Callable[[Session], None]:
    def write(session: Session) -> None:
        records.update_file(session, set_id, path, state=FileState.FAILED.value,
                            verified_at=None, verified_size=None, verified_mtime_ns=None,
                            bytes_done=0, last_error=error[:500])

    return write


async def adopt_in_place(service: WeightsService, set_id: int,
                         files: Sequence[records.FileRecord], target_dir: Path) -> dict[str, bool]:
    """path → proven now. Unchanged verified files are not re-hashed; present, right-sized
    unproven files are hashed and adopted."""
    proven: dict[str, bool] = {}
    todo = []
    for f in files:
        target = target_dir / f.path
        if await asyncio.to_thread(_unchanged, f, target):
            proven[f.path] = True
            live = service.live_file(f.path)
            if live is not None:
                live.bytes_done = f.size
            continue
        size = await asyncio.to_thread(_size_of, target)
        if size == f.size:
            todo.append(f)
        else:
            proven[f.path] = False
            live = service.live_file(f.path)
            if live is not None and live.state == FileState.VERIFIED:
                live.state, live.dirty = FileState.QUEUED.value, True
    results = await _hash_and_record(service, set_id, target_dir, todo)
    proven.update({path: r.ok for path, r in results.items()})
    return proven


def _size_of(path: Path) -> int | None:
    try:
        return path.stat().st_size if path.is_file() else None
    except OSError:
        return None


# --- full verification --------------------------------------------------------------------------


async def run_full_verify(service: WeightsService, *, rehash: bool) -> None:
    """Hash the active set against its manifest and record the verdict. A mismatch is
    quarantined and reported; fetching it again is a separate step (`refetch`), taken here
    only when the operator enabled `weights.auto_refetch`."""
    control = await service.db.run(records.get_control)
    if control.active_set_id is None:
        raise ApplianceError("weights_no_manifest", "no weights manifest is recorded yet",
                             "pull or import the weights first")
    set_id = control.active_set_id
    record = await service.db.run(lambda s: records.get_set(s, set_id))
    assert record is not None
    files = await service.db.run(lambda s: records.set_files(s, set_id))
    target_dir = service.dir_for(record.repo_id)
    service._live_set = set_id
    service._live = {f.path: LiveFile(size=f.size, state=f.state, bytes_done=0,
                                      attempts=f.attempts, last_error=f.last_error)
                     for f in files}
    todo = []
    unchanged: list[records.FileRecord] = []
    for f in files:
        if not rehash and await asyncio.to_thread(_unchanged, f, target_dir / f.path):
            service._live[f.path].bytes_done = f.size
            unchanged.append(f)
        else:
            todo.append(f)
    total = sum(f.size for f in todo)
    keep_cached = service.config.weights.prewarm and should_prewarm(
        record.total_bytes, psutil.virtual_memory().total)
    service.set_activity(Activity.VERIFYING, f"hashing {len(todo)} of {len(files)} files "
                         f"({bytes_text(total)}; {len(unchanged)} unchanged since their last "
                         "full hash)" + (", warming the page cache" if keep_cached else ""))
    loop = asyncio.get_running_loop()
    started = loop.time()
    moved: dict[str, Path] = {}
    results = await _hash_and_record(service, set_id, target_dir, todo,
                                     drop_cache=not keep_cached, moved=moved)
    seconds = max(loop.time() - started, 1e-6)
    outcome = VerifyOutcome(
        at=service.clock.now(), files=len(files), hashed=len(todo), unchanged=len(unchanged),
        unchanged_since=_unchanged_since(unchanged, record.full_verified_at),
        mismatches=tuple(_mismatch(r, moved.get(p)) for p, r in sorted(results.items())
                         if not r.ok),
        rate_text=rate_text(total / seconds) if todo else "")
    service.note_verification(set_id, outcome)
    if not outcome.ok:
        await service.db.run(lambda s: records.set_full_verified(s, set_id, None))
        refetch = service.config.weights.auto_refetch and refetchable(record)
        await service.finish_job(failed=outcome.summary, hint=(
            "fetching them again now (weights.auto_refetch is on)" if refetch else
            "fetch them again: `appliance weights refetch` (or the Weights page's "
            "\"Fetch the damaged files again\")" if refetchable(record) else
            "copy those files again and re-run the import"))
        if refetch:
            await service.refetch(actor="weights (weights.auto_refetch)", via="automatic",
                                  handover=True)
        return
    # Only bytes read now prove anything: a run that read none keeps the old time.
    if todo and (len(todo) == len(files) or record.full_verified_at is None):
        now = service.clock.now()
        await service.db.run(lambda s: records.set_full_verified(s, set_id, now))
    elif record.full_verified_at is None:
        at = outcome.unchanged_since or service.clock.now()
        await service.db.run(lambda s: records.set_full_verified(s, set_id, at))
    if keep_cached and len(todo) == len(files):
        service.note_warm()
    await service.quick_verify()
    await service.finish_job(message=outcome.summary)
    if service.on_ready is not None:
        await service.on_ready()


def _unchanged_since(unchanged: Sequence[records.FileRecord],
                     set_verified_at: dt.datetime | None) -> dt.datetime | None:
    """When the unchanged files were last proven, as one event has one time: the set's full
    verification when they were all hashed by then (a pull proves files one by one, then
    the set; the status shows the set's time), else the oldest file's own hash."""
    since = [f.verified_at for f in unchanged if f.verified_at is not None]
    if not since:
        return None
    if set_verified_at is not None and all(_utc(t) <= _utc(set_verified_at) for t in since):
        return set_verified_at
    return min(since, key=_utc)


def _utc(value: dt.datetime) -> dt.datetime:
    return value if value.tzinfo else value.replace(tzinfo=dt.UTC)


def _mismatch(result: HashResult, moved: Path | None) -> Mismatch:
    if result.actual is not None:
        found = f"{result.algorithm} {result.actual}"
    else:  # not readable as the manifest's file: say what stood in its place
        found = (result.error or "unreadable").removeprefix(f"{result.path}: ")
    return Mismatch(result.path, result.algorithm, result.expected, found,
                    str(moved) if moved else None)


def refetchable(record: records.SetRecord) -> bool:
    """A set whose commit the Hub knows (a pull, or an import of a Hub snapshot); an import
    of a local copy (`local-…` commit) can only be copied again."""
    return bool(re.fullmatch(r"[0-9a-f]{40}", record.commit))


# --- import ---------------------------------------------------------------------------------------


def check_import_dir(directory: Path, manifest_file: Path | None) -> None:
    """Refuse an import that cannot start, before anything is recorded."""
    if not directory.is_dir():
        raise ApplianceError("weights_import_dir", f"{directory} is not a directory",
                             "give the folder holding the checkpoint (e.g. the mounted disk)",
                             status=422, exit_code=EX_USAGE)
    if manifest_file is not None:
        try:
            manifest_from_json(manifest_file.read_text())
        except OSError as exc:
            raise ApplianceError("weights_import_manifest", f"cannot read {manifest_file}: "
                                 f"{exc.strerror or exc}", "give a readable manifest file",
                                 status=422, exit_code=EX_USAGE) from None


async def run_import(service: WeightsService, directory: Path,
                     manifest_file: Path | None) -> None:
    manifest = await _import_manifest(service, directory, manifest_file)
    record = await adopt_manifest(service, manifest, str(directory))
    target_dir = service.dir_for(manifest.repo_id)
    files = await service.db.run(lambda s: records.set_files(s, record.id))
    service._live_set = record.id
    service._live = {f.path: LiveFile(size=f.size, state=f.state, bytes_done=0)
                     for f in files}
    service.set_activity(Activity.IMPORTING, f"importing {len(files)} files from {directory}")
    root = _snapshot_root(directory, manifest.commit)
    missing: list[str] = []
    for f in files:
        target = target_dir / f.path
        if await asyncio.to_thread(_unchanged, f, target):
            service._live[f.path].bytes_done = f.size
            continue
        source = root / f.path
        if await asyncio.to_thread(_same_file, source, target):
            hashed = await _hash_and_record(service, record.id, target_dir, [f])
            ok = f.path in hashed and hashed[f.path].ok
        else:
            ok = await _copy_in(service, record.id, source, target, f)
        if not ok:
            missing.append(f.path)
            live = service._live[f.path]
            if live.state != FileState.FAILED:
                live.state, live.dirty = FileState.MISSING.value, True
    if missing:
        await service.finish_job(failed=f"{len(missing)} of {len(files)} files are missing "
                                 f"or damaged in {directory}: {', '.join(missing[:5])}",
                                 hint="copy them again and re-run the import (the files "
                                 "already proven are kept), or `appliance weights pull` "
                                 "fetches only those")
        return
    await complete(service, record, manifest)


async def _import_manifest(service: WeightsService, directory: Path,
                           manifest_file: Path | None) -> Manifest:
    if manifest_file is not None:
        return manifest_from_json(await asyncio.to_thread(manifest_file.read_text))
    bundled = await asyncio.to_thread(read_manifest_file, directory)
    if bundled is not None:
        return bundled
    control = await service.db.run(records.get_control)
    if control.active_set_id is not None:
        set_id = control.active_set_id
        return await service.db.run(lambda s: records.load_manifest(s, set_id))
    raise ApplianceError(
        "weights_import_no_manifest", f"{directory} has no manifest.json and no manifest is "
        "recorded, so the files cannot be proven",
        "export one where the weights are trusted (`appliance weights export-manifest > "
        "manifest.json`) and put it beside the files, or pass --manifest FILE, or pull the "
        "manifest from the Hub first", status=422, exit_code=EX_USAGE)


def _snapshot_root(directory: Path, commit: str) -> Path:
    """A flat copy of the repo, or a Hugging Face cache folder (`snapshots/<commit>/`)."""
    snapshot = directory / "snapshots" / commit
    return snapshot if snapshot.is_dir() else directory


def _same_file(source: Path, target: Path) -> bool:
    try:
        return source.exists() and target.exists() and os.path.samefile(source, target)
    except OSError:
        return False


async def _copy_in(service: WeightsService, set_id: int, source: Path, target: Path,
                   f: records.FileRecord) -> bool:
    """Adopt one file from elsewhere: same volume → hash it there and hard-link it (no
    copy); another volume → copy once into a .part while hashing, rename on a match."""
    live = service._live[f.path]
    size = await asyncio.to_thread(_size_of, source)
    if size != f.size:
        live.last_error = (f"{source} is missing" if size is None else
                           f"{source} is {size} bytes, the manifest says {f.size}")
        live.dirty = True
        return False
    live.state, live.dirty = FileState.VERIFYING.value, True
    sink = progress_sink(service)
    try:
        ok, error = await in_thread(service, lambda cancel: _adopt_file(
            source, target, f.manifest_file(), lambda n: sink(f.path, n), cancel))
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise DiskFull(target) from None
        raise
    await asyncio.sleep(0)
    if ok:
        await mark_verified(service, set_id, f.path)
        live.state, live.bytes_done, live.last_error = FileState.VERIFIED.value, f.size, ""
    else:
        live.state, live.bytes_done, live.last_error = FileState.FAILED.value, 0, error
    live.dirty = True
    return ok


def _adopt_file(source: Path, target: Path, file: ManifestFile,
                on_progress: Callable[[int], None], cancel: threading.Event) -> tuple[bool, str]:
    from appliance.weights.hashing import HashCancelled

    target.parent.mkdir(parents=True, exist_ok=True)
    if os.stat(source).st_dev == os.stat(target.parent).st_dev:
        from appliance.weights.hashing import hash_file

        result = hash_file(source, file, on_progress=on_progress, cancel=cancel)
        if not result.ok:
            return False, f"{source}: {result.message}"
        with contextlib.suppress(FileNotFoundError):
            target.unlink()
        try:
            os.link(source, target)
            return True, ""
        except OSError:
            pass  # a filesystem without hard links: fall through to one copy
    part = part_path(target)
    digest = Digest(file)
    with source.open("rb") as reader, part.open("wb") as writer:
        while chunk := reader.read(COPY_CHUNK):
            if cancel.is_set():
                raise HashCancelled
            writer.write(chunk)
            digest.update(chunk)
            on_progress(len(chunk))
        writer.flush()
        os.fsync(writer.fileno())
    if not digest.matches():
        part.unlink(missing_ok=True)
        return False, (f"{source}: {digest.algorithm} {digest.hexdigest()[:16]}… does not "
                       f"match the manifest; copy it again")
    os.replace(part, target)
    return True, ""


def manifest_from_dir(directory: Path, repo_id: str, revision: str = "local",
                      workers: int = 4) -> Manifest:
    """A manifest of a trusted copy (sha256 of every file), to carry to an air-gapped box
    beside the files. The commit is derived from the listing, so the same files always give
    the same manifest. Blocking: hashes everything."""
    import hashlib

    from appliance.weights.hashing import hash_files as _hash
    from appliance.weights.manifest import build_manifest

    if not directory.is_dir():
        raise ApplianceError("weights_export_dir", f"{directory} is not a directory",
                             "give the folder holding the checkpoint", exit_code=EX_USAGE)
    paths = sorted(p for p in directory.rglob("*") if p.is_file()
                   and not p.name.endswith(".part") and QUARANTINE not in p.parts
                   and p.name != "manifest.json")
    placeholder = "0" * 64  # hash_files needs an expected digest; we only want the actual
    items = [(p, ManifestFile(p.relative_to(directory).as_posix(), p.stat().st_size,
                              sha256=placeholder)) for p in paths]
    results = _hash(items, workers=workers, drop_cache=True)
    files = []
    for (path, item), result in zip(items, results, strict=True):
        if result.actual is None:
            raise ApplianceError("weights_export_read", f"cannot hash {path}: {result.error}",
                                 "check the file and run the export again",
                                 exit_code=EX_USAGE)
        files.append(ManifestFile(item.path, item.size, sha256=result.actual))
    listing = "\n".join(f"{f.path} {f.size} {f.sha256}" for f in files)
    commit = "local-" + hashlib.sha256(listing.encode()).hexdigest()[:32]
    return build_manifest(repo_id, revision, commit, files)
