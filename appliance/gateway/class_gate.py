"""The gateway's service classes at work (issue 24): admission per class, early refusal of
interactive requests predicted to miss their TTFT SLO, and the per-class count of what each
answered request got. The thin stateful shell around `appliance.gateway.slo` (pure): it holds
the moving measures and reads the admission queue as it stands.

A request of class C takes a slot at once when one is free under the limit and under C's
share and nobody of C's priority or above waits; otherwise, when C has a TTFT SLO and the
estimate says it would miss it, it is refused at once (429 `slo_ttft_predicted_miss`, with
Retry-After); otherwise it waits in the fair queue for at most C's allowance (its deadline,
else its SLO, else gateway.queue_wait_seconds), then 429 `queue_timeout`. Until the gateway
has served a request since it started, the estimate's service time is the qualification's: a
full batch at the qualified point (`Admission.service_prior`, set with the limit).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from appliance.gateway import slo
from appliance.gateway.admission import Admission
from appliance.gateway.classes import ServiceClass, class_of
from appliance.gateway.errors import GatewayError
from appliance.gateway.metrics import GatewayMetrics


class ClassGate:
    def __init__(self, admission: Admission, classes: Mapping[str, ServiceClass],
                 queue_wait_seconds: float, metrics: GatewayMetrics) -> None:
        self.admission, self.classes, self.metrics = admission, classes, metrics
        self.queue_wait = queue_wait_seconds
        self.measures = slo.Measures()

    def of(self, name: str) -> ServiceClass:
        return class_of(self.classes, name)

    def try_acquire(self, cls: ServiceClass, weight: int, tokens: int) -> bool:
        return self.admission.try_acquire(weight, tokens, cls.name, cls.share, cls.priority)

    def outlook(self, cls: ServiceClass, tokens: int) -> slo.Outlook:
        admission = self.admission
        slots = min(admission.limit, admission.group_slots(cls.share))
        free = min(admission.limit - admission.in_use,
                   slots - admission.group_use.get(cls.name, 0))
        return slo.Outlook(admission.waiting_at_or_above(cls.priority), max(0, free), slots,
                           tokens)

    def refuse_early(self, cls: ServiceClass, tokens: int) -> None:
        """Raise the early 429 when `cls` has a TTFT SLO this request is predicted to miss."""
        measures = self.measures
        prior = self.admission.service_prior
        if measures.service_seconds.value is None and prior is not None:
            # nothing served yet since the start: the qualification's batch time at the point
            measures = replace(measures, service_seconds=slo.Ewma(prior))
        refusal = slo.admit(cls, self.outlook(cls, tokens), measures)
        if refusal is not None:
            raise GatewayError(429, slo.PREDICTED_MISS, refusal.message,
                               retry_after=refusal.retry_after)

    async def acquire(self, cls: ServiceClass, key_id: int, weight: int, tokens: int) -> None:
        """Wait in the queue for at most the class's allowance (QueueFull, QueueTimeout)."""
        await self.admission.acquire(key_id, weight, cls.wait_allowance(self.queue_wait),
                                     tokens, cls.name, cls.share, cls.priority)

    def release(self, cls: ServiceClass, weight: int) -> None:
        self.admission.release(weight, cls.name)

    def served(self, *, held_seconds: float, prompt_tokens: int,
               engine_ttft_seconds: float | None) -> None:
        self.measures = self.measures.served(held_seconds=held_seconds,
                                             prompt_tokens=prompt_tokens,
                                             engine_ttft_seconds=engine_ttft_seconds)

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
