"""The gateway tells the truth about what it can serve (issue 14) and admits by size (issue 15).

`/health` is what a load balancer probes: 200 only while a request would be served, 503 with
the engine's state, the reason and Retry-After otherwise. The idle gateway reads the
database only as often as it must.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import httpx
from sqlalchemy.orm import Session

from appliance.config import Config
from appliance.db.database import Database
from tests.conftest import wait_for
from tests.gateway_rig import LiveGateway, auth, chat_body
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

        # Freshness is not lost: a state published while idle is what the next probe sees.
        live.publish("stopped", "stopped by the operator")
        assert httpx.get(f"{live.url}/health", timeout=5).status_code == 503
        live.publish("ready", "serving")
        assert httpx.get(f"{live.url}/health", timeout=5).status_code == 200
        reply = httpx.post(f"{live.url}/v1/chat/completions", headers=auth(key),
                           json=chat_body(max_tokens=3), timeout=30)
        assert reply.status_code == 200
        live.usage_rows(1)  # written once there was something to write
    finally:
        live.stop()
        counting.dispose()
