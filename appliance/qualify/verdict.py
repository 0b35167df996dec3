"""Per-step statistics from per-request samples, and the qualified-point rule (pure).

A user's decode speed is the tokens after its first divided by the time from the first token
to the last (`(output_tokens - 1) / (end - first_token)`): what a person watching the answer
stream sees, with the queueing and the prefill left to TTFT. The floor is judged at p10
across a round's users: one user in ten may be slower, no more.

A step passes when every repeat held the floor (decode p10 ≥ floor), the TTFT ceiling (p90 ≤
the ceiling, when one is set), had zero failures and no wedge. The **qualified point** is the
highest step that passed with every lower step passing too: a box that fails at 8 and passes
at 16 is not trusted at 16. Percentiles interpolate linearly between ranks (numpy's default).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class Sample:
    """One request of a round, as the runner saw it (times in seconds on one monotonic clock).

    `gaps` are the inter-token gaps of its stream; `error` is empty when it finished."""

    sent_at: float
    first_token_at: float | None
    end_at: float | None
    output_tokens: int
    input_tokens: int
    gaps: tuple[float, ...] = ()
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and self.end_at is not None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.sent_at

    @property
    def decode_rate(self) -> float | None:
        """Tokens per second after the first; None when there is no second token to time."""
        if not self.ok or self.first_token_at is None or self.end_at is None:
            return None
        span = self.end_at - self.first_token_at
        if self.output_tokens < 2 or span <= 0:
            return None
        return (self.output_tokens - 1) / span


def percentile(values: Sequence[float], p: float) -> float | None:
    """The `p`th percentile (0-100) of `values`, linear between ranks; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(frozen=True)
class Round:
    """One repeat of one step: what every table row and the verdict are made of."""

    concurrency: int
    repeat: int
    requests: int
    failures: int
    wedged: bool
    seconds: float
    output_tokens: int
    input_tokens: int
    output_tps: float
    total_tps: float
    ttft_p50: float | None
    ttft_p90: float | None
    ttft_p99: float | None
    itl_p50: float | None
    itl_p90: float | None
    itl_p99: float | None
    decode_p10: float | None
    kv_peak: float | None = None     # the engine's KV pool in use, 0-1, highest seen
    state_peak: float | None = None  # its state (mamba) pool in use, 0-1, highest seen
    error: str = ""                  # the first failure, in the engine's or the client's words

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, body: dict[str, Any]) -> Round:
        known: dict[str, Any] = {k: v for k, v in body.items() if k in cls.__dataclass_fields__}
        return cls(**known)


def round_of(concurrency: int, repeat: int, samples: Sequence[Sample], seconds: float, *,
             wedged: bool = False, kv_peak: float | None = None,
             state_peak: float | None = None) -> Round:
    """The statistics of one round. Throughput counts every token delivered, finished or not,
    over the round's wall time; latencies and decode speeds count finished requests only."""
    done = [s for s in samples if s.ok]
    failed = [s for s in samples if not s.ok]
    ttfts = [t for s in done if (t := s.ttft) is not None]
    gaps = [g for s in done for g in s.gaps]
    rates = [r for s in done if (r := s.decode_rate) is not None]
    out = sum(s.output_tokens for s in samples)
    inp = sum(s.input_tokens for s in samples if s.first_token_at is not None)
    span = max(seconds, 1e-9)
    return Round(
        concurrency=concurrency, repeat=repeat, requests=len(samples), failures=len(failed),
        wedged=wedged, seconds=round(seconds, 3), output_tokens=out, input_tokens=inp,
        output_tps=round(out / span, 2), total_tps=round((out + inp) / span, 2),
        ttft_p50=_r(percentile(ttfts, 50)), ttft_p90=_r(percentile(ttfts, 90)),
        ttft_p99=_r(percentile(ttfts, 99)), itl_p50=_r(percentile(gaps, 50)),
        itl_p90=_r(percentile(gaps, 90)), itl_p99=_r(percentile(gaps, 99)),
        decode_p10=_r(percentile(rates, 10), 2), kv_peak=kv_peak, state_peak=state_peak,
        error=next((s.error for s in failed if s.error), "no answer" if failed else ""))


