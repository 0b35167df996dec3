"""Service classes and admission that predicts (issue 24), pure: the classes' validation, the
TTFT estimate from the requests in flight and its early refusal, the judgement of an answered
request, the admission queue's shares and priorities, and the class gate reading what is in
flight (asyncio, no sockets, a clock moved by hand). Milliseconds."""

from __future__ import annotations

import asyncio

import pytest

from appliance.gateway import slo
from appliance.gateway.admission import Admission
from appliance.gateway.class_gate import GUARD_TOKENS, ClassGate, Ticket
from appliance.gateway.classes import (
    BATCH,
    DEFAULT_CLASSES,
    INTERACTIVE,
    ClassProblem,
    ServiceClass,
    effective,
    parse_classes,
)
from appliance.gateway.errors import GatewayError
from appliance.gateway.metrics import GatewayMetrics

INTERACTIVE_5S = ServiceClass(INTERACTIVE, ttft_slo_seconds=5.0, decode_floor_tps=32.0,
                              priority=10)
MEASURED = slo.Measures(slo.Ewma(20.0), slo.Ewma(4000.0))  # 20 s a request, 4,000 tok/s
# ... decoding at 50 tokens/s, answers of 1,000 tokens
STREAMING = slo.Measures(slo.Ewma(20.0), slo.Ewma(4000.0), slo.Ewma(50.0), slo.Ewma(1000.0))


def admit(cls: ServiceClass, outlook: slo.Outlook, measures: slo.Measures) -> slo.Refusal | None:
    return slo.admit(cls, outlook, measures, slo.predict(outlook, measures))


def stream(age: float, produced: int | None, max_tokens: int | None = 1000,
           prompt: int = 8000) -> slo.Flight:
    return slo.Flight(age, 1, prompt, max_tokens, produced)


# --- classes ----------------------------------------------------------------------------------

def test_defaults_promise_nothing_new() -> None:
    interactive = DEFAULT_CLASSES[INTERACTIVE]
    assert interactive.ttft_slo_seconds is None and interactive.share == 1
    assert interactive.wait_allowance(60) == 60  # as gateway.queue_wait_seconds before classes
    assert DEFAULT_CLASSES[BATCH].wait_allowance(60) == 600
    assert admit(interactive, slo.Outlook(500, 0, (20.0,) * 8, 10_000), MEASURED) is None


def test_a_table_changes_only_the_keys_it_names() -> None:
    classes = parse_classes({"interactive": {"ttft_slo_seconds": 5},
                             "bulk": {"share": 0.25, "priority": -1}})
    assert classes[INTERACTIVE].ttft_slo_seconds == 5 and classes[INTERACTIVE].priority == 10
    assert classes["bulk"].share == 0.25 and classes[BATCH].deadline_seconds == 600
    assert set(effective({})) == {INTERACTIVE, BATCH}


@pytest.mark.parametrize(("raw", "key", "expected"), [
    ({"batch": {"share": 1.0}}, "gateway.classes", "less than 1"),
    ({"a": {"share": 0.3}, "batch": {"share": 0.7}}, "gateway.classes", "less than 1"),
    ({"batch": {"share": 0}}, "gateway.classes.batch.share", "positive"),
    ({"batch": {"share": 1.5}}, "gateway.classes.batch.share", "at most 1"),
    ({"interactive": {"ttft_slo_seconds": "5"}}, "gateway.classes.interactive.ttft_slo_seconds",
     "positive number"),
    ({"interactive": {"preemptible": True}}, "gateway.classes.interactive.preemptible",
     "never preempted"),
    ({"interactive": {"colour": 1}}, "gateway.classes.interactive.colour", "one of"),
    ({"Big": {}}, "gateway.classes.Big", "lowercase"),
    ({"batch": {"priority": 1.5}}, "gateway.classes.batch.priority", "integer"),
    ({"batch": {"priority": 2**63}}, "gateway.classes.batch.priority", "within"),
])
def test_bad_classes_name_the_key_and_the_next_step(raw: dict[str, object], key: str,
                                                    expected: str) -> None:
    with pytest.raises(ClassProblem) as caught:
        parse_classes(raw)
    assert caught.value.key == key and expected in caught.value.expected


# --- the estimate -----------------------------------------------------------------------------

