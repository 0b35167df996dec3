"""The weights through the admin API: status, pull, verify, refetch, import, cancel,
manifest.

Jobs run in the daemon (202 Accepted with the status); they survive a daemon restart. Every
action is audited. The Hub token never appears in any answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from litestar import Request, Router, get, post
from litestar.params import JSONBody

from appliance.auditing import audit
from appliance.auth.accounts import Admin
from appliance.auth.guards import password_current
from appliance.auth.middleware import AuthInfo, client_address
from appliance.config import check_endpoint, check_repo_id
from appliance.errors import ApplianceError
from appliance.runtime import runtime_of
from appliance.weights.manifest import Manifest

AdminRequest = Request[Admin, AuthInfo, Any]


@dataclass(frozen=True)
class PullBody:
    repo: str | None = None       # default: weights.repo, else engine.model
    revision: str | None = None   # default: weights.revision
    endpoint: str | None = None   # default: weights.endpoint


@dataclass(frozen=True)
class VerifyBody:
    full: bool = False    # quick tier (sub-second) unless true
    rehash: bool = False  # full tier: hash even files unchanged since they were proven


@dataclass(frozen=True)
class ImportBody:
    directory: str
    manifest: str | None = None  # a manifest JSON file; default: DIR/manifest.json


async def _audited(request: AdminRequest, action: str, target: str,
                   detail: dict[str, Any], *, outcome: str = "ok") -> None:
    await audit(runtime_of(request), actor=request.user.username,
                address=client_address(request), action=f"weights.{action}", target=target,
                outcome=outcome, detail={"via": f"api:{request.auth.kind}", **detail})


@get("/", summary="Weights: the active manifest, the job in flight, every file's progress")
async def weights_status(request: AdminRequest) -> dict[str, Any]:
    return (await runtime_of(request).weights.status()).to_dict()


@post("/pull", status_code=202, summary="Download (or resume) the weights; flags override "
      "the [weights] configuration")
async def weights_pull(request: AdminRequest, data: JSONBody[PullBody | None] = None
                       ) -> dict[str, Any]:
    body = data or PullBody()
    runtime = runtime_of(request)
    _check_pull(body)
    view = await runtime.weights.pull(actor=request.user.username, repo=body.repo,
                                      revision=body.revision, endpoint=body.endpoint)
    await _audited(request, "pull", body.repo or runtime.config.weights_repo,
                   {"revision": body.revision or runtime.config.weights.revision,
                    "endpoint": body.endpoint or runtime.config.weights.endpoint})
    return view.to_dict()


def _check_pull(body: PullBody) -> None:
    for key, value, check in (("repo", body.repo, check_repo_id),
                              ("endpoint", body.endpoint, check_endpoint)):
        if value is not None and (expected := check(value)):
            raise ApplianceError("weights_bad_input", f"{key} {value!r} is not {expected}",
                                 f"fix {key}, or leave it out to use the [weights] "
                                 "configuration", status=422)


@post("/verify", status_code=202, summary="Quick check now, or start a full verification")
async def weights_verify(request: AdminRequest, data: JSONBody[VerifyBody | None] = None
                         ) -> dict[str, Any]:
    body = data or VerifyBody()
    runtime = runtime_of(request)
    if body.full:
        view = await runtime.weights.verify_full(actor=request.user.username,
                                                 rehash=body.rehash)
        await _audited(request, "verify", "full", {"rehash": body.rehash})
        return view.to_dict()
    report = await runtime.weights.quick_verify()
    if report is None:
        raise ApplianceError("weights_no_manifest", "no weights manifest is recorded yet",
                             "pull or import the weights first", status=409)
    await _audited(request, "verify", "quick", {"ok": report.ok},
                   outcome="ok" if report.ok else "failed")
    return (await runtime.weights.status()).to_dict()


@post("/refetch", status_code=202, summary="Fetch the active set's damaged or missing "
      "files again, from the endpoint configured now")
async def weights_refetch(request: AdminRequest) -> dict[str, Any]:
    runtime = runtime_of(request)
    view = await runtime.weights.refetch(actor=request.user.username)
    await _audited(request, "refetch", view.repo_id or "",
                   {"commit": view.commit, "endpoint": runtime.config.weights.endpoint})
    return view.to_dict()


@post("/import", status_code=202, summary="Import a checkpoint from a directory or disk")
async def weights_import(request: AdminRequest, data: JSONBody[ImportBody]) -> dict[str, Any]:
    runtime = runtime_of(request)
    manifest = Path(data.manifest) if data.manifest else None
    directory = Path(data.directory)
    if not directory.is_absolute() or (manifest is not None and not manifest.is_absolute()):
        raise ApplianceError("weights_bad_input", "import paths must be absolute (they are "
                             "read by the daemon, on the box)", "give absolute paths",
                             status=422)
    view = await runtime.weights.import_dir(directory, actor=request.user.username,
                                            manifest_file=manifest)
    await _audited(request, "import", str(directory), {"manifest": data.manifest or ""})
    return view.to_dict()


@post("/cancel", status_code=200, summary="Cancel the job in flight (partial files are kept)")
async def weights_cancel(request: AdminRequest) -> dict[str, Any]:
    view = await runtime_of(request).weights.cancel(actor=request.user.username)
    await _audited(request, "cancel", "", {})
    return view.to_dict()


@get("/manifest", summary="The active manifest as JSON (for an air-gapped box's import)")
async def weights_manifest(request: AdminRequest) -> dict[str, Any]:
    manifest: Manifest = await runtime_of(request).weights.export_manifest()
    return manifest.to_dict()


def weights_router() -> Router:
    return Router(path="/api/v1/weights", guards=[password_current], tags=["weights"],
                  route_handlers=[weights_status, weights_pull, weights_verify,
                                  weights_refetch, weights_import, weights_cancel,
                                  weights_manifest])
