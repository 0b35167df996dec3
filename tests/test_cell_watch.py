"""The head's cell watch (issue 17): the pure CellView over the head's own engine and its
members; the engine key's hand-over and the keyed transport that follows it; the router's
process runner with the real sglang-router; and, between two real daemons on loopback, the
whole watch: the member's status names its worker, the head writes the router's spec and
starts the router (a recording RouterRunner, passed through build_runtime), hands its engine
key over, publishes the cell's state for the gateway, records a lost member once, polls
without an audit row per poll, and stops the router when the cell is gone."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from appliance.cell.engine_key import (
    EngineKeys,
    KeyedTransport,
    fingerprint,
    hand_over,
    key_path,
    previous_key_path,
)
from appliance.cell.local import QuietReads
from appliance.cell.membership import Member, Seen, add_member, record_seen
from appliance.cell.published import read_cell_published
from appliance.cell.router import (
    RouterInputs,
    RouterSpec,
    Worker,
    build_router_spec,
    router_spec_path,
    write_router_spec,
)
from appliance.cell.router_metrics import RouterReading, RouterScrape, WorkerFigures
from appliance.cell.router_runner import ProcessRouterRunner
from appliance.cell.view import (
    CellView,
    EngineFacts,
    Observed,
    build_view,
    member_changes,
    up_now,
)
from appliance.config import Config
from appliance.db.database import Database
from appliance.db.journal import list_audit, list_events
from appliance.errors import ApplianceError
from appliance.runtime import build_runtime
from appliance.secrets import engine_api_key, engine_auth_path
from appliance.testing.clock import FakeClock
from appliance.testing.fake_gpus import FakeGpus
from tests.conftest import free_port, wait_for
from tests.test_cell_engine import ROUTER_MISSING, TIMEOUTS
from tests.test_cell_engine import model as model  # the module's fixture
from tests.test_cell_membership import Box, add, close_box, join_token, start_box
from tests.test_engine_lifecycle import prove_weights, write_model

AT = dt.datetime(2026, 11, 30, 12, 0, tzinfo=dt.UTC)
HEAD_KEY = fingerprint("h" * 64)

# --------------------------------------------------------------------------- the view, pure


def member(member_id: int, host: str, role: str = "unified", **seen: Any) -> Member:
    return Member(member_id, f"https://{host}:8443", role, True, f"{member_id:08x}", AT,
                  "alice", **seen)


def answer(role: str, state: str, host: str, *, capacity: int | None = None,
           bootstrap: int | None = None, eta: float | None = None, key: str = HEAD_KEY,
           running: str | None = HEAD_KEY) -> dict[str, Any]:
    """A member's peer status as GET /api/v1/cell/peer/status writes it."""
    engine = EngineFacts(role=role, state=state, url=f"http://{host}:30000",
                         bootstrap_port=bootstrap, capacity=capacity, eta_seconds=eta)
    return {"role": role, "engine": engine.engine_json(), "engine_key": key,
            **({"engine_key_running": running} if running else {}),
            "hostname": host, "version": "1", "health": {"overall": "ok"},
            "gpus": {"count": 8, "hottest_c": 61.0, "utilization_pct": 40.0,
                     "memory_used_bytes": 1, "memory_total_bytes": 2}}


def ok(m: Member, reply: dict[str, Any]) -> Observed:
    return Observed(m, "ok", answer=reply)


UNIFIED_HEAD = EngineFacts(role="unified", state="ready", url="http://127.0.0.1:30000",
                           key=HEAD_KEY)


def all_routed(observed: list[Observed], own: EngineFacts) -> RouterScrape:
    """The router's scrape with every worker of the cell healthy and its circuit closed."""
    workers = build_view(own, observed, router_running=False, at=AT).workers
    return RouterScrape(workers={w.url: WorkerFigures(w.url, healthy=True, circuit="closed")
                                 for w in workers})