def test_a_free_slot_costs_only_the_prefill() -> None:
    guess = slo.predict(slo.Outlook(0, 1, (20.0,) * 7, 8000), MEASURED)
    assert guess is not None and guess.wait_seconds == 0 and guess.seconds == 2.0
    assert admit(INTERACTIVE_5S, slo.Outlook(0, 1, (20.0,) * 7, 8000), MEASURED) is None


def test_the_wait_is_the_turn_of_the_slots_in_flight() -> None:
    # 8 slots freeing every 2.5 s (2.5, 5, ... 20 s left), 3 ahead: the 4th frees at 10 s
    outlook = slo.Outlook(3, 0, tuple(2.5 * i for i in range(1, 9)), 8000)
    guess = slo.predict(outlook, MEASURED)
    assert guess is not None and guess.wait_seconds == 10.0 and guess.seconds == 12.0
    refusal = admit(INTERACTIVE_5S, outlook, MEASURED)
    assert refusal is not None and refusal.retry_after == 7  # 12 s predicted, 5 s promised
    assert "within 5 s" in refusal.message and "interactive" in refusal.message
    assert "all 8 slots it may use are taken and 3 requests wait ahead" in refusal.message
    assert "about 10 s for a slot" in refusal.message and "batch key" in refusal.message


def test_beyond_the_slots_in_flight_each_waiter_ahead_holds_one_service_time() -> None:
    # 2 slots free in 1 and 3 s; 3 ahead take them at 1, 3 and 1 + 20 s; this one's turn is
    # when the slot freed at 3 s frees again: 23 s
    guess = slo.predict(slo.Outlook(3, 0, (1.0, 3.0), 0), MEASURED)
    assert guess is not None and guess.wait_seconds == 23.0
    # 3 ahead, 2 of them on the free slots now: the 3rd takes the 1 s slot, this one the 3 s
    guess = slo.predict(slo.Outlook(3, 2, (1.0, 3.0), 0), MEASURED)
    assert guess is not None and guess.wait_seconds == 3.0
    refusal = admit(INTERACTIVE_5S, slo.Outlook(5, 2, (1.0, 3.0), 0), MEASURED)
    assert refusal is not None and "5 requests wait ahead of it for the 4 slots" \
        in refusal.message


def test_a_slot_about_to_free_is_worth_waiting_for() -> None:
    """Six streams hold a slot each for about 20 s; the last is 990 of its 1,000 tokens in:
    its slot frees in 0.2 s, so a new arrival is admitted to the queue. Dividing the class's
    service time by its slots (the estimate before) said 20 / 6 = 3.3 s + 2 s: refused."""
    flights = [(stream(age, int(age * 50)), STREAMING) for age in (1.0, 4.0, 7.0, 10.0, 13.0)]
    flights.append((stream(19.8, 990), STREAMING))
    outlook = slo.outlook(0, 0, flights, 8000)
    assert outlook.residuals[0] == pytest.approx(0.2)
    guess = slo.predict(outlook, STREAMING)
    assert guess is not None and guess.seconds == pytest.approx(2.2)
    assert admit(INTERACTIVE_5S, outlook, STREAMING) is None


def test_every_slot_long_to_run_is_refused_at_once_with_the_excess() -> None:
    flights = [(stream(age, int(age * 50)), STREAMING) for age in (1.0, 2.0, 3.0, 4.0)]
    outlook = slo.outlook(0, 0, flights, 8000)
    refusal = admit(INTERACTIVE_5S, outlook, STREAMING)
    # the soonest to free has 1,000 - 200 tokens left at 50/s: 16 s, + 2 s of prefill
    assert refusal is not None and refusal.retry_after == 13
    assert "all 4 slots it may use are taken, so it would wait about 16 s" in refusal.message


@pytest.mark.parametrize(("flight", "left"), [
    (stream(10.0, 500), 10.0),  # 500 of 1,000 tokens to go at 50/s
    (stream(0.5, 0), 1.5 + 20.0),  # still prefilling: 1.5 s of its 2 s left, then 1,000
    (stream(10.0, 500, max_tokens=600), 2.0),  # its cap is nearer than the typical answer
    (stream(10.0, 500, max_tokens=None), 10.0),  # no cap: the typical answer
    (stream(30.0, 1500, max_tokens=4000), 50.0),  # longer than the typical: runs to its cap
    (stream(30.0, 1500, max_tokens=None), 1.0),  # ... or, capless, overdue: 5 % of 20 s
    (stream(12.0, None), 10.0),  # not a stream: as many tokens as its age had time for
    (stream(20.0, 1000), 1.0),  # at its end: overdue, not gone
])
def test_a_residual_is_its_remaining_tokens_over_its_class_rate(flight: slo.Flight,
                                                               left: float) -> None:
    assert slo.residual(flight, STREAMING) == pytest.approx(left)


