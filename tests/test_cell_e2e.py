"""The cell end to end (issue 17), on one machine with no GPU: two appliances (their own state
directories, ports and daemons) in the prefill and decode roles, their engine emulators, the
REAL `sglang-router` 0.3.2 from PyPI that the head's daemon starts from the spec it writes,
and the head's gateway. The real `openai` SDK streams chat completions through the gateway,
the cell's router, the prefill box and the decode box; the gateway's usage rows record them.
Killing the decode box's engine (kill -9) while a user sends one request after another and
another streams gives only the gateway's own 503s (never the router's words or an internal
address), the cut stream ends with an error event the SDK raises, and the prefill engine is
not restarted; the decode box's own supervisor brings its engine back and service returns. A
second decode box joins, and a rolling restart of the decode role restarts both, one at a
time, while one user sends requests one after another and another streams: none fails
(issue 25).

Slow by nature (two daemons, two emulators, the router): one scenario, every wait bounded.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from appliance.cell.ops import cell_ops_of
from appliance.cell.published import read_cell_published
from appliance.config import engine_url
from appliance.db.database import Database
from appliance.engine.args import model_dir
from appliance.secrets import engine_api_key
from appliance.testing.fake_gpus import FakeGpus
from tests.conftest import Console, free_port, wait_for
from tests.gateway_rig import LiveGateway, make_key
from tests.test_cell_engine import ROUTER_MISSING, TIMEOUTS
from tests.test_cell_membership import Box, add, close_box, join_token, start_box
from tests.test_engine_lifecycle import prove_weights, write_model

pytestmark = pytest.mark.skipif(
    ROUTER_MISSING, reason="sglang-router is not installed (dev extra: pip install -e "
    "'.[dev]'); the cell test drives SGLang's own router")

# The router's health clock, shortened so a lost and a returned decode are seen in seconds
# (production keeps RouterInputs' 10 s interval and thresholds of 3 and 2).
ROUTER_CLOCK = {"health_interval_secs": 1, "health_failure_threshold": 1,
                "health_success_threshold": 1, "startup_timeout_secs": 60,
                "request_timeout_secs": 60}


@dataclass
class Cell:
    head: Box
    head_db: Database
    member: Box
    member_db: Database
    second: Box  # a second decode box, joined later
    second_db: Database


def with_weights(config: Any, db: Database) -> None:
    """Proven weights; their tokenizer.json is one the router loads from the head's model
    directory (appliance.testing.checkpoint)."""
    write_model(config.paths.models_dir, config.engine.model)
    prove_weights(config, db)


@pytest.fixture
def cell(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Cell]:
    monkeypatch.setenv("FAKE_SGLANG_LOAD_SECONDS", "1")
    monkeypatch.setenv("FAKE_SGLANG_FAULT", "slow_tokens=0.005")
    # No shared pretend-GPU file: each box's preflight would see the other boxes' engines on
    # "its" GPUs as processes it did not start, and refuse to launch.
    monkeypatch.delenv("FAKE_SGLANG_GPU_STATE", raising=False)
    for name, value in TIMEOUTS.items():
        monkeypatch.setenv(name, value)
    common = {"engine_poll_seconds": 0.1, "cell_poll_seconds": 0.2}
    # A prefill gives up on a killed decode's request in 2 s, not cell.bootstrap_timeout_s's
    # 60 (the launch spec sets SGLang's variables over any inherited one): the router's
    # attempt waits for the prefill's answer before it retries elsewhere.
    pd = {f"APPLIANCE_CELL_{side}_TIMEOUT_S": "2" for side in ("BOOTSTRAP", "WAITING")}
    head, head_db = start_box(tmp_path, "head", {
        **pd, "APPLIANCE_CELL_ROLE": "prefill", "APPLIANCE_ENGINE_PORT": str(free_port()),
        "APPLIANCE_CELL_BOOTSTRAP_PORT": str(free_port()),
        "APPLIANCE_CELL_ROUTER_PORT": str(free_port()),
        "APPLIANCE_CELL_ROUTER_METRICS_PORT": str(free_port())},
        prepare=with_weights, router_options=ROUTER_CLOCK, gpus=FakeGpus(), **common)
    member, member_db = start_box(tmp_path, "member", {
        **pd, "APPLIANCE_CELL_ROLE": "decode", "APPLIANCE_ENGINE_PORT": str(free_port())},
        prepare=with_weights, engine_backoff_seconds=1.0, gpus=FakeGpus(), **common)
    second, second_db = start_box(tmp_path, "second", {
        **pd, "APPLIANCE_CELL_ROLE": "decode", "APPLIANCE_ENGINE_PORT": str(free_port())},
        prepare=with_weights, gpus=FakeGpus(), **common)
    boxes = (head, member, second)
    for box in boxes:
        box.runtime.supervisor.ready_interval = 0.2
    try:
        yield Cell(head, head_db, member, member_db, second, second_db)
    finally:
        for box in boxes:  # never leave an engine or the router behind
            runner = box.runtime.supervisor.runner
            ident = runner.find()
            if ident is not None:
                runner.kill(ident)
        asyncio.run(head.runtime.cell.runner.stop())
        close_box(second, second_db)
        close_box(member, member_db)
        close_box(head, head_db)


def engine_state(box: Box) -> str:
    return str(box.api.get("/api/v1/engine").json()["state"])


def start_engine(box: Box) -> None:
    answer = box.api.post("/api/v1/engine/start", json={})
    assert answer.status_code == 202, answer.text


def serving(box: Box) -> bool:
    published = box.runtime.db.call(read_cell_published)
    return published is not None and published.active and published.serving


def chat(gateway: LiveGateway, key: str, content: str) -> httpx.Response:
    return httpx.post(f"{gateway.url}/v1/chat/completions", timeout=30,
                      headers={"Authorization": f"Bearer {key}"},
                      json={"model": "kimi-k3", "max_tokens": 4,
                            "messages": [{"role": "user", "content": content}]})


def test_two_boxes_serve_one_endpoint_through_the_real_router(cell: Cell) -> None:
    import openai

    head, member = cell.head, cell.member
    added = add(head, member, join_token(member))
    assert added.status_code == 201, added.text
    assert added.json()["engine_key"]["handed_over"] is True  # before the member's engine runs
    start_engine(head)
    start_engine(member)
    for box in (head, member):
        wait_for(lambda box=box: engine_state(box) == "ready", f"{box.name}'s engine READY", 90)
    try:
        wait_for(lambda: serving(head), "the head to publish a serving cell", 60)
    except BaseException:
        view = head.runtime.cell.view
        log = head.runtime.state_dir / "router" / "router.log"
        pytest.fail(f"the cell never served: {view.message if view else 'no view'}; router "
                    f"log: {log.read_text()[:4000] if log.exists() else 'none'}")
    spec = json.loads((head.runtime.state_dir / "router" / "router-spec.json").read_text())
    model = str(model_dir(head.runtime.config.paths.models_dir, head.runtime.config.engine.model))
    assert spec["args"][spec["args"].index("--tokenizer-path") + 1] == model  # never the Hub

    gateway = LiveGateway(head.runtime.config, cell.head_db, engine_url(head.runtime.config))
    gateway.start()
    try:
        body = wait_for(lambda: (lambda b: b if b["admitting"] else None)(
            httpx.get(f"{gateway.url}/health", timeout=5).json()),
            "the gateway to admit through the cell", 30)
        assert body["cell"]["serving"] is True
        assert body["cell"]["router"] == (
            f"http://127.0.0.1:{head.runtime.config.cell.router_port}")
        key = make_key(head.runtime.config, cell.head_db, "cell-user")

        # The real SDK streams through gateway → router → prefill → decode.
        client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=0,
                               timeout=30)

        def streamed() -> list[str] | None:
            try:
                stream = client.chat.completions.create(
                    model="kimi-k3", max_tokens=6, stream=True,
                    messages=[{"role": "user", "content": "stream through the cell"}])
                return [c.choices[0].delta.content for c in stream
                        if c.choices and c.choices[0].delta.content]
            except openai.APIStatusError:
                return None  # the router's first health checks may still be passing

        pieces = wait_for(streamed, "a stream through the cell", 30)
        assert len(pieces) == 6
        answer = client.chat.completions.create(
            model="kimi-k3", max_tokens=3, messages=[{"role": "user", "content": "again"}])
        assert answer.choices[0].message.content and answer.usage is not None
        # The head's dashboard says the cell serves, and through which boxes, in words.
        console = Console(head.url)
        try:
            assert console.login().status_code == 303
            dashboard = re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", console.http.get("/").text))
        finally:
            console.close()
        assert "Cell serving" in dashboard and "1 member besides this box" in dashboard
        assert "The Cell page →" in dashboard
        rows = gateway.usage_rows(2)
        assert [(r[1], r[4]) for r in rows[-2:]] == [("chat", "ok"), ("chat", "ok")]
        assert rows[-1][6] == 3  # the decode box's completion tokens, as the user was told
        # The real router has no Anthropic Messages route (why the gateway answers it
        # itself, Route.unserved): asked directly, with the key it demands, it says 404.
        messages = {"model": "kimi-k3", "max_tokens": 3,
                    "messages": [{"role": "user", "content": "hi"}]}
        router_key = engine_api_key(head.runtime.state_dir)
        direct = httpx.post(f"{body['cell']['router']}/v1/messages", json=messages, timeout=30,
                            headers={"Authorization": f"Bearer {router_key}"})
        assert direct.status_code == 404, direct.text
        through = httpx.post(f"{gateway.url}/v1/messages", json=messages, timeout=30,
                             headers={"x-api-key": key, "anthropic-version": "2023-06-01"})
        assert through.status_code == 404
        assert through.json()["error"]["type"] == "not_found_error"
        assert "/v1/chat/completions" in through.json()["error"]["message"]

        # The decode box's engine dies (kill -9) under a stream and a user's requests: the
        # stream ends with an error the SDK raises, and every refusal is the gateway's own.
        head_engine = head.runtime.supervisor.runner.find()
        assert head_engine is not None
        runner = member.runtime.supervisor.runner
        ident = runner.find()
        assert ident is not None
        kill_decode_under_load(client, gateway, key, lambda: runner.kill(ident))

        def refused() -> httpx.Response | None:
            reply = chat(gateway, key, "anyone there?")
            return reply if reply.status_code == 503 and "member 1" in reply.text else None

        refusal = wait_for(refused, "the gateway to refuse with the head's reason", 30)
        error = refusal.json()["error"]
        assert error["code"] == "cell_unavailable", error
        assert "no decode" in error["message"] and "member 1" in error["message"], error
        assert int(refusal.headers["Retry-After"]) >= 5
        # Nothing was done to the prefill box: the same engine process serves on.
        assert head.runtime.supervisor.runner.find() == head_engine

        # The decode box's own supervisor restarts its engine; the cell serves again.
        wait_for(lambda: engine_state(member) == "ready", "the decode engine back", 90)
        back = wait_for(lambda: (lambda r: r if r.status_code == 200 else None)(
            chat(gateway, key, "back again")), "service through the cell again", 60)
        assert back.json()["choices"][0]["message"]["content"]
        assert head.runtime.supervisor.runner.find() == head_engine
        outcomes = wait_for(lambda: (lambda o: o if o[-1] == "ok" else None)(
            [r[4] for r in gateway.usage_rows(4)]), "the usage row of the answer", 15)
        assert "cell_unavailable" in outcomes  # the refusals are recorded as such

        rolling_restart_keeps_serving(cell, gateway, key)
    finally:
        gateway.stop()


ROUTER_WORDS = ("Decode server", "Prefill server", "No available", "http://", "error sending")


def only_the_gateways_refusals(replies: list[httpx.Response]) -> None:
    """Every answer is a 200 or the gateway's own 503 `cell_unavailable` with Retry-After,
    never the router's words or an internal address (issue 25)."""
    for reply in replies:
        if reply.status_code == 200:
            continue
        assert reply.status_code == 503, reply.text
        error = reply.json()["error"]
        assert error["code"] == "cell_unavailable", error
        assert int(reply.headers["Retry-After"]) >= 5
        assert not any(word in error["message"] for word in ROUTER_WORDS), error


