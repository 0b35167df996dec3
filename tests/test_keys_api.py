"""The gateway API keys admin API (`/api/v1/keys`) over real loopback HTTP.

A live server, a console session (cookie + X-CSRF-Token) and an admin API token. Covers the
key shown once (the create answer) and never again (list, read, the database, the audit
log); the record's shape and status (active, expired, revoked); each bad input refused with a
clear 4xx that changes nothing; revoking (idempotent); editing limits (kept, set, cleared);
the audit trail; and the door closed to callers without a login.
"""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select

from appliance.api.keys import parse_expiry, parse_when
from appliance.db.journal import list_audit
from appliance.db.models import GatewayKey
from appliance.errors import ApplianceError
from appliance.gateway.keys import KEY_RE, load_entries
from appliance.runtime import Runtime
from appliance.testing.clock import FakeClock
from tests.conftest import Console, LiveServer, csrf, problem

API = "/api/v1/keys"
RECORD_KEYS = {"id", "name", "owner", "prefix", "status", "created_at", "created_by",
               "last_used_at", "expires_at", "revoked_at", "revoked_by", "limits", "service_class"}
NO_LIMITS = {"max_concurrency": None, "requests_per_minute": None, "tokens_per_day": None,
             "max_tokens": None}


def create(console: Console, **body: Any) -> httpx.Response:
    return console.http.post(API, json={"name": "support bots", **body}, headers=csrf(console))


def created(console: Console, **body: Any) -> dict[str, Any]:
    response = create(console, **body)
    assert response.status_code == 201, response.text
    answer: dict[str, Any] = response.json()
    return answer


def audit_trail(runtime: Runtime) -> list[tuple[str, str, str, dict[str, Any]]]:
    """(action, actor, target, detail) of the keys.* audit entries, oldest first."""
    entries = runtime.db.call(lambda s: list_audit(s, action="keys.", per_page=500)).items
    return [(a.action, a.actor, a.target, a.detail) for a in reversed(entries)]


def key_count(runtime: Runtime) -> int:
    return runtime.db.call(lambda s: int(s.scalar(select(func.count(GatewayKey.id))) or 0))


# --- creating and listing ---------------------------------------------------------------------


def test_create_shows_the_key_once_and_never_again(logged_in: Console, runtime: Runtime,
                                                   clock: FakeClock) -> None:
    response = create(logged_in, owner="Support team", expires_in_days=30,
                      limits={"max_concurrency": 4, "requests_per_minute": 60,
                              "tokens_per_day": 5_000_000_000, "max_tokens": 4096})
    assert response.status_code == 201, response.text
    assert response.headers["cache-control"] == "no-store"
    answer = response.json()
    key = answer.pop("key")
    match = KEY_RE.match(key)
    assert match and match.group(1) == answer["prefix"]
    assert set(answer) == RECORD_KEYS
    assert answer["name"] == "support bots" and answer["owner"] == "Support team"
    assert answer["status"] == "active" and answer["created_by"] == "alice"
    assert answer["limits"] == {"max_concurrency": 4, "requests_per_minute": 60,
                                "tokens_per_day": 5_000_000_000, "max_tokens": 4096}
    expires = dt.datetime.fromisoformat(answer["expires_at"])
    assert expires == clock.now() + dt.timedelta(days=30)
    assert answer["last_used_at"] is None and answer["revoked_at"] is None

    listed = logged_in.http.get(API)
    assert listed.status_code == 200
    assert key not in listed.text
    assert listed.json() == [answer]
    one = logged_in.http.get(f"{API}/{answer['prefix']}")
    assert one.status_code == 200 and one.json() == answer and key not in one.text
    # Stored: the prefix and an HMAC, never the key; the gateway's cache accepts it.
    stored = runtime.db.call(lambda s: s.scalar(select(GatewayKey)))
    assert stored is not None and key not in repr(vars(stored))
    entry = runtime.db.call(load_entries)[0]
    assert entry.accepts(runtime.secret, key, clock.now())
    assert not entry.accepts(runtime.secret, key[:-1] + ("A" if key[-1] != "A" else "B"),
                             clock.now())
    # Audited, without the key.
    trail = audit_trail(runtime)
    assert trail == [("keys.create", "alice", answer["prefix"], {
        "via": "api:session", "name": "support bots", "owner": "Support team",
        "expires_at": answer["expires_at"].replace("Z", "+00:00"),
        "limits": answer["limits"], "service_class": "interactive"})]
    assert key not in json.dumps(trail)


