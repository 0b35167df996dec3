"""Admission that predicts (issue 24): will this request's first token come within its class's
TTFT SLO? And afterwards: did the request get what its class promised? Pure.

The estimate uses only what the gateway knows itself: the requests in flight (when each took
its slot, its class, the tokens it has streamed, its max_tokens), the requests waiting ahead
of this one in its class and above, and what it measured of each class (`Measures`, moving
averages of the requests of that class it served: how long one holds its slot, how fast it
decodes, how long its answers are, the prefill rate its prompts saw). With nothing measured
the estimate is None, and the request is admitted as before classes: an early refusal must
rest on evidence.

    predicted TTFT = wait for a slot + prefill
    wait for a slot = 0 while a slot is free to it, else the time until the
                      (requests ahead + its weight - free slots)-th slot it can use frees
    prefill         = its own: estimated prompt tokens / its class's measured prefill rate
                      + the engine's prefill still ahead of it once it has its slot: what
                      the admitted requests of its priority or above have left to prefill
                      (`pending_prefill`), less what the engine does of it while this one
                      waits (the engine prefills one request's chunk after another, and with
                      priority scheduling a lower-priority prompt does not go first)

Each in-flight request's residual (`residual`) is what is left of it: where its class's decode
rate is measured, its remaining tokens over that rate (its tokens are its max_tokens, or its
class's typical answer length while it has produced fewer than that: most requests stop
before their cap, and one already longer than the typical is taken to run to its cap), plus
what is left of its prefill; else its class's service time less its age. A request past its
estimate (overdue) is taken to end soon, never at once (`OVERDUE_SHARE` of its class's
service time).
The slots are then played forward (`predict`): the soonest-freeing slot goes to the first
waiter ahead, which holds it for this class's service time, and so on until this request's
turn. A batch request holding a slot this class could take counts with its own class's
residual; a batch request's long hold and 32K-token prompt never enter an interactive
request's service time or prefill rate.

A request whose predicted TTFT, plus the class's headroom, is over its class's SLO is refused
at once (`Refusal`), with a Retry-After of the excess: by then the slots ahead of it have freed
by that much. The headroom is the estimate's own measured lateness (`Measures.headroom`): the
90th percentile of (first token seen - first token predicted) over the class's last
`ERRORS_KEPT` predicted requests, never below 0 nor above half the SLO, and 0 until
`ERRORS_NEEDED` are seen. So an estimate that runs late (the gateway's own time to the
engine, prefill the rate does not see) is corrected by what it was seen to miss by, not by a
guessed margin.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from appliance.gateway.classes import ServiceClass

MET = "met"
REFUSED = "refused"
MISSED_TTFT = "missed_ttft"
MISSED_DECODE = "missed_decode"
RESULTS = (MET, REFUSED, MISSED_TTFT, MISSED_DECODE)
# The admission refusals a class's count calls "refused early" (the others, such as a bad
# key or a malformed body, say nothing about the class's promise).
PREDICTED_MISS = "slo_ttft_predicted_miss"
REFUSALS = frozenset({PREDICTED_MISS, "queue_full", "queue_timeout"})
ALPHA = 0.1  # weight of a new sample: about the last 20 requests count
# A request already past its estimate (overdue) ends "soon": this share of its class's
# service time.
# Not zero: it is evidently longer than most, and a row of overdue requests must not read
# as a row of free slots.
OVERDUE_SHARE = 0.05
ERRORS_KEPT = 50  # the predictions whose lateness makes the headroom: the last 50
ERRORS_NEEDED = 10  # fewer seen: no headroom yet (a percentile of a handful is noise)
HEADROOM_QUANTILE = 0.9


@dataclass(frozen=True)
class Ewma:
    """An exponentially weighted moving average; None until the first sample."""

    value: float | None = None

    def add(self, sample: float) -> Ewma:
        if not math.isfinite(sample) or sample < 0:
            return self
        if self.value is None:
            return Ewma(sample)
        return Ewma(self.value + (sample - self.value) * ALPHA)


@dataclass(frozen=True)
class Measures:
    """What the gateway has seen of one class's requests at the engine: the seconds one holds
    its slot, the (estimated) prompt tokens per second of the engine's time to a first token,
    the tokens per second a stream decodes at, the tokens an answer has, and how late its
    predicted requests' first tokens came against the prediction (seconds, the last
    ERRORS_KEPT; negative: early)."""

    service_seconds: Ewma = Ewma()
    prefill_tps: Ewma = Ewma()
    decode_tps: Ewma = Ewma()
    completion_tokens: Ewma = Ewma()
    errors: tuple[float, ...] = ()

    def served(self, *, held_seconds: float, prompt_tokens: int,
               engine_ttft_seconds: float | None, completion_tokens: int = 0,
               decode_seconds: float | None = None) -> Measures:
        """With one more answered request: `held_seconds` from admission to its end,
        `engine_ttft_seconds` from admission to its first byte, `decode_seconds` from its
        first token to its last (None: not seen, not a stream)."""
        prefill, decode = self.prefill_tps, self.decode_tps
        if engine_ttft_seconds is not None and engine_ttft_seconds > 0 and prompt_tokens > 0:
            prefill = prefill.add(prompt_tokens / engine_ttft_seconds)
        if decode_seconds is not None and decode_seconds > 0 and completion_tokens > 1:
            decode = decode.add((completion_tokens - 1) / decode_seconds)
        answered = self.completion_tokens.add(completion_tokens) if completion_tokens > 0 \
            else self.completion_tokens
        return replace(self, service_seconds=self.service_seconds.add(held_seconds),
                       prefill_tps=prefill, decode_tps=decode, completion_tokens=answered)

    def erred(self, seconds_late: float) -> Measures:
        """With one more predicted request's lateness (first token seen - predicted)."""
        if not math.isfinite(seconds_late):
            return self
        return replace(self, errors=(*self.errors[1 - ERRORS_KEPT:], seconds_late))

    def headroom(self, slo_seconds: float) -> float:
        """The seconds an admission keeps free under the SLO: the HEADROOM_QUANTILE of the
        lateness seen, within [0, slo_seconds / 2]; 0 with fewer than ERRORS_NEEDED seen."""
        if len(self.errors) < ERRORS_NEEDED:
            return 0.0
        ranked = sorted(self.errors)
        late = ranked[min(len(ranked) - 1, int(HEADROOM_QUANTILE * len(ranked)))]
        return min(max(0.0, late), slo_seconds / 2)

    def prefill_seconds(self, prompt_tokens: int) -> float:
        """The engine's time to prefill `prompt_tokens` (estimated) at the measured rate;
        0 while no rate is measured."""
        rate = self.prefill_tps.value
        return prompt_tokens / rate if rate else 0.0

    def with_prior(self, service_seconds: float | None) -> Measures:
        """These measures, with `service_seconds` as the service time while none is
        measured (the qualification's batch time right after a start)."""
        if self.service_seconds.value is not None or service_seconds is None:
            return self
        return replace(self, service_seconds=Ewma(service_seconds))


