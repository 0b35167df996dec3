"""Capacity planning for a cell: what a mix of boxes like this one would serve. Pure.

For a workload profile, each mix (1 unified; 1 prefill + 1 decode; 1P+2D; 2 unified; or
an operator's `NU` / `NP+MD`) gets three figures, each labelled MEASURED or PREDICTED with
its basis in words:

- **users at the floor**: concurrent users the mix serves with every user decoding at the
  per-user floor (32 tokens/s at p10 by default, as a qualification judges it);
- **output tokens/s** at that concurrency;
- **time to first token** at that concurrency (typical: a qualification's p50, the model's
  mean).

Measured figures come from this box's qualification ledger: a finished qualification of this
box's own spec as a unified box, at a floor at least the plan's, gives the "1 unified" row
(with the model's prediction beside it; "N unified" is then predicted as N times it). The
field points (`FIELD_K3`: one B300x8 box unified, ~552 tokens/s at 64 users; a 1P+1D pair
1,163 tokens/s at 64 users, every user above 32 tokens/s) are measured too, but elsewhere and
on their own workload, so they are cited beside the table (`references`), never put in a
profile's row. Everything else is PREDICTED by the model below.

A decode box's speed is a throughput, the output tokens/s it sustained (never its users
times the floor, which is only what each of them was promised): a decode box's own qualified
point where one is recorded (`decode_measured`), else at least what this box sustained as a
unified box (it also prefilled then), else the field pair's decode box.

No row claims that more boxes serve fewer users or fewer tokens/s than the one box measured
here without saying why: such a row's `limited_by` says what the model limits it by and that
the measured box is the better guide until that mix is measured.

The model (its assumptions; what a predicted figure means):

- Every box is like this one: same GPUs, weights and launch, each tuned for its role with the
  Tuning page's recommendation (`unified_capacity`: concurrent requests a unified or decode
  box's pools hold at the profile's lengths; a prefill box's pools must hold its few
  requests and the longest prompt, `prefill_fits`).
- A request is a mean prompt of `prompt_tokens` and a mean answer of `output_tokens` (the
  profile's lengths split as a qualification splits them). A share `cache_hit` of the prompt
  is found in the prefix cache and not prefilled again: this box's gateway records measure it
  on the traffic it served (0 without them).
- A box prefills `prefill_rate` prompt tokens/s and, while only decoding, sustains
  `decode_rate` output tokens/s summed over its users at the floor (None: unknown, then only
  memory and prefill limit a box).
- A unified box shares its time: each user at the floor costs `floor / decode_rate` of it for
  decoding and `floor * prompt / (answer * prefill_rate)` for prefilling its next request; the
  box is planned to at most `UTILISATION` busy, so queues stay finite.
- A decode box only decodes: it holds `decode_rate / floor` users at the floor, at most what
  its pools hold. The prefill boxes feed the decode boxes: together they prefill at most
  `UTILISATION` of `prefill_rate` each, so the mix holds no more users than that feeds.
  The KV handover over RDMA is taken as free beside the prefill.
- TTFT is a mean prompt's prefill time, queued as at a single server with fixed service time
  (M/D/1: `(1 + rho / (2 (1 - rho)))` times the service time) at the prefill's utilisation
  `rho`; on a unified box the prefill also runs only in the time decode leaves it.
- Output tokens/s: each user repeats "wait the TTFT, then stream an answer at its speed", so
  `users * speed * answer / (answer + speed * TTFT)`. The speed is the floor on a unified
  box; on a P/D mix the decode boxes' throughput shared by the users (never below the floor),
  as far as the prefill boxes, at most `UTILISATION` busy, feed the faster turns.
- Not modelled: speculative decoding's acceptance, a router's imbalance between boxes (and
  which prefill box holds a session's cached prefix), network limits.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from appliance.errors import EX_USAGE, ApplianceError
from appliance.qualify.ledger import Record
from appliance.qualify.plan import DEFAULT_FLOOR, PREFILL_GUESS
from appliance.tuning.observed import RequestRecord

DEFAULT_MIXES = ("1U", "1P+1D", "1P+2D", "2U")
MAX_BOXES = 16   # a custom mix's boxes, all roles together
MAX_MIXES = 8    # mixes in one plan
UTILISATION = 0.9
_MIX = re.compile(r"\s*(?:(\d{1,3})\s*U|(\d{1,3})\s*P\s*\+\s*(\d{1,3})\s*D)\s*", re.IGNORECASE)

Kind = Literal["measured", "predicted"]


class PlanInputError(ApplianceError):
    """A mix or floor the planner cannot take; says what it would take."""

    def __init__(self, message: str, hint: str) -> None:
        super().__init__("cell_plan_invalid", message, hint, status=422, exit_code=EX_USAGE)


@dataclass(frozen=True)
class Mix:
    """`unified` boxes serving alone side by side, or `prefill` + `decode` boxes in P/D."""

    unified: int = 0
    prefill: int = 0
    decode: int = 0

    @property
    def label(self) -> str:
        if self.unified:
            return f"{self.unified} unified"
        return f"{self.prefill}P+{self.decode}D"

    @property
    def boxes(self) -> int:
        return self.unified + self.prefill + self.decode


def parse_mix(text: str) -> Mix:
    """`1U`, `2U`, `1P+1D`, `1P+3D` (case and spaces free); at least one box of each role a
    mix needs, `MAX_BOXES` at most."""
    match = _MIX.fullmatch(text)
    if match is None:
        raise PlanInputError(f"{text[:40]!r} is not a mix",
                             "write NU for N unified boxes (e.g. 2U) or NP+MD for N prefill "
                             "and M decode boxes (e.g. 1P+3D)")
    unified, prefill, decode = (int(g) if g else 0 for g in match.groups())
    mix = Mix(unified, prefill, decode)
    if (unified == 0 and (prefill == 0 or decode == 0)) or mix.boxes > MAX_BOXES:
        raise PlanInputError(f"{text[:40]!r}: a mix needs 1 to {MAX_BOXES} boxes, a P/D mix at "
                             "least one prefill and one decode box",
                             "e.g. 1U, 2U, 1P+1D or 1P+3D")
    return mix


def parse_mixes(texts: Sequence[str]) -> tuple[Mix, ...]:
    """The default mixes, then the operator's (each once, `MAX_MIXES` in all)."""
    mixes: list[Mix] = []
    for text in (*DEFAULT_MIXES, *texts):
        for part in text.split(","):
            if part.strip() and (mix := parse_mix(part)) not in mixes:
                mixes.append(mix)
    if len(mixes) > MAX_MIXES:
        raise PlanInputError(f"{len(mixes)} mixes; at most {MAX_MIXES} in one plan",
                             "ask for fewer custom mixes")
    return tuple(mixes)