def test_list_is_newest_first_with_each_status(logged_in: Console, clock: FakeClock) -> None:
    first = created(logged_in, name="soon gone", expires_at=(
        clock.now() + dt.timedelta(minutes=10)).isoformat())
    clock.advance(60)
    second = created(logged_in, name="revoked one")
    clock.advance(60)
    third = created(logged_in, name="plain")
    revoked = logged_in.http.post(f"{API}/{second['prefix']}/revoke", headers=csrf(logged_in))
    assert revoked.status_code == 200
    assert [k["status"] for k in logged_in.http.get(API).json()] == [
        "active", "revoked", "active"]
    clock.advance(600)  # past the first key's expiry (and within the session's idle limit)
    listed = logged_in.http.get(API).json()
    assert [(k["name"], k["status"]) for k in listed] == [
        ("plain", "active"), ("revoked one", "revoked"), ("soon gone", "expired")]
    assert listed[0]["prefix"] == third["prefix"] and listed[2]["prefix"] == first["prefix"]
    assert listed[1]["revoked_by"] == "alice"
    assert all("key" not in k for k in listed)


def test_expiry_forms(logged_in: Console, clock: FakeClock) -> None:
    # A date is 00:00 UTC that day; a time without a zone is UTC; a zone is honoured.
    on_date = created(logged_in, name="a", expires_at="2027-01-31")
    assert on_date["expires_at"] == "2027-01-31T00:00:00Z"
    naive = created(logged_in, name="b", expires_at="2027-01-31T18:30:00")
    assert naive["expires_at"] == "2027-01-31T18:30:00Z"
    zoned = created(logged_in, name="c", expires_at="2027-01-31T18:30:00+02:00")
    assert zoned["expires_at"] == "2027-01-31T16:30:00Z"
    never = created(logged_in, name="d")
    assert never["expires_at"] is None


def test_a_bearer_token_can_manage_keys_and_is_audited_as_such(
        logged_in: Console, server: LiveServer, runtime: Runtime) -> None:
    token = logged_in.http.post("/api/v1/tokens", json={"name": "provisioning"},
                                headers=csrf(logged_in)).json()["token"]
    with httpx.Client(base_url=server.base_url,
                      headers={"Authorization": f"Bearer {token}"}) as c:
        made = c.post(API, json={"name": "ci", "limits": {"max_tokens": 512}})
        assert made.status_code == 201, made.text
        prefix = made.json()["prefix"]
        assert c.post(f"{API}/{prefix}/revoke").json()["status"] == "revoked"
    assert [(a, actor, d["via"]) for a, actor, _, d in audit_trail(runtime)] == [
        ("keys.create", "alice", "api:token"), ("keys.revoke", "alice", "api:token")]


# --- refusals: each a clear 4xx, nothing changed -----------------------------------------------


