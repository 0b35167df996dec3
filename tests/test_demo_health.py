"""The demo's health instruments: the hot-GPU episode turns a warning on and off, and the
webhook sink records what the monitor's alert sender posts."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from appliance.config import GpuConfig
from appliance.health.gpu_checks import gpu_checks
from appliance.health.model import Level
from appliance.testing.demo_health import HOT_GPU, hot_gpu_episode, webhook_sink
from appliance.testing.fake_gpus import FakeGpus


def _temperature_level(gpus: FakeGpus) -> Level:
    results = gpu_checks(gpus.snapshot(), GpuConfig(), None, None)
    (result,) = [r for r in results if r.id == f"gpu.{HOT_GPU}.temperature"]
    return result.level


def _wait(check: Callable[[], bool], what: str) -> None:
    end = time.monotonic() + 30
    while not check():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_the_hot_gpu_episode_warns_then_recovers() -> None:
    gpus = FakeGpus()
    assert _temperature_level(gpus) is Level.OK
    with hot_gpu_episode(gpus, after_seconds=0.05, lasts_seconds=0.3):
        _wait(lambda: _temperature_level(gpus) is Level.WARN, "the warning")
        _wait(lambda: _temperature_level(gpus) is Level.OK, "the recovery")


def test_the_webhook_sink_appends_each_alert(tmp_path: Path) -> None:
    path = tmp_path / "alerts.jsonl"
    with webhook_sink(path) as url:
        for level in ("warn", "ok"):
            reply = httpx.post(url, json={"check": "gpu.5.temperature", "level": level})
            assert reply.status_code == 204
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["level"] for line in lines] == ["warn", "ok"]
