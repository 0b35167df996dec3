"""The decode-floor guard through the real gateway (issue 24), in front of the engine emulator
on loopback: while an interactive stream runs under its class's floor, a batch request that
finds a slot free (under the limit and under batch's share) waits in the queue instead of
starting, the gateway's log says why, and once the slow stream ends the batch request is
served. Interactive work still starts at once.

The interactive floor (1,000 tokens/s) is above what the emulator streams (50/s), so every
interactive stream is under it once judged (16 tokens). No timed assertions: every wait is on
a state (the stream's own tokens, the queue's depth, the answer).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from appliance.config import Config
from tests.conftest import make_config, wait_for
from tests.gateway_rig import LiveGateway, auth, chat_body

# the engine at 50 tokens/s a stream, and a key of a class
from tests.test_gateway_slo_live import class_key, gateway_engine  # noqa: F401

CLASSES = {"interactive": {"decode_floor_tps": 1000},  # faster than the engine streams
           "batch": {"deadline_seconds": 120, "share": 0.5}}


@pytest.fixture
def config(tmp_path: Path) -> Config:
    return make_config(tmp_path / "appliance", APPLIANCE_GATEWAY_MAX_CONCURRENCY="4",
                       APPLIANCE_GATEWAY_CLASSES=json.dumps(CLASSES))


def read_events(lines: Iterator[str], count: int) -> None:
    seen = 0
    while seen < count:
        seen += next(lines).startswith("data:")


def test_a_slow_interactive_stream_holds_batch_back_until_it_ends(
        gateway: LiveGateway, caplog: pytest.LogCaptureFixture) -> None:
    interactive = class_key(gateway, "people", "interactive")
    batch = class_key(gateway, "nightly", "batch")
    url = f"{gateway.url}/v1/chat/completions"
    admission = gateway.parts.admission
    answer: list[httpx.Response] = []
    caplog.set_level("INFO", "appliance.gateway.class_gate")
    with httpx.stream("POST", url, headers=auth(batch), timeout=120,
                      json=chat_body("long batch", max_tokens=5000, ignore_eos=True,
                                     stream=True)) as running_batch:
        batch_lines = running_batch.iter_lines()  # kept: a generator dropped closes the stream
        read_events(batch_lines, 1)  # batch is running: nothing held it
        with httpx.stream("POST", url, headers=auth(interactive), timeout=120,
                          json=chat_body("a person", max_tokens=5000, ignore_eos=True,
                                         stream=True)) as slow:
            slow_lines = slow.iter_lines()  # kept, as batch_lines
            read_events(slow_lines, 20)  # judged: about 50 tokens/s, under 1,000
            assert admission.in_use == 2 and admission.group_use["batch"] == 1

            waiter = threading.Thread(target=lambda: answer.append(httpx.post(
                url, headers=auth(batch), timeout=120, json=chat_body("later", max_tokens=5))))
            waiter.start()
            # two slots free, one of them batch's own: held by the guard, not by a limit
            wait_for(lambda: admission.waiting == 1, "the batch request to be held")
            assert admission.in_use == 2 and not answer
            assert any("holding back work of priority 0 and below: a stream of the "
                       "interactive class runs at" in r.getMessage() for r in caplog.records)

            # interactive work still starts at once
            quick = httpx.post(url, headers=auth(interactive), timeout=30,
                               json=chat_body("quick", max_tokens=3))
            assert quick.status_code == 200, quick.text
            assert admission.waiting == 1
        # the slow stream closed: its release finds nobody under the floor
        waiter.join(timeout=120)
        assert answer and answer[0].status_code == 200, answer
        assert answer[0].json()["choices"][0]["message"]["content"]
        assert admission.waiting == 0
    assert any("no longer holding back" in r.getMessage() for r in caplog.records)
