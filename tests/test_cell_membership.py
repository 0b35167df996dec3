"""Cell membership between two boxes on loopback (issue 17): a member makes a one-time join
token, the head adds the member with it and reads its status through the peer API with the
credential it got; the credential opens nothing else; wrong, expired and used tokens are
refused and audited on the member; a member that revoked the head shows as revoked and nothing
else happens; every cross-box call is audited on both boxes.

Each box is the real app under uvicorn on its own 127.0.0.1 port with its own state directory
and database (conftest's LiveServer), so the test holds each box's fake clock.
"""

from __future__ import annotations

import json
import sqlite3
import stat
from collections.abc import Callable, Iterator
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from appliance.auth.accounts import create_admin
from appliance.auth.tokens import create_token
from appliance.cell.membership import credential_path
from appliance.config import Config
from appliance.db.database import Database
from appliance.db.journal import list_audit
from appliance.db.schema import migrate
from appliance.errors import EX_USAGE
from appliance.resources import migrations_dir
from appliance.runtime import Runtime, build_runtime
from appliance.testing.clock import FakeClock
from tests.conftest import PASSWORD, LiveServer, make_config, problem, run_cli


@dataclass
class Box:
    name: str
    runtime: Runtime
    server: LiveServer
    api: httpx.Client  # as its admin, with an admin API token
    clock: FakeClock

    @property
    def url(self) -> str:
        return self.server.base_url

    def audit(self, action: str) -> list[Any]:
        """This box's audit entries of exactly `action` (the filter matches prefixes), newest
        first."""
        entries = self.runtime.db.call(lambda s: list_audit(s, action=action, per_page=100))
        return [e for e in entries.items if e.action == action]


def start_box(root: Path, name: str, env: dict[str, str] | None = None,
              prepare: Callable[[Config, Database], None] | None = None,
              **overrides: Any) -> tuple[Box, Database]:
    """A box on its own port and state directory: `env` adds APPLIANCE_* settings, `prepare`
    runs on the migrated database before the daemon starts (weights to prove, say), and
    `overrides` go to build_runtime (adapters, poll intervals)."""
    config = make_config(root / name, **(env or {}))
    clock = FakeClock()
    db = Database(config.database_url)
    migrate(db, migrations_dir(), config.paths.state_dir / "backups", clock.now())
    if prepare is not None:
        prepare(config, db)
    runtime = build_runtime(config, clock=clock, db=db, **overrides)
    now = clock.now()

    def admin_token(s: Any) -> str:
        admin = create_admin(s, "alice", PASSWORD, now)
        token, _ = create_token(s, runtime.secret, admin, f"test {name}", now)
        return token

    token = db.call(admin_token)
    server = LiveServer(runtime).start()
    api = httpx.Client(base_url=server.base_url, timeout=30,
                       headers={"Authorization": f"Bearer {token}"})
    return Box(name, runtime, server, api, clock), db


def close_box(box: Box, db: Database) -> None:
    box.api.close()
    box.server.stop()
    db.dispose()


@pytest.fixture
def boxes(tmp_path: Path) -> Iterator[tuple[Box, Box]]:
    head, head_db = start_box(tmp_path, "head")
    member, member_db = start_box(tmp_path, "member")
    yield head, member
    close_box(head, head_db)
    close_box(member, member_db)


def join_token(member: Box) -> str:
    answer = member.api.post("/api/v1/cell/join-tokens")
    assert answer.status_code == 201, answer.text
    token = answer.json()["token"]
    assert token.startswith("acj_")
    return str(token)


def add(head: Box, member: Box, token: str) -> httpx.Response:
    return head.api.post("/api/v1/cell/members", json={"address": member.url, "token": token})


