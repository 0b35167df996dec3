"""`appliance gateway`: the data plane's process (unit `appliance-gateway.service`).

It shares the database with the control plane but nothing else: restarting either never
cuts the other's connections, and the engine outlives both. READY=1 goes to systemd once the
socket is listened on.

Under systemd the listening socket is `appliance-gateway.socket`'s, passed in (socket
activation) and checked against gateway.host/gateway.port; elsewhere the gateway binds them
itself. SIGTERM stops accepting (the passed socket's queue stays with systemd for the next
process), drains keep-alive connections (appliance.gateway.handover: a request that arrives
is served with `Connection: close`, an idle connection is closed after a short grace), lets
streams in flight finish for up to `GRACEFUL_SECONDS`, writes the usage still buffered, and
exits 0. So a restart refuses nobody: clients reconnect to the queue the next process takes.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import socket
from typing import Any

import uvicorn

from appliance.config import Config
from appliance.gateway.app import GatewayApp
from appliance.gateway.handover import (
    Drain,
    DrainingServer,
    check_address,
    draining_protocol,
    inherited_socket,
)
from appliance.gateway.parts import GatewayParts, build_gateway
from appliance.headbounds import HeadLimits
from appliance.sdnotify import notify
from appliance.serving import serve_until_stopped

log = logging.getLogger(__name__)
GRACEFUL_SECONDS = 60


def uvicorn_config(parts: GatewayParts, *, head: HeadLimits | None = None,
                   drain: Drain | None = None) -> uvicorn.Config:
    """The gateway's server. httptools (fastest: this is the hot path) under `head`'s bounds
    on request heads (appliance.headbounds), which uvicorn alone does not bound with it, and
    draining by `drain` when the server stops (appliance.gateway.handover)."""
    cfg = parts.config.gateway
    protocol = draining_protocol(head or HeadLimits(), drain or Drain())
    return uvicorn.Config(
        GatewayApp(parts), host=cfg.host, port=cfg.port, http=protocol,
        ssl_certfile=str(cfg.tls_cert) if cfg.tls_cert else None,
        ssl_keyfile=str(cfg.tls_key) if cfg.tls_key else None,
        log_config=None, access_log=False, server_header=False, date_header=False,
        proxy_headers=False, lifespan="on", timeout_graceful_shutdown=GRACEFUL_SECONDS,
        limit_concurrency=None, backlog=4096,
    )


async def serve_gateway(parts: GatewayParts, listener: socket.socket | None = None) -> None:
    """Serve on `listener` (the socket systemd passed) or, without one, on the configured
    host and port."""
    cfg = parts.config.gateway
    url = f"{'https' if cfg.tls_cert else 'http'}://{cfg.host}:{cfg.port}"
    how = "socket from appliance-gateway.socket" if listener is not None else "bound here"
    drain = Drain()

    async def announce() -> None:
        _freeze_startup_objects()
        notify(f"READY=1\nSTATUS=gateway on {url} ({how})")
        log.info("gateway ready on %s, %s (pid %d)", url, how, os.getpid())

    server = DrainingServer(uvicorn_config(parts, drain=drain), drain)
    await serve_until_stopped(server, announce, what="gateway", where=url,
                              port_key="gateway.port",
                              sockets=[listener] if listener is not None else None)


def run_gateway(config: Config, **overrides: Any) -> int:
    """Run the gateway until SIGTERM; `overrides` go to `build_gateway`. A socket passed by
    systemd is taken first (its variables are unset before anything else starts) and must
    listen on gateway.host:gateway.port, else exit 78 naming both."""
    from appliance.db.schema import check_schema
    from appliance.resources import migrations_dir

    listener = inherited_socket()
    if listener is not None:
        check_address(listener, config.gateway.host, config.gateway.port, config.source)
    parts = build_gateway(config, **overrides)
    check_schema(parts.db, migrations_dir())
    try:
        _use_uvloop()
        asyncio.run(serve_gateway(parts, listener))
    finally:
        parts.db.dispose()
    return 0


def _freeze_startup_objects() -> None:
    """Move what the start left (modules, SQLAlchemy's and aiohttp's tables, the app: 77,680
    objects after the imports alone) out of the collector's sight. They live as long as the
    process, yet every full collection walked them all, a pause of tens of milliseconds (95
    ms measured on the loaded 2-core dev VM) that stalled every stream and showed in the TTFT
    p99; the collector now walks only what requests allocate. Once, when ready."""
    gc.collect()
    gc.freeze()


def _use_uvloop() -> None:
    """uvloop when installed (it is a dependency): the gateway's hot path is the loop."""
    try:
        import uvloop
    except ImportError:
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
