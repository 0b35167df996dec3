"""The gateway end to end: the real `openai` SDK → gateway (uvicorn, loopback) → the engine
emulator (a subprocess), over a real SQLite database.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import openai
import pytest
from sqlalchemy import text

from appliance.config import Config
from appliance.db.database import Database
from appliance.gateway.keys import revoke_key
from tests.conftest import free_port, make_config, wait_for
from tests.gateway_rig import (
    MODEL,
    LiveGateway,
    auth,
    chat_body,
    emulator_stats,
    make_key,
    publish,
)
from tests.test_fake_sglang import Emulator


def client(gateway: LiveGateway, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=0, timeout=30)


def test_sdk_streaming_and_not_with_usage_recorded(gateway: LiveGateway) -> None:
    key = gateway.key()
    sdk = client(gateway, key)
    answer = sdk.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello there"}], max_tokens=12)
    assert answer.choices[0].message.content
    assert answer.usage is not None and answer.usage.completion_tokens > 0

    chunks = list(sdk.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello there"}], max_tokens=12,
        stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == answer.choices[0].message.content  # the emulator is deterministic
    # the gateway asked the engine for usage, and cut that chunk out again: not asked for
    assert all(c.usage is None for c in chunks)
    assert all(c.choices for c in chunks)

    asked = list(sdk.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello there"}], max_tokens=12,
        stream=True, stream_options={"include_usage": True}))
    assert asked[-1].usage is not None and not asked[-1].choices

    completion = sdk.completions.create(model=MODEL, prompt="one two three", max_tokens=5)
    assert completion.choices[0].text

    rows = gateway.usage_rows(4)
    assert [(r[1], r[2], r[3], r[4]) for r in rows] == [
        ("chat", False, 200, "ok"), ("chat", True, 200, "ok"), ("chat", True, 200, "ok"),
        ("completions", False, 200, "ok")]
    usage = answer.usage
    for row in rows[:3]:  # the same prompt: the same counts, streamed or not
        assert (row[5], row[6]) == (usage.prompt_tokens, usage.completion_tokens)
    assert rows[2][7] > 0  # the second identical prompt hit the emulator's prefix cache


def test_models_list_needs_a_key_and_names_the_served_model(gateway: LiveGateway) -> None:
    key = gateway.key()
    models = client(gateway, key).models.list()
    assert [m.id for m in models.data] == [MODEL]
    with pytest.raises(openai.AuthenticationError):
        client(gateway, "sk-00000000-" + "x" * 43).models.list()
    missing = httpx.get(f"{gateway.url}/v1/models/other", headers={
        "Authorization": f"Bearer {key}"})
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "model_not_found"


def test_a_burst_never_exceeds_the_engines_running_limit(gateway: LiveGateway,
                                                          gateway_engine: Emulator) -> None:
    httpx.post(f"{gateway_engine.url}/emulator/stats/reset", timeout=5)
    key = gateway.key()
    assert gateway.parts.admission.limit == 4  # learned from the engine's /server_info

    async def burst() -> list[int]:
        async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as http:
            replies = await asyncio.gather(*[
                http.post("/v1/chat/completions", headers=auth(key),
                          json=chat_body(f"burst {i}", max_tokens=30, stream=i % 2 == 0))
                for i in range(24)])
            return [r.status_code for r in replies]

    assert asyncio.run(burst()) == [200] * 24
    stats = emulator_stats(gateway_engine)
    assert stats["peak_running"] == 4  # full use of the engine, never more
    assert stats["waiting"] == 0


def test_503_with_retry_after_and_eta_while_the_engine_loads(gateway: LiveGateway) -> None:
    key = gateway.key()
    gateway.publish("loading_weights", "loading weights: 42% (650 of 1,560 GB)", eta=1800)
    gateway.wait_admitting(False)
    reply = httpx.post(f"{gateway.url}/v1/chat/completions", headers=auth(key),
                       json=chat_body())
    assert reply.status_code == 503
    assert reply.headers["retry-after"] == "1800"
    error = reply.json()["error"]
    assert error["code"] == "engine_unavailable"
    assert "loading weights" in error["message"] and "about 30 min" in error["message"]
    with pytest.raises(openai.InternalServerError):
        client(gateway, key).chat.completions.create(model=MODEL, messages=[
            {"role": "user", "content": "hi"}])
    gateway.publish("ready", "serving")
    gateway.wait_admitting()
    assert httpx.post(f"{gateway.url}/v1/chat/completions", headers=auth(key),
                      json=chat_body()).status_code == 200


def test_a_revoked_key_is_refused_at_the_next_poll(gateway: LiveGateway) -> None:
    key = gateway.key("leaver")
    assert httpx.get(f"{gateway.url}/v1/models", headers=auth(key)).status_code == 200
    prefix = key.split("-")[1]
    now = dt.datetime.now(dt.UTC)
    gateway.db.call(lambda s: revoke_key(s, prefix, by="tests", now=now))
    # the gateway polls keys every 0.5 s in production (0.1 s in this rig)
    wait_for(lambda: httpx.get(f"{gateway.url}/v1/models",
                               headers=auth(key)).status_code == 401, "the revocation")
    reply = httpx.post(f"{gateway.url}/v1/chat/completions", headers=auth(key),
                       json=chat_body())
    assert reply.status_code == 401 and reply.json()["error"]["code"] == "invalid_api_key"


def test_client_disconnect_aborts_the_engine_request_and_frees_the_slot(
        gateway: LiveGateway, gateway_engine: Emulator) -> None:
    key = gateway.key()
    before = emulator_stats(gateway_engine)["aborted_total"]
    with httpx.stream("POST", f"{gateway.url}/v1/chat/completions", headers=auth(key),
                      json=chat_body("long one", max_tokens=5000, stream=True,
                                     ignore_eos=True), timeout=30) as reply:
        lines = reply.iter_lines()
        assert next(lines).startswith("data:")
    wait_for(lambda: emulator_stats(gateway_engine)["aborted_total"] == before + 1, "the abort")
    wait_for(lambda: gateway.parts.admission.in_use == 0, "the slot to be free")
    rows = gateway.usage_rows(1)
    assert rows[-1][3:5] == (499, "client_closed")
    assert rows[-1][6] >= 1  # no usage from the engine: the chunks it sent are counted


def test_queue_full_and_queue_timeout_answer_429_with_retry_after(
        tmp_path: Path, gateway_engine: Emulator) -> None:
    config = make_config(tmp_path / "q", APPLIANCE_GATEWAY_MAX_CONCURRENCY="1",
                         APPLIANCE_GATEWAY_QUEUE_MAX="1",
                         APPLIANCE_GATEWAY_QUEUE_WAIT_SECONDS="1")
    db = migrated(config)
    live = LiveGateway(config, db, gateway_engine.url).start()
    try:
        live.publish("ready")
        live.wait_admitting()
        key = live.key()
        long = chat_body("hold the slot", max_tokens=3000, ignore_eos=True)

        async def scenario() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=live.url, timeout=60) as http:
                holder = asyncio.create_task(
                    http.post("/v1/chat/completions", headers=auth(key), json=long))
                await wait_async(lambda: live.parts.admission.in_use == 1)
                queued = asyncio.create_task(
                    http.post("/v1/chat/completions", headers=auth(key), json=chat_body()))
                await wait_async(lambda: live.parts.admission.waiting == 1)
                full = await http.post("/v1/chat/completions", headers=auth(key),
                                       json=chat_body())
                timed_out = await queued
                holder.cancel()
                return [full, timed_out]

        full, timed_out = asyncio.run(scenario())
        assert full.status_code == 429 and full.json()["error"]["code"] == "queue_full"
        assert int(full.headers["retry-after"]) >= 1
        assert timed_out.status_code == 429
        assert timed_out.json()["error"]["code"] == "queue_timeout"
        assert int(timed_out.headers["retry-after"]) >= 1
    finally:
        live.stop()
        db.dispose()


def migrated(config: Config) -> Database:
    from appliance.db.schema import migrate
    from appliance.resources import migrations_dir

    db = Database(config.database_url)
    migrate(db, migrations_dir(), config.paths.state_dir / "backups", dt.datetime.now(dt.UTC))
    return db


async def wait_async(check: Callable[[], bool], timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            pytest.fail("gave up waiting")
        await asyncio.sleep(0.02)


def test_two_keys_share_a_busy_engine_fairly(tmp_path: Path, gateway_engine: Emulator) -> None:
    """Key A queues ten requests, then key B two: B's go round-robin with A's instead of
    behind all of them (the ring is unit-tested in test_gateway_admission).

    Timing-proof: B sends once at least six of A's wait, so at most two of A's have
    finished; with the ring B's two finish by position 7, without it at 10 and 11."""
    config = make_config(tmp_path / "fair", APPLIANCE_GATEWAY_MAX_CONCURRENCY="2")
    db = migrated(config)
    live = LiveGateway(config, db, gateway_engine.url).start()
    try:
        live.publish("ready")
        live.wait_admitting()
        busy, polite = live.key("busy"), live.key("polite")
        # 0.5 s each at the emulator's 2 ms a token: A's ten all arrive before two finish,
        # even on a loaded machine (60 tokens once lost that race in CI)
        work = chat_body("fair share", max_tokens=250, ignore_eos=True)

        async def scenario() -> None:
            async with httpx.AsyncClient(base_url=live.url, timeout=60) as http:
                flood = [asyncio.create_task(http.post("/v1/chat/completions",
                                                       headers=auth(busy), json=work))
                         for _ in range(10)]
                await wait_async(lambda: live.parts.admission.waiting >= 6)
                late = [asyncio.create_task(http.post("/v1/chat/completions",
                                                      headers=auth(polite), json=work))
                        for _ in range(2)]
                replies = await asyncio.gather(*flood, *late)
                assert [r.status_code for r in replies] == [200] * 12

        asyncio.run(scenario())
        rows = live.usage_rows(12)  # in the order the requests finished
        finished = [row[0] for row in rows]
        polite_id = max(finished)  # created second
        last_polite = max(i for i, key in enumerate(finished) if key == polite_id)
        assert last_polite < 8, finished  # not behind the busy key's whole backlog
    finally:
        live.stop()
        db.dispose()