def kill_decode_under_load(client: Any, gateway: LiveGateway, key: str,
                           kill: Callable[[], None]) -> None:
    """A long stream is under way and a user sends requests one after another when `kill`
    takes the decode engine down; the stream must end with an error the SDK raises, and the
    user's answers must be 200s or the gateway's own 503s until the head says why."""
    import openai

    streaming = threading.Event()
    outcome: dict[str, Any] = {}

    def stream() -> None:
        pieces = 0
        try:
            for chunk in client.chat.completions.create(
                    model="kimi-k3", max_tokens=4000, stream=True,
                    messages=[{"role": "user", "content": "a long answer, please"}],
                    extra_body={"ignore_eos": True}):
                pieces += sum(1 for c in chunk.choices if c.delta.content)
                if pieces >= 5:
                    streaming.set()
            outcome["ended"] = f"ended without an error after {pieces} pieces"
        except openai.APIError as exc:
            outcome["error"], outcome["pieces"] = exc, pieces
        finally:
            streaming.set()

    streamer = threading.Thread(target=stream, daemon=True)
    streamer.start()
    assert streaming.wait(60), "the long stream never started"
    assert "ended" not in outcome and "error" not in outcome, outcome
    replies: list[httpx.Response] = []
    lost: list[str] = []  # requests that got no answer at all
    stop = threading.Event()

    def user() -> None:
        for i in range(500):
            if stop.is_set():
                return
            started = time.monotonic()
            try:
                replies.append(chat(gateway, key, f"during the crash {i}"))
            except httpx.HTTPError as exc:
                lost.append(f"request {i}: {exc!r} after {time.monotonic() - started:.1f} s")

    sender = threading.Thread(target=user, daemon=True)
    sender.start()
    wait_for(lambda: len(replies) >= 2, "the user's first answers", 30)
    kill()
    streamer.join(60)

    def told() -> httpx.Response | None:  # asked here too: the user may wait on a retry
        reply = chat(gateway, key, "anyone there?")
        replies.append(reply)
        return reply if reply.status_code == 503 and "member 1" in reply.text else None

    try:
        wait_for(told, "the user to be told by the head which member is gone", 60)
    except BaseException:
        seen = [(r.status_code, r.text[:200]) for r in replies[-5:]]
        pytest.fail(f"the head never said which member is gone: last answers {seen}, "
                    f"{len(replies)} in all, unanswered {lost}")
    finally:
        stop.set()
        sender.join(60)
    assert lost == [], lost
    assert "error" in outcome, outcome  # not a silent 200 cut short
    error = outcome["error"]
    assert "stopped this stream" in error.message, error.message
    assert outcome["pieces"] < 4000
    only_the_gateways_refusals(replies)


