"""The gateway's hot-path shortcuts (issue 24) keep what they replace: a metric's children
kept by its labels count as prometheus_client's own did, and the start's objects are frozen
out of the garbage collector once the gateway is ready."""

from __future__ import annotations

import gc

from appliance.gateway.metrics import GatewayMetrics
from appliance.gateway.serve import _freeze_startup_objects
from appliance.gateway.sse import StreamMeter


def test_kept_children_count_as_the_library_s_own() -> None:
    metrics = GatewayMetrics()
    first = metrics.requests.labels("chat", "200", "ok")
    assert metrics.requests.labels("chat", "200", "ok") is first
    first.inc()
    metrics.requests.labels("chat", "200", "ok").inc(2)
    metrics.requests.labels("chat", "429", "queue_full").inc()
    metrics.tokens.labels(kind="prompt").inc(5)  # by name: the library's own path
    metrics.duration.labels("chat").observe(0.2)
    metrics.slo.labels("interactive", "met", "").inc()
    text = metrics.render().decode()
    assert 'appliance_gateway_requests_total{endpoint="chat",outcome="ok",status="200"} 3.0' \
        in text
    assert 'outcome="queue_full",status="429"} 1.0' in text
    assert 'appliance_gateway_tokens_total{kind="prompt"} 5.0' in text
    assert 'appliance_gateway_request_duration_seconds_count{endpoint="chat"} 1.0' in text
    assert 'appliance_gateway_slo_requests_total{class="interactive",reason="",result="met"}' \
        in text


def test_whole_event_chunks_are_metered_and_the_end_seen() -> None:
    meter = StreamMeter(strip_usage=False)
    token = b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n'
    assert meter.feed(token) == token
    assert meter.feed(token + token) == token + token
    assert not meter.ended
    usage = b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":3}}\n\n'
    assert meter.feed(usage + b"data: [DONE]\n\n") == usage + b"data: [DONE]\n\n"
    assert meter.ended and meter.events == 3
    assert (meter.usage.prompt_tokens, meter.usage.completion_tokens) == (3, 3)
    cutting = StreamMeter(strip_usage=True)
    assert cutting.feed(token + usage) == token  # the usage-only event the client did not ask for


def test_the_start_s_objects_are_frozen_once() -> None:
    try:
        _freeze_startup_objects()
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
