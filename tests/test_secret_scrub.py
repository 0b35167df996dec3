"""Secrets the first redaction pass missed (issue 22 follow-ups): the key a head's hand-over
replaced, which the daemon never holds in memory, comes out of the engine log the API shows.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from appliance.cell.engine_key import previous_key_path
from appliance.clock import SystemClock
from appliance.config import Config
from appliance.db.database import Database
from appliance.engine.logsecrets import MARK
from appliance.runtime import build_runtime
from appliance.secrets import write_private
from appliance.testing.fake_gpus import FakeGpus
from tests.conftest import Console, make_config
from tests.test_engine_log_secrets import adopted_daemon, startup_log

PREVIOUS = "previous-engine-key-0123456789abcdefghij"  # shaped as ENGINE_KEY_RE wants


@pytest.fixture
def config(tmp_path: Path) -> Config:
    return make_config(tmp_path / "appliance")


@pytest.fixture
def viewer(config: Config, db: Database) -> Iterator[Console]:
    """A viewer of a daemon whose adopted engine started before a hand-over: its log holds the
    replaced key, now only in `engine-api.key.previous`; the daemon holds the new one."""
    boot = build_runtime(config, clock=SystemClock(), db=db, gpus=FakeGpus())
    assert boot.engine_keys.current and boot.engine_keys.current != PREVIOUS
    write_private(previous_key_path(config.paths.state_dir), PREVIOUS.encode() + b"\n")
    with adopted_daemon(config, db, startup_log(PREVIOUS)) as (server, runtime):
        assert PREVIOUS not in (runtime.engine_keys.current, runtime.engine_keys.accepted)
        console = Console(server.base_url)
        try:
            assert console.login("vera").status_code == 303
            yield console
        finally:
            console.close()


def test_the_key_a_handover_replaced_is_redacted_by_value(viewer: Console) -> None:
    answer = viewer.http.get("/api/v1/engine/log", params={"lines": 50})
    assert answer.status_code == 200, answer.text
    assert PREVIOUS not in answer.text
    # the line that names the key where no field name says so
    assert f"[2026-12-02 05:01:04] config file read: {MARK} (from --config)" in (
        answer.json()["lines"])
    status = viewer.http.get("/api/v1/engine")
    assert status.status_code == 200 and PREVIOUS not in status.text
