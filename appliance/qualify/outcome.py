"""A qualification's values and words, pure: what an operator asks for (`Request`), what a run
will do (`Planned`, `summary`), its progress, how it ended (`outcome`) and the box's
standing, shared by the service, the API, the console and the CLI."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

from appliance.qualify import ledger, plan
from appliance.qualify.climb import Climbed
from appliance.qualify.promises import broken_words
from appliance.qualify.verdict import Step, ended_words, qualified_point, verdict_words


@dataclass(frozen=True)
class Request:
    """What an operator asks for (the API body, the CLI flags, the console form)."""

    floor: float = plan.DEFAULT_FLOOR
    ttft_p90_max: float | None = None
    # no ttft_p90_max given: hold the interactive class's TTFT SLO (False: no TTFT SLO at all)
    ttft_from_class: bool = True
    repeats: int = plan.DEFAULT_REPEATS
    ladder: tuple[int, ...] | None = None
    workload: str = "harsh"                 # harsh | profile:NAME | replay
    input_tokens: int | None = None         # the harsh load's prompt (default 8,192)
    output_tokens: int | None = None        # the harsh load's answer (default 1,000)
    wedge_seconds: float = plan.DEFAULT_WEDGE_SECONDS
    continue_from: int | None = None        # a lower-bound qualification to climb on from


@dataclass(frozen=True)
class Planned:
    settings: plan.Settings
    estimate_seconds: float
    spec_hash: str
    engine_version: str
    carried: tuple[Step, ...] = ()  # a continued ladder: the passed steps it starts from

    def to_dict(self) -> dict[str, Any]:
        return {"settings": self.settings.to_dict(), "estimate_seconds": round(
            self.estimate_seconds), "spec_hash": self.spec_hash,
            "engine_version": self.engine_version, "summary": summary(self)}


def summary(planned: Planned) -> str:
    """What a run will do, in words, for the confirmation."""
    s = planned.settings
    minutes = max(1, round(planned.estimate_seconds / 60))
    repeats = "once" if s.repeats == 1 else f"{s.repeats} times"
    carried = {step.concurrency for step in planned.carried}
    todo = [c for c in s.ladder if c not in carried]
    steps = ", ".join(str(c) for c in todo)
    start = (f"continues qualification {s.continues} from {max(carried)} concurrent users "
             f"(its steps are kept); " if s.continues is not None and carried else "")
    scale = (f" The engine runs on a time scale of {s.time_scale:g} (a time-scaled "
             "emulator): every figure is in the engine's time." if s.time_scale != 1 else "")
    return (f"{start}{s.workload.describe()}; {len(todo)} steps ({steps} concurrent users), "
            f"each run {repeats} after flushing the prefix cache; about {minutes} min at "
            f"most. The gateway refuses users (503) for the whole run.{scale}")


@dataclass(frozen=True)
class Progress:
    """The running qualification, for the status answers (frozen: replaced, not edited)."""

    qid: int
    started_at: dt.datetime
    estimate_seconds: float
    phase: str = "starting"
    concurrency: int | None = None
    repeat: int | None = None
    steps_done: int = 0
    steps_total: int = 0

    @property
    def ends_at(self) -> dt.datetime:
        """When the run should end (what the gateway's refusals tell users)."""
        return self.started_at + dt.timedelta(seconds=self.estimate_seconds)

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.qid, "started_at": self.started_at.isoformat(),
                "ends_at": self.ends_at.isoformat(),
                "estimate_seconds": round(self.estimate_seconds), "phase": self.phase,
                "concurrency": self.concurrency, "repeat": self.repeat,
                "steps_done": self.steps_done, "steps_total": self.steps_total}


def outcome(settings: plan.Settings, steps: tuple[Step, ...], climbed: Climbed,
            error: str) -> tuple[str, int | None, str]:
    """The state, the qualified point and the verdict a run ends with. A climb the engine
    stopped early is `done` at its last passed step when one passed (a lower bound, said
    so), `failed` when none did, so it never replaces an earlier qualification with
    nothing."""
    state = climbed.outcome
    point = qualified_point(steps) if state == "done" else None
    if state == "done" and climbed.stopped and point is None:
        state, error = "failed", error or climbed.stopped
    if state != "done":
        return state, None, ended_words(state, error)
    words = verdict_words(point, settings.floor, settings.ttft_p90_max, steps,
                          max_running=settings.max_running_requests, stopped=climbed.stopped)
    failing = next((s for s in sorted(steps, key=lambda s: s.concurrency) if not s.passed),
                   None)
    if point is not None and failing is not None:  # which promise the point stopped short of
        words += f"; {broken_words(failing, settings.floor, settings.ttft_p90_max)}"
    if climbed.retried:
        rounds = "round was" if climbed.retried == 1 else "rounds were"
        words += (f" ({climbed.retried} {rounds} measured again after the engine left "
                  "READY)")
    if settings.time_scale != 1:
        words += f" (in the engine's time: its time scale is {settings.time_scale:g})"
    return state, point, words


def standing(spec: str | None, current: ledger.Record | None) -> str:
    """The box's standing in words (the console's and the CLI's first line)."""
    if spec is None:
        return "no engine is running, so nothing can be qualified"
    if current is None:
        return (f"unqualified: the running engine (launch configuration {spec[:12]}) has "
                "never been qualified")
    return current.verdict


def time_scale_of(info: dict[str, Any]) -> float:
    """Wall seconds per engine second: a time-scaled emulator's `emulator_time_scale`, 1 for
    a real engine (which has no such field)."""
    value = info.get("emulator_time_scale")
    return float(value) if isinstance(value, int | float) and 0 < value <= 1000 else 1.0
