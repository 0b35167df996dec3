"""Bad input at the gateway: each malformed, oversized or unauthorised request gets a clear
4xx in OpenAI's error shape (Anthropic's on /v1/messages), is counted, and never reaches the
engine — asserted at the emulator's own request counter. No 500 anywhere.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from appliance.config import Config
from tests.conftest import make_config
from tests.gateway_rig import (
    MODEL,
    LiveGateway,
    auth,
    chat_body,
    emulator_stats,
    start_engine,
    stop_engine,
)
from tests.test_fake_sglang import Emulator

CONTEXT = 4096  # the engine below runs with --context-length 4096


@pytest.fixture(scope="module")
def gateway_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Emulator]:
    emu = start_engine(tmp_path_factory, "--context-length", str(CONTEXT))
    yield emu
    stop_engine(emu)


@pytest.fixture
def config(tmp_path: Path) -> Config:
    return make_config(tmp_path / "appliance", APPLIANCE_GATEWAY_MAX_BODY_MIB="1")


def post(gateway: LiveGateway, key: str | None, content: bytes | str | dict[str, object],
         path: str = "/v1/chat/completions",
         content_type: str = "application/json") -> httpx.Response:
    data = json.dumps(content).encode() if isinstance(content, dict) else content
    headers = {"content-type": content_type, **(auth(key) if key else {})}
    return httpx.post(gateway.url + path, content=data, headers=headers, timeout=30)


CASES = [
    ("invalid JSON", b'{"model": ', 400, "invalid_json"),
    ("invalid UTF-8", b'{"model": "\xff\xfe"}', 400, "invalid_json"),
    ("deep nesting", b"[" * 100_000 + b"]" * 100_000, 400, "invalid_json"),
    ("not an object", b"[1, 2]", 400, "invalid_json"),
    ("no model", {"messages": [{"role": "user", "content": "x"}]}, 400, "invalid_request"),
    ("unknown model", {"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]},
     404, "model_not_found"),
    ("no messages", {"model": MODEL}, 400, "invalid_request"),
    ("empty messages", {"model": MODEL, "messages": []}, 400, "invalid_request"),
    ("message without role", {"model": MODEL, "messages": [{"content": "x"}]}, 400,
     "invalid_request"),
    ("thousands of messages", {"model": MODEL, "messages": [
        {"role": "user", "content": "x"}] * 10_001}, 400, "invalid_request"),
    ("huge n", chat_body(n=1000), 400, "invalid_request"),
    ("stream not a boolean", chat_body(stream="yes"), 400, "invalid_request"),
    ("max_tokens not an integer", chat_body(max_tokens="lots"), 400, "invalid_type"),
    ("max_tokens zero", chat_body(max_tokens=0), 400, "invalid_request"),
    ("max_tokens over the context", chat_body(max_tokens=CONTEXT), 400,
     "context_length_exceeded"),
    # no tokenizer here: refused when even 8 characters a token would not fit
    ("prompt longer than the context", chat_body("word " * (CONTEXT * 8 // 5 + 1)),
     400, "context_length_exceeded"),
]


@pytest.mark.parametrize(("case", "body", "status", "code"), CASES, ids=[c[0] for c in CASES])
def test_bad_requests_get_a_clear_4xx_and_never_reach_the_engine(
        gateway: LiveGateway, gateway_engine: Emulator, case: str, body: object, status: int,
        code: str) -> None:
    key = gateway.key()
    before = emulator_stats(gateway_engine)["requests_total"]
    reply = post(gateway, key, body)  # type: ignore[arg-type]
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["code"] == code and error["message"] and error["type"]
    assert emulator_stats(gateway_engine)["requests_total"] == before
    rows = gateway.usage_rows(1)
    assert rows[-1][3:5] == (status, code)  # counted
    metrics = httpx.get(f"{gateway.url}/metrics").text
    assert f'outcome="{code}",status="{status}"' in metrics or \
        f'status="{status}",outcome="{code}"' in metrics or code in metrics


def test_oversized_body_413_before_it_is_read(gateway: LiveGateway,
                                              gateway_engine: Emulator) -> None:
    key = gateway.key()
    before = emulator_stats(gateway_engine)["requests_total"]
    big = chat_body("x" * (2 << 20))
    reply = post(gateway, key, big)
    assert reply.status_code == 413
    assert reply.json()["error"]["code"] == "request_too_large"
    # a chunked body (no Content-Length) is cut off at the limit as well
    def chunks() -> Iterator[bytes]:
        for _ in range(40):
            yield b" " * 65536
    reply = httpx.post(f"{gateway.url}/v1/chat/completions", content=chunks(),
                       headers={"content-type": "application/json", **auth(key)}, timeout=30)
    assert reply.status_code == 413
    assert emulator_stats(gateway_engine)["requests_total"] == before


def test_key_and_route_errors(gateway: LiveGateway) -> None:
    key = gateway.key()
    missing = post(gateway, None, chat_body())
    assert missing.status_code == 401 and missing.json()["error"]["code"] == "invalid_api_key"
    assert "www-authenticate" in missing.headers
    wrong = post(gateway, "sk-deadbeef-" + "A" * 43, chat_body())
    assert wrong.status_code == 401
    garbage = post(gateway, "not a key at all", chat_body())
    assert garbage.status_code == 401
    text = post(gateway, key, "model=kimi", content_type="text/plain")
    assert text.status_code == 415
    assert httpx.get(f"{gateway.url}/v1/chat/completions", headers=auth(key)).status_code == 405
    unknown = httpx.get(f"{gateway.url}/v2/whatever")
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "not_found"


def test_anthropic_route_errors_use_anthropics_envelope(gateway: LiveGateway) -> None:
    key = gateway.key()
    reply = httpx.post(f"{gateway.url}/v1/messages", headers={"x-api-key": key},
                       json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]})
    assert reply.status_code == 400
    body = reply.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in body["error"]["message"]


def test_key_cap_on_max_tokens(gateway: LiveGateway) -> None:
    key = gateway.key("capped", max_tokens=100)
    reply = post(gateway, key, chat_body(max_tokens=101))
    assert reply.status_code == 400
    assert reply.json()["error"] == {
        "message": "max_tokens 101 is over this key's cap of 100", "type":
        "invalid_request_error", "param": "max_tokens", "code": "max_tokens_over_key_cap"}
    assert post(gateway, key, chat_body(max_tokens=100)).status_code == 200


def test_huge_headers_and_slow_clients_get_no_500(gateway: LiveGateway) -> None:
    key = gateway.key()
    reply = httpx.post(f"{gateway.url}/v1/chat/completions", json=chat_body(),
                       headers={**auth(key), "x-padding": "p" * 200_000}, timeout=30)
    assert reply.status_code < 500 or reply.status_code == 503
    # a client that sends half its body and stops holds no admission slot
    with socket.create_connection(("127.0.0.1", gateway.port)) as sock:
        body = json.dumps(chat_body()).encode()
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\nAuthorization: Bearer " +
                     key.encode() + b"\r\nContent-Length: " + str(len(body)).encode() +
                     b"\r\n\r\n" + body[:10])
        assert gateway.parts.admission.in_use == 0
    assert post(gateway, key, chat_body()).status_code == 200


def test_the_engines_own_refusal_comes_back_in_openais_shape(gateway: LiveGateway,
                                                             gateway_engine: Emulator) -> None:
    """Too close to call without a tokenizer: forwarded, and SGLang's flat error is rewrapped
    into OpenAI's shape with the same code the gateway would have used."""
    key = gateway.key()
    reply = post(gateway, key, chat_body("w " * (CONTEXT + 10)))
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert "context length" in error["message"]
    assert gateway.usage_rows(1)[-1][3:5] == (400, "context_length_exceeded")