def view(observed: list[Observed], own: EngineFacts = UNIFIED_HEAD, router: bool = True,
         scrape: RouterScrape | None = None) -> CellView:
    return build_view(own, observed, router_running=router, at=AT,
                      router=scrape or all_routed(observed, own))


def test_a_ready_prefill_and_decode_serve_with_the_decodes_capacity() -> None:
    p, d1, d2 = member(2, "10.0.0.5"), member(3, "10.0.0.6"), member(4, "10.0.0.7")
    cell = view([ok(p, answer("prefill", "ready", "10.0.0.5", capacity=32, bootstrap=8998)),
                 ok(d1, answer("decode", "ready", "10.0.0.6", capacity=64)),
                 ok(d2, answer("decode", "ready", "10.0.0.7", capacity=64))])
    assert cell.active and cell.serving and cell.message == ""
    assert cell.capacity == 128 and cell.capacity_total == 128  # decodes only
    assert cell.workers == (Worker("decode", "http://10.0.0.6:30000"),
                            Worker("decode", "http://10.0.0.7:30000"),
                            Worker("prefill", "http://10.0.0.5:30000", 8998))
    entry = cell.member(2)
    assert entry is not None and entry.ready and entry.gpus is not None
    assert (entry.name, entry.bootstrap_port, entry.health) == ("member 2 (10.0.0.5)", 8998,
                                                                "ok")
    # The same cell without its router process is not serving, and says why.
    down = view([ok(p, answer("prefill", "ready", "10.0.0.5", bootstrap=8998)),
                 ok(d1, answer("decode", "ready", "10.0.0.6", capacity=64))], router=False)
    assert down.active and not down.serving and "router is not running" in down.message


def test_a_ready_engine_serves_only_once_the_router_sends_to_it() -> None:
    """Issue 25: the head counted a member ready when it said READY, before the router had
    taken it back, and users met the router's own 503 "No available decode workers"."""
    p, d1, d2 = member(2, "10.0.0.5"), member(3, "10.0.0.6"), member(4, "10.0.0.7")
    observed = [ok(p, answer("prefill", "ready", "10.0.0.5", capacity=32, bootstrap=8998)),
                ok(d1, answer("decode", "ready", "10.0.0.6", capacity=64)),
                ok(d2, answer("decode", "ready", "10.0.0.7", capacity=64))]
    routed = all_routed(observed, UNIFIED_HEAD)
    figures = dict(routed.workers)
    figures["http://10.0.0.6:30000"] = WorkerFigures("http://10.0.0.6:30000", healthy=False,
                                                     circuit="closed")
    figures["http://10.0.0.7:30000"] = WorkerFigures("http://10.0.0.7:30000", healthy=True,
                                                     circuit="open")
    cell = view(observed, scrape=RouterScrape(workers=figures))
    assert not cell.serving and cell.capacity == 0 and cell.capacity_total == 128
    assert cell.message == (
        "no decode member is ready: member 3 (10.0.0.6) is ready, but the router's health "
        "checks have not taken it in yet; member 4 (10.0.0.7) is ready, but its circuit in "
        "the router is open")
    figures["http://10.0.0.7:30000"] = WorkerFigures("http://10.0.0.7:30000", healthy=True,
                                                     circuit="closed")
    one = view(observed, scrape=RouterScrape(workers=figures))
    assert one.serving and one.capacity == 64  # only what the router sends to counts
    half = dict(figures)
    half["http://10.0.0.5:30000"] = WorkerFigures("http://10.0.0.5:30000", healthy=True,
                                                  circuit="half open")
    assert not view(observed, scrape=RouterScrape(workers=half)).serving
    # A worker the router does not list yet, or no figures at all, is not confirmed either.
    unlisted = view(observed, scrape=RouterScrape(workers={}))
    assert "the router does not list it yet" in unlisted.message
    blind = build_view(UNIFIED_HEAD, observed, router_running=True, at=AT, router=None)
    assert not blind.serving and "the router's figures are not available" in blind.message
    # Without the router running, the view says that, not each engine's router state.
    stopped = build_view(UNIFIED_HEAD, observed, router_running=False, at=AT)
    assert "router is not running" in stopped.message


