"""Recording what is proven: a set's manifest adopted, a file hashed and matched, the whole set
verified. Shared by the pull and the jobs that read files already on disk (importer.py), so
neither imports the other for them.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from appliance.errors import ApplianceError
from appliance.sizes import bytes_text
from appliance.weights import records
from appliance.weights.manifest import Manifest
from appliance.weights.quarantine import remove_quarantine
from appliance.weights.views import FileState

if TYPE_CHECKING:
    from appliance.weights.service import WeightsService


async def adopt_manifest(service: WeightsService, manifest: Manifest,
                         source: str) -> records.SetRecord:
    now = service.clock.now()

    def store(s: Any) -> records.SetRecord:
        record = records.store_manifest(s, manifest, source, now)
        records.set_control(s, at=now, by="weights", active_set_id=record.id)
        return record

    record = await service.db.run(store)
    await service.record_event("info", f"weights manifest of {manifest.repo_id}@"
                               f"{manifest.commit[:12]}: {len(manifest.files)} files, "
                               f"{bytes_text(manifest.total_bytes)}")
    return record


async def complete(service: WeightsService, record: records.SetRecord, manifest: Manifest) -> None:
    await asyncio.to_thread(remove_quarantine, service.dir_for(manifest.repo_id))
    now = service.clock.now()
    await service.db.run(lambda s: records.set_full_verified(s, record.id, now))
    service.note_verification(None, None)  # an earlier verdict of damage is repaired now
    report = await service.quick_verify()
    if report is not None and not report.ok:
        raise ApplianceError("weights_quick_failed", "every file matched its hash but the "
                             "checkpoint's structure check failed: " + "; ".join(
                                 f"{p.path}: {p.message}" for p in report.problems[:3]),
                             "the source publishes a broken checkpoint; report it upstream")
    await service.finish_job(message=f"{manifest.repo_id}@{manifest.commit[:12]}: all "
                             f"{len(manifest.files)} files verified "
                             f"({bytes_text(manifest.total_bytes)})")
    if service.on_ready is not None:
        await service.on_ready()


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
