"""The weights verdicts where the operator looks (issue 14), as real `python -m appliance weights
…` subprocesses against the fake Hub, with no daemon running:

- `verify --full` on a flipped byte exits 1 naming the file, the expected and the found digest
  and where the file was moved (moved, not deleted), and returns at once even with the Hub
  unreachable: it starts no re-download unless `weights.auto_refetch` is on;
- `verify --full` that read nothing says so and keeps the full-verification time;
- `refetch` is its own audited step and goes to the endpoint configured now, not the one the
  set was first pulled from;
- `status` works while another CLI process runs a pull, before the bootstrap password was
  changed;
- a shard deleted since it was proven is never "ready for the engine";
- an unreachable Hub is one clear job-level line, not a Python exception per file;
- `doctor` names the damaged file and calls it critical.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

from sqlalchemy import select

from appliance.clock import SystemClock
from appliance.db.database import Database
from appliance.db.models import AuditEntry, WeightsControl
from appliance.testing.checkpoint import write_checkpoint
from appliance.testing.fake_hub import FakeHub
from appliance.ui.weights import readiness
from appliance.weights.service import WeightsService
from tests.conftest import REPO as SOURCE_TREE
from tests.conftest import make_config, run_cli, wait_for
from tests.test_weights_cli import migrated
from tests.test_weights_pull import REPO, SHARD, box, identical, pull_to_ready

MODEL_DIR = "moonshotai--Kimi-K3"


def checkpoint(tmp_path: Path) -> Path:
    folder = tmp_path / "hub-repo"
    write_checkpoint(folder, shards=4, shard_bytes=256 * 1024)
    return folder


def weights(config: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return run_cli("--config", str(config), "weights", *args, env=env)


def pulled_box(tmp_path: Path, hub: FakeHub, extra: str = "") -> Path:
    config = migrated(tmp_path / "box", f'endpoint = "{hub.url}"\nretry_max_seconds = 1\n'
                      + extra)
    result = weights(config, "pull", "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    return config


def flip_a_byte(path: Path) -> bytes:
    """Same size, one byte of tensor data changed: only a hash can see it. Returns the
    damaged content (to prove it survives in the quarantine)."""
    with path.open("r+b") as handle:
        handle.seek(path.stat().st_size // 2)
        byte = handle.read(1)
        handle.seek(-1, os.SEEK_CUR)
        handle.write(bytes([byte[0] ^ 0xFF]))
    return path.read_bytes()


def dead_endpoint() -> str:
    """An http URL on 127.0.0.1 where nothing listens (connection refused)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def database(root: Path) -> Database:
    return Database(f"sqlite:///{root / 'state' / 'appliance.db'}")


def test_verify_full_on_a_flipped_byte_exits_1_naming_the_file_with_the_hub_gone(
        tmp_path: Path) -> None:
    repo = checkpoint(tmp_path)
    with FakeHub({REPO: repo}) as hub:
        config = pulled_box(tmp_path, hub)
    # The Hub is gone now: a verification that waited for a re-download would never return
    # (run_cli gives up after 60 s).
    models = tmp_path / "box" / "models" / MODEL_DIR
    damaged = flip_a_byte(models / SHARD)
    import hashlib

    found = hashlib.sha256(damaged).hexdigest()
    expected = hashlib.sha256((repo / SHARD).read_bytes()).hexdigest()

    result = weights(config, "verify", "--full")
    assert result.returncode == 1, result.stdout + result.stderr
    out = result.stdout
    assert out.startswith("verify --full: FAILED: 1 of 9 files do not match the manifest"), out
    moved = models / ".quarantine" / SHARD
    assert f"  {SHARD}\n" in out
    assert f"expected: sha256 {expected}" in out
    assert f"found:    sha256 {found}" in out
    assert f"moved to: {moved}" in out
    assert "appliance weights refetch" in out  # the next step, named
    assert "all 9 files verified" not in out and "ready for the engine: no" in out
    # Moved, not deleted: the damaged bytes are kept where the report says.
    assert moved.read_bytes() == damaged and not (models / SHARD).exists()
    db = database(tmp_path / "box")
    try:
        control = db.call(lambda s: s.get(WeightsControl, 1))
        assert control is not None and control.job == ""  # no re-download was started
    finally:
        db.dispose()

    as_json = weights(config, "verify", "--full", "--json")  # the file is gone now: missing
    assert as_json.returncode == 1
    verdict = json.loads(as_json.stdout)["verification"]
    assert verdict["ok"] is False
    assert [m["path"] for m in verdict["mismatches"]] == [SHARD]
    assert "missing" in verdict["mismatches"][0]["found"]
    assert moved.read_bytes() == damaged  # a second run moves nothing over the first copy

    doctor = run_cli("--config", str(config), "doctor", "--json",
                     env={"APPLIANCE_GPU_EXPECTED_COUNT": "0"})
    check = {c["id"]: c for c in json.loads(doctor.stdout)["checks"]}["appliance.weights"]
    assert check["level"] == "critical", check
    assert SHARD in check["summary"] and "refetch" in check["hint"]


