"""What the monitor tells the supervisor after an engine poll. Pure.

The engine costs about 90 minutes to start, so the policy is conservative by construction:

- an engine that is not serving (starting, loading, stopped, crashed, draining) gets nothing:
  a loading engine is never judged by a check, and a dead one is the supervisor's own business
  (its watcher sees the process end and takes the crash path);
- a serving engine (READY or DEGRADED) whose `engine.generate` or `engine.ready` check is
  CRITICAL is reported as failing (the supervisor turns READY into DEGRADED and raises an
  alert); when neither is CRITICAL it is reported healthy (the supervisor turns DEGRADED
  back into READY once every source is healthy);
- a restart only when the operator enabled it (`restart_degraded_after_minutes` > 0), the
  engine is DEGRADED, has been for that long, is still failing, no operator command is
  pending, and the policy has not already asked for one in this degraded spell. Never in a
  STARTING state, never when the operator stopped or is stopping it.

The monitor never kills anything: a restart is a `Command.RESTART` submitted to the
supervisor, which drains and restarts like an operator's would.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from appliance.engine.states import SERVING, EngineState
from appliance.health.model import CheckResult, Level

# The engine checks whose CRITICAL means "alive but not serving" (engine_checks.py), the
# broader symptom first: it is the one named when both fail.
VERDICT_CHECKS = ("engine.ready", "engine.generate")


@dataclass(frozen=True)
class EngineView:
    """What the policy needs from the supervisor, read just before deciding."""

    state: EngineState
    pending: str | None = None  # an operator or scheduled command waiting or running
    degraded_seconds: float | None = None  # how long DEGRADED (monotonic); None: not


@dataclass(frozen=True)
class Decision:
    """`report`: call `report_health(failure, hint)` (failure None: healthy again).
    `restart`: submit a RESTART as `actor`, and record `reason` as an event."""

    report: bool = False
    failure: str | None = None
    hint: str = ""
    restart: bool = False
    actor: str = ""
    reason: str = ""


NOTHING = Decision()


def decide(view: EngineView, results: Iterable[CheckResult], *,
           restart_after_minutes: int, restart_requested: bool) -> Decision:
    """The action after one engine poll. `restart_requested`: the policy already asked for a
    restart in this degraded spell (the monitor resets it when the engine leaves DEGRADED)."""
    if view.state not in SERVING:
        return NOTHING
    verdicts = [r for r in results if r.id in VERDICT_CHECKS]
    failing = [r for r in verdicts if r.level is Level.CRITICAL]
    if not failing:
        if not verdicts:
            return NOTHING  # nothing was judged (the watcher had no answer to give)
        return Decision(report=True, failure=None)
    cause = min(failing, key=lambda r: VERDICT_CHECKS.index(r.id))
    minutes = restart_after_minutes
    restart = (
        minutes > 0
        and view.state is EngineState.DEGRADED
        and view.degraded_seconds is not None
        and view.degraded_seconds >= minutes * 60
        and view.pending is None
        and not restart_requested
    )
    if not restart:
        return Decision(report=True, failure=cause.summary, hint=cause.hint)
    assert view.degraded_seconds is not None
    actor = f"health policy: degraded for {view.degraded_seconds / 60:.0f} min"
    reason = (f"restarting the engine: it has been degraded for "
              f"{view.degraded_seconds / 60:.0f} min ({cause.summary}) and "
              f"health.restart_degraded_after_minutes = {minutes} allows an automatic "
              "restart; set it to 0 to leave a degraded engine to the operator")
    return Decision(report=True, failure=cause.summary, hint=cause.hint, restart=True,
                    actor=actor, reason=reason)