def test_a_residual_without_a_decode_rate_is_the_service_time_left() -> None:
    assert slo.residual(stream(5.0, 100), MEASURED) == 15.0
    assert slo.residual(stream(25.0, 100), MEASURED) == 1.0  # overdue
    assert slo.residual(stream(5.0, 100), slo.Measures()) == float("inf")
    assert slo.residual(stream(5.0, 100), slo.Measures().with_prior(40.0)) == 35.0


def test_nothing_measured_is_no_reason_to_refuse() -> None:
    unknown = slo.outlook(50, 0, [(stream(1.0, 10), slo.Measures())] * 8, 0)
    assert unknown.residuals == (float("inf"),) * 8
    assert slo.predict(unknown, slo.Measures()) is None
    assert admit(INTERACTIVE_5S, unknown, slo.Measures()) is None
    # a slot taken this instant by a request not yet in flight: its class's service time
    fresh = slo.outlook(0, 0, [], 0, fresh=2, fresh_seconds=None)
    assert slo.predict(fresh, slo.Measures()) is None
    assert slo.outlook(0, 0, [], 0, fresh=2, fresh_seconds=20.0).residuals == (20.0, 20.0)


def test_measures_move_with_what_the_gateway_sees() -> None:
    measures = slo.Measures().served(held_seconds=10.0, prompt_tokens=2000,
                                     engine_ttft_seconds=0.5)
    assert measures.service_seconds.value == 10.0 and measures.prefill_tps.value == 4000.0
    assert measures.decode_tps.value is None and measures.completion_tokens.value is None
    measures = measures.served(held_seconds=20.0, prompt_tokens=0, engine_ttft_seconds=None)
    assert measures.service_seconds.value == pytest.approx(11.0)
    assert measures.prefill_tps.value == 4000.0  # a request without a first token says nothing
    measures = measures.served(held_seconds=3.0, prompt_tokens=0, engine_ttft_seconds=None,
                               completion_tokens=101, decode_seconds=2.0)
    assert measures.decode_tps.value == 50.0 and measures.completion_tokens.value == 101
    assert measures.with_prior(40.0) is measures  # measured: the prior stands aside
    assert slo.Ewma(1.0).add(float("nan")).value == 1.0


# --- the judgement ----------------------------------------------------------------------------

@pytest.mark.parametrize(("ttft", "tokens", "decode", "result"), [
    (1.0, 101, 2.0, slo.MET),  # 50 tok/s
    (6.0, 101, 2.0, slo.MISSED_TTFT),
    (1.0, 101, 5.0, slo.MISSED_DECODE),  # 20 tok/s
    (1.0, 1, 5.0, slo.MET),  # one token has no speed
    (1.0, 101, None, slo.MET),  # not a stream: decode not judged
])
def test_judge(ttft: float, tokens: int, decode: float | None, result: str) -> None:
    assert slo.judge(INTERACTIVE_5S, ttft_seconds=ttft, completion_tokens=tokens,
                     decode_seconds=decode) == result


# --- the queue: shares and priorities ---------------------------------------------------------

async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_a_class_holds_at_most_its_share_and_does_not_block_the_others() -> None:
    async def scenario() -> None:
        admission = Admission(limit=4, queue_max=10)
        assert admission.try_acquire(1, 0, BATCH, 0.5) and admission.try_acquire(1, 0, BATCH, 0.5)
        assert not admission.try_acquire(1, 0, BATCH, 0.5)  # 2 of 4 is batch's half
        batch = asyncio.create_task(admission.acquire(1, 1, 10, 0, BATCH, 0.5))
        await settle()
        assert admission.waiting == 1
        # interactive passes the batch waiter its share holds back
        assert admission.try_acquire(1, 0, INTERACTIVE, 1.0, 10)
        assert admission.group_use == {BATCH: 2, INTERACTIVE: 1}
        admission.release(1, BATCH)
        await asyncio.wait_for(batch, 5)
        assert admission.group_use[BATCH] == 2 and admission.waiting == 0

    asyncio.run(scenario())


