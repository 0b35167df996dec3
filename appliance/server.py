"""`appliance serve`: one asyncio process running the admin console/API and the scheduler.

Order matters for systemd: READY=1 is sent only after uvicorn has bound its socket (uvicorn
runs lifespan startup before binding, so a startup hook would lie). The watchdog is pinged
from the event loop, so a wedged loop is noticed; nothing about the engine or the GPUs ever
gates a ping. SIGTERM and SIGINT start a graceful shutdown; the process then exits 0.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal

import uvicorn

from appliance.app import create_app
from appliance.db.journal import add_event
from appliance.errors import ApplianceError
from appliance.runtime import Runtime
from appliance.sdnotify import notify, watchdog_interval
from appliance.serving import OwnSignalsServer, watchdog_loop

log = logging.getLogger(__name__)


def _record(runtime: Runtime, severity: str, message: str) -> None:
    now = runtime.clock.now()
    runtime.db.call(lambda s: add_event(s, at=now, severity=severity, source="daemon",
                                        message=message))


async def _announce_ready(server: OwnSignalsServer, runtime: Runtime) -> None:
    while not server.started:
        if server.should_exit:
            return
        await asyncio.sleep(0.05)
    cfg = runtime.config.server
    scheme = "https" if runtime.config.tls else "http"
    url = f"{scheme}://{cfg.host}:{cfg.port}"
    await asyncio.to_thread(_record, runtime, "info",
                            f"daemon {runtime.version} started (pid {os.getpid()}) on {url}")
    notify(f"READY=1\nSTATUS=admin console on {url}")
    log.info("appliance %s ready on %s", runtime.version, url)


async def run_server(runtime: Runtime) -> None:
    cfg = runtime.config.server
    config = uvicorn.Config(
        create_app(runtime),
        host=cfg.host,
        port=cfg.port,
        ssl_certfile=str(cfg.tls_cert) if cfg.tls_cert else None,
        ssl_keyfile=str(cfg.tls_key) if cfg.tls_key else None,
        log_config=None,
        access_log=False,
        server_header=False,
        proxy_headers=False,  # nothing proxies the console: client addresses are real
        lifespan="on",
    )
    server = OwnSignalsServer(config)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: setattr(server, "should_exit", True))
    tasks = [asyncio.create_task(_announce_ready(server, runtime))]
    interval = watchdog_interval()
    if interval:
        tasks.append(asyncio.create_task(watchdog_loop(interval)))
    try:
        await server.serve()
    except SystemExit:
        # uvicorn exits on a failed bind after logging the OS error.
        raise ApplianceError(
            "bind_failed",
            f"could not listen on {cfg.host}:{cfg.port}",
            "another program holds the port (`ss -ltnp`), or choose server.port in the config",
            exit_code=75,
        ) from None
    finally:
        for task in tasks:
            task.cancel()
        # A repeated SIGTERM while we finish shutting down must not kill us half-way: from
        # here to exit the signals are ignored (systemd's stop timeout still applies).
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
            signal.signal(sig, signal.SIG_IGN)
    if not server.started:
        raise ApplianceError(
            "startup_failed", f"the control plane did not start on {cfg.host}:{cfg.port}",
            "read the lines above for the cause", exit_code=70,
        )
    notify("STOPPING=1\nSTATUS=shutting down")
    await asyncio.to_thread(_record, runtime, "info", "daemon stopped cleanly")