def test_head_adds_a_member_and_reads_its_status(boxes: tuple[Box, Box]) -> None:
    head, member = boxes
    token = join_token(member)

    added = add(head, member, token)
    assert added.status_code == 201, added.text
    record = added.json()
    assert record["address"] == member.url and record["role"] == "unified"
    prefix = record["credential"]
    # The head keeps the credential in a private file, never in its database; the member
    # keeps only its keyed hash.
    path = credential_path(head.runtime.state_dir, record["id"])
    credential = path.read_text().strip()
    assert credential.startswith(f"acp_{prefix}_")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    for box in (head, member):
        with closing(sqlite3.connect(str(box.runtime.db.engine.url.database))) as conn:
            dump = "\n".join(conn.iterdump())
        assert credential not in dump and token not in dump, box.name

    listed = head.api.get("/api/v1/cell/members")
    assert listed.status_code == 200, listed.text
    [seen] = listed.json()
    assert seen["status"] == "ok", seen
    assert seen["engine"]["state"] == "stopped"
    assert seen["member_role"] == "unified"  # the member's own [cell] role, as it reports it
    assert seen["health"]["overall"] in ("ok", "warn", "critical")

    # Audited on both boxes: the join, the engine key's hand-over and the status read, each
    # by both sides.
    calls = head.audit("cell.call")
    assert [(c.detail["method"], c.detail["path"], c.outcome) for c in reversed(calls)] == [
        ("POST", "/api/v1/cell/join", "ok"), ("PUT", "/api/v1/cell/peer/engine-key", "ok"),
        ("GET", "/api/v1/cell/peer/status", "ok")]
    assert record["engine_key"]["handed_over"] is True
    assert seen["engine_key"] == member.audit("cell.peer.engine_key")[0].detail["engine_key"]
    assert all(c.target == member.url for c in calls)
    assert [e.target for e in head.audit("cell.member.add")] == [member.url]
    [joined] = member.audit("cell.join")
    assert (joined.outcome, joined.target, joined.address) == ("ok", prefix, "127.0.0.1")
    [served] = member.audit("cell.peer.status")
    assert served.target == prefix and served.detail["via"] == f"cell peer {prefix}"


def test_the_peer_credential_opens_only_the_peer_api(boxes: tuple[Box, Box]) -> None:
    head, member = boxes
    record = add(head, member, join_token(member)).json()
    credential = credential_path(head.runtime.state_dir, record["id"]).read_text().strip()
    peer = httpx.Client(base_url=member.url, timeout=30,
                        headers={"Authorization": f"Bearer {credential}"})
    with peer:
        assert peer.get("/api/v1/cell/peer/status").status_code == 200
        for method, path in (("GET", "/api/v1/status"), ("GET", "/api/v1/keys"),
                             ("POST", "/api/v1/engine/start"), ("DELETE", "/api/v1/cell/peer"),
                             ("POST", "/api/v1/cell/join-tokens"), ("GET", "/settings")):
            answer = peer.request(method, path)
            assert answer.status_code == 403, (method, path, answer.text)
            assert "cell peer credential works only" in answer.text
        # The peer API drives the member's own supervisor, whose rules still hold.
        stopped = peer.post("/api/v1/cell/peer/engine/stop", json={"confirm": True})
        problem(stopped, 409, "engine_command_refused")
    refused = member.audit("cell.peer.refused")
    assert len(refused) == 6 and {e.outcome for e in refused} == {"denied"}
    assert "GET /api/v1/keys" in {e.target for e in refused}
    [engine] = member.audit("cell.peer.engine")
    assert (engine.outcome, engine.target) == ("denied", record["credential"])
    assert engine.detail["action"] == "stop"
    # The supervisor's own audit names the door too.
    assert member.audit("engine.stop")[0].detail["via"] == f"cell peer {record['credential']}"


def test_wrong_expired_and_used_tokens_are_refused_and_audited(boxes: tuple[Box, Box]) -> None:
    head, member = boxes
    wrong = "acj_" + "x" * 43
    problem(add(head, member, wrong), 502, "join_refused")
    expiring = join_token(member)
    member.clock.advance(3601)  # the member's clock: an hour and a second later
    body = problem(add(head, member, expiring), 502, "join_refused")
    assert "has expired" in body["detail"]
    good = join_token(member)
    assert add(head, member, good).status_code == 201
    assert head.api.delete("/api/v1/cell/members/1").status_code == 200
    used = problem(add(head, member, good), 502, "join_refused")
    assert "already used" in used["detail"]
    # The member answered 403 to each, with the reason, audited with the caller's address.
    joins = [(e.outcome, e.detail.get("reason"), e.address)
             for e in reversed(member.audit("cell.join"))]
    assert joins == [("denied", "unknown", "127.0.0.1"), ("denied", "expired", "127.0.0.1"),
                     ("ok", None, "127.0.0.1"), ("denied", "used", "127.0.0.1")]
    statuses = [c.detail.get("status") for c in reversed(head.audit("cell.call"))
                if c.detail["path"] == "/api/v1/cell/join"]
    assert statuses == [403, 403, 201, 403]
    # Straight at the member: a 403 problem, no credential.
    direct = httpx.post(f"{member.url}/api/v1/cell/join", json={"token": good})
    assert problem(direct, 403, "join_refused")
    assert head.api.get("/api/v1/cell/members").json() == []