def check_floor(floor: float) -> float:
    if not (math.isfinite(floor) and 0 < floor <= 10_000):
        raise PlanInputError(f"a floor of {floor:g} tokens/s cannot be planned for",
                             f"give the per-user decode floor in tokens/s, e.g. "
                             f"{DEFAULT_FLOOR:g}")
    return floor


@dataclass(frozen=True)
class Point:
    """A measured operating point: `users` at once, `output_tps` in all, typical TTFT; with
    `floor_held` every user at or above `floor` tokens/s. `source` says where, in words."""

    users: int
    output_tps: float
    ttft_seconds: float | None
    floor_held: bool
    floor: float
    source: str


@dataclass(frozen=True)
class FieldPoints:
    """Figures measured elsewhere on the same model and hardware, cited."""

    unified: Point
    pair: Point  # one prefill and one decode box


FIELD_SOURCE = ("measured in the field on Kimi K3, 8xB300 per box, on its own workload, not "
                "on this box")
FIELD_K3 = FieldPoints(
    unified=Point(64, 552.0, None, False, DEFAULT_FLOOR,
                  f"{FIELD_SOURCE}: not every user held the floor"),
    pair=Point(64, 1163.0, None, True, DEFAULT_FLOOR,
               f"{FIELD_SOURCE}: every user above 32 tokens/s"))


def measured_point(record: Record, floor: float, profile: str = "") -> Point | None:
    """This box's qualification as a measured point: the qualified step's users, output and
    median TTFT, its source saying whether it ran `profile`'s workload. None when it found no
    point, or held a lower floor than the plan's."""
    if record.state != "done" or record.qualified is None or record.settings.floor < floor:
        return None
    step = next((s for s in record.steps if s.concurrency == record.qualified), None)
    output = step.mean("output_tps") if step else None
    if step is None or output is None:
        return None
    workload = record.settings.workload
    same = "this profile" if workload.name == f"profile:{profile}" else \
        f"{workload.title}, not this profile"
    return Point(record.qualified, output, step.mean("ttft_p50"), True, record.settings.floor,
                 f"measured on this box: qualification #{record.id} ({same}, floor "
                 f"{record.settings.floor:g} tokens/s)")


