"""The engine's states and the pure rules between them.

The supervisor is the only writer of engine state; these functions decide, it acts. Nothing
here does IO or reads a clock: callers pass times in.

    STOPPED → PREFLIGHT → LAUNCHING → LOADING_WEIGHTS → ALLOCATING → CAPTURING_GRAPHS
            → WARMING → READY ⇄ DEGRADED → DRAINING → STOPPING → STOPPED
    crash → BACKOFF → (retry) … → FAILED (operator action)     live engine at start → ADOPTED
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class EngineState(enum.Enum):
    STOPPED = "stopped"
    PREFLIGHT = "preflight"
    LAUNCHING = "launching"
    LOADING_WEIGHTS = "loading_weights"
    ALLOCATING = "allocating"
    CAPTURING_GRAPHS = "capturing_graphs"
    WARMING = "warming"
    READY = "ready"
    DEGRADED = "degraded"
    DRAINING = "draining"
    STOPPING = "stopping"
    BACKOFF = "backoff"
    FAILED = "failed"
    ADOPTED = "adopted"

    @property
    def label(self) -> str:
        return self.value.replace("_", " ")


# States in which an engine process exists (or is being created) on this box.
LIVE = frozenset({
    EngineState.LAUNCHING, EngineState.LOADING_WEIGHTS, EngineState.ALLOCATING,
    EngineState.CAPTURING_GRAPHS, EngineState.WARMING, EngineState.READY, EngineState.DEGRADED,
    EngineState.DRAINING, EngineState.STOPPING, EngineState.ADOPTED,
})
# States of a start in progress: no health check may ever restart the engine here.
STARTING = frozenset({
    EngineState.PREFLIGHT, EngineState.LAUNCHING, EngineState.LOADING_WEIGHTS,
    EngineState.ALLOCATING, EngineState.CAPTURING_GRAPHS, EngineState.WARMING,
})
SERVING = frozenset({EngineState.READY, EngineState.DEGRADED})
# The order of the start, for "phases never go backwards".
START_ORDER = (
    EngineState.LAUNCHING, EngineState.LOADING_WEIGHTS, EngineState.ALLOCATING,
    EngineState.CAPTURING_GRAPHS, EngineState.WARMING, EngineState.READY,
)


def admits_requests(state: EngineState) -> bool:
    """The gateway forwards new requests only to a READY engine. DEGRADED is alive but
    failing (/ready or a generation fails: a wedged scheduler would hold every request until
    its timeout), so new requests get a 503 with Retry-After while requests already in
    flight finish; draining stops admission too."""
    return state is EngineState.READY


def later_start_phase(current: EngineState, candidate: EngineState) -> EngineState:
    """The further along of two start phases; a start never moves backwards."""
    if current not in START_ORDER or candidate not in START_ORDER:
        return candidate
    return max(current, candidate, key=START_ORDER.index)


class Command(enum.Enum):
    START = "start"
    STOP = "stop"
    RESTART = "restart"
    ROLLBACK = "rollback"  # start with the last launch spec that reached READY


def refusal(state: EngineState, command: Command) -> str | None:
    """Why `command` cannot run in `state` (a sentence), or None when it can."""
    if command in (Command.START, Command.ROLLBACK) and state in LIVE | {EngineState.PREFLIGHT}:
        return f"the engine is already {state.label}"
    if command in (Command.START, Command.ROLLBACK) and state is EngineState.BACKOFF:
        return None  # starting now skips the wait
    if command is Command.STOP and state is EngineState.STOPPED:
        return "the engine is already stopped"
    if command is Command.RESTART and state in STARTING:
        return f"the engine is {state.label}; stop it first if you really mean to start over"
    return None


# --- crashes ------------------------------------------------------------------------------

# Reasons that fail the same way on every retry: go straight to FAILED.
PERMANENT = frozenset({"bad_argument", "weights_error"})


@dataclass(frozen=True)
class CrashDecision:
    retry: bool
    delay_seconds: float
    reason: str
    hint: str


def backoff_delay(attempt: int, base: float = 30.0, cap: float = 900.0) -> float:
    """Exponential backoff: 30 s, 60 s, 120 s … capped at 15 minutes (attempt starts at 1)."""
    return float(min(cap, base * 2 ** max(0, attempt - 1)))


def decide_after_crash(
    reason: str, hint: str, attempt: int, max_retries: int, backoff_base: float = 30.0
) -> CrashDecision:
    """What to do after attempt number `attempt` ended in a crash classified as `reason`."""
    if reason in PERMANENT:
        hint = hint or "fix the cause; a retry would fail the same way"
        return CrashDecision(False, 0.0, reason, hint)
    if attempt > max_retries:
        return CrashDecision(
            False, 0.0, reason,
            f"{hint} The engine crashed {attempt} times in a row; it stays stopped until you "
            "start it (or roll back to the last configuration that reached READY).".strip(),
        )
    return CrashDecision(True, backoff_delay(attempt, base=backoff_base), reason, hint)


def reason_from_exit(code: int | None) -> tuple[str, str]:
    """A classification from the exit status alone, when the log said nothing clearer."""
    if code is None:
        return "unknown", "the engine is gone and its exit status is unknown; read its log"
    if code < 0:
        names = {9: "SIGKILL", 15: "SIGTERM", 6: "SIGABRT", 11: "SIGSEGV"}
        name = names.get(-code, f"signal {-code}")
        hint = ("killed by the kernel's OOM killer or an operator: check `journalctl -k`"
                if -code == 9 else "read the engine log for what sent it")
        return "signal", f"the engine died from {name}; {hint}"
    if code == 2:
        return "bad_argument", "SGLang rejected its arguments; fix the flag named in the log"
    return "unknown", f"the engine exited with status {code}; read the end of its log"


def stop_outcome(code: int | None) -> str:
    """How an engine the supervisor stopped (SIGTERM) ended, for the run's record: ""
    when nothing is known.

    SGLang 0.5.23 drains on SIGTERM (in-flight requests finish, then exit 0) only once its
    drain handler is installed, which happens when the first request reaches its tokenizer
    manager (`TokenizerManager.auto_create_handle_loop`). An engine that never received one
    (started with `--skip-server-warmup` and only probed on /health or /ready) is ended by
    uvicorn's own handler at once: status 143 (128 + SIGTERM), no drain. That is a clean
    stop of an idle engine, not a crash and not a drain, and is said so.
    """
    if code is None:
        return ""
    if code == 0:
        return "; the engine drained and exited cleanly"
    if code in (143, -15):
        return ("; the engine ended on SIGTERM at once, without a drain: it had never "
                "received a request, so SGLang had not installed its drain, and nothing was "
                "in flight")
    if code in (137, -9):
        return (f"; the engine did not exit within engine.kill_after_seconds and was killed "
                f"(status {code})")
    return f"; the engine exited with status {code}"