def test_a_missing_role_is_said_in_words_with_the_soonest_eta() -> None:
    p, d1 = member(2, "10.0.0.5"), member(3, "10.0.0.6")
    # Member 4 answered before (its row keeps its engine address) and does not now.
    d2 = member(4, "10.0.0.7", engine_url="http://10.0.0.7:30000", reported_role="decode",
                engine_state="ready", capacity=64)
    cell = view([ok(p, answer("prefill", "ready", "10.0.0.5", bootstrap=8998)),
                 ok(d1, answer("decode", "loading_weights", "10.0.0.6", eta=2400)),
                 Observed(d2, "unreachable", "the member at https://10.0.0.7:8443 did not "
                                             "answer")])
    assert cell.active and not cell.serving
    assert cell.message == ("no decode member is ready: member 3 (10.0.0.6) is loading, about "
                            "40 minutes left; member 4 (10.0.0.7) does not answer")
    assert cell.eta_seconds == 2400
    assert cell.capacity == 0 and cell.capacity_total is None  # member 3's is not known
    # the silent member keeps its place in the router: no spec change, no router restart
    assert Worker("decode", "http://10.0.0.7:30000") in cell.workers
    entry = cell.member(4)
    assert entry is not None and (entry.status, entry.reachable, entry.state) == (
        "unreachable", False, "ready")


def test_capacity_is_unknown_when_a_ready_decode_did_not_say() -> None:
    p, d1, d2 = member(2, "10.0.0.5"), member(3, "10.0.0.6"), member(4, "10.0.0.7")
    cell = view([ok(p, answer("prefill", "ready", "10.0.0.5", bootstrap=8998)),
                 ok(d1, answer("decode", "ready", "10.0.0.6", capacity=64)),
                 ok(d2, answer("decode", "ready", "10.0.0.7"))])
    assert cell.serving and cell.capacity is None


def test_the_heads_own_engine_is_a_worker_in_a_pd_role() -> None:
    own = EngineFacts(role="prefill", state="ready", url="http://127.0.0.1:30000",
                      bootstrap_port=8998, key=HEAD_KEY)
    d = member(2, "10.0.0.6")
    cell = view([ok(d, answer("decode", "ready", "10.0.0.6", capacity=48))], own)
    assert cell.serving and cell.capacity == 48
    assert Worker("prefill", "http://127.0.0.1:30000", 8998) in cell.workers
    loading = view([ok(d, answer("decode", "ready", "10.0.0.6", capacity=48))],
                   EngineFacts(role="prefill", state="loading_weights",
                               url="http://127.0.0.1:30000", eta_seconds=90, key=HEAD_KEY))
    assert loading.message == ("no prefill engine is ready: this box (the head) is loading, "
                               "about 1 minute 30 seconds left")


def test_unified_members_are_listed_but_never_workers() -> None:
    u = member(2, "10.0.0.5")
    cell = view([ok(u, answer("unified", "ready", "10.0.0.5", capacity=64))])
    assert not cell.active and not cell.serving and cell.workers == ()
    assert cell.capacity is None
    assert "no prefill and no decode engine" in cell.message
    entry = cell.member(2)
    assert entry is not None and entry.role == "unified" and not entry.ready


