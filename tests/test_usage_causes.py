"""The Usage page's errors by cause, and the "No key" row that counts refused requests.

- Through the real gateway (loopback HTTP in front of the engine emulator): a bogus key and
  a revoked key each get 401 and are recorded without a key, so the report's "No key" row
  counts them and the causes name them, not "errors" alone.
- The page over real HTTP: 7 refusals during a qualification, 9 while the engine restarted
  and 6 wrong keys read as three causes with their counts and statuses, and a key's filter
  shows only its own.
- The CSV export writes millisecond sums without binary-float noise.
"""

from __future__ import annotations

import datetime as dt
import re
from html import unescape

import httpx

from appliance.gateway.error_causes import error_causes
from appliance.gateway.keys import revoke_key
from appliance.gateway.report import RollupRow, load_report, resolve_span
from appliance.gateway.usage import write_batch
from appliance.gateway.usage_csv import csv_line, float_text
from appliance.runtime import Runtime
from tests.conftest import Console, wait_for
from tests.gateway_rig import LiveGateway, auth, chat_body
from tests.test_usage_api import record, seed


def test_refused_keys_are_counted_under_no_key_with_their_cause(gateway: LiveGateway) -> None:
    key = gateway.key("leaver")
    assert httpx.post(f"{gateway.url}/v1/chat/completions", headers=auth(key),
                      json=chat_body()).status_code == 200
    now = dt.datetime.now(dt.UTC)
    gateway.db.call(lambda s: revoke_key(s, key.split("-")[1], by="tests", now=now))
    wait_for(lambda: httpx.get(f"{gateway.url}/v1/models",
                               headers=auth(key)).status_code == 401, "the revocation")
    for presented in (key, "sk-0000000000000000bogus"):
        reply = httpx.post(f"{gateway.url}/v1/chat/completions", headers=auth(presented),
                           json=chat_body())
        assert reply.status_code == 401, reply.text
    rows = gateway.usage_rows(3)
    refused = [r for r in rows if r[3] == 401 and r[1] == "chat"]
    assert len(refused) == 2 and all(r[0] is None for r in refused), rows
    start, end = now - dt.timedelta(hours=1), now + dt.timedelta(hours=1)
    causes = gateway.db.call(lambda s: error_causes(s, start, end, 0))
    chat_refusals = [c for c in causes if c.code == "invalid_api_key"]
    assert chat_refusals and chat_refusals[0].status == 401 and chat_refusals[0].count >= 2
    assert chat_refusals[0].words == "refused: no API key, or a wrong, revoked or expired one"
    report = gateway.db.call(lambda s: load_report(s, resolve_span("24h", None, None, now)))
    no_key = next(k for k in report.keys if k.key.id == 0)
    assert no_key.usage.requests >= 2 and no_key.usage.errors == no_key.usage.requests


def _text(html: str) -> str:
    return re.sub(r"\s+", " ", unescape(re.sub(r"<[^>]+>", " ", html)))


def test_the_page_breaks_errors_down_by_cause(runtime: Runtime, logged_in: Console) -> None:
    data = seed(runtime)  # 6 requests, one 504 engine_timeout, one 401 without a key
    at = runtime.clock.now().replace(hour=11, minute=20)
    span = resolve_span("24h", None, None, runtime.clock.now())
    alpha = runtime.db.call(lambda s: load_report(s, span, data.alpha)).key
    assert alpha is not None
    runtime.db.call(lambda s: write_batch(s, [
        *(record(alpha.id, at, status=503, outcome="engine_qualifying", completion=0)
          for _ in range(7)),
        *(record(alpha.id, at, status=503, outcome="engine_unavailable", completion=0)
          for _ in range(9)),
        *(record(None, at, status=401, outcome="invalid_api_key", prompt=0, completion=0)
          for _ in range(6)),
    ]))
    page = logged_in.http.get("/usage", params={"range": "24h"})
    assert page.status_code == 200, page.text
    causes = re.search(r'<ul class="usage-causes[^>]*>(.*?)</ul>', page.text, re.S)
    assert causes, page.text
    lines = [_text(li).strip() for li in re.findall(r"<li.*?</li>", causes.group(1), re.S)]
    assert lines[:3] == [
        "9 refused while the engine was not serving (starting, restarting, draining or "
        "stopped) (HTTP 503)",
        "7 refused while a qualification measured the engine (HTTP 503)",
        "6 refused: no API key, or a wrong, revoked or expired one (HTTP 401)"]
    assert 'title="error code engine_qualifying"' in causes.group(1)  # one hover for support
    words = _text(page.text)
    assert "wrong, revoked or expired one (401)" in words  # what "No key" counts
    alone = logged_in.http.get("/usage", params={"range": "24h", "key": data.alpha})
    only = re.search(r'<ul class="usage-causes[^>]*>(.*?)</ul>', alone.text, re.S)
    assert only and "invalid_api_key" not in only.group(1)
    assert "engine_timeout" in only.group(1)


def test_the_csv_has_no_float_noise() -> None:
    assert [float_text(v) for v in (41033.51599999999, 12.5, 7.0, 0.0001, -0.0)] == [
        "41033.516", "12.5", "7.0", "0.0", "0.0"]
    row = RollupRow(dt.datetime(2026, 11, 30, tzinfo=dt.UTC), 1, "kimi-k3", 3, 0, 10, 5, 0,
                    41033.51599999999, 0.30000000000000004, 1, 0, 0)
    line = csv_line((row.duration_ms, row.ttft_ms, row.requests))
    assert line == "41033.516,0.3,3\r\n"
