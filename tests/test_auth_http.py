"""Admin access over real loopback HTTP: login, sessions, CSRF, Host guard, throttling, tokens.

Covers the fault cases 12 (brute force), 13 (CSRF), 15 (foreign Host) and 20 (clock jump)
from deploy-and-reliability.md §4.2.
"""

from __future__ import annotations

import datetime as dt

import httpx
import pytest

from appliance.auth.middleware import CSRF_COOKIE
from appliance.auth.sessions import COOKIE_NAME
from appliance.auth.tokens import list_tokens
from appliance.db.journal import list_audit
from appliance.runtime import Runtime
from appliance.testing.clock import FakeClock
from tests.conftest import PASSWORD, Console, LiveServer, add_admin


def audit_actions(runtime: Runtime, action: str = "") -> list[tuple[str, str, str]]:
    page = runtime.db.call(lambda s: list_audit(s, action=action, per_page=500))
    return [(a.action, a.outcome, a.actor) for a in page.items]


# --- login, cookies, sessions ---------------------------------------------------------------


def test_login_sets_a_strict_httponly_session_cookie(runtime: Runtime, console: Console) -> None:
    add_admin(runtime)
    response = console.login()
    assert response.status_code == 303
    assert response.headers["location"] == "/"
    cookies = [c for c in response.headers.get_list("set-cookie") if c.startswith(COOKIE_NAME)]
    assert len(cookies) == 1
    flags = [part.strip().lower() for part in cookies[0].split(";")]
    assert "httponly" in flags
    assert "samesite=strict" in flags
    assert "path=/" in flags
    assert "secure" not in flags  # plain HTTP here; see the TLS test for Secure
    assert ("auth.login", "ok", "alice") in audit_actions(runtime, "auth.login")


def test_csrf_cookie_is_strict_and_httponly(console: Console) -> None:
    response = console.http.get("/login")
    cookie = next(c for c in response.headers.get_list("set-cookie") if c.startswith(CSRF_COOKIE))
    flags = [part.strip().lower() for part in cookie.split(";")]
    assert "httponly" in flags and "samesite=strict" in flags


def test_tls_config_marks_cookies_secure(tmp_path, runtime: Runtime) -> None:  # type: ignore[no-untyped-def]
    from appliance.app import create_app
    from appliance.config import load_config
    from appliance.runtime import build_runtime
    from appliance.ui.login import session_cookie

    cert, key = tmp_path / "c.pem", tmp_path / "k.pem"
    cert.write_text("x")
    key.write_text("x")
    config = load_config(dev=True, dev_root=tmp_path / "a", env={
        "APPLIANCE_SERVER_TLS_CERT": str(cert), "APPLIANCE_SERVER_TLS_KEY": str(key)})
    tls_runtime = build_runtime(config, db=runtime.db, clock=runtime.clock)
    assert session_cookie(tls_runtime, "v").secure is True
    app = create_app(tls_runtime)
    assert app.csrf_config is not None and app.csrf_config.cookie_secure is True


def test_unauthenticated_console_redirects_and_api_answers_401(console: Console) -> None:
    page = console.http.get("/audit")
    assert page.status_code == 303
    assert page.headers["location"] == "/login?next=/audit"
    api = console.http.get("/api/v1/me")
    assert api.status_code == 401
    assert api.headers["content-type"].startswith("application/problem+json")
    assert api.json()["hint"]


def test_wrong_password_is_refused_and_audited(runtime: Runtime, console: Console) -> None:
    add_admin(runtime)
    response = console.login(password="not the password at all")
    assert response.status_code == 401
    assert "Wrong username or password." in response.text
    assert COOKIE_NAME not in response.cookies
    assert ("auth.login", "failed", "alice") in audit_actions(runtime, "auth.login")


def test_unknown_user_gets_the_same_answer(runtime: Runtime, console: Console) -> None:
    response = console.login(username="mallory")
    assert response.status_code == 401
    assert "Wrong username or password." in response.text


def test_open_redirect_is_refused(runtime: Runtime, console: Console) -> None:
    add_admin(runtime)
    token = console.page_token()
    response = console.http.post("/login", data={
        "username": "alice", "password": PASSWORD, "next": "//evil.example/x",
        "_csrf_token": token})
    assert response.status_code == 303
    assert response.headers["location"] == "/"


