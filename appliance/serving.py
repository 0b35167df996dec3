"""What both planes' servers share, kept free of either plane's imports so the gateway
process does not load the control plane (Litestar, templates, scheduler) to reuse it."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
from collections.abc import Awaitable, Callable, Generator

import uvicorn

from appliance.errors import ApplianceError
from appliance.sdnotify import notify, watchdog_interval


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


async def serve_until_stopped(server: OwnSignalsServer, announce: Callable[[], Awaitable[None]],
                              *, what: str, where: str, port_key: str,
                              sockets: list[socket.socket] | None = None) -> None:
    """Serve until SIGTERM or SIGINT, for either plane: on `sockets` when given (listening
    sockets passed by systemd, which uvicorn closes its copies of at the end), else on the
    server config's host and port.

    `announce` runs once the socket is bound (uvicorn runs lifespan startup before binding,
    so READY=1 sent from a startup hook would lie); the systemd watchdog is pinged from the
    event loop beside it. A failed bind is exit 75 and a start that never bound exit 70,
    each naming `where`. From the end of serving to exit, repeated signals are ignored so a
    second SIGTERM cannot cut the shutdown half-way (systemd's stop timeout still applies).
    Ends by telling systemd STOPPING=1.
    """
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: setattr(server, "should_exit", True))

    async def when_bound() -> None:
        while not server.started:
            if server.should_exit:
                return
            await asyncio.sleep(0.05)
        await announce()

    tasks = [asyncio.create_task(when_bound())]
    interval = watchdog_interval()
    if interval:
        tasks.append(asyncio.create_task(watchdog_loop(interval)))
    try:
        await server.serve(sockets=sockets)
    except SystemExit:
        # uvicorn exits on a failed bind after logging the OS error.
        raise ApplianceError(
            "bind_failed", f"could not listen on {where}",
            f"another program holds the port (`ss -ltnp`), or choose {port_key} in the config",
            exit_code=75,
        ) from None
    finally:
        for task in tasks:
            task.cancel()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
            signal.signal(sig, signal.SIG_IGN)
    if not server.started:
        raise ApplianceError("startup_failed", f"the {what} did not start on {where}",
                             "read the lines above for the cause", exit_code=70)
    notify("STOPPING=1\nSTATUS=shutting down")
