"""Admission that predicts (issue 24): will this request's first token come within its class's
TTFT SLO? And afterwards: did the request get what its class promised? Pure.

The estimate uses only what the gateway measured itself (`Measures`, moving averages of the
requests it served): the requests waiting ahead of this one in its class and above, how long
an admitted request holds its slot at the admission limit (so how often a slot frees), and
the prompt's prefill cost (its estimated tokens over the prefill rate seen at the engine).
With nothing measured yet the estimate is None, and the request is admitted as before
classes: an early refusal must rest on evidence.

    predicted TTFT = wait for a slot + prefill
    wait for a slot = 0 while a slot is free to it, else
                      (requests ahead - free slots + 1) x service time / slots of its class
    prefill         = estimated prompt tokens / measured prefill tokens per second

A request whose predicted TTFT is over its class's SLO is refused at once (`Refusal`), with a
Retry-After of the excess: by then the queue ahead of it has drained by that much.
"""

from __future__ import annotations

import math
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
    """What the gateway has seen of the engine: the seconds an admitted request holds its
    slot, and the prompt tokens per second of the engine's time to a first token."""

    service_seconds: Ewma = Ewma()
    prefill_tps: Ewma = Ewma()

    def served(self, *, held_seconds: float, prompt_tokens: int,
               engine_ttft_seconds: float | None) -> Measures:
        """With one more answered request: `held_seconds` from admission to its end,
        `engine_ttft_seconds` from admission to its first byte (None: not seen)."""
        prefill = self.prefill_tps
        if engine_ttft_seconds is not None and engine_ttft_seconds > 0 and prompt_tokens > 0:
            prefill = prefill.add(prompt_tokens / engine_ttft_seconds)
        return replace(self, service_seconds=self.service_seconds.add(held_seconds),
                       prefill_tps=prefill)


@dataclass(frozen=True)
class Outlook:
    """The queue as a new request finds it."""

    ahead: int  # weight waiting in its class and above (granted before it)
    free: int  # slots it could take now: under the limit and under its class's share
    slots: int  # slots its class may hold at once (how many free up in parallel for it)
    prompt_tokens: int  # estimated (appliance.gateway.admission.estimate_prompt_tokens)


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
    """The expected seconds to this request's first token; None when the gateway has not
    measured what the estimate needs."""
    prefill_rate = measures.prefill_tps.value
    prefill = outlook.prompt_tokens / prefill_rate if prefill_rate else 0.0
    if outlook.ahead < outlook.free:
        return Prediction(prefill, 0.0, prefill)
    service = measures.service_seconds.value
    if service is None:
        return None
    wait = (outlook.ahead - outlook.free + 1) * service / max(1, outlook.slots)
    return Prediction(wait + prefill, wait, prefill)


def admit(cls: ServiceClass, outlook: Outlook, measures: Measures) -> Refusal | None:
    """None to admit (or queue); a Refusal when the class has a TTFT SLO this request is
    predicted to miss."""
    slo = cls.ttft_slo_seconds
    if slo is None:
        return None
    guess = predict(outlook, measures)
    if guess is None or guess.seconds <= slo:
        return None
    retry = max(1, math.ceil(guess.seconds - slo))
    return Refusal(
        f"the box is too busy to give this request its first token within {slo:g} s, the "
        f"promise of its key's class ({cls.name}): {outlook.ahead} requests wait ahead of it "
        f"and it would wait about {guess.wait_seconds:.0f} s for a slot plus "
        f"{guess.prefill_seconds:.1f} s of prefill (about {guess.seconds:.0f} s in all); "
        f"retry in {retry} s, or send work that can wait with a batch key", retry)


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
