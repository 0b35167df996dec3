"""The weights service against the fake Hub over real loopback HTTP (no mocked downloader).

Covers: a full pull (manifest = the Hub's listing, everything verified, bytes identical);
stall and trickle detected within their windows and resumed with Range; corrupted bytes
detected with only that file fetched again; 5xx bursts with Retry-After; a connection closed
mid-file; a cross-origin redirect that never receives the token; the token nowhere in what
the service writes; a restart mid-pull that resumes by itself; cancel; the engine's verdict
after damage on disk; import from a folder; a full verification that quarantines and refetches.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import re
import shutil
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from appliance.clock import SystemClock
from appliance.config import Config
from appliance.db.database import Database
from appliance.db.journal import list_events
from appliance.db.models import AuditEntry, Event, WeightsControl, WeightsFile, WeightsSet
from appliance.db.schema import migrate
from appliance.resources import migrations_dir
from appliance.testing.checkpoint import write_checkpoint
from appliance.testing.fake_hub import FakeHub
from appliance.weights.service import WeightsService
from appliance.weights.views import WeightsView
from tests.conftest import make_config

REPO = "moonshotai/Kimi-K3"
SHARD = "model-00002-of-00004.safetensors"
TOKEN = "hf_SeCrEtToKeN0123456789abcdef"
DEADLINE = 60.0


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    folder = tmp_path / "hub-repo"
    write_checkpoint(folder, shards=4, shard_bytes=1 << 20)
    return folder


@pytest.fixture
def hub(repo: Path) -> Iterator[FakeHub]:
    with FakeHub({REPO: repo}) as running:
        yield running


def box(root: Path, hub: FakeHub, **env: str) -> tuple[Config, Database]:
    settings = {"APPLIANCE_WEIGHTS_ENDPOINT": hub.url, "APPLIANCE_WEIGHTS_RESERVE_GIB": "0",
                "APPLIANCE_WEIGHTS_STALL_SECONDS": "2", "APPLIANCE_WEIGHTS_RETRY_MAX_SECONDS": "1",
                "APPLIANCE_WEIGHTS_MIN_RATE_WINDOW_SECONDS": "3", **env}
    config = make_config(root, **settings)
    db = Database(config.database_url)
    migrate(db, migrations_dir(), config.paths.state_dir / "backups", SystemClock().now())
    return config, db


def run(coro: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(coro())


async def pulled(service: WeightsService, **kwargs: Any) -> WeightsView:
    await service.pull(actor="test", **kwargs)
    await asyncio.wait_for(service.wait_idle(), DEADLINE)
    return await service.status()


def pull_to_ready(config: Config, db: Database) -> None:
    """One whole pull by a fresh service; it must end with the weights ready for the engine."""

    async def scenario() -> None:
        service = WeightsService(config, db, SystemClock())
        view = await pulled(service)
        await service.stop_service()
        assert view.ready_for_engine, view.message

    run(scenario)


def identical(repo: Path, target: Path) -> bool:
    names = sorted(p.name for p in repo.iterdir())
    return names == sorted(p.name for p in target.iterdir() if p.is_file()) and all(
        (repo / n).read_bytes() == (target / n).read_bytes() for n in names)


def gets(hub: FakeHub, name: str) -> list[dict[str, Any]]:
    return [r for r in hub.requests() if r["method"] == "GET" and r["path"].endswith("/" + name)]


def part_sizes(folder: Path) -> dict[str, int]:
    """name → length of each non-empty .part now; a part renamed into place while we look
    (a small file finishing) is simply not there."""
    sizes = {}
    for part in folder.glob("*.part"):
        with contextlib.suppress(FileNotFoundError):
            if size := part.stat().st_size:
                sizes[part.name.removesuffix(".part")] = size
    return sizes


def event_texts(db: Database) -> list[str]:
    return [e.message for e in db.call(lambda s: list_events(s, per_page=500)).items]


def test_full_pull_records_the_manifest_and_verifies_everything(
        tmp_path: Path, repo: Path, hub: FakeHub) -> None:
    config, db = box(tmp_path / "box", hub)

    async def scenario() -> None:
        service = WeightsService(config, db, SystemClock())
        view = await pulled(service)
        await service.stop_service()
        assert view.activity == "idle" and view.ready_for_engine, view.message
        assert view.commit == hub.commit(REPO) and view.revision == "main"
        assert view.counts["verified"] == len(view.files) == 9
        assert view.done_bytes == view.total_bytes == sum(
            p.stat().st_size for p in repo.iterdir())

    run(scenario)
    target = config.paths.models_dir / "moonshotai--Kimi-K3"
    assert identical(repo, target)
    assert not list(target.glob("*.part"))
    rows = db.call(lambda s: s.scalars(select(WeightsFile)).all())
    expected = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in repo.iterdir()}
    for row in rows:  # the manifest holds the Hub's hashes: sha256 for shards, git ids else
        if row.path.endswith(".safetensors"):
            assert row.sha256 == expected[row.path]
        else:
            content = (repo / row.path).read_bytes()
            assert row.git_oid == hashlib.sha1(  # noqa: S324 - git's blob id is sha1
                b"blob %d\0" % len(content) + content).hexdigest()
        assert row.state == "verified" and row.verified_size == row.size
    assert all(len(gets(hub, name)) == 1 for name in expected)  # nothing fetched twice


def test_stall_is_detected_within_its_window_and_resumed_with_range(
        tmp_path: Path, repo: Path, hub: FakeHub) -> None:
    hub.set_faults([f"stall:{SHARD}:300000"])  # then silence until the client gives up
    config, db = box(tmp_path / "box", hub)

    pull_to_ready(config, db)
    requests = gets(hub, SHARD)
    assert len(requests) >= 2
    assert requests[0]["range"] is None and requests[0]["bytes"] == 300000
    assert requests[1]["range"] == "bytes=300000-"  # resumed, not refetched
    stalled = [r for r in requests[:2]]
    assert stalled[1]["t"] - stalled[0]["t"] < 2 + 1.5 + 10  # window + backoff + slack
    assert any("stalled: no bytes for 2 s" in m for m in event_texts(db))
    assert identical(repo, config.paths.models_dir / "moonshotai--Kimi-K3")


def test_trickle_is_detected_by_the_rate_floor_and_resumed(
        tmp_path: Path, repo: Path, hub: FakeHub) -> None:
    hub.set_faults([f"trickle:{SHARD}:2000:200000"])  # full speed, then 2 KB/s
    config, db = box(tmp_path / "box", hub, APPLIANCE_WEIGHTS_MIN_RATE_KIB_S="64")

    pull_to_ready(config, db)
    ranges = [r["range"] for r in gets(hub, SHARD)]  # logged when each request ended
    assert ranges.count(None) == 1, ranges  # one fetch from the start; the rest resumed
    assert all(int(r.split("=")[1].rstrip("-")) >= 200000 for r in ranges if r)
    assert any("too slow" in m and "below the 0.07 MB/s floor" in m for m in event_texts(db))


def test_corrupt_bytes_refetch_only_that_file(tmp_path: Path, repo: Path, hub: FakeHub) -> None:
    hub.set_faults([f"corrupt:{SHARD}"])
    config, db = box(tmp_path / "box", hub)

    pull_to_ready(config, db)
    assert len(gets(hub, SHARD)) == 2
    others = [p.name for p in repo.iterdir() if p.name != SHARD]
    assert all(len(gets(hub, name)) == 1 for name in others)
    assert any("corrupt" in m and SHARD in m for m in event_texts(db))
    assert identical(repo, config.paths.models_dir / "moonshotai--Kimi-K3")


def test_server_errors_and_dropped_connections_are_retried(
        tmp_path: Path, repo: Path, hub: FakeHub) -> None:
    hub.set_faults(["5xx:3:503:1", "429:1:1", f"close:{SHARD}:100000"])
    config, db = box(tmp_path / "box", hub)

    pull_to_ready(config, db)
    statuses = [r["status"] for r in hub.requests()]
    assert statuses.count(503) == 3 and statuses.count(429) == 1
    assert "bytes=100000-" in [r["range"] for r in gets(hub, SHARD)]
    texts = event_texts(db)
    assert any("answered 503" in m for m in texts) and any("answered 429" in m for m in texts)
    assert identical(repo, config.paths.models_dir / "moonshotai--Kimi-K3")


def test_redirect_to_another_origin_never_carries_the_token(
        tmp_path: Path, repo: Path) -> None:
    with FakeHub({REPO: repo}, token=TOKEN, faults=["redirect"]) as hub:
        config, db = box(tmp_path / "box", hub, APPLIANCE_WEIGHTS_TOKEN=TOKEN)

        async def scenario() -> None:
            service = WeightsService(config, db, SystemClock())
            view = await pulled(service)
            await service.stop_service()
            assert view.ready_for_engine, view.message
            assert TOKEN not in repr(view.to_dict())

        run(scenario)
        blobs = [r for r in hub.requests() if r["path"].startswith("/lfs-blobs/")]
        assert len(blobs) == 4 and not any(r["auth"] for r in blobs)
        assert all(r["auth"] for r in hub.requests() if r["path"].startswith("/api/"))
    assert identical(repo, config.paths.models_dir / "moonshotai--Kimi-K3")
    dump = db.call(lambda s: [repr(r.__dict__) for model in (
        Event, AuditEntry, WeightsSet, WeightsFile, WeightsControl)
        for r in s.scalars(select(model)).all()])
    assert not any(TOKEN in text for text in dump)


def test_a_wrong_token_fails_with_a_clear_error_and_no_token_in_it(
        tmp_path: Path, repo: Path) -> None:
    with FakeHub({REPO: repo}, token=TOKEN) as hub:
        config, db = box(tmp_path / "box", hub, APPLIANCE_WEIGHTS_TOKEN="hf_wrong_" + TOKEN)

        async def scenario() -> None:
            service = WeightsService(config, db, SystemClock())
            view = await pulled(service)
            await service.stop_service()
            assert view.activity == "failed"
            assert "gated or private" in view.message and "token" in view.hint
            assert TOKEN not in view.message + view.hint

        run(scenario)
    assert not any(TOKEN in m for m in event_texts(db))


def test_restart_mid_pull_resumes_by_itself_from_the_parts(
        tmp_path: Path, repo: Path, hub: FakeHub) -> None:
    hub.set_faults(["rate:400000"])  # ~3 s per shard: time to stop mid-file
    config, db = box(tmp_path / "box", hub)
    target = config.paths.models_dir / "moonshotai--Kimi-K3"

    async def first() -> None:
        service = WeightsService(config, db, SystemClock())
        await service.start_service()
        await service.pull(actor="test")
        for _ in range(400):
            if any(size > 100_000 for size in part_sizes(target).values()):
                break
            await asyncio.sleep(0.05)
        await service.stop_service()  # like a daemon restart: the wish stays in the database

    run(first)
    offsets = part_sizes(target)  # an empty part (no byte yet) rightly starts from 0
    assert offsets, "no partial file to resume"
    hub.clear_faults()
    time.sleep(1.0)  # the hub logs a request when it ends: let the dropped ones land first
    hub.clear_requests()

    async def second() -> None:
        service = WeightsService(config, db, SystemClock())
        await service.start_service()  # nobody asks: it resumes the pull on its own
        await asyncio.wait_for(service.wait_idle(), DEADLINE)
        view = await service.status()
        await service.stop_service()
        assert view.ready_for_engine, view.message

    run(second)
    for name, offset in offsets.items():
        ranges = [r["range"] for r in gets(hub, name)]
        assert ranges and all(r is not None for r in ranges), (name, ranges)
        assert int(ranges[0].split("=")[1].rstrip("-")) >= offset
    assert identical(repo, target)


def test_cancel_keeps_the_parts_and_clears_the_wish(
        tmp_path: Path, hub: FakeHub) -> None:
    hub.set_faults(["rate:200000"])
    config, db = box(tmp_path / "box", hub)
    target = config.paths.models_dir / "moonshotai--Kimi-K3"

    async def scenario() -> None:
        service = WeightsService(config, db, SystemClock())
        await service.pull(actor="test")
        for _ in range(400):
            if any(size > 50_000 for size in part_sizes(target).values()):
                break
            await asyncio.sleep(0.05)
        view = await service.cancel(actor="ops")
        await service.stop_service()
        assert view.activity == "idle" and "cancelled by ops" in view.message

    run(scenario)
    assert list(target.glob("*.part"))
    assert db.call(lambda s: s.get(WeightsControl, 1).job) == ""


def test_damage_after_verification_blocks_the_engine_and_a_pull_fetches_only_it(
        tmp_path: Path, repo: Path, hub: FakeHub) -> None:
    config, db = box(tmp_path / "box", hub)
    target = config.paths.models_dir / "moonshotai--Kimi-K3"

    async def scenario() -> None:
        service = WeightsService(config, db, SystemClock())
        assert (await pulled(service)).ready_for_engine
        assert (await service.launch_verdict()).verified is True
        with (target / SHARD).open("r+b") as handle:  # a truncated shard (fault 5)
            handle.truncate(1000)
        verdict = await service.launch_verdict()
        assert verdict.verified is False and SHARD in verdict.message
        hub.clear_requests()
        view = await pulled(service)
        await service.stop_service()
        assert view.ready_for_engine, view.message
        assert [r["path"].rsplit("/", 1)[1] for r in hub.requests()
                if "/resolve/" in r["path"]] == [SHARD]

    run(scenario)
    assert identical(repo, target)


def test_full_verification_quarantines_damage_and_refetches_only_that_file(
        tmp_path: Path, repo: Path, hub: FakeHub) -> None:
    # The automatic refetch is the operator's choice (weights.auto_refetch; off by default:
    # tests/test_weights_verdicts.py).
    config, db = box(tmp_path / "box", hub, APPLIANCE_WEIGHTS_AUTO_REFETCH="true")
    target = config.paths.models_dir / "moonshotai--Kimi-K3"

    async def scenario() -> None:
        service = WeightsService(config, db, SystemClock())
        await pulled(service)
        with (target / SHARD).open("r+b") as handle:  # same size, other bytes: only sha256 sees it
            handle.seek(5000)
            handle.write(b"\xff" * 16)
        hub.clear_requests()
        await service.verify_full(actor="test", rehash=True)
        await asyncio.wait_for(service.wait_idle(), DEADLINE)
        view = await service.status()
        await service.stop_service()
        assert view.ready_for_engine, view.message

    run(scenario)
    assert [r["path"].rsplit("/", 1)[1] for r in hub.requests()
            if "/resolve/" in r["path"]] == [SHARD]
    assert any("do not match the manifest" in m for m in event_texts(db))
    assert identical(repo, target)
    assert not (target / ".quarantine").exists()  # cleaned once the file was proven again


def test_import_from_a_folder_adopts_matches_and_reports_what_is_missing(
        tmp_path: Path, repo: Path, hub: FakeHub) -> None:
    config, db = box(tmp_path / "box", hub)
    disk = tmp_path / "usb"
    shutil.copytree(repo, disk)
    (disk / SHARD).unlink()
    with (disk / "config.json").open("a") as handle:
        handle.write(" ")  # wrong size: not adopted

    async def scenario() -> None:
        service = WeightsService(config, db, SystemClock())
        view = await pulled(service)
        manifest = (await service.export_manifest()).to_json()
        await service.stop_service()
        shutil.rmtree(config.paths.models_dir)
        (disk / "manifest.json").write_text(manifest)
        fresh_config, fresh_db = box(tmp_path / "airgapped", hub)
        airgapped = WeightsService(fresh_config, fresh_db, SystemClock())
        await airgapped.import_dir(disk, actor="test")
        await asyncio.wait_for(airgapped.wait_idle(), DEADLINE)
        view = await airgapped.status()
        await airgapped.stop_service()
        assert view.activity == "failed"
        assert "2 of 9 files are missing or damaged" in view.message
        assert SHARD in view.message and "config.json" in view.message
        assert view.counts["verified"] == 7 and not view.ready_for_engine

    run(scenario)


def test_prewarm_before_a_launch_reports_gb_per_second(tmp_path: Path, hub: FakeHub) -> None:
    config, db = box(tmp_path / "box", hub)
    off, off_db = box(tmp_path / "off", hub, APPLIANCE_WEIGHTS_PREWARM="false")

    async def scenario() -> None:
        service = WeightsService(config, db, SystemClock())
        await pulled(service)
        lines: list[str] = []
        message = await service.prewarm_for_launch(lines.append)
        assert message is not None and "page cache warmed before the launch" in message
        assert re.search(r"\([0-9.]+ [kMG]?B/s\)", message), message  # SI, as every rate
        assert await service.prewarm_for_launch(lines.append) is None  # just warmed
        await service.stop_service()
        disabled = WeightsService(off, off_db, SystemClock())
        await pulled(disabled)
        assert await disabled.prewarm_for_launch(lines.append) is None
        await disabled.stop_service()

    run(scenario)
    assert any("page cache warmed" in m for m in event_texts(db))
