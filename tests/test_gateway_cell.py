"""The gateway on the head of a prefill/decode cell (issue 17): while the head's daemon says
the cell is active (`appliance.cell.published`), requests go to the cell's router instead of
the local engine, with the engine key, admitted up to the cell's capacity; while the cell
does not serve, users get its reason and ETA; an inactive row gives the local engine back.

The router here is a second engine emulator, keyed as the router is (`--api-key`): any
OpenAI-compatible upstream stands in for it. The real `sglang-router` is tried elsewhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from appliance.cell.published import CellPublished
from appliance.config import Config
from appliance.db.database import Database
from appliance.engine.publish import Published, write_qualifying
from appliance.gateway.engine_gate import decide
from appliance.gateway.qualified import CELL, CELL_UNKNOWN, CONFIGURED, FALLBACK_LIMIT, cell_limit
from appliance.secrets import engine_auth_path, write_engine_auth
from tests.conftest import free_port
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
from tests.test_qualified_admission import health, wait_health

NOW = dt.datetime(2026, 5, 1, 12, 0, tzinfo=dt.UTC)
LOCAL = "http://127.0.0.1:30000"
ROUTER = "http://127.0.0.1:30100"


def engine(state: str = "ready", **extra: object) -> Published:
    return Published(state, state, None, NOW, **extra)  # type: ignore[arg-type]


def cell(*, active: bool = True, serving: bool = True, message: str = "",
         eta: float | None = None, capacity: int | None = 64,
         url: str = ROUTER + "/") -> CellPublished:
    return CellPublished(active, url, serving, message, eta, capacity, NOW)


# --- the decision -------------------------------------------------------------------------------


def test_without_an_active_cell_the_route_is_the_local_engine_as_before() -> None:
    for row in (None, cell(active=False)):
        route = decide(engine(), row, LOCAL, override=8)
        assert route.base_url == LOCAL and not route.through_cell
        assert route.admission is None  # the local rules: qualified point, engine capacity
        assert route.serving and route.refusal(NOW) is None
        stopped = decide(engine("stopped"), row, LOCAL).refusal(NOW)
        assert stopped is not None and stopped.code == "engine_unavailable"
        assert stopped.message == "the engine is stopped: stopped; retry later"
    unknown = decide(None, None, LOCAL).refusal(NOW)
    assert unknown is not None and unknown.retry_after == 10


def test_an_active_serving_cell_routes_to_its_router_sized_by_its_capacity() -> None:
    route = decide(engine(), cell(capacity=96), LOCAL)
    assert route.base_url == ROUTER and route.through_cell
    assert route.upstream_name == "the cell's router"
    assert route.admission is not None
    assert (route.admission.limit, route.admission.source) == (96, CELL)
    assert "through the cell's router" in route.admission.words()
    assert "decode members' running-request limits" in route.admission.words()
    # the operator's override still wins
    configured = decide(engine(), cell(capacity=96), LOCAL, override=12).admission
    assert configured is not None and (configured.limit, configured.source) == (12, CONFIGURED)
    assert "through the cell's router (gateway.max_concurrency)" in configured.words()
    # the head's own engine does not decide: the cell serves whatever it is doing
    for head in (engine("stopped"), engine("loading_weights"), None):
        assert decide(head, cell(), LOCAL).refusal(NOW) is None


def test_a_cell_without_a_published_capacity_admits_a_cautious_guess() -> None:
    guessed = cell_limit(None)
    assert (guessed.limit, guessed.source) == (FALLBACK_LIMIT, CELL_UNKNOWN)
    assert "has not published the cell's capacity" in guessed.words()
    assert cell_limit(0).source == CELL_UNKNOWN
    assert cell_limit(7).limit == 7


def test_a_cell_that_does_not_serve_refuses_with_its_reason_and_eta() -> None:
    reason = "no decode member is READY: decode-1 is loading weights"
    refusal = decide(engine(), cell(serving=False, message=reason, eta=150), LOCAL).refusal(NOW)
    assert refusal is not None
    assert (refusal.status, refusal.code, refusal.retry_after) == (503, "cell_unavailable", 150)
    # The head's words carry its ETA; Retry-After is that same ETA, never a rounding of its
    # own ("about 4 seconds left" beside Retry-After 30 was issue 25's).
    assert refusal.message == f"the cell is not serving: {reason}; retry later"
    no_eta = decide(engine(), cell(serving=False, message=reason), LOCAL).refusal(NOW)
    assert no_eta is not None and no_eta.retry_after == 30
    assert "ready in" not in no_eta.message
    soon = decide(engine(), cell(serving=False, eta=1), LOCAL).refusal(NOW)
    assert soon is not None and soon.retry_after == 5  # never sooner than the poll can see
    assert "no prefill or no decode member is ready" in soon.message  # said, even unsaid


def test_a_qualification_of_the_head_closes_the_gateway_in_a_cell_too() -> None:
    leased = engine(qualifying_until=NOW + dt.timedelta(minutes=10))
    refusal = decide(leased, cell(), LOCAL).refusal(NOW)
    assert refusal is not None and refusal.code == "engine_qualifying"
    after = decide(leased, cell(), LOCAL).refusal(NOW + dt.timedelta(minutes=11))
    assert after is None  # a lapsed lease: the daemon is gone, the cell serves


def test_the_routers_errors_become_the_gateways_own_without_internal_addresses() -> None:
    """Issue 25: users read the router's 502 `Decode server error: error sending request for
    url (http://127.0.0.1:…)` and its 503 `No available decode workers`."""
    decode_error = (b'{"error": {"message": "Decode server error: error sending request for '
                    b'url (http://10.0.0.6:30000/v1/chat/completions)", "code": '
                    b'"decode_server_error"}}')
    none_left = b"No available servers: No available decode workers (all circuits open)"
    serving = decide(engine(), cell(), LOCAL)
    for status, body in ((502, decode_error), (503, none_left), (504, b"timeout")):
        error = serving.upstream_error(status, body, anthropic=False)
        assert (error.status, error.code, error.retry_after) == (503, "cell_unavailable", 5)
        assert "did not answer the cell's router" in error.message
        assert "http" not in error.message and "Decode server" not in error.message
    # once the head says why, its reason and ETA are the answer
    lost = decide(engine(), cell(serving=False, message="no decode member is ready: member 2 "
                                 "(10.0.0.6) is stopped", eta=40), LOCAL)
    said = lost.upstream_error(502, decode_error, anthropic=True)
    assert said.retry_after == 40 and "member 2 (10.0.0.6) is stopped" in said.message
    other = serving.upstream_error(500, b'{"message": "Prefill server error (500): boom at '
                                   b'http://10.0.0.5:30000/generate"}', anthropic=False)
    assert other.code == "engine_error" and "http://" not in other.message
    assert "an engine of the cell" in other.message
    down = serving.unreachable(OSError("Connect call failed ('127.0.0.1', 30100)"))
    assert down.code == "cell_unavailable" and "30100" not in down.message
    # the single box's path is as it was
    local = decide(engine(), None, LOCAL)
    assert local.upstream_error(503, b'{"message": "busy"}', anthropic=False).code == \
        "engine_error"
    assert local.unreachable(OSError("refused")).code == "engine_unreachable"


# --- live: a gateway in front of two emulators --------------------------------------------------


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Emulator, Path]]:
    """The stand-in for the head's router: an emulator that demands the engine key (as the
    router does with `--api-key`), slow enough that a poll happens while it streams."""
    state = tmp_path_factory.mktemp("router-state")
    write_engine_auth(state)
    emu = start_engine(tmp_path_factory, "--config", str(engine_auth_path(state)),
                       token_seconds=0.02)
    yield emu, state
    stop_engine(emu)


