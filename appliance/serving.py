"""What both planes' servers share, kept free of either plane's imports so the gateway
process does not load the control plane (Litestar, templates, scheduler) to reuse it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Generator

import uvicorn

from appliance.sdnotify import notify


class OwnSignalsServer(uvicorn.Server):
    """uvicorn without its own signal capture: the daemon installs handlers on its loop and
    does not want the signal re-raised after shutdown (it would skip our cleanup)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


async def watchdog_loop(interval: float) -> None:
    while True:
        notify("WATCHDOG=1")
        await asyncio.sleep(interval)