@pytest.mark.parametrize(("body", "status", "code", "words"), [
    ({"name": "<script>"}, 422, "key_name_invalid", "is not allowed"),
    ({"name": ""}, 422, "key_name_invalid", "is not allowed"),
    ({"name": "x" * 65}, 422, "key_name_invalid", "is not allowed"),
    ({"name": "ok", "owner": "o" * 129}, 422, "key_owner_invalid", "129 characters"),
    ({"name": "ok", "expires_at": "2026-11-29T00:00:00Z"}, 422, "key_expiry_past",
     "is in the past"),
    ({"name": "ok", "expires_at": "next tuesday"}, 422, "key_expiry_invalid",
     "not an ISO 8601 date or time"),
    ({"name": "ok", "expires_at": "2027-02-30"}, 422, "key_expiry_invalid", "ISO 8601"),
    ({"name": "ok", "expires_in_days": 0}, 422, "key_expiry_invalid", "in 0 days"),
    ({"name": "ok", "expires_in_days": -3}, 422, "key_expiry_invalid", "in -3 days"),
    ({"name": "ok", "expires_in_days": 10**9}, 422, "key_expiry_invalid", "days"),
    ({"name": "ok", "expires_in_days": 3, "expires_at": "2027-01-01"}, 422,
     "key_expiry_ambiguous", "both"),
    ({"name": "ok", "limits": {"max_concurrency": 0}}, 422, "key_limits_invalid",
     "max_concurrency must be a whole number from 1"),
    ({"name": "ok", "limits": {"requests_per_minute": -5}}, 422, "key_limits_invalid",
     "requests_per_minute must be"),
    ({"name": "ok", "limits": {"max_tokens": 2**31}}, 422, "key_limits_invalid",
     "max_tokens must be a whole number from 1 to 2147483647"),
    ({"name": "ok", "limits": {"tokens_per_day": 1.5}}, 400, "http_400", "tokens_per_day"),
    ({"name": "ok", "limits": {"max_tokens": "lots"}}, 400, "http_400", "max_tokens"),
    ({"name": "ok", "limits": {"max_tokens": True}}, 400, "http_400", "max_tokens"),
    ({"name": "ok", "max_tokens": 10}, 400, "http_400", "unknown field `max_tokens`"),
    ({"owner": "nobody"}, 400, "http_400", "missing required field `name`"),
])
def test_bad_input_is_refused_and_changes_nothing(
        logged_in: Console, runtime: Runtime, body: dict[str, Any], status: int, code: str,
        words: str) -> None:
    response = logged_in.http.post(API, json=body, headers=csrf(logged_in))
    answer = problem(response, status, code)
    assert words in answer["detail"], answer
    if status == 422:
        assert answer["hint"], answer  # the next step is named
    assert key_count(runtime) == 0
    assert audit_trail(runtime) == []


def test_unknown_prefix_is_404_everywhere(logged_in: Console, runtime: Runtime) -> None:
    for response in (
        logged_in.http.get(f"{API}/0123abcd"),
        logged_in.http.post(f"{API}/0123abcd/revoke", headers=csrf(logged_in)),
        logged_in.http.patch(f"{API}/0123abcd", json={"limits": {"max_tokens": 5}},
                             headers=csrf(logged_in)),
    ):
        body = problem(response, 404, "key_unknown")
        assert "'0123abcd'" in body["detail"] and "list the keys" in body["hint"]
    assert audit_trail(runtime) == []


# --- revoking ---------------------------------------------------------------------------------


def test_revoke_is_idempotent_and_the_gateway_refuses_the_key(
        logged_in: Console, runtime: Runtime, clock: FakeClock) -> None:
    answer = created(logged_in)
    key, prefix = answer["key"], answer["prefix"]
    first = logged_in.http.post(f"{API}/{prefix}/revoke", headers=csrf(logged_in))
    assert first.status_code == 200, first.text
    assert first.json()["status"] == "revoked" and first.json()["revoked_by"] == "alice"
    revoked_at = first.json()["revoked_at"]
    clock.advance(600)
    again = logged_in.http.post(f"{API}/{prefix}/revoke", headers=csrf(logged_in))
    assert again.status_code == 200
    assert again.json()["revoked_at"] == revoked_at  # the first revocation stands
    entry = runtime.db.call(load_entries)[0]
    assert entry.revoked and not entry.accepts(runtime.secret, key, clock.now())
    assert [(a, d.get("already_revoked", False)) for a, _, _, d in audit_trail(runtime)] == [
        ("keys.create", False), ("keys.revoke", False), ("keys.revoke", True)]


def test_session_calls_need_the_csrf_header(logged_in: Console, runtime: Runtime) -> None:
    prefix = created(logged_in)["prefix"]
    refused = logged_in.http.post(f"{API}/{prefix}/revoke")
    problem(refused, 403, "forbidden")
    assert logged_in.http.get(f"{API}/{prefix}").json()["status"] == "active"
    assert logged_in.http.post(API, json={"name": "x"}).status_code == 403
    assert key_count(runtime) == 1


# --- limits -----------------------------------------------------------------------------------


