"""Host readings and checks: `read_host` on real temporary paths (one of them missing), and
`host_checks` on hand-built readings at and around every threshold; `disk_space`, which the
daemon's status shares. `roomy_host` is shared with the other health tests."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
from pathlib import Path
from typing import Any

import psutil

from appliance.config import Config, HealthConfig, PathsConfig
from appliance.db.database import Database
from appliance.health.host_checks import GIB, MIB, host_checks, read_host
from appliance.health.model import HostFigures, Level
from appliance.runtime import build_runtime
from appliance.status import daemon_status
from appliance.testing.clock import FakeClock
from appliance.volumes import disk_space

NOW = dt.datetime(2026, 11, 30, 12, 0, tzinfo=dt.UTC)
HEALTH = HealthConfig()


def make_paths(tmp_path: Path, models: str = "models") -> PathsConfig:
    return PathsConfig(state_dir=tmp_path / "state", models_dir=tmp_path / models,
                       log_dir=tmp_path / "logs")


def roomy_host(now: dt.datetime = NOW, **changes: Any) -> HostFigures:
    """A host with room everywhere (every host check OK) at `now`, with `changes` made; the
    host reading of every health test that needs one."""
    return dataclasses.replace(HostFigures(
        at=now, models_free_bytes=2000 * GIB, models_total_bytes=4000 * GIB,
        state_free_bytes=50 * GIB, state_total_bytes=100 * GIB, shm_free_bytes=500 * GIB,
        shm_total_bytes=1000 * GIB, memory_available_bytes=2000 * GIB,
        memory_total_bytes=3000 * GIB, load1=10.0, cpu_count=224, daemon_rss_bytes=300 * MIB),
        **changes)


def by_id(figures: HostFigures,
          paths: PathsConfig | None = None) -> dict[str, tuple[Level, str, str]]:
    return {r.id: (r.level, r.summary, r.hint) for r in host_checks(figures, HEALTH, paths)}


# --- read_host -----------------------------------------------------------------------------

def test_read_host_measures_existing_and_missing_paths(tmp_path: Path) -> None:
    (tmp_path / "state").mkdir()
    shm = tmp_path / "shm"
    shm.mkdir()
    config = make_paths(tmp_path, models="not/there/yet")
    figures = read_host(config, NOW, shm=shm)
    here = psutil.disk_usage(str(tmp_path))
    # the missing models dir is measured on the volume it will live on (its nearest parent)
    assert figures.models_total_bytes == here.total
    assert figures.models_free_bytes is not None and figures.models_free_bytes > 0
    assert figures.state_total_bytes == here.total
    assert figures.shm_total_bytes == here.total
    assert figures.at == NOW
    assert 0 < figures.memory_available_bytes <= figures.memory_total_bytes
    assert figures.cpu_count == (psutil.cpu_count() or 1)
    assert figures.load1 >= 0
    assert figures.daemon_rss_bytes > 10 * MIB  # this test process, Python and all


def test_read_host_without_shm_reports_none(tmp_path: Path) -> None:
    figures = read_host(make_paths(tmp_path), NOW, shm=tmp_path / "no-shm")
    assert figures.shm_free_bytes is None and figures.shm_total_bytes is None
    shm = by_id(figures)["host.shm"]
    assert shm[0] is Level.WARN and "no readable" in shm[1] and "mount" in shm[2]


def test_read_host_on_a_file_instead_of_shm_dir_is_none(tmp_path: Path) -> None:
    not_a_dir = tmp_path / "shm"
    not_a_dir.write_text("x")
    assert read_host(make_paths(tmp_path), NOW, shm=not_a_dir).shm_free_bytes is None


def test_disk_space_of_what_cannot_be_read_is_none(tmp_path: Path) -> None:
    here = psutil.disk_usage(str(tmp_path))
    space = disk_space(tmp_path / "not" / "there")  # the volume it will live on
    assert space is not None and space[1] == here.total
    assert disk_space(tmp_path / ("x" * 300) / "y") is None  # a name too long: ENAMETOOLONG
    assert disk_space(tmp_path / "not", nearest_parent=False) is None  # a mount point: itself


def test_the_daemon_status_leaves_out_a_volume_it_cannot_read(
        tmp_path: Path, config: Config, db: Database, clock: FakeClock) -> None:
    config = dataclasses.replace(config, paths=dataclasses.replace(
        config.paths, models_dir=tmp_path / ("x" * 300)))
    status = asyncio.run(daemon_status(build_runtime(config, clock=clock, db=db)))
    assert [(v.name, v.path) for v in status.volumes] == [
        ("state", str(config.paths.state_dir)), ("logs", str(config.paths.log_dir))]
    assert all(v.total_bytes > 0 for v in status.volumes)


# --- host_checks ---------------------------------------------------------------------------

def test_a_healthy_host_is_ok_everywhere_in_a_stable_order() -> None:
    results = host_checks(roomy_host(), HEALTH)
    assert [r.id for r in results] == ["host.models_disk", "host.state_disk", "host.memory",
                                       "host.shm", "host.load", "host.daemon_memory"]
    assert all(r.group == "host" and r.level is Level.OK and r.hint == "" for r in results)
    models = results[0].summary
    assert "2.15 TB free of 4.29 TB (50% free)" in models


def test_models_disk_warns_then_goes_critical(tmp_path: Path) -> None:
    warn = dataclasses.replace(roomy_host(), models_free_bytes=99 * GIB)
    level, summary, hint = by_id(warn, paths=make_paths(tmp_path))["host.models_disk"]
    assert level is Level.WARN and "106.30 GB free" in summary and "107.37 GB warning" in summary
    assert str(tmp_path / "models") in hint and "Weights page" in hint
    critical = dataclasses.replace(roomy_host(), models_free_bytes=19 * GIB)
    level, summary, _ = by_id(critical)["host.models_disk"]
    assert level is Level.CRITICAL and "21.47 GB critical" in summary
    edge = dataclasses.replace(roomy_host(), models_free_bytes=100 * GIB)
    assert by_id(edge)["host.models_disk"][0] is Level.OK


def test_state_disk_names_the_backups_folder(tmp_path: Path) -> None:
    low = dataclasses.replace(roomy_host(), state_free_bytes=4 * GIB)
    level, _, hint = by_id(low, paths=make_paths(tmp_path))["host.state_disk"]
    assert level is Level.WARN and f"{tmp_path / 'state'}/backups" in hint
    gone = dataclasses.replace(roomy_host(), state_free_bytes=GIB // 2)
    assert by_id(gone)["host.state_disk"][0] is Level.CRITICAL


def test_an_unreadable_volume_warns() -> None:
    unreadable = dataclasses.replace(roomy_host(), models_free_bytes=None, models_total_bytes=None)
    level, summary, hint = by_id(unreadable)["host.models_disk"]
    assert level is Level.WARN and "could not be read" in summary and "directory" in hint


def test_memory_warns_under_the_percentage() -> None:
    low = dataclasses.replace(roomy_host(), memory_available_bytes=270 * GIB)  # 9% of 3000
    level, summary, hint = by_id(low)["host.memory"]
    assert level is Level.WARN and "(9.0%)" in summary and "10% warning" in summary
    assert "ps aux" in hint
    fine = dataclasses.replace(roomy_host(), memory_available_bytes=300 * GIB)
    assert by_id(fine)["host.memory"][0] is Level.OK


def test_shm_warns_when_nearly_full() -> None:
    full = dataclasses.replace(roomy_host(), shm_free_bytes=3 * GIB)
    level, summary, hint = by_id(full)["host.shm"]
    assert level is Level.WARN and "4.29 GB warning" in summary and "/dev/shm" in hint


def test_load_warns_over_twice_the_cpus() -> None:
    busy = dataclasses.replace(roomy_host(), load1=9.5, cpu_count=4)
    level, summary, hint = by_id(busy)["host.load"]
    assert level is Level.WARN and "9.5" in summary and "over 8" in summary and "top" in hint
    assert by_id(dataclasses.replace(busy, load1=8.0))["host.load"][0] is Level.OK


def test_load_is_judged_over_five_minutes_when_known() -> None:
    """A busy minute is no finding (it would warn and recover again and again)."""
    spike = dataclasses.replace(roomy_host(), load1=9.5, load5=3.0, cpu_count=4)
    level, summary, _ = by_id(spike)["host.load"]
    assert level is Level.OK and "3.0 over 5 minutes" in summary
    sustained = dataclasses.replace(spike, load5=8.5)
    assert by_id(sustained)["host.load"][0] is Level.WARN


def test_daemon_memory_warns_over_the_line() -> None:
    fat = dataclasses.replace(roomy_host(), daemon_rss_bytes=3000 * MIB)
    level, summary, hint = by_id(fat)["host.daemon_memory"]
    assert level is Level.WARN and "3.15 GB of memory" in summary and "systemctl restart" in hint
    assert "over the 2.15 GB warning line" in summary
    custom = HealthConfig(daemon_rss_warn_mib=4096)
    assert all(r.level is Level.OK for r in host_checks(fat, custom))