def test_higher_priority_waiters_go_first() -> None:
    async def scenario() -> list[str]:
        admission = Admission(limit=1, queue_max=10)
        assert admission.try_acquire()
        order: list[str] = []

        async def wait(name: str, key: int, group: str, priority: int) -> None:
            await admission.acquire(key, 1, 10, 0, group, 1.0, priority)
            order.append(name)
            admission.release(1, group)

        low = asyncio.create_task(wait("batch", 1, BATCH, 0))
        await settle()
        assert admission.waiting_at_or_above(10) == 0 and admission.waiting_at_or_above(0) == 1
        high = asyncio.create_task(wait("interactive", 2, INTERACTIVE, 10))
        await settle()
        admission.release()
        await asyncio.wait_for(asyncio.gather(low, high), 5)
        return order

    assert asyncio.run(scenario()) == ["interactive", "batch"]


# --- the gate: what is in flight --------------------------------------------------------------

class Clock:
    """The gate's clock, moved by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def a_gate(limit: int, raw: dict[str, object] | None = None) -> tuple[ClassGate, Clock]:
    clock = Clock()
    classes = effective(parse_classes(raw or {"interactive": {"ttft_slo_seconds": 5}}))
    return ClassGate(Admission(limit, 16), classes, 30.0, GatewayMetrics(), clock), clock


def serve_one(gate: ClassGate, cls: str, *, held: float, prompt: int, tokens: int,
              rate: float = 50.0) -> None:
    """A stream of `cls` answered: its first token after 2 s, then `tokens` at `rate`/s."""
    gate.served(cls, held_seconds=held, prompt_tokens=prompt, engine_ttft_seconds=2.0,
                completion_tokens=tokens, decode_seconds=(tokens - 1) / rate)


def aboard(gate: ClassGate, cls: str, produced: list[int], max_tokens: int = 1000,
           prompt: int = 8000) -> Ticket:
    """Take a slot and board it; `produced[0]` is its tokens streamed so far."""
    assert gate.try_acquire(gate.of(cls), 1, prompt)
    return gate.board(gate.of(cls), 1, prompt, max_tokens, lambda: produced[0])


def test_a_request_finding_a_slot_about_to_free_queues_and_gets_it() -> None:
    """Both slots are taken, one 990 tokens into its 1,000: its slot frees in 0.2 s, so a
    new interactive request waits for it (the class's 22 s per request over 2 slots, the
    estimate before, said 11 s: refused)."""
    async def scenario() -> None:
        gate, clock = a_gate(2)
        interactive = gate.of(INTERACTIVE)
        serve_one(gate, INTERACTIVE, held=22.0, prompt=8000, tokens=1000)
        long = [0]
        aboard(gate, INTERACTIVE, long)
        ending = aboard(gate, INTERACTIVE, [0])
        clock.now += 21.8
        long[0] = 10
        ending.progress = lambda: 990
        gate.refuse_early(interactive, 8000)  # 0.2 s to a slot + 2 s of prefill: admitted
        waiter = asyncio.create_task(
            gate.acquire(interactive, 7, 1, 8000, gate.allowance(interactive, 8000)))
        await settle()
        assert gate.admission.waiting == 1
        gate.release(interactive, 1, ending)  # the stream ends
        await asyncio.wait_for(waiter, 5)
        assert gate.admission.waiting == 0 and gate.admission.in_use == 2
        assert ending not in gate.flying and len(gate.flying) == 1

    asyncio.run(scenario())


def test_a_request_finding_every_slot_long_to_run_is_refused_at_once() -> None:
    gate, clock = a_gate(2)
    interactive = gate.of(INTERACTIVE)
    serve_one(gate, INTERACTIVE, held=22.0, prompt=8000, tokens=1000)
    aboard(gate, INTERACTIVE, [100])
    aboard(gate, INTERACTIVE, [200])
    clock.now += 4.0
    with pytest.raises(GatewayError) as refused:
        gate.refuse_early(interactive, 8000)
    err = refused.value
    # 800 tokens left at 50/s: 16 s, + 2 s of prefill, over a 5 s promise by 13 s
    assert err.status == 429 and err.code == slo.PREDICTED_MISS and err.retry_after == 13
    assert "first token within 5 s" in str(err) and "about 16 s for a slot" in str(err)
    assert gate.admission.waiting == 0  # never queued


def test_batch_measures_do_not_change_an_interactive_estimate() -> None:
    """A batch stream's 32K prompt and ten-minute hold feed batch's measures only; a batch
    request holding a slot interactive could take counts with its own residual."""
    gate, clock = a_gate(3, {"interactive": {"ttft_slo_seconds": 5},
                             "batch": {"share": 0.5}})
    interactive = gate.of(INTERACTIVE)
    serve_one(gate, INTERACTIVE, held=22.0, prompt=8000, tokens=1000)
    aboard(gate, INTERACTIVE, [500])
    aboard(gate, INTERACTIVE, [600])
    clock.now += 10.0
    before = gate.outlook(interactive, 8000)
    measured = gate.measured(INTERACTIVE)
    serve_one(gate, BATCH, held=600.0, prompt=32768, tokens=1000, rate=999 / 598)
    assert gate.measured(INTERACTIVE) == measured
    assert gate.outlook(interactive, 8000) == before
    assert slo.predict(before, measured) == slo.predict(gate.outlook(interactive, 8000),
                                                        gate.measured(INTERACTIVE))
    # the third slot, now taken by batch, frees by batch's measures: its 2 s of prefill,
    # then 1,000 tokens at 1.67/s
    aboard(gate, BATCH, [0], prompt=32768)
    residuals = gate.outlook(interactive, 8000).residuals
    assert len(residuals) == 3 and residuals[-1] == pytest.approx(2 + 1000 * 598 / 999)


def test_a_class_at_its_share_waits_for_its_own_slots_only() -> None:
    gate, _ = a_gate(4, {"bulk": {"share": 0.5, "ttft_slo_seconds": 60, "priority": 1},
                         "batch": {"share": 0.25}})
    bulk = gate.of("bulk")
    serve_one(gate, INTERACTIVE, held=22.0, prompt=8000, tokens=1000)
    serve_one(gate, "bulk", held=60.0, prompt=8000, tokens=1000)
    aboard(gate, "bulk", [10])
    aboard(gate, "bulk", [20])
    aboard(gate, INTERACTIVE, [990])  # about to free, but not a slot bulk may take
    outlook = gate.outlook(bulk, 8000)
    assert outlook.free == 0 and len(outlook.residuals) == 2
    assert min(outlook.residuals) == pytest.approx((1000 - 20) / 50)


def test_a_slot_granted_before_its_request_boarded_counts_as_just_taken() -> None:
    gate, _ = a_gate(2)
    interactive = gate.of(INTERACTIVE)
    serve_one(gate, INTERACTIVE, held=22.0, prompt=8000, tokens=1000)
    assert gate.try_acquire(interactive, 1, 0) and gate.try_acquire(interactive, 1, 0)
    assert gate.outlook(interactive, 0).residuals == (22.0, 22.0)


# --- prefill ahead in the engine, the headroom, the queue allowance ---------------------------

def prefilling(age: float, prompt: int = 8000, outranks: bool = True) -> slo.Flight:
    return slo.Flight(age, 1, prompt, 1000, 0, outranks)


def test_prefill_ahead_in_the_engine_counts_unless_it_ranks_below() -> None:
    """Two admitted interactive prompts still prefilling (2 s each at 4,000 tok/s, 0.5 s and
    1.5 s in): 1.5 + 0.5 s of the engine's prefill go before a new request's own 2 s. A
    batch prompt below its priority does not: priority scheduling takes this one first."""
    flights = [(prefilling(0.5), STREAMING), (prefilling(1.5), STREAMING),
               (prefilling(0.1, 32768, outranks=False), STREAMING)]
    outlook = slo.outlook(0, 1, flights, 8000)
    assert outlook.backlog == pytest.approx(2.0)
    guess = slo.predict(outlook, STREAMING)
    assert guess is not None and guess.wait_seconds == 0 and guess.seconds == pytest.approx(4.0)
    # streaming already: nothing left to prefill
    assert slo.pending_prefill(stream(3.0, 10), STREAMING) == 0.0


def test_prefill_ahead_is_done_while_the_request_waits_for_its_slot() -> None:
    outlook = slo.Outlook(0, 0, (1.5, 30.0), 8000, backlog=2.0)
    guess = slo.predict(outlook, STREAMING)  # its slot in 1.5 s; 0.5 s of backlog left
    assert guess is not None and guess.seconds == pytest.approx(1.5 + 0.5 + 2.0)
    assert guess.prefill_seconds == pytest.approx(2.5)


def test_the_headroom_is_how_late_the_estimates_ran_one_time_in_ten() -> None:
    measures = STREAMING
    for _ in range(slo.ERRORS_NEEDED - 1):
        measures = measures.erred(2.0)
    assert measures.headroom(5.0) == 0.0  # too few to tell
    measures = STREAMING
    for late in [-0.5] * 30 + [0.2] * 15 + [0.8] * 5:
        measures = measures.erred(late)
    assert len(measures.errors) == slo.ERRORS_KEPT
    assert measures.headroom(5.0) == pytest.approx(0.8)  # the slowest tenth
    for _ in range(slo.ERRORS_KEPT):
        measures = measures.erred(-1.0)  # early every time: no headroom, never negative
    assert measures.headroom(5.0) == 0.0
    for _ in range(slo.ERRORS_KEPT):
        measures = measures.erred(9.0)
    assert measures.headroom(5.0) == 2.5  # at most half the promise
    assert measures.erred(float("nan")) == measures


def test_a_request_inside_the_slo_but_not_its_headroom_is_refused_and_told_why() -> None:
    late = STREAMING
    for _ in range(slo.ERRORS_KEPT):
        late = late.erred(1.0)
    outlook = slo.Outlook(0, 0, (2.5, 30.0), 8000)  # 2.5 s to a slot + 2 s: 4.5 s
    assert admit(INTERACTIVE_5S, outlook, STREAMING) is None
    refusal = admit(INTERACTIVE_5S, outlook, late)
    assert refusal is not None and refusal.retry_after == 1
    assert "one in ten such estimates ran 1.0 s late or more" in refusal.message


def test_a_waiter_may_wait_only_as_long_as_its_prefill_leaves_it() -> None:
    """Interactive (5 s) whose 8,000-token prompt takes 2 s to prefill: a slot granted after
    3 s cannot give it its first token in time, so it waits 3 s at most; a second's measured
    lateness takes another second; batch keeps its deadline."""
    gate, _ = a_gate(2, {"interactive": {"ttft_slo_seconds": 5},
                         "batch": {"deadline_seconds": 600}})
    interactive, batch = gate.of(INTERACTIVE), gate.of(BATCH)
    assert gate.allowance(interactive, 8000) == 5.0  # nothing measured yet: the SLO
    serve_one(gate, INTERACTIVE, held=22.0, prompt=8000, tokens=1000)  # 4,000 tok/s
    assert gate.allowance(interactive, 8000) == pytest.approx(3.0)
    for _ in range(slo.ERRORS_KEPT):
        gate.erred(INTERACTIVE, 1.0)
    assert gate.allowance(interactive, 8000) == pytest.approx(2.0)
    assert gate.allowance(interactive, 40_000) == 0.0  # its prefill alone is over: no wait
    assert gate.allowance(batch, 32768) == 600.0


def test_a_queued_request_that_ran_late_raises_the_headroom_on_the_live_path() -> None:
    """refuse_early hands back the prediction it admitted on; the lateness the gateway sees
    at the first token goes into the class's measures (app._judge calls erred)."""
    gate, clock = a_gate(1)
    interactive = gate.of(INTERACTIVE)
    serve_one(gate, INTERACTIVE, held=22.0, prompt=8000, tokens=1000)
    aboard(gate, INTERACTIVE, [900])  # 100 tokens to go: 2 s
    clock.now += 21.8
    predicted = gate.refuse_early(interactive, 8000)
    assert predicted == pytest.approx(2.0 + 2.0)
    for _ in range(slo.ERRORS_KEPT):
        gate.erred(INTERACTIVE, 3.2)  # every first token 3.2 s later than predicted
    with pytest.raises(GatewayError) as refused:
        gate.refuse_early(interactive, 8000)  # 4 + 2.5 (at most half the SLO) > 5
    assert refused.value.retry_after == 2


