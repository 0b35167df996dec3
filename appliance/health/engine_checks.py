"""The engine's checks, from one `EngineFigures` (what `EngineWatcher.poll` returned). Pure.

    engine.ready     serving and /ready fails (503, or no answer) → CRITICAL
    engine.generate  the last /health_generate or canary failed → CRITICAL (alive, not
                     generating)
    engine.latency   the canary's time to first token over canary_ttft_warn_ms → WARN
    engine.metrics   serving, answering, but /metrics unreadable → WARN (figures missing)
    engine.queue     requests wait while the KV pool is nearly full → WARN (the memory split
                     does not fit the workload)

Outside READY/DEGRADED every check is OK and unjudged (`judged=False`), with "not checked
while <state>": a loading engine is never judged (nor probed), so nothing here can push a
restart during a load, and a failure is not "recovered" by the engine stopping. The policy (what
DEGRADED means, whether anything restarts) is the supervisor's; hints only describe it.
"""

from __future__ import annotations

import dataclasses

from appliance.config import HealthConfig
from appliance.engine.states import SERVING, EngineState
from appliance.health.model import CheckResult, EngineFigures, Level

GROUP = "engine"
# Requests queue behind a KV pool this full: the split (--mamba-full-memory-ratio) is tight.
QUEUE_TOKEN_USAGE = 0.9
TITLES = {"engine.ready": "Engine /ready", "engine.generate": "Engine generates",
          "engine.latency": "Engine latency", "engine.metrics": "Engine metrics",
          "engine.queue": "Engine queue"}


def _state(value: str) -> EngineState | None:
    try:
        return EngineState(value)
    except ValueError:
        return None


def _result(check_id: str, level: Level, summary: str, hint: str = "") -> CheckResult:
    return CheckResult(check_id, GROUP, TITLES[check_id], level, summary,
                       hint if level is not Level.OK else "")


def _restart_policy(health: HealthConfig) -> str:
    minutes = health.restart_degraded_after_minutes
    if minutes:
        return (f"the supervisor restarts it after {minutes} minutes DEGRADED "
                "(health.restart_degraded_after_minutes)")
    return ("it is not restarted automatically (health.restart_degraded_after_minutes is 0); "
            "restart it from the Engine page if it does not recover")


def _ready(figures: EngineFigures) -> CheckResult:
    if figures.ready is True:
        return _result("engine.ready", Level.OK, "/ready answers 200")
    if figures.ready is False:
        return _result(
            "engine.ready", Level.CRITICAL,
            "the engine answers /ready with 503: it is draining, paused or marked unhealthy",
            "look at the end of the engine log (Engine page); SGLang marks itself unhealthy "
            "after a failed health check and recovers after a successful one")
    return _result(
        "engine.ready", Level.CRITICAL,
        "the engine does not answer /ready (its port is closed or it hangs)",
        "look at the engine log and `systemctl status appliance-engine`; a dead engine goes "
        "through the supervisor's crash path")


def _generate(figures: EngineFigures, health: HealthConfig) -> CheckResult:
    canary = figures.canary
    if canary is None:
        return _result("engine.generate", Level.OK,
                       f"no generation probe yet: it runs when at most "
                       f"{health.canary_max_load} requests are in flight, at most every "
                       f"{health.canary_interval_seconds} s")
    if not canary.ok:
        return _result(
            "engine.generate", Level.CRITICAL,
            f"the engine is alive but does not generate: {canary.error}",
            f"look at the engine log for a stuck scheduler or CUDA errors; "
            f"{_restart_policy(health)}")
    ttft = f"{canary.ttft_seconds * 1000:.0f} ms to the first token" \
        if canary.ttft_seconds is not None else "generated"
    rate = f", {canary.decode_tokens_per_second:.1f} tokens/s decoding" \
        if canary.decode_tokens_per_second is not None else ""
    return _result("engine.generate", Level.OK, f"the last canary generated: {ttft}{rate}")


def _latency(figures: EngineFigures, health: HealthConfig) -> CheckResult:
    canary = figures.canary
    if canary is None or not canary.ok or canary.ttft_seconds is None:
        return _result("engine.latency", Level.OK, "no canary timing yet")
    ms = canary.ttft_seconds * 1000
    if ms > health.canary_ttft_warn_ms:
        return _result(
            "engine.latency", Level.WARN,
            f"the canary waited {ms:.0f} ms for its first token, over the "
            f"{health.canary_ttft_warn_ms} ms warning line",
            "an idle engine answering slowly points at the GPUs (clocks, throttling: see the "
            "GPU checks) or at a long prefill queue; compare with the TTFT figures on the "
            "dashboard")
    return _result("engine.latency", Level.OK,
                   f"the canary's first token came after {ms:.0f} ms")


def _metrics(figures: EngineFigures) -> CheckResult:
    # running_requests is read from /metrics only; None while the engine answers /ready means
    # /metrics was missing or unreadable.
    if figures.running_requests is not None or figures.ready is None:
        return _result("engine.metrics", Level.OK, "/metrics is readable"
                       if figures.running_requests is not None else
                       "not checked while the engine does not answer")
    return _result(
        "engine.metrics", Level.WARN,
        "the engine answers but its /metrics is missing or unreadable: throughput, TTFT and "
        "cache figures are missing",
        "the launch spec must carry --enable-metrics (the Engine page shows the command "
        "line); restart the engine at a quiet time to apply it")


def _queue(figures: EngineFigures) -> CheckResult:
    queued, usage = figures.queued_requests, figures.token_usage
    if queued and usage is not None and usage >= QUEUE_TOKEN_USAGE:
        return _result(
            "engine.queue", Level.WARN,
            f"{queued} requests wait while the KV cache is {usage:.0%} full",
            "the memory split does not fit this workload's context lengths; the Tuning page "
            "recommends a --mamba-full-memory-ratio from the observed requests (applying it "
            "costs a restart)")
    waiting = f"{queued} waiting" if queued else "no request waiting"
    return _result("engine.queue", Level.OK, waiting if usage is None else
                   f"{waiting}, KV cache {usage:.0%} used")


def engine_checks(figures: EngineFigures, health: HealthConfig) -> list[CheckResult]:
    """Every engine check, in a stable order, for one poll's figures."""
    state = _state(figures.state)
    if state not in SERVING:
        label = state.label if state is not None else figures.state.replace("_", " ")
        return [dataclasses.replace(_result(check_id, Level.OK, f"not checked while {label}"),
                                    judged=False) for check_id in TITLES]
    return [_ready(figures), _generate(figures, health), _latency(figures, health),
            _metrics(figures), _queue(figures)]
