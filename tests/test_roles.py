"""Roles (issue 16): every route and every daemon-backed CLI command declares the least role it
needs in appliance/auth/roles.py, and one app-wide guard enforces it.

The route walk builds the real app and visits every (method, path) Litestar routes: a route
without an entry fails here. Each declared route is then requested as a viewer, an operator
and an admin (a real login, real CSRF): the guard's answer is what is checked, so a test guard
placed after it answers 418 for whatever got through and no action runs its side effects.
"""

from __future__ import annotations

import argparse
import datetime as dt
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from alembic import command
from alembic.config import Config as AlembicConfig
from litestar import Litestar
from litestar.connection import ASGIConnection
from litestar.exceptions import HTTPException
from litestar.handlers.base import BaseRouteHandler
from litestar.routes import HTTPRoute
from litestar.testing import TestClient
from litestar.utils import ensure_async_callable
from sqlalchemy import text

from appliance.app import create_app
from appliance.auth.accounts import create_admin, get_admin, set_role
from appliance.auth.middleware import CSRF_COOKIE, PUBLIC_PATHS
from appliance.auth.roles import (
    CLI_COMMANDS,
    CLI_LOCAL,
    PUBLIC,
    ROUTES,
    Role,
    cli_role,
    route_access,
)
from appliance.auth.tokens import create_token, resolve_token
from appliance.cli import build_parser
from appliance.config import Config
from appliance.db.database import Database
from appliance.db.journal import list_audit
from appliance.db.schema import migrate
from appliance.errors import ApplianceError
from appliance.resources import migrations_dir
from appliance.runtime import Runtime
from tests.conftest import CSRF_INPUT, PASSWORD, LiveServer

pytestmark = pytest.mark.filterwarnings("ignore:The base_url:UserWarning")
NOW = dt.datetime(2026, 12, 9, 12, 0, tzinfo=dt.UTC)
USERS = {Role.VIEWER: "vera", Role.OPERATOR: "otto", Role.ADMIN: "alice"}
# A value for each path parameter, so every route can be requested.
PARAMS = {"action": "start", "action_id": "1", "prefix": "deadbeef", "name": "nosuch",
          "check": "gpu", "qid": "1", "file_path": "app.css", "path": "x", "member_id": "1"}
REACHED = 418


def concrete(template: str) -> str:
    return re.sub(r"\{(\w+)\}", lambda m: PARAMS[m.group(1)], template)


def app_routes(app: Litestar) -> set[tuple[str, str]]:
    """Every (method, path template) the app routes, Litestar's generated OPTIONS aside."""
    found = set()
    for route in app.routes:
        assert isinstance(route, HTTPRoute), f"{route.path}: only HTTP routes are declared"
        for method in route.route_handler_map:
            if method != "OPTIONS":
                found.add((method, route.path_format))
    return found


def add_accounts(runtime: Runtime) -> None:
    def apply(s: Any) -> None:
        for role, name in USERS.items():
            create_admin(s, name, PASSWORD, NOW, role=role)

    runtime.db.call(apply)


def client_of(app: Litestar) -> TestClient[Litestar]:
    """A client with its own cookies. Not entered: the app's startup (the supervisor, the
    scheduler) is not what these tests are about, and it must not run once per client."""
    return TestClient(app, base_url="http://localhost")


def login(client: TestClient[Litestar], username: str) -> None:
    page = client.get("/login")
    match = CSRF_INPUT.search(page.text)
    assert match, page.text
    answer = client.post("/login", data={"username": username, "password": PASSWORD,
                                         "next": "/", "_csrf_token": match.group(1)},
                         follow_redirects=False)
    assert answer.status_code == 303, answer.text
    client.headers["X-CSRF-Token"] = client.cookies[CSRF_COOKIE]


@pytest.fixture
def app(runtime: Runtime) -> Litestar:
    add_accounts(runtime)
    return create_app(runtime)


# --- the table covers the app -----------------------------------------------------------------


