"""The control plane publishes the engine's state for the gateway: coalesced, newest wins."""

from __future__ import annotations

import asyncio

from appliance.db.database import Database
from appliance.engine.publish import StatusPublisher, read_published
from appliance.engine.states import EngineState
from appliance.engine.supervisor import EngineStatus
from appliance.testing.clock import FakeClock


def test_changes_are_written_coalesced_and_the_newest_wins(db: Database,
                                                            clock: FakeClock) -> None:
    async def scenario() -> None:
        publisher = StatusPublisher(db, clock, interval=0.05)
        assert db.call(read_published) is None
        publisher.listen(EngineStatus(state=EngineState.LOADING_WEIGHTS, message="10%",
                                      eta_seconds=3600.4))
        for percent in range(11, 60):  # a moving bar: many changes, few writes
            publisher.listen(EngineStatus(state=EngineState.LOADING_WEIGHTS,
                                          message=f"{percent}%", eta_seconds=1800.0))
        for _ in range(500):  # the 0.05 s tick writes the latest; a loaded box may lag
            published = db.call(read_published)
            if published is not None and published.message == "59%":
                break
            await asyncio.sleep(0.02)
        published = db.call(read_published)
        assert published is not None
        assert (published.state, published.message, published.eta_seconds) == \
            ("loading_weights", "59%", 1800.0)
        assert not published.admits_requests
        publisher.listen(EngineStatus(state=EngineState.READY, message="serving"))
        await publisher.stop()  # the daemon stopping writes what is pending
        final = db.call(read_published)
        assert final is not None and final.state == "ready" and final.admits_requests

    asyncio.run(scenario())


def test_the_runtime_wires_the_publisher_to_the_supervisor(runtime: object) -> None:
    from appliance.runtime import Runtime

    assert isinstance(runtime, Runtime)
    assert runtime.publisher.listen in runtime.supervisor._listeners