def test_logout_ends_the_session(logged_in: Console, runtime: Runtime) -> None:
    logged_in.page_token("/")
    response = logged_in.http.post("/logout", data={"_csrf_token": logged_in.csrf})
    assert response.status_code == 303
    assert logged_in.http.get("/").status_code == 303
    assert ("auth.logout", "ok", "alice") in audit_actions(runtime, "auth.logout")


def test_idle_session_expires(logged_in: Console, clock: FakeClock, runtime: Runtime) -> None:
    assert logged_in.http.get("/").status_code == 200
    clock.advance(runtime.config.auth.session_idle_minutes * 60 - 5)
    assert logged_in.http.get("/").status_code == 200  # activity slides the idle deadline
    clock.advance(runtime.config.auth.session_idle_minutes * 60 + 1)
    assert logged_in.http.get("/").status_code == 303


def test_session_has_an_absolute_lifetime(logged_in: Console, clock: FakeClock,
                                          runtime: Runtime) -> None:
    step = runtime.config.auth.session_idle_minutes * 60 - 60
    lifetime = runtime.config.auth.session_max_hours * 3600
    for _ in range(lifetime // step):
        clock.advance(step)
        logged_in.http.get("/")
    clock.advance(step)
    assert logged_in.http.get("/").status_code == 303


def test_password_reset_ends_other_sessions(logged_in: Console, server: LiveServer,
                                            runtime: Runtime) -> None:
    from appliance.auth.accounts import set_password

    now = runtime.clock.now()
    runtime.db.call(lambda s: set_password(s, "alice", "another long password", now))
    assert logged_in.http.get("/").status_code == 303


def test_must_change_password_blocks_everything_else(runtime: Runtime, console: Console) -> None:
    add_admin(runtime, "admin", must_change=True)
    response = console.login("admin")
    assert response.headers["location"] == "/account/password"
    assert console.http.get("/").headers["location"] == "/account/password"
    api = console.http.get("/api/v1/status")
    assert api.status_code == 403
    assert api.json()["code"] == "password_change_required"
    token = console.page_token("/account/password")
    changed = console.http.post("/account/password", data={
        "current_password": PASSWORD, "new_password": "a brand new passphrase",
        "confirm_password": "a brand new passphrase", "_csrf_token": token})
    assert changed.status_code == 303
    assert console.http.get("/").status_code == 200


@pytest.mark.parametrize(("new", "confirm", "current", "message"), [
    ("short", "short", PASSWORD, "at least 12"),
    ("a long new password", "a different one!", PASSWORD, "differ"),
    ("a long new password", "a long new password", "wrong current pw", "current password is wrong"),
    (PASSWORD, PASSWORD, PASSWORD, "different from the current"),
])
def test_bad_password_changes_are_explained(logged_in: Console, new: str, confirm: str,
                                            current: str, message: str) -> None:
    token = logged_in.page_token("/account/password")
    response = logged_in.http.post("/account/password", data={
        "current_password": current, "new_password": new, "confirm_password": confirm,
        "_csrf_token": token})
    assert response.status_code == 422
    assert message in response.text
    assert logged_in.http.get("/").status_code == 200  # the old session still works


# --- CSRF (fault 13) -------------------------------------------------------------------------


def test_csrf_covers_every_unsafe_method(server: LiveServer) -> None:
    from appliance.app import create_app

    config = create_app(server.runtime).csrf_config
    assert config is not None
    assert set(config.safe_methods) <= {"GET", "HEAD", "OPTIONS"}


def test_login_without_csrf_token_is_refused(runtime: Runtime, console: Console) -> None:
    add_admin(runtime)
    console.http.get("/login")
    response = console.http.post("/login", data={"username": "alice", "password": PASSWORD})
    assert response.status_code == 403
    assert COOKIE_NAME not in response.cookies


def test_console_post_without_csrf_token_changes_nothing(logged_in: Console,
                                                         runtime: Runtime) -> None:
    response = logged_in.http.post("/settings/tokens", data={"name": "sneaky"})
    assert response.status_code == 403
    assert runtime.db.call(list_tokens) == []
    assert logged_in.http.post("/logout").status_code == 403
    assert logged_in.http.get("/").status_code == 200  # still logged in


def test_console_post_with_foreign_origin_is_refused(logged_in: Console,
                                                     runtime: Runtime) -> None:
    logged_in.page_token("/settings")
    response = logged_in.http.post(
        "/settings/tokens", data={"name": "x", "_csrf_token": logged_in.csrf},
        headers={"Origin": "http://evil.example"})
    assert response.status_code == 403
    assert runtime.db.call(list_tokens) == []


def test_console_post_with_token_works(logged_in: Console, runtime: Runtime) -> None:
    logged_in.page_token("/settings")
    response = logged_in.http.post(
        "/settings/tokens", data={"name": "ci", "_csrf_token": logged_in.csrf},
        headers={"HX-Request": "true"})
    assert response.status_code == 200
    assert "apt_" in response.text
    assert [t.name for t in runtime.db.call(list_tokens)] == ["ci"]


def test_api_with_session_needs_the_csrf_header(logged_in: Console, runtime: Runtime) -> None:
    refused = logged_in.http.post("/api/v1/tokens", json={"name": "nope"})
    assert refused.status_code == 403
    assert "CSRF" in refused.json()["detail"]
    assert runtime.db.call(list_tokens) == []
    cookie = logged_in.http.cookies[CSRF_COOKIE]
    ok = logged_in.http.post("/api/v1/tokens", json={"name": "yes"},
                             headers={"X-CSRF-Token": cookie})
    assert ok.status_code == 201
    assert ok.json()["token"].startswith("apt_")


# --- Host header (fault 15) ------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/login", "/", "/api/v1/me", "/healthz"])
def test_foreign_host_header_is_refused(server: LiveServer, path: str) -> None:
    response = httpx.get(server.base_url + path, headers={"Host": "evil.example"})
    assert response.status_code == 400
    assert response.json()["code"] == "host_not_allowed"
    assert "server.allowed_hosts" in response.json()["hint"]


@pytest.mark.parametrize("host", ["localhost", "127.0.0.1:1234", "LOCALHOST:8080", "[::1]:80"])
def test_allowed_hosts_match_any_port(server: LiveServer, host: str) -> None:
    assert httpx.get(server.base_url + "/healthz", headers={"Host": host}).status_code == 200


# --- brute force (fault 12) and clock jumps (fault 20) ---------------------------------------


def _fail_times(console: Console, times: int, username: str = "alice") -> list[int]:
    return [console.login(username, "wrong password!").status_code for _ in range(times)]


def test_brute_force_is_throttled_and_audited(runtime: Runtime, console: Console) -> None:
    add_admin(runtime)
    limit = runtime.config.auth.login_max_failures
    assert _fail_times(console, limit) == [401] * limit
    blocked = console.login()  # even the right password is refused while throttled
    assert blocked.status_code == 429
    assert 1 <= int(blocked.headers["retry-after"]) <= runtime.config.auth.login_window_seconds
    assert "Too many failed logins" in blocked.text
    assert ("auth.login", "denied", "alice") in audit_actions(runtime, "auth.login")


def test_throttle_is_per_user_and_lifts_after_the_window(runtime: Runtime, console: Console,
                                                         clock: FakeClock) -> None:
    add_admin(runtime)
    add_admin(runtime, "bob")
    _fail_times(console, runtime.config.auth.login_max_failures)
    assert console.login().status_code == 429
    assert console.login("bob").status_code == 303  # another account is not locked out
    clock.advance(runtime.config.auth.login_window_seconds + 1)
    assert console.login().status_code == 303


@pytest.mark.parametrize("jump", [-3 * 3600, 3 * 3600, 400 * 86400])
def test_wall_clock_jump_neither_lifts_nor_extends_the_throttle(
    runtime: Runtime, console: Console, clock: FakeClock, jump: int
) -> None:
    add_admin(runtime)
    _fail_times(console, runtime.config.auth.login_max_failures)
    clock.jump_wall(jump)
    assert console.login().status_code == 429  # a stepped clock does not unlock
    clock.advance(runtime.config.auth.login_window_seconds + 1)
    assert console.login().status_code == 303  # nor does it lock forever


def test_brute_force_loop_stays_bounded(runtime: Runtime, console: Console) -> None:
    """A bounded spray of 40 attempts: all refused, none succeed, the daemon stays up."""
    add_admin(runtime)
    codes = _fail_times(console, 40)
    assert set(codes) == {401, 429}
    assert codes.count(401) == runtime.config.auth.login_max_failures
    assert console.http.get("/healthz").status_code == 200


# --- admin API tokens ------------------------------------------------------------------------


def _api_token(logged_in: Console, name: str = "script", **extra: object) -> str:
    cookie = logged_in.http.cookies[CSRF_COOKIE]
    response = logged_in.http.post("/api/v1/tokens", json={"name": name, **extra},
                                   headers={"X-CSRF-Token": cookie})
    assert response.status_code == 201, response.text
    return str(response.json()["token"])


def test_bearer_token_reaches_the_api_without_csrf(logged_in: Console, server: LiveServer,
                                                   runtime: Runtime) -> None:
    token = _api_token(logged_in)
    with httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {token}"}) as c:
        assert c.get("/api/v1/me").json() == {
            "username": "alice", "auth": "token", "must_change_password": False,
            "role": "admin"}
        created = c.post("/api/v1/tokens", json={"name": "second"})
        assert created.status_code == 201
        prefix = created.json()["info"]["prefix"]
        assert c.delete(f"/api/v1/tokens/{prefix}").json()["revoked_at"] is not None
    stored = runtime.db.call(list_tokens)
    assert all(token not in repr(t) for t in stored)  # only prefix and hash are kept
    assert ("token.create", "ok", "alice") in audit_actions(runtime, "token.")


def test_revoked_and_expired_tokens_stop_working(logged_in: Console, server: LiveServer,
                                                 clock: FakeClock) -> None:
    expiring = _api_token(logged_in, "short",
                          expires_at=(clock.now() + dt.timedelta(hours=1)).isoformat())
    revoked = _api_token(logged_in, "gone")
    prefix = revoked.split("_")[1]
    cookie = logged_in.http.cookies[CSRF_COOKIE]
    logged_in.http.delete(f"/api/v1/tokens/{prefix}", headers={"X-CSRF-Token": cookie})
    me = server.base_url + "/api/v1/me"
    assert httpx.get(me, headers={"Authorization": f"Bearer {revoked}"}).status_code == 401
    assert httpx.get(me, headers={"Authorization": f"Bearer {expiring}"}).status_code == 200
    clock.advance(3601)
    assert httpx.get(me, headers={"Authorization": f"Bearer {expiring}"}).status_code == 401


@pytest.mark.parametrize("header", ["Bearer", "Bearer apt_", "Bearer apt_zzzzzzzz_" + "a" * 43,
                                    "Basic abc", "Bearer apt_0123abcd_" + "b" * 43])
def test_malformed_or_unknown_tokens_are_401(server: LiveServer, header: str) -> None:
    response = httpx.get(server.base_url + "/api/v1/me", headers={"Authorization": header})
    assert response.status_code == 401


def test_token_creation_rejects_bad_input(logged_in: Console, clock: FakeClock) -> None:
    cookie = logged_in.http.cookies[CSRF_COOKIE]
    headers = {"X-CSRF-Token": cookie}
    bad_name = logged_in.http.post("/api/v1/tokens", json={"name": "<script>"}, headers=headers)
    assert bad_name.status_code == 422
    assert bad_name.json()["code"] == "token_name_invalid"
    past = logged_in.http.post("/api/v1/tokens", headers=headers, json={
        "name": "old", "expires_at": (clock.now() - dt.timedelta(days=1)).isoformat()})
    assert past.status_code == 422
    assert past.json()["code"] == "token_expiry_past"
    missing = logged_in.http.post("/api/v1/tokens", json={}, headers=headers)
    assert missing.status_code == 400


def test_openapi_schema_is_published(server: LiveServer) -> None:
    schema = httpx.get(server.base_url + "/api/v1/schema/openapi.json").json()
    assert "/api/v1/tokens" in schema["paths"]
    assert "/login" not in schema["paths"]


def test_audit_and_events_api_pages(logged_in: Console, runtime: Runtime) -> None:
    audit = logged_in.http.get("/api/v1/audit", params={"action": "auth."}).json()
    assert audit["total"] >= 1 and audit["items"][0]["action"] == "auth.login"
    bad = logged_in.http.get("/api/v1/events", params={"severity": "loud"})
    assert bad.status_code == 400 and "use one of" in bad.json()["hint"]
    assert logged_in.http.get("/api/v1/audit", params={"page": 0}).status_code == 400


def test_admin_accounts_are_listed_without_secrets(logged_in: Console) -> None:
    admins = logged_in.http.get("/api/v1/admins").json()
    assert [a["username"] for a in admins] == ["alice"]
    assert not any("hash" in key or key == "password" for key in admins[0])
    page = logged_in.http.get("/settings").text
    assert "Admin accounts" in page and "alice" in page and "argon2" not in page
