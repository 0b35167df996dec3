"""The weights' rows in the database, as frozen records (ORM rows never leave this module).

A set is a manifest (repo + commit, every file with its size and hash), written before any
byte is fetched and never changed; per-file rows carry what is known about the copy on disk.
The control row holds the operator's wish: the active set and the job that should be running,
so a restarted daemon resumes it.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from appliance.db.models import WeightsControl, WeightsFile, WeightsSet
from appliance.weights.manifest import Manifest, ManifestFile, build_manifest
from appliance.weights.views import FileState


@dataclass(frozen=True)
class SetRecord:
    id: int
    repo_id: str
    revision: str
    commit: str
    source: str
    manifest_digest: str
    total_bytes: int
    created_at: dt.datetime
    full_verified_at: dt.datetime | None


@dataclass(frozen=True)
class FileRecord:
    path: str
    size: int
    sha256: str | None
    git_oid: str | None
    state: str
    bytes_done: int
    attempts: int
    last_error: str
    verified_at: dt.datetime | None
    verified_size: int | None
    verified_mtime_ns: int | None

    def manifest_file(self) -> ManifestFile:
        return ManifestFile(self.path, self.size, self.sha256, self.git_oid)


@dataclass(frozen=True)
class Control:
    active_set_id: int | None
    job: str
    job_args: dict[str, Any]
    updated_at: dt.datetime | None
    updated_by: str


def _set(row: WeightsSet) -> SetRecord:
    return SetRecord(row.id, row.repo_id, row.revision, row.commit_id, row.source,
                     row.manifest_digest, row.total_bytes, row.created_at, row.full_verified_at)


def _file(row: WeightsFile) -> FileRecord:
    return FileRecord(row.path, row.size, row.sha256, row.git_oid, row.state, row.bytes_done,
                      row.attempts, row.last_error, row.verified_at, row.verified_size,
                      row.verified_mtime_ns)


def store_manifest(session: Session, manifest: Manifest, source: str,
                   at: dt.datetime) -> SetRecord:
    """The set for this manifest, created with every file queued if it is new. The same
    repo+commit always lists the same files; a different listing for it is refused."""
    row = session.scalars(select(WeightsSet).where(
        WeightsSet.repo_id == manifest.repo_id,
        WeightsSet.commit_id == manifest.commit)).one_or_none()
    if row is not None:
        if row.manifest_digest != manifest.digest:
            from appliance.weights.manifest import ManifestError

            raise ManifestError(
                f"{manifest.repo_id}@{manifest.commit[:12]} is already recorded with a "
                "different list of files or hashes; a commit's files never change",
                "check that the manifest comes from the same source; a mirror serving other "
                "bytes under the same commit is not to be trusted")
        return _set(row)
    row = WeightsSet(repo_id=manifest.repo_id, revision=manifest.revision,
                     commit_id=manifest.commit, source=source[:1024],
                     manifest_digest=manifest.digest, total_bytes=manifest.total_bytes,
                     created_at=at)
    session.add(row)
    session.flush()
    for item in manifest.files:
        session.add(WeightsFile(set_id=row.id, path=item.path, size=item.size,
                                sha256=item.sha256, git_oid=item.git_oid,
                                state=FileState.QUEUED.value, bytes_done=0, attempts=0,
                                last_error=""))
    session.flush()
    return _set(row)


def get_set(session: Session, set_id: int) -> SetRecord | None:
    row = session.get(WeightsSet, set_id)
    return _set(row) if row else None


def list_sets(session: Session) -> list[SetRecord]:
    return [_set(r) for r in session.scalars(select(WeightsSet).order_by(WeightsSet.id.desc()))]


def set_files(session: Session, set_id: int) -> list[FileRecord]:
    rows = session.scalars(select(WeightsFile).where(WeightsFile.set_id == set_id)
                           .order_by(WeightsFile.path))
    return [_file(r) for r in rows]


def load_manifest(session: Session, set_id: int) -> Manifest:
    record = get_set(session, set_id)
    if record is None:
        raise LookupError(f"no weights set {set_id}")
    return build_manifest(record.repo_id, record.revision, record.commit,
                          [f.manifest_file() for f in set_files(session, set_id)])


def get_control(session: Session) -> Control:
    row = session.get(WeightsControl, 1)
    if row is None:
        return Control(None, "", {}, None, "")
    return Control(row.active_set_id, row.job, json.loads(row.job_args or "{}"),
                   row.updated_at, row.updated_by)


_UNSET: Any = object()


def set_control(session: Session, *, at: dt.datetime, by: str, active_set_id: Any = _UNSET,
                job: str | None = None, job_args: Mapping[str, Any] | None = None) -> None:
    row = session.get(WeightsControl, 1)
    if row is None:
        row = WeightsControl(id=1, job="", job_args="{}", updated_at=at, updated_by=by)
        session.add(row)
    if active_set_id is not _UNSET:
        row.active_set_id = active_set_id
    if job is not None:
        row.job = job
        row.job_args = json.dumps(dict(job_args or {}))
    row.updated_at = at
    row.updated_by = by[:128]


def update_file(session: Session, set_id: int, path: str, **changes: Any) -> None:
    row = session.scalars(select(WeightsFile).where(WeightsFile.set_id == set_id,
                                                    WeightsFile.path == path)).one()
    for key, value in changes.items():
        setattr(row, key, value)


def update_files(session: Session, set_id: int,
                 changes: Mapping[str, Mapping[str, Any]]) -> None:
    """Apply many per-file changes in one transaction (the periodic progress write)."""
    if not changes:
        return
    rows = session.scalars(select(WeightsFile).where(WeightsFile.set_id == set_id,
                                                     WeightsFile.path.in_(list(changes))))
    for row in rows:
        for key, value in changes[row.path].items():
            setattr(row, key, value)


def set_full_verified(session: Session, set_id: int, at: dt.datetime | None) -> None:
    row = session.get(WeightsSet, set_id)
    if row is not None:
        row.full_verified_at = at


def active_set(session: Session) -> SetRecord | None:
    """The set the weights control points at (the one the engine is to serve), if any."""
    set_id = get_control(session).active_set_id
    return get_set(session, set_id) if set_id is not None else None