def _r(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


@dataclass(frozen=True)
class Step:
    """Every repeat of one concurrency and whether it passed (`reasons`: why not)."""

    concurrency: int
    rounds: tuple[Round, ...]
    passed: bool
    reasons: tuple[str, ...]

    @property
    def decode_p10(self) -> float | None:
        """The slowest repeat's p10 (the one the floor is judged on)."""
        values = [r.decode_p10 for r in self.rounds if r.decode_p10 is not None]
        return min(values) if values else None

    @property
    def ttft_p90(self) -> float | None:
        values = [r.ttft_p90 for r in self.rounds if r.ttft_p90 is not None]
        return max(values) if values else None

    def mean(self, name: str) -> float | None:
        values = [v for r in self.rounds if (v := getattr(r, name)) is not None]
        return sum(values) / len(values) if values else None

    def worst(self, name: str) -> float | None:
        values = [v for r in self.rounds if (v := getattr(r, name)) is not None]
        return max(values) if values else None

    @property
    def failures(self) -> int:
        return sum(r.failures for r in self.rounds)

    @property
    def wedged(self) -> bool:
        return any(r.wedged for r in self.rounds)

    def to_dict(self) -> dict[str, Any]:
        return {"concurrency": self.concurrency, "passed": self.passed,
                "reasons": list(self.reasons), "decode_p10": self.decode_p10,
                "ttft_p90": self.ttft_p90, "output_tps": _r(self.mean("output_tps"), 2),
                "total_tps": _r(self.mean("total_tps"), 2), "failures": self.failures,
                "wedged": self.wedged, "rounds": [r.to_dict() for r in self.rounds]}


def judge(concurrency: int, rounds: Iterable[Round], *, floor: float,
          ttft_p90_max: float | None, repeats: int) -> Step:
    """Whether one step passed, with every reason it did not (in the operator's words)."""
    done = tuple(rounds)
    reasons: list[str] = []
    if len(done) < repeats:
        reasons.append(f"only {len(done)} of {repeats} repeats ran")
    for r in done:
        which = f"repeat {r.repeat}"
        if r.wedged:
            reasons.append(f"{which}: the engine stopped producing tokens (wedged)")
        if r.failures:
            noun = "request" if r.failures == 1 else "requests"
            reasons.append(f"{which}: {r.failures} {noun} failed"
                           + (f" ({r.error})" if r.error else ""))
        if r.decode_p10 is None:
            if not r.wedged and not r.failures:
                reasons.append(f"{which}: no user's decode speed could be measured")
        elif r.decode_p10 < floor:
            reasons.append(f"{which}: the slowest users decoded at {r.decode_p10:.1f} "
                           f"tokens/s (p10), under the floor of {floor:g}")
        if ttft_p90_max is not None and (r.ttft_p90 is None or r.ttft_p90 > ttft_p90_max):
            seen = "unmeasured" if r.ttft_p90 is None else f"{r.ttft_p90:.2f} s"
            reasons.append(f"{which}: time to first token (p90) {seen}, over the ceiling "
                           f"of {ttft_p90_max:g} s")
    return Step(concurrency, done, not reasons, tuple(reasons))


def qualified_point(steps: Sequence[Step]) -> int | None:
    """The highest concurrency that passed with every lower step passing (module doc)."""
    point = None
    for step in sorted(steps, key=lambda s: s.concurrency):
        if not step.passed:
            break
        point = step.concurrency
    return point


def steps_from(body: Sequence[dict[str, Any]]) -> tuple[Step, ...]:
    """Steps back from their stored form (`Step.to_dict`)."""
    return tuple(Step(int(s["concurrency"]), tuple(Round.from_dict(r) for r in s["rounds"]),
                      bool(s["passed"]), tuple(s["reasons"])) for s in body)


def lower_bound(point: int | None, steps: Sequence[Step], max_running: int | None) -> bool:
    """Whether `point` is only a lower bound: no step failed, so the ladder stopped at its top
    before the box reached its limit (a step above it might pass too). The engine's own
    `max_running` is a true ceiling: a ladder that reached it measured all there is."""
    if point is None or not steps or not all(s.passed for s in steps):
        return False
    top = max(s.concurrency for s in steps)
    return point == top and (max_running is None or point < max_running)


def verdict_words(point: int | None, floor: float, ttft_p90_max: float | None,
                  steps: Sequence[Step], *, max_running: int | None = None,
                  stopped: str = "") -> str:
    """The verdict in words, as the console and the CLI say it. `stopped`: why the climb
    ended before a step failed or the ladder's top (the engine would not stay READY), with
    what was not measured; a point it leaves is a lower bound, and the box is admitted at it."""
    ceiling = (f" and sees a first token within {ttft_p90_max:g} s (p90)"
               if ttft_p90_max is not None else "")
    if point is not None:
        users = "user" if point == 1 else "users"
        speed = f"every user at or above {floor:g} tokens/s{ceiling}"
        if stopped:
            return (f"qualified for at least {point} concurrent {users} (the ladder stopped "
                    f"at {point}: {stopped}): {speed}; the gateway admits at {point}")
        if lower_bound(point, steps, max_running):
            return (f"qualified for at least {point} concurrent {users} (the ladder stopped "
                    f"at {point}; no step failed, so more may pass: continue the ladder to "
                    f"find the point): {speed}")
        return f"qualified at {point} concurrent {users}: {speed}"
    if not steps:
        return "not qualified: no step was measured" + (f" ({stopped})" if stopped else "")
    first = sorted(steps, key=lambda s: s.concurrency)[0]
    users = "user" if first.concurrency == 1 else "users"
    why = first.reasons[0] if first.reasons else "it did not pass"
    return f"not qualified: already at {first.concurrency} concurrent {users}, {why}"


def ended_words(state: str, error: str) -> str:
    """The verdict of a run that ended without one (cancelled, failed, interrupted): the state
    once, then why (never "failed: failed: …")."""
    words = {"cancelled": "cancelled", "failed": "not qualified: the run failed",
             "interrupted": "interrupted"}.get(state, state)
    return f"{words}: {error}" if error else words