def test_limits_edit_keeps_sets_and_clears(logged_in: Console, runtime: Runtime) -> None:
    prefix = created(logged_in, limits={"max_concurrency": 4, "requests_per_minute": 60})[
        "prefix"]
    url = f"{API}/{prefix}"
    edited = logged_in.http.patch(url, json={"limits": {"requests_per_minute": None,
                                                        "max_tokens": 8192}},
                                  headers=csrf(logged_in))
    assert edited.status_code == 200, edited.text
    assert edited.json()["limits"] == {"max_concurrency": 4, "requests_per_minute": None,
                                       "tokens_per_day": None, "max_tokens": 8192}
    assert logged_in.http.get(url).json()["limits"] == edited.json()["limits"]
    assert runtime.db.call(load_entries)[0].limits.max_tokens == 8192  # what the gateway reads
    # Refusals change nothing.
    for body, status in (({"limits": {"max_tokens": 0}}, 422),
                         ({"limits": {"max_tokens": -1}}, 422),
                         ({"limits": {"max_tokens": 2.5}}, 400),
                         ({"limits": {"max_tokenz": 5}}, 400),
                         ({"max_tokens": 5}, 400)):
        response = logged_in.http.patch(url, json=body, headers=csrf(logged_in))
        assert response.status_code == status, (body, response.text)
    assert logged_in.http.get(url).json()["limits"] == edited.json()["limits"]
    cleared = logged_in.http.patch(url, json={"limits": dict(NO_LIMITS)},
                                   headers=csrf(logged_in))
    assert cleared.json()["limits"] == NO_LIMITS
    trail = [(a, d) for a, _, _, d in audit_trail(runtime) if a == "keys.limits"]
    assert trail == [
        ("keys.limits", {"via": "api:session", "name": "support bots",
                         "before": {**NO_LIMITS, "max_concurrency": 4,
                                    "requests_per_minute": 60},
                         "limits": {**NO_LIMITS, "max_concurrency": 4, "max_tokens": 8192}}),
        ("keys.limits", {"via": "api:session", "name": "support bots",
                         "before": {**NO_LIMITS, "max_concurrency": 4, "max_tokens": 8192},
                         "limits": NO_LIMITS}),
    ]


# --- the door ---------------------------------------------------------------------------------


def test_callers_without_a_login_get_401(server: LiveServer, logged_in: Console) -> None:
    prefix = created(logged_in)["prefix"]
    with httpx.Client(base_url=server.base_url) as anonymous:
        for method, path in (("GET", API), ("POST", API), ("GET", f"{API}/{prefix}"),
                             ("PATCH", f"{API}/{prefix}"), ("POST", f"{API}/{prefix}/revoke")):
            response = anonymous.request(method, path, json={"name": "x"})
            assert response.status_code == 401, (method, path, response.text)
            assert response.json()["code"] == "unauthorized"
        bad = anonymous.get(API, headers={"Authorization": "Bearer apt_0123abcd_" + "b" * 43})
        assert bad.status_code == 401
    assert logged_in.http.get(f"{API}/{prefix}").json()["status"] == "active"


def test_openapi_schema_lists_the_keys_routes(server: LiveServer) -> None:
    schema = httpx.get(server.base_url + "/api/v1/schema/openapi.json").json()
    assert {"/api/v1/keys", "/api/v1/keys/{prefix}", "/api/v1/keys/{prefix}/revoke"} <= set(
        schema["paths"])
    assert set(schema["paths"]["/api/v1/keys/{prefix}"]) == {"get", "patch"}


# --- the expiry parser the console and the CLI share ------------------------------------------


def test_parse_expiry() -> None:
    now = dt.datetime(2026, 11, 30, 12, 0, tzinfo=dt.UTC)
    assert parse_expiry("", now) is None and parse_expiry(" never ", now) is None
    assert parse_expiry("30d", now) == now + dt.timedelta(days=30)
    assert parse_expiry("7 days", now) == now + dt.timedelta(days=7)
    assert parse_expiry("2027-01-31", now) == dt.datetime(2027, 1, 31, tzinfo=dt.UTC)
    assert parse_when("2027-01-31T01:00:00-01:00") == dt.datetime(2027, 1, 31, 2, tzinfo=dt.UTC)
    for text in ("30", "tomorrow", "0d", "2027-13-01", "9999999999d"):
        with pytest.raises(ApplianceError) as caught:
            parse_expiry(text, now)
        assert caught.value.status == 422 and caught.value.hint
