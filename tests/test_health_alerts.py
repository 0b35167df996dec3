"""Alerts: events for transitions, and webhook delivery to a real HTTP receiver on loopback
(success, retries after 5xx, giving up with one event, final 4xx, mutes)."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from appliance.db.database import Database
from appliance.db.journal import EventRecord, list_events
from appliance.health.alerts import Alerts
from appliance.health.model import CheckResult, Level
from appliance.health.transitions import Transition, changes
from appliance.testing.clock import FakeClock
from tests.conftest import free_port

HOT = CheckResult("gpu.3.temperature", "gpu", "GPU 3 temperature", Level.CRITICAL,
                  "GPU 3 is at 93 °C", "check the airflow")
COOL = CheckResult("gpu.3.temperature", "gpu", "GPU 3 temperature", Level.OK, "GPU 3 is at 60 °C")


class Receiver:
    """A webhook receiver on 127.0.0.1: answers the statuses queued in `statuses` in order,
    then 200, and keeps every JSON body it was sent."""

    def __init__(self) -> None:
        self.statuses: list[int] = []
        self.bodies: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with receiver.lock:
                    receiver.bodies.append(body)
                    status = receiver.statuses.pop(0) if receiver.statuses else 200
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.02,),
                                       daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/hook"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    server = Receiver()
    yield server
    server.close()


def alerts_for(db: Database, clock: FakeClock, url: str, retries: int = 3) -> Alerts:
    return Alerts(db=db, clock=clock, url=url, retries=retries, box="box-7", version="9.9",
                  base_delay=0.01)


def publish(alerts: Alerts, found: list[Transition], muted: frozenset[str] = frozenset()) -> None:
    """What the monitor does after a poll: events in a transaction, then the webhook."""
    async def scenario() -> None:
        loud = await alerts.db.run(lambda s: alerts.record(s, found, muted))
        alerts.send(loud)
        await alerts.drain()
        await alerts.close()

    asyncio.run(scenario())


def health_events(db: Database) -> list[EventRecord]:
    return list(reversed(db.call(lambda s: list_events(s, source="health")).items))


def test_a_failure_is_one_event_and_one_delivery(db: Database, clock: FakeClock,
                                                 receiver: Receiver) -> None:
    alerts = alerts_for(db, clock, receiver.url)
    publish(alerts, changes({}, [HOT], clock.now()))

    assert receiver.bodies == [{
        "check": "gpu.3.temperature", "group": "gpu", "title": "GPU 3 temperature",
        "level": "critical", "previous_level": "ok", "kind": "failure",
        "summary": "GPU 3 is at 93 °C", "hint": "check the airflow",
        "at": clock.now().isoformat(), "box": "box-7", "version": "9.9"}]
    (event,) = health_events(db)
    assert event.severity == "critical"
    assert event.message == "GPU 3 temperature critical: GPU 3 is at 93 °C"
    assert event.detail["kind"] == "failure" and event.detail["hint"] == "check the airflow"

    publish(alerts, changes({HOT.id: Level.CRITICAL}, [COOL], clock.now()))
    assert [b["kind"] for b in receiver.bodies] == ["failure", "recovery"]
    assert receiver.bodies[1]["previous_level"] == "critical"
    assert [e.severity for e in health_events(db)] == ["critical", "info"]


def test_5xx_is_retried_then_delivered(db: Database, clock: FakeClock,
                                       receiver: Receiver) -> None:
    receiver.statuses = [500, 503]
    publish(alerts_for(db, clock, receiver.url, retries=5), changes({}, [HOT], clock.now()))

    assert len(receiver.bodies) == 3  # two refusals, then delivered
    assert [e.message for e in health_events(db)] == [
        "GPU 3 temperature critical: GPU 3 is at 93 °C"]  # no delivery failure


def test_gives_up_after_the_retries_with_one_event(db: Database, clock: FakeClock,
                                                   receiver: Receiver) -> None:
    receiver.statuses = [500] * 6
    alerts = alerts_for(db, clock, receiver.url, retries=2)
    publish(alerts, changes({}, [HOT], clock.now()))

    assert len(receiver.bodies) == 3  # the first attempt and two retries
    failures = [e for e in health_events(db) if "could not be delivered" in e.message]
    assert len(failures) == 1 and failures[0].severity == "warning"
    assert "after 3 attempt(s): HTTP 500" in failures[0].message
    assert "health.webhook_url" in failures[0].message

    # Still down: the next undelivered alert is logged, not another event.
    publish(alerts, changes({HOT.id: Level.CRITICAL}, [COOL], clock.now()))
    assert len(receiver.bodies) == 6
    assert len([e for e in health_events(db) if "could not be delivered" in e.message]) == 1

    # Up again: delivered, and one event says so.
    publish(alerts, changes({}, [HOT], clock.now()))
    assert len(receiver.bodies) == 7
    back = [e for e in health_events(db) if "accepts alerts again" in e.message]
    assert len(back) == 1 and "2 alert(s) could not be delivered" in back[0].message


def test_a_refusing_receiver_is_not_retried(db: Database, clock: FakeClock,
                                            receiver: Receiver) -> None:
    receiver.statuses = [404]
    publish(alerts_for(db, clock, receiver.url, retries=5), changes({}, [HOT], clock.now()))
    assert len(receiver.bodies) == 1
    assert any("after 1 attempt(s): HTTP 404" in e.message for e in health_events(db))


def test_no_receiver_at_all_gives_up_with_one_event(db: Database, clock: FakeClock) -> None:
    url = f"http://127.0.0.1:{free_port()}/hook"  # nothing listens there
    publish(alerts_for(db, clock, url, retries=1), changes({}, [HOT], clock.now()))
    (failure,) = [e for e in health_events(db) if "could not be delivered" in e.message]
    assert "after 2 attempt(s): ConnectError" in failure.message


def test_a_muted_check_sends_nothing_and_writes_no_event(db: Database, clock: FakeClock,
                                                         receiver: Receiver) -> None:
    publish(alerts_for(db, clock, receiver.url), changes({}, [HOT], clock.now()),
            muted=frozenset({HOT.id}))
    assert receiver.bodies == [] and health_events(db) == []


def test_without_a_url_only_events_are_written(db: Database, clock: FakeClock) -> None:
    publish(alerts_for(db, clock, ""), changes({}, [HOT], clock.now()))
    assert [e.severity for e in health_events(db)] == ["critical"]



# A webhook URL carries its secret in the path, the query or the userinfo (Slack, Teams, ntfy).
SECRET_PARTS = ("services", "T000", "B000", "XXXXsecret", "token=abc", "hookuser", "hookpass")


def secret_url(port: int) -> str:
    return f"http://hookuser:hookpass@127.0.0.1:{port}/services/T000/B000/XXXXsecret?token=abc"


def assert_no_secret(texts: list[str]) -> None:
    for text in texts:
        leaked = [part for part in SECRET_PARTS if part in text]
        assert not leaked, f"{leaked} shown in {text!r}"


def test_a_failing_webhook_is_named_without_its_secret_parts(
        db: Database, clock: FakeClock, receiver: Receiver,
        caplog: pytest.LogCaptureFixture) -> None:
    port = receiver.server.server_address[1]
    receiver.statuses = [500] * 2
    alerts = alerts_for(db, clock, secret_url(port), retries=1)
    with caplog.at_level("WARNING", logger="appliance.health.alerts"):
        publish(alerts, changes({}, [HOT], clock.now()))
        publish(alerts, changes({HOT.id: Level.CRITICAL}, [COOL], clock.now()))

    assert len(receiver.bodies) == 3  # it was the real receiver that failed, then took one
    messages = [e.message for e in health_events(db)]
    failed = [m for m in messages if "could not be delivered" in m]
    back = [m for m in messages if "accepts alerts again" in m]
    assert failed and back
    assert f"http://127.0.0.1:{port}/***" in failed[0]  # which webhook: scheme, host, port
    assert_no_secret(messages + [json.dumps(e.detail) for e in health_events(db)])
    logged = [r.getMessage() for r in caplog.records]
    assert any("not delivered" in line for line in logged)
    assert_no_secret(logged)


def test_an_unreachable_webhook_is_named_without_its_secret_parts(
        db: Database, clock: FakeClock, caplog: pytest.LogCaptureFixture) -> None:
    port = free_port()  # nothing listens there: the transport's own error is shown
    with caplog.at_level("WARNING", logger="appliance.health.alerts"):
        publish(alerts_for(db, clock, secret_url(port), retries=0),
                changes({}, [HOT], clock.now()))
    (failure,) = [e.message for e in health_events(db) if "could not be delivered" in e.message]
    assert "ConnectError" in failure and f"127.0.0.1:{port}/***" in failure
    assert_no_secret([failure] + [r.getMessage() for r in caplog.records])
