"""The engine's priority-scheduling flags, chosen from the service classes (issue 24). Pure.

When (`appliance.gateway.priority.priority_on`, which also decides whether the gateway adds
each request's priority): the operator configured service classes (`[gateway.classes.NAME]`
tables, so `config.gateway.classes` is not empty) and the classes in force
(`classes.effective`) hold more than one distinct priority. Otherwise there is nothing to
order and no flag is added, so a box without classes keeps its argv and its spec hash. The
flags depend only on the classes' priorities and preemptibility and on the gateway's queue
bounds: changing a class's SLO or share does not change the spec (no engine restart for it).

The flags (SGLang 0.5.23, srt/arg_groups/fields/schedule.py; the scheduler's use of them in
managers/scheduler.py and schedule_policy.py):
  --enable-priority-scheduling   the waiting queue is sorted by priority (larger first), then
                                 arrival (`_sort_by_priority_and_fcfs`); the appliance's
                                 schedule policy stays fcfs, which validation_hook.py requires
                                 (fcfs or lof)
  --default-priority-value P     the interactive class's priority, for a request that carries
                                 none (the monitor's probes; a /v1/messages request carries
                                 its class's in a header, `engine_env` below); without it
                                 SGLang ranks such a request below every other (-2**63) and
                                 labels it 'None' in /metrics
  --priority-scheduling-preemption-threshold T
                                 when a class is preemptible: a waiting request preempts
                                 (retracts) a running one when the running batch is full and
                                 its priority exceeds the running one's by more than T
                                 (`preempt_to_schedule`). T = the highest priority minus the
                                 lowest priority of a class that is not preemptible, so no
                                 request of such a class is ever preempted, and a preemptible
                                 class below all of them is preempted by the top class
  --disable-priority-preemption  when no class is preemptible (SGLang preempts by default)
  --retraction-policy priority   when the KV pool is full, retract the lowest priority first
                                 (`_get_decode_retraction_order`), not the shortest answer
  --max-queued-requests N        N = gateway.queue_max + the gateway's concurrency
                                 (gateway.max_concurrency, or AUTO_CONCURRENCY while it follows
                                 the qualified point): the gateway holds at most that many
                                 requests in all, so the engine refuses (503 "The request queue
                                 is full.") only what the gateway would have refused itself;
                                 with priority scheduling a full queue drops its lowest-priority
                                 request for a higher one (`_abort_on_queued_limit`)
With the flags, the launch spec's environment carries SGLANG_ENABLE_REQUEST_HEADER_OVERRIDES=1
(`appliance.gateway.priority.engine_env`, added by `appliance.engine.args.inputs_from_config`):
SGLang's Anthropic body has no priority field, and the gateway's `x-override-priority` header
is read only with it.
"""

from __future__ import annotations

from collections.abc import Mapping

from appliance.gateway.classes import INTERACTIVE, ServiceClass, effective
from appliance.gateway.priority import priority_on

# The concurrency assumed while gateway.max_concurrency is 0 (the qualified point or the
# engine's slot count, known only once the engine runs): above any K3 box's slot count, so
# the engine's queue bound never binds before the gateway's.
AUTO_CONCURRENCY = 1024
INT64 = (-(1 << 63), (1 << 63) - 1)  # SGLang refuses a priority outside (tokenizer_manager)


def preemption_threshold(classes: Mapping[str, ServiceClass]) -> int | None:
    """SGLang's threshold that never preempts a non-preemptible class; None when no class
    is preemptible, or when none could be preempted (every preemptible class ranks at or
    above a non-preemptible one)."""
    kept = [c.priority for c in classes.values() if not c.preemptible]
    top = max(c.priority for c in classes.values())
    threshold = top - min(kept)
    if not any(top - c.priority > threshold for c in classes.values() if c.preemptible):
        return None
    return threshold


def priority_args(configured: Mapping[str, ServiceClass], *, queue_max: int,
                  max_concurrency: int) -> tuple[tuple[str, str | None], ...]:
    """The priority-scheduling flags for the configured classes, in argv order (the module
    docstring says why each); none when `priority_on` is false."""
    if not priority_on(configured):
        return ()
    classes = effective(configured)
    pairs: list[tuple[str, str | None]] = [
        ("--enable-priority-scheduling", None),
        ("--default-priority-value", str(classes[INTERACTIVE].priority)),
    ]
    threshold = preemption_threshold(classes)
    if threshold is None:
        pairs.append(("--disable-priority-preemption", None))
    else:
        pairs.append(("--priority-scheduling-preemption-threshold", str(threshold)))
    pairs.append(("--retraction-policy", "priority"))
    concurrency = max_concurrency or AUTO_CONCURRENCY
    pairs.append(("--max-queued-requests", str(queue_max + concurrency)))
    return tuple(pairs)
