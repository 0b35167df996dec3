"""Single sign-on (appliance.auth.oidc, appliance.ui.sso) against real OpenID providers running
as their own processes on loopback.

The browser test signs in through oidc-provider-mock (a third-party provider built on Authlib)
in chromium. The plain-HTTP tests follow the flow by hand against tests/oidc_provider.py, which
can be told to misbehave: every bad answer (tampered signature, expired token, wrong audience,
wrong nonce, wrong state, no mapped group) is refused and opens no session; with the provider
down the SSO button says so and local login still works; local login can be reserved for
break-glass accounts.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import select

from appliance.auth.sessions import COOKIE_NAME
from appliance.config import Config
from appliance.db.models import AdminUser
from appliance.runtime import Runtime
from appliance.testing.clock import FakeClock
from tests.conftest import (
    PASSWORD,
    REPO,
    Console,
    LiveServer,
    add_admin,
    csrf,
    free_port,
    make_config,
)
from tests.oidc_provider import CLIENT_ID, CLIENT_SECRET

ROLE_MAP = "appliance-operators=operator,appliance-admins=admin"


def start(command: list[str], url: str) -> subprocess.Popen[str]:
    """A provider process; returns once it answers (bounded wait, never a sleep)."""
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    for _ in range(200):
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        if process.poll() is not None:
            break
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=0.1)
    process.kill()
    output = process.stdout.read() if process.stdout else ""
    raise AssertionError(f"provider did not start: {output}")


def stop(process: subprocess.Popen[str]) -> None:
    process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=10)
    if process.stdout:
        process.stdout.close()


@pytest.fixture
def clock() -> FakeClock:
    # ID tokens carry the provider's real time; the console must judge them on the same one.
    return FakeClock(dt.datetime.now(dt.UTC))


@pytest.fixture
def provider_kind() -> str:
    return "ours"


@pytest.fixture
def idp(provider_kind: str) -> Iterator[str]:
    """The provider's issuer URL. "ours" is tests/oidc_provider.py; "mock" is
    oidc-provider-mock with olivia in the operators' group, which the browser reaches as
    localhost and the console as 127.0.0.1: two sites, as a real provider and box are."""
    port = free_port()
    if provider_kind == "mock":
        olivia = {"sub": "olivia", "preferred_username": "olivia",
                  "groups": ["appliance-operators"]}
        command = [sys.executable, "-m", "oidc_provider_mock", "--port", str(port),
                   "--require-nonce", "--user-claims", json.dumps(olivia)]
        issuer = f"http://localhost:{port}"
    else:
        command = [sys.executable, "-m", "tests.oidc_provider", str(port)]
        issuer = f"http://127.0.0.1:{port}"
    process = start(command, f"{issuer}/.well-known/openid-configuration")
    yield issuer
    stop(process)


@pytest.fixture
def extra_env() -> dict[str, str]:
    return {}


@pytest.fixture
def config(tmp_path: Path, idp: str, extra_env: dict[str, str]) -> Config:
    secret = tmp_path / "client-secret"
    secret.write_text(CLIENT_SECRET + "\n")
    env = {"APPLIANCE_OIDC_ENABLED": "true", "APPLIANCE_OIDC_ISSUER": idp,
           "APPLIANCE_OIDC_CLIENT_ID": CLIENT_ID,
           "APPLIANCE_OIDC_CLIENT_SECRET_FILE": str(secret),
           "APPLIANCE_OIDC_ROLE_MAP": ROLE_MAP, "APPLIANCE_OIDC_DISPLAY_NAME": "Test IdP",
           **extra_env}
    return make_config(tmp_path / "appliance", **env)


def control(idp: str, **body: Any) -> None:
    httpx.post(f"{idp}/_control", content=json.dumps(body), timeout=5).raise_for_status()


def sign_in(console: Console, *, tamper_state: bool = False) -> httpx.Response:
    """The whole flow by hand: the console's redirect, the provider's, the callback."""
    started = console.http.get("/login/sso?next=/engine")
    assert started.status_code == 303, started.text
    at_idp = httpx.get(started.headers["location"], timeout=10)
    assert at_idp.status_code == 302, at_idp.text
    back = at_idp.headers["location"]
    if tamper_state:
        back = back.replace("state=", "state=x")
    return console.http.get(back)


def has_session(console: Console) -> bool:
    return console.http.get("/").status_code == 200


def test_sign_in_maps_groups_to_a_role_and_opens_a_session(
        runtime: Runtime, server: LiveServer, console: Console, idp: str) -> None:
    page = console.http.get("/login")
    assert "Sign in with Test IdP" in page.text
    done = sign_in(console)
    assert done.status_code == 200, done.text
    assert 'url=/engine"' in done.text  # the page moves on to where the user was going
    assert COOKIE_NAME in console.http.cookies
    assert has_session(console)
    user = runtime.db.call(lambda s: s.scalar(select(AdminUser).where(
        AdminUser.external_subject == "u-1")))
    assert (user.username, user.role, user.source) == ("olivia@127.0.0.1", "operator", "oidc")
    # Signing in again with an admin group updates the same account.
    control(idp, claims={"sub": "u-1", "preferred_username": "olivia",
                         "groups": ["staff", "appliance-admins", "appliance-operators"]})
    assert sign_in(Console(server.base_url)).status_code == 200
    again = runtime.db.call(lambda s: s.get(AdminUser, user.id))
    assert again.role == "admin"
    # The shadow account has no password that works here.
    assert Console(server.base_url).login("olivia@127.0.0.1", PASSWORD).status_code != 303


@pytest.mark.parametrize("mode", ["tampered", "expired", "wrong_audience", "wrong_nonce",
                                  "foreign_key"])
def test_a_bad_id_token_is_refused(server: LiveServer, console: Console, idp: str,
                                   mode: str) -> None:
    control(idp, mode=mode)
    refused = sign_in(console)
    assert refused.status_code == 401, refused.text
    assert "failed verification" in refused.text
    assert "Nobody was signed in" in refused.text
    assert COOKIE_NAME not in console.http.cookies
    assert not has_session(console)


def test_a_wrong_state_is_refused(server: LiveServer, console: Console) -> None:
    refused = sign_in(console, tamper_state=True)
    assert refused.status_code == 400
    assert "does not belong to the sign-in this browser started" in refused.text
    assert not has_session(console)


def test_a_callback_without_the_flow_cookie_is_refused(server: LiveServer, idp: str) -> None:
    started = Console(server.base_url)
    location = started.http.get("/login/sso").headers["location"]
    back = httpx.get(location, timeout=10).headers["location"]
    stranger = Console(server.base_url)  # another browser: no flow cookie
    refused = stranger.http.get(back)
    assert refused.status_code == 400
    assert "not started in this browser" in refused.text


def test_a_user_without_a_mapped_group_is_refused_with_a_page(
        runtime: Runtime, server: LiveServer, console: Console, idp: str) -> None:
    control(idp, claims={"sub": "u-2", "preferred_username": "sam", "groups": ["staff"]})
    refused = sign_in(console)
    assert refused.status_code == 403
    assert "Sign-in refused" in refused.text
    assert "none of your groups has a role" in refused.text
    assert "appliance-operators" in refused.text
    assert not has_session(console)
    assert runtime.db.call(lambda s: s.scalar(select(AdminUser).where(
        AdminUser.external_subject == "u-2"))) is None


ADMIN = {"sub": "u-9", "preferred_username": "ada", "groups": ["appliance-admins"]}


def sso_audit(runtime: Runtime) -> list[Any]:
    from appliance.db.journal import list_audit

    rows = runtime.db.call(lambda s: list_audit(s, action="auth.sso")).items
    return list(reversed(rows))


def mint(console: Console, name: str) -> str:
    created = console.http.post("/api/v1/tokens", json={"name": name}, headers=csrf(console))
    assert created.status_code in (200, 201), created.text
    token: str = created.json()["token"]
    return token


def as_token(server: LiveServer, token: str) -> httpx.Response:
    """A read any role may make (GET /api/v1/tokens: viewer)."""
    return httpx.get(f"{server.base_url}/api/v1/tokens", timeout=10,
                     headers={"Authorization": f"Bearer {token}"})


def acts_as_admin(server: LiveServer, token: str) -> bool:
    """Whether the token passes an admin-only route's guard (a token name that is refused
    afterwards, so nothing is created)."""
    answer = httpx.post(f"{server.base_url}/api/v1/tokens", json={"name": "!!"}, timeout=10,
                        headers={"Authorization": f"Bearer {token}"})
    assert answer.status_code in (403, 422), answer.text
    return answer.status_code == 422


def admin_with_token(server: LiveServer, console: Console, idp: str) -> str:
    """ada signs in through the provider as an admin and mints an admin API token."""
    control(idp, claims=ADMIN)
    assert sign_in(console).status_code == 200
    token = mint(console, "ada script")
    assert acts_as_admin(server, token)
    return token


def test_an_admin_who_loses_every_group_loses_their_tokens_too(
        runtime: Runtime, server: LiveServer, console: Console, idp: str) -> None:
    token = admin_with_token(server, console, idp)

    control(idp, claims={**ADMIN, "groups": ["staff"]})  # out of every mapped group
    refused = sign_in(Console(server.base_url))
    assert refused.status_code == 403
    assert as_token(server, token).status_code in (401, 403)  # the token fell with the account
    assert not has_session(console)
    user = runtime.db.call(lambda s: s.scalar(select(AdminUser).where(
        AdminUser.external_subject == "u-9")))
    assert user.role == "none"
    denied = sso_audit(runtime)[-1]
    assert denied.outcome == "denied"
    assert denied.detail["role_before"] == "admin" and denied.detail["role"] == "none"

    # Back in a mapped group: the next sign-in gives the role back, and the token's ceiling.
    control(idp, claims={**ADMIN, "groups": ["appliance-operators"]})
    assert sign_in(Console(server.base_url)).status_code == 200
    assert as_token(server, token).status_code == 200 and not acts_as_admin(server, token)
    lowered = sso_audit(runtime)[-1]
    assert (lowered.detail["role_before"], lowered.detail["role"]) == ("none", "operator")


def test_a_lowered_sign_in_lowers_the_tokens_and_is_audited(
        runtime: Runtime, server: LiveServer, console: Console, idp: str) -> None:
    token = admin_with_token(server, console, idp)
    control(idp, claims={**ADMIN, "groups": ["appliance-operators"]})
    assert sign_in(Console(server.base_url)).status_code == 200
    assert not acts_as_admin(server, token)  # the admin route is beyond it now
    lowered = sso_audit(runtime)[-1]
    assert (lowered.detail["role_before"], lowered.detail["role"]) == ("admin", "operator")


@pytest.mark.parametrize("extra_env", [{"APPLIANCE_OIDC_ISSUER": f"http://127.0.0.1:{free_port()}"}])
def test_provider_down_says_so_and_local_login_still_works(
        runtime: Runtime, server: LiveServer, console: Console) -> None:
    down = console.http.get("/login/sso")
    assert down.status_code == 503
    assert "Single sign-on is unavailable: Test IdP" in down.text
    assert "local break-glass account" in down.text
    add_admin(runtime, "alice")
    assert console.login("alice").status_code == 303
    assert has_session(console)


@pytest.mark.parametrize("extra_env", [{"APPLIANCE_AUTH_LOCAL_LOGIN": "break_glass",
                                        "APPLIANCE_AUTH_BREAK_GLASS_ACCOUNTS": "root-admin"}])
def test_local_login_reserved_for_break_glass_accounts(
        runtime: Runtime, server: LiveServer) -> None:
    add_admin(runtime, "alice")
    add_admin(runtime, "root-admin")
    alice = Console(server.base_url)
    refused = alice.login("alice")
    assert refused.status_code == 403
    assert "reserved for break-glass accounts" in refused.text
    assert not has_session(alice)
    keeper = Console(server.base_url)
    assert keeper.login("root-admin").status_code == 303
    assert has_session(keeper)


# --- chromium against a third-party provider ------------------------------------------------


@pytest.mark.browser
@pytest.mark.parametrize(("provider_kind", "extra_env"),
                         [("mock", {"APPLIANCE_OIDC_SCOPES": "openid profile"})])
def test_browser_signs_in_through_the_provider(
        runtime: Runtime, server: LiveServer, browser: Any) -> None:
    from tests.browser_rig import expect

    context = browser.new_context(base_url=server.base_url)
    page = context.new_page()
    page.goto("/login")
    page.get_by_role("link", name="Sign in with Test IdP").click()
    expect(page.get_by_role("heading", name="Authorize Client")).to_be_visible()
    page.get_by_role("button", name="olivia").click()
    expect(page).to_have_url(f"{server.base_url}/")
    expect(page.get_by_role("navigation", name="main")).to_be_visible()
    user = runtime.db.call(lambda s: s.scalar(select(AdminUser).where(
        AdminUser.external_subject == "olivia")))
    assert (user.role, user.source) == ("operator", "oidc")
    context.close()