def test_an_engine_with_another_key_or_on_loopback_is_not_ready() -> None:
    p, d, lo = member(2, "10.0.0.5"), member(3, "10.0.0.6"), member(4, "10.0.0.8")
    cell = view([ok(p, answer("prefill", "ready", "10.0.0.5", bootstrap=8998,
                              running=fingerprint("o" * 64))),
                 ok(d, answer("decode", "ready", "10.0.0.6", capacity=64)),
                 ok(lo, answer("decode", "ready", "127.0.0.1", capacity=64))])
    assert not cell.serving
    assert cell.message == ("no prefill member is ready: member 2 (10.0.0.5)'s engine runs "
                            "with another key: restart it to serve in the cell")
    loopback = cell.member(4)
    assert loopback is not None and loopback.worker_url is None and not loopback.ready
    assert "set cell.listen_address" in loopback.problem
    assert Worker("decode", "http://127.0.0.1:30000") not in cell.workers
    # An engine on every interface is reached at the member's console host.
    anywhere = view([ok(d, answer("decode", "ready", "0.0.0.0", capacity=8))])  # noqa: S104
    entry = anywhere.member(3)
    assert entry is not None and entry.worker_url == "http://10.0.0.6:30000"


def test_a_member_is_lost_once_and_back_once_with_the_capacity_left() -> None:
    p, d1, d2 = member(2, "10.0.0.5"), member(3, "10.0.0.6"), member(4, "10.0.0.7")
    prefill = ok(p, answer("prefill", "ready", "10.0.0.5", bootstrap=8998))
    both = [prefill, ok(d1, answer("decode", "ready", "10.0.0.6", capacity=64)),
            ok(d2, answer("decode", "ready", "10.0.0.7", capacity=64))]
    rows = {3: member(3, "10.0.0.6", engine_url="http://10.0.0.6:30000",
                      reported_role="decode", engine_state="ready", capacity=64)}
    gone = [prefill, Observed(rows[3], "unreachable", "no answer"), both[2]]
    up: dict[int, bool] = {}
    seen = []
    for polled in (both, both, gone, gone, both, both):
        cell = view(polled)
        seen += [c.sentence for c in member_changes(up, cell)]
        up = up_now(up, cell)
    assert seen == [
        "cell member lost: member 3 (10.0.0.6) does not answer; 1 of 1 prefill engine ready; "
        "decode capacity now 64 of 128 running requests",
        "cell member back: member 3 (10.0.0.6) has its decode engine ready; 1 of 1 prefill "
        "engine ready; decode capacity now 128 of 128 running requests"]
    # A member still loading since the head first saw it is no loss.
    loading = [ok(d1, answer("decode", "loading_weights", "10.0.0.6"))]
    assert member_changes({}, view(loading)) == []
    assert up_now({}, view(loading)) == {}


# --------------------------------------------------------------------------- small parts


def test_a_heads_status_reads_are_audited_first_then_hourly() -> None:
    reads = QuietReads(period=3600)
    assert reads.due("aaaa", 0.0) == 1
    assert [reads.due("aaaa", t) for t in (3.0, 6.0, 3599.0)] == [None, None, None]
    assert reads.due("bbbb", 10.0) == 1  # another head is its own
    assert reads.due("aaaa", 3600.0) == 4  # this entry stands for four reads


def test_the_keyed_transport_follows_a_handed_over_key(tmp_path: Path) -> None:
    """An engine launched with the old key, then one launched with the handed-over key: the
    daemon's clients keep working with each and say which key the engine accepts."""
    state = tmp_path / "state"
    old = engine_api_key(state)
    engine_key = {"value": old}  # the key the engine was launched with

    def engine(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health" or request.headers.get(
                "authorization") == f"Bearer {engine_key['value']}":
            return httpx.Response(200, json={"ok": True})
        return httpx.Response(401, json={"error": "Unauthorized"})

    keys = EngineKeys(state, old)

    async def scenario() -> None:
        async with httpx.AsyncClient(base_url="http://engine", transport=KeyedTransport(
                keys, httpx.MockTransport(engine))) as client:
            assert (await client.get("/server_info")).status_code == 200
            assert keys.running == fingerprint(old)
            new = "n" * 64
            assert hand_over(state, new) and not hand_over(state, new)
            assert previous_key_path(state).read_text().strip() == old
            assert new in engine_auth_path(state).read_text()
            assert (await client.get("/server_info")).status_code == 200  # still the old one
            assert keys.running == fingerprint(old)
            engine_key["value"] = new  # the engine restarted and read the new file
            assert (await client.get("/v1/loads")).status_code == 200
            assert keys.running == fingerprint(new)
            engine_key["value"] = "x" * 64  # a key this box never held: refused, not guessed
            assert (await client.get("/v1/loads")).status_code == 401
            assert keys.running == fingerprint(new)

    asyncio.run(scenario())
    with pytest.raises(ApplianceError, match="not an engine API key"):
        hand_over(state, "-" + "a" * 40)
    assert key_path(state).read_text().strip() == "n" * 64


