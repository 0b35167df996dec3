"""The weights check on the Health page and in `/api/v1/health` (issue 14): the same verdict as
`appliance doctor`'s, polled by the monitor in its own "weights" group.

A real checkpoint in the models folder, recorded as a verified set the way a pull leaves it;
"check now" over loopback HTTP (console session, CSRF) after each change: a good set is OK, a
quarantined file or one a verification recorded failed is CRITICAL naming the file, and a
file cut short fails the quick tier (CRITICAL) without any hash being read.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session

from appliance.config import Config
from appliance.db.database import Database
from appliance.engine.args import model_dir
from appliance.health.doctor import weights_check as doctor_check
from appliance.health.model import Level
from appliance.runtime import Runtime
from appliance.testing.checkpoint import write_checkpoint
from appliance.weights import records
from appliance.weights.manifest import ManifestFile, build_manifest
from appliance.weights.quarantine import quarantine
from tests.conftest import Console, csrf

API = "/api/v1/health"


def record_verified_set(runtime: Runtime) -> tuple[Path, list[str]]:
    """The configured model's checkpoint on disk, recorded active and fully verified (what a
    finished pull records); returns its folder and its file paths."""
    config = runtime.config
    folder = model_dir(config.paths.models_dir, config.engine.model)
    written = write_checkpoint(folder, shards=2, shard_bytes=32 << 10)
    files = [ManifestFile(p.relative_to(folder).as_posix(), p.stat().st_size,
                          sha256=hashlib.sha256(p.read_bytes()).hexdigest()) for p in written]
    manifest = build_manifest(config.engine.model, "main", "c" * 40, files)
    now = runtime.clock.now()

    def record(session: Session) -> None:
        stored = records.store_manifest(session, manifest, "test", now)
        records.update_files(session, stored.id, {
            f.path: {"state": "verified", "bytes_done": f.size} for f in files})
        records.set_full_verified(session, stored.id, now)
        records.set_control(session, at=now, by="test", active_set_id=stored.id)

    runtime.db.call(record)
    return folder, [f.path for f in files]


def check_now(console: Console) -> dict[str, Any]:
    """The console's "Check now" (the page's form), then the API's snapshot."""
    response = console.http.post("/health/check", headers=csrf(console))
    assert response.status_code in (200, 303), response.text
    body: dict[str, Any] = console.http.get(f"{API}/").json()
    return body


def weights_of(body: dict[str, Any]) -> dict[str, Any]:
    found = [c for c in body["checks"] if c["group"] == "weights"]
    assert [c["id"] for c in found] == ["weights.set"], found
    return found[0]


def card(console: Console) -> str:
    """The text of the Health page's Weights card."""
    page = console.http.get("/health").text
    match = re.search(r'<section[^>]*id="health-weights".*?</section>', page, re.S)
    assert match, "the Health page has no Weights card"
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", match.group(0)))


def test_a_good_set_is_ok_and_a_damaged_file_is_critical(runtime: Runtime,
                                                         logged_in: Console) -> None:
    body = check_now(logged_in)
    nothing = weights_of(body)
    assert nothing["level"] == "warn" and "no weight set of" in nothing["summary"]

    folder, paths = record_verified_set(runtime)
    good = weights_of(check_now(logged_in))
    assert good["level"] == "ok", good
    assert "the quick check passes now" in good["summary"]
    words = card(logged_in)
    assert "Weights" in words and "the quick check passes now" in words

    shard = next(p for p in paths if p.endswith(".safetensors"))
    assert quarantine(folder, shard) is not None  # what a failed full verification does
    bad = weights_of(check_now(logged_in))
    assert bad["level"] == "critical", bad
    assert shard in bad["summary"] and "damaged or failed" in bad["summary"]
    assert "refetch" in bad["hint"]
    assert check_now(logged_in)["overall"] == "critical"
    words = card(logged_in)
    assert "critical" in words.lower() and shard in words

    # The doctor's verdict is the same one, under its own id.
    same = doctor_check(runtime.db, runtime.config)
    assert (same.id, same.group, same.level) == ("appliance.weights", "appliance",
                                                 Level.CRITICAL)
    assert same.summary == bad["summary"]


def test_a_file_recorded_failed_or_cut_short_is_critical(runtime: Runtime,
                                                         logged_in: Console) -> None:
    folder, paths = record_verified_set(runtime)
    shard = next(p for p in paths if p.endswith(".safetensors"))
    with (folder / shard).open("r+b") as handle:  # cut short: the quick tier sees the size
        handle.truncate((folder / shard).stat().st_size - 1)
    short = weights_of(check_now(logged_in))
    assert short["level"] == "critical", short
    assert "fails the quick check" in short["summary"] and shard in short["summary"]

    def fail(session: Session) -> None:
        control = records.get_control(session)
        assert control.active_set_id is not None
        records.update_file(session, control.active_set_id, shard, state="failed",
                            last_error=f"{shard}: sha256 does not match the manifest")

    runtime.db.call(fail)
    failed = weights_of(check_now(logged_in))
    assert failed["level"] == "critical"
    assert f"{shard}: sha256 does not match the manifest" in failed["summary"]


def test_the_monitor_polls_weights_in_its_own_group(config: Config, db: Database,
                                                    runtime: Runtime) -> None:
    import asyncio

    async def scenario() -> None:
        snapshot = await runtime.health.check_weights()
        assert [r.id for r in snapshot.by_group()["weights"]] == ["weights.set"]
        await runtime.health.close()

    asyncio.run(scenario())


def test_a_full_verification_through_the_api_shows_on_health_without_check_now(
        runtime: Runtime, logged_in: Console) -> None:
    """Issue 23: the check said "not verified yet" for 5 minutes after the weights were
    verified. The job's end re-judges it: the next read of /api/v1/health and the Health
    card carry the verdict, with no "check now" and no scheduled poll in between."""
    from tests.conftest import wait_for

    folder, paths = record_verified_set(runtime)
    set_id = runtime.db.call(records.active_set).id  # type: ignore[union-attr]
    runtime.db.call(lambda s: records.set_full_verified(s, set_id, None))
    pending = weights_of(check_now(logged_in))
    assert pending["level"] == "warn" and "not verified yet" in pending["summary"], pending

    def verify() -> dict[str, Any]:
        started = logged_in.http.post("/api/v1/weights/verify", headers=csrf(logged_in),
                                      json={"full": True, "rehash": True})
        assert started.status_code == 202, started.text

        def ended() -> dict[str, Any] | None:
            # The job's end state, not a time: no job, and a verification verdict recorded.
            view: dict[str, Any] = logged_in.http.get("/api/v1/weights/").json()
            return view if not view["job"] and view["verification"] else None

        body: dict[str, Any] = wait_for(ended, "the verification's end")
        return body

    assert verify()["verification"]["ok"]
    verified = weights_of(logged_in.http.get(f"{API}/").json())
    assert verified["level"] == "ok", verified
    assert "the quick check passes now" in card(logged_in)

    shard = next(p for p in paths if p.endswith(".safetensors"))
    target = folder / shard
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only the hash sees it
    target.write_bytes(bytes(data))
    assert not verify()["verification"]["ok"]
    damaged = weights_of(logged_in.http.get(f"{API}/").json())
    assert damaged["level"] == "critical" and shard in damaged["summary"], damaged
    status = logged_in.http.get("/api/v1/weights/").json()
    assert status["latest_check"]["kind"] == "full verification", status["latest_check"]
    assert not status["latest_check"]["ok"]
