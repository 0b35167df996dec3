"""`appliance weights …` as real subprocesses with no daemon running (the command runs the job
itself): export from a trusted folder, import on another box, bad inputs with clear errors
and nothing recorded (fault 14: hostile manifest paths), a bandwidth cap."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from sqlalchemy import func, select

from appliance.db.database import Database
from appliance.db.models import WeightsSet
from appliance.testing.checkpoint import write_checkpoint
from appliance.testing.fake_hub import FakeHub
from tests.conftest import run_cli
from tests.test_server import write_config
from tests.test_weights_pull import REPO, identical


def migrated(root: Path, extra: str = "") -> Path:
    config = write_config(root)
    with config.open("a") as handle:
        handle.write("\n[weights]\nreserve_gib = 0\n" + extra)
    assert run_cli("--config", str(config), "migrate").returncode == 0
    return config


def sets_recorded(root: Path) -> int:
    db = Database(f"sqlite:///{root / 'state' / 'appliance.db'}")
    try:
        return int(db.call(lambda s: s.scalar(select(func.count()).select_from(WeightsSet))))
    finally:
        db.dispose()


def test_export_from_a_folder_then_import_on_an_airgapped_box(tmp_path: Path) -> None:
    trusted = tmp_path / "trusted"
    write_checkpoint(trusted, shards=3, shard_bytes=256 * 1024)
    disk = tmp_path / "disk"
    shutil.copytree(trusted, disk)
    manifest = disk / "manifest.json"
    connected = write_config(tmp_path / "connected")  # the export needs no database
    exported = run_cli("--config", str(connected), "weights", "export-manifest", "--from-dir",
                       str(trusted), "--repo", REPO, "--out", str(manifest))
    assert exported.returncode == 0, exported.stderr
    assert "8 files" in exported.stderr
    assert json.loads(manifest.read_text())["repo_id"] == REPO

    config = migrated(tmp_path / "box")
    result = run_cli("--config", str(config), "weights", "import", str(disk), "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    view = json.loads(result.stdout)
    assert view["ready_for_engine"] and view["counts"]["verified"] == 8
    assert identical(trusted, tmp_path / "box" / "models" / "moonshotai--Kimi-K3")

    status = run_cli("--config", str(config), "weights", "status")
    assert status.returncode == 0 and "ready for the engine: yes" in status.stdout
    quick = run_cli("--config", str(config), "weights", "verify")
    assert quick.returncode == 0 and "latest check: quick check at " in quick.stdout \
        and ": passed:" in quick.stdout


def test_a_hostile_manifest_is_refused_naming_the_path_and_nothing_is_recorded(
        tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    write_checkpoint(disk, shards=2, shard_bytes=64 * 1024)
    evil = tmp_path / "evil.json"
    evil.write_text(json.dumps({
        "format": "appliance-weights-manifest/1", "repo_id": REPO, "revision": "main",
        "commit": "c" * 40, "files": [
            {"path": "config.json", "size": 1, "sha256": "a" * 64},
            {"path": "../../../etc/cron.d/own", "size": 1, "sha256": "a" * 64}]}))
    config = migrated(tmp_path / "box")
    result = run_cli("--config", str(config), "weights", "import", str(disk), "--manifest",
                     str(evil))
    assert result.returncode == 65, result.stdout + result.stderr
    assert "'../../../etc/cron.d/own'" in result.stderr and "escape" in result.stderr
    assert sets_recorded(tmp_path / "box") == 0
    assert not (tmp_path / "box" / "models").exists()


def test_bad_inputs_exit_with_a_clear_error(tmp_path: Path) -> None:
    config = migrated(tmp_path / "box")
    bad = run_cli("--config", str(config), "weights", "pull", "--endpoint", "ftp://mirror")
    assert bad.returncode == 64 and "--endpoint 'ftp://mirror' is not an http(s) URL" in bad.stderr
    repo = run_cli("--config", str(config), "weights", "pull", "--repo", "../etc")
    assert repo.returncode == 64 and "--repo '../etc'" in repo.stderr
    missing = run_cli("--config", str(config), "weights", "import", str(tmp_path / "nope"))
    assert missing.returncode == 64 and "is not a directory" in missing.stderr
    none = run_cli("--config", str(config), "weights", "export-manifest")
    assert none.returncode == 1 and "no weights manifest is recorded" in none.stderr
    assert sets_recorded(tmp_path / "box") == 0


def test_pull_without_a_daemon_runs_here_and_honours_the_bandwidth_cap(tmp_path: Path) -> None:
    repo = tmp_path / "hub-repo"
    write_checkpoint(repo, shards=2, shard_bytes=1 << 20)  # ~2.1 MB
    with FakeHub({REPO: repo}) as hub:
        config = migrated(tmp_path / "box", f'endpoint = "{hub.url}"\n'
                                             "bandwidth_limit_mib_s = 1\n")
        began = time.monotonic()
        result = run_cli("--config", str(config), "weights", "pull", "--json")
        took = time.monotonic() - began
    assert result.returncode == 0, result.stdout + result.stderr
    assert json.loads(result.stdout)["ready_for_engine"]
    # A cap is a floor on the time taken (load can only make it slower, never faster).
    assert took >= 1.0, took
    assert identical(repo, tmp_path / "box" / "models" / "moonshotai--Kimi-K3")
