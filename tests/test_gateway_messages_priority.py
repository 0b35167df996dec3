"""A /v1/messages request's class priority reaches the engine (issue 24): the real gateway,
with service classes configured, sends it in the `x-override-priority` header (SGLang's
Anthropic body has no priority field), and an engine emulator launched as the product
launches it for those classes (the classes layer's flags and the spec's environment, which
carries SGLANG_ENABLE_REQUEST_HEADER_OVERRIDES=1) orders its queue by it. Loopback, a real
database.

The gateway admits three at once, the engine runs one (--max-running-requests 1): while an
interactive request holds the engine's one slot, a batch key's /v1/messages request and then
an interactive key's reach the engine's queue. With the header honoured the interactive one
(10) runs before the earlier batch one (0). The control is the same launch without the
variable: the engine ignores the header, both run at --default-priority-value (10), first
come first served, so the batch one runs first; the order the engine served them in is its
own record of the priorities it saw.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from appliance.config import Config
from appliance.engine.args import Origin, build_launch_spec, inputs_from_config
from appliance.gateway.priority import HEADER_OVERRIDES_ENV
from tests.conftest import make_config
from tests.gateway_rig import (
    MODEL,
    LiveGateway,
    auth,
    chat_body,
    engine_at,
    start_engine,
    stop_engine,
)
from tests.test_fake_sglang import Emulator
from tests.test_gateway_slo_live import class_key

# The gateway admits three at once; batch is a class of its own (priority 0, below
# interactive's 10), so the classes turn priority scheduling on.
GATEWAY_ENV = {"APPLIANCE_GATEWAY_MAX_CONCURRENCY": "3",
               "APPLIANCE_GATEWAY_CLASSES": json.dumps({"batch": {"share": 0.5}})}


def product_launch(config: Config) -> tuple[list[str], dict[str, str]]:
    """The classes layer's flags of the product's spec for `config`, and the spec's
    environment."""
    spec = build_launch_spec(("sglang",), inputs_from_config(config))
    flags = [token for arg in spec.args if arg.origin is Origin.CLASSES
             for token in arg.tokens()]
    return flags, dict(spec.env)


@pytest.fixture(scope="module", params=[True, False], ids=["header-overrides", "control"])
def honoured(request: pytest.FixtureRequest) -> bool:
    """Whether the engine runs with the spec's SGLANG_ENABLE_REQUEST_HEADER_OVERRIDES."""
    return bool(request.param)


@pytest.fixture(scope="module")
def gateway_engine(honoured: bool,
                   tmp_path_factory: pytest.TempPathFactory) -> Iterator[Emulator]:
    flags, env = product_launch(make_config(tmp_path_factory.mktemp("spec") / "appliance",
                                            **GATEWAY_ENV))
    assert "--enable-priority-scheduling" in flags
    assert env.get(HEADER_OVERRIDES_ENV) == "1"
    if not honoured:
        env.pop(HEADER_OVERRIDES_ENV)
    emu = start_engine(tmp_path_factory, *flags, "--max-running-requests", "1",
                       token_seconds=0.02, **env)
    yield emu
    stop_engine(emu)


@pytest.fixture
def config(tmp_path: Path) -> Config:
    return make_config(tmp_path / "appliance", **GATEWAY_ENV)


def messages_body(name: str, tokens: int) -> dict[str, object]:
    return {"model": MODEL, "max_tokens": tokens,
            "messages": [{"role": "user", "content": name}]}


def test_a_messages_request_is_scheduled_by_its_class_priority(
        gateway: LiveGateway, gateway_engine: Emulator, honoured: bool) -> None:
    interactive = class_key(gateway, "people", "interactive")
    batch = class_key(gateway, "nightly", "batch")
    done: list[str] = []

    async def ask(client: httpx.AsyncClient, name: str, key: str, path: str,
                  body: dict[str, object]) -> httpx.Response:
        # a client's own override header is never forwarded: the class's priority is sent
        reply = await client.post(path, headers={**auth(key), "x-override-priority": "99"},
                                  json=body)
        done.append(name)
        return reply

    async def scenario() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=gateway.url, timeout=120) as client:
            held = asyncio.ensure_future(ask(
                client, "held", interactive, "/v1/chat/completions",
                chat_body("held", max_tokens=150, ignore_eos=True)))
            await engine_at(gateway_engine, 1, 0, done)
            late = asyncio.ensure_future(ask(client, "batch", batch, "/v1/messages",
                                             messages_body("batch", 4)))
            await engine_at(gateway_engine, 1, 1, done)
            urgent = asyncio.ensure_future(ask(client, "interactive", interactive,
                                               "/v1/messages", messages_body("urgent", 4)))
            await engine_at(gateway_engine, 1, 2, done)
            return list(await asyncio.gather(held, late, urgent))

    replies = asyncio.run(scenario())
    assert [r.status_code for r in replies] == [200, 200, 200], [r.text for r in replies]
    assert all(r.json()["type"] == "message" for r in replies[1:])
    if honoured:
        assert done == ["held", "interactive", "batch"]
    else:  # the header unread: both at the default priority, in arrival order
        assert done == ["held", "batch", "interactive"]
