"""The demo's fake GPUs are as busy as the engine is (issue 23: 52 to 89 % utilisation and
715 to 959 W with "0 running, 0 queued"): full pools with nothing running read idle, a running
share reads busy, a queue reads full; the load comes from the engine's own `/metrics`, served
here by a real HTTP server on loopback.
"""

from __future__ import annotations

import http.server
import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from appliance.testing.clock import FakeClock
from appliance.testing.fake_gpus import FakeGpus, metrics_activity

GIB = 1 << 30
HELD = 250 * GIB  # full pools, as while serving


def held_by_me(path: Path, gpus: int = 2) -> Path:
    """The emulator's state file: `gpus` GPUs holding full pools for this (live) process."""
    path.write_text(json.dumps({"updated": time.time(), "gpus": [
        {"index": i, "memory_used_bytes": HELD,
         "processes": [{"pid": os.getpid(), "used_bytes": HELD, "name": f"TP{i}"}]}
        for i in range(gpus)]}), encoding="utf-8")
    return path


class Metrics:
    """A loopback `/metrics` answering `text` (changeable)."""

    def __init__(self) -> None:
        self.text = ""
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = owner.text.encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/metrics"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def set(self, running_share: float, queued: int) -> None:
        labels = '{model_name="k3",tp_rank="0"}'
        self.text = (f"# TYPE sglang:utilization gauge\nsglang:utilization{labels} "
                     f"{running_share}\n# TYPE sglang:num_queue_reqs gauge\n"
                     f"sglang:num_queue_reqs{labels} {float(queued)}\n")

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def metrics() -> Iterator[Metrics]:
    served = Metrics()
    yield served
    served.close()


def test_full_pools_with_nothing_running_read_idle_and_load_reads_busy(
        tmp_path: Path, metrics: Metrics) -> None:
    fake = FakeGpus(state_file=held_by_me(tmp_path / "gpus.json"), clock=FakeClock(),
                    activity=metrics_activity(metrics.url))
    metrics.set(0.0, 0)  # "0 running, 0 queued"
    for gpu in fake.snapshot().gpus[:2]:
        assert gpu.memory_used_bytes == HELD  # the memory is still held
        assert (gpu.utilization_pct, gpu.power_w, gpu.temperature_c) == (0.0, 190.0, 34.0)
        assert gpu.throttle_reasons == ("gpu_idle",)

    metrics.set(0.25, 0)  # a quarter of max_running_requests
    some = fake.snapshot().gpus[0]
    assert some.utilization_pct is not None and 0 < some.utilization_pct < 95
    assert some.power_w is not None and some.power_w > 190.0

    metrics.set(0.5, 7)  # requests queue: the engine is at its limit
    full = fake.snapshot().gpus[0]
    assert full.utilization_pct is not None and some.utilization_pct < full.utilization_pct
    assert full.power_w is not None and 650 <= full.power_w <= 1000


def test_an_engine_that_does_not_answer_reads_idle(tmp_path: Path, metrics: Metrics) -> None:
    url = metrics.url
    metrics.close()  # nothing listens there now
    fake = FakeGpus(state_file=held_by_me(tmp_path / "gpus.json"),
                    activity=metrics_activity(url, timeout=5.0))
    gpu = fake.snapshot().gpus[0]
    assert (gpu.utilization_pct, gpu.power_w) == (0.0, 190.0)


def test_nonsense_metrics_read_idle(tmp_path: Path, metrics: Metrics) -> None:
    metrics.text = "sglang:utilization{tp_rank=\"0\"} not-a-number\n"
    assert metrics_activity(metrics.url)() == 0.0
    metrics.text = "<html>not metrics</html>"
    assert metrics_activity(metrics.url)() == 0.0
