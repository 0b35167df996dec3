"""The two promises a qualification measures, and which of them a step broke (pure).

A qualification holds the decode floor (p10 across users, `verdict`) and, when one is given,
a time-to-first-token SLO judged at **p90** across a step's users. p90, not p99: a step has
1 to a few dozen users per repeat, so its p99 is its single slowest request (one unlucky
prefill moves the point), while p90 is the figure the issue's benchmark and the existing
ceiling already speak in; the gateway's early refusal (gateway.slo) keeps the admitted tail
within the class's SLO at run time. The SLO used is the run's `ttft_p90_max`: the operator's,
else the interactive class's `ttft_slo_seconds` when one is configured, else none (a
qualification of the floor alone, as before classes).
"""

from __future__ import annotations

from collections.abc import Mapping

from appliance.gateway.classes import INTERACTIVE, ServiceClass, effective
from appliance.qualify.verdict import Step

TTFT, DECODE, FAILURES, WEDGED = "ttft", "decode", "failures", "wedged"
WORDS = {TTFT: "the time to first token", DECODE: "the decode floor",
         FAILURES: "requests failed", WEDGED: "the engine stopped producing tokens"}


def class_ttft(classes: Mapping[str, ServiceClass]) -> float | None:
    """The interactive class's TTFT SLO in seconds (None: it promises none)."""
    return effective(classes)[INTERACTIVE].ttft_slo_seconds


def ttft_for(asked: float | None, from_class: bool,
             classes: Mapping[str, ServiceClass]) -> float | None:
    """The TTFT SLO a run holds: the one asked for, else (unless the operator said none) the
    interactive class's."""
    if asked is not None or not from_class:
        return asked
    return class_ttft(classes)


def broken(step: Step, floor: float, ttft_max: float | None) -> tuple[str, ...]:
    """Which promises `step` broke, in a fixed order (empty when it passed)."""
    found: list[str] = []
    if step.wedged:
        found.append(WEDGED)
    if step.failures:
        found.append(FAILURES)
    if any(r.decode_p10 is not None and r.decode_p10 < floor for r in step.rounds):
        found.append(DECODE)
    if ttft_max is not None and any(r.ttft_p90 is None or r.ttft_p90 > ttft_max
                                    for r in step.rounds):
        found.append(TTFT)
    return tuple(found)


def broken_words(step: Step, floor: float, ttft_max: float | None) -> str:
    """e.g. 'at 8 concurrent users the time to first token failed (4.10 s at p90, over the
    SLO of 2 s)'; empty when the step passed."""
    which = broken(step, floor, ttft_max)
    if not which:
        return ""
    parts = []
    for name in which:
        if name == TTFT and ttft_max is not None:
            seen = step.ttft_p90
            measured = "unmeasured" if seen is None else f"{seen:.2f} s at p90"
            parts.append(f"the time to first token ({measured}, over the SLO of "
                         f"{ttft_max:g} s)")
        elif name == DECODE and step.decode_p10 is not None:
            parts.append(f"the decode floor ({step.decode_p10:.1f} tokens/s at p10, under "
                         f"{floor:g})")
        else:
            parts.append(WORDS[name])
    users = "user" if step.concurrency == 1 else "users"
    return f"at {step.concurrency} concurrent {users} {' and '.join(parts)} failed"
