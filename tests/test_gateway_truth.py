"""The gateway tells the truth about what it can serve (issue 14) and admits by size (issue 15).

`/health` is what a load balancer probes: 200 only while a request would be served, 503 with
the engine's state, the reason and Retry-After otherwise. The idle gateway reads the
database only as often as it must.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import httpx
import pytest
from sqlalchemy.orm import Session

from appliance.config import Config
from appliance.db.database import Database
from appliance.gateway.admission import Admission, QueueTimeout, estimate_prompt_tokens
from appliance.gateway.parts import free_kv_tokens
from tests.conftest import wait_for
from tests.gateway_rig import (
    LiveGateway,
    auth,
    chat_body,
    emulator_stats,
    start_engine,
    stop_engine,
)
from tests.test_fake_sglang import Emulator

T = TypeVar("T")


def test_health_is_503_with_the_reason_until_the_engine_is_ready(gateway: LiveGateway) -> None:
    healthy = httpx.get(f"{gateway.url}/health", timeout=5)
    assert healthy.status_code == 200
    body = healthy.json()
    assert body["status"] == "ok" and body["engine"] == "ready" and body["admitting"] is True

    gateway.publish("stopped", "stopped by the operator")
    gateway.wait_admitting(False)
    stopped = httpx.get(f"{gateway.url}/health", timeout=5)
    assert stopped.status_code == 503
    body = stopped.json()
    assert body["status"] == "unavailable" and body["engine"] == "stopped"
    assert "the engine is stopped: stopped by the operator" in body["reason"]
    assert stopped.headers["retry-after"] == "30" and body["retry_after"] == 30
    # the same reason a request gets
    key = gateway.key()
    refused = httpx.post(f"{gateway.url}/v1/chat/completions", headers=auth(key),
                         json=chat_body(), timeout=10)
    assert refused.status_code == 503
    assert refused.json()["error"]["message"] == body["reason"]

    gateway.publish("loading_weights", "loading weights: 42%", eta=1800)
    gateway.wait_admitting(False)

    def loading() -> bool:
        reply = httpx.get(f"{gateway.url}/healthz", timeout=5)
        return reply.status_code == 503 and reply.json()["engine"] == "loading_weights"


    wait_for(loading, "the gateway to see the engine loading")
    reply = httpx.get(f"{gateway.url}/healthz", timeout=5)
    assert reply.headers["retry-after"] == "1800" and "about 30 min" in reply.json()["reason"]

    gateway.publish("degraded", "alive but failing: /ready fails")
    wait_for(lambda: httpx.get(f"{gateway.url}/health", timeout=5).json()["engine"]
             == "degraded", "the gateway to see the engine degraded")
    assert httpx.get(f"{gateway.url}/health", timeout=5).status_code == 503

    gateway.publish("ready", "serving")
    gateway.wait_admitting()
    assert httpx.get(f"{gateway.url}/health", timeout=5).status_code == 200


class CountingDatabase(Database):
    """The database the gateway uses, counting its transactions (the seam for idle work)."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.runs = 0

    async def run(self, fn: Callable[[Session], T]) -> T:
        self.runs += 1
        return await super().run(fn)


def test_an_idle_gateway_backs_off_and_a_request_wakes_it(config: Config, db: Database,
                                                           gateway_engine: Emulator) -> None:
    counting = CountingDatabase(db.url)
    live = LiveGateway(config, counting, gateway_engine.url, idle_poll_interval=1.0,
                       idle_after=0.3).start()  # busy: a poll every 0.1 s (the rig's)
    try:
        key = live.key()
        live.publish("ready", "serving")
        live.wait_admitting()
        wait_for(lambda: live.parts.backed_off, "the poll to back off")
        before = counting.runs
        time.sleep(3.0)
        # Busy, that would be ~30 polls; idle, one a second (none of it usage writes).
        assert counting.runs - before <= 5

        # Freshness is not lost: a state published while idle is what a probe sees within
        # the poll's shortest spacing (0.5 s), not after the idle interval.
        def health_is(code: int) -> bool:
            return httpx.get(f"{live.url}/health", timeout=5).status_code == code

        live.publish("stopped", "stopped by the operator")
        wait_for(lambda: health_is(503), "the stop to show on /health", timeout=5)
        live.publish("ready", "serving")
        wait_for(lambda: health_is(200), "the ready state to show on /health", timeout=5)
        reply = httpx.post(f"{live.url}/v1/chat/completions", headers=auth(key),
                           json=chat_body(max_tokens=3), timeout=30)
        assert reply.status_code == 200
        live.usage_rows(1)  # written once there was something to write
    finally:
        live.stop()
        counting.dispose()


