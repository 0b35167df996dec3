"""What a qualification will do, before it does it (pure).

The ladder of concurrencies climbs 1, 2, 4, 8, 16, 24, 32, 48, 64, then by halves of powers
of two (96, 128, 192, 256, …), and always ends at the engine's `max_running_requests`: the
engine can never run more at once, so nothing above it is worth measuring. A workload is a
short cycle of request shapes (input and output tokens); user `i` of a round sends shape
`i mod len(shapes)`. The estimate is an upper bound in the ordinary case: every step's every
repeat at the floor speed, plus the prefill and the cache flush.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from appliance.tuning.profiles import LengthDistribution, Profile

DEFAULT_FLOOR = 32.0          # decode tokens per second, at p10 across users
DEFAULT_REPEATS = 3
DEFAULT_WEDGE_SECONDS = 60.0  # no token on any stream this long: the engine is wedged
HARSH_INPUT, HARSH_OUTPUT = 8192, 1000
BASE_LADDER = (1, 2, 4, 8, 16, 24, 32, 48, 64)
PROFILE_SAMPLES = 16          # shapes drawn from a profile's length distribution
PREFILL_GUESS = 20_000.0      # prompt tokens per second the estimate assumes (the whole box)
FLUSH_SECONDS = 2.0           # a cache flush and the settling around it, per round
MAX_STEPS = 64
MAX_CONCURRENCY = 4096
MAX_REPEATS = 10


class PlanError(ValueError):
    """A setting that cannot be planned; `field` names it, the message says what would do."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message


@dataclass(frozen=True)
class Shape:
    """One request: `input_tokens` of prompt, exactly `output_tokens` of answer."""

    input_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class Workload:
    """A named cycle of request shapes. `name` is `harsh`, `profile:NAME` or `replay`."""

    name: str
    title: str
    shapes: tuple[Shape, ...]

    def __post_init__(self) -> None:
        if not self.shapes:
            raise PlanError("workload", f"{self.name} has no request shapes")

    def shape(self, user: int) -> Shape:
        return self.shapes[user % len(self.shapes)]

    @property
    def longest_output(self) -> int:
        return max(s.output_tokens for s in self.shapes)

    def describe(self) -> str:
        if len(self.shapes) == 1:
            s = self.shapes[0]
            return f"{self.title}: {s.input_tokens:,} tokens in, {s.output_tokens:,} out"
        ins = sorted(s.input_tokens for s in self.shapes)
        outs = sorted(s.output_tokens for s in self.shapes)
        return (f"{self.title}: {ins[0]:,} to {ins[-1]:,} tokens in, "
                f"{outs[0]:,} to {outs[-1]:,} out ({len(self.shapes)} shapes)")

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "title": self.title,
                "shapes": [[s.input_tokens, s.output_tokens] for s in self.shapes]}

    @classmethod
    def from_dict(cls, body: dict[str, Any]) -> Workload:
        return cls(str(body["name"]), str(body["title"]),
                   tuple(Shape(int(i), int(o)) for i, o in body["shapes"]))


def harsh(input_tokens: int = HARSH_INPUT, output_tokens: int = HARSH_OUTPUT) -> Workload:
    """The default: every user sends the same long prompt shape and decodes a long answer."""
    return Workload("harsh", "Harsh load", (Shape(input_tokens, output_tokens),))