def measured_prefill_rate(record: Record) -> float | None:
    """Prompt tokens/s from the qualification's one-user step (its prompt over its median
    TTFT: one request alone, no queue); None without one."""
    step = next((s for s in record.steps if s.concurrency == 1), None)
    rates = [r.input_tokens / r.requests / r.ttft_p50 for r in (step.rounds if step else ())
             if r.requests and r.ttft_p50 and r.input_tokens]
    return sum(rates) / len(rates) if rates else None


@dataclass(frozen=True)
class PlanInputs:
    """Everything the plan is computed from (module docstring); frozen, gathered by the
    caller (appliance.api.cell_plan)."""

    profile: str
    profile_title: str
    prompt_tokens: float
    output_tokens: float
    floor: float
    unified_capacity: int
    prefill_fits: bool
    prefill_rate: float
    prefill_rate_basis: str
    decode_rate: float | None
    decode_rate_basis: str
    budget_basis: str
    measured: Point | None = None  # this box, unified
    decode_measured: Point | None = None  # a decode box's qualified point (its throughput)
    field: FieldPoints | None = None
    cache_hit: float = 0.0  # share of the prompt found in the prefix cache
    cache_hit_basis: str = "no prefix-cache hits counted: no traffic recorded on this box yet"


@dataclass(frozen=True)
class Figure:
    """One number of the plan, `kind` measured or predicted, and on what (`basis`). `model` is
    the model's own value beside a measured one (None where it is the value itself or cannot
    be said); `value` None: cannot be said (e.g. a TTFT that grows without bound)."""

    value: float | None
    kind: Kind
    basis: str
    model: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class MixPlan:
    """What one mix serves, and what limits it (`limited_by`, in words)."""

    mix: Mix
    users: Figure
    output_tps: Figure
    ttft_seconds: Figure
    limited_by: str

    def to_dict(self) -> dict[str, Any]:
        return {"mix": self.mix.label, "boxes": self.mix.boxes,
                "unified": self.mix.unified, "prefill": self.mix.prefill,
                "decode": self.mix.decode, "users": self.users.to_dict(),
                "output_tps": self.output_tps.to_dict(),
                "ttft_seconds": self.ttft_seconds.to_dict(), "limited_by": self.limited_by}


@dataclass(frozen=True)
class Reference:
    """A figure measured elsewhere, cited beside the plan: `mix` at `point`."""

    mix: Mix
    point: Point

    def to_dict(self) -> dict[str, Any]:
        p = self.point
        return {"mix": self.mix.label, "kind": "measured", "users": p.users,
                "output_tps": p.output_tps, "floor_held": p.floor_held, "floor": p.floor,
                "basis": p.source}


@dataclass(frozen=True)
class CellPlan:
    """The plan for one profile: a row per mix, the figures measured elsewhere
    (`references`), the basis of its predictions and the model's assumptions (the module
    docstring, short)."""

    inputs: PlanInputs
    rows: tuple[MixPlan, ...]
    references: tuple[Reference, ...]
    basis: str
    assumptions: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        i = self.inputs
        return {"profile": i.profile, "profile_title": i.profile_title, "floor": i.floor,
                "prompt_tokens": round(i.prompt_tokens), "output_tokens": round(i.output_tokens),
                "cache_hit": round(i.cache_hit, 3),
                "mixes": [r.to_dict() for r in self.rows],
                "references": [r.to_dict() for r in self.references], "basis": self.basis,
                "assumptions": list(self.assumptions)}


ASSUMPTIONS = (
    "every box is like this one, each tuned for its role as the Tuning page recommends",
    f"boxes are planned to at most {UTILISATION:.0%} busy; the router spreads users evenly",
    "TTFT queues as at one server with a fixed service time (M/D/1) at the prefill's load",
    "prefix-cache hits cut every box's prefill alike, at the share this box's traffic shows",
    "the KV handover between boxes (RDMA) is taken as free beside the prefill",
)


