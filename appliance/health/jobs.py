"""The health monitor's scheduled jobs on the daemon's scheduler.

    health_gpus    every health.gpu_interval_seconds     (NVML, in a thread, with a timeout)
    health_engine  every health.engine_interval_seconds  (/ready, /metrics, rare probes)
    health_host    every health.host_interval_seconds    (disks, memory, load)
    health_weights every 5 minutes                         (the weights' quick tier: file stats)
    health_prune   hourly                                 (roll-ups, old history, mutes)

With the scheduler's defaults (`runtime.new_scheduler`): one instance of each at a time,
missed runs coalesced into one, no misfire deadline. Each also runs once as soon as the
scheduler starts, so the dashboard has figures within seconds of a daemon start. The jobs
never raise (a failing check becomes a CRITICAL result; see `monitor`), except prune, whose
failure the scheduler's listener turns into an event.
"""

from __future__ import annotations

import datetime as dt

from appliance.health.weights_checks import INTERVAL_SECONDS as WEIGHTS_SECONDS
from appliance.runtime import Runtime

JOB_IDS = ("health_gpus", "health_engine", "health_host", "health_weights", "health_prune")


def schedule_health(runtime: Runtime) -> None:
    monitor, health = runtime.health, runtime.config.health
    # APScheduler keeps its own wall-clock time; "now" here is its time, not the runtime's
    # clock (which a test may have set anywhere).
    first = dt.datetime.now(dt.UTC)
    jobs = (
        ("health_gpus", monitor.check_gpus, health.gpu_interval_seconds),
        ("health_engine", monitor.check_engine, health.engine_interval_seconds),
        ("health_host", monitor.check_host, health.host_interval_seconds),
        ("health_weights", monitor.check_weights, WEIGHTS_SECONDS),
        ("health_prune", monitor.prune, 3600),
    )
    for job_id, poll, seconds in jobs:
        runtime.scheduler.add_job(poll, "interval", seconds=seconds, id=job_id,
                                  next_run_time=first, replace_existing=True)