def test_a_join_token_guesser_is_throttled_and_adds_no_rows_past_the_limit(
        boxes: tuple[Box, Box]) -> None:
    head, member = boxes
    attempts = member.runtime.cell_attempts
    limit = attempts.max_failures

    def guess(token: str = "acj_" + "x" * 43) -> httpx.Response:
        return httpx.post(f"{member.url}/api/v1/cell/join", json={"token": token}, timeout=10)

    for _ in range(limit):
        problem(guess(), 403, "join_refused")
    blocked = guess()
    body = problem(blocked, 429)
    assert int(blocked.headers["Retry-After"]) >= 1
    assert f"sent {limit} wrong cell join tokens" in body["detail"]
    assert "retry in" in body["detail"]
    for _ in range(3 * limit):  # a flood: answered, not written down
        assert guess().status_code == 429
    assert len(member.audit("cell.join")) == limit
    # A right token from that address waits too (it learns nothing more), and the head says so.
    good = join_token(member)
    assert guess(good).status_code == 429
    refused = problem(add(head, member, good), 502)
    assert "HTTP 429" in refused["detail"] and "retry in" in refused["detail"]
    # Once the oldest failure leaves the window, the right token joins.
    member.clock.advance(attempts.window + 1)
    assert add(head, member, good).status_code == 201
    assert len(attempts) <= attempts.max_addresses


def test_forged_peer_credentials_are_throttled_but_a_revoked_one_still_hears_revoked(
        boxes: tuple[Box, Box]) -> None:
    _, member = boxes
    limit = member.runtime.cell_attempts.max_failures

    def status(credential: str) -> httpx.Response:
        return httpx.get(f"{member.url}/api/v1/cell/peer/status", timeout=10,
                         headers={"Authorization": f"Bearer {credential}"})

    # A credential this box issued, then revoked (the member left): never counted as a guess.
    joined = httpx.post(f"{member.url}/api/v1/cell/join", json={"token": join_token(member)})
    credential = joined.json()["credential"]
    assert member.api.delete("/api/v1/cell/peer").status_code == 200
    for _ in range(limit + 2):
        assert problem(status(credential), 401)["detail"].startswith("this member revoked")

    forged = "acp_0000beef_" + "x" * 43
    for _ in range(limit):
        assert status(forged).status_code == 401
    blocked = status(forged)
    body = problem(blocked, 429)
    assert int(blocked.headers["Retry-After"]) >= 1
    assert "wrong cell peer credentials" in body["detail"]
    rows = len(member.audit("cell.peer.refused"))
    for _ in range(3 * limit):
        assert status(forged).status_code == 429
    assert len(member.audit("cell.peer.refused")) == rows == 2 * limit + 2


def test_a_member_that_left_shows_as_revoked_and_nothing_else_happens(
        boxes: tuple[Box, Box]) -> None:
    head, member = boxes
    record = add(head, member, join_token(member)).json()
    left = member.api.delete("/api/v1/cell/peer")
    assert left.status_code == 200 and left.json()["revoked"] == [record["credential"]]

    [seen] = head.api.get("/api/v1/cell/members").json()
    assert seen["status"] == "revoked"
    assert "revoked this head's credential" in seen["error"]
    assert seen["id"] == record["id"]  # still registered: the head's admin decides
    assert credential_path(head.runtime.state_dir, record["id"]).exists()
    [call] = head.audit("cell.call")[:1]
    assert (call.outcome, call.detail["status"]) == ("denied", 401)
    # This read's refusal, and at most one of the head's watch (which then leaves a member
    # that revoked it alone for ten minutes, rather than be refused every few seconds).
    refused = member.audit("cell.peer.refused")
    assert 1 <= len(refused) <= 2
    assert {(r.detail["reason"], r.address) for r in refused} == {("revoked", "127.0.0.1")}
    assert member.audit("cell.leave")[0].detail["revoked"] == [record["credential"]]

    removed = head.api.delete(f"/api/v1/cell/members/{record['id']}")
    assert removed.status_code == 200
    assert removed.json()["released_on_member"] is False
    assert not credential_path(head.runtime.state_dir, record["id"]).exists()
    assert head.api.get("/api/v1/cell/members").json() == []