# --- the decode-floor guard -------------------------------------------------------------------

FLOORED = {"interactive": {"ttft_slo_seconds": 5, "decode_floor_tps": 32},
           "batch": {"share": 0.5, "deadline_seconds": 600}}


def streaming(gate: ClassGate, cls: str, clock: Clock, tokens: list[int],
              since: float) -> Ticket:
    """A stream of `cls` aboard whose first token came `since` seconds ago."""
    ticket = aboard(gate, cls, tokens)
    first = clock.now - since
    ticket.first = lambda: first
    return ticket


def test_a_stream_under_its_floor_holds_batch_back_and_interactive_still_goes(
        caplog: pytest.LogCaptureFixture) -> None:
    gate, clock = a_gate(4, FLOORED)
    interactive, batch = gate.of(INTERACTIVE), gate.of(BATCH)
    aboard(gate, BATCH, [100])
    slow = [200]
    streaming(gate, INTERACTIVE, clock, slow, since=10.0)  # 199 tokens in 10 s: 19.9/s
    with caplog.at_level("INFO", "appliance.gateway.class_gate"):
        assert not gate.try_acquire(batch, 1, 32768)  # another 32K prefill: slower still
        assert not gate.try_acquire(batch, 1, 32768)
        assert gate.try_acquire(interactive, 1, 8000)
        slow[0] = 400  # 39.9/s: over 1.1 x 32
        assert gate.try_acquire(batch, 1, 32768)
    # said in the log once as it turns, each way, with the stream's speed and the floor
    assert [r.getMessage() for r in caplog.records] == [
        "holding back work of priority 0 and below: a stream of the interactive class runs "
        "at 19.9 tokens/s, under 1.1 x its floor of 32",
        "no longer holding back lower-priority work: every judged stream runs above 1.1 x "
        "its class's floor"]


