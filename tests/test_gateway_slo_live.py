"""Service classes through the real gateway (issue 24), in front of the engine emulator with
slow tokens, on loopback, over a real database: an interactive request that would miss its
TTFT SLO is refused at once with 429, Retry-After and the reason; a batch request waits in the
queue and completes; a batch client that closes its socket while queued frees its place; and
/metrics, the usage rows, their CSV and the Usage page count met and refused per class.

The gateway admits one request at a time (gateway.max_concurrency = 1), so one long stream
holds the box: the gateway measured a typical answer of 20 tokens, and this stream has
already sent more than that, so it is taken to run to its max_tokens of 5,000 (about 100 s
at the 50 tokens/s measured), far over the SLO (1 s): a request that finds the slot taken is
predicted to miss. No timed assertions: every wait is on a state (the queue's depth, the
stream's own tokens, a usage row, a counter).
"""

from __future__ import annotations

import datetime as dt
import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from appliance.config import Config
from appliance.db.database import Database
from appliance.gateway.keys import KeyLimits, create_key
from appliance.secrets import server_secret
from tests.conftest import Console, make_config, wait_for
from tests.gateway_rig import LiveGateway, auth, chat_body, start_engine, stop_engine
from tests.test_fake_sglang import Emulator

CLASSES = {"interactive": {"ttft_slo_seconds": 1, "decode_floor_tps": 5},
           "batch": {"deadline_seconds": 120, "share": 0.5},
           "racing": {"decode_floor_tps": 1000, "share": 0.25}}  # faster than the engine


@pytest.fixture(scope="module")
def gateway_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Emulator]:
    emu = start_engine(tmp_path_factory, token_seconds=0.02)  # 50 tokens/s a stream
    yield emu
    stop_engine(emu)


@pytest.fixture
def config(tmp_path: Path) -> Config:
    return make_config(tmp_path / "appliance", APPLIANCE_GATEWAY_MAX_CONCURRENCY="1",
                       APPLIANCE_GATEWAY_CLASSES=json.dumps(CLASSES))


def class_key(live: LiveGateway, name: str, service_class: str) -> str:
    secret = server_secret(live.config.paths.state_dir)
    now = dt.datetime.now(dt.UTC)
    key, _ = live.db.call(lambda s: create_key(s, secret, name=name, owner="tests", by="tests",
                                               now=now, limits=KeyLimits(),
                                               service_class=service_class))
    return key


def metric(live: LiveGateway, cls: str, result: str, reason: str = "") -> float:
    text = httpx.get(f"{live.url}/metrics", timeout=5).text
    line = (f'appliance_gateway_slo_requests_total{{class="{cls}",reason="{reason}",'
            f'result="{result}"}} ')
    for row in text.splitlines():
        if row.startswith(line):
            return float(row[len(line):])
    return 0.0


def raw_request(live: LiveGateway, key: str, body: dict[str, object]) -> socket.socket:
    """A request sent over a socket of our own, so the test can close it while it waits."""
    payload = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", live.port), timeout=10)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                 b"Content-Type: application/json\r\nAuthorization: Bearer " + key.encode()
                 + b"\r\nContent-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
    return sock


