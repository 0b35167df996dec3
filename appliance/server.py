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

import uvicorn

from appliance.app import create_app
from appliance.db.journal import add_event
from appliance.headbounds import HeadLimits, head_bounded
from appliance.runtime import Runtime
from appliance.sdnotify import notify
from appliance.serving import OwnSignalsServer, serve_until_stopped

log = logging.getLogger(__name__)


def _record(runtime: Runtime, severity: str, message: str) -> None:
    now = runtime.clock.now()
    runtime.db.call(lambda s: add_event(s, at=now, severity=severity, source="daemon",
                                        message=message))


async def _announce_ready(runtime: Runtime) -> None:
    cfg = runtime.config.server
    scheme = "https" if runtime.config.tls else "http"
    url = f"{scheme}://{cfg.host}:{cfg.port}"
    await asyncio.to_thread(_record, runtime, "info",
                            f"daemon {runtime.version} started (pid {os.getpid()}) on {url}")
    notify(f"READY=1\nSTATUS=admin console on {url}")
    log.info("appliance %s ready on %s", runtime.version, url)


def uvicorn_config(runtime: Runtime, *, head: HeadLimits | None = None) -> uvicorn.Config:
    """The console's server: the app on `server.host:port`, request heads bounded by `head`
    (appliance.headbounds: size, field count, time to arrive, one Host)."""
    cfg = runtime.config.server
    return uvicorn.Config(
        create_app(runtime),
        host=cfg.host,
        port=cfg.port,
        http=head_bounded(head or HeadLimits()),
        ssl_certfile=str(cfg.tls_cert) if cfg.tls_cert else None,
        ssl_keyfile=str(cfg.tls_key) if cfg.tls_key else None,
        log_config=None,
        access_log=False,
        server_header=False,
        proxy_headers=False,  # nothing proxies the console: client addresses are real
        lifespan="on",
    )


async def run_server(runtime: Runtime) -> None:
    cfg = runtime.config.server
    server = OwnSignalsServer(uvicorn_config(runtime))
    await serve_until_stopped(server, lambda: _announce_ready(runtime), what="control plane",
                              where=f"{cfg.host}:{cfg.port}", port_key="server.port")
    await asyncio.to_thread(_record, runtime, "info", "daemon stopped cleanly")
