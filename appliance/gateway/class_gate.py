"""The gateway's service classes at work (issue 24): admission per class, early refusal of
interactive requests predicted to miss their TTFT SLO, and the per-class count of what each
answered request got. The thin stateful shell around `appliance.gateway.slo` (pure): it holds
each class's moving measures and the requests in flight (`Ticket`s), and reads the admission
queue as it stands.

A request of class C takes a slot at once when one is free under the limit and under C's
share and nobody of C's priority or above waits; otherwise, when C has a TTFT SLO and the
estimate says it would miss it, it is refused at once (429 `slo_ttft_predicted_miss`, with
Retry-After); otherwise it waits in the fair queue for at most C's allowance (`allowance`: its
deadline; else its SLO less its own predicted prefill and the class's headroom, since a slot
granted later can no longer give it its first token in time and is better left to the next;
else gateway.queue_wait_seconds), then 429 `queue_timeout`. Once such a request has its first
token, how late it came against its prediction feeds the class's headroom (`erred`); one that
waited out its allowance feeds it the least it would have been late by (`waited_out`).

The estimate reads the slots C could take: while C is held back by its own share, only its
own class's requests free one for it; otherwise any admitted request does, of whatever
class, each with its own class's measures. A class that has served nothing since the start
borrows the qualification's full batch at the qualified point as its service time
(`Admission.service_prior`, set with the limit), so a restart under load does not admit a
queue blind; a slot granted this instant, before its request boarded, counts as freshly
taken.

The decode-floor guard (`may_grant`): a long prompt prefills in the same engine steps as the
running streams decode (SGLang's chunked prefill, mixed with decode), so every batch request
admitted stalls each interactive stream for its prefill (a 32K prompt: four 8K chunks, about
2.3 s on a K3 box). While a stream of a class with a decode floor has run under
`GUARD_MARGIN` x its floor since its first token (read once it has `GUARD_TOKENS`), a request
of a lower priority is not granted a slot but waits in the queue (up to its own allowance,
batch's deadline), unless no request of its priority or below is in flight: work that may
wait keeps at least one slot, so it is delayed, never starved. Lower priorities are
granted again at the next release once every floored stream runs above the margin.

Invariant: a Ticket is boarded after its slot is acquired and leaves with `release`, so the
tickets are the admitted requests (less those granted but not yet resumed).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from appliance.gateway import slo
from appliance.gateway.admission import Admission
from appliance.gateway.classes import ServiceClass, class_of
from appliance.gateway.errors import GatewayError
from appliance.gateway.metrics import GatewayMetrics

log = logging.getLogger(__name__)
GUARD_TOKENS = 16  # a stream's decode rate is read once it has streamed this many tokens
GUARD_MARGIN = 1.1  # lower priorities wait while a floored stream runs under 1.1 x its floor


def _unseen() -> float | None:
    return None


@dataclass(eq=False)
class Ticket:
    """One admitted request, as the estimate reads it. `progress` says how many tokens it
    has streamed (None while that is unseen: not a stream, or its answer not begun), `first`
    when its first token came (the clock's time; None: not yet, or not a stream)."""

    service_class: str
    weight: int
    prompt_tokens: int
    max_tokens: int | None
    progress: Callable[[], int | None]
    admitted: float = 0.0
    priority: int = 0  # its class's (whose prefill goes first in the engine)
    first: Callable[[], float | None] = _unseen


class ClassGate:
    def __init__(self, admission: Admission, classes: Mapping[str, ServiceClass],
                 queue_wait_seconds: float, metrics: GatewayMetrics,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.admission, self.classes, self.metrics = admission, classes, metrics
        self.queue_wait = queue_wait_seconds
        self.clock = clock
        self.measures: dict[str, slo.Measures] = {}
        self.flying: set[Ticket] = set()
        self.floors = {c.name: c.decode_floor_tps for c in classes.values()
                       if c.decode_floor_tps is not None}
        # the guard can hold only priorities under a floored class's
        self.floor_top = max((classes[name].priority for name in self.floors), default=None)
        self.holding = False  # the guard's last verdict on a lower priority (logged as it turns)
        if self.floor_top is not None and any(c.priority < self.floor_top
                                              for c in classes.values()):
            admission.may_grant = self.may_grant

    def of(self, name: str) -> ServiceClass:
        return class_of(self.classes, name)

    def measured(self, name: str) -> slo.Measures:
        """A class's measures, the qualification's service time standing in until it has
        its own."""
        return self.measures.get(name, slo.Measures()).with_prior(self.admission.service_prior)

    def try_acquire(self, cls: ServiceClass, weight: int, tokens: int) -> bool:
        return self.admission.try_acquire(weight, tokens, cls.name, cls.share, cls.priority)

    def board(self, cls: ServiceClass, weight: int, tokens: int, max_tokens: int | None,
              progress: Callable[[], int | None],
              first: Callable[[], float | None] = _unseen) -> Ticket:
        """Note a request that has just taken its slot; `release` ends it."""
        ticket = Ticket(cls.name, weight, tokens, max_tokens, progress, self.clock(),
                        cls.priority, first)
        self.flying.add(ticket)
        return ticket

    def may_grant(self, priority: int) -> bool:
        """The decode-floor guard (the module docstring says why): False while a floored
        stream of a higher class runs under GUARD_MARGIN x its floor and a request of this
        priority or below is in flight."""
        top = self.floor_top
        if top is None or priority >= top:
            return True
        now = self.clock()
        yielding = False
        strained: tuple[str, float, float] | None = None  # class, its stream's rate, floor
        for t in self.flying:
            if t.priority <= priority:
                yielding = True
            elif strained is None and (floor := self.floors.get(t.service_class)) is not None:
                first, produced = t.first(), t.progress()
                if first is not None and produced is not None and produced >= GUARD_TOKENS \
                        and now > first:
                    rate = (produced - 1) / (now - first)
                    if rate < floor * GUARD_MARGIN:
                        strained = (t.service_class, rate, floor)
            if yielding and strained is not None:
                if not self.holding:
                    self.holding = True
                    log.info("holding back work of priority %d and below: a stream of the %s "
                             "class runs at %.1f tokens/s, under %g x its floor of %g", priority,
                             strained[0], strained[1], GUARD_MARGIN, strained[2])
                return False
        if self.holding:
            self.holding = False
            log.info("no longer holding back lower-priority work: every judged stream runs "
                     "above %g x its class's floor", GUARD_MARGIN)
        return True

    def outlook(self, cls: ServiceClass, tokens: int, weight: int = 1) -> slo.Outlook:
        admission = self.admission
        slots = min(admission.limit, admission.group_slots(cls.share))
        own = admission.group_use.get(cls.name, 0)
        free = min(admission.limit - admission.in_use, slots - own)
        # held back by its share: only its own class's requests free a slot it can take
        by_share = cls.share < 1 and own + weight > slots
        now = self.clock()
        flights: list[tuple[slo.Flight, slo.Measures]] = []
        boarded = 0
        measures: dict[str, slo.Measures] = {}  # each class's, looked up once per outlook
        for t in self.flying:
            if by_share and t.service_class != cls.name:
                continue
            boarded += t.weight
            mine = measures.get(t.service_class)
            if mine is None:
                mine = measures[t.service_class] = self.measured(t.service_class)
            flights.append((slo.Flight(now - t.admitted, t.weight, t.prompt_tokens,
                                       t.max_tokens, t.progress(),
                                       t.priority >= cls.priority), mine))
        taken = own if by_share else admission.in_use
        return slo.outlook(admission.waiting_at_or_above(cls.priority), free, flights, tokens,
                           weight, fresh=taken - boarded,
                           fresh_seconds=self.measured(cls.name).service_seconds.value)

    def refuse_early(self, cls: ServiceClass, tokens: int, weight: int = 1) -> float | None:
        """Raise the early 429 when `cls` has a TTFT SLO this request is predicted to miss;
        else the predicted seconds to its first token (None: no SLO, or nothing measured)."""
        if cls.ttft_slo_seconds is None:
            return None
        measures = self.measured(cls.name)
        outlook = self.outlook(cls, tokens, weight)
        guess = slo.predict(outlook, measures)
        refusal = slo.admit(cls, outlook, measures, guess)
        if refusal is not None:
            raise GatewayError(429, slo.PREDICTED_MISS, refusal.message,
                               retry_after=refusal.retry_after)
        return None if guess is None else guess.seconds

    def erred(self, cls_name: str, seconds_late: float) -> None:
        """Feed `cls_name`'s headroom with how late a predicted first token came."""
        self.measures[cls_name] = self.measures.get(cls_name, slo.Measures()).erred(
            seconds_late)

    def waited_out(self, cls: ServiceClass, tokens: int, predicted: float | None,
                   waited: float) -> None:
        """A predicted request that waited its whole allowance without a slot: its first
        token would have come after that wait and its prefill, so it was at least that late
        against its prediction. Fed to the headroom like a first token seen, or the headroom
        would learn only from the requests that were served (the least late ones)."""
        if predicted is not None:
            self.erred(cls.name, waited + self.measured(cls.name).prefill_seconds(tokens)
                       - predicted)

    def allowance(self, cls: ServiceClass, tokens: int) -> float:
        """The longest this request may wait for a slot (the module docstring says why)."""
        allowed = cls.wait_allowance(self.queue_wait)
        slo_seconds = cls.ttft_slo_seconds
        if cls.deadline_seconds is not None or slo_seconds is None:
            return allowed
        measures = self.measured(cls.name)
        spare = slo_seconds - measures.prefill_seconds(tokens) - measures.headroom(slo_seconds)
        return max(0.0, min(allowed, spare))

    async def acquire(self, cls: ServiceClass, key_id: int, weight: int, tokens: int,
                      allowance: float) -> None:
        """Wait in the queue for at most `allowance` seconds (QueueFull, QueueTimeout)."""
        await self.admission.acquire(key_id, weight, allowance, tokens, cls.name, cls.share,
                                     cls.priority)

    def release(self, cls: ServiceClass, weight: int, ticket: Ticket | None = None) -> None:
        if ticket is not None:
            self.flying.discard(ticket)
        self.admission.release(weight, cls.name)

    def served(self, cls_name: str, *, held_seconds: float, prompt_tokens: int,
               engine_ttft_seconds: float | None, completion_tokens: int = 0,
               decode_seconds: float | None = None) -> None:
        """Feed `cls_name`'s measures with one answered request (slo.Measures.served)."""
        self.measures[cls_name] = self.measures.get(cls_name, slo.Measures()).served(
            held_seconds=held_seconds, prompt_tokens=prompt_tokens,
            engine_ttft_seconds=engine_ttft_seconds, completion_tokens=completion_tokens,
            decode_seconds=decode_seconds)

    def result(self, cls_name: str, outcome: str, *, judged: bool, ttft_seconds: float | None,
               completion_tokens: int, decode_seconds: float | None) -> str:
        """The request's per-class result (slo.RESULTS, or "" when it says nothing about the
        class's promise), counted on /metrics."""
        if not cls_name:
            return ""
        if outcome in slo.REFUSALS:
            result, reason = slo.REFUSED, outcome
        elif outcome == "ok" and judged:
            result = slo.judge(self.of(cls_name), ttft_seconds=ttft_seconds,
                               completion_tokens=completion_tokens,
                               decode_seconds=decode_seconds)
            reason = ""
        else:
            return ""
        self.metrics.slo.labels(cls_name, result, reason).inc()
        return result
