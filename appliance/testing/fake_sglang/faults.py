"""Faults the engine emulator injects on demand: env `FAKE_SGLANG_FAULT`, comma-separated.

Part of a test and demo instrument (`appliance.testing.fake_sglang`). Pure.

    crash_at=P        at P% of the weight load, rank 0 hits a GPU fault (`RuntimeError: CUDA
                      error: unspecified launch failure`, the kind a restart may cure) and exits
                      1; the main process logs `Rank 0 scheduler died during initialization
                      (exit code: 1)` and exits 1
    corrupt_at=P      the same, but the exception is a corrupt shard's
                      (`safetensors_rust.SafetensorError: Error while deserializing header`),
                      which no restart cures
    hang_at=P         at P% of the weight load, stop logging and reading; stay alive
    oom[=RANK]        at allocation, RANK (default 0) logs `CUDA out of memory` and exits 1;
                      the main process reports the dead rank and exits 1
    scheduler_death[=S]  S seconds (default 1) after ready, scheduler TP3 (the last rank if
                      fewer) is SIGKILLed; the watchdog logs `Subprocess scheduler_3 (pid=...)
                      crashed with exit code -9. Triggering SIGQUIT for cleanup...` (SGLang
                      names its watchdog's processes `scheduler_{i}`, engine.py:1362) and the
                      whole tree dies (the main process by SIGKILL, as kill_process_tree does)
    slow_tokens=S     S seconds per generated token (default 0.01)
    unhealthy         after ready the scheduler is wedged: generation never produces a token,
                      so /health and /health_generate wait SGLANG_HEALTH_CHECK_TIMEOUT (20 s,
                      honoured from the env), log `Health check failed...`, mark the server
                      UnHealthy and return 503; from then on /ready is 503 too, and SIGTERM
                      exits without draining (SGLang's "health check failed. Force exiting.")

An unknown or malformed item is refused at startup (exit 2), so a test cannot silently run
without the fault it asked for. The same goes for the serving performance model
(`FAKE_SGLANG_PERF`, `FAKE_SGLANG_TIME_SCALE`, see `perfmodel.py`), which `faults_from_env`
reads into `Faults.perf` (None: off, the plain `slow_tokens` pacing).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from appliance.testing.fake_sglang.perfmodel import PerfError, PerfModel, perf_from_env

DEFAULT_TOKEN_SECONDS = 0.01


class FaultError(ValueError):
    pass


@dataclass(frozen=True)
class Faults:
    crash_at: float | None = None
    corrupt_at: float | None = None
    hang_at: float | None = None
    oom_rank: int | None = None
    scheduler_death_after: float | None = None
    token_seconds: float = DEFAULT_TOKEN_SECONDS
    unhealthy: bool = False
    perf: PerfModel | None = None

    @property
    def load_stop_at(self) -> float | None:
        """The load fraction (0..1) where a crash or a hang interrupts the weight load."""
        points = [p for p in (self.crash_at, self.corrupt_at, self.hang_at) if p is not None]
        return min(points) / 100 if points else None

    @property
    def load_interruption(self) -> str | None:
        """What happens at `load_stop_at`: "crash", "corrupt" or "hang" (the earliest wins)."""
        points = [(p, kind) for kind, p in (("crash", self.crash_at),
                                           ("corrupt", self.corrupt_at),
                                           ("hang", self.hang_at)) if p is not None]
        return min(points)[1] if points else None


def _number(item: str, value: str | None, default: float | None = None) -> float:
    if value is None or value == "":
        if default is None:
            raise FaultError(f"FAKE_SGLANG_FAULT: {item!r} needs a value, e.g. {item}=50")
        return default
    try:
        number = float(value)
    except ValueError:
        raise FaultError(f"FAKE_SGLANG_FAULT: {item}={value!r} is not a number") from None
    if number < 0:
        raise FaultError(f"FAKE_SGLANG_FAULT: {item}={value!r} must not be negative")
    return number


def parse_faults(text: str | None) -> Faults:
    faults = Faults()
    for raw in (text or "").split(","):
        item = raw.strip()
        if not item:
            continue
        name, _, value = item.partition("=")
        name = name.strip()
        val = value.strip() if "=" in item else None
        if name in ("crash_at", "corrupt_at", "hang_at"):
            percent = _number(name, val)
            if percent > 100:
                raise FaultError(f"FAKE_SGLANG_FAULT: {name}={val} is a percentage (0-100)")
            if name == "crash_at":
                faults = replace(faults, crash_at=percent)
            elif name == "corrupt_at":
                faults = replace(faults, corrupt_at=percent)
            else:
                faults = replace(faults, hang_at=percent)
        elif name == "oom":
            faults = replace(faults, oom_rank=int(_number(name, val, 0)))
        elif name == "scheduler_death":
            faults = replace(faults, scheduler_death_after=_number(name, val, 1.0))
        elif name == "slow_tokens":
            faults = replace(faults, token_seconds=_number(name, val))
        elif name == "unhealthy":
            faults = replace(faults, unhealthy=True)
        else:
            raise FaultError(
                f"FAKE_SGLANG_FAULT: unknown fault {name!r} (known: crash_at=P, corrupt_at=P, "
                f"hang_at=P, oom[=RANK], scheduler_death[=S], slow_tokens=S, unhealthy)"
            )
    return faults


def faults_from_env(environ: Mapping[str, str]) -> Faults:
    """`FAKE_SGLANG_FAULT` plus the performance model; either one's error is a FaultError."""
    faults = parse_faults(environ.get("FAKE_SGLANG_FAULT"))
    try:
        return replace(faults, perf=perf_from_env(environ))
    except PerfError as exc:
        raise FaultError(str(exc)) from None
