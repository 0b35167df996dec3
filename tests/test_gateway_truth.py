"""The gateway tells the truth about what it can serve (issue 14) and admits by size (issue 15).

`/health` is what a load balancer probes: 200 only while a request would be served, 503 with
the engine's state, the reason and Retry-After otherwise. The idle gateway reads the
database only as often as it must.
"""

from __future__ import annotations

import httpx

from tests.conftest import wait_for
from tests.gateway_rig import LiveGateway, auth, chat_body


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
