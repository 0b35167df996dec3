"""Workload profiles: who uses the box, as a request-length distribution and a concurrency target.

A profile is data, not code: a `LengthDistribution` (percentiles of tokens per live request,
context = prompt + tokens generated so far) and the number of concurrent requests the operator
hopes to serve. The built-ins below cover the common shapes; custom profiles are stored in the
database (`appliance.tuning.store`) and validated by the same functions, so a bad value is
refused with the field it concerns, whichever door it came through.

Invariants of `LengthDistribution`:

- `points` is non-empty; percentiles strictly increase, lie in (0, 100] and end at 100; tokens
  never decrease and are >= 1; `minimum` (the 0th percentile) is >= 1 and <= the first point.
- The quantile function is piecewise-linear through (0, minimum) and every point, so `quantile`
  is monotone, `quantile(100) == max` and `minimum <= mean() <= max`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from appliance.errors import EX_DATAERR, ApplianceError
from appliance.sizes import tokens_text

K = 1024  # context lengths are quoted in binary K/M (128K = 131,072 tokens) across the ecosystem
M = K * K


class ProfileError(ApplianceError):
    """A profile value cannot be used; `field` names the offending input (e.g. `lengths.p90`)."""

    exit_code = EX_DATAERR

    def __init__(self, field: str, message: str, hint: str, *, code: str = "profile_invalid",
                 status: int = 422) -> None:
        super().__init__(code, f"{field}: {message}", hint, status=status)
        self.field = field


# Token counts have one form everywhere (appliance/sizes.py); the tuning modules call it by
# this name.
format_tokens = tokens_text


@dataclass(frozen=True)
class LengthDistribution:
    """Tokens per live request as percentiles; see the module docstring for invariants.

    Build it with `LengthDistribution.of(...)`, which validates; the constructor does too.
    """

    points: tuple[tuple[float, int], ...]
    minimum: int = 1

    def __post_init__(self) -> None:
        _validate_points(self.points, self.minimum, "lengths")

    @classmethod
    def of(cls, points: Iterable[Sequence[float]], minimum: int | None = None,
           *, field: str = "lengths") -> LengthDistribution:
        """Validated distribution from `(percentile, tokens)` pairs; `minimum` defaults to 1."""
        pairs: list[tuple[float, int]] = []
        for index, pair in enumerate(points):
            if len(pair) != 2:
                raise ProfileError(f"{field}[{index}]", f"expected [percentile, tokens], got "
                                   f"{list(pair)!r}", "give each point as a pair, e.g. [50, 6000]")
            p, tokens = pair
            pairs.append((_number(p, f"{field}[{index}].percentile"),
                          _int(tokens, f"{field}.p{_label(p)}")))
        low = 1 if minimum is None else _int(minimum, f"{field}.minimum")
        _validate_points(tuple(pairs), low, field)
        return cls(tuple(pairs), low)

    @property
    def max(self) -> int:
        """The longest request (the 100th percentile)."""
        return self.points[-1][1]

    def quantile(self, p: float) -> float:
        """Tokens at percentile `p` in [0, 100], linear between the stated points."""
        if not 0 <= p <= 100:
            raise ValueError(f"percentile {p} is outside [0, 100]")
        previous_p, previous_t = 0.0, float(self.minimum)
        for point_p, point_t in self.points:
            if p <= point_p:
                share = (p - previous_p) / (point_p - previous_p)
                return previous_t + share * (point_t - previous_t)
            previous_p, previous_t = point_p, float(point_t)
        return float(self.max)  # unreachable: the last point is 100

    def mean(self) -> float:
        """The mean of the piecewise-linear quantile function (the area under it / 100)."""
        total, previous_p, previous_t = 0.0, 0.0, float(self.minimum)
        for point_p, point_t in self.points:
            total += (point_p - previous_p) * (previous_t + point_t) / 2
            previous_p, previous_t = point_p, float(point_t)
        return total / 100

    def scaled(self, factor: float) -> LengthDistribution:
        """Every percentile (and the minimum) times `factor` (> 0), rounded, at least 1."""
        if factor <= 0:
            raise ValueError("the scale factor must be positive")
        return LengthDistribution(
            tuple((p, max(1, round(t * factor))) for p, t in self.points),
            max(1, round(self.minimum * factor)),
        )

    def describe(self) -> str:
        """`p50 6K, p90 59K, p99 195K, max 256K`."""
        parts = [f"p{_label(p)} {format_tokens(t)}" for p, t in self.points[:-1]]
        return ", ".join([*parts, f"max {format_tokens(self.max)}"])

    def to_dict(self) -> dict[str, Any]:
        return {"minimum": self.minimum, "percentiles": [[p, t] for p, t in self.points],
                "mean": round(self.mean()), "max": self.max}

    def to_json(self) -> str:
        return json.dumps({"minimum": self.minimum,
                           "percentiles": [[p, t] for p, t in self.points]})

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], *, field: str = "lengths") -> LengthDistribution:
        """From `{"minimum": 1, "percentiles": [[50, 6000], ..., [100, 262144]]}`."""
        points = data.get("percentiles")
        if not isinstance(points, list) or not all(isinstance(x, list | tuple) for x in points):
            raise ProfileError(f"{field}.percentiles", "missing or not a list of "
                               "[percentile, tokens] pairs",
                               'give e.g. [[50, 6000], [90, 60000], [100, 262144]]')
        minimum = data.get("minimum")
        return cls.of(points, None if minimum is None else minimum, field=field)

    @classmethod
    def from_json(cls, text: str, *, field: str = "lengths") -> LengthDistribution:
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise ProfileError(field, f"not valid JSON ({exc})", "store the distribution as "
                               "JSON written by LengthDistribution.to_json") from exc
        if not isinstance(data, dict):
            raise ProfileError(field, "not a JSON object", 'expected {"percentiles": [...]}')
        return cls.from_mapping(data, field=field)


@dataclass(frozen=True)
class Profile:
    """A named workload: `lengths` of live requests and the concurrency the operator wants."""

    name: str
    title: str
    description: str
    lengths: LengthDistribution
    target_concurrency: int
    builtin: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "title": self.title, "description": self.description,
                "lengths": self.lengths.to_dict(), "target_concurrency": self.target_concurrency,
                "builtin": self.builtin}


_NAME = re.compile(r"[a-z][a-z0-9]*(?:-[a-z0-9]+)*")
NAME_MAX = 40
TITLE_MAX = 80
DESCRIPTION_MAX = 2000
TARGET_MAX = 100_000


def validate_name(name: str) -> str:
    """A slug: lowercase letters, digits and single hyphens, starting with a letter."""
    if not (2 <= len(name) <= NAME_MAX) or not _NAME.fullmatch(name):
        raise ProfileError("name", f"{name!r} is not a valid profile name",
                           f"use 2-{NAME_MAX} lowercase letters, digits and single hyphens, "
                           "starting with a letter, e.g. 'support-bots'")
    return name


def make_profile(name: str, title: str, description: str, lengths: LengthDistribution,
                 target_concurrency: int, *, builtin: bool = False) -> Profile:
    """A validated profile; every refusal is a `ProfileError` naming its field."""
    validate_name(name)
    title = title.strip()
    if not title or len(title) > TITLE_MAX:
        raise ProfileError("title", f"must be 1-{TITLE_MAX} characters", "give a short title, "
                           "e.g. 'Support bots'")
    if len(description) > DESCRIPTION_MAX:
        raise ProfileError("description", f"is longer than {DESCRIPTION_MAX} characters",
                           "shorten it")
    target = _int(target_concurrency, "target_concurrency")
    if not 1 <= target <= TARGET_MAX:
        raise ProfileError("target_concurrency", f"{target} is outside 1..{TARGET_MAX}",
                           "give the number of requests you expect at the same time, at least 1")
    return Profile(name, title, description.strip(), lengths, target, builtin)


def with_changes(profile: Profile, **changes: Any) -> Profile:
    """`profile` with `changes` applied and validated again (for edits)."""
    updated = replace(profile, **changes)
    return make_profile(updated.name, updated.title, updated.description, updated.lengths,
                        updated.target_concurrency, builtin=updated.builtin)


# --- validation helpers -------------------------------------------------------------------------

def _label(p: Any) -> str:
    return f"{p:g}" if isinstance(p, int | float) else str(p)


def _number(value: Any, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
        raise ProfileError(field, f"{value!r} is not a number", "give a number")
    return float(value)


def _int(value: Any, field: str) -> int:
    if isinstance(value, bool):
        raise ProfileError(field, f"{value!r} is not a whole number", "give a whole number")
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if not isinstance(value, int):
        raise ProfileError(field, f"{value!r} is not a whole number", "give a whole number")
    return value


def _validate_points(points: tuple[tuple[float, int], ...], minimum: int, field: str) -> None:
    if not points:
        raise ProfileError(f"{field}.percentiles", "is empty", "give at least [[100, max_tokens]]")
    if isinstance(minimum, bool) or not isinstance(minimum, int) or minimum < 1:
        raise ProfileError(f"{field}.minimum", f"{minimum!r} is below 1 token",
                           "give the shortest request in tokens, at least 1")
    previous_p, previous_t = 0.0, minimum
    for p, tokens in points:
        where = f"{field}.p{_label(p)}"
        if not 0 < p <= 100:
            raise ProfileError(where, f"percentile {p:g} is outside (0, 100]",
                               "use percentiles above 0 and at most 100")
        if p <= previous_p:
            raise ProfileError(where, "percentiles must strictly increase",
                               "list the points in increasing percentile order, each once")
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
            raise ProfileError(where, f"{tokens!r} is not a token count >= 1",
                               "give whole tokens, at least 1")
        if tokens < previous_t:
            below = "the minimum" if previous_p == 0 else f"p{_label(previous_p)}"
            raise ProfileError(where, f"{tokens} tokens is below {below} ({previous_t})",
                               "a higher percentile cannot be shorter; tokens must not decrease")
        previous_p, previous_t = p, tokens
    if points[-1][0] != 100:
        raise ProfileError(f"{field}.p100", "the distribution does not reach the 100th "
                           "percentile", "end with [100, longest_request_tokens]")


def _dist(minimum: int, *points: tuple[float, int]) -> LengthDistribution:
    return LengthDistribution(tuple(points), minimum)


# Numbers are tokens per live request (prompt + generated so far), in binary K.
BUILTIN: tuple[Profile, ...] = (
    make_profile(
        "coding-agent", "Coding agent",
        "Agent loops (IDE agents, CLI agents) that resend a growing transcript each turn: "
        "long, growing contexts, few users at once.",
        # A turn starts from a system prompt plus tool schemas (~8K) and grows with every file
        # read and tool result; sessions commonly sit at tens of K, long ones compact near
        # 128-256K, and a few run to 400K on K3's 1M window.
        _dist(8 * K, (25, 24 * K), (50, 48 * K), (75, 96 * K), (90, 160 * K), (99, 256 * K),
              (100, 400 * K)),
        32, builtin=True),
    make_profile(
        "chat", "Chat",
        "Short conversational turns from many users: short contexts, high concurrency.",
        # Chat turns are a few hundred tokens of history plus the reply: median ~2K, a quarter
        # past 4K as conversations run on; pasted documents make a p99 around 16K, rarely 32K.
        _dist(256, (50, 2 * K), (75, 4 * K), (90, 8 * K), (99, 16 * K), (100, 32 * K)),
        256, builtin=True),
    make_profile(
        "long-document", "Long documents",
        "A few very long prompts at a time: contracts, books, whole repositories, up to the "
        "1M context.",
        # Whole-document analysis: nothing under ~200K is worth this profile; typical inputs
        # are 500K+ and the largest fill K3's 1,048,576-token window.
        _dist(192 * K, (25, 384 * K), (50, 512 * K), (90, 800 * K), (100, M)),
        4, builtin=True),
    make_profile(
        "balanced", "Balanced",
        "A mix of chat, tools and some long context; a default when the workload is unknown.",
        # Half chat-sized, a long tail of agent and document work up to 256K.
        _dist(512, (50, 16 * K), (90, 96 * K), (99, 200 * K), (100, 256 * K)),
        64, builtin=True),
)
BUILTIN_NAMES = frozenset(p.name for p in BUILTIN)


def builtin_profile(name: str) -> Profile | None:
    return next((p for p in BUILTIN if p.name == name), None)
