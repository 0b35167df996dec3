"""`appliance gateway`: the data plane's process (unit `appliance-gateway.service`).

It shares the database with the control plane but nothing else: restarting either never
cuts the other's connections, and the engine outlives both. READY=1 goes to systemd once the
socket is bound. SIGTERM stops accepting, lets streams in flight finish for up to
`GRACEFUL_SECONDS`, writes the usage still buffered, and exits 0.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

import uvicorn

from appliance.config import Config
from appliance.gateway.app import GatewayApp
from appliance.gateway.parts import GatewayParts, build_gateway
from appliance.headbounds import HeadLimits, head_bounded
from appliance.sdnotify import notify
from appliance.serving import OwnSignalsServer, serve_until_stopped

log = logging.getLogger(__name__)
GRACEFUL_SECONDS = 60


def uvicorn_config(parts: GatewayParts, *, head: HeadLimits | None = None) -> uvicorn.Config:
    """The gateway's server. httptools (fastest: this is the hot path) under `head`'s bounds
    on request heads (appliance.headbounds), which uvicorn alone does not bound with it."""
    cfg = parts.config.gateway
    return uvicorn.Config(
        GatewayApp(parts), host=cfg.host, port=cfg.port, http=head_bounded(head or HeadLimits()),
        ssl_certfile=str(cfg.tls_cert) if cfg.tls_cert else None,
        ssl_keyfile=str(cfg.tls_key) if cfg.tls_key else None,
        log_config=None, access_log=False, server_header=False, date_header=False,
        proxy_headers=False, lifespan="on", timeout_graceful_shutdown=GRACEFUL_SECONDS,
        limit_concurrency=None, backlog=4096,
    )


async def serve_gateway(parts: GatewayParts) -> None:
    cfg = parts.config.gateway
    url = f"{'https' if cfg.tls_cert else 'http'}://{cfg.host}:{cfg.port}"

    async def announce() -> None:
        notify(f"READY=1\nSTATUS=gateway on {url}")
        log.info("gateway ready on %s (pid %d)", url, os.getpid())

    await serve_until_stopped(OwnSignalsServer(uvicorn_config(parts)), announce,
                              what="gateway", where=url, port_key="gateway.port")


def run_gateway(config: Config, **overrides: Any) -> int:
    """Run the gateway until SIGTERM; `overrides` go to `build_gateway`."""
    from appliance.db.schema import check_schema
    from appliance.resources import migrations_dir

    parts = build_gateway(config, **overrides)
    check_schema(parts.db, migrations_dir())
    try:
        _use_uvloop()
        asyncio.run(serve_gateway(parts))
    finally:
        parts.db.dispose()
    return 0


def _use_uvloop() -> None:
    """uvloop when installed (it is a dependency): the gateway's hot path is the loop."""
    try:
        import uvloop
    except ImportError:
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
