"""The head compares the cell's KV layouts (appliance.cell.layout_guard) at a join, at every
poll and before an engine start or restart it asks of a member, on two real daemons over
loopback HTTP with real SQLite."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from appliance.cell import layout
from appliance.cell.layout_guard import OWN, LayoutGuard
from appliance.cell.membership import Member
from appliance.cell.view import Observed
from tests.conftest import free_port, problem, wait_for
from tests.test_cell_membership import Box, close_box, join_token, start_box

Pair = tuple[Box, Box]


def boxes(root: Path, member_args: str = "") -> Iterator[Pair]:
    head, head_db = start_box(root, "head", {"APPLIANCE_CELL_ROLE": "prefill",
                                             "APPLIANCE_CELL_BOOTSTRAP_PORT": str(free_port())},
                              cell_poll_seconds=3600.0)
    env = {"APPLIANCE_ENGINE_EXTRA_ARGS": member_args} if member_args else {}
    member, member_db = start_box(root, "member", env)
    yield head, member
    close_box(head, head_db)
    close_box(member, member_db)


@pytest.fixture
def mismatched(tmp_path: Path) -> Iterator[Pair]:
    yield from boxes(tmp_path, "--page-size,64")


@pytest.fixture
def matched(tmp_path: Path) -> Iterator[Pair]:
    yield from boxes(tmp_path)


def add_decode(head: Box, member: Box) -> Any:
    return head.api.post("/api/v1/cell/members", json={
        "address": member.url, "token": join_token(member), "role": "decode"})


def test_a_decode_with_another_page_size_cannot_join_and_leaves_nothing_behind(
        mismatched: Pair) -> None:
    head, member = mismatched
    refused = add_decode(head, member)
    body = problem(refused, 409, "kv_layout_mismatch")
    assert f"{member.url} cannot join as decode: page size differs: this box (the head) " \
        f"(prefill) has --page-size SGLang's choice, the joining box ({member.url}) (decode) " \
        "has --page-size 64" in body["detail"]
    assert "engine.extra_args" in body["hint"]
    assert head.api.get("/api/v1/cell/members").json() == []
    # the credential the member gave for the join is handed back there
    [released] = member.audit("cell.peer.release")
    assert released.outcome == "ok"
    [denied] = head.audit("cell.member.add")
    assert denied.outcome == "denied" and "page size" in denied.detail["mismatches"][0]


def test_a_matching_decode_joins_and_a_later_mismatch_is_an_event_and_blocks_its_restart(
        matched: Pair) -> None:
    head, member = matched
    added = add_decode(head, member)
    assert added.status_code == 201, added.text
    guard = head.runtime.cell.layouts
    wait_for(lambda: len(guard.boxes) == 2, what="the head's poll after the join")
    assert guard.mismatches == () and set(guard.boxes) == {OWN, f"member 1 ({member.url})"}
    # the member now reports a layout the prefill cannot feed (its configuration changed)
    [seen] = [b for name, b in guard.boxes.items() if name != OWN]
    other = dict(seen.layout.to_json() if seen.layout else {}, kv_cache_dtype="bf16")
    row = Member(1, member.url, "decode", False, "x", head.runtime.clock.now(), "alice")
    events: list[tuple[str, str]] = []

    async def event(severity: str, message: str, detail: dict[str, Any] | None) -> None:
        events.append((severity, message))

    answer = {"role": "decode", "layout": other}
    asyncio.run(guard.poll(head.runtime.cell.local, [Observed(row, "ok", answer=answer)],
                           event))
    asyncio.run(guard.poll(head.runtime.cell.local, [Observed(row, "ok", answer=answer)],
                           event))
    [(severity, message)] = events  # once per change, not every poll
    assert severity == "error" and "KV cache dtype differs" in message and "bf16" in message
    restart = head.api.post("/api/v1/cell/members/1/engine/restart", json={"confirm": True})
    body = problem(restart, 409, "kv_layout_mismatch")
    assert f"member 1 ({member.url}) would restart into a KV layout" in body["detail"]
    assert not member.audit("cell.peer.engine")  # never reached the member
    asyncio.run(guard.poll(head.runtime.cell.local, [Observed(row, "unreachable")], event))
    assert guard.mismatches  # a member that stops answering keeps its last layout
    answer = {"role": "decode", "layout": seen.layout.to_json() if seen.layout else None}
    asyncio.run(guard.poll(head.runtime.cell.local, [Observed(row, "ok", answer=answer)],
                           event))
    assert events[-1][0] == "info" and guard.mismatches == ()


def test_a_member_of_an_older_release_reporting_no_layout_is_not_refused() -> None:
    guard = LayoutGuard()
    local: Any = None  # not asked: a box that reported no layout is compared at a poll
    assert guard.joining(local, "10.0.0.9", "decode", None) == ()
    assert guard.joining(local, "10.0.0.9", "decode", {"nonsense": 1}) == ()
    assert layout.from_json(None) is None