def test_a_stream_too_young_to_judge_holds_nothing() -> None:
    gate, clock = a_gate(4, FLOORED)
    aboard(gate, BATCH, [100])
    streaming(gate, INTERACTIVE, clock, [GUARD_TOKENS - 1], since=10.0)  # 15 tokens: unjudged
    aboard(gate, INTERACTIVE, [0])  # not streaming yet: nothing to read
    assert gate.try_acquire(gate.of(BATCH), 1, 32768)


def test_work_that_may_wait_keeps_one_slot_however_slow_the_streams() -> None:
    gate, clock = a_gate(4, FLOORED)
    streaming(gate, INTERACTIVE, clock, [100], since=10.0)  # 9.9/s, yet no batch in flight
    assert gate.try_acquire(gate.of(BATCH), 1, 32768)


def test_a_held_batch_request_waits_and_goes_once_the_slow_stream_ends() -> None:
    async def scenario() -> None:
        gate, clock = a_gate(4, FLOORED)
        batch = gate.of(BATCH)
        aboard(gate, BATCH, [100])
        slow = streaming(gate, INTERACTIVE, clock, [200], since=10.0)
        waiter = asyncio.create_task(gate.acquire(batch, 9, 1, 32768, 600.0))
        await settle()
        assert gate.admission.waiting == 1 and gate.admission.in_use == 2  # a slot free, held
        gate.release(gate.of(INTERACTIVE), 1, slow)  # the slow stream ends: nobody strained
        await asyncio.wait_for(waiter, 5)
        assert gate.admission.waiting == 0 and gate.admission.group_use[BATCH] == 2

    asyncio.run(scenario())


def test_without_a_floor_above_another_class_there_is_no_guard() -> None:
    assert a_gate(4, {"interactive": {"ttft_slo_seconds": 5}, "batch": {}})[0] \
        .admission.may_grant is None
    # the floor on the lowest class only: nothing ranks below it to hold back
    assert a_gate(4, {"interactive": {"priority": 0}, "batch": {"decode_floor_tps": 5}})[0] \
        .admission.may_grant is None


def test_a_waiter_that_timed_out_teaches_the_headroom_the_least_it_was_late_by() -> None:
    gate, _ = a_gate(2)
    interactive = gate.of(INTERACTIVE)
    serve_one(gate, INTERACTIVE, held=22.0, prompt=8000, tokens=1000)  # 2 s of prefill
    for _ in range(slo.ERRORS_NEEDED):
        # predicted 2.5 s; waited 3 s without a slot: at least 3 + 2 - 2.5 s late
        gate.waited_out(interactive, 8000, 2.5, 3.0)
    assert gate.measured(INTERACTIVE).errors == (2.5,) * slo.ERRORS_NEEDED
    gate.waited_out(interactive, 8000, None, 3.0)  # never predicted: says nothing
    assert len(gate.measured(INTERACTIVE).errors) == slo.ERRORS_NEEDED