@pytest.mark.skipif(ROUTER_MISSING, reason="sglang-router is not installed (dev extra)")
def test_the_process_runner_starts_finds_and_stops_the_real_router(tmp_path: Path,
                                                                  model: Path) -> None:
    state = tmp_path / "state"
    key = "r" * 64
    (state / "secrets").mkdir(parents=True)
    (state / "secrets" / "engine-api.key").write_text(key)
    spec = build_router_spec(RouterInputs(
        workers=(Worker("prefill", f"http://127.0.0.1:{free_port()}", free_port()),
                 Worker("decode", f"http://127.0.0.1:{free_port()}")),
        model_path=model, port=free_port(), metrics_port=free_port(),
        key_file=state / "secrets" / "engine-api.key", program=Path(sys.executable),
        startup_timeout_secs=60))
    path = router_spec_path(state)
    write_router_spec(path, spec)
    runner = ProcessRouterRunner(state, grace=5)
    try:
        asyncio.run(runner.restart(path))
        assert asyncio.run(runner.running())
        pid = int(json.loads(runner.pidfile.read_text())["pid"])
        # The router retitles itself: the key it got on its command line leaves the list.
        wait_for(lambda: key.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes(),
                 "the router to retitle itself", 30)
        again = ProcessRouterRunner(state, grace=5)  # a restarted daemon finds it
        assert asyncio.run(again.running())
        asyncio.run(again.stop())
        assert not asyncio.run(again.running()) and not runner.pidfile.exists()
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    finally:
        asyncio.run(runner.stop())
    assert runner.log_path.exists()


# --------------------------------------------------------------------------- two daemons


@dataclass
class RecordingRouter:
    """A RouterRunner that records what the watch asks of it and starts nothing."""

    calls: list[str] = field(default_factory=list)
    specs: list[RouterSpec] = field(default_factory=list)
    up: bool = False

    async def restart(self, spec_path: Path) -> None:
        self.specs.append(RouterSpec.from_json(spec_path.read_text()))
        self.calls.append("restart")
        self.up = True

    async def stop(self) -> None:
        self.calls.append("stop")
        self.up = False

    async def running(self) -> bool:
        return self.up

    async def read(self) -> RouterReading:
        """Its figures (RouterFigures): while up, every worker of its spec healthy and its
        circuit closed, as the real router says once its health checks pass."""
        if not self.up or not self.specs:
            return RouterReading(up=False, error="its metrics port did not answer")
        return RouterReading(up=True, scrape=RouterScrape(workers={
            w.url: WorkerFigures(w.url, healthy=True, circuit="closed")
            for w in self.specs[-1].workers}))


class RefusingRouter(RecordingRouter):
    """A router that cannot be started (systemctl refused, say)."""

    async def restart(self, spec_path: Path) -> None:
        self.calls.append("restart")
        raise ApplianceError("router_unit_failed", "systemctl restart failed: denied",
                             "see the polkit rule")


