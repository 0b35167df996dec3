"""Qualification through the admin API (`/api/v1/qualify`).

`GET /` answers the state (and a run's progress), the running spec's standing and the ledger;
`GET /{id}` one qualification with its step table, `GET /{id}/chart.svg` its chart. `POST
/plan` says what a run would do and how long (nothing starts); `POST /run` starts one, and
without `"confirm": true` is refused (409) with that estimate, because the gateway refuses
users for the whole run. `POST /cancel` stops a run; the gateway admits users again. Runs and
cancels are audited (`qualify.run`, `qualify.cancel`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from litestar import Request, Response, Router, get, post
from litestar.params import FromPath, JSONBody

from appliance.auditing import audit
from appliance.auth.accounts import Admin
from appliance.auth.guards import password_current
from appliance.auth.middleware import AuthInfo, client_address
from appliance.errors import ApplianceError
from appliance.qualify.chart import render_chart
from appliance.qualify.outcome import Request as QualifyRequest
from appliance.runtime import Runtime, runtime_of

AdminRequest = Request[Admin, AuthInfo, Any]
SVG_HEADERS = {"Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'",
               "X-Content-Type-Options": "nosniff", "Cache-Control": "no-store"}


@dataclass(frozen=True)
class RunBody:
    """A qualification's settings; every field has the issue's default."""

    floor: float = 32.0
    ttft_p90_max: float | None = None  # absent: the interactive class's TTFT SLO, if any
    no_ttft_slo: bool = False          # true: hold the floor alone, whatever the classes say
    repeats: int = 3
    ladder: list[int] | None = None
    workload: str = "harsh"
    input_tokens: int | None = None
    output_tokens: int | None = None
    wedge_seconds: float = 60.0
    continue_from: int | None = None  # a qualification whose every step passed: climb on
    confirm: bool = False

    def request(self) -> QualifyRequest:
        return QualifyRequest(
            floor=self.floor, ttft_p90_max=self.ttft_p90_max,
            ttft_from_class=not self.no_ttft_slo, repeats=self.repeats,
            ladder=tuple(self.ladder) if self.ladder else None, workload=self.workload,
            input_tokens=self.input_tokens, output_tokens=self.output_tokens,
            wedge_seconds=self.wedge_seconds, continue_from=self.continue_from)


async def overview(runtime: Runtime) -> dict[str, Any]:
    """The status and the ledger (without step tables), as the API and the CLI show them."""
    service = runtime.qualify
    history = await service.history()
    return {**await service.status(), "history": [
        {**r.to_dict(steps=False), "chart": f"/api/v1/qualify/{r.id}/chart.svg"}
        for r in history]}


async def start_run(runtime: Runtime, body: QualifyRequest, *, confirm: bool, actor: str,
                    address: str, via: str) -> dict[str, Any]:
    """Start a run (audited, refusals too), shared by the API and the console."""
    try:
        record = await runtime.qualify.start(body, actor=actor, confirm=confirm)
    except ApplianceError as exc:
        if exc.code != "confirmation_required":
            await audit(runtime, actor=actor, address=address, action="qualify.run",
                        outcome="denied", detail={"via": via, "refused": exc.message})
        raise
    await audit(runtime, actor=actor, address=address, action="qualify.run",
                target=str(record.id), detail={"via": via, "spec_hash": record.spec_hash,
                                               "settings": record.settings.to_dict()})
    return record.to_dict()


async def cancel_run(runtime: Runtime, *, actor: str, address: str, via: str) -> bool:
    cancelled = await runtime.qualify.cancel()
    progress = runtime.qualify.progress
    await audit(runtime, actor=actor, address=address, action="qualify.cancel",
                target=str(progress.qid) if progress else "",
                outcome="ok" if cancelled else "noop", detail={"via": via})
    return cancelled


def _via(request: AdminRequest) -> str:
    return f"api:{request.auth.kind}"


@get("/", summary="Qualification state, the running spec's standing, and the ledger")
async def qualify_status(request: AdminRequest) -> dict[str, Any]:
    return await overview(runtime_of(request))


@get("/{qid:int}", summary="One qualification with its step table")
async def qualify_one(request: AdminRequest, qid: FromPath[int]) -> dict[str, Any]:
    record = await runtime_of(request).qualify.get(qid)
    return {**record.to_dict(), "chart": f"/api/v1/qualify/{qid}/chart.svg"}


@get("/{qid:int}/chart.svg", summary="One qualification's chart (SVG)")
async def qualify_chart(request: AdminRequest, qid: FromPath[int]) -> Response[str]:
    record = await runtime_of(request).qualify.get(qid)
    return Response(render_chart(record), media_type="image/svg+xml", headers=SVG_HEADERS)


@post("/plan", status_code=200, summary="What a run would do and how long (starts nothing)")
async def qualify_plan(request: AdminRequest, data: JSONBody[RunBody]) -> dict[str, Any]:
    return (await runtime_of(request).qualify.preview(data.request())).to_dict()


@post("/run", status_code=202, summary="Start a qualification (needs confirm: the gateway "
      "refuses users meanwhile)")
async def qualify_run(request: AdminRequest, data: JSONBody[RunBody]) -> dict[str, Any]:
    return await start_run(runtime_of(request), data.request(), confirm=data.confirm,
                           actor=request.user.username, address=client_address(request),
                           via=_via(request))


@post("/cancel", status_code=200, summary="Cancel the running qualification")
async def qualify_cancel(request: AdminRequest) -> dict[str, Any]:
    runtime = runtime_of(request)
    cancelled = await cancel_run(runtime, actor=request.user.username,
                                 address=client_address(request), via=_via(request))
    return {"cancelled": cancelled, "state": "cancelling" if cancelled else "idle"}


def qualify_router() -> Router:
    return Router(path="/api/v1/qualify", guards=[password_current], tags=["qualify"],
                  route_handlers=[qualify_status, qualify_one, qualify_chart, qualify_plan,
                                  qualify_run, qualify_cancel])