@pytest.fixture
def live(config: Config, db: Database, gateway_engine: Emulator,
         router: tuple[Emulator, Path]) -> Iterator[LiveGateway]:
    """The head's gateway, its local engine READY, holding the key the router demands."""
    secrets = config.paths.state_dir / "secrets"
    secrets.mkdir(parents=True, exist_ok=True, mode=0o700)
    (secrets / "engine-api.key").write_bytes(
        (router[1] / "secrets" / "engine-api.key").read_bytes())
    gateway = LiveGateway(config, db, gateway_engine.url).start()
    gateway.publish("ready", "serving")
    gateway.wait_admitting()
    yield gateway
    gateway.stop()


def counts(*engines: Emulator) -> list[int]:
    return [emulator_stats(e)["requests_total"] for e in engines]


def chat(gateway: LiveGateway, key: str) -> httpx.Response:
    return httpx.post(f"{gateway.url}/v1/chat/completions", headers=auth(key),
                      json=chat_body(max_tokens=3), timeout=30)


def test_through_the_cell_requests_go_to_its_router_up_to_its_capacity(
        live: LiveGateway, gateway_engine: Emulator, router: tuple[Emulator, Path]) -> None:
    local, cell_router = gateway_engine, router[0]
    key = live.key()
    before = counts(local, cell_router)
    assert chat(live, key).status_code == 200
    assert counts(local, cell_router) == [before[0] + 1, before[1]]  # single box: local
    assert live.parts.admission.limit == 4  # the local engine's max_running_requests

    live.publish_cell(cell_router.url, capacity=3)
    body = wait_health(live, lambda b: "cell" in b and b["limit"] == 3, "the cell's route")
    assert body["status"] == "ok" and body["cell"] == {
        "router": cell_router.url, "serving": True, "capacity": 3, "message": ""}
    admission = body["admission"]
    assert isinstance(admission, dict) and admission["source"] == CELL
    assert "through the cell's router" in admission["words"]
    assert live.parts.admission.limit == 3  # the capacity the head published

    before = counts(local, cell_router)
    reply = chat(live, key)
    assert reply.status_code == 200, reply.text  # the router's key was sent: it demands it
    # the real SDK, streamed, through the gateway to the router
    client = openai.OpenAI(base_url=f"{live.url}/v1", api_key=key, max_retries=0, timeout=30)
    readings = live.parts.kv_readings
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "through the cell"}],
        max_tokens=40, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 40
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    assert counts(local, cell_router) == [before[0], before[1] + 2]
    # 0.8 s of streaming, polls every 0.1 s: none read a KV pool through the router
    assert live.parts.kv_readings == readings and live.parts.admission.kv_free is None

    rows = live.usage_rows(3)
    assert [(r[1], r[2], r[3], r[4]) for r in rows[-2:]] == [
        ("chat", False, 200, "ok"), ("chat", True, 200, "ok")]
    assert rows[-1][6] == 40  # the completion tokens the router's stream reported

    # the real router has no /v1/messages: the gateway says so in Anthropic's shape, and
    # sends nothing on
    before = counts(local, cell_router)
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        refused = httpx.post(f"{live.url}{path}", headers={"x-api-key": key,
                             "anthropic-version": "2023-06-01"}, json={
                                 "model": MODEL, "max_tokens": 3,
                                 "messages": [{"role": "user", "content": "hi"}]}, timeout=30)
        assert refused.status_code == 404, refused.text
        error = refused.json()
        assert error["type"] == "error" and error["error"]["type"] == "not_found_error"
        assert "heads a cell" in error["error"]["message"]
        assert "/v1/chat/completions" in error["error"]["message"]
    assert counts(local, cell_router) == before

    # the row going inactive gives the local engine back
    live.publish_cell(cell_router.url, active=False, capacity=3)
    body = wait_health(live, lambda b: "cell" not in b and b["limit"] == 4, "the local route")
    assert body["status"] == "ok"
    before = counts(local, cell_router)
    assert chat(live, key).status_code == 200
    assert counts(local, cell_router) == [before[0] + 1, before[1]]


