"""Climbing a qualification's ladder, through transient losses of READY.

Each step runs its repeats, each after a prefix-cache flush, only while the engine is READY.
When READY is lost (DEGRADED for a few seconds, say) the round in progress is stopped and
thrown away (its figures would measure the blip, not the box), the step pauses until READY
returns, at most `ready_wait` seconds, and the repeat runs again: at most `retries` times per
step. Steps that passed are kept whatever happens after them. When READY does not return in
time, a step keeps losing it, or the engine will not flush its cache, the climb stops:
`Climbed.stopped` says why and which steps were not measured, and the service records the
steps it has (the box may be admitted at the last one that passed).

A step that fails, or a wedge, ends the climb as before: the point is below it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from appliance.qualify import plan
from appliance.qualify.runner import LoadRunner
from appliance.qualify.verdict import Round, Step, judge, round_of

READY_WAIT_SECONDS = 300.0  # how long a paused step waits for READY before the climb stops
STEP_RETRIES = 3            # rounds of one step thrown away for a loss of READY, at most
WATCH_SECONDS = 0.25        # how often a round looks at the engine's state


@dataclass(frozen=True)
class Climbed:
    """How a climb ended: `done` (a step failed, the ladder's top, or `stopped` early) or
    `cancelled`; `retried`: the rounds measured again after a loss of READY."""

    outcome: str
    stopped: str = ""
    retried: int = 0


class _Lost(Exception):
    """The engine left READY during a round (or would not flush while it was away)."""


def users(count: int) -> str:
    return f"{count} concurrent {'user' if count == 1 else 'users'}"


def seconds_words(value: float) -> str:
    return f"{value:.0f} s" if value < 120 else f"{value / 60:.0f} min"


class Climber:
    """One climb of `settings.ladder` (see the module doc). `steps` holds the steps so far
    (a continued ladder starts with the previous run's); each new one is appended and
    `save`d as soon as it is judged."""

    def __init__(self, runner: LoadRunner, settings: plan.Settings, qid: int,
                 cancel: asyncio.Event, *, ready: Callable[[], bool],
                 state_label: Callable[[], str], progress: Callable[..., None],
                 save: Callable[[tuple[Step, ...]], Awaitable[None]],
                 note: Callable[[str], Awaitable[None]], monotonic: Callable[[], float],
                 ready_wait: float = READY_WAIT_SECONDS, retries: int = STEP_RETRIES) -> None:
        self.runner, self.settings, self.qid, self.cancel = runner, settings, qid, cancel
        self.ready, self.state_label, self.progress = ready, state_label, progress
        self.save, self.note, self.monotonic = save, note, monotonic
        self.ready_wait, self.retries = ready_wait, retries
        self.retried = 0

    async def climb(self, steps: list[Step]) -> Climbed:
        s = self.settings
        measured = {step.concurrency for step in steps}
        for index, concurrency in enumerate(s.ladder):
            if concurrency in measured:
                continue
            rounds: list[Round] = []
            losses, repeat = 0, 1
            while repeat <= s.repeats:
                if self.cancel.is_set():
                    return Climbed("cancelled", retried=self.retried)
                if not self.ready() and not await self._await_ready(concurrency):
                    return self._stopped(concurrency, f"the engine left READY at "
                                         f"{users(concurrency)} and was not READY again "
                                         f"within {seconds_words(self.ready_wait)}")
                try:
                    measured_round = await self._round(concurrency, repeat)
                except _Lost as lost:
                    losses += 1
                    self.retried += 1
                    if losses > self.retries:
                        return self._stopped(concurrency, f"the engine left READY {losses} "
                                             f"times at {users(concurrency)} ({self.retries} "
                                             f"retries allowed){lost}")
                    await self.note(f"qualification {self.qid}: the engine left READY during "
                                    f"repeat {repeat} at {users(concurrency)}; that round "
                                    f"is measured again once it is READY (retry {losses} "
                                    f"of {self.retries})")
                    continue
                except RuntimeError as exc:  # the engine would not flush its prefix cache
                    return self._stopped(concurrency, f"at {users(concurrency)}, {exc}")
                if measured_round is None:
                    return Climbed("cancelled", retried=self.retried)
                rounds.append(measured_round)
                if measured_round.wedged:
                    break  # back off: no more load on a wedged engine
                repeat += 1
            step = judge(concurrency, rounds, floor=s.floor, ttft_p90_max=s.ttft_p90_max,
                         repeats=s.repeats)
            steps.append(step)
            self.progress(steps_done=index + 1)
            await self.save(tuple(steps))
            if not step.passed:
                break
        return Climbed("done", retried=self.retried)

    def _stopped(self, at: int, why: str) -> Climbed:
        left = [c for c in self.settings.ladder if c >= at]
        return Climbed("done", f"{why}; not measured: {', '.join(map(str, left))}",
                       self.retried)

    async def _await_ready(self, concurrency: int) -> bool:
        """Pause until the engine is READY again (True), or the wait ran out (False); a
        cancel ends the pause too (True: the caller sees the cancel)."""
        self.progress(phase=f"paused: the engine is {self.state_label()}; waiting up to "
                      f"{seconds_words(self.ready_wait)} for READY to measure again",
                      concurrency=concurrency)
        await self.note(f"qualification {self.qid} paused at {users(concurrency)}: the "
                        f"engine is {self.state_label()}; the step is measured again once it "
                        "is READY")
        deadline = self.monotonic() + self.ready_wait
        while not self.ready():
            if self.cancel.is_set():
                return True
            if self.monotonic() > deadline:
                return False
            await asyncio.sleep(WATCH_SECONDS)
        return True

    async def _round(self, concurrency: int, repeat: int) -> Round | None:
        """One repeat; None when cancelled, `_Lost` when READY was lost while it ran."""
        stop = asyncio.Event()
        lost: list[str] = []

        async def watch() -> None:
            while not stop.is_set():
                if self.cancel.is_set():
                    stop.set()
                elif not self.ready():
                    lost.append(f" (it was {self.state_label()})")
                    stop.set()
                else:
                    await asyncio.sleep(WATCH_SECONDS)

        watcher = asyncio.get_running_loop().create_task(watch())
        try:
            self.progress(phase="flushing the prefix cache", concurrency=concurrency,
                          repeat=repeat)
            result: Any = None
            try:
                await self.runner.flush_cache(stop)
            except RuntimeError:
                if not lost and self.ready():
                    raise
            if not stop.is_set():
                self.progress(phase="measuring")
                result = await self.runner.run_round(
                    self.settings.workload, concurrency,
                    f"q{self.qid}c{concurrency}r{repeat}", stop)
        finally:
            stop.set()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
        if self.cancel.is_set():
            return None
        if lost or result is None or not self.ready():  # a round across a blip: again
            raise _Lost(lost[0] if lost else "")
        return round_of(concurrency, repeat, result.samples, result.seconds,
                        wedged=result.wedged, kv_peak=result.kv_peak,
                        state_peak=result.state_peak)