@dataclass(frozen=True)
class Flight:
    """One admitted request as a new arrival finds it."""

    age_seconds: float  # since it took its slot
    weight: int  # the slots it holds (its n)
    prompt_tokens: int  # estimated (appliance.gateway.admission.estimate_prompt_tokens)
    max_tokens: int | None  # its cap (None: none sent)
    produced: int | None  # the tokens it has streamed (None: not a stream yet, unseen)
    outranks: bool = True  # its priority is at least the new request's: prefilled before it


def residual(flight: Flight, measures: Measures) -> float:
    """The seconds until `flight` frees its slot, by its own class's `measures` (with the
    prior filled in); infinity where nothing is known (no evidence: never a reason to
    refuse)."""
    service = measures.service_seconds.value
    rate = measures.decode_tps.value
    age = flight.age_seconds
    floor = OVERDUE_SHARE * service if service is not None else 0.0
    typical = measures.completion_tokens.value
    if rate:
        prefill = measures.prefill_seconds(flight.prompt_tokens)
        produced = flight.produced
        if produced is None:  # its tokens are unseen: as many as its age has had time for
            produced = int(max(0.0, age - prefill) * rate)
        total = flight.max_tokens
        if typical is not None and produced < typical:
            total = round(typical) if total is None else min(total, round(typical))
        if total is not None:
            pending = max(0.0, prefill - age) if produced == 0 else 0.0
            left = pending + (total - produced) / rate
            return left if left > 0 else floor
    if service is None:
        return math.inf
    return service - age if service > age else floor


def pending_prefill(flight: Flight, measures: Measures) -> float:
    """The seconds of prefill `flight` still has before its first token, by its class's
    measured rate: none once it streams."""
    if flight.produced:
        return 0.0
    return max(0.0, measures.prefill_seconds(flight.prompt_tokens) - flight.age_seconds)


@dataclass(frozen=True)
class Outlook:
    """The slots as a new request finds them."""

    ahead: int  # weight waiting in its class and above (granted before it)
    free: int  # slots it could take now: under the limit and under its class's share
    residuals: tuple[float, ...]  # seconds until each taken slot it could use frees, one a slot
    prompt_tokens: int  # estimated (appliance.gateway.admission.estimate_prompt_tokens)
    weight: int = 1
    backlog: float = 0.0  # seconds of prefill the engine does before this request's