def test_while_the_cell_does_not_serve_users_get_its_reason_and_eta(
        live: LiveGateway, db: Database, router: tuple[Emulator, Path]) -> None:
    cell_router = router[0]
    key = live.key()
    reason = "no decode member is READY: decode-1 is loading weights (42%)"
    live.publish_cell(cell_router.url, serving=False, message=reason, eta=600, capacity=3)
    live.wait_admitting(False)
    refused = chat(live, key)
    assert refused.status_code == 503 and refused.headers["retry-after"] == "600"
    error = refused.json()["error"]
    assert error["code"] == "cell_unavailable"
    assert error["message"] == f"the cell is not serving: {reason}; retry later"
    probe = health(live)
    assert probe.status_code == 503 and probe.json()["reason"] == error["message"]
    assert probe.json()["cell"]["serving"] is False

    # serving again; the head's own engine stopping does not close the cell's gateway
    live.publish("stopped", "stopped by the operator")
    live.publish_cell(cell_router.url, capacity=3)
    live.wait_admitting()
    before = counts(cell_router)
    assert chat(live, key).status_code == 200
    assert counts(cell_router) == [before[0] + 1]

    # a qualification lease on the head still closes it
    until = dt.datetime.now(dt.UTC) + dt.timedelta(minutes=5)
    db.call(lambda s: write_qualifying(s, until))
    live.wait_admitting(False)
    qualifying = chat(live, key)
    assert qualifying.status_code == 503
    assert qualifying.json()["error"]["code"] == "engine_qualifying"
    db.call(lambda s: write_qualifying(s, None))
    live.wait_admitting()
    assert live.usage_rows(3)[-3][4] == "cell_unavailable"


