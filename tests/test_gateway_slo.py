"""Service classes and admission that predicts (issue 24), pure: the classes' validation, the
TTFT estimate and its early refusal, the judgement of an answered request, and the admission
queue's shares and priorities (asyncio, no sockets). Milliseconds."""

from __future__ import annotations

import asyncio

import pytest

from appliance.gateway import slo
from appliance.gateway.admission import Admission
from appliance.gateway.classes import (
    BATCH,
    DEFAULT_CLASSES,
    INTERACTIVE,
    ClassProblem,
    ServiceClass,
    effective,
    parse_classes,
)

INTERACTIVE_5S = ServiceClass(INTERACTIVE, ttft_slo_seconds=5.0, decode_floor_tps=32.0,
                              priority=10)
MEASURED = slo.Measures(slo.Ewma(20.0), slo.Ewma(4000.0))  # 20 s a request, 4,000 tok/s


# --- classes ----------------------------------------------------------------------------------

def test_defaults_promise_nothing_new() -> None:
    interactive = DEFAULT_CLASSES[INTERACTIVE]
    assert interactive.ttft_slo_seconds is None and interactive.share == 1
    assert interactive.wait_allowance(60) == 60  # as gateway.queue_wait_seconds before classes
    assert DEFAULT_CLASSES[BATCH].wait_allowance(60) == 600
    assert slo.admit(interactive, slo.Outlook(500, 0, 8, 10_000), MEASURED) is None


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
    guess = slo.predict(slo.Outlook(0, 1, 8, 8000), MEASURED)
    assert guess is not None and guess.wait_seconds == 0 and guess.seconds == 2.0
    assert slo.admit(INTERACTIVE_5S, slo.Outlook(0, 1, 8, 8000), MEASURED) is None


def test_a_queue_ahead_costs_a_slot_turn_each_and_is_refused_with_the_excess() -> None:
    # 3 ahead, nothing free, 8 slots each freeing every 20 s: (3 + 1) x 20 / 8 = 10 s + 2 s
    outlook = slo.Outlook(3, 0, 8, 8000)
    guess = slo.predict(outlook, MEASURED)
    assert guess is not None and guess.seconds == 12.0
    refusal = slo.admit(INTERACTIVE_5S, outlook, MEASURED)
    assert refusal is not None and refusal.retry_after == 7  # 12 s predicted, 5 s promised
    assert "within 5 s" in refusal.message and "interactive" in refusal.message
    assert "3 requests wait ahead" in refusal.message and "batch key" in refusal.message


def test_nothing_measured_is_no_reason_to_refuse() -> None:
    assert slo.predict(slo.Outlook(50, 0, 8, 0), slo.Measures()) is None
    assert slo.admit(INTERACTIVE_5S, slo.Outlook(50, 0, 8, 0), slo.Measures()) is None


def test_measures_move_with_what_the_gateway_sees() -> None:
    measures = slo.Measures().served(held_seconds=10.0, prompt_tokens=2000,
                                     engine_ttft_seconds=0.5)
    assert measures.service_seconds.value == 10.0 and measures.prefill_tps.value == 4000.0
    measures = measures.served(held_seconds=20.0, prompt_tokens=0, engine_ttft_seconds=None)
    assert measures.service_seconds.value == pytest.approx(11.0)
    assert measures.prefill_tps.value == 4000.0  # a request without a first token says nothing
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
