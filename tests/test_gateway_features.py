"""Gateway features over the real stack: tool calls and reasoning through the `openai` SDK,
Anthropic Messages, per-key limits, conversation-history verdicts, metrics, and an engine
that cannot be reached.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import openai

from appliance.config import Config
from appliance.db.database import Database
from tests.conftest import free_port
from tests.gateway_rig import (
    MODEL,
    LiveGateway,
    auth,
    chat_body,
    emulator_stats,
)
from tests.test_fake_sglang import Emulator

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}




def sdk(gateway: LiveGateway, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=0, timeout=30)


def test_tool_calls_pass_through_streamed_and_not(gateway: LiveGateway) -> None:
    client = sdk(gateway, gateway.key())
    messages: list[dict[str, object]] = [{"role": "user", "content": "weather in Paris?"}]
    answer = client.chat.completions.create(model=MODEL, messages=messages,  # type: ignore
                                            tools=[WEATHER])
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]  # type: ignore[index]
    assert call.function.name == "get_weather"  # type: ignore[union-attr]
    assert "city" in json.loads(call.function.arguments)  # type: ignore[union-attr]

    chunks = list(client.chat.completions.create(model=MODEL, messages=messages,  # type: ignore
                                                 tools=[WEATHER], stream=True))
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert deltas and deltas[0].function.name == "get_weather"  # type: ignore[union-attr]
    arguments = "".join(d.function.arguments or "" for d in deltas)  # type: ignore[union-attr]
    assert json.loads(arguments) == json.loads(call.function.arguments)  # type: ignore

    messages += [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                 {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    final = client.chat.completions.create(model=MODEL, messages=messages,  # type: ignore
                                           tools=[WEATHER])
    assert final.choices[0].message.content and final.choices[0].finish_reason == "stop"


def test_reasoning_content_passes_unmodified(gateway: LiveGateway,
                                             gateway_engine: Emulator) -> None:
    key = gateway.key()
    body = chat_body("think first", chat_template_kwargs={"thinking": True}, max_tokens=40)
    direct = httpx.post(f"{gateway_engine.url}/v1/chat/completions", json=body, timeout=30).json()
    through = httpx.post(f"{gateway.url}/v1/chat/completions", json=body, headers=auth(key),
                         timeout=30).json()
    assert through["choices"][0]["message"]["reasoning_content"]
    assert through["choices"][0]["message"] == direct["choices"][0]["message"]


def test_anthropic_messages_streamed_and_not_with_usage(gateway: LiveGateway) -> None:
    key = gateway.key()
    body = {"model": MODEL, "max_tokens": 20,
            "messages": [{"role": "user", "content": "hello claude-style"}]}
    reply = httpx.post(f"{gateway.url}/v1/messages", json=body, timeout=30,
                       headers={"x-api-key": key, "anthropic-version": "2023-06-01"})
    assert reply.status_code == 200, reply.text
    message = reply.json()
    assert message["type"] == "message" and message["content"][0]["text"]
    with httpx.stream("POST", f"{gateway.url}/v1/messages", json={**body, "stream": True},
                      headers={"x-api-key": key}, timeout=30) as stream:
        events = [line.split(": ", 1)[1] for line in stream.iter_lines()
                  if line.startswith("event: ")]
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert "content_block_delta" in events and "message_delta" in events
    rows = gateway.usage_rows(2)
    # Anthropic counts cache reads apart from input_tokens; the gateway records the whole
    # prompt either way (the second, identical prompt hit the emulator's prefix cache)
    prompt = message["usage"]["input_tokens"] + message["usage"].get(
        "cache_read_input_tokens", 0)
    for row in rows:
        assert row[1] == "messages" and row[4] == "ok"
        assert (row[5], row[6]) == (prompt, message["usage"]["output_tokens"])
    assert rows[1][7] > 0


def test_per_key_rate_concurrency_and_daily_token_limits(gateway: LiveGateway) -> None:
    rpm = gateway.key("rpm", requests_per_minute=2)
    codes = [httpx.post(f"{gateway.url}/v1/chat/completions", json=chat_body(),
                        headers=auth(rpm), timeout=30) for _ in range(3)]
    assert [c.status_code for c in codes] == [200, 200, 429]
    assert codes[2].json()["error"]["code"] == "requests_per_minute_limit"
    assert 1 <= int(codes[2].headers["retry-after"]) <= 60

    one = gateway.key("one-at-a-time", max_concurrency=1)

    async def two_at_once() -> list[int]:
        async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as http:
            first = asyncio.create_task(http.post(
                "/v1/chat/completions", headers=auth(one),
                json=chat_body("slow", max_tokens=400, ignore_eos=True)))
            for _ in range(2000):
                if gateway.parts.admission.in_use or first.done():
                    break
                await asyncio.sleep(0.01)
            second = await http.post("/v1/chat/completions", headers=auth(one),
                                     json=chat_body())
            return [(await first).status_code, second.status_code]

    assert asyncio.run(two_at_once()) == [200, 429]

    budget = gateway.key("budget", tokens_per_day=30)
    first = httpx.post(f"{gateway.url}/v1/chat/completions", headers=auth(budget),
                       json=chat_body(max_tokens=40, ignore_eos=True), timeout=30)
    assert first.status_code == 200  # under budget when it started
    over = httpx.post(f"{gateway.url}/v1/chat/completions", headers=auth(budget),
                      json=chat_body(), timeout=30)
    assert over.status_code == 429 and over.json()["error"]["code"] == "tokens_per_day_limit"
    assert int(over.headers["retry-after"]) <= 86400


def test_history_verdicts_are_recorded_per_request(gateway: LiveGateway) -> None:
    client = sdk(gateway, gateway.key("historian"))
    system = {"role": "system", "content": "be brief"}
    history: list[dict[str, object]] = [system, {"role": "user", "content": "first question"}]
    verdicts = []
    for turn in ("second question", "third question"):
        answer = client.chat.completions.create(model=MODEL, messages=history)  # type: ignore
        history += [{"role": "assistant", "content": answer.choices[0].message.content},
                    {"role": "user", "content": turn}]
    client.chat.completions.create(model=MODEL, messages=history)  # type: ignore
    rewritten = [system, {"role": "user", "content": "first question"},
                 {"role": "assistant", "content": "an edited answer"},
                 {"role": "user", "content": "next"}]
    client.chat.completions.create(model=MODEL, messages=rewritten)  # type: ignore
    verdicts = [row[8] for row in gateway.usage_rows(4)]
    assert verdicts == ["new", "appended", "appended", "rewritten"]


def test_metrics_count_requests_tokens_and_admission(gateway: LiveGateway) -> None:
    key = gateway.key()
    httpx.post(f"{gateway.url}/v1/chat/completions", json=chat_body(), headers=auth(key))
    httpx.post(f"{gateway.url}/v1/chat/completions", json={"model": MODEL}, headers=auth(key))
    text = httpx.get(f"{gateway.url}/metrics").text
    assert 'appliance_gateway_requests_total{endpoint="chat",outcome="ok",status="200"} 1.0' \
        in text
    assert 'appliance_gateway_requests_total{endpoint="chat",outcome="invalid_request",' \
        'status="400"} 1.0' in text
    assert "appliance_gateway_concurrency_limit 4.0" in text
    assert 'appliance_gateway_tokens_total{kind="completion"}' in text
    assert "appliance_gateway_time_to_first_token_seconds_bucket" in text
    assert "appliance_gateway_queue_depth 0.0" in text


def test_an_unreachable_engine_is_a_502_not_a_hang(config: Config, db: Database) -> None:
    live = LiveGateway(config, db, f"http://127.0.0.1:{free_port()}").start()
    try:
        live.publish("ready")
        live.wait_admitting()
        reply = httpx.post(f"{live.url}/v1/chat/completions", json=chat_body(),
                           headers=auth(live.key()), timeout=30)
        assert reply.status_code == 502
        assert reply.json()["error"]["code"] == "engine_unreachable"
        assert "retry-after" in reply.headers
    finally:
        live.stop()


def test_requests_already_queued_are_refused_once_the_engine_drains(
        gateway: LiveGateway, gateway_engine: Emulator) -> None:
    """A stop publishes DRAINING: nothing new reaches the engine, in flight finishes."""
    key = gateway.key()
    httpx.post(f"{gateway_engine.url}/emulator/stats/reset", timeout=5)
    before = emulator_stats(gateway_engine)["requests_total"]
    gateway.publish("draining", "draining: waiting for in-flight requests")
    gateway.wait_admitting(False)
    reply = httpx.post(f"{gateway.url}/v1/chat/completions", json=chat_body(),
                       headers=auth(key))
    assert reply.status_code == 503 and "draining" in reply.json()["error"]["message"]
    assert emulator_stats(gateway_engine)["requests_total"] == before


def test_a_degraded_engine_gets_no_new_requests_until_it_recovers(
        gateway: LiveGateway, gateway_engine: Emulator) -> None:
    """Alive but failing (fault case 8): new requests get 503 with Retry-After and never
    reach the engine; once the supervisor publishes READY again they flow."""
    key = gateway.key()
    before = emulator_stats(gateway_engine)["requests_total"]
    gateway.publish("degraded", "alive but failing: /ready fails; not restarted")
    gateway.wait_admitting(False)
    reply = httpx.post(f"{gateway.url}/v1/chat/completions", json=chat_body(),
                       headers=auth(key))
    assert reply.status_code == 503 and reply.headers["retry-after"]
    assert "degraded" in reply.json()["error"]["message"]
    assert emulator_stats(gateway_engine)["requests_total"] == before
    gateway.publish("ready", "serving again")
    gateway.wait_admitting()
    assert httpx.post(f"{gateway.url}/v1/chat/completions", json=chat_body(),
                      headers=auth(key)).status_code == 200
