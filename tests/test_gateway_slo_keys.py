"""A key's service class (issue 24) through the three doors: the admin API (create with a
class, move it with PATCH, a class the box lacks refused with nothing changed), the CLI
(`keys create --class`, `keys class`, listed), and the Keys page (shown in the table, chosen
when creating, edited in the row). Every change audited; the gateway's cache carries it."""

from __future__ import annotations

import re
from pathlib import Path

from appliance.db.journal import list_audit
from appliance.gateway.keys import list_keys, load_entries
from appliance.runtime import Runtime
from tests.conftest import Console, csrf
from tests.test_keys_cli import box, database, keys  # noqa: F401 - the box fixture

API = "/api/v1/keys"


def test_the_api_sets_and_moves_a_keys_class(logged_in: Console, runtime: Runtime) -> None:
    made = logged_in.http.post(API, json={"name": "nightly", "service_class": "batch"},
                               headers=csrf(logged_in))
    assert made.status_code == 201, made.text
    prefix = made.json()["prefix"]
    assert made.json()["service_class"] == "batch"
    plain = logged_in.http.post(API, json={"name": "people"}, headers=csrf(logged_in))
    assert plain.json()["service_class"] == "interactive"

    moved = logged_in.http.patch(f"{API}/{prefix}", json={"service_class": "interactive"},
                                 headers=csrf(logged_in))
    assert moved.status_code == 200, moved.text
    assert moved.json()["service_class"] == "interactive"
    entries = {e.prefix: e for e in runtime.db.call(load_entries)}
    assert entries[prefix].service_class == "interactive"  # what the gateway caches

    # A class this box does not define: 422 naming it and the classes there are; no change.
    for body in ({"service_class": "gold"},
                 {"service_class": "gold", "limits": {"max_tokens": 5}}):
        refused = logged_in.http.patch(f"{API}/{prefix}", json=body, headers=csrf(logged_in))
        assert refused.status_code == 422 and refused.json()["code"] == "key_class_unknown"
        assert "'gold'" in refused.json()["detail"] and "batch, interactive" in \
            refused.json()["hint"]
    info = next(k for k in runtime.db.call(list_keys) if k.prefix == prefix)
    assert info.service_class == "interactive" and info.limits.max_tokens is None
    refused = logged_in.http.post(API, json={"name": "x", "service_class": "gold"},
                                  headers=csrf(logged_in))
    assert refused.status_code == 422 and len(runtime.db.call(list_keys)) == 2

    trail = [(a.action, a.detail.get("before"), a.detail.get("service_class"))
             for a in reversed(runtime.db.call(
                 lambda s: list_audit(s, action="keys.", per_page=50)).items)]
    assert trail == [("keys.create", None, "batch"), ("keys.create", None, "interactive"),
                     ("keys.class", "batch", "interactive")]


def test_the_cli_creates_with_a_class_and_moves_it(box: Path) -> None:  # noqa: F811
    code, out, err = keys(box, "create", "--name", "nightly", "--class", "batch")
    assert code == 0, err
    assert "; batch;" in err
    prefix = out.strip()[3:11]
    code, out, err = keys(box, "list")
    assert code == 0 and re.search(rf"^{prefix} .* batch ", out, re.M), out
    code, out, err = keys(box, "class", prefix, "interactive")
    assert code == 0 and f"key {prefix} (nightly) is now interactive" in out, err
    code, out, err = keys(box, "class", prefix, "gold")
    assert code == 65 and "there is no service class 'gold'" in err, err
    db = database(box)
    try:
        [info] = db.call(list_keys)
    finally:
        db.dispose()
    assert info.service_class == "interactive"


def test_the_keys_page_shows_and_edits_the_class(logged_in: Console,
                                                 runtime: Runtime) -> None:
    token = logged_in.page_token("/keys")
    made = logged_in.http.post("/keys", data={"name": "nightly", "service_class": "batch",
                                              "_csrf_token": token})
    assert made.status_code == 200, made.text
    [info] = runtime.db.call(list_keys)
    assert info.service_class == "batch"
    page = logged_in.http.get("/keys").text
    assert "<th>Class</th>" in page
    assert '<td class="key-class">batch</td>' in page
    assert '<option value="interactive" selected' in page  # the create form's default
    form = logged_in.http.get(f"/keys/{info.prefix}/limits").text
    assert '<option value="batch" selected' in form
    saved = logged_in.http.post(f"/keys/{info.prefix}/limits",
                                data={"service_class": "interactive", "_csrf_token": token})
    assert saved.status_code == 303
    [info] = runtime.db.call(list_keys)
    assert info.service_class == "interactive"
    refused = logged_in.http.post(f"/keys/{info.prefix}/limits",
                                  data={"service_class": "gold", "max_tokens": "7",
                                        "_csrf_token": token})
    assert refused.status_code == 422 and "There is no service class" in refused.text
    [info] = runtime.db.call(list_keys)
    assert info.service_class == "interactive" and info.limits.max_tokens is None
