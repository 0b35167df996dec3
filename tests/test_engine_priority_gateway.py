"""Priorities reach the engine's requests (issue 24): the real gateway, with service classes
configured, forwards each request with its key's class priority, and an engine emulator
running SGLang's priority scheduling orders its own queue by it. Loopback, a real database.

The gateway admits three at once (gateway.max_concurrency = 3), the engine runs one
(--max-running-requests 1): a batch request and then an interactive one both reach the
engine's queue while a long request runs, and the interactive one is served first, which
the engine can only do if the priority arrived (its queue is fcfs among equal priorities).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from appliance.config import Config
from tests.conftest import make_config
from tests.gateway_rig import (
    LiveGateway,
    auth,
    chat_body,
    engine_at,
    start_engine,
    stop_engine,
)
from tests.test_fake_sglang import Emulator
from tests.test_gateway_slo_live import class_key


@pytest.fixture(scope="module")
def gateway_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Emulator]:
    emu = start_engine(tmp_path_factory, "--max-running-requests", "1",
                       "--enable-priority-scheduling", "--default-priority-value", "10",
                       token_seconds=0.02)
    yield emu
    stop_engine(emu)


@pytest.fixture
def config(tmp_path: Path) -> Config:
    return make_config(tmp_path / "appliance", APPLIANCE_GATEWAY_MAX_CONCURRENCY="3",
                       APPLIANCE_GATEWAY_CLASSES=json.dumps({"batch": {"share": 0.5}}))


def test_the_engine_serves_an_interactive_request_before_an_earlier_batch_one(
        gateway: LiveGateway, gateway_engine: Emulator) -> None:
    interactive = class_key(gateway, "people", "interactive")
    batch = class_key(gateway, "nightly", "batch")
    done: list[str] = []

    async def ask(client: httpx.AsyncClient, name: str, key: str,
                  tokens: int) -> httpx.Response:
        reply = await client.post("/v1/chat/completions", headers=auth(key),
                                  json=chat_body(name, max_tokens=tokens, ignore_eos=True,
                                                 priority=99))  # a client's own is replaced
        done.append(name)
        return reply

    async def scenario() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=gateway.url, timeout=120) as client:
            held = asyncio.ensure_future(ask(client, "held", interactive, 150))
            await engine_at(gateway_engine, 1, 0)
            late = asyncio.ensure_future(ask(client, "batch", batch, 4))
            await engine_at(gateway_engine, 1, 1)
            urgent = asyncio.ensure_future(ask(client, "interactive", interactive, 4))
            await engine_at(gateway_engine, 1, 2)
            return list(await asyncio.gather(held, late, urgent))

    replies = asyncio.run(scenario())
    assert [r.status_code for r in replies] == [200, 200, 200], [r.text for r in replies]
    assert done == ["held", "interactive", "batch"]
