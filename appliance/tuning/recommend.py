"""The inverse of the calculator: from a workload, the memory split that serves it best.

`capacity` turns one `Sizing` into the number of concurrent requests it sustains at a length
distribution; `curve` states that for a list of ratios (the tuning page's chart);
`recommend` sweeps a fine grid of `--mamba-full-memory-ratio` values, finds where the state
limit and the KV limit cross (the balanced ratio), picks the ratio that fits the most
concurrent requests, checks whether pinning the state pool with `--max-mamba-cache-size` would
do better, and says in words what the choice buys and what it gives up. Pure: every number
comes from `calculator.size_pools`.

The capacity model (what `capacity` assumes, so what every figure here means):

- Decode-time steady state: each live request holds `mamba_slots_per_request` state slots
  (SGLang's scheduler cap, `sizing.max_running_requests`, already counts them) and KV rows
  for its whole context (prompt + tokens generated so far).
- KV is one shared pool, so it is the *mean* context that fills it:
  `kv_limit = floor(logical_tokens / mean)`. The longest request must still fit on its own.
- No prefix sharing (a radix-cache hit would make KV go further), page rounding ignored (at
  most one page per request), prefill chunks and retraction headroom ignored.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

from appliance.errors import EX_DATAERR, ApplianceError
from appliance.tuning.calculator import CalculatorError, Launch, Sizing, size_pools
from appliance.tuning.geometry import Geometry
from appliance.tuning.profiles import LengthDistribution, format_tokens
from appliance.tuning.roles import RoleTarget

GRID_LOW = 0.02
GRID_HIGH = 50.0
GRID_PER_DECADE = 96  # 2.4 % steps; the crossing is then refined to 3 digits
PIN_MIN_KV_GAIN = 0.05  # a pin is worth its rigidity only for >= 1 request or >= 5 % more KV
UNCAPPED = 1 << 20  # a --max-running-requests no state pool reaches (what lifting it gives)


class RecommendError(ApplianceError):
    """No memory split can be computed for this budget and launch."""

    exit_code = EX_DATAERR

    def __init__(self, message: str, hint: str) -> None:
        super().__init__("tuning_impossible", message, hint, status=422)


@dataclass(frozen=True)
class Capacity:
    """Concurrent requests one sizing sustains at one length distribution.

    `concurrent == min(state_limit, kv_limit)`, or 0 when the longest request does not fit in
    the whole KV pool; `binding` is the pool that runs out first ("kv" when the longest does
    not fit). `state_limited_by` is the calculator's reason for `state_limit` (state slots, the
    requested `--max-running-requests`, KV rows).
    """

    concurrent: int
    state_limit: int
    kv_limit: int
    fits_longest: bool
    binding: Literal["state", "kv"]
    logical_tokens: int
    state_limited_by: str

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def capacity(sizing: Sizing, lengths: LengthDistribution) -> Capacity:
    """See the module docstring for the model and its assumptions."""
    state_limit = max(0, sizing.max_running_requests)
    kv_limit = max(0, math.floor(sizing.logical_tokens / lengths.mean()))
    fits = lengths.max <= sizing.logical_tokens
    concurrent = min(state_limit, kv_limit) if fits else 0
    binding: Literal["state", "kv"] = "state" if fits and state_limit <= kv_limit else "kv"
    return Capacity(concurrent, state_limit, kv_limit, fits, binding, sizing.logical_tokens,
                    str(sizing.running_limited_by))


@dataclass(frozen=True)
class CurvePoint:
    """One ratio on the chart: the two limits and what the workload gets (their minimum, or
    0 where the longest request does not fit)."""

    ratio: float
    state_limit: int
    kv_limit: int
    concurrent: int

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def ratio_grid(low: float = GRID_LOW, high: float = GRID_HIGH,
               per_decade: int = GRID_PER_DECADE) -> tuple[float, ...]:
    """Geometric ratios from `low` to `high`, each rounded to 3 significant digits."""
    steps = math.ceil(math.log10(high / low) * per_decade)
    values = {_round_sig(low * (high / low) ** (i / steps), 3) for i in range(steps + 1)}
    return tuple(sorted(values))


def curve(geometry: Geometry, launch: Launch, budget_bytes: int, lengths: LengthDistribution,
          ratios: Iterable[float]) -> list[CurvePoint]:
    """The chart's points; a ratio SGLang would refuse at this budget (no state slot fits) is
    left out. A pin in `launch` is ignored: the chart is about the ratio."""
    free = _unpinned(launch)
    points = []
    for ratio in ratios:
        cap = _capacity_at(geometry, free, budget_bytes, lengths, ratio)
        if cap is not None:
            points.append(CurvePoint(ratio, cap.state_limit, cap.kv_limit, cap.concurrent))
    return points


@dataclass(frozen=True)
class Recommendation:
    """The split to use for one workload, and what it buys over the current one.

    `ratio` is the recommended `--mamba-full-memory-ratio`; `pin`, when not None, the
    `--max-mamba-cache-size` that would serve better still (exactly the slots the workload
    needs, the rest to KV); `pin_capacity` what it gives. `balanced_ratio` is the smallest
    3-digit ratio where the state limit reaches the KV limit (None when they do not cross
    within the grid). Both pools grow in whole slots and pages, so at high ratios one more
    state slot can take several requests' worth of KV: the limits cross by a jump, not always
    at equality. `target_range` is the span of grid ratios that meet
    `target_concurrency` (None when none does). `cap_note` says what raising a binding
    `--max-running-requests` cap would give when the target is not met ("" otherwise).
    """

    ratio: float
    recommended: Capacity
    current_ratio: float
    current: Capacity
    gain: int
    binding: Literal["state", "kv"]
    balanced_ratio: float | None
    pin: int | None
    pin_capacity: Capacity | None
    pin_note: str
    cap_note: str
    target_concurrency: int
    meets_target: bool
    target_range: tuple[float, float] | None
    gives_up: str
    summary: str
    mean_tokens: int
    longest_tokens: int
    sizing: Sizing
    role: RoleTarget | None = None  # the cell role it was sized for (None: a box alone)

    def to_dict(self) -> dict[str, Any]:
        data = {key: value for key, value in self.__dict__.items() if key != "sizing"}
        data["role"] = self.role.to_dict() if self.role else None
        data["recommended"] = self.recommended.to_dict()
        data["current"] = self.current.to_dict()
        data["pin_capacity"] = self.pin_capacity.to_dict() if self.pin_capacity else None
        data["target_range"] = list(self.target_range) if self.target_range else None
        data["sizing"] = self.sizing.to_dict()
        return data


def recommend(geometry: Geometry, launch: Launch, budget_bytes: int,
              lengths: LengthDistribution, *, target_concurrency: int,
              current_ratio: float, grid: Sequence[float] | None = None,
              role: RoleTarget | None = None) -> Recommendation:
    """The ratio that fits the most concurrent requests of `lengths` (ties: the lowest, which
    leaves the most KV headroom), with the balanced ratio, an optional pin, and the words.

    `launch` is the current launch: its `max_mamba_cache_size`, if set, applies to the
    current capacity only (SGLang ignores the ratio under a pin); the sweep is unpinned.

    `role` (appliance.tuning.roles) sizes for a cell role: its concurrency replaces
    `target_concurrency`, and its `--max-running-requests` (a prefill's few requests at once)
    applies to both the current and the recommended split, so the recommendation is the
    lowest ratio that holds them, with the rest of the memory as KV. None, or a unified or
    decode target, recommends exactly as for a box serving alone.
    """
    if role is not None:
        target_concurrency = role.concurrency
        if role.max_running_requests is not None:
            launch = replace(launch, max_running_requests=role.max_running_requests)
    free = _unpinned(launch)
    ratios = sorted(set(grid if grid is not None else ratio_grid()))
    swept = _sweep(geometry, free, budget_bytes, lengths, ratios)
    if not swept:
        raise RecommendError(
            f"no ratio from {ratios[0]:g} to {ratios[-1]:g} leaves room for one state slot "
            f"and the KV cache in a budget of {budget_bytes / 2**30:.2f} GiB per GPU",
            "check the budget (the engine's last startup log, or --budget-gib) and the launch "
            "flags; a smaller --max-running-requests or --mamba-ssm-dtype bfloat16 needs less")
    crossing = _crossing(geometry, free, budget_bytes, lengths, swept)
    balanced = _round_up_sig(crossing, 3) if crossing is not None else None
    if crossing is not None:
        # The optimum sits at the crossing: look at 3-digit ratios just around it as well.
        local = {_round_sig(crossing * (1 + k / 1000), 3) for k in range(-12, 13)}
        swept = sorted([*swept, *_sweep(geometry, free, budget_bytes, lengths,
                                        sorted(local - set(ratios)))], key=lambda x: x[0])
    best = max(swept, key=lambda item: (item[2].concurrent, item[2].logical_tokens, -item[0]))
    ratio, sizing, chosen = _nicer(geometry, free, budget_bytes, lengths, best)
    current_sizing = _size(geometry, launch, budget_bytes, current_ratio)
    current = (capacity(current_sizing, lengths) if current_sizing is not None
               else Capacity(0, 0, 0, False, "state", 0, "no state slot fits"))
    meeting = [r for r, _, cap in swept if cap.concurrent >= target_concurrency]
    target_range = (meeting[0], meeting[-1]) if meeting else None
    pin, pin_cap = _pin(geometry, free, budget_bytes, lengths, chosen, sizing)
    pin_note = _pin_note(pin, pin_cap, chosen, ratio, sizing)
    cap_note = ""
    if chosen.concurrent < target_concurrency and chosen.state_limited_by == "requested":
        raised = recommend(geometry, replace(free, max_running_requests=UNCAPPED), budget_bytes,
                           lengths, target_concurrency=target_concurrency,
                           current_ratio=current_ratio, grid=grid)
        if raised.recommended.concurrent > chosen.concurrent:
            cap_note = (f"{_limit_reason(chosen, launch)} holds it at {chosen.concurrent}: "
                        f"with --max-running-requests {raised.recommended.concurrent} and "
                        f"ratio {_r(raised.ratio)} it would fit {raised.recommended.concurrent}")
    mean = round(lengths.mean())
    return Recommendation(
        ratio=ratio, recommended=chosen, current_ratio=current_ratio, current=current,
        gain=chosen.concurrent - current.concurrent, binding=chosen.binding,
        balanced_ratio=balanced, pin=pin, pin_capacity=pin_cap, pin_note=pin_note,
        cap_note=cap_note,
        target_concurrency=target_concurrency,
        meets_target=chosen.concurrent >= target_concurrency, target_range=target_range,
        gives_up=_gives_up(ratio, chosen, current_ratio, current, launch, geometry),
        summary=_summary(ratio, chosen, current_ratio, current, lengths, target_concurrency,
                         launch),
        mean_tokens=mean, longest_tokens=lengths.max, sizing=sizing, role=role)


# --- the sweep ----------------------------------------------------------------------------


def _unpinned(launch: Launch) -> Launch:
    return replace(launch, max_mamba_cache_size=None) if launch.max_mamba_cache_size else launch


def _size(geometry: Geometry, launch: Launch, budget: int, ratio: float) -> Sizing | None:
    try:
        return size_pools(geometry, launch, budget, ratio)
    except CalculatorError:
        return None  # SGLang refuses this split at this budget: no point on the curve


def _capacity_at(geometry: Geometry, launch: Launch, budget: int, lengths: LengthDistribution,
                 ratio: float) -> Capacity | None:
    sizing = _size(geometry, launch, budget, ratio)
    return capacity(sizing, lengths) if sizing is not None else None


def _round_sig(value: float, digits: int) -> float:
    return float(f"{value:.{digits}g}")


def _round_up_sig(value: float, digits: int) -> float:
    """`value` rounded up to `digits` significant digits (so the limits still cross there)."""
    scale = 10 ** (digits - 1 - math.floor(math.log10(value)))
    return _round_sig(math.ceil(value * scale - 1e-9) / scale, digits)


def _nicer(geometry: Geometry, launch: Launch, budget: int, lengths: LengthDistribution,
           best: tuple[float, Sizing, Capacity]) -> tuple[float, Sizing, Capacity]:
    """The best swept ratio, or a 1- or 2-significant-digit neighbour that fits as many requests
    and is lower (so has at least as much KV): people type 0.45, not 0.447."""
    ratio, _, cap = best
    for candidate in sorted({_round_sig(ratio, 2), _round_sig(ratio, 1)}):
        if candidate == ratio or candidate <= 0:
            continue
        other = _size(geometry, launch, budget, candidate)
        if other is None:
            continue
        other_cap = capacity(other, lengths)
        if other_cap.concurrent > cap.concurrent or (
                other_cap.concurrent == cap.concurrent and candidate < ratio):
            return candidate, other, other_cap
    return best


def _sweep(geometry: Geometry, launch: Launch, budget: int, lengths: LengthDistribution,
           ratios: Iterable[float]) -> list[tuple[float, Sizing, Capacity]]:
    out = []
    for ratio in ratios:
        sizing = _size(geometry, launch, budget, ratio)
        if sizing is not None:
            out.append((ratio, sizing, capacity(sizing, lengths)))
    return out


def _crossing(geometry: Geometry, launch: Launch, budget: int, lengths: LengthDistribution,
              swept: list[tuple[float, Sizing, Capacity]]) -> float | None:
    """The smallest ratio where the rising state limit reaches the falling KV limit: found in
    the first grid interval whose left end has state < KV and right end state >= KV, then
    bisected. None when the curves do not cross on the grid (a cap holds the state limit
    under the KV limit, or state binds even at the lowest ratio)."""
    for (r0, _, c0), (r1, _, c1) in itertools.pairwise(swept):
        if c0.state_limit < c0.kv_limit and c1.state_limit >= c1.kv_limit:
            low, high = r0, r1
            for _ in range(48):
                middle = (low + high) / 2
                cap = _capacity_at(geometry, launch, budget, lengths, middle)
                if cap is not None and cap.state_limit >= cap.kv_limit:
                    high = middle
                else:
                    low = middle
            return high
    return None


def _pin(geometry: Geometry, launch: Launch, budget: int, lengths: LengthDistribution,
         chosen: Capacity, sizing: Sizing) -> tuple[int | None, Capacity | None]:
    """The `--max-mamba-cache-size` that serves better than the chosen ratio, if any: the
    fewest slots for the most requests (n requests need n x slots-per-request), the rest of the
    budget to KV. Offered only for one more request or >= 5 % more KV."""
    per = max(1, sizing.mamba_slots_per_request)

    def at(n: int) -> Capacity | None:
        pinned = _size(geometry, replace(launch, max_mamba_cache_size=n * per), budget, 1.0)
        return capacity(pinned, lengths) if pinned is not None else None

    # Largest n whose state limit still fits under the KV limit (kv_limit falls as n grows).
    low, high = 0, max(1, chosen.state_limit) * 2 + 8
    while low < high:
        middle = (low + high + 1) // 2
        cap = at(middle)
        if cap is not None and cap.fits_longest and cap.state_limit <= cap.kv_limit and (
                cap.state_limit >= middle):
            low = middle
        else:
            high = middle - 1
    options = [(n, c) for n in (low, low + 1) if n >= 1 and (c := at(n)) is not None]
    if not options:
        return None, None
    n, best = max(options, key=lambda item: (item[1].concurrent, item[1].logical_tokens))
    more_requests = best.concurrent > chosen.concurrent
    more_kv = (best.concurrent == chosen.concurrent and chosen.logical_tokens > 0
               and best.logical_tokens >= chosen.logical_tokens * (1 + PIN_MIN_KV_GAIN))
    if best.concurrent > 0 and (more_requests or more_kv):
        return n * per, best
    return None, None


# --- the words ----------------------------------------------------------------------------


def _r(ratio: float) -> str:
    return f"{ratio:g}"


def _pin_note(pin: int | None, cap: Capacity | None, chosen: Capacity, ratio: float,
              sizing: Sizing) -> str:
    if pin is None or cap is None:
        return ""
    per = max(1, sizing.mamba_slots_per_request)
    return (f"pinning --max-mamba-cache-size {pin} ({pin // per} requests x {per} slots) fits "
            f"{cap.concurrent} concurrent requests with {format_tokens(cap.logical_tokens)} "
            f"tokens of KV, against {chosen.concurrent} with "
            f"{format_tokens(chosen.logical_tokens)} at ratio {_r(ratio)}; the pin holds the "
            "state pool fixed when the budget changes, the ratio scales with it")


def _gives_up(ratio: float, chosen: Capacity, current_ratio: float, current: Capacity,
              launch: Launch, geometry: Geometry) -> str:
    if math.isclose(ratio, current_ratio) and not launch.max_mamba_cache_size:
        return "nothing: it is the current setting"
    context = geometry.context_length
    if chosen.logical_tokens < current.logical_tokens:
        before = min(current.logical_tokens, context)
        after = min(chosen.logical_tokens, context)
        if after >= before:
            return (f"KV capacity drops from {format_tokens(current.logical_tokens)} to "
                    f"{format_tokens(chosen.logical_tokens)} tokens (less room for the prefix "
                    f"cache); a single request still reaches the model's "
                    f"{format_tokens(context)} context")
        return (f"the longest single request it can hold drops from {format_tokens(before)} "
                f"to {format_tokens(after)} tokens")
    if chosen.state_limit < current.state_limit:
        return (f"the most requests the state pool admits at once drops from "
                f"{current.state_limit} to {chosen.state_limit}, so bursts of short requests "
                "queue sooner")
    return (f"nothing: the state slots it drops were unused ({_limit_reason(chosen, launch)} "
            f"holds running requests at {chosen.state_limit}), and KV grows from "
            f"{format_tokens(current.logical_tokens)} to {format_tokens(chosen.logical_tokens)} "
            "tokens")


def _limit_reason(cap: Capacity, launch: Launch) -> str:
    if cap.state_limited_by == "requested":
        flag = launch.max_running_requests
        return (f"--max-running-requests {flag}" if flag is not None
                else "the speculative-decoding default --max-running-requests")
    if cap.state_limited_by == "kv":
        return "SGLang's KV rows // 2 cap"
    if cap.state_limited_by == "estimate":
        return "SGLang's default running-request estimate"
    return "the state pool"


def _summary(ratio: float, chosen: Capacity, current_ratio: float, current: Capacity,
             lengths: LengthDistribution, target: int, launch: Launch) -> str:
    if not chosen.fits_longest:
        return (f"no ratio holds the longest request ({format_tokens(lengths.max)} tokens) in "
                f"this budget: the most KV any ratio gives is "
                f"{format_tokens(chosen.logical_tokens)} tokens, at ratio {_r(ratio)}; shorten "
                "the longest requests or add memory (fp8 KV, more GPUs, DCP)")
    sessions = (f"concurrent requests averaging {format_tokens(lengths.mean())} tokens "
                f"(longest {format_tokens(lengths.max)})")
    if launch.max_mamba_cache_size:
        now = f"the current pin (--max-mamba-cache-size {launch.max_mamba_cache_size})"
    else:
        now = f"ratio {_r(current_ratio)}"
    head = f"{now} fits {current.concurrent} {sessions}"
    if not current.fits_longest and current.logical_tokens:
        head += (f", as its {format_tokens(current.logical_tokens)}-token KV pool cannot hold "
                 "the longest")
    change = chosen.concurrent - current.concurrent
    if math.isclose(ratio, current_ratio) and not launch.max_mamba_cache_size:
        text = f"{head}; that is already the best ratio"
    elif change == 0:
        text = (f"{head}; ratio {_r(ratio)} fits the same {chosen.concurrent} with KV for "
                f"{format_tokens(chosen.logical_tokens)} tokens instead of "
                f"{format_tokens(current.logical_tokens)}")
    else:
        text = f"{head}; ratio {_r(ratio)} fits {chosen.concurrent} ({change:+d})"
    if chosen.binding == "kv":
        text += f". At {_r(ratio)} the KV pool fills first"
    elif chosen.state_limited_by == "state":
        text += f". At {_r(ratio)} the state pool fills first"
    else:
        text += f". At {_r(ratio)} {_limit_reason(chosen, launch)} binds first"
    verdict = "met" if chosen.concurrent >= target else f"not met (best {chosen.concurrent})"
    return f"{text}; target {target}: {verdict}."