def test_every_route_declares_a_role(app: Litestar) -> None:
    routed = app_routes(app)
    missing = sorted(routed - set(ROUTES))
    assert not missing, ("routes without a role in appliance/auth/roles.py ROUTES: "
                         f"{missing}")
    stale = sorted(set(ROUTES) - routed)
    assert not stale, f"ROUTES names routes the app does not have: {stale}"


def test_public_routes_are_exactly_the_unauthenticated_paths(app: Litestar) -> None:
    for method, path in app_routes(app):
        unauthenticated = any(path == p or path.startswith(p + "/") for p in PUBLIC_PATHS)
        assert (ROUTES[(method, path)] == PUBLIC) == unauthenticated, (method, path)


def test_every_cli_command_is_daemon_backed_with_a_role_or_local() -> None:
    def leaves(parser: argparse.ArgumentParser, prefix: tuple[str, ...]) -> Iterator[str]:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs:
            yield " ".join(prefix)
        for action in subs:
            for name, sub in action.choices.items():
                yield from leaves(sub, (*prefix, name))

    commands = set(leaves(build_parser(), ()))
    undeclared = commands - set(CLI_COMMANDS) - CLI_LOCAL
    assert not undeclared, f"CLI commands in neither CLI_COMMANDS nor CLI_LOCAL: {undeclared}"
    assert not set(CLI_COMMANDS) & CLI_LOCAL
    assert not (set(CLI_COMMANDS) | CLI_LOCAL) - commands, "declared commands that do not exist"
    for name, routes in CLI_COMMANDS.items():
        assert all(route in ROUTES for route in routes), name
    assert cli_role("engine status") == Role.VIEWER
    assert cli_role("engine logs") == Role.VIEWER
    assert cli_role("engine restart") == Role.OPERATOR
    assert cli_role("weights pull") == Role.OPERATOR
    assert cli_role("qualify run") == Role.OPERATOR


def test_roles_are_ordered_by_rank_not_spelling() -> None:
    assert Role.VIEWER < Role.OPERATOR < Role.ADMIN
    assert Role.ADMIN.allows("viewer") and not Role.VIEWER.allows("operator")
    assert max(Role, key=lambda r: r.rank) == Role.ADMIN
    assert route_access("OPTIONS", "/anything") == PUBLIC
    assert route_access("GET", "/not/declared") is None


# --- the guard, route by route ----------------------------------------------------------------


