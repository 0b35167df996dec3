"""The control plane's Prometheus exposition (`appliance.health.metrics_out`, `metrics_gpu`,
`metrics_route`) and the Grafana dashboard built on it.

Pure tests build `MetricsInputs` from the shipped fake GPUs and hand-built health values and
parse the text with prometheus_client's own parser. The route is served over a real runtime
(migrated SQLite, fake GPUs, fake clock): first as the only handler of a small Litestar app,
then through `create_app` on loopback, public and behind an admin API token.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from litestar import Litestar
from litestar.testing import TestClient
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from appliance import __version__
from appliance.auth.accounts import list_admins
from appliance.auth.tokens import create_token
from appliance.config import Config
from appliance.db.database import Database
from appliance.engine.states import EngineState
from appliance.gateway.usage import UsageRecord, write_batch
from appliance.gpu.port import GpuSnapshot
from appliance.health.metrics_out import (
    InputsCollector,
    MetricsInputs,
    UsageFigures,
    WeightsFigures,
)
from appliance.health.metrics_route import CONTENT_TYPE, metrics_handler, usage_since
from appliance.health.model import (
    CanaryResult,
    CheckResult,
    EngineFigures,
    HealthSnapshot,
    HostFigures,
    Level,
)
from appliance.runtime import Runtime, build_runtime
from appliance.testing.clock import FakeClock
from appliance.testing.fake_gpus import FakeGpus
from appliance.weights.views import Activity
from tests.conftest import REPO, LiveServer, add_admin, make_config
from tests.test_health_host import roomy_host

NOW = dt.datetime(2026, 11, 30, 12, 0, tzinfo=dt.UTC)
GIB = 1 << 30
DASHBOARD = REPO / "deploy" / "grafana" / "appliance-dashboard.json"


Families = dict[str, list[Sample]]


# --- helpers ---------------------------------------------------------------------------------


def engine_figures(**changes: Any) -> EngineFigures:
    figures = EngineFigures(
        at=NOW, state="ready", ready=True, running_requests=12, queued_requests=3,
        token_usage=0.42, state_usage=0.2, cache_hit_rate=0.61, generation_tokens_per_second=1850.0,
        ttft_p50_seconds=0.35, ttft_p90_seconds=1.2,
        canary=CanaryResult(at=NOW, ok=True, ttft_seconds=0.2,
                            decode_tokens_per_second=55.0))
    return dataclasses.replace(figures, **changes)


def host_figures() -> HostFigures:
    return roomy_host(NOW, shm_free_bytes=None, shm_total_bytes=None, load1=10.5)


CHECKS = (
    CheckResult("gpu.nvml", "gpu", "NVML", Level.OK, "NVML answers"),
    CheckResult("gpu.3.temperature", "gpu", "GPU 3 temperature", Level.WARN, "GPU 3 is hot",
                "check the airflow"),
    CheckResult("host.models_disk", "host", "Models disk", Level.CRITICAL, "almost full",
                "free space"),
    CheckResult("engine.ready", "engine", "Engine ready", Level.OK, "ready"),
)


def snapshot(gpus: GpuSnapshot | None = None, **changes: Any) -> HealthSnapshot:
    base = HealthSnapshot(at=NOW, results=CHECKS, gpus=gpus or FakeGpus().snapshot(),
                          engine=engine_figures(), host=host_figures())
    return dataclasses.replace(base, **changes)


def inputs(health: HealthSnapshot | None = None, **changes: Any) -> MetricsInputs:
    base = MetricsInputs(
        version="1.2.3", started_at=NOW - dt.timedelta(hours=1), gpus_expected=8,
        health=health if health is not None else snapshot(), engine_state=EngineState.READY,
        weights=WeightsFigures(activity="idle", ready=True, total_bytes=1000,
                               done_bytes=1000, verified_bytes=900, rate_bytes_per_second=0.0),
        usage=UsageFigures(3600.0, {"ok": 5, "queue_timeout": 1},
                           {"prompt": 900, "completion": 100, "cached": 400}))
    return dataclasses.replace(base, **changes)


def render(metrics: MetricsInputs) -> str:
    registry = CollectorRegistry()
    registry.register(InputsCollector(lambda: metrics))
    return generate_latest(registry).decode()


def parse(text: str) -> Families:
    return {family.name: list(family.samples) for family in text_string_to_metric_families(text)}


def scrape(metrics: MetricsInputs) -> Families:
    return parse(render(metrics))


def by_gpu(samples: list[Sample]) -> dict[str, float]:
    return {s.labels["gpu"]: s.value for s in samples}


def value(families: Families, name: str, **labels: str) -> float:
    found = [s.value for s in families[name] if all(s.labels.get(k) == v
                                                    for k, v in labels.items())]
    assert len(found) == 1, (name, labels, families.get(name))
    return found[0]


def values(families: Families, expected: dict[str, float]) -> dict[str, float]:
    """The value of each series `expected` names (one sample each), to compare with it."""
    return {name: value(families, name) for name in expected}


# --- the exposition --------------------------------------------------------------------------


def test_exposition_parses_with_help_base_units_and_no_counters() -> None:
    text = render(inputs())
    families = list(text_string_to_metric_families(text))
    assert len(families) > 40
    for family in families:
        assert family.name.startswith("appliance_"), family.name
        assert family.type == "gauge", family.name
        assert family.documentation.strip(), f"{family.name} has no HELP"
        assert not family.name.endswith("_total"), family.name
        assert family.samples, f"{family.name} is exported with no sample"
    parsed = parse(text)
    assert value(parsed, "appliance_build_info", version="1.2.3") == 1
    assert value(parsed, "appliance_daemon_start_time_seconds") == (NOW.timestamp() - 3600)


def test_every_gpu_has_its_series_labelled_by_index_and_uuid() -> None:
    gpus = FakeGpus()
    gpus.set_fields(5, temperature_c=71.5, power_w=880.0, utilization_pct=93.0)
    gpus.set_memory_used(5, 200 * GIB)
    families = scrape(inputs(snapshot(gpus.snapshot())))
    expected = {str(i): f"GPU-fa4e0000-b300-4000-8000-{i:012x}" for i in range(8)}
    for name in ("appliance_gpu_temperature_celsius", "appliance_gpu_power_watts",
                 "appliance_gpu_power_limit_watts", "appliance_gpu_utilization_ratio",
                 "appliance_gpu_memory_used_bytes", "appliance_gpu_memory_total_bytes",
                 "appliance_gpu_ecc_uncorrectable_errors", "appliance_gpu_nvlink_up_links"):
        samples = families[name]
        assert {s.labels["gpu"]: s.labels["uuid"] for s in samples} == expected, name
        assert all(set(s.labels) == {"gpu", "uuid"} for s in samples), name
    assert by_gpu(families["appliance_gpu_up"]) == {str(i): 1.0 for i in range(8)}
    assert value(families, "appliance_gpu_temperature_celsius", gpu="5") == 71.5
    assert value(families, "appliance_gpu_power_watts", gpu="5") == 880.0
    assert value(families, "appliance_gpu_utilization_ratio", gpu="5") == pytest.approx(0.93)
    assert value(families, "appliance_gpu_utilization_ratio", gpu="0") == 0.0
    assert value(families, "appliance_gpu_memory_used_bytes", gpu="5") == 200 * GIB
    assert value(families, "appliance_nvml_up") == 1
    assert value(families, "appliance_gpus_expected") == 8
    assert value(families, "appliance_gpu_driver_info", driver_version="580.95.05",
                 cuda_version="13.0") == 1


def test_lost_gpu_is_down_and_has_no_telemetry() -> None:
    gpus = FakeGpus()
    gpus.lose_gpu(3)
    families = scrape(inputs(snapshot(gpus.snapshot())))
    up = by_gpu(families["appliance_gpu_up"])
    assert up == {**{str(i): 1.0 for i in range(8)}, "3": 0.0}
    for name, samples in families.items():
        if name != "appliance_gpu_up":
            assert all(s.labels.get("gpu") != "3" for s in samples), name
    assert len(families["appliance_gpu_temperature_celsius"]) == 7
    assert value(families, "appliance_nvml_up") == 1


def test_nvml_down_says_so_and_exports_no_gpu_series() -> None:
    gpus = FakeGpus()
    gpus.fail()
    families = scrape(inputs(snapshot(gpus.snapshot())))
    assert value(families, "appliance_nvml_up") == 0
    assert value(families, "appliance_gpus_expected") == 8
    assert not [n for n in families if n.startswith("appliance_gpu_")]


def test_nothing_polled_yet_is_left_out_not_reported_as_ok() -> None:
    families = scrape(inputs(HealthSnapshot(at=None), weights=None, usage=None))
    assert "appliance_nvml_up" not in families
    assert "appliance_health_status" not in families
    assert "appliance_health_check_status" not in families
    assert "appliance_engine_running_requests" not in families
    assert "appliance_weights_state" not in families
    assert "appliance_usage_requests_last_hour" not in families
    assert value(families, "appliance_gpus_expected") == 8
    assert value(families, "appliance_engine_state", state="ready") == 1


def test_check_levels_mutes_and_overall_status() -> None:
    families = scrape(inputs(snapshot()))
    status = {(s.labels["check"], s.labels["group"]): s.value
              for s in families["appliance_health_check_status"]}
    assert status == {("gpu.nvml", "gpu"): 0, ("gpu.3.temperature", "gpu"): 1,
                      ("host.models_disk", "host"): 2, ("engine.ready", "engine"): 0}
    assert {s.value for s in families["appliance_health_check_muted"]} == {0}
    assert value(families, "appliance_health_status") == 2
    assert value(families, "appliance_health_updated_timestamp_seconds") == NOW.timestamp()

    muted = scrape(inputs(snapshot(muted=frozenset({"host.models_disk"}))))
    assert value(muted, "appliance_health_check_muted", check="host.models_disk") == 1
    assert value(muted, "appliance_health_check_muted", check="gpu.3.temperature") == 0
    # still exported at its level, but no longer counted in the overall status
    assert value(muted, "appliance_health_check_status", check="host.models_disk") == 2
    assert value(muted, "appliance_health_status") == 1


@pytest.mark.parametrize("state", list(EngineState))
def test_engine_state_enum_has_exactly_one_current_value(state: EngineState) -> None:
    samples = scrape(inputs(engine_state=state))["appliance_engine_state"]
    assert {s.labels["state"] for s in samples} == {s.value for s in EngineState}
    assert [s.labels["state"] for s in samples if s.value == 1] == [state.value]
    assert sum(s.value for s in samples) == 1


def test_engine_figures_and_unknown_figures_left_out() -> None:
    families = scrape(inputs(load_percent=37.5, eta_seconds=3100.0,
                             engine_state=EngineState.LOADING_WEIGHTS))
    expected = {
        "appliance_engine_load_progress_ratio": 0.375, "appliance_engine_eta_seconds": 3100,
        "appliance_engine_ready": 1, "appliance_engine_running_requests": 12,
        "appliance_engine_queued_requests": 3, "appliance_engine_token_usage_ratio": 0.42,
        "appliance_engine_state_usage_ratio": 0.2,
        "appliance_engine_cache_hit_ratio": 0.61,
        "appliance_engine_generation_tokens_per_second": 1850,
        "appliance_engine_canary_ok": 1, "appliance_engine_canary_ttft_seconds": 0.2,
    }
    assert values(families, expected) == expected
    assert value(families, "appliance_engine_ttft_seconds", quantile="0.5") == 0.35
    assert value(families, "appliance_engine_ttft_seconds", quantile="0.9") == 1.2

    sparse = snapshot(engine=engine_figures(running_requests=None, ttft_p90_seconds=None,
                                            ready=None, canary=None))
    families = scrape(inputs(sparse))
    for absent in ("appliance_engine_load_progress_ratio", "appliance_engine_eta_seconds",
                   "appliance_engine_running_requests", "appliance_engine_ready",
                   "appliance_engine_canary_ok"):
        assert absent not in families, absent
    assert [s.labels["quantile"] for s in families["appliance_engine_ttft_seconds"]] == ["0.5"]


def test_gpu_health_series_ecc_remap_nvlink_xid_throttle_fabric() -> None:
    gpus = FakeGpus()
    gpus.add_ecc_errors(2, uncorrectable=3, correctable=7)
    gpus.set_fields(4, nvlink_up=16, remap_pending=True,
                    throttle_reasons=("hw_thermal", "sw_thermal"), fabric_state="in_progress",
                    fabric_error="NVLink training failed")
    gpus.add_xid(6, 48, at=NOW - dt.timedelta(minutes=9))
    gpus.add_xid(6, 79, at=NOW - dt.timedelta(minutes=2))
    gpus.set_fields(7, temperature_c=None)
    families = scrape(inputs(snapshot(gpus.snapshot())))
    assert value(families, "appliance_gpu_ecc_uncorrectable_errors", gpu="2") == 3
    assert value(families, "appliance_gpu_ecc_uncorrectable_errors_lifetime", gpu="2") == 3
    assert value(families, "appliance_gpu_ecc_correctable_errors", gpu="2") == 7
    assert value(families, "appliance_gpu_ecc_uncorrectable_errors", gpu="0") == 0
    links = by_gpu(families["appliance_gpu_nvlink_up_links"])
    total = by_gpu(families["appliance_gpu_nvlink_links"])
    assert links["4"] == 16 and links["0"] == total["0"] == total["4"] > 16
    assert value(families, "appliance_gpu_row_remap_pending", gpu="4") == 1
    assert value(families, "appliance_gpu_row_remap_pending", gpu="0") == 0
    throttled = {s.labels["reason"]: s.value for s in families["appliance_gpu_clocks_throttled"]
                 if s.labels["gpu"] == "4"}
    assert len(throttled) == 9 and {r for r, v in throttled.items() if v} == {
        "hw_thermal", "sw_thermal"}
    fabric = {s.labels["state"]: s.value for s in families["appliance_gpu_fabric_state"]
              if s.labels["gpu"] == "4"}
    assert fabric == {"not_started": 0, "in_progress": 1, "completed": 0}
    assert value(families, "appliance_gpu_fabric_error", gpu="4") == 1
    assert value(families, "appliance_gpu_fabric_error", gpu="0") == 0
    assert value(families, "appliance_gpu_xid_errors_last_hour", gpu="6") == 2
    assert value(families, "appliance_gpu_last_xid", gpu="6") == 79
    assert value(families, "appliance_gpu_xid_errors_last_hour", gpu="0") == 0
    assert "0" not in by_gpu(families["appliance_gpu_last_xid"])
    # a reading the driver did not give is left out, not sent as 0
    assert "7" not in by_gpu(families["appliance_gpu_temperature_celsius"])


def test_host_weights_and_usage_figures() -> None:
    families = scrape(inputs(weights=WeightsFigures(
        activity="downloading", ready=False, total_bytes=1000, done_bytes=400,
        verified_bytes=300, rate_bytes_per_second=25.0)))
    free = {s.labels["volume"]: s.value for s in families["appliance_host_volume_free_bytes"]}
    assert free == {"models": 2000 * GIB, "state": 50 * GIB}  # shm unknown: left out
    expected = {
        "appliance_host_memory_available_bytes": 2000 * GIB, "appliance_host_load1": 10.5,
        "appliance_daemon_resident_memory_bytes": 300 << 20, "appliance_weights_ready": 0,
        "appliance_weights_verified_bytes": 300, "appliance_weights_present_bytes": 400,
        "appliance_weights_size_bytes": 1000,
    }
    assert values(families, expected) == expected
    states = {s.labels["state"]: s.value for s in families["appliance_weights_state"]}
    assert set(states) == {a.value for a in Activity}
    assert [k for k, v in states.items() if v] == ["downloading"]
    assert value(families, "appliance_usage_requests_last_hour", outcome="ok") == 5
    assert value(families, "appliance_usage_requests_last_hour", outcome="queue_timeout") == 1
    assert value(families, "appliance_usage_tokens_last_hour", kind="cached") == 400


# --- the usage figures from the database ----------------------------------------------------


def usage(key_id: int | None, started: dt.datetime, outcome: str = "ok", prompt: int = 1000,
          completion: int = 100, cached: int = 0) -> UsageRecord:
    status = 200 if outcome == "ok" else 429
    return UsageRecord(key_id, "kimi-k3", "chat", True, status, outcome, prompt, completion,
                       cached, started, started + dt.timedelta(seconds=2), 1.0, 300.0, 2000.0)


def seed_usage(db: Database, now: dt.datetime) -> None:
    db.call(lambda s: write_batch(s, [
        usage(1, now - dt.timedelta(minutes=5), cached=600),
        usage(1, now - dt.timedelta(minutes=50), prompt=500, completion=50),
        usage(2, now - dt.timedelta(minutes=20), "queue_timeout", prompt=0, completion=0),
        usage(None, now - dt.timedelta(minutes=59), "unauthorized", prompt=0, completion=0),
        usage(1, now - dt.timedelta(minutes=61), prompt=9999),  # outside the hour
        usage(1, now - dt.timedelta(days=2), prompt=9999),
    ]))


def test_usage_since_counts_the_last_hour_by_outcome(db: Database) -> None:
    seed_usage(db, NOW)
    figures = db.call(lambda s: usage_since(s, NOW - dt.timedelta(hours=1), 3600.0))
    assert dict(figures.requests) == {"ok": 2, "queue_timeout": 1, "unauthorized": 1}
    assert dict(figures.tokens) == {"prompt": 1500, "completion": 150, "cached": 600}
    empty = db.call(lambda s: usage_since(s, NOW + dt.timedelta(hours=1), 3600.0))
    assert dict(empty.requests) == {}
    assert dict(empty.tokens) == {"prompt": 0, "completion": 0, "cached": 0}


# --- the route -------------------------------------------------------------------------------


@pytest.fixture
def gpus() -> FakeGpus:
    return FakeGpus()


@pytest.fixture
def runtime(config: Config, db: Database, clock: FakeClock, gpus: FakeGpus) -> Runtime:
    return build_runtime(config, clock=clock, db=db, gpus=gpus)


@pytest.fixture
def client(runtime: Runtime) -> Iterator[TestClient[Litestar]]:
    app = Litestar(route_handlers=[metrics_handler()])
    app.state.runtime = runtime
    with TestClient(app) as test_client:
        yield test_client


def test_route_serves_the_exposition_and_caches_database_figures(
        runtime: Runtime, client: TestClient[Litestar], clock: FakeClock) -> None:
    seed_usage(runtime.db, clock.now())
    response = client.get("/metrics")
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == CONTENT_TYPE
    assert response.headers["cache-control"] == "no-store"
    families = parse(response.text)
    assert value(families, "appliance_build_info", version=__version__) == 1
    assert value(families, "appliance_engine_state", state="stopped") == 1
    assert value(families, "appliance_gpus_expected") == 8
    assert value(families, "appliance_weights_state", state="idle") == 1
    assert value(families, "appliance_weights_size_bytes") == 0  # no set yet
    assert value(families, "appliance_usage_requests_last_hour", outcome="ok") == 2

    # the database figures are read at most every 10 s (on the runtime's clock)
    seed_usage(runtime.db, clock.now())
    again = parse(client.get("/metrics").text)
    assert value(again, "appliance_usage_requests_last_hour", outcome="ok") == 2
    clock.advance(11)
    later = parse(client.get("/metrics").text)
    assert value(later, "appliance_usage_requests_last_hour", outcome="ok") == 4


def test_route_exports_the_monitors_snapshot(
        runtime: Runtime, client: TestClient[Litestar], gpus: FakeGpus) -> None:
    gpus.lose_gpu(3)
    gpus.set_fields(0, temperature_c=95.0)
    asyncio.run(runtime.health.check_gpus())
    families = parse(client.get("/metrics").text)
    assert value(families, "appliance_nvml_up") == 1
    assert by_gpu(families["appliance_gpu_up"]) == {**{str(i): 1.0 for i in range(8)},
                                                    "3": 0.0}
    assert value(families, "appliance_gpu_temperature_celsius", gpu="0") == 95.0
    failing = {s.labels["check"] for s in families["appliance_health_check_status"] if s.value}
    assert failing, "a lost GPU and a GPU at 95 °C fail some check"
    assert all(s.labels["group"] == "gpu" for s in families["appliance_health_check_status"])
    assert value(families, "appliance_health_status") == 2


# --- through create_app, over real HTTP (conftest's `server` over this module's runtime) ------


def test_metrics_public_by_default(server: LiveServer) -> None:
    response = httpx.get(f"{server.base_url}/metrics", timeout=10)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == CONTENT_TYPE
    assert "appliance_engine_state" in parse(response.text)


@pytest.fixture
def private_box(tmp_path: Path, clock: FakeClock) -> Iterator[LiveServer]:
    from appliance.db.schema import migrate
    from appliance.resources import migrations_dir

    config = make_config(tmp_path / "private", APPLIANCE_HEALTH_METRICS_PUBLIC="false")
    db = Database(config.database_url)
    migrate(db, migrations_dir(), config.paths.state_dir / "backups", clock.now())
    runtime = build_runtime(config, clock=clock, db=db, gpus=FakeGpus())
    server = LiveServer(runtime).start()
    yield server
    server.stop()
    db.dispose()


def test_private_metrics_need_an_admin_api_token(private_box: LiveServer) -> None:
    runtime = private_box.runtime
    add_admin(runtime)
    now = runtime.clock.now()
    token, _ = runtime.db.call(lambda s: create_token(s, runtime.secret, list_admins(s)[0],
                                                      "prometheus", now))
    url = f"{private_box.base_url}/metrics"
    refused = httpx.get(url, timeout=10)
    assert refused.status_code == 401, refused.text
    assert refused.headers["www-authenticate"].startswith("Bearer")  # not a login page
    wrong = httpx.get(url, headers={"Authorization": "Bearer apt_nope_nope"}, timeout=10)
    assert wrong.status_code == 401, wrong.text
    allowed = httpx.get(url, headers={"Authorization": f"Bearer {token}"}, timeout=10)
    assert allowed.status_code == 200, allowed.text
    assert "appliance_build_info" in parse(allowed.text)


# --- the Grafana dashboard --------------------------------------------------------------------


def exprs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for key, item in node.items():
            if key in ("expr", "definition") and isinstance(item, str):
                yield item
            elif key == "query" and isinstance(item, str | dict):
                yield from ([item] if isinstance(item, str) else exprs(item))
            else:
                yield from exprs(item)
    elif isinstance(node, list):
        for item in node:
            yield from exprs(item)


def exported_names() -> set[str]:
    """Every metric name the exposition can produce (all inputs filled in, one GPU lost)."""
    gpus = FakeGpus()
    gpus.lose_gpu(1)
    gpus.add_xid(0, 79, at=NOW)
    gpus.set_fields(0, fabric_error="failed")
    return set(scrape(inputs(snapshot(gpus.snapshot()), load_percent=10.0, eta_seconds=60.0)))


def test_dashboard_queries_only_metrics_the_exposition_produces() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["schemaVersion"] >= 39
    assert [i["name"] for i in dashboard["__inputs"]] == ["DS_PROMETHEUS"]
    found = list(exprs(dashboard))
    assert len(found) > 30
    used = {name for expr in found for name in re.findall(r"appliance_[a-z0-9_]+", expr)}
    exported = exported_names()
    assert used - exported == set()
    for wanted in ("appliance_health_status", "appliance_health_check_status",
                   "appliance_gpu_temperature_celsius", "appliance_gpu_power_watts",
                   "appliance_gpu_utilization_ratio", "appliance_gpu_memory_used_bytes",
                   "appliance_gpu_ecc_uncorrectable_errors", "appliance_gpu_nvlink_up_links",
                   "appliance_engine_state", "appliance_engine_load_progress_ratio",
                   "appliance_engine_running_requests", "appliance_engine_queued_requests",
                   "appliance_engine_token_usage_ratio",
                   "appliance_engine_generation_tokens_per_second",
                   "appliance_engine_ttft_seconds", "appliance_engine_cache_hit_ratio",
                   "appliance_host_volume_free_bytes", "appliance_usage_requests_last_hour",
                   "appliance_usage_tokens_last_hour"):
        assert wanted in used, f"the dashboard has no panel for {wanted}"
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"] == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
            assert panel["targets"], panel["title"]
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
