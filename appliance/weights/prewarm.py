"""Page-cache prewarm before a launch: the engine's 80-minute load then reads memory.

Only when `weights.prewarm` is on and host RAM is at least 1.25 times the model (the B300 box
has 3 TiB for 1.56 TB); skipped when a prewarm, or a full verification that kept its pages,
ran in the last ten minutes. On a prefill box with a hierarchical cache, the RAM plan
(ram_plan.py: what the host cache leaves the weights' page cache once the engine runs) is
stated with the prewarm's line and event.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING

import psutil

from appliance.sizes import bytes_text, rate_text
from appliance.weights import records
from appliance.weights.hashing import prewarm
from appliance.weights.importer import in_thread
from appliance.weights.ram_plan import plan_ram

if TYPE_CHECKING:
    from appliance.weights.service import WeightsService

WARM_FOR_SECONDS = 600.0


async def prewarm_for_launch(service: WeightsService, report: Callable[[str], None]) -> str | None:
    """Before a launch: read every shard into the page cache, in parallel, so the
    engine's 80-minute load reads memory rather than disk. Only when weights.prewarm is
    on and host RAM is at least 1.25 times the model (the B300 box has 3 TiB for 1.56 TB);
    skipped right after a full verification that kept the pages. `report` gets a line
    every second; the result (GB and GB/s) is returned and recorded as an event."""
    from appliance.weights.records import active_set

    record = await service.db.run(active_set)
    if not service.config.weights.prewarm or record is None:
        return None
    memory = (await asyncio.to_thread(psutil.virtual_memory)).total
    host = await service.host_cache() if service.host_cache is not None else None
    plan = plan_ram(memory, record.total_bytes, host)
    ram_note = f"; RAM plan: {plan.sentence}" if host is not None else ""
    if plan.verdict == "refused":  # said before the 80-minute load, not after it
        await service.record_event("warning", f"RAM plan: {plan.sentence}")
    if not plan.prewarm:
        if ram_note:
            report(f"no prewarm{ram_note}")
        return None
    loop = asyncio.get_running_loop()
    if service._warm_at is not None and loop.time() - service._warm_at < WARM_FOR_SECONDS:
        return None
    files = await service.db.run(lambda s: records.set_files(s, record.id))
    paths = [service.dir_for(record.repo_id) / f.path for f in files]
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
                   f"{bytes_text(total)} at {rate_text(rate)}")

    narrator = asyncio.create_task(narrate())
    try:
        result = await in_thread(service, lambda cancel: prewarm(
            paths, workers=service.config.weights.hash_workers, on_progress=count,
            cancel=cancel))
    finally:
        narrator.cancel()
    service._warm_at = loop.time()
    rate = result.bytes_read / max(result.seconds, 1e-6)
    message = (f"page cache warmed before the launch: {bytes_text(result.bytes_read)} in "
               f"{result.seconds:.1f} s ({rate_text(rate)}){ram_note}")
    await service.record_event("info", message)
    return message