def plan_cell(inputs: PlanInputs, mixes: Sequence[Mix]) -> CellPlan:
    """Each mix's figures (module docstring). Invariants: a row's figure is measured only
    from this box's own qualification; every other row figure is the model's; the field's
    figures are only `references`."""
    basis = (f"predicted from the tuning model at the profile's mean request "
             f"({inputs.prompt_tokens:,.0f} tokens in, {inputs.output_tokens:,.0f} out): a "
             f"unified or decode box's pools hold {inputs.unified_capacity} of them "
             f"({inputs.budget_basis}); {inputs.cache_hit:.0%} of each prompt found in the "
             f"prefix cache ({inputs.cache_hit_basis}); prefill at "
             f"{inputs.prefill_rate:,.0f} prompt tokens/s per box ({inputs.prefill_rate_basis});"
             " decode "
             + (f"at {inputs.decode_rate:,.0f} tokens/s per box ({inputs.decode_rate_basis})"
                if inputs.decode_rate else f"speed unknown ({inputs.decode_rate_basis})"))
    field = inputs.field
    references = () if field is None else (Reference(Mix(unified=1), field.unified),
                                           Reference(Mix(prefill=1, decode=1), field.pair))
    return CellPlan(inputs, tuple(_row(inputs, mix) for mix in mixes), references, basis,
                    ASSUMPTIONS)


# --- the model ------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Predicted:
    users: int
    output_tps: float
    ttft: float | None
    limited_by: str


def _queued(service: float, rho: float) -> float | None:
    """M/D/1 mean time in system for a fixed `service` time at utilisation `rho`."""
    if rho >= 1:
        return None
    return service * (1 + rho / (2 * (1 - rho)))


def _output(users: int, floor: float, answer: float, ttft: float | None) -> float:
    if users <= 0:
        return 0.0
    wait = ttft if ttft is not None else 0.0
    return users * floor * answer / (answer + floor * wait)


def predict(inputs: PlanInputs, mix: Mix) -> _Predicted:
    """The model's figures for one mix (module docstring)."""
    f, answer = inputs.floor, inputs.output_tokens
    # What is really prefilled; at least a token, however high the hit share.
    prompt = max(inputs.prompt_tokens * (1 - inputs.cache_hit), 1.0)
    rate, decode = inputs.prefill_rate, inputs.decode_rate
    service = prompt / rate
    prefill_share = f * prompt / (answer * rate)  # of one box's time, per user at the floor
    decode_share = f / decode if decode else 0.0
    if mix.unified:
        by_speed = math.floor(UTILISATION / (prefill_share + decode_share))
        per_box = min(inputs.unified_capacity, by_speed)
        limited = ("each box's memory" if inputs.unified_capacity < by_speed
                   else "each box's time, shared between prefill and decode")
        busy_decoding = per_box * decode_share
        ttft = _queued(service / (1 - busy_decoding),
                       per_box * prefill_share / (1 - busy_decoding))
        users = per_box * mix.unified
        return _Predicted(users, _output(users, f, answer, ttft), ttft, limited)
    if not inputs.prefill_fits:
        return _Predicted(0, 0.0, None, "a prefill box cannot hold the longest prompt")
    by_speed = math.floor(decode / f) if decode else inputs.unified_capacity
    per_decode = min(inputs.unified_capacity, by_speed)
    decode_side = per_decode * mix.decode
    prefill_side = math.floor(UTILISATION * mix.prefill / prefill_share)
    users = min(decode_side, prefill_side)
    if prefill_side < decode_side:
        limited = "the prefill boxes (they feed fewer users than the decode boxes hold)"
    elif decode is None or inputs.unified_capacity < by_speed:
        limited = "the decode boxes' memory"
    else:
        limited = "the decode boxes' speed at the floor"
    # The decode boxes' throughput is shared by the users, each above the floor when there is
    # more than they need, as far as the prefill boxes can feed the faster turns it brings.
    speed = f
    if users > 0 and decode:
        fed = UTILISATION * mix.prefill * rate * answer / (users * prompt)
        speed = max(f, min(decode * mix.decode / users, fed))
    ttft = _queued(service, users * (speed * prompt / (answer * rate)) / mix.prefill)
    return _Predicted(users, _output(users, speed, answer, ttft), ttft, limited)


