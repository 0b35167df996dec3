"""The support bundle through the admin API: `POST /api/v1/support-bundle?since=24h`.

Builds the same archive as `appliance support-bundle` (appliance.ops.bundle), adding what only
the running daemon knows — the live health snapshot, and NVML's Xid history through its own
GPU port — and streams it as an attachment. The build runs in a worker thread (subprocesses,
NVML, disk), one at a time (a second request meanwhile is a 409), and is audited as
`support.bundle` with the caller and their address. The file is written under
`<state_dir>/support/` (0600) and deleted once sent. The console's Settings button uses
`make_bundle` here too, so both doors give the same file.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import threading
from functools import partial
from pathlib import Path
from typing import Annotated, Any

import anyio.to_thread
import msgspec
from litestar import Request, Router, post
from litestar.background_tasks import BackgroundTask
from litestar.params import QueryParameter
from litestar.response import File

from appliance.auth.accounts import Admin
from appliance.auth.guards import password_current
from appliance.auth.middleware import AuthInfo, client_address
from appliance.errors import ApplianceError
from appliance.ops.bundle import Bundle, Part, build, default_name, parse_since
from appliance.runtime import Runtime, runtime_of

log = logging.getLogger(__name__)
AdminRequest = Request[Admin, AuthInfo, Any]
SinceQuery = Annotated[str, QueryParameter(
    description="how far back logs, health changes and counters go: 24h, 90m, 7d or an ISO "
                "date")]

_BUSY = threading.Lock()  # one bundle at a time: each reads every log and runs nvidia-smi


async def _live_parts(runtime: Runtime) -> list[Part]:
    """What only the running daemon knows: its health monitor's latest snapshot."""
    from appliance.api.health import health_out, load_board

    board = await load_board(runtime)
    return [Part("health/current.json", msgspec.json.format(msgspec.json.encode(
        health_out(board)), indent=2) + b"\n",
        "the daemon's current health snapshot: every check, GPUs, engine and host figures")]


def _build_locked(runtime: Runtime, out: Path, **kwargs: Any) -> Bundle:
    if not _BUSY.acquire(blocking=False):
        raise ApplianceError("bundle_busy", "a support bundle is being made right now",
                             "wait a minute and ask again; it ends by itself", status=409)
    try:
        return build(runtime.config, out, db=runtime.db, gpus=runtime.gpus, **kwargs)
    finally:
        _BUSY.release()


async def make_bundle(runtime: Runtime, *, actor: str, address: str, since: str = "24h",
                      ) -> File:
    """Build a bundle off the event loop and answer it as a download that deletes itself."""
    now = runtime.clock.now()
    start = parse_since(since, now)
    extra = await _live_parts(runtime)
    folder = runtime.config.paths.state_dir / "support"
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=folder))
    name = f"{default_name(now)}.tar.gz"
    try:
        bundle = await anyio.to_thread.run_sync(partial(
            _build_locked, runtime, work / name, actor=actor, address=address, since=start,
            now=now, extra=extra))
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    if bundle.audit_error:
        log.warning("support bundle %s was not audited: %s", name, bundle.audit_error)
    return File(bundle.path, filename=name, media_type="application/gzip",
                background=BackgroundTask(shutil.rmtree, work, ignore_errors=True))


@post("/support-bundle", status_code=200, summary="Build and download a support bundle "
      "(.tar.gz, secrets and prompts redacted; audited)")
async def support_bundle(request: AdminRequest, since: SinceQuery = "24h") -> File:
    return await make_bundle(runtime_of(request), actor=request.user.username,
                             address=client_address(request), since=since)


def ops_router() -> Router:
    return Router(path="/api/v1", guards=[password_current], tags=["operations"],
                  route_handlers=[support_bundle])