def test_a_prompt_larger_than_its_kv_share_waits_in_turn() -> None:
    async def scenario() -> None:
        admission = Admission(limit=4, queue_max=10)
        admission.set_kv_free(1000)
        assert admission.try_acquire(1, 100)  # alone with 1000 free
        # the next one shares the 900 left with the one admitted: 450 each, not 900/3 empty
        # slots (an idle box's limit would otherwise hold back every long prompt)
        assert admission.kv_free == 900 and admission.kv_share() == 450
        assert not admission.try_acquire(1, 500)  # over its share: not sent in
        order: list[str] = []

        async def wait(name: str, key: int, tokens: int, timeout: float = 10) -> None:
            await admission.acquire(key, 1, timeout, tokens)
            order.append(name)

        big = asyncio.create_task(wait("big", 2, 500))
        await asyncio.sleep(0)
        small = asyncio.create_task(wait("small", 3, 10))  # nobody jumps the queue
        await asyncio.sleep(0)
        assert admission.waiting == 2 and order == []
        admission.set_kv_free(1500)  # the engine freed KV: 750 for the next one now
        await asyncio.gather(big, small)
        assert order == ["big", "small"] and admission.in_use == 3

        with pytest.raises(QueueTimeout):  # bounded by the queue timeout, as ever
            await wait("huge", 4, 5000, timeout=0.05)
        assert admission.waiting == 0
        huge = asyncio.create_task(wait("huge", 4, 5000))
        await asyncio.sleep(0)
        for _ in range(3):
            admission.release()
        await huge  # alone, any size runs: it waits for room, never forever
        assert order[-1] == "huge" and admission.in_use == 1

    asyncio.run(scenario())


def test_free_kv_tokens_from_the_engines_load_report() -> None:
    loads = {"loads": [{"max_total_num_tokens": 1000, "num_used_tokens": 250},
                       {"max_total_num_tokens": 1000, "num_used_tokens": 1200}]}
    assert free_kv_tokens(loads) == 750
    assert free_kv_tokens({"loads": []}) is None
    assert free_kv_tokens({"loads": [{"num_used_tokens": 1}]}) is None
    assert free_kv_tokens(None) is None
    assert estimate_prompt_tokens(b"x" * 4000) == 1000


def test_the_gateway_holds_a_prompt_the_engines_kv_pool_cannot_take(
        config: Config, db: Database, tmp_path_factory: pytest.TempPathFactory) -> None:
    engine = start_engine(tmp_path_factory, "--max-total-tokens", "1200", token_seconds=0.05)
    live = LiveGateway(config, db, engine.url).start()
    try:
        live.publish("ready", "serving")
        live.wait_admitting()
        key = live.key()
        # ~100 tokens each in the engine: whenever the gateway reads the pool, the third
        # still fits its share (with 200 it could be held while two ran: 2 of 3 ran together)
        filler = " ".join(["word"] * 100)

        async def scenario() -> list[int]:
            async with httpx.AsyncClient(timeout=60) as client:
                def send(content: str, max_tokens: int) -> Awaitable[httpx.Response]:
                    return client.post(f"{live.url}/v1/chat/completions", headers=auth(key),
                                       json=chat_body(content, max_tokens=max_tokens))

                # 160 tokens at 0.05 s: the fillers hold their KV for 8 s, room for a slow
                # machine to see all three run and two pool readings (60 tokens, 3 s, was
                # too short on CI: the fillers had finished before the share was read)
                fillers = [asyncio.ensure_future(send(f"{i} {filler}", 160)) for i in range(3)]
                parts = live.parts
                for _ in range(600):  # the three run, and the gateway read the pool since
                    if emulator_stats(engine)["running"] == 3:
                        break
                    await asyncio.sleep(0.05)
                assert emulator_stats(engine)["running"] == 3, (
                    f"the three fillers never ran together: {emulator_stats(engine)}")
                seen = parts.kv_readings
                for _ in range(600):
                    if parts.kv_readings >= seen + 2:
                        break
                    await asyncio.sleep(0.05)
                assert parts.kv_readings >= seen + 2, "the gateway never read the KV pool"
                assert parts.admission.in_use == 3 and not any(f.done() for f in fillers)
                assert parts.admission.limit == 4  # a slot is free: only KV can hold it
                share = parts.admission.kv_share()
                assert share is not None and share < 700, share
                big = asyncio.ensure_future(send(" ".join(["word"] * 700), 5))  # ~900 est.
                for _ in range(600):  # it waits in the gateway's queue, not in the engine
                    if parts.admission.waiting == 1 or big.done():
                        break
                    await asyncio.sleep(0.05)
                assert not big.done() and parts.admission.waiting == 1
                assert emulator_stats(engine)["running"] <= 3
                replies = await asyncio.gather(*fillers, big)
                return [r.status_code for r in replies]

        assert asyncio.run(scenario()) == [200] * 4
    finally:
        live.stop()
        stop_engine(engine)
