"""Weights with real processes and a real small filesystem (faults 1 and 4).

- kill -9 of the daemon mid-download: a restarted daemon carries on by itself; the fake Hub
  (its own process) saw only Range requests for the files that had parts, and the Hub token
  appears nowhere in the daemon's output, database or answers.
- disk full: a size-limited tmpfs (root only: skipped elsewhere) — a fresh pull that cannot
  fit refuses with the numbers; space running out mid-way pauses cleanly with nothing
  partial marked verified, and the pull resumes by itself once space is freed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from appliance.clock import SystemClock
from appliance.db.database import Database
from appliance.db.models import WeightsFile
from appliance.testing.checkpoint import write_checkpoint
from appliance.weights.service import WeightsService
from tests.conftest import run_cli, wait_for
from tests.test_server import Daemon, write_config
from tests.test_weights_pull import REPO, box, identical, part_sizes

TOKEN = "hf_DaemonToken_9f8e7d6c5b4a"


@contextlib.contextmanager
def hub_process(repo: Path, log: Path, *faults: str, token: str = "") -> Iterator[str]:
    """The fake Hub as its own process (it outlives the daemon we kill); yields its URL."""
    command = [sys.executable, "-m", "appliance.testing.fake_hub", "--repo", f"{REPO}={repo}",
               "--port", "0", "--request-log", str(log), "--warm"]
    for fault in faults:
        command += ["--fault", fault]
    if token:
        command += ["--token", token]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert "listening on" in line, line
        yield line.split("listening on", 1)[1].strip()
    finally:
        process.terminate()
        process.wait(timeout=10)


def weights_cli(config: Path, *args: str) -> dict[str, Any]:
    result = run_cli("--config", str(config), "weights", *args, "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    body: dict[str, Any] = json.loads(result.stdout)
    return body


def test_kill_9_mid_download_resumes_on_restart_with_range_only(tmp_path: Path) -> None:
    repo = tmp_path / "hub-repo"
    write_checkpoint(repo, shards=4, shard_bytes=1 << 20)
    requests_log = tmp_path / "hub-requests.jsonl"
    with hub_process(repo, requests_log, "rate:250000", token=TOKEN) as url:
        config = write_config(tmp_path / "box")
        with config.open("a") as handle:
            handle.write(f'\n[weights]\nendpoint = "{url}"\ntoken = "{TOKEN}"\n'
                         "reserve_gib = 0\nstall_seconds = 5\nretry_max_seconds = 1\n"
                         "\n[gpu]\nexpected_count = 0\n")
        assert run_cli("--config", str(config), "migrate").returncode == 0
        created = run_cli("--config", str(config), "admin", "create", "--username", "ops",
                          "--password-stdin", input="a sturdy passphrase\n")
        assert created.returncode == 0, created.stderr
        target = tmp_path / "box" / "models" / "moonshotai--Kimi-K3"

        first = Daemon(config)
        first.wait_ready()
        started = weights_cli(config, "pull", "--detach")
        assert started["activity"] in ("resolving", "downloading"), started
        wait_for(lambda: any(n > 200_000 for n in part_sizes(target).values()),
                 "partial shards on disk")
        first.proc.send_signal(signal.SIGKILL)  # fault 1: kill -9 mid-download
        first.proc.wait(timeout=10)
        killed_at = time.time()
        parts = part_sizes(target)  # an empty part (no byte yet) rightly starts from 0
        assert parts
        db = Database(first.settings.database_url)
        verified = db.call(lambda s: {r.path for r in s.scalars(select(WeightsFile)).all()
                                      if r.state == "verified"})
        assert not verified & set(parts), "a partial file was marked verified"

        second = Daemon(config)  # nobody asks again: the daemon carries on by itself
        try:
            second.wait_ready()
            done = wait_for(lambda: (v := weights_cli(config, "status"))["ready_for_engine"]
                            and v, "the resumed pull to finish", timeout=90)
            assert done["counts"]["verified"] == 9
        finally:
            assert second.stop() == 0
        output = first.output() + second.output()
        dump = db.call(lambda s: repr([r.__dict__ for r in s.scalars(select(WeightsFile))]))
        db.dispose()
    assert identical(repo, target)
    records = [json.loads(line) for line in requests_log.read_text().splitlines()]
    after = [r for r in records if r["t"] > killed_at and r["method"] == "GET"]
    for name, offset in parts.items():
        resumed = [r["range"] for r in after if r["path"].endswith("/" + name)]
        assert resumed, f"{name} was not requested after the restart"
        assert all(r is not None and int(r.split("=")[1].split("-")[0]) >= offset
                   for r in resumed), (name, offset, resumed)  # nothing re-sent from 0
    assert "carrying on with the weights pull" in second.output()
    assert TOKEN not in output and TOKEN not in dump and TOKEN not in json.dumps(done)


# --- a full disk ---------------------------------------------------------------------------------


@pytest.fixture
def small_volume(tmp_path: Path) -> Iterator[Path]:
    """A 6 MiB tmpfs; needs root (CI runs as root), skipped where mounting is refused."""
    mount = tmp_path / "small"
    mount.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a size-limited tmpfs needs root")
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(mount)],
                            capture_output=True, text=True, check=False)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(volume: Path, leave: int) -> Path:
    """Write a filler file until only about `leave` bytes stay free."""
    filler = volume / "filler"
    stats = os.statvfs(volume)
    size = max(0, stats.f_bavail * stats.f_frsize - leave)
    with filler.open("wb") as handle, contextlib.suppress(OSError):
        handle.write(b"\0" * size)
    return filler


def test_disk_full_refuses_then_pauses_and_resumes(tmp_path: Path, small_volume: Path) -> None:
    from appliance.testing.fake_hub import FakeHub

    repo = tmp_path / "hub-repo"
    write_checkpoint(repo, shards=4, shard_bytes=1 << 20)  # ~4.2 MB
    with FakeHub({REPO: repo}) as hub:
        config, db = box(tmp_path / "box", hub, APPLIANCE_PATHS_MODELS_DIR=str(small_volume))
        target = small_volume / "moonshotai--Kimi-K3"
        service = WeightsService(config, db, SystemClock())
        service.space_recheck_seconds = 0.5

        async def refused() -> None:
            filler = fill(small_volume, leave=2 << 20)  # 2 MiB free: short before a byte
            view = await service.pull(actor="test")
            await asyncio.wait_for(service.wait_idle(), 30)
            view = await service.status()
            assert view.activity == "failed"
            assert "not starting the pull" in view.message and "short by" in view.message
            assert "free space on the models volume" in view.hint
            assert not list(target.glob("*.part")) if target.exists() else True
            filler.unlink()

        asyncio.run(refused())

        hub.set_faults(["rate:300000"])

        async def paused_then_resumed() -> None:
            await service.pull(actor="test")
            for _ in range(600):
                if any(n > 300_000 for n in part_sizes(target).values()):
                    break
                await asyncio.sleep(0.02)
            filler = fill(small_volume, leave=0)  # fault 4: the disk fills up mid-way
            for _ in range(600):
                view = await service.status()
                if view.activity == "paused":
                    break
                await asyncio.sleep(0.05)
            assert view.activity == "paused", view.message
            assert "full" in view.message or "short by" in view.message
            partial = set(part_sizes(target))
            states = db.call(lambda s: {r.path: r.state for r in s.scalars(select(WeightsFile))})
            assert partial and all(states[name] != "verified" for name in partial)
            assert view.full_verified_at is None and not view.ready_for_engine
            hub.clear_faults()
            filler.unlink()  # space is back: nobody has to ask again
            await asyncio.wait_for(service.wait_idle(), 60)
            view = await service.status()
            await service.stop_service()
            assert view.ready_for_engine, view.message

        asyncio.run(paused_then_resumed())
    assert identical(repo, target)
