"""The Qualification page: is the running engine qualified, at what point, and how it was
measured (the step table and the chart); a form to run one, which first shows what it will
do and how long the gateway will refuse users, and runs only once that is confirmed; a
running qualification's progress (refreshed every two seconds) with a cancel button; the
ledger, each entry with a page of its own (`/qualify/{id}`). Everything comes from the same
service as the API and the CLI (`appliance.api.qualify`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from litestar import get, post
from litestar.params import FromPath, URLEncodedBody
from litestar.response import Template
from markupsafe import Markup

from appliance.api.qualify import cancel_run, start_run
from appliance.auth.middleware import client_address
from appliance.errors import ApplianceError
from appliance.qualify.chart import render_chart
from appliance.qualify.ledger import Record
from appliance.qualify.outcome import Request as QualifyRequest
from appliance.qualify.outcome import summary
from appliance.qualify.promises import class_ttft
from appliance.runtime import Runtime, runtime_of
from appliance.ui.login import AdminRequest
from appliance.ui.pages import GUARDED


def users(count: int) -> str:
    return f"{count} concurrent {'user' if count == 1 else 'users'}"


def seconds(value: float | None) -> str:
    if value is None:
        return "—"
    return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.2f} s"


def share(value: float | None) -> str:
    return "—" if value is None else f"{value * 100:.0f} %"


def rate(value: float | None) -> str:
    return "—" if value is None else f"{value:,.1f}"


def minutes(value: float) -> str:
    whole = max(1, round(value / 60))
    return f"about {whole} {'minute' if whole == 1 else 'minutes'}"


STATE_WORDS = {"running": "running", "done": "finished", "cancelled": "cancelled",
               "failed": "failed", "interrupted": "interrupted by a daemon restart"}
HELPERS = {"users": users, "seconds": seconds, "share": share, "rate": rate,
           "minutes": minutes, "state_words": STATE_WORDS}


async def _context(runtime: Runtime) -> dict[str, Any]:
    service = runtime.qualify
    status = await service.status()
    current = await service.current()
    profiles = [p.name for p in await runtime.tuning.profiles()]
    return {**HELPERS, "status": status, "progress": service.progress,
            "current": current, "chart": _chart(current), "history": await service.history(),
            "profiles": profiles, "engine_ready": status["engine_state"] == "ready",
            "error": "", "error_hint": "", "confirm": None, "form": RunForm(
                ttft_p90_max=_seconds_text(class_ttft(runtime.config.gateway.classes)))}


def _seconds_text(value: float | None) -> str:
    return "" if value is None else f"{value:g}"


def _chart(record: Record | None) -> Markup | None:
    # The SVG is built from escaped text only (appliance.qualify.chart), so it is safe inline.
    return Markup(render_chart(record)) if record is not None and record.steps else None  # noqa: S704


@get("/qualify", **GUARDED)
async def qualify_page(request: AdminRequest) -> Template:
    return Template("pages/qualify.html",
                    context={**await _context(runtime_of(request)), "nav": "qualify"})


@get("/qualify/status", **GUARDED)
async def qualify_status_partial(request: AdminRequest) -> Template:
    return Template("partials/qualify_status.html", context=await _context(runtime_of(request)))


@get("/qualify/{qid:int}", **GUARDED)
async def qualify_record_page(request: AdminRequest, qid: FromPath[int]) -> Template:
    record = await runtime_of(request).qualify.get(qid)
    return Template("pages/qualify_record.html", context={
        **HELPERS, "nav": "qualify", "record": record, "chart": _chart(record)})


@dataclass
class RunForm:
    floor: str = "32"
    ttft_p90_max: str = ""
    repeats: str = "3"
    ladder: str = ""
    workload: str = "harsh"
    continue_from: str = ""  # "continue the ladder": the lower-bound qualification's id
    confirm: str = ""

    def request(self) -> QualifyRequest:
        try:
            ladder = tuple(int(p) for p in self.ladder.replace(" ", "").split(",") if p)
            return QualifyRequest(
                floor=float(self.floor), repeats=int(self.repeats),
                ttft_p90_max=float(self.ttft_p90_max) if self.ttft_p90_max.strip() else None,
                ttft_from_class=False,  # the form shows the class's SLO; empty means none
                ladder=ladder or None, workload=self.workload,
                continue_from=int(self.continue_from) if self.continue_from else None)
        except ValueError:
            raise ApplianceError(
                "qualify_invalid", "the floor, the ceiling, the repeats and the steps must be "
                "numbers", "e.g. floor 32, repeats 3, steps 1,2,4,8 (or empty for the "
                "default ladder)", status=422) from None


@post("/qualify/run", **GUARDED)
async def qualify_run_ui(request: AdminRequest, data: URLEncodedBody[RunForm]) -> Template:
    """First press: what the run will do and how long, with a confirm button. Confirmed:
    start it; the answer is the status part with its progress."""
    runtime = runtime_of(request)
    context = await _context(runtime)
    context["form"] = data
    try:
        body = data.request()
        if data.confirm != "yes":
            context["confirm"] = summary(await runtime.qualify.preview(body))
        else:
            await start_run(runtime, body, confirm=True, actor=request.user.username,
                            address=client_address(request), via="console")
            context = {**await _context(runtime), "form": data}
    except ApplianceError as exc:
        context["error"], context["error_hint"] = exc.message, exc.hint
        return Template("partials/qualify_status.html", context=context,
                        status_code=exc.status)
    return Template("partials/qualify_status.html", context=context)


@post("/qualify/cancel", **GUARDED)
async def qualify_cancel_ui(request: AdminRequest) -> Template:
    runtime = runtime_of(request)
    await cancel_run(runtime, actor=request.user.username, address=client_address(request),
                     via="console")
    context = await _context(runtime)
    return Template("partials/qualify_status.html", context=context)