def test_verify_full_that_read_nothing_says_so_and_keeps_the_verified_time(
        tmp_path: Path) -> None:
    with FakeHub({REPO: checkpoint(tmp_path)}) as hub:
        config = pulled_box(tmp_path, hub)
    before = json.loads(weights(config, "status", "--json").stdout)["full_verified_at"]
    assert before

    result = weights(config, "verify", "--full")
    assert result.returncode == 0, result.stdout + result.stderr
    first = result.stdout.splitlines()[0]
    assert first.startswith("verify --full: 9 files unchanged since their last full hash on "
                            ), first
    assert "no bytes were read" in first and "match" not in first
    # One event, one time (issue 23): the hash it names is the set's full verification.
    hashed_at = first.split("last full hash on ")[1].split(";")[0]
    assert f"fully verified at {hashed_at}" in result.stdout, result.stdout
    after = json.loads(weights(config, "status", "--json").stdout)["full_verified_at"]
    assert after == before

    rehashed = weights(config, "verify", "--full", "--rehash")
    assert rehashed.returncode == 0
    assert rehashed.stdout.startswith("verify --full: all 9 files match the manifest")


def test_refetch_is_its_own_audited_step_and_goes_to_the_endpoint_in_force_now(
        tmp_path: Path) -> None:
    repo = checkpoint(tmp_path)
    with FakeHub({REPO: repo}) as first:
        config = pulled_box(tmp_path, first)
        first_url = first.url
    models = tmp_path / "box" / "models" / MODEL_DIR
    flip_a_byte(models / SHARD)
    assert weights(config, "verify", "--full").returncode == 1

    with FakeHub({REPO: repo}) as mirror:  # the operator moved to another mirror
        now = {"APPLIANCE_WEIGHTS_ENDPOINT": mirror.url}
        status = weights(config, "status", **now)
        assert "ready for the engine: no" in status.stdout
        result = weights(config, "refetch", "--json", **now)
        assert result.returncode == 0, result.stdout + result.stderr
        view = json.loads(result.stdout)
        fetched = [r["path"].rsplit("/", 1)[1] for r in mirror.requests()
                   if r["method"] == "GET" and "/resolve/" in r["path"]]
    assert view["ready_for_engine"], view["message"]
    assert fetched == [SHARD]  # only the damaged file, from the mirror in force
    assert identical(repo, models)
    db = database(tmp_path / "box")
    try:
        entries = db.call(lambda s: s.scalars(select(AuditEntry).where(
            AuditEntry.action == "weights.refetch")).all())
        assert len(entries) == 1
        detail = json.loads(entries[0].detail)
        assert detail["endpoint"] == mirror.url != first_url and detail["via"] == "cli"
    finally:
        db.dispose()