def test_members_that_do_not_answer_keep_their_place_and_a_failing_router_is_told_once(
        config: Config, db: Database, clock: FakeClock) -> None:
    """No server: the watch's poll over two members whose daemons do not answer (their rows
    hold the engines they reported before) and a router that cannot start."""
    router = RefusingRouter()
    runtime = build_runtime(config, clock=clock, db=db, router=router, router_figures=router)
    def register(s: Any) -> None:
        for n, (role, host) in enumerate((("prefill", "10.0.0.5"), ("decode", "10.0.0.6"))):
            added = add_member(  # a console address nothing listens on
                s, runtime.state_dir, address=f"http://127.0.0.1:{free_port()}", role=role,
                verify_tls=True, credential="acp_" + "0" * 60, prefix=f"{n:08x}",
                added_by="alice", now=clock.now())
            record_seen(s, added.id, Seen(f"http://{host}:30000", 8998 if n == 0 else None,
                                          role, "ready", 64), clock.now())

    db.call(register)

    async def polls() -> list[CellView]:
        seen = [await runtime.cell.poll_once()]
        seen.append(await runtime.cell.poll_once())
        clock.advance(61)  # the retry is due: the same failure is not told again
        seen.append(await runtime.cell.poll_once())
        return seen

    views = asyncio.run(polls())
    first = views[0]
    assert first.active and not first.serving and not first.router_running
    assert first.workers == (Worker("decode", "http://10.0.0.6:30000"),
                             Worker("prefill", "http://10.0.0.5:30000", 8998))
    assert {m.status for m in first.members} == {"unreachable"}
    assert router.calls == ["restart", "restart"]
    events = db.call(lambda s: [e.message for e in list_events(s, source="cell",
                                                                per_page=50).items])
    # No member was ever seen ready by this watch: nothing is lost.
    assert events == ["the cell's router: systemctl restart failed: denied (see the polkit "
                      "rule)"]
    calls = db.call(lambda s: list_audit(s, action="cell.call", per_page=50)).items
    assert sorted(c.outcome for c in calls) == ["failed", "failed"]  # one per member


def with_weights(config: Config, db: Database) -> None:
    write_model(config.paths.models_dir, config.engine.model)
    prove_weights(config, db)


@dataclass
class Cell:
    head: Box
    member: Box
    router: RecordingRouter
    engine_port: int
    bootstrap_port: int
    webhooks: list[dict[str, Any]]  # what the head's alert webhook received


@pytest.fixture
def cell(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Cell]:
    """A head whose own engine is a (stopped) decode, and a prefill member with proven
    weights and the engine emulator, each watching every 0.2 s."""
    monkeypatch.setenv("FAKE_SGLANG_LOAD_SECONDS", "1")
    monkeypatch.setenv("FAKE_SGLANG_GPU_STATE", str(tmp_path / "gpus.json"))
    monkeypatch.delenv("FAKE_SGLANG_FAULT", raising=False)
    for name, value in TIMEOUTS.items():
        monkeypatch.setenv(name, value)
    router = RecordingRouter()
    webhooks: list[dict[str, Any]] = []

    def receiver(request: httpx.Request) -> httpx.Response:
        webhooks.append(json.loads(request.content))
        return httpx.Response(204)

    head, head_db = start_box(tmp_path, "head", {
        "APPLIANCE_CELL_ROLE": "decode", "APPLIANCE_ENGINE_PORT": str(free_port()),
        "APPLIANCE_HEALTH_WEBHOOK_URL": "http://alerts.test/hook"},
        router=router, router_figures=router, cell_poll_seconds=0.2,
        webhook_transport=httpx.MockTransport(receiver))
    engine_port, bootstrap_port = free_port(), free_port()
    member_box, member_db = start_box(tmp_path, "member", {
        "APPLIANCE_CELL_ROLE": "prefill", "APPLIANCE_ENGINE_PORT": str(engine_port),
        "APPLIANCE_CELL_BOOTSTRAP_PORT": str(bootstrap_port)}, prepare=with_weights,
        gpus=FakeGpus(state_file=tmp_path / "gpus.json"), engine_poll_seconds=0.1,
        cell_poll_seconds=0.2)
    member_box.runtime.supervisor.ready_interval = 0.2
    try:
        yield Cell(head, member_box, router, engine_port, bootstrap_port, webhooks)
    finally:
        runner = member_box.runtime.supervisor.runner
        ident = runner.find()
        if ident is not None:  # never leave an emulator behind
            runner.kill(ident)
        close_box(head, head_db)
        close_box(member_box, member_db)