def test_removing_a_member_gives_its_credential_up_there(boxes: tuple[Box, Box]) -> None:
    head, member = boxes
    record = add(head, member, join_token(member)).json()
    credential = credential_path(head.runtime.state_dir, record["id"]).read_text().strip()
    removed = head.api.delete(f"/api/v1/cell/members/{record['id']}")
    assert removed.json()["released_on_member"] is True
    [released] = member.audit("cell.peer.release")
    assert released.target == record["credential"]
    answer = httpx.get(f"{member.url}/api/v1/cell/peer/status",
                       headers={"Authorization": f"Bearer {credential}"})
    assert answer.status_code == 401
    assert "revoked" in answer.json()["detail"]


def test_an_unreachable_member_is_shown_as_such(boxes: tuple[Box, Box]) -> None:
    head, member = boxes
    add(head, member, join_token(member))
    member.server.stop()
    [seen] = head.api.get("/api/v1/cell/members").json()
    assert seen["status"] == "unreachable", seen
    assert "did not answer" in seen["error"]
    assert head.audit("cell.call")[0].outcome == "failed"
    assert len(head.audit("cell.member.add")) == 1 and not head.audit("cell.member.remove")


def test_join_tokens_need_an_admin_and_the_join_route_no_login(boxes: tuple[Box, Box]) -> None:
    _, member = boxes
    anonymous = httpx.post(f"{member.url}/api/v1/cell/join-tokens")
    assert anonymous.status_code == 401  # the public /join does not open /join-tokens
    assert httpx.post(f"{member.url}/api/v1/cell/join", json={"token": "nope"}).status_code == 403
    assert member.api.post("/api/v1/cell/members", json={
        "address": "ftp://x", "token": "t"}).json()["code"] == "member_address_invalid"


# --- the CLI, between two real `appliance serve` processes --------------------------------------


def test_the_cli_joins_two_real_daemons(tmp_path: Path) -> None:
    """`appliance cell join-token` on one daemon, `cell add` and `cell members` on another,
    `cell leave` back on the first: each through its own daemon's API."""
    from tests.test_server import Daemon, write_config

    configs = {}
    for name in ("head", "member"):
        path = write_config(tmp_path / name)
        assert run_cli("--config", str(path), "migrate").returncode == 0
        made = run_cli("--config", str(path), "admin", "create", "--username", "alice",
                       "--password-stdin", input=PASSWORD + "\n")
        assert made.returncode == 0, made.stderr
        configs[name] = path
    daemons = {name: Daemon(path) for name, path in configs.items()}
    try:
        for daemon in daemons.values():
            daemon.wait_ready()

        def cell(name: str, *args: str) -> Any:
            done = run_cli("--config", str(configs[name]), "cell", *args, "--json")
            assert done.returncode == 0, (args, done.stdout, done.stderr)
            return json.loads(done.stdout)

        token = cell("member", "join-token")["token"]
        member_url = daemons["member"].base_url
        # The token comes on stdin, so no argv on the box holds it (/proc/PID/cmdline).
        argv = ["--config", str(configs["head"]), "cell", "add", member_url, "--json"]
        refused = run_cli(*argv, input="\n")
        assert refused.returncode == EX_USAGE and "no join token on stdin" in refused.stderr
        assert cell("head", "members") == []  # nothing was added
        done = run_cli(*argv, input=token + "\n")
        assert done.returncode == 0, (done.stdout, done.stderr)
        assert not any(token in arg for arg in argv) and "warning" not in done.stderr
        added = json.loads(done.stdout)
        assert added["address"] == member_url
        [seen] = cell("head", "members")
        assert (seen["status"], seen["engine"]["state"]) == ("ok", "stopped")
        again = run_cli("--config", str(configs["head"]), "cell", "add", member_url, token)
        assert again.returncode != 0 and "is already member 1" in again.stderr, again.stderr
        assert "visible to every user on this box" in again.stderr  # the positional warns
        dash = run_cli("--config", str(configs["head"]), "cell", "add", member_url, "-",
                       input=token + "\n")
        assert "is already member 1" in dash.stderr and "warning" not in dash.stderr
        assert cell("member", "leave")["revoked"] == [added["credential"]]
        [seen] = cell("head", "members")
        assert seen["status"] == "revoked"
        listing = run_cli("--config", str(configs["head"]), "cell", "members")
        assert "revoked this head's credential" in listing.stdout
    finally:
        for daemon in daemons.values():
            daemon.stop()
