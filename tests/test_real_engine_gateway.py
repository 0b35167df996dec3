"""The gateway in front of the REAL SGLang 0.5.23 (CPU, a tiny Llama): what users get.

One engine for the module, started with the engine key the product keeps
(`appliance.secrets.engine_api_key`); the real GatewayApp in front of it, over a real
database, with keys made by the console's key store. The `openai` SDK is the client.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from appliance.clock import SystemClock
from appliance.db.database import Database
from appliance.db.schema import migrate
from appliance.resources import migrations_dir
from appliance.secrets import engine_api_key
from tests.conftest import make_config
from tests.gateway_rig import LiveGateway, auth, publish
from tests.realengine.fixtures import DENSE_CPU_ARGS, RealEngine

pytestmark = pytest.mark.real_engine

MODEL = "kimi-k3"  # the served name the gateway's configuration expects by default


@pytest.fixture(scope="module")
def gateway(real_sglang_env: Path, dense_model: Path,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LiveGateway, RealEngine]]:
    root = tmp_path_factory.mktemp("real-gateway")
    config = make_config(root / "appliance")
    db = Database(config.database_url)
    migrate(db, migrations_dir(), config.paths.state_dir / "backups", SystemClock().now())
    key = engine_api_key(config.paths.state_dir)
    with RealEngine.start(real_sglang_env, dense_model, log=root / "engine.log",
                          args=(*DENSE_CPU_ARGS, "--served-model-name", MODEL),
                          api_key=key) as engine:
        engine.wait_healthy()
        live = LiveGateway(config, db, engine.base_url).start()
        publish(db, "ready")
        live.wait_admitting()
        try:
            yield live, engine
        finally:
            live.stop()
            db.dispose()


def sdk(gateway: LiveGateway, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=0, timeout=120)


def test_the_sdk_streams_a_real_chat_with_usage_through_the_gateway(
        gateway: tuple[LiveGateway, RealEngine]) -> None:
    live, _ = gateway
    client = sdk(live, live.key("alice"))
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello there"}], max_tokens=8,
        stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True}))
    content = [c for c in chunks if c.choices]
    assert content, "no content chunk came back"
    usage = chunks[-1].usage
    assert usage is not None and not chunks[-1].choices
    assert usage.completion_tokens == 8 and usage.prompt_tokens > 0
    # Without asking for usage, the gateway's own usage request is cut out again.
    plain = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True))
    assert all(c.usage is None for c in plain)
    [first, second] = live.usage_rows(2)
    assert first[5] == usage.prompt_tokens and first[6] == 8  # what the real engine counted
    assert 0 < second[6] <= 4  # usage recorded for the stream that did not ask for it


def test_the_real_engine_port_requires_the_engine_key(
        gateway: tuple[LiveGateway, RealEngine]) -> None:
    live, engine = gateway
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    url = f"{engine.base_url}/v1/chat/completions"
    assert httpx.post(url, json=body, timeout=60).status_code == 401
    assert httpx.post(url, json=body, headers=auth("not-the-key"), timeout=60).status_code == 401
    # A user's gateway key is not the engine key either: only the gateway gets in.
    user_key = live.key("mallory")
    assert httpx.post(url, json=body, headers=auth(user_key), timeout=60).status_code == 401
    assert httpx.post(url, json=body, headers=engine.headers(), timeout=60).status_code == 200
    assert httpx.get(f"{engine.base_url}/health", timeout=60).status_code == 200  # exempt


def test_a_keys_max_tokens_cap_binds_on_the_real_engine(
        gateway: tuple[LiveGateway, RealEngine]) -> None:
    live, _ = gateway
    client = sdk(live, live.key("capped", max_tokens=6))
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, max_tokens=50,
                                       messages=[{"role": "user", "content": "hi"}])
    assert "cap of 6" in str(refused.value)
    # No max_tokens asked: the cap is written into what the engine gets, and it binds there.
    answer = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "go on"}],
        extra_body={"ignore_eos": True})
    assert answer.usage is not None and answer.usage.completion_tokens == 6