async def reached(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
    raise HTTPException(status_code=REACHED, detail="the role guard let this through")


def test_each_role_gets_exactly_its_routes(app: Litestar, runtime: Runtime) -> None:
    clients = {role: client_of(app) for role in Role}
    anonymous = client_of(app)
    anonymous.get("/login")  # its CSRF cookie, for POST /login
    anonymous.headers["X-CSRF-Token"] = anonymous.cookies[CSRF_COOKIE]
    for role, client in clients.items():
        login(client, USERS[role])
    # Last after the role guard: whatever it lets through stops there, before any handler
    # runs. (Litestar resolves each handler's guards once, app's first; this extends that.)
    for route in app.routes:
        for handler in route.route_handlers:  # type: ignore[attr-defined]
            handler.resolve_guards().append(ensure_async_callable(reached))
    for (method, template), needed in sorted(ROUTES.items()):
        path = concrete(template)
        if needed == PUBLIC:
            answer = anonymous.request(method, path)
            assert answer.status_code == REACHED, (method, path, answer.text)
            continue
        # Without a session the middleware answers before any guard (/metrics: unless
        # health.metrics_public opens it to scrapers, which the guard lets through).
        refused = anonymous.request(method, path, follow_redirects=False)
        opened = template == "/metrics" and runtime.config.health.metrics_public
        assert refused.status_code == (REACHED if opened else 401) or (
            refused.status_code == 303 and not path.startswith("/api/")), (method, path)
        for role, client in clients.items():
            answer = client.request(method, path)
            if role.allows(needed):
                assert answer.status_code == REACHED, (role, method, path, answer.text)
            else:
                assert answer.status_code == 403, (role, method, path, answer.text)
                words = f"this needs the {needed} role (you are a"
                assert words in answer.text, (role, method, path, answer.text)
                if path.startswith("/api/"):
                    assert answer.json()["code"] == "role_required"


def test_a_refusal_is_audited_and_names_the_role(app: Litestar, runtime: Runtime) -> None:
    client = client_of(app)
    login(client, "vera")
    answer = client.post("/api/v1/engine/start", json={})
    assert answer.status_code == 403
    body = answer.json()
    assert body["detail"] == "this needs the operator role (you are a viewer)"
    assert "set-role" in body["hint"]
    page = client.post("/engine/stop", data={"confirm": "yes"})
    assert page.status_code == 403
    assert "this needs the operator role (you are a viewer)" in page.text
    entries = runtime.db.call(lambda s: list_audit(s, action="auth.forbidden")).items
    assert [(e.actor, e.outcome, e.target) for e in entries] == [
        ("vera", "denied", "POST /engine/stop"), ("vera", "denied", "POST /api/v1/engine/start")]
    assert entries[1].detail["needs"] == "operator"
    assert entries[1].detail["role"] == "viewer"


def test_a_viewer_reads_every_page_and_read_api(app: Litestar) -> None:
    reads = [(m, t) for (m, t), need in ROUTES.items()
             if need == Role.VIEWER and m == "GET" and t != "/api/v1/engine/log/stream"]
    assert len(reads) > 30
    client = client_of(app)
    login(client, "vera")
    for _, template in reads:
        answer = client.get(concrete(template))
        # Not refused: 200, or a 4xx where the made-up id does not exist, a required query
        # is left out, or there is nothing to read yet (no manifest, no model geometry).
        assert answer.status_code < 500, (template, answer.text[:300])
        assert answer.status_code not in (401, 403), (template, answer.text[:300])
        assert "role_required" not in answer.text, template
    assert client.get("/api/v1/me").json()["role"] == "viewer"


# --- the console hides what a role cannot do --------------------------------------------------


def test_the_console_hides_actions_from_a_viewer(app: Litestar) -> None:
    viewer, admin = client_of(app), client_of(app)
    login(viewer, "vera")
    login(admin, "alice")
    seen = viewer.get("/engine").text
    assert 'hx-post="/engine/start"' not in seen
    assert "vera · <span" in seen and ">viewer</span>" in seen
    assert 'hx-post="/engine/start"' in admin.get("/engine").text
    for page, action in (("/weights", 'action="/weights/pull"'),
                         ("/keys", 'action="/keys"'),
                         ("/settings", 'hx-post="/settings/tokens"')):
        assert action not in viewer.get(page).text, page
        assert action in admin.get(page).text, page


# --- admin API tokens carry a role no higher than their creator's -----------------------------


def test_token_roles(app: Litestar, runtime: Runtime) -> None:
    secret = runtime.secret

    def make(owner: str, role: str | None) -> str:
        def apply(s: Any) -> str:
            admin = next(a for a in [get_admin(s, i) for i in range(1, 10)]
                         if a and a.username == owner)
            return create_token(s, secret, admin, f"t {owner}", NOW, role=role)[0]
        return runtime.db.call(apply)

    with pytest.raises(ApplianceError) as refused:
        make("vera", "admin")
    assert refused.value.code == "token_role_too_high"
    with pytest.raises(ApplianceError):
        make("otto", "admin")

    client = client_of(app)
    login(client, "alice")
    made = client.post("/api/v1/tokens", json={"name": "reader", "role": "viewer"})
    assert made.status_code == 201, made.text
    assert made.json()["info"]["role"] == "viewer"
    reader = {"Authorization": f"Bearer {made.json()['token']}"}
    bearer = client_of(app)
    assert bearer.get("/api/v1/me", headers=reader).json()["role"] == "viewer"
    refused_api = bearer.post("/api/v1/tokens", json={"name": "up", "role": "admin"},
                              headers=reader)
    assert refused_api.status_code == 403
    assert refused_api.json()["code"] == "role_required"

    # an admin's token acts as the account does now: demoting the account demotes it
    full = {"Authorization": f"Bearer {make('alice', None)}"}
    assert bearer.get("/api/v1/me", headers=full).json()["role"] == "admin"
    runtime.db.call(lambda s: set_role(s, "otto", "admin"))
    runtime.db.call(lambda s: set_role(s, "alice", "operator"))
    assert bearer.get("/api/v1/me", headers=full).json()["role"] == "operator"
    assert bearer.post("/api/v1/keys", json={"name": "x"}, headers=full).status_code == 403


def test_the_last_admin_cannot_be_demoted(runtime: Runtime) -> None:
    add_accounts(runtime)
    with pytest.raises(ApplianceError) as refused:
        runtime.db.call(lambda s: set_role(s, "alice", "viewer"))
    assert refused.value.code == "last_admin"


def test_a_token_of_a_demoted_owner_resolves_with_the_lower_role(runtime: Runtime) -> None:
    add_accounts(runtime)

    def mint(s: Any) -> str:
        otto = next(a for a in [get_admin(s, i) for i in range(1, 10)]
                    if a and a.username == "otto")
        return create_token(s, runtime.secret, otto, "ops", NOW)[0]

    token = runtime.db.call(mint)
    runtime.db.call(lambda s: set_role(s, "otto", "viewer"))
    found = runtime.db.call(lambda s: resolve_token(s, runtime.secret, token, NOW))
    assert found is not None and found[0].role == Role.VIEWER
    assert found[1].role == Role.OPERATOR  # what it was given; it acts as the lower


# --- existing accounts become admins ----------------------------------------------------------


def test_existing_accounts_and_tokens_migrate_to_admin(tmp_path: Path) -> None:
    db = Database(f"sqlite:///{tmp_path / 'old.db'}")
    try:
        with db.engine.begin() as conn:
            cfg = AlembicConfig()
            cfg.set_main_option("script_location", str(migrations_dir()))
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, "0008_qualification")
        with db.engine.begin() as conn:
            conn.execute(text(
                "INSERT INTO admin_users (id, username, password_hash, must_change_password, "
                "created_at, password_changed_at) VALUES (1, 'old', 'x', 0, :t, :t)"),
                {"t": "2026-11-01 00:00:00.000000"})
            conn.execute(text(
                "INSERT INTO api_tokens (name, prefix, token_hash, user_id, created_at) "
                "VALUES ('old', 'abcd1234', 'h', 1, :t)"), {"t": "2026-11-01 00:00:00.000000"})
        migrate(db, migrations_dir(), tmp_path / "backups", NOW)
        with db.engine.connect() as conn:
            assert conn.execute(text("SELECT role FROM admin_users")).scalar() == "admin"
            assert conn.execute(text("SELECT role FROM api_tokens")).scalar() == "admin"
        admin = db.call(lambda s: get_admin(s, 1))
        assert admin is not None and admin.role == Role.ADMIN
    finally:
        db.dispose()


# --- the CLI's tokens carry the command's role ------------------------------------------------


def test_the_cli_reads_status_with_only_a_viewer_ready(
        runtime: Runtime, config: Config, capsys: pytest.CaptureFixture[str]) -> None:
    from appliance.engine import cli as engine_cli

    runtime.db.call(lambda s: create_admin(s, "vera", PASSWORD, NOW, role="viewer"))
    live = LiveServer(runtime).start()
    try:
        args = build_parser().parse_args(["engine", "status"])
        assert engine_cli.run(args, config) == 0
        assert "stopped" in capsys.readouterr().out.lower()
        with engine_cli.daemon_api(config, "engine status") as api:
            assert api.get("/api/v1/me").json() == {
                "username": "vera", "auth": "token", "must_change_password": False,
                "role": "viewer"}
        start = build_parser().parse_args(["engine", "start"])
        with pytest.raises(ApplianceError) as refused:
            engine_cli.run(start, config)
        assert refused.value.code == "no_admin"
        assert "operator role" in refused.value.message
    finally:
        live.stop()
