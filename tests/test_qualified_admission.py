"""Admission from the qualification ledger (issue 15, "admission measured, not guessed"): the
gateway's global limit is the running spec's qualified point less the margin, else the
engine's max_running_requests (said "unqualified"), and the operator's max_concurrency still
overrides; while a qualification runs every request gets a 503 that says so, and a cancel
leaves the gateway as it was. The burst test holds the issue's promise: 50 concurrent long
streams through the gateway with that admission finish without a failure, while the same
burst straight to the calibrated emulator collapses (SGLang's waiting timeout).

The ledger rows are written directly (the qualification itself is tested in
test_qualify_run). No wall-clock assertions; servers on 127.0.0.1; every loop bounded.
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

from appliance.db.database import Database
from appliance.db.models import Qualification
from appliance.engine.publish import write_published, write_qualifying
from appliance.gateway.qualified import (
    CONFIGURED,
    QUALIFIED,
    UNQUALIFIED,
    QualifiedPoint,
    QualifiedReader,
    admission_limit,
    point_of,
    retry_after,
)
from appliance.qualify import ledger, plan
from appliance.qualify.verdict import Step, round_of
from appliance.runtime import Runtime
from appliance.status import AdmissionStanding, _admission
from appliance.testing.fake_sglang.scheduler import WAITING_TIMEOUT
from tests.conftest import Console, make_config
from tests.gateway_rig import MODEL, LiveGateway, auth, chat_body
from tests.test_fake_sglang import Emulator, small_model
from tests.test_gateway import migrated

SPEC = "a" * 64
OTHER = "b" * 64
AT = dt.datetime(2026, 12, 1, 20, 12, 3, tzinfo=dt.UTC)


def qualify(db: Database, spec: str, point: int | None, *, floor: float = 32.0,
            batch_seconds: float = 40.0, state: str = "done") -> int:
    """A finished qualification of `spec` in the ledger, as the service would leave it: steps
    1..point passed (each repeat's round took `batch_seconds`), the next one failed."""
    top = point or 1
    steps = tuple(Step(c, (round_of(c, 1, (), batch_seconds), round_of(c, 2, (), batch_seconds)),
                       True, ()) for c in range(1, top + 1) if point is not None)
    failed = Step(top + 1 if point else 1, (round_of(top + 1, 1, (), batch_seconds),), False,
                  ("too slow",))
    steps = (*steps, failed)
    settings = plan.Settings(plan.harsh(), tuple(range(1, top + 2)), floor=floor)
    opened = db.call(lambda s: ledger.open_qualification(
        s, spec_hash=spec, at=AT - dt.timedelta(minutes=30), by="tests", engine_version="",
        tuning="", settings=settings))
    db.call(lambda s: ledger.close_qualification(
        s, opened.id, state=state, at=AT, steps=steps, qualified=point, verdict="tests"))
    return opened.id


def publish(db: Database, spec: str | None, state: str = "ready") -> None:
    now = dt.datetime.now(dt.UTC)
    db.call(lambda s: write_published(s, state, state, None, now, spec))


# -- the rules, pure --------------------------------------------------------------------------
POINT = QualifiedPoint(7, 16, 32.0, AT, 40.0)


def test_the_limit_and_where_it_comes_from() -> None:
    unqualified = admission_limit(62, None)
    assert (unqualified.limit, unqualified.source) == (62, UNQUALIFIED)
    assert unqualified.words().startswith("unqualified: ")
    assert admission_limit(None, None).limit == 32  # the engine did not say: a cautious guess

    qualified = admission_limit(62, POINT)
    assert (qualified.limit, qualified.source) == (16, QUALIFIED)
    assert qualified.words() == ("admitting up to 16 at a time (qualified 2026-12-01 "
                                 "20:12:03 UTC, floor 32 tokens/s)")
    assert admission_limit(62, POINT, margin=2).limit == 14
    assert admission_limit(62, POINT, margin=40).limit == 1  # never shut by a large margin
    assert admission_limit(8, POINT).limit == 8  # never above what the engine can hold
    # A ladder that stopped at its top with no step failing: the point is a lower bound.
    bound = admission_limit(62, dataclasses.replace(POINT, lower_bound=True))
    assert bound.words() == ("admitting up to 16 at a time (qualified 2026-12-01 20:12:03 "
                             "UTC, floor 32 tokens/s; at least 16: the ladder stopped there "
                             "with no step failing, continue it to admit more)")

    configured = admission_limit(62, POINT, margin=2, override=5)
    assert (configured.limit, configured.source) == (5, CONFIGURED)
    assert admission_limit(62, None, override=5).source == CONFIGURED
    assert configured.to_dict()["qualification"] == {  # type: ignore[comparison-overlap]
        "id": 7, "point": 16, "floor": 32.0, "at": AT.isoformat(), "batch_seconds": 40.0}


def test_retry_after_counts_batches_at_the_qualified_point_never_below_the_median() -> None:
    # 20 ahead for 16 slots: two batches of 40 s
    assert retry_after(20, 16, POINT, [5.0, 6.0, 7.0], 1.0) == 80
    # a median longer than the estimate wins
    assert retry_after(1, 16, POINT, [90.0, 100.0, 110.0], 1.0) == 100
    assert retry_after(10_000, 16, POINT, [], 1.0) == 600  # bounded
    # unqualified: the old estimate (recent mean x batches, up to 60 s), floored by the median
    assert retry_after(8, 4, None, [], 3.0) == 6
    assert retry_after(8, 4, None, [20.0], 3.0) == 20


def test_the_reader_finds_the_running_specs_newest_finished_point(db: Database) -> None:
    reader = QualifiedReader()
    assert db.call(lambda s: reader.read(s, SPEC)) is None  # never qualified
    qualify(db, OTHER, 24)
    qualify(db, SPEC, 8, state="cancelled")
    assert db.call(lambda s: reader.read(s, SPEC)) is None  # another spec's, a cancelled one
    first = qualify(db, SPEC, 16, batch_seconds=30.0)
    found = db.call(lambda s: reader.read(s, SPEC))
    assert found == QualifiedPoint(first, 16, 32.0, AT, 30.0)
    newer = qualify(db, SPEC, 12, floor=40.0)
    found = db.call(lambda s: reader.read(s, SPEC))
    assert found is not None and (found.qid, found.point, found.floor) == (newer, 12, 40.0)
    assert db.call(lambda s: reader.read(s, None)) is None
    qualify(db, SPEC, None)  # the newest found no point: unqualified
    assert db.call(lambda s: reader.read(s, SPEC)) is None
    record = db.call(lambda s: ledger.get_qualification(s, first))
    assert record is not None and point_of(record) == QualifiedPoint(first, 16, 32.0, AT, 30.0)


# -- the live gateway (in front of the shared plain emulator: 4 running requests) -------------
def health(live: LiveGateway) -> httpx.Response:
    return httpx.get(f"{live.url}/health", timeout=10)


def wait_health(live: LiveGateway, check: object, what: str) -> dict[str, object]:
    from tests.conftest import wait_for

    def seen() -> dict[str, object] | None:
        body = health(live).json()
        return body if check(body) else None  # type: ignore[operator]
    return dict(wait_for(seen, what, 20))


def test_health_says_unqualified_then_admits_at_the_qualified_point(
        gateway: LiveGateway, db: Database) -> None:
    publish(db, SPEC)
    body = wait_health(gateway, lambda b: b["admission"]["source"] == UNQUALIFIED,
                       "the unqualified admission")
    assert body["limit"] == 4 and body["admission"]["limit"] == 4  # type: ignore[index]
    assert "qualify" in str(body["admission"]["words"])  # type: ignore[index]

    qualify(db, SPEC, 2)
    body = wait_health(gateway, lambda b: b["admission"]["source"] == QUALIFIED,
                       "the qualified admission")
    assert body["limit"] == 2 and gateway.parts.admission.limit == 2
    assert body["admission"]["words"] == (  # type: ignore[index]
        "admitting up to 2 at a time (qualified 2026-12-01 20:12:03 UTC, floor 32 tokens/s)")

    publish(db, OTHER)  # another spec runs: its own standing, not the last one's
    body = wait_health(gateway, lambda b: b["admission"]["source"] == UNQUALIFIED,
                       "the other spec's admission")
    assert body["limit"] == 4


def test_a_qualification_refuses_users_with_503_and_a_cancel_reopens(
        gateway: LiveGateway, db: Database) -> None:
    key = gateway.key()
    publish(db, SPEC)
    now = dt.datetime.now(dt.UTC)
    ends = now + dt.timedelta(minutes=10)
    db.call(lambda s: write_qualifying(s, now + dt.timedelta(seconds=30), ends))
    body = wait_health(gateway, lambda b: b["admitting"] is False, "the qualifying refusal")
    assert f"being qualified (until {ends:%H:%M:%S} UTC)" in str(body["reason"])
    # The admission it states is the refusal first, then the limit that applies after it.
    admission: dict[str, Any] = body["admission"]  # type: ignore[assignment]
    assert admission["admitting"] is False and admission["refusal"] == {
        "reason": "a qualification is running", "until": ends.isoformat()}
    assert str(admission["words"]).startswith(
        f"refusing every user until about {ends:%H:%M:%S} UTC: a qualification is running")
    assert "; then unqualified: admitting up to 4 at a time" in str(admission["words"])
    refused = httpx.post(f"{gateway.url}/v1/chat/completions", headers=auth(key),
                         json=chat_body(max_tokens=4), timeout=10)
    assert refused.status_code == 503
    assert refused.json()["error"]["code"] == "engine_qualifying"
    assert "being qualified" in refused.json()["error"]["message"]
    assert 5 <= int(refused.headers["retry-after"]) <= 600  # about the ten minutes left

    db.call(lambda s: write_qualifying(s, None))  # cancelled: the gateway as it was
    wait_health(gateway, lambda b: b["admitting"] is True, "the gateway to admit again")
    answered = httpx.post(f"{gateway.url}/v1/chat/completions", headers=auth(key),
                          json=chat_body(max_tokens=4), timeout=30)
    assert answered.status_code == 200


def test_max_concurrency_still_overrides(tmp_path: Path, gateway_engine: Emulator) -> None:
    config = make_config(tmp_path / "over", APPLIANCE_GATEWAY_MAX_CONCURRENCY="3",
                         APPLIANCE_GATEWAY_QUALIFIED_MARGIN="1")
    db = migrated(config)
    live = LiveGateway(config, db, gateway_engine.url).start()
    try:
        qualify(db, SPEC, 2)
        publish(db, SPEC)
        # configured from the start; the running spec's point is read once published
        body = wait_health(live, lambda b: "qualified at 2" in b["admission"]["words"],
                           "the configured admission of a qualified spec")
        assert body["admission"]["source"] == CONFIGURED  # type: ignore[index]
        assert body["limit"] == 3 and live.parts.admission.limit == 3
    finally:
        live.stop()
        db.dispose()


# -- the burst: 50 long streams, through the gateway and straight to the emulator ---------------
# Scaled from 8K/1K to 2K/256 with a pool of 60,000 tokens (about 26 such requests) and an 8 s
# waiting timeout on a 10x clock: the same model, so 50 at once still collapses directly.
SCALE = 0.1
PERF = "k3-b300,kv_tokens=60000,waiting_timeout=8"
PROMPT_WORDS, OUTPUT_TOKENS, USERS, POINT_USERS = 2048, 256, 50, 16


@pytest.fixture(scope="module")
def modelled(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Emulator]:
    root = tmp_path_factory.mktemp("modelled")
    emu = Emulator(root, [str(small_model(root / "model", 1 << 16)), "--served-model-name",
                          MODEL, "--enable-metrics", "--mamba-full-memory-ratio", "0.5"],
                   FAKE_SGLANG_LOAD_SECONDS="1", FAKE_SGLANG_PERF=PERF,
                   FAKE_SGLANG_TIME_SCALE=str(SCALE))
    try:
        emu.wait_ready()
        yield emu
    finally:
        emu.kill()


async def stream_one(client: httpx.AsyncClient, index: int,
                     headers: dict[str, str]) -> tuple[int, str | None]:
    """One streaming completion: (tokens received, why it failed or None)."""
    body = {"model": MODEL, "prompt": " ".join(f"w{index}x{i}" for i in range(PROMPT_WORDS)),
            "max_tokens": OUTPUT_TOKENS, "ignore_eos": True, "stream": True}
    tokens, error = 0, None
    async with client.stream("POST", "/v1/completions", json=body, headers=headers) as reply:
        if reply.status_code != 200:
            return 0, f"HTTP {reply.status_code}: {(await reply.aread())[:200]!r}"
        async for line in reply.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            frame = json.loads(line.removeprefix("data: "))
            if "error" in frame:
                error = frame["error"]["message"]
            elif frame.get("choices") and frame["choices"][0]["text"]:
                tokens += 1
    return tokens, error


async def burst(url: str, headers: dict[str, str]) -> list[tuple[int, str | None]]:
    """USERS streams at once, one each, 127.0.0.1 only."""
    limits = httpx.Limits(max_connections=USERS + 5)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
        return await asyncio.gather(*(stream_one(client, i, headers) for i in range(USERS)))


def test_fifty_long_streams_through_the_qualified_gateway_all_finish_and_collapse_direct(
        tmp_path: Path, modelled: Emulator) -> None:
    direct = asyncio.run(burst(modelled.url, {}))
    failed = [error for _, error in direct if error is not None]
    assert failed and set(failed) == {WAITING_TIMEOUT}  # the collapse, reproduced

    config = make_config(tmp_path / "qualified", APPLIANCE_GATEWAY_QUEUE_WAIT_SECONDS="600")
    db = migrated(config)
    live = LiveGateway(config, db, modelled.url).start()
    try:
        qualify(db, SPEC, POINT_USERS, batch_seconds=5.0)
        publish(db, SPEC)
        wait_health(live, lambda b: b["admission"]["source"] == QUALIFIED and b["admitting"],
                    "the qualified admission")
        before = httpx.get(f"{modelled.url}/emulator/stats", timeout=10).json()
        served = asyncio.run(burst(live.url, auth(live.key())))
        assert [error for _, error in served] == [None] * USERS
        assert all(tokens == OUTPUT_TOKENS for tokens, _ in served)
        after = httpx.get(f"{modelled.url}/emulator/stats", timeout=10).json()
        assert after["failed_total"] == before["failed_total"]
        assert live.parts.admission.limit == POINT_USERS  # the excess waited in the queue
    finally:
        live.stop()
        db.dispose()


# -- what the console says ---------------------------------------------------------------------
def test_the_dashboard_and_usage_page_say_unqualified_then_the_qualified_point(
        logged_in: Console, runtime: Runtime, db: Database,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(type(runtime.supervisor), "running_spec_hash",
                        property(lambda self: SPEC))  # an engine of this spec runs
    for path in ("/", "/usage"):
        html = logged_in.http.get(path).text
        line = re.search(r'<p class="admission notice" id="admission-line"[^>]*>(.*?)</p>', html,
                         re.S)
        assert line, path
        assert "unqualified: the running engine (launch configuration aaaaaaaaaaaa)" \
            in line.group(1)
        assert '<a href="/qualify">Qualify the box' in line.group(1)

    qualify(db, SPEC, 16)
    for path in ("/", "/usage"):
        html = logged_in.http.get(path).text
        assert "admitting up to 16 at a time (qualified 2026-12-01 20:12:03 UTC, floor 32 " \
               "tokens/s)" in html, path
        assert 'class="admission muted"' in html and "Qualify the box" not in html

    status = logged_in.http.get("/api/v1/status").json()
    assert status["admission"]["qualified"] is True


def test_with_no_engine_the_standing_says_so(runtime: Runtime) -> None:
    assert _admission(runtime) == AdmissionStanding(
        None, "no engine is running, so the gateway admits nobody")


def test_the_head_of_a_cell_says_the_cells_admission_not_its_engines(runtime: Runtime) -> None:
    from tests.gateway_rig import publish_cell

    router = "http://127.0.0.1:30100"
    publish_cell(runtime.db, router, serving=False,
                 message="no decode member is ready: member 2 (10.0.0.6) is loading")
    standing = _admission(runtime)
    assert standing.qualified is None and standing.words == (
        "the cell is not serving, so the gateway admits nobody: no decode member is ready: "
        "member 2 (10.0.0.6) is loading")
    publish_cell(runtime.db, router, capacity=128)
    assert "128" in _admission(runtime).words and "cell" in _admission(runtime).words
    publish_cell(runtime.db, router, active=False)  # no cell: the engine's own standing again
    assert _admission(runtime).words == "no engine is running, so the gateway admits nobody"


def test_the_tuning_page_compares_the_split_before_and_after(db: Database) -> None:
    from appliance.qualify.compare import measured

    def done(spec: str, point: int, tuning: str) -> None:
        qid = qualify(db, spec, point)
        db.call(lambda s: setattr(s.get(Qualification, qid), "tuning", tuning))

    assert measured([], SPEC).current is None
    done(OTHER, 16, "profile chat, --mamba-full-memory-ratio 0.9")
    only_before = measured(db.call(ledger.list_qualifications), SPEC)
    assert only_before.current is None and only_before.change == ""
    done(SPEC, 22, "profile chat, --mamba-full-memory-ratio 2.2")
    both = measured(db.call(ledger.list_qualifications), SPEC)
    assert both.change == "ratio 0.9: 16 at 32 tok/s → ratio 2.2: 22 at 32 tok/s"
    assert measured(db.call(ledger.list_qualifications), None).current is None