def cell_events(box: Box) -> list[str]:
    return [e.message for e in box.runtime.db.call(
        lambda s: list_events(s, source="cell", per_page=100)).items]


def member_status(head: Box, member_id: int = 1) -> str | None:
    current = head.runtime.cell.view
    entry = current.member(member_id) if current is not None else None
    return entry.status if entry is not None else None


def polls_pass(box: Box, count: int) -> None:
    """Wait until the box's watch has polled `count` more times."""
    start = box.runtime.cell.polls
    wait_for(lambda: box.runtime.cell.polls >= start + count, f"{count} cell polls", 30)


def test_the_head_follows_its_member_into_the_router_and_out(cell: Cell) -> None:
    head, member_box, router = cell.head, cell.member, cell.router
    head_key = engine_api_key(head.runtime.state_dir)
    added = add(head, member_box, join_token(member_box))
    assert added.status_code == 201, added.text
    assert added.json()["engine_key"]["handed_over"] is True
    # The member holds the head's key, for its next engine start.
    assert key_path(member_box.runtime.state_dir).read_text().strip() == head_key
    assert head_key in engine_auth_path(member_box.runtime.state_dir).read_text()
    [handed] = member_box.audit("cell.peer.engine_key")
    assert handed.detail["engine_key"] == fingerprint(head_key)
    assert head_key not in str(handed.detail)

    started = member_box.api.post("/api/v1/engine/start", json={})
    assert started.status_code == 202, started.text
    wait_for(lambda: member_box.api.get("/api/v1/engine").json()["state"] == "ready",
             "the member's engine to be READY", 60)

    def member_seen() -> Any:
        current = head.runtime.cell.view
        entry = current.member(1) if current is not None else None
        return entry if entry is not None and entry.capacity else None

    entry = wait_for(member_seen, "the head to see the member's READY engine")
    worker = f"http://127.0.0.1:{cell.engine_port}"
    [seen] = head.api.get("/api/v1/cell/members").json()
    assert seen["member_role"] == "prefill"
    engine = seen["engine"]
    assert (engine["url"], engine["bootstrap_port"], engine["reachable_from_cell"]) == (
        worker, cell.bootstrap_port, False)
    assert engine["capacity"] == entry.capacity > 0
    # The member's daemon started with its own key and its engine with the head's: its
    # clients followed the engine, and it says which key the engine accepts.
    assert seen["engine_key"] == seen["engine_key_running"] == fingerprint(head_key)
    assert seen["gpus"]["count"] == 8

    # The router's spec names the member's prefill and the head's own decode.
    wait_for(lambda: router.calls, "the router to be started")
    spec = router.specs[-1]
    args = list(spec.args)
    assert args[args.index("--prefill") + 1:args.index("--prefill") + 3] == [
        worker, str(cell.bootstrap_port)]
    assert args[args.index("--decode") + 1] == (
        f"http://127.0.0.1:{head.runtime.config.engine.port}")
    assert router_spec_path(head.runtime.state_dir).exists()
    published = head.runtime.db.call(read_cell_published)
    assert published is not None and published.active and not published.serving
    assert published.upstream_url == f"http://127.0.0.1:{head.runtime.config.cell.router_port}"
    assert published.message == "no decode engine is ready: this box (the head) is stopped"

    # Polling leaves no audit row per poll: on the head, only the admin's own read; on the
    # member, the first read by the head's credential (the watch's or the admin's).
    polls_pass(head, 10)
    status_path = "/api/v1/cell/peer/status"
    assert [c.outcome for c in head.audit("cell.call")
            if c.detail["path"] == status_path] == ["ok"]
    assert len(member_box.audit("cell.peer.status")) == 1
    restarts = router.calls.count("restart")

    # A member that takes another key is handed the head's again (audited on both boxes).
    member_box.api.put("/api/v1/cell/peer/engine-key", json={"key": "m" * 64}).raise_for_status()
    wait_for(lambda: len([c for c in head.audit("cell.call")
                          if c.detail["path"] == "/api/v1/cell/peer/engine-key"]) == 2,
             "the head to hand its key over again")
    assert key_path(member_box.runtime.state_dir).read_text().strip() == head_key
    # Newest first: the head's key again (its running engine has it: no restart), the other
    # key (the running engine does not: a restart), the first hand-over (no engine yet).
    assert [(e.detail["changed"], e.detail["restart_needed"])
            for e in member_box.audit("cell.peer.engine_key")] == [
        (True, False), (True, True), (True, False)]

    # The member's daemon goes away (its engine stays): one event, one audit row, no router
    # restart (the member keeps its place; the router's health checks take it out).
    member_box.server.stop()
    wait_for(lambda: member_status(head) == "unreachable", "the head to see it unreachable")
    polls_pass(head, 5)
    [lost] = [m for m in cell_events(head) if "lost" in m]
    assert lost.startswith("cell member lost: member 1 (127.0.0.1) does not answer")
    assert "0 of 1 prefill engine ready" in lost
    assert [c.outcome for c in head.audit("cell.call")
            if c.detail["path"] == status_path] == ["failed", "ok"]
    assert router.calls.count("restart") == restarts
    [hook] = wait_for(lambda: [h for h in cell.webhooks if h["check"] == "cell.member.1"],
                      "the webhook for the lost member")
    assert (hook["kind"], hook["level"], hook["summary"]) == ("failure", "critical", lost)
    published = head.runtime.db.call(read_cell_published)
    assert published is not None and published.active and not published.serving
    assert "member 1 (127.0.0.1) does not answer" in published.message

    # Removed: the cell is gone, the router stopped, the gateway told.
    removed = head.api.delete("/api/v1/cell/members/1")
    assert removed.status_code == 200 and removed.json()["released_on_member"] is False
    def gone() -> bool:
        published = head.runtime.db.call(read_cell_published)
        return published is not None and not published.active

    wait_for(gone, "the head to publish that it heads no cell")
    assert router.calls[-1] == "stop"
    assert os.path.exists(router_spec_path(head.runtime.state_dir))  # kept: the last spec