def rolling_restart_keeps_serving(cell: Cell, gateway: LiveGateway, key: str) -> None:
    """A second decode box joins; a rolling restart of the decode role restarts both engines,
    one at a time, while one user's requests keep going through the gateway: none fails."""
    head, second = cell.head, cell.second
    assert add(head, second, join_token(second)).status_code == 201
    start_engine(second)
    wait_for(lambda: engine_state(second) == "ready", "the second decode engine READY", 90)

    def both_serving() -> bool:  # both decodes ready, the router sending to each
        view = head.runtime.cell.view
        decodes = [m for m in view.members if m.role == "decode"] if view else []
        return (view is not None and view.serving and len(decodes) == 2
                and all(m.ready and m.capacity for m in decodes)
                and view.capacity == sum(m.capacity or 0 for m in decodes))

    try:
        wait_for(both_serving, "the head to admit up to both decode boxes' capacity", 60)
    except BaseException:
        view = head.runtime.cell.view
        log = head.runtime.state_dir / "router" / "router.log"
        pytest.fail(f"the head never admitted both decodes: "
                    f"{view.message if view else 'no view'}, capacity "
                    f"{view.capacity if view else None}; router log: "
                    f"{log.read_text()[-3000:] if log.exists() else 'none'}")
    ops = cell_ops_of(head.server.server.config.app.state, head.runtime)
    ops.rolling_poll_seconds, ops.rolling_deadline_seconds = 0.2, 90.0
    runs = {box.name: box.api.get("/api/v1/engine").json()["run_id"]
            for box in (cell.member, second)}

    import openai

    codes: list[int] = []
    failures: list[str] = []
    streams: list[int] = []
    stop = threading.Event()
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=0,
                           timeout=60)

    def user() -> None:  # one user, one request after another, for the whole restart
        for i in range(2000):
            if stop.is_set():
                return
            reply = chat(gateway, key, f"still there {i}?")
            codes.append(reply.status_code)
            if reply.status_code != 200:
                failures.append(reply.text[:300])

    def streamer() -> None:  # another streams, one stream after another
        for i in range(2000):
            if stop.is_set():
                return
            try:
                pieces = sum(1 for c in client.chat.completions.create(
                    model="kimi-k3", max_tokens=40, stream=True,
                    messages=[{"role": "user", "content": f"stream {i}"}],
                    extra_body={"ignore_eos": True}) for d in c.choices if d.delta.content)
            except openai.APIError as exc:
                failures.append(f"stream {i}: {exc}"[:300])
                continue
            streams.append(pieces)

    workers = [threading.Thread(target=user, daemon=True),
               threading.Thread(target=streamer, daemon=True)]
    for worker in workers:
        worker.start()
    try:
        started = head.api.post("/api/v1/cell/rolling-restart",
                                json={"role": "decode", "confirm": True})
        assert started.status_code == 202, started.text

        def ended() -> dict[str, Any] | None:
            rolling = head.api.get("/api/v1/cell").json()["rolling_restart"]
            return rolling if rolling and rolling["state"] != "running" else None
        rolling = wait_for(ended, "the rolling restart to end", 120)
    finally:
        stop.set()
        for worker in workers:
            worker.join(60)
    assert rolling["state"] == "done", rolling
    for box in (cell.member, second):  # each decode engine was restarted: a new run
        assert box.api.get("/api/v1/engine").json()["run_id"] != runs[box.name]
    assert failures == [], failures
    assert len(codes) > 10 and set(codes) == {200}, codes
    assert len(streams) > 3 and set(streams) == {40}, streams