def test_the_gateway_process_serves_and_stops_cleanly_on_sigterm(
        tmp_path: Path, gateway_engine: Emulator) -> None:
    """`appliance gateway` as the unit runs it: a process of its own over a migrated
    database; SIGTERM ends it with status 0 and its buffered usage written."""
    import os
    import subprocess
    import sys

    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("APPLIANCE_")}
    env |= {"APPLIANCE_PATHS_STATE_DIR": str(tmp_path / "state"),
            "APPLIANCE_PATHS_MODELS_DIR": str(tmp_path / "models"),
            "APPLIANCE_PATHS_LOG_DIR": str(tmp_path / "log"),
            "APPLIANCE_GATEWAY_PORT": str(port),
            "APPLIANCE_ENGINE_PORT": str(gateway_engine.port)}
    config = make_config(tmp_path / "unused", **{k: v for k, v in env.items()
                                                 if k.startswith("APPLIANCE_")})
    db = migrated(config)
    publish(db, "ready")
    key = make_key(config, db)
    process = subprocess.Popen([sys.executable, "-m", "appliance", "--dev", "gateway"],
                               env=env, cwd=tmp_path, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"

        def answered() -> bool:
            try:
                return httpx.get(f"{url}/health", timeout=2).json()["admitting"] is True
            except httpx.HTTPError:
                return False

        wait_for(answered, "the gateway process to admit")
        reply = httpx.post(f"{url}/v1/chat/completions", headers=auth(key),
                           json=chat_body(), timeout=30)
        assert reply.status_code == 200
        process.terminate()
        assert process.wait(timeout=30) == 0
        rows = db.call(lambda s: s.execute(text("SELECT status, outcome FROM usage_requests"))
                       .all())
        assert [tuple(r) for r in rows] == [(200, "ok")]  # flushed on the way out
    finally:
        if process.poll() is None:
            process.kill()
        db.dispose()
