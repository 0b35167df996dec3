"""`GET /api/v1/cell/plan`: what each mix of boxes like this one would serve.

`?profile=NAME` (a built-in or custom tuning profile; default the box's current one, as the
Tuning page picks it), `?mix=1P+3D` (repeatable or comma-separated; added to the default
1 unified, 1P+1D, 1P+2D, 2 unified), `?floor=32` (tokens/s every user must hold, as a
qualification judges it). Viewer and up (auth/roles.py).

This module gathers the facts the pure planner (appliance.cell.plan) needs: the tuning
model's per-role recommendation on this box's pools, this box's qualification ledger (the
newest finished qualification of this box's spec as a unified box, and of its spec as a
decode box, whose throughput sets the decode speed), whether the field figures apply (Kimi
K3 on 8 GPUs), and the prefix-cache hit share of the traffic
the gateway recorded since the engine's latest start (as the Tuning page reads it).
`plan_context` gives the Cell page's partial (`partials/cell_plan.html`) its variables.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from litestar import Request, Router, get
from litestar.params import FromQuery

from appliance.auth.accounts import Admin
from appliance.auth.guards import password_current
from appliance.auth.middleware import AuthInfo
from appliance.cell.plan import (
    FIELD_K3,
    CellPlan,
    PlanInputs,
    cache_hit,
    check_floor,
    decode_rate,
    measured_point,
    parse_mixes,
    plan_cell,
    prefill_rate,
)
from appliance.errors import ApplianceError
from appliance.qualify.ledger import Record, list_qualifications
from appliance.qualify.plan import DEFAULT_FLOOR
from appliance.runtime import Runtime, runtime_of
from appliance.tuning.roles import request_shape
from appliance.tuning.service import gateway_records

AdminRequest = Request[Admin, AuthInfo, Any]


def unified_spec_hash(runtime: Runtime) -> str:
    """The hash of the spec this box would launch as a unified box (its qualifications as a
    box serving alone are filed under it), whatever its role now."""
    return runtime.supervisor.current_spec(role="unified").spec_hash


def unified_record(records: Sequence[Record], spec_hash: str) -> Record | None:
    """The newest finished qualification of `spec_hash` that found a point."""
    return next((r for r in records if r.spec_hash == spec_hash and r.state == "done"
                 and r.qualified is not None), None)


async def gather(runtime: Runtime, profile: str | None, floor: float) -> PlanInputs:
    """The planner's inputs for this box (module docstring)."""
    chosen = await runtime.tuning.profile(profile)
    sized = await runtime.tuning.by_role(chosen, ("unified", "prefill"))
    unified, prefill = sized.recommendations["unified"], sized.recommendations["prefill"]
    records = await runtime.db.run(list_qualifications)
    record = unified_record(records, unified_spec_hash(runtime))
    point = measured_point(record, floor, chosen.name) if record is not None else None
    as_decode = unified_record(records, runtime.supervisor.current_spec(role="decode").spec_hash)
    decoding = measured_point(as_decode, floor, chosen.name) if as_decode is not None else None
    now = runtime.clock.now()
    hit, hit_basis = cache_hit(await runtime.db.run(lambda s: gateway_records(s, now)))
    field = FIELD_K3 if (sized.geometry.model_type == "kimi_k3"
                         and sized.launch.tp == 8) else None
    decode, decode_basis = decode_rate(point, field, decoding)
    rate, rate_basis = prefill_rate(record)
    prompt, answer = request_shape(chosen.lengths)
    budget = "budget measured from the engine's last startup" if sized.budget.measured \
        else "budget an estimate: no startup measured on this box yet"
    return PlanInputs(
        profile=chosen.name, profile_title=chosen.title, prompt_tokens=prompt,
        output_tokens=answer, floor=floor, unified_capacity=unified.recommended.concurrent,
        prefill_fits=prefill.recommended.concurrent >= 1, prefill_rate=rate,
        prefill_rate_basis=rate_basis, decode_rate=decode, decode_rate_basis=decode_basis,
        budget_basis=budget, measured=point, decode_measured=decoding, field=field,
        cache_hit=hit,
        cache_hit_basis=hit_basis)


async def cell_plan(runtime: Runtime, *, profile: str | None = None,
                    mixes: Sequence[str] = (), floor: float = DEFAULT_FLOOR) -> CellPlan:
    """The plan for `profile` over the default mixes and `mixes`; refusals name the input."""
    wanted = parse_mixes(mixes)  # a bad mix is refused before anything is read
    inputs = await gather(runtime, profile, check_floor(floor))
    return plan_cell(inputs, wanted)


async def plan_context(runtime: Runtime, profile: str | None = None) -> dict[str, Any]:
    """The Cell page partial's variables: `plan` (a CellPlan, or None) and `plan_problem`
    (the ApplianceError that kept it from being computed, or None)."""
    try:
        return {"plan": await cell_plan(runtime, profile=profile), "plan_problem": None}
    except ApplianceError as exc:
        return {"plan": None, "plan_problem": exc}


@get("/", summary="What each mix of boxes would serve for a workload profile, measured or "
     "predicted")
async def get_cell_plan(request: AdminRequest, profile: FromQuery[str | None] = None,
                        mix: FromQuery[list[str] | None] = None,
                        floor: FromQuery[float | None] = None) -> dict[str, Any]:
    plan = await cell_plan(runtime_of(request), profile=profile or None, mixes=mix or (),
                           floor=DEFAULT_FLOOR if floor is None else floor)
    return plan.to_dict()


def cell_plan_router() -> Router:
    return Router(path="/api/v1/cell/plan", guards=[password_current], tags=["cell"],
                  route_handlers=[get_cell_plan])
