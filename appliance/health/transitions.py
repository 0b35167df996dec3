"""Which level changes to record: a failure once when it starts, not at every poll. Pure.

The monitor remembers each check's last known level (`Known`, check id -> level) and, after
every poll, asks `changes(known, results, at)` what moved:

- OK -> WARN or CRITICAL: a *failure* (recorded once, however many polls it lasts);
- WARN <-> CRITICAL: a *change* (recorded once);
- WARN or CRITICAL -> OK: a *recovery* (recorded once).

A check never seen before counts as having been OK: one that first appears failing is a
failure, one that first appears OK records nothing.

A check that disappears from the results (the per-GPU checks of a GPU NVML no longer
enumerates, or every GPU check while NVML hangs) is **not** a recovery: nothing is recorded,
and its last known level is kept (`remember` only updates the ids it is given). When it
comes back, it is compared with that level, so a GPU that was hot before NVML hung and is
still hot after records nothing new, and one that cooled down meanwhile records a recovery.
The monitor seeds `Known` from the stored history at start, so a daemon restart does not
record every ongoing failure again.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from appliance.health.model import CheckResult, Level

Known = Mapping[str, Level]


@dataclass(frozen=True)
class Transition:
    """One recorded level change of one check, with the result that caused it."""

    at: dt.datetime
    result: CheckResult
    previous: Level

    @property
    def check_id(self) -> str:
        return self.result.id

    @property
    def level(self) -> Level:
        return self.result.level

    @property
    def kind(self) -> str:
        return kind_of(self.previous, self.level)


def kind_of(previous: Level, level: Level) -> str:
    """"failure" (from OK), "recovery" (to OK) or "change" (WARN <-> CRITICAL)."""
    if previous is Level.OK:
        return "failure"
    return "recovery" if level is Level.OK else "change"


def changes(known: Known, results: Iterable[CheckResult], at: dt.datetime) -> list[Transition]:
    """The transitions from `known` levels to `results`, in the results' order."""
    return [
        Transition(at=at, result=result, previous=known.get(result.id, Level.OK))
        for result in results
        if result.level is not known.get(result.id, Level.OK)
    ]


def remember(known: Known, results: Iterable[CheckResult]) -> dict[str, Level]:
    """`known` updated with `results`' levels; ids absent from `results` keep theirs."""
    updated = dict(known)
    updated.update((result.id, result.level) for result in results)
    return updated