def _row(inputs: PlanInputs, mix: Mix) -> MixPlan:
    p = predict(inputs, mix)
    model = "predicted by the model" if inputs.measured is not None else (
        "predicted by the model: nothing is measured on this box yet (a qualification "
        "measures one box)")
    users = Figure(float(p.users), "predicted", model)
    output = Figure(round(p.output_tps, 1), "predicted", model)
    ttft = Figure(None if p.ttft is None else round(p.ttft, 2), "predicted",
                  model if p.ttft is not None else "grows without bound: the prefill is "
                  "saturated")
    point, scale = (inputs.measured, mix.unified) if mix.unified else (None, 0)
    if point is not None:
        measured: Kind = "measured" if scale == 1 else "predicted"
        source = point.source if scale == 1 else (
            f"{scale} x the figure of one box ({point.source}): boxes serving alone share "
            "nothing")
        if point.floor_held:
            users = Figure(float(point.users * scale), measured, source, float(p.users))
        output = Figure(round(point.output_tps * scale, 1), measured, source,
                        round(p.output_tps, 1))
        if point.ttft_seconds is not None:
            ttft = Figure(round(point.ttft_seconds, 2), measured, source, ttft.value)
    return MixPlan(mix, users, output, ttft, _below_one_box(inputs, mix, users, output, p))


def _below_one_box(inputs: PlanInputs, mix: Mix, users: Figure, output: Figure,
                   p: _Predicted) -> str:
    """`limited_by`, saying why when a mix of several boxes is predicted to serve fewer users
    or fewer tokens/s than the one box measured here."""
    one = inputs.measured
    if one is None or mix.boxes <= 1:
        return p.limited_by
    fewer = [what for what, value, measured in (
        ("users", users.value, float(one.users) if one.floor_held else None),
        ("output tokens/s", output.value, one.output_tps))
        if value is not None and measured is not None and value < measured]
    if not fewer:
        return p.limited_by
    why = ("its decode speed is only a lower bound, what this box sustained while it also "
           "prefilled" if mix.unified == 0 and inputs.decode_measured is None else
           "its rates are assumed or scaled, not measured on this mix")
    return (f"{p.limited_by}; below the one box measured here ({one.users} users, "
            f"{one.output_tps:,.0f} tokens/s) in {' and '.join(fewer)}: the model's limit "
            f"for this mix is lower than what one box did because {why}; trust the measured "
            "box until this mix is measured")


def decode_rate(measured: Point | None, field: FieldPoints | None,
                decoding: Point | None = None) -> tuple[float | None, str]:
    """Output tokens/s one box sustains while only decoding, a throughput (never users x
    floor): a decode box's qualified point, else at least what this box sustained as a
    unified box (it also prefilled then), else what the field's decode box sustained; None
    when none is known."""
    if decoding is not None:
        return (decoding.output_tps,
                f"{decoding.output_tps:,.0f} tokens/s sustained by a decode box at "
                f"{decoding.users} users ({decoding.source})")
    if measured is not None:
        return (measured.output_tps,
                f"at least the {measured.output_tps:,.0f} tokens/s this box sustained at its "
                f"{measured.users} qualified users, while it also prefilled")
    if field is not None:
        pair = field.pair
        return (pair.output_tps,
                f"the {pair.output_tps:,.0f} tokens/s the field's decode box sustained at "
                f"{pair.users} users, each above {pair.floor:g} tokens/s (not on this box)")
    return None, "no qualification of this box yet, and no field figure for this model"


MIN_CACHE_RECORDS = 50  # recorded requests before their hit share is trusted
MAX_CACHE_HIT = 0.99


def cache_hit(records: Sequence[RequestRecord]) -> tuple[float, str]:
    """The share of prompt tokens the prefix cache served, over the gateway's records of this
    box's traffic; 0 with fewer than `MIN_CACHE_RECORDS` or no prompt tokens."""
    prompt = sum(r.prompt_tokens for r in records)
    if len(records) < MIN_CACHE_RECORDS or prompt <= 0:
        return 0.0, (f"no prefix-cache hits counted: {len(records)} requests recorded on this "
                     f"box since its engine started ({MIN_CACHE_RECORDS} give a share)")
    share = min(sum(r.cached_tokens for r in records) / prompt, MAX_CACHE_HIT)
    return share, (f"measured on this box's traffic: {len(records):,} requests since its "
                   "engine started, not this profile's")


def prefill_rate(record: Record | None) -> tuple[float, str]:
    """Prompt tokens/s one box prefills: measured from this box's qualification when it has
    a one-user step, else the qualification planner's assumption."""
    measured = measured_prefill_rate(record) if record is not None else None
    if measured is not None and record is not None:
        return measured, (f"measured on this box: qualification #{record.id}'s one-user "
                          "prompt over its time to first token")
    return PREFILL_GUESS, "assumed, as the qualification planner assumes: not measured here"