def outlook(ahead: int, free: int, flights: Sequence[tuple[Flight, Measures]],
            prompt_tokens: int, weight: int = 1, fresh: int = 0,
            fresh_seconds: float | None = None) -> Outlook:
    """The Outlook from the in-flight requests whose slots this class could take, each with
    its class's measures; `fresh` slots taken by requests not yet seen in flight (granted
    this instant) hold `fresh_seconds` each (None: unknown). The backlog is the pending
    prefill of those that outrank it."""
    left = [residual(f, m) for f, m in flights for _ in range(max(1, f.weight))]
    left += [math.inf if fresh_seconds is None else fresh_seconds] * max(0, fresh)
    backlog = sum(pending_prefill(f, m) * max(1, f.weight) for f, m in flights if f.outranks)
    return Outlook(ahead, max(0, free), tuple(sorted(left)), prompt_tokens, weight, backlog)


@dataclass(frozen=True)
class Prediction:
    seconds: float
    wait_seconds: float
    prefill_seconds: float


@dataclass(frozen=True)
class Refusal:
    """An early refusal: the reason in words and the Retry-After from the same estimate."""

    message: str
    retry_after: int


def predict(outlook: Outlook, measures: Measures) -> Prediction | None:
    """The expected seconds to this request's first token, by its class's `measures`; None
    when the gateway has not measured what the estimate needs.

    The slots are played forward: each turn the soonest-freeing slot goes to the next in
    line (the waiters ahead, then this request), and a waiter's slot frees again after this
    class's service time. Exact for requests that take their measured time; as good as the
    residuals otherwise. The prefill is its own plus the backlog the engine has not done by
    the time this request has its slot."""
    own = measures.prefill_seconds(outlook.prompt_tokens)
    turns = outlook.ahead + outlook.weight - outlook.free
    if turns <= 0:
        prefill = own + outlook.backlog
        return Prediction(prefill, 0.0, prefill)
    service = measures.service_seconds.value
    slots = list(outlook.residuals)  # sorted: already a heap
    if not slots:
        return None
    wait = 0.0
    for _ in range(turns):
        wait = heapq.heappop(slots)
        if math.isinf(wait):
            return None
        heapq.heappush(slots, math.inf if service is None else wait + service)
    prefill = own + max(0.0, outlook.backlog - wait)
    return Prediction(wait + prefill, wait, prefill)


def admit(cls: ServiceClass, outlook: Outlook, measures: Measures,
          guess: Prediction | None) -> Refusal | None:
    """None to admit (or queue); a Refusal when the class has a TTFT SLO this request is
    predicted (`guess`, from `predict`) to miss, its headroom counted."""
    slo = cls.ttft_slo_seconds
    if slo is None or guess is None:
        return None
    headroom = measures.headroom(slo)
    if guess.seconds + headroom <= slo:
        return None
    retry = max(1, math.ceil(guess.seconds + headroom - slo))
    taken = len(outlook.residuals)
    if outlook.free:
        busy = f"{outlook.ahead} requests wait ahead of it for the {taken + outlook.free} " \
            "slots it may use"
    else:
        busy = f"all {taken} slots it may use are taken"
        if outlook.ahead:
            busy += f" and {outlook.ahead} requests wait ahead of it"
    late = f", and one in ten such estimates ran {headroom:.1f} s late or more" \
        if headroom >= 0.05 else ""
    return Refusal(
        f"the box is too busy to give this request its first token within {slo:g} s, the "
        f"promise of its key's class ({cls.name}): {busy}, so it would wait about "
        f"{guess.wait_seconds:.0f} s for a slot plus {guess.prefill_seconds:.1f} s of prefill "
        f"(about {guess.seconds:.0f} s in all{late}); retry in {retry} s, or send work that "
        f"can wait with a batch key", retry)


def judge(cls: ServiceClass, *, ttft_seconds: float | None, completion_tokens: int,
          decode_seconds: float | None) -> str:
    """Whether an answered request got its class's promise: MET, MISSED_TTFT (the first
    token came later than the SLO) or MISSED_DECODE (the stream ran below the floor).
    `decode_seconds`: from the first token to the last (None: not a stream, not judged)."""
    slo, floor = cls.ttft_slo_seconds, cls.decode_floor_tps
    if slo is not None and ttft_seconds is not None and ttft_seconds > slo:
        return MISSED_TTFT
    if floor is not None and decode_seconds is not None and decode_seconds > 0 \
            and completion_tokens > 1 and (completion_tokens - 1) / decode_seconds < floor:
        return MISSED_DECODE
    return MET