class CuttingRouter:
    """A stand-in for the router in front of an engine that dies mid-stream: its stream
    sends `chunks` events, then either ends cleanly without `[DONE]` (what the router does
    when it finishes its side) or resets the connection (what a dead decode's cut does)."""

    def __init__(self) -> None:
        import threading

        self.port = free_port()
        self.reset = False
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()
        assert self._ready.wait(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _serve(self) -> None:
        from aiohttp import web

        async def chat(request: web.Request) -> web.StreamResponse:
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            for i in range(3):
                chunk = {"id": "c", "object": "chat.completion.chunk", "model": MODEL,
                         "created": 0, "choices": [{"index": 0, "delta": {"content": f"t{i} "},
                                                    "finish_reason": None}]}
                await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            if self.reset and request.transport is not None:
                request.transport.abort()  # the connection reset: no terminating chunk
                return response
            await response.write_eof()
            return response

        async def main() -> None:
            app = web.Application()
            app.router.add_post("/v1/chat/completions", chat)
            runner = web.AppRunner(app)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", self.port).start()
            self._ready.set()
            await asyncio.Event().wait()

        self._loop = asyncio.new_event_loop()
        with contextlib.suppress(RuntimeError):
            self._loop.run_until_complete(main())

    def stop(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


def test_a_stream_its_engine_cut_short_ends_with_an_error_the_sdk_raises(
        live: LiveGateway) -> None:
    """Issue 25: a stream whose decode engine died ended as a 200 with no `[DONE]` and no
    error, so the client took 41 of 200 tokens for a whole answer."""
    cutting = CuttingRouter()
    try:
        live.publish_cell(cutting.url, capacity=3)
        wait_health(live, lambda b: "cell" in b and b["limit"] == 3, "the cell's route")
        client = openai.OpenAI(base_url=f"{live.url}/v1", api_key=live.key(), max_retries=0,
                               timeout=30)
        for reset in (False, True):
            cutting.reset = reset
            pieces: list[str] = []
            with pytest.raises(openai.APIError) as raised:
                for c in client.chat.completions.create(
                        model=MODEL, stream=True,
                        messages=[{"role": "user", "content": "cut me short"}]):
                    pieces.extend(d.delta.content or "" for d in c.choices)
            assert pieces == ["t0 ", "t1 ", "t2 "]  # what came, then the error
            assert "stopped this stream after 3 chunks" in raised.value.message
            assert "send the request again" in raised.value.message
        rows = live.usage_rows(2)
        assert [r[4] for r in rows[-2:]] == ["stream_interrupted", "upstream_error"]
    finally:
        cutting.stop()


def test_a_request_to_the_router_goes_on_a_fresh_connection_and_the_engines_on_a_kept_one(
) -> None:
    """sglang-router 0.3.2 holds a stream's first token for the client's delayed
    acknowledgement on a kept-alive connection (+30 ms, benchmarks/cell_latency.py): the
    gateway asks for a connection of its own per request to the router, and keeps its
    engine connections alive as ever."""
    from aiohttp import web

    from appliance.gateway.upstream import Upstream

    seen: list[tuple[str, int]] = []  # (the Connection header, the client's port)

    async def record(request: web.Request) -> web.Response:
        peer = request.transport.get_extra_info("peername") if request.transport else None
        seen.append((request.headers.get("Connection", ""), peer[1] if peer else 0))
        return web.json_response({})

    async def scenario() -> None:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", record)
        runner = web.AppRunner(app)
        await runner.setup()
        engine, router = web.TCPSite(runner, "127.0.0.1", 0), web.TCPSite(runner, "127.0.0.1", 0)
        await engine.start()
        await router.start()
        urls = [f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
                for site in (engine, router)]
        upstream = Upstream(urls[0], read_timeout=10)
        await upstream.start()
        try:
            for base in (None, None, urls[1], urls[1]):
                async with upstream.request("POST", "/v1/chat/completions", b"{}", {},
                                            base) as response:
                    await response.read()
        finally:
            await upstream.close()
            await runner.cleanup()

    asyncio.run(scenario())
    assert [header.lower() for header, _ in seen] == ["", "", "close", "close"]
    assert seen[0][1] == seen[1][1]  # the engine's connection was kept and used again
    assert seen[2][1] != seen[3][1]  # each request to the router: a connection of its own