def test_classes_refuse_early_queue_batch_and_count_per_class(
        gateway: LiveGateway, db: Database, request: pytest.FixtureRequest) -> None:
    interactive = class_key(gateway, "people", "interactive")
    batch = class_key(gateway, "nightly", "batch")
    url = f"{gateway.url}/v1/chat/completions"
    # One stream the gateway measures: 20 tokens at 50/s, its first at once.
    with httpx.stream("POST", url, headers=auth(interactive), timeout=60,
                      json=chat_body("measure", max_tokens=20, ignore_eos=True,
                                     stream=True)) as reply:
        reply.read()
        assert reply.status_code == 200, reply.text
    wait_for(lambda: metric(gateway, "interactive", "met") == 1, "the first request judged")

    admission = gateway.parts.admission
    batch_answer: list[httpx.Response] = []
    with httpx.stream("POST", url, headers=auth(interactive), timeout=120,
                      json=chat_body("hold the box", max_tokens=5000, ignore_eos=True,
                                     stream=True)) as held:
        lines = held.iter_lines()  # kept: a generator dropped closes the stream
        events = 0
        while events <= 25:  # past the typical answer: it will run to its cap
            events += next(lines).startswith("data:")
        assert admission.in_use == 1  # the one slot is taken

        # Interactive: predicted to wait ~100 s for the slot, over its 1 s: refused at once.
        refused = httpx.post(url, headers=auth(interactive), timeout=10,
                             json=chat_body("now please", max_tokens=5))
        assert refused.status_code == 429
        error = refused.json()["error"]
        assert error["code"] == "slo_ttft_predicted_miss"
        assert error["type"] == "rate_limit_error"
        assert "first token within 1 s" in error["message"]
        assert "(interactive)" in error["message"] and "batch key" in error["message"]
        assert int(refused.headers["retry-after"]) >= 30  # the hold's tokens still to come
        assert admission.waiting == 0  # it never queued

        # Batch: waits for the slot (up to its 120 s deadline) instead.
        waiter = threading.Thread(target=lambda: batch_answer.append(httpx.post(
            url, headers=auth(batch), timeout=120, json=chat_body("later", max_tokens=5))))
        waiter.start()
        wait_for(lambda: admission.waiting == 1, "the batch request to queue")

        # A queued batch client that closes its socket frees its place at once.
        sock = raw_request(gateway, batch, chat_body("gone", max_tokens=5))
        wait_for(lambda: admission.waiting == 2, "the second batch request to queue")
        sock.close()
        wait_for(lambda: admission.waiting == 1, "the closed client to leave the queue")
        assert admission.in_use == 1
    # Closing the long stream frees the slot: the batch request is served.
    waiter.join(timeout=120)
    assert batch_answer and batch_answer[0].status_code == 200, batch_answer
    assert batch_answer[0].json()["choices"][0]["message"]["content"]

    wait_for(lambda: metric(gateway, "batch", "met") == 1, "the batch request judged")
    assert metric(gateway, "interactive", "refused", "slo_ttft_predicted_miss") == 1
    assert metric(gateway, "batch", "refused", "queue_timeout") == 0

    # The usage rows keep the class and the result; the closed clients are not judged.
    from sqlalchemy import select

    from appliance.db.models import UsageRequest

    wait_for(lambda: gateway.parts.recorder.written >= 5, "5 usage records", 15)
    rows = db.call(lambda s: sorted((r.service_class, r.outcome, r.slo) for r in
                                    s.scalars(select(UsageRequest))))
    assert rows == [("batch", "client_closed", ""), ("batch", "ok", "met"),
                    ("interactive", "client_closed", ""), ("interactive", "ok", "met"),
                    ("interactive", "slo_ttft_predicted_miss", "refused")]

    # The Usage page counts them per class, in words; the CSV carries the columns. (The
    # console starts only now: its supervisor publishes the engine it finds, none.)
    logged_in: Console = request.getfixturevalue("logged_in")
    now = dt.datetime.now(dt.UTC)
    span = {"range": "custom", "from": (now - dt.timedelta(hours=1)).strftime("%Y-%m-%dT%H:00Z"),
            "to": (now + dt.timedelta(hours=1)).strftime("%Y-%m-%dT%H:00Z")}
    page = logged_in.http.get("/usage", params=span)
    assert page.status_code == 200, page.text
    html = page.text
    assert 'id="usage-classes"' in html
    row = html[html.index('data-class="interactive"'):]
    row = row[:row.index("</tr>")]
    assert '<td data-result="met">1 (50.0 %)</td>' in row
    assert "1 refused at once: the first token would have come later" in row
    batch_row = html[html.index('data-class="batch"'):]
    assert '<td data-result="met">1 (100.0 %)</td>' in batch_row[:batch_row.index("</tr>")]
    csv = logged_in.http.get("/api/v1/usage/export.csv",
                             params={**span, "granularity": "request"}).text
    header, *lines = csv.splitlines()
    assert header.endswith(",history,service_class,slo")
    assert any(line.endswith(",interactive,refused") for line in lines)


def test_a_stream_below_its_class_floor_counts_as_missed_decode(gateway: LiveGateway,
                                                                db: Database) -> None:
    racing = class_key(gateway, "racing", "racing")
    with httpx.stream("POST", f"{gateway.url}/v1/chat/completions", headers=auth(racing),
                      timeout=60, json=chat_body("go", max_tokens=20, ignore_eos=True,
                                                 stream=True)) as reply:
        reply.read()
        assert reply.status_code == 200, reply.text
    wait_for(lambda: metric(gateway, "racing", "missed_decode") == 1, "the slow stream judged")
    assert metric(gateway, "racing", "met") == 0

    from sqlalchemy import select

    from appliance.db.models import UsageRequest

    wait_for(lambda: gateway.parts.recorder.written >= 1, "the usage record", 15)
    assert db.call(lambda s: [(r.service_class, r.slo) for r in
                              s.scalars(select(UsageRequest))]) == [("racing", "missed_decode")]
