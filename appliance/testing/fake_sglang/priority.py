"""SGLang 0.5.23's priority scheduling, as pure rules over the parsed flags. A test and demo
instrument (`appliance.testing.fake_sglang`); the scheduler (`scheduler.py`) and the pacing
core (`core.py`) apply them.

From the source (srt/managers/scheduler.py, schedule_policy.py, schedule_batch.py,
tokenizer_manager.py):
- a request's `priority` (an int, top level of /v1/chat/completions, /v1/completions and
  /generate) is kept as given; with `--enable-priority-scheduling` one without it takes
  `--default-priority-value`, else the lowest rank (-2**63; 2**63-1 with
  `--schedule-low-priority-values-first`). Outside the signed 64-bit range it is refused
  (400). Without priority scheduling it is ignored, unless `--abort-on-priority-when-disabled`
  (503 "Using priority is disabled for this server. ...").
- the waiting queue is sorted by (priority x sign, time it entered the queue): larger first
  (sign -1) unless low values go first (`_sort_by_priority_and_fcfs`); without priority
  scheduling it stays in arrival order (fcfs).
- with the running batch full, a waiting request preempts running ones (lowest rank first,
  the newest first among equals) whose priority is more than
  `--priority-scheduling-preemption-threshold` (10) below its own, until it fits
  (`preempt_to_schedule`; on by default, off with `--disable-priority-preemption`). A
  preempted request frees its KV and goes back to the queue, as a retracted one does.
- `--retraction-policy priority`: when the KV pool is full, the lowest rank is retracted first,
  then SGLang's usual order (fewest generated, longest prompt).
- `--max-queued-requests N`: a request arriving at a queue of N is refused with 503 "The
  request queue is full."; with priority scheduling the queue's lowest-ranked request (the
  newest among equals) is aborted instead when the newcomer ranks strictly above it, with 503
  "The request is aborted by a higher priority request." (`_abort_on_queued_limit`).
- the header `x-override-priority: N` sets a request's priority, over the body's, only when
  the engine process runs with SGLANG_ENABLE_REQUEST_HEADER_OVERRIDES true (srt/environ.py
  `EnvBool`: true/1/yes/y, any case; anything else is off). 0.5.23 reads it
  (`apply_header_overrides`, entrypoints/request_headers.py) on /generate
  (`serve_generate_request`) and wherever `OpenAIServingChat._convert_to_internal_request`
  runs: /v1/chat/completions and the Anthropic /v1/messages; never on /v1/completions. Its
  value is cast with Python's `int()`; one that fails is an HTTPException 400
  "invalid x-override-priority header '<value>': <int()'s words>". A /v1/messages body has no
  priority field, so without the header such a request takes `--default-priority-value`.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from appliance.testing.fake_sglang.args import ServeArgs

QUEUE_FULL = "The request queue is full."
ABORTED_BY_HIGHER = "The request is aborted by a higher priority request."
DISABLED = ("Using priority is disabled for this server. Please send a new request without a "
            "priority.")
OUT_OF_RANGE = ("priority must be a signed 64-bit integer between -9223372036854775808 and "
                "9223372036854775807")
OVERRIDES_ENV = "SGLANG_ENABLE_REQUEST_HEADER_OVERRIDES"
PRIORITY_HEADER = "x-override-priority"


class Ranked(Protocol):
    """What the rules read of a request: its key, priority and queue-entry time."""

    @property
    def key(self) -> str: ...

    @property
    def priority(self) -> int: ...

    @property
    def queued_at(self) -> float: ...


R = TypeVar("R", bound=Ranked)


@dataclass(frozen=True)
class PriorityPolicy:
    """The priority flags of one engine; the default is SGLang's without any of them."""

    enabled: bool = False
    low_first: bool = False
    preemption: bool = False  # enabled and not --disable-priority-preemption
    threshold: int = 10
    default: int | None = None
    max_queued: int | None = None
    retract_by_priority: bool = False
    abort_when_disabled: bool = False

    @classmethod
    def of(cls, args: ServeArgs) -> PriorityPolicy:
        values = args.values
        enabled = values.get("enable_priority_scheduling") is True
        default, threshold, queued = (values.get(k) for k in (
            "default_priority_value", "priority_scheduling_preemption_threshold",
            "max_queued_requests"))
        return cls(enabled=enabled,
                   low_first=values.get("schedule_low_priority_values_first") is True,
                   preemption=enabled and values.get("disable_priority_preemption") is not True,
                   threshold=threshold if isinstance(threshold, int) else 10,
                   default=default if isinstance(default, int) else None,
                   max_queued=queued if isinstance(queued, int) else None,
                   retract_by_priority=values.get("retraction_policy") == "priority",
                   abort_when_disabled=values.get("abort_on_priority_when_disabled") is True)

    @property
    def sign(self) -> int:
        """+1: smaller values first; -1 (the default): larger values first."""
        return 1 if self.low_first else -1

    def assign(self, requested: int | None) -> int:
        """The priority the scheduler ranks a request by. Raises `Refused` (400 out of range,
        503 when priorities are refused while disabled)."""
        if requested is not None and not -(1 << 63) <= requested < (1 << 63):
            raise Refused(OUT_OF_RANGE, 400)
        if not self.enabled:
            if requested is not None and self.abort_when_disabled:
                raise Refused(DISABLED, 503)
            return 0  # unused: fcfs
        if requested is None:
            requested = self.default
        if requested is None:
            return sys.maxsize if self.low_first else -sys.maxsize - 1
        return requested

    def rank(self, req: Ranked) -> tuple[int, float]:
        """The waiting queue's sort key (smaller first)."""
        return (req.priority * self.sign if self.enabled else 0, req.queued_at)

    def order(self, waiting: Iterable[R]) -> list[R]:
        return sorted(waiting, key=self.rank)  # stable: fcfs keeps arrival order

    def preemptible(self, incoming: Ranked, running: Iterable[R]) -> list[R]:
        """The running requests `incoming` may preempt, in the order SGLang takes them
        (lowest rank first, newest first among equals): those more than the threshold
        below it, stopping at the first that is not."""
        if not self.preemption:
            return []
        out = []
        for req in sorted(running, key=lambda r: (-r.priority * self.sign, -r.queued_at)):
            if (incoming.priority - req.priority) * -self.sign > self.threshold:
                out.append(req)
            else:
                break
        return out

    def retraction_key(self, priority: int, generated: int, prompt: int) -> tuple[int, ...]:
        """SGLang's `_get_decode_retraction_order` key: the largest is kept longest."""
        if self.retract_by_priority:
            return (priority * -self.sign, generated, -prompt)
        return (generated, -prompt)

    def on_full_queue(self, incoming: Ranked,
                      waiting: Sequence[Ranked]) -> tuple[str, str] | None:
        """None when `incoming` may join the queue; else (the key to abort, its message):
        the newcomer's, or a lower-ranked waiting request's."""
        if self.max_queued is None or len(waiting) + 1 <= self.max_queued:
            return None
        if self.enabled and waiting:
            worst = max(waiting, key=lambda r: (self.sign * r.priority, r.queued_at))
            if self.sign * incoming.priority < self.sign * worst.priority:
                return worst.key, ABORTED_BY_HIGHER
        return incoming.key, QUEUE_FULL