def test_a_router_that_dies_is_started_again_in_seconds_then_less_often(
        config: Config, db: Database, clock: FakeClock) -> None:
    """A router found down is started 5 s after its last start, then after 10 s, 20 s …
    while each start dies again; once one keeps running, the next death is met in 5 s."""
    router = RecordingRouter()
    runtime = build_runtime(config, clock=clock, db=db, router=router, router_figures=router)

    def register(s: Any) -> None:
        for n, role in enumerate(("prefill", "decode")):
            added = add_member(
                s, runtime.state_dir, address=f"http://127.0.0.1:{free_port()}", role=role,
                verify_tls=True, credential="acp_" + "0" * 60, prefix=f"{n:08x}",
                added_by="alice", now=clock.now())
            record_seen(s, added.id, Seen(f"http://10.0.0.{5 + n}:30000",
                                          8998 if n == 0 else None, role, "ready", 64),
                        clock.now())

    db.call(register)

    def starts_after(die: bool, seconds: float) -> int:
        if die:
            router.up = False
        clock.advance(seconds)
        asyncio.run(runtime.cell.poll_once())
        return router.calls.count("restart")

    assert starts_after(False, 0) == 1  # the spec was written: started
    assert starts_after(True, 4) == 1  # died: not again before 5 s
    assert starts_after(False, 1) == 2
    assert starts_after(True, 9) == 2  # died again: 10 s now
    assert starts_after(False, 1) == 3
    assert starts_after(False, 0) == 3  # it keeps running: all is forgiven
    assert starts_after(True, 5) == 4
