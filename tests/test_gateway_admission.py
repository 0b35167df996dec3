"""Admission and per-key limits, as pure asyncio: no sockets, no sleeps that matter."""

from __future__ import annotations

import asyncio
import datetime as dt

import pytest

from appliance.gateway.admission import Admission, QueueFull, QueueTimeout
from appliance.gateway.limits import KeyLimiter


def run(coro: object) -> object:
    return asyncio.run(coro)  # type: ignore[arg-type]


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_fast_path_until_full_then_fifo_per_key() -> None:
    async def scenario() -> list[str]:
        admission = Admission(limit=2, queue_max=10)
        assert admission.try_acquire() and admission.try_acquire()
        assert not admission.try_acquire()
        order: list[str] = []

        async def wait(name: str, key: int) -> None:
            await admission.acquire(key, 1, timeout=10)
            order.append(name)

        tasks = [asyncio.create_task(wait(f"a{i}", 1)) for i in range(3)]
        await settle()
        assert admission.waiting == 3 and order == []
        for _ in range(3):
            admission.release()
            await settle()
        await asyncio.gather(*tasks)
        return order

    assert run(scenario()) == ["a0", "a1", "a2"]


def test_round_robin_across_keys_a_busy_key_cannot_starve_another() -> None:
    async def scenario() -> list[str]:
        admission = Admission(limit=1, queue_max=100)
        assert admission.try_acquire()
        order: list[str] = []

        async def wait(name: str, key: int) -> None:
            await admission.acquire(key, 1, timeout=10)
            order.append(name)
            await asyncio.sleep(0)
            admission.release()

        busy = [asyncio.create_task(wait(f"A{i}", 1)) for i in range(6)]
        await settle()
        late = [asyncio.create_task(wait(f"B{i}", 2)) for i in range(2)]
        await settle()
        admission.release()
        await asyncio.gather(*busy, *late)
        return order

    order = run(scenario())
    # B arrived after six of A's were queued, yet alternates with A from the first free slot
    assert order[:4] == ["A0", "B0", "A1", "B1"]
    assert sorted(order) == sorted([f"A{i}" for i in range(6)] + ["B0", "B1"])


def test_new_arrivals_never_jump_the_queue() -> None:
    async def scenario() -> None:
        admission = Admission(limit=1, queue_max=10)
        assert admission.try_acquire()
        waiter = asyncio.create_task(admission.acquire(1, 1, timeout=10))
        await settle()
        admission.release()  # handed to the waiter, not left for a newcomer
        assert not admission.try_acquire()
        await waiter
        assert admission.in_use == 1

    run(scenario())


def test_queue_full_and_queue_timeout() -> None:
    async def scenario() -> None:
        admission = Admission(limit=1, queue_max=1)
        assert admission.try_acquire()
        first = asyncio.create_task(admission.acquire(1, 1, timeout=0.05))
        await settle()
        with pytest.raises(QueueFull):
            await admission.acquire(2, 1, timeout=10)
        with pytest.raises(QueueTimeout):
            await first
        assert admission.waiting == 0 and admission.in_use == 1

    run(scenario())


def test_a_cancelled_waiter_leaves_the_queue_and_holds_nothing() -> None:
    async def scenario() -> None:
        admission = Admission(limit=1, queue_max=10)
        assert admission.try_acquire()
        gone = asyncio.create_task(admission.acquire(1, 1, timeout=10))
        stays = asyncio.create_task(admission.acquire(2, 1, timeout=10))
        await settle()
        gone.cancel()
        await settle()
        assert admission.waiting == 1
        admission.release()
        await stays
        assert admission.in_use == 1 and admission.waiting == 0
        # granted and cancelled in the same instant: the slot is handed back
        racing = asyncio.create_task(admission.acquire(3, 1, timeout=10))
        await settle()
        admission.release()
        racing.cancel()
        await settle()
        assert admission.in_use == 0

    run(scenario())


def test_weights_and_raising_the_limit() -> None:
    async def scenario() -> None:
        admission = Admission(limit=4, queue_max=10)
        assert admission.try_acquire(3)
        heavy = asyncio.create_task(admission.acquire(1, 2, timeout=10))
        await settle()
        assert not heavy.done()
        admission.set_limit(5)
        await heavy
        assert admission.in_use == 5
        # heavier than the whole limit: waits for everything else, then runs alone
        huge = asyncio.create_task(admission.acquire(2, 9, timeout=10))
        await settle()
        admission.release(3)
        await settle()
        assert not huge.done()
        admission.release(2)
        await huge
        assert admission.in_use == 9

    run(scenario())


def test_requests_per_minute_is_a_sliding_window() -> None:
    limiter = KeyLimiter()
    assert limiter.admit_rate(1, 2, now=100.0) is None
    assert limiter.admit_rate(1, 2, now=110.0) is None
    assert limiter.admit_rate(1, 2, now=120.0) == 40  # the first leaves the window at 160
    assert limiter.admit_rate(2, 2, now=120.0) is None  # keys are apart
    assert limiter.admit_rate(1, 2, now=160.5) is None


def test_tokens_per_day_renew_at_midnight_utc() -> None:
    limiter = KeyLimiter()
    evening = dt.datetime(2026, 11, 30, 23, 0, tzinfo=dt.UTC)
    limiter.seed_tokens({1: 900}, evening)
    assert limiter.over_daily(1, 1000, evening) is None
    limiter.add_tokens(1, 100, evening)
    assert limiter.over_daily(1, 1000, evening) == 3600
    assert limiter.over_daily(1, 1000, evening + dt.timedelta(hours=1, seconds=1)) is None