def split_length(total: int) -> Shape:
    """A request of `total` tokens as prompt and answer: a ninth is answer (the harsh load's
    own 8,192:1,000 proportion), at least 1 and at most 1,000 tokens."""
    output = min(HARSH_OUTPUT, max(1, total // 9))
    return Shape(max(1, total - output), output)


def shapes_of(lengths: LengthDistribution, samples: int = PROFILE_SAMPLES) -> tuple[Shape, ...]:
    """Request shapes at evenly spaced percentiles of a length distribution, each split into
    prompt and answer (`split_length`): how a profile becomes requests, for a qualification
    and for the tuning of a prefill box alike."""
    return tuple(split_length(max(2, round(lengths.quantile(100.0 * (k + 0.5) / samples))))
                 for k in range(samples))


def from_profile(profile: Profile, samples: int = PROFILE_SAMPLES) -> Workload:
    """Shapes at evenly spaced percentiles of a tuning profile's length distribution."""
    return Workload(f"profile:{profile.name}", f"Profile {profile.title}",
                    shapes_of(profile.lengths, samples))


def from_usage(pairs: Iterable[tuple[int, int]], samples: int = PROFILE_SAMPLES) -> Workload:
    """The box's own traffic shape: `samples` requests at evenly spaced ranks of the recorded
    (prompt, completion) token pairs, ordered by total length."""
    usable = sorted((p, c) for p, c in pairs if p > 0 and c > 0)
    if not usable:
        raise PlanError("workload", "the gateway has recorded no answered request with "
                        "token counts yet; use the harsh load or a profile")
    usable.sort(key=lambda pc: pc[0] + pc[1])
    picks = [usable[min(len(usable) - 1, int(len(usable) * (k + 0.5) / samples))]
             for k in range(samples)]
    return Workload("replay", "Replay of this box's traffic",
                    tuple(Shape(p, c) for p, c in picks))


def ladder(max_running: int, base: Sequence[int] = BASE_LADDER) -> tuple[int, ...]:
    """The concurrencies to try, ascending, ending at `max_running` (see the module doc)."""
    if max_running < 1:
        raise PlanError("max_running_requests", f"{max_running} is not a usable engine limit")
    steps = [c for c in base if c <= max_running]
    step = 64
    while steps and steps[-1] >= 64 and step < max_running:
        step = step * 3 // 2 if step & (step - 1) == 0 else step * 4 // 3
        if step < max_running:
            steps.append(step)
    if not steps or steps[-1] != max_running:
        steps.append(max_running)
    return tuple(steps)


def custom_ladder(values: Iterable[int], max_running: int | None) -> tuple[int, ...]:
    """An operator's ladder: distinct, ascending, each within 1…max_running_requests."""
    steps = sorted(set(values))
    if not steps:
        raise PlanError("ladder", "no step given; e.g. 1,2,4,8")
    if steps[0] < 1:
        raise PlanError("ladder", f"{steps[0]} concurrent users cannot be measured; start at 1")
    limit = max_running or MAX_CONCURRENCY
    if steps[-1] > limit:
        raise PlanError("ladder", f"{steps[-1]} is above the engine's limit of {limit} "
                        "running requests; it would only queue")
    if len(steps) > MAX_STEPS:
        raise PlanError("ladder", f"{len(steps)} steps; at most {MAX_STEPS}")
    return tuple(steps)


@dataclass(frozen=True)
class Settings:
    """Everything a qualification is run with; stored with its result."""

    workload: Workload
    ladder: tuple[int, ...]
    floor: float = DEFAULT_FLOOR            # decode tok/s every user must hold (p10)
    ttft_p90_max: float | None = None       # seconds; None: no ceiling
    repeats: int = DEFAULT_REPEATS
    wedge_seconds: float = DEFAULT_WEDGE_SECONDS
    max_running_requests: int | None = None
    notes: tuple[str, ...] = field(default=())
    # Wall seconds per engine second (a time-scaled emulator says it; real SGLang: 1): every
    # figure is measured in the engine's time, as its /metrics are.
    time_scale: float = 1.0
    continues: int | None = None  # the qualification whose passed steps this one extends

    def __post_init__(self) -> None:
        if not 0 < self.floor <= 10_000:
            raise PlanError("floor", f"{self.floor:g} tokens/s is not a usable floor")
        if self.ttft_p90_max is not None and not 0 < self.ttft_p90_max <= 3600:
            raise PlanError("ttft_p90_max", f"{self.ttft_p90_max:g} s is not a usable ceiling")
        if not 1 <= self.repeats <= MAX_REPEATS:
            raise PlanError("repeats", f"{self.repeats}: give 1 to {MAX_REPEATS}")
        if not 1 <= self.wedge_seconds <= 3600:
            raise PlanError("wedge_seconds", f"{self.wedge_seconds:g} s: give 1 to 3600")
        if not 0 < self.time_scale <= 1000:
            raise PlanError("time_scale", f"{self.time_scale:g} is not a usable time scale")
        if not self.ladder:
            raise PlanError("ladder", "no step given")

    def to_dict(self) -> dict[str, Any]:
        return {"workload": self.workload.to_dict(), "ladder": list(self.ladder),
                "floor": self.floor, "ttft_p90_max": self.ttft_p90_max,
                "repeats": self.repeats, "wedge_seconds": self.wedge_seconds,
                "max_running_requests": self.max_running_requests,
                "time_scale": self.time_scale, "continues": self.continues}

    @classmethod
    def from_dict(cls, body: dict[str, Any]) -> Settings:
        ttft = body.get("ttft_p90_max")
        limit = body.get("max_running_requests")
        continues = body.get("continues")  # absent in rows from before it was stored
        return cls(Workload.from_dict(body["workload"]), tuple(int(c) for c in body["ladder"]),
                   float(body["floor"]), None if ttft is None else float(ttft),
                   int(body["repeats"]), float(body["wedge_seconds"]),
                   None if limit is None else int(limit),
                   time_scale=float(body.get("time_scale", 1.0)),
                   continues=None if continues is None else int(continues))


def round_seconds(settings: Settings, concurrency: int) -> float:
    """One round at `concurrency`, if every user decodes at the floor: the prefill of every
    prompt, the longest answer at the floor speed, and the flush before it."""
    prompts = sum(settings.workload.shape(u).input_tokens for u in range(concurrency))
    decode = settings.workload.longest_output / settings.floor
    return FLUSH_SECONDS + prompts / PREFILL_GUESS + decode


def estimate_seconds(settings: Settings, skip: Iterable[int] = ()) -> float:
    """The whole ladder, every step repeated (the runner stops at the first failing step, so
    a box that fails early takes less), in wall seconds; `skip`: steps already measured (a
    continued ladder)."""
    done = set(skip)
    engine = sum(settings.repeats * round_seconds(settings, c) for c in settings.ladder
                 if c not in done)
    return engine * settings.time_scale


def continued(passed: Sequence[int], max_running: int | None,
              steps: Sequence[int] | None = None) -> tuple[int, ...]:
    """The ladder of a run continuing one whose every step passed: its steps, then the steps
    above its top (the operator's, or the default ladder's up to the engine's limit)."""
    top = max(passed)
    above = [c for c in (steps or (ladder(max_running) if max_running else ())) if c > top]
    if not above:
        limit = max_running or MAX_CONCURRENCY
        raise PlanError("ladder", f"nothing above {top} to measure" + (
            f" (the engine runs at most {limit} requests at once)" if max_running else
            "; give the steps to try"))
    return custom_ladder([*passed, *above], max_running)