def test_status_works_while_a_cli_pull_runs_before_the_password_is_changed(
        tmp_path: Path) -> None:
    with FakeHub({REPO: checkpoint(tmp_path)}, faults=["rate:10000"]) as hub:
        config = migrated(tmp_path / "box", f'endpoint = "{hub.url}"\n')
        env = {k: v for k, v in os.environ.items() if not k.startswith("APPLIANCE_")}
        pull = subprocess.Popen([sys.executable, "-m", "appliance", "--config", str(config),
                                 "weights", "pull", "--json"], cwd=SOURCE_TREE, env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            db = database(tmp_path / "box")
            try:
                wait_for(lambda: db.call(lambda s: getattr(s.get(WeightsControl, 1), "job",
                                                           "")) == "pull",
                         "the CLI pull to record its job")
            finally:
                db.dispose()
            result = weights(config, "status", "--json")
            text = weights(config, "status")
        finally:
            pull.send_signal(signal.SIGINT)
            try:
                pull.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pull.kill()
                pull.wait()
    assert result.returncode == 0, result.stdout + result.stderr
    view = json.loads(result.stdout)
    assert view["job"] == "pull" and view["activity"] in ("downloading", "resolving")
    assert f"in another process (pid {pull.pid}" in view["message"]
    assert view["repo_id"] == REPO and not view["ready_for_engine"]
    assert text.returncode == 0 and "running in another process" in text.stdout


def test_a_shard_deleted_after_it_was_proven_is_never_ready(tmp_path: Path) -> None:
    with FakeHub({REPO: checkpoint(tmp_path)}) as hub:
        config = pulled_box(tmp_path, hub)
    models = tmp_path / "box" / "models" / MODEL_DIR
    (models / SHARD).unlink()
    result = weights(config, "status")
    assert result.returncode == 0
    assert "ready for the engine: no" in result.stdout
    assert f"{SHARD} is missing from {models}" in result.stdout
    view = json.loads(weights(config, "status", "--json").stdout)
    said = readiness(_view_of(view), REPO)
    assert not said.ok and said.text.startswith("Not ready for the engine: 1 file changed")
    assert any(SHARD in p for p in said.problems)


def _view_of(body: dict[str, Any]) -> Any:
    """The page's readiness sentence takes a WeightsView: rebuild the fields it reads."""
    import datetime as dt

    from appliance.weights.views import WeightsView

    return WeightsView(
        repo_id=body["repo_id"], revision=body["revision"], commit=body["commit"],
        source=body["source"], model_dir=body["model_dir"], activity=body["activity"],
        message=body["message"], hint=body["hint"], total_bytes=body["total_bytes"],
        done_bytes=body["done_bytes"], rate_bps=0.0, eta_seconds=None, files=(),
        full_verified_at=dt.datetime.fromisoformat(body["full_verified_at"]),
        quick_checked_at=None, quick_ok=None, quick_problems=(),
        ready_for_engine=body["ready_for_engine"],
        disk_problems=tuple(body["disk_problems"]))


def test_an_unreachable_hub_is_one_clear_job_level_line(tmp_path: Path) -> None:
    repo = checkpoint(tmp_path)
    dead = dead_endpoint()
    with FakeHub({REPO: repo}) as hub:
        config, db = box(tmp_path / "box", hub)
        pull_to_ready(config, db)
        fresh, fresh_db = box(tmp_path / "fresh", hub, APPLIANCE_WEIGHTS_ENDPOINT=dead)
    flip_a_byte(config.paths.models_dir / MODEL_DIR / SHARD)
    config = make_config(tmp_path / "box", APPLIANCE_WEIGHTS_ENDPOINT=dead,
                         APPLIANCE_WEIGHTS_RESERVE_GIB="0",
                         APPLIANCE_WEIGHTS_RETRY_MAX_SECONDS="1")

    async def scenario() -> None:
        service = WeightsService(config, db, SystemClock())
        try:
            await service.verify_full(actor="test")
            await asyncio.wait_for(service.wait_job(), 60)
            assert (await service.status()).refetchable
            await service.refetch(actor="test")  # the manifest is known: straight to files

            async def paused() -> Any:
                for _ in range(600):  # bounded: 60 s
                    view = await service.status()
                    if view.activity == "paused":
                        return view
                    await asyncio.sleep(0.1)
                raise AssertionError(f"never paused: {view.activity}: {view.message}")

            view = await paused()
            assert view.message.startswith(f"cannot reach {dead}: connection refused; next try "
                                           "in "), view.message
            shard = next(f for f in view.files if f.path == SHARD)
            assert shard.last_error == f"cannot reach {dead}: connection refused"
            assert "Error" not in view.message + shard.last_error  # no Python class names
        finally:
            with contextlib.suppress(Exception):
                await service.cancel(actor="test")
            await service.stop_service()

    asyncio.run(scenario())

    # The manifest step says the same when it cannot reach the Hub.

    async def resolving() -> None:
        service = WeightsService(fresh, fresh_db, SystemClock())
        try:
            await service.pull(actor="test")
            for _ in range(600):
                view = await service.status()
                if view.activity == "paused":
                    break
                await asyncio.sleep(0.1)
            assert view.activity == "paused", view.message
            assert view.message.startswith(f"cannot reach {dead}: connection refused; "), (
                view.message)
        finally:
            await service.cancel(actor="test")
            await service.stop_service()

    asyncio.run(resolving())


def test_auto_refetch_when_enabled_is_audited_and_uses_the_endpoint_in_force(
        tmp_path: Path) -> None:
    repo = checkpoint(tmp_path)
    with FakeHub({REPO: repo}) as first:
        config, db = box(tmp_path / "box", first)
        pull_to_ready(config, db)
    flip_a_byte(config.paths.models_dir / MODEL_DIR / SHARD)
    with FakeHub({REPO: repo}) as mirror:
        config = make_config(tmp_path / "box", APPLIANCE_WEIGHTS_ENDPOINT=mirror.url,
                             APPLIANCE_WEIGHTS_RESERVE_GIB="0",
                             APPLIANCE_WEIGHTS_AUTO_REFETCH="true")

        async def scenario() -> None:
            service = WeightsService(config, db, SystemClock())
            await service.verify_full(actor="test")
            await asyncio.wait_for(service.wait_idle(), 60)
            view = await service.status()
            await service.stop_service()
            assert view.ready_for_engine, view.message

        asyncio.run(scenario())
        fetched = [r["path"].rsplit("/", 1)[1] for r in mirror.requests()
                   if "/resolve/" in r["path"]]
    assert fetched == [SHARD]
    entries = db.call(lambda s: [(e.actor, json.loads(e.detail)) for e in s.scalars(
        select(AuditEntry).where(AuditEntry.action == "weights.refetch"))])
    assert entries == [("weights (weights.auto_refetch)",
                        {"via": "automatic", "commit": entries[0][1]["commit"],
                         "endpoint": mirror.url})]


def test_the_page_names_the_damage_and_offers_the_refetch_as_its_own_step() -> None:
    import datetime as dt

    from appliance.weights.views import Mismatch, VerifyOutcome
    from tests.test_weights_ui import REPO_ID, _file, _render, _view

    at = dt.datetime(2026, 5, 1, 12, tzinfo=dt.UTC)
    moved = f"/m/.quarantine/{SHARD}"
    outcome = VerifyOutcome(at=at, files=2, hashed=2, unchanged=0, unchanged_since=None,
                            mismatches=(Mismatch(SHARD, "sha256", "a" * 64,
                                                 "sha256 " + "b" * 64, moved),))
    view = _view((_file("config.json", "verified", 100), _file(SHARD, "failed")),
                 repo_id=REPO_ID, activity="failed", message=outcome.summary,
                 verification=outcome, refetchable=True)
    said = readiness(view, REPO_ID)
    assert not said.ok
    assert said.text == ("Not ready for the engine: the full verification of 2026-05-01 "
                         "12:00:00 UTC found 1 damaged file.")
    assert said.problems == (f"{SHARD}: expected sha256 {'a' * 64}, found sha256 {'b' * 64}; "
                             f"moved to {moved}",)
    html = _render("partials/weights_status.html", view, csrf_input="")
    assert 'action="/weights/refetch"' in html and "Fetch the damaged files again" in html
    assert f"moved to {moved}" in html
    # No button while a job runs, nor when nothing is damaged.
    busy = _render("partials/weights_status.html",
                   dataclasses.replace(view, activity="downloading", job="pull"),
                   csrf_input="")
    assert "/weights/refetch" not in busy
    # Once a refetch has proven the set again, the old verdict no longer holds the page back.
    repaired = dataclasses.replace(view, activity="idle", full_verified_at=at,
                                   refetchable=False)
    assert readiness(repaired, REPO_ID).ok