class Refused(Exception):
    """A request the engine answers with an error before queueing it: a priority out of
    range (SGLang's ValueError, 400) or refused while disabled (an abort, 503)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.message, self.status = message, status


class BadHeader(Refused):
    """An `x-override-priority` that `int()` refuses: SGLang's HTTPException 400, which each
    endpoint answers in its own shape (the serving modules)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, 400)


def header_overrides_on(environ: Mapping[str, str]) -> bool:
    """Whether the engine honours the request header overrides (`OVERRIDES_ENV`, read as
    SGLang's `EnvBool` reads it; an unreadable value is its default, off)."""
    return environ.get(OVERRIDES_ENV, "").lower() in ("true", "1", "yes", "y")


def header_priority(headers: Iterable[tuple[bytes, bytes]], requested: int | None) -> int | None:
    """The priority once `apply_header_overrides` has run: the first `x-override-priority`
    header's value as `int()` reads it (whitespace, a sign and `_` between digits allowed),
    else `requested` (the body's). Raises `BadHeader` naming the value, as SGLang does."""
    wanted = PRIORITY_HEADER.encode()
    raw = next((value for name, value in headers if name.lower() == wanted), None)
    if raw is None:
        return requested
    value = raw.decode("latin-1")  # how Starlette decodes a header value
    try:
        return int(value)
    except ValueError as exc:
        raise BadHeader(f"invalid {PRIORITY_HEADER} header {value!r}: {exc}") from None


def requested_priority(body: dict[str, Any]) -> int | None:
    """The body's top-level `priority` (pydantic's `Optional[int]`). Raises ValueError for
    another type (the serving layer answers it as a 400 naming the field)."""
    value = body.get("priority")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError("priority must be an integer")
    return value
