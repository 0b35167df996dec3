"""The gateway's security findings (project issue 18), each through the real gateway in front
of the engine emulator where it can be, else at the module's own seam:

- a key's `max_tokens` cap binds a request that sets none (absent or null, `max_tokens` or
  chat's `max_completion_tokens`);
- numbers sent as strings are refused with OpenAI's 400 `invalid_type` naming the field;
- a failing key never makes the gateway query the database, an unknown prefix and a wrong
  secret take the same path, and one client address gets 429 with Retry-After after ten
  failed keys while another address still works.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
from typing import Any

import httpx
import pytest

from appliance.gateway.auth_throttle import AuthFailures
from appliance.gateway.errors import GatewayError
from appliance.gateway.keycache import INVALID, KeyCache
from appliance.gateway.keys import KeyEntry, KeyLimits
from appliance.gateway.validate import ENDPOINTS, parse
from appliance.secrets import keyed_hash
from tests.gateway_rig import MODEL, LiveGateway, auth, chat_body, emulator_stats
from tests.test_fake_sglang import Emulator

NOW = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
SECRET = b"s" * 32


def post(gateway: LiveGateway, key: str, body: dict[str, Any],
         path: str = "/v1/chat/completions", **client: Any) -> httpx.Response:
    with httpx.Client(timeout=30, **client) as http:
        return http.post(gateway.url + path, json=body, headers=auth(key))


# --- 1. the key's max_tokens cap --------------------------------------------------------------


@pytest.mark.parametrize("unset", [{}, {"max_tokens": None}, {"max_completion_tokens": None},
                                   {"max_tokens": None, "max_completion_tokens": None}],
                         ids=["absent", "max_tokens null", "max_completion_tokens null",
                              "both null"])
def test_a_capped_key_gets_at_most_its_cap_when_the_request_sets_none(
        gateway: LiveGateway, unset: dict[str, Any]) -> None:
    key = gateway.key("capped", max_tokens=5)
    # min_tokens 40: the emulator would generate 40 tokens if nothing bounded the request
    reply = post(gateway, key, chat_body(min_tokens=40, **unset))
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 5
    assert reply.json()["choices"][0]["finish_reason"] == "length"


def test_the_cap_binds_streams_and_completions_too(gateway: LiveGateway) -> None:
    key = gateway.key("capped", max_tokens=5)
    body = chat_body(min_tokens=40, stream=True, stream_options={"include_usage": True})
    with httpx.Client(timeout=30) as http, http.stream(
            "POST", f"{gateway.url}/v1/chat/completions", headers=auth(key),
            json=body) as response:
        assert response.status_code == 200
        usage = [json.loads(line[6:])["usage"] for line in response.iter_lines()
                 if line.startswith("data: {") and '"usage":{' in line]
    assert usage[-1]["completion_tokens"] == 5
    reply = post(gateway, key, {"model": MODEL, "prompt": "once upon a time", "min_tokens": 40},
                 "/v1/completions")
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 5
    # an uncapped key is untouched
    free = gateway.key("free")
    assert post(gateway, free, chat_body(min_tokens=40)).json()["usage"][
        "completion_tokens"] == 40


def test_max_completion_tokens_over_the_cap_is_refused(gateway: LiveGateway,
                                                       gateway_engine: Emulator) -> None:
    key = gateway.key("capped", max_tokens=5)
    before = emulator_stats(gateway_engine)["requests_total"]
    reply = post(gateway, key, chat_body(max_completion_tokens=3, max_tokens=300))
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == "max_tokens"
    reply = post(gateway, key, chat_body(max_completion_tokens=6))
    assert reply.status_code == 400
    assert reply.json()["error"] == {
        "message": "max_completion_tokens 6 is over this key's cap of 5",
        "type": "invalid_request_error", "param": "max_completion_tokens",
        "code": "max_tokens_over_key_cap"}
    assert emulator_stats(gateway_engine)["requests_total"] == before


def test_a_cap_the_context_cannot_reach_is_not_written_into_the_request() -> None:
    chat = ENDPOINTS["/v1/chat/completions"]
    body = b'{"model": "m", "messages": [{"role": "user", "content": "x"}]}'
    parsed = parse(chat, body, served=frozenset({"m"}), context_len=4096, key_max_tokens=8192)
    assert parsed.body == body and parsed.max_tokens is None
    parsed = parse(chat, body, served=frozenset({"m"}), context_len=4096, key_max_tokens=100)
    assert b'"max_completion_tokens":100' in parsed.body and parsed.max_tokens == 100


# --- 2. numbers as strings --------------------------------------------------------------------

STRINGS = [
    ("/v1/chat/completions", "max_tokens", "5", "an integer"),
    ("/v1/chat/completions", "max_completion_tokens", "5", "an integer"),
    ("/v1/chat/completions", "n", "2", "an integer"),
    ("/v1/chat/completions", "temperature", "0.7", "a number"),
    ("/v1/chat/completions", "top_p", "1", "a number"),
    ("/v1/chat/completions", "presence_penalty", "0", "a number"),
    ("/v1/chat/completions", "frequency_penalty", "0", "a number"),
    ("/v1/chat/completions", "seed", "1", "an integer"),
    ("/v1/chat/completions", "top_logprobs", "2", "an integer"),
    ("/v1/chat/completions", "logprobs", "true", "a boolean"),
    ("/v1/completions", "max_tokens", "5", "an integer"),
    ("/v1/completions", "logprobs", "2", "an integer"),
    ("/v1/completions", "temperature", "0", "a number"),
    ("/v1/messages", "max_tokens", "5", "an integer"),
    ("/v1/messages", "temperature", "0.5", "a number"),
    ("/v1/messages", "top_k", "5", "an integer"),
]


@pytest.mark.parametrize(("path", "name", "value", "expected"), STRINGS,
                         ids=[f"{p} {n}" for p, n, _, _ in STRINGS])
def test_a_number_sent_as_a_string_is_refused_naming_the_field(
        path: str, name: str, value: str, expected: str) -> None:
    endpoint = ENDPOINTS[path]
    data: dict[str, Any] = {"model": "m", "max_tokens": 10}
    if endpoint.name == "completions":
        data["prompt"] = "x"
    else:
        data["messages"] = [{"role": "user", "content": "x"}]
    data[name] = value
    with pytest.raises(GatewayError) as caught:
        parse(endpoint, json.dumps(data).encode(), served=frozenset({"m"}), context_len=None,
              key_max_tokens=None)
    err = caught.value
    assert (err.status, err.code, err.param) == (400, "invalid_type", name)
    assert err.message == (f"Invalid type for '{name}': expected {expected}, but got a string "
                           "instead.")


def test_strings_are_refused_by_the_gateway_in_openais_shape(
        gateway: LiveGateway, gateway_engine: Emulator) -> None:
    key = gateway.key()
    before = emulator_stats(gateway_engine)["requests_total"]
    reply = post(gateway, key, chat_body(temperature="0.7"))
    assert reply.status_code == 400
    assert reply.json() == {"error": {
        "message": "Invalid type for 'temperature': expected a number, but got a string instead.",
        "type": "invalid_request_error", "param": "temperature", "code": "invalid_type"}}
    reply = httpx.post(f"{gateway.url}/v1/messages", headers={"x-api-key": key}, timeout=30,
                       json={"model": MODEL, "max_tokens": "5",
                             "messages": [{"role": "user", "content": "x"}]})
    assert reply.status_code == 400
    assert reply.json()["error"]["type"] == "invalid_request_error"
    assert "'max_tokens'" in reply.json()["error"]["message"]
    assert emulator_stats(gateway_engine)["requests_total"] == before
    # numbers, nulls and booleans where they belong still pass
    ok = post(gateway, key, chat_body(max_tokens=3, temperature=0, top_p=None, seed=1,
                                      logprobs=False))
    assert ok.status_code == 200, ok.text


# --- 3. failing keys: no database work, the same path, a throttle per address -----------------


class CountingDb:
    """A database stand-in that counts what the key cache asks of it."""

    def __init__(self) -> None:
        self.calls = 0

    async def run(self, work: Any) -> Any:
        self.calls += 1
        raise AssertionError("a failing key must not reach the database")


def _entry(key: str) -> KeyEntry:
    return KeyEntry(1, "alice", key[3:11], keyed_hash(SECRET, key), None, False, KeyLimits())


GOOD = "sk-0123abcd-" + "A" * 43


def test_unknown_prefixes_never_reach_the_database() -> None:
    db = CountingDb()
    cache = KeyCache(db, SECRET, failed_wait=0.01)  # type: ignore[arg-type]

    async def scenario() -> None:
        keys = [f"sk-{i:08x}-" + "B" * 43 for i in range(50)]
        results = await asyncio.gather(*(cache.resolve(k, NOW) for k in keys),
                                       return_exceptions=True)
        assert all(r is INVALID for r in results)
        for key in keys[:10]:  # one after another as well
            with pytest.raises(GatewayError):
                await cache.resolve(key, NOW)

    asyncio.run(scenario())
    assert db.calls == 0


@pytest.mark.parametrize("presented", ["sk-feedf00d-" + "A" * 43, "sk-0123abcd-" + "C" * 43],
                         ids=["unknown prefix", "known prefix, wrong secret"])
def test_every_failing_key_waits_for_the_next_poll_then_gets_the_same_401(
        presented: str) -> None:
    cache = KeyCache(CountingDb(), SECRET, failed_wait=60)  # type: ignore[arg-type]
    cache._by_prefix = {"0123abcd": _entry(GOOD)}

    async def scenario() -> None:
        earlier = cache.poll_started()  # a poll already running when the key arrives
        waiting = asyncio.ensure_future(cache.resolve(presented, NOW))
        for _ in range(5):
            await asyncio.sleep(0)
        assert not waiting.done()
        cache.poll_done(earlier)  # it may have read the table before the key was made
        for _ in range(5):
            await asyncio.sleep(0)
        assert not waiting.done()
        cache.poll_done(cache.poll_started())
        with pytest.raises(GatewayError) as caught:
            await waiting
        assert caught.value is INVALID
        assert await cache.resolve(GOOD, NOW) is cache._by_prefix["0123abcd"]  # at once

    asyncio.run(scenario())


def test_a_key_made_after_the_last_poll_works_after_the_next() -> None:
    cache = KeyCache(CountingDb(), SECRET, failed_wait=60)  # type: ignore[arg-type]

    async def scenario() -> None:
        waiting = asyncio.ensure_future(cache.resolve(GOOD, NOW))
        await asyncio.sleep(0)
        ticket = cache.poll_started()
        cache._by_prefix = {"0123abcd": _entry(GOOD)}  # what refresh_in loads
        cache.poll_done(ticket)
        assert (await waiting).name == "alice"

    asyncio.run(scenario())


def test_the_failure_table_forgets_old_failures_and_stays_bounded() -> None:
    table = AuthFailures(max_failures=3, window=60, max_addresses=4)
    for second in range(3):
        assert table.blocked("10.0.0.1", second) is None
        table.failed("10.0.0.1", second)
    assert table.blocked("10.0.0.1", 10) == 50  # the first failure leaves the window at 60
    assert table.blocked("10.0.0.1", 60.5) is None
    for i in range(100):
        table.failed(f"10.0.1.{i}", 100)
    assert len(table) == 4
    assert all(len(times) <= 3 for times in table._failures.values())


def test_ten_failed_keys_from_one_address_get_429_and_other_addresses_still_work(
        gateway: LiveGateway) -> None:
    good = gateway.key()
    for i in range(10):
        wrong = f"sk-{i:08x}-" + "Z" * 43
        assert post(gateway, wrong, chat_body(max_tokens=1)).status_code == 401
    blocked = post(gateway, "sk-deadbeef-" + "Z" * 43, chat_body(max_tokens=1))
    assert blocked.status_code == 429
    assert 1 <= int(blocked.headers["retry-after"]) <= 60
    error = blocked.json()["error"]
    assert error["type"] == "rate_limit_error" and error["code"] == "too_many_failed_keys"
    assert set(error) == {"message", "type", "param", "code"}
    # the blocked address learns nothing more, not even from a right key
    assert post(gateway, good, chat_body(max_tokens=1)).status_code == 429
    models = httpx.get(f"{gateway.url}/v1/models", headers=auth(good), timeout=30)
    assert models.status_code == 429
    # another address (all of 127/8 is loopback) is not affected
    other = httpx.HTTPTransport(local_address="127.0.0.2")
    assert post(gateway, good, chat_body(max_tokens=1), transport=other).status_code == 200


def test_a_missing_key_is_not_counted_as_a_guess(gateway: LiveGateway) -> None:
    gateway.parts.auth_failures = AuthFailures(max_failures=2)
    for _ in range(5):
        reply = httpx.post(f"{gateway.url}/v1/chat/completions", json=chat_body(), timeout=30)
        assert reply.status_code == 401
    assert post(gateway, gateway.key(), chat_body(max_tokens=1)).status_code == 200
