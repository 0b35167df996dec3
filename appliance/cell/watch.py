"""The head's cell watch: one background task of the daemon that follows the members and
keeps the router and the gateway in step with them.

Every `interval` seconds while this box has members (every `idle_interval` otherwise, and at
once after a member is added or removed: `poke`), one poll:

1. reads each member's peer status (`GET /api/v1/cell/peer/status`, PeerClient's timeouts),
   and keeps what it reported in the member's row (membership.record_seen). A member that
   does not answer keeps its last engine address: the router's health checks take it out,
   and its spec does not change (no router restart for a member that is down);
2. hands the head's engine key to a member that reports another key's fingerprint
   (`PUT /api/v1/cell/peer/engine-key`, audited on both boxes; again after `PUSH_RETRY`
   seconds at most while the member still reports another);
3. builds the `CellView` (appliance.cell.view) from the head's own engine and the members;
4. writes the router's spec from the view's workers and restarts the router (RouterRunner)
   when the spec changed, or when the router is down: 5 s after it was last started, then
   twice as long after each start that did not keep it running, up to `RESTART_RETRY`
   seconds (a router that died once is back in seconds; one that cannot start is not
   restarted every poll); a cell that is no longer active (members removed, roles unified)
   stops it; then reads the router's figures (its metrics port, `RouterFigures`): an engine
   is ready in the view only while the router counts it healthy with its circuit closed (a
   failed read keeps the last one for `SCRAPE_GRACE` seconds, so one slow scrape does not
   close the cell);
5. publishes the cell's state for the gateway (`cell_status`, written only when it
   changed; a box that never headed a cell writes nothing);
6. records one event, and sends one webhook, when a member that was ready is lost
   (unreachable, revoked, its engine out of READY) and when it is back, with the capacity
   left.

Auditing: the periodic status read is audited on the head only when its outcome (ok, failed,
denied) changes; the member audits the first read by each head and then one an hour
(appliance.cell.local.QuietReads). Every call that changes something is audited on both.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Mapping
from functools import partial
from pathlib import Path
from typing import Any, Final

import httpx

from appliance.cell import membership
from appliance.cell.layout_guard import LayoutGuard
from appliance.cell.local import LocalEngine, QuietReads
from appliance.cell.membership import Member, Seen
from appliance.cell.peer import (
    AuditIf,
    Auditor,
    MemberRefused,
    MemberRevoked,
    MemberUnreachable,
    PeerClient,
)
from appliance.cell.published import CellPublished, read_cell_published, write_cell_published
from appliance.cell.router import (
    RouterInputs,
    build_router_spec,
    engine_key_file,
    router_spec_path,
    worker_url,
    write_router_spec,
)
from appliance.cell.router_metrics import RouterFigures, RouterMetricsReader, RouterScrape
from appliance.cell.router_runner import RouterRunner
from appliance.cell.view import (
    CellView,
    MemberChange,
    Observed,
    build_view,
    member_changes,
    up_now,
)
from appliance.clock import Clock
from appliance.config import Config
from appliance.db.database import Database
from appliance.db.journal import add_event
from appliance.engine.args import model_dir
from appliance.errors import ApplianceError
from appliance.health.alerts import Alerts, severity_of
from appliance.health.model import CheckResult, Level
from appliance.health.transitions import Transition
from appliance.secrets import read_engine_api_key

log = logging.getLogger(__name__)

ACTOR: Final = "cell watch"
STATUS_PATH: Final = "/api/v1/cell/peer/status"
KEY_PATH: Final = "/api/v1/cell/peer/engine-key"
PUSH_RETRY: Final = 60.0
RESTART_RETRY: Final = 60.0
RESTART_FIRST: Final = 5.0  # the first wait before a router found down is started again
# A member that revoked this head answers every read with a refusal it audits: ask it again
# only this often (the head's admin removes it, or it joins again with a new token).
REVOKED_RETRY: Final = 600.0
SCRAPE_GRACE: Final = 10.0  # how long a router scrape stands in for reads that failed
SOURCE: Final = "cell"


async def observe(client: PeerClient, state_dir: Path, member: Member, *,
                  audit_if: AuditIf | None = None) -> Observed:
    """One member's peer status, or why there is none (never raises for the member's sake)."""
    credential = membership.read_credential(state_dir, member.id)
    if credential is None:
        return Observed(member, "no_credential",
                        "this head has lost the member's credential file; remove the member "
                        "and add it again", "remove the member and add it again")
    try:
        answer = await client.call(member, credential, "GET", STATUS_PATH, audit_if=audit_if)
    except MemberUnreachable as exc:
        return Observed(member, "unreachable", exc.message, exc.hint)
    except MemberRevoked as exc:
        return Observed(member, "revoked", exc.message, exc.hint)
    except MemberRefused as exc:
        return Observed(member, "refused", exc.message, exc.hint)
    return Observed(member, "ok", answer=answer)


async def push_engine_key(client: PeerClient, state_dir: Path, member: Member) -> dict[str, Any]:
    """Hand the head's engine key to `member` (audited on both boxes); its answer says
    whether its running engine must restart to use it."""
    key = read_engine_api_key(state_dir)
    credential = membership.read_credential(state_dir, member.id)
    if key is None or credential is None:
        raise ApplianceError(
            "engine_key_missing", "this head cannot read its engine key or the member's "
            "credential", "check state_dir/secrets/ on the head (the daemon writes both)")
    return await client.call(member, credential, "PUT", KEY_PATH, json={"key": key})


def router_program(config: Config) -> Path | None:
    """The Python the router runs under: the installer's router venv in production (None:
    RouterInputs' default), this interpreter in development (its venv has sglang-router)."""
    import sys

    if config.dev or config.engine.runner != "systemd":
        return Path(sys.executable)
    return None


class CellWatch:
    def __init__(self, *, config: Config, db: Database, clock: Clock, local: LocalEngine,
                 runner: RouterRunner, alerts: Alerts, audit: Auditor,
                 interval: float = 3.0, idle_interval: float = 30.0,
                 transport: httpx.AsyncBaseTransport | None = None,
                 router_options: Mapping[str, Any] | None = None,
                 router_figures: RouterFigures | None = None) -> None:
        self.config, self.db, self.clock = config, db, clock
        self.router_figures = router_figures or RouterMetricsReader(
            f"http://127.0.0.1:{config.cell.router_metrics_port}/metrics")
        self._scrape: tuple[RouterScrape, float] | None = None  # the last good one, when
        # RouterInputs fields to set besides the workers (tests and the demo shorten the
        # router's health-check clock; production keeps RouterInputs' defaults).
        self.router_options = dict(router_options or {})
        self.local, self.runner, self.alerts = local, runner, alerts
        self.interval, self.idle_interval = interval, idle_interval
        self.client = PeerClient(audit, actor=ACTOR, address="", transport=transport)
        self.reads = QuietReads()  # the member side: which status reads it audits
        self.layouts = LayoutGuard()  # what must match between prefill and decode
        self.view: CellView | None = None  # the latest (None: before the first poll)
        self.polls = 0
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._outcomes: dict[int, str] = {}  # member id -> last audited status-read outcome
        self._up: dict[int, bool] = {}
        self._pushed: dict[int, tuple[str | None, float]] = {}
        self._revoked: dict[int, tuple[Observed, float]] = {}
        self._published: CellPublished | None = None
        self._published_read = False
        self._router_may_run = True  # at start: a router left from before is found and judged
        self._restarted_at: float | None = None
        self._failed_starts = 0  # starts in a row after which the router was found down
        self._router_failure = ""  # the last failure told, so it is told once

    @property
    def state_dir(self) -> Path:
        return self.config.paths.state_dir

    # --- the task ---------------------------------------------------------------------------

    async def start(self) -> None:
        if self._task is None:
            self._wake = asyncio.Event()
            self._task = asyncio.create_task(self._loop(), name="cell-watch")

    async def stop(self) -> None:
        """Stop watching; the router keeps running (a restarted daemon finds it)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def poke(self) -> None:
        """Poll now (a member was added or removed)."""
        self._wake.set()

    async def _loop(self) -> None:
        while True:
            view: CellView | None
            try:
                view = await self.poll_once()
            except Exception:  # a database hiccup or a bug must not end the watch
                log.exception("cell watch poll failed")
                view = self.view
            idle = view is None or (not view.members and not view.active)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(),
                                       self.idle_interval if idle else self.interval)
            self._wake.clear()

    # --- one poll -----------------------------------------------------------------------------

    async def poll_once(self) -> CellView:
        members = await self.db.run(membership.list_members)
        own = await self.local.facts()
        observed = list(await asyncio.gather(*(self._observe(m) for m in members)))
        await self._keep(observed)
        await self._push_keys(observed, own.key)
        await self.layouts.poll(self.local, observed, self._event)
        # The router follows the workers; whether it then runs is part of the final view.
        provisional = build_view(own, observed, router_running=False, at=self.clock.now())
        running = await self._drive_router(provisional)
        scrape = await self._read_router() if running else None
        view = build_view(own, observed, router_running=running, at=provisional.at,
                          router=scrape)
        await self._publish(view)
        await self._report(view)
        self._outcomes = {m.id: self._outcomes.get(m.id, "ok") for m in members}
        self.view, self.polls = view, self.polls + 1
        return view

    async def _observe(self, member: Member) -> Observed:
        now = self.clock.monotonic()
        revoked = self._revoked.get(member.id)
        if revoked is not None and now - revoked[1] < REVOKED_RETRY:
            return dataclasses.replace(revoked[0], member=member)
        seen = await observe(self.client, self.state_dir, member,
                             audit_if=partial(self._changed, member.id))
        if seen.status == "revoked":
            self._revoked[member.id] = (seen, now)
        else:
            self._revoked.pop(member.id, None)
        return seen

    def _changed(self, member_id: int, outcome: str) -> bool:
        """audit_if for the periodic read: audit only a change of outcome. The join (or the
        daemon's previous poll) left the member ok, so a first ok is no change."""
        before = self._outcomes.get(member_id, "ok")
        self._outcomes[member_id] = outcome
        return outcome != before

    async def _keep(self, observed: list[Observed]) -> None:
        now = self.clock.now()
        seen = [(o.member.id, o.report.engine) for o in observed if o.report is not None]
        if not seen:
            return

        def keep(session: Any) -> None:
            for member_id, e in seen:
                membership.record_seen(session, member_id, Seen(
                    e.url, e.bootstrap_port, e.role, e.state, e.capacity), now)

        await self.db.run(keep)

    async def _push_keys(self, observed: list[Observed], head_key: str | None) -> None:
        now = self.clock.monotonic()
        for o in observed:
            report = o.report
            if head_key is None or report is None or report.engine.key == head_key:
                self._pushed.pop(o.member.id, None)
                continue
            last = self._pushed.get(o.member.id)
            if last is not None and last[0] == report.engine.key and now - last[1] < PUSH_RETRY:
                continue
            self._pushed[o.member.id] = (report.engine.key, now)
            try:
                await push_engine_key(self.client, self.state_dir, o.member)
            except ApplianceError as exc:  # audited; tried again after PUSH_RETRY
                log.warning("could not hand the engine key to member %s: %s", o.member.id,
                            exc.message)

    # --- the router ---------------------------------------------------------------------------

    def _inputs(self, view: CellView) -> RouterInputs:
        cell = self.config.cell
        extra: dict[str, Any] = {}
        program = router_program(self.config)
        if program is not None:
            extra["program"] = program
        return RouterInputs(
            workers=view.workers,
            model_path=model_dir(self.config.paths.models_dir, self.config.engine.model),
            host=cell.router_host, port=cell.router_port,
            key_file=engine_key_file(self.state_dir),
            **{"metrics_port": cell.router_metrics_port, **extra, **self.router_options})

    async def _drive_router(self, view: CellView) -> bool:
        """Bring the router in line with the view; whether it runs now. A runner that fails
        (systemctl refused, a spec the router cannot start from) is one event per distinct
        failure, and is tried again at the next change or after RESTART_RETRY seconds."""
        path = router_spec_path(self.state_dir)
        try:
            if not view.active:
                if self._router_may_run and await self.runner.running():
                    await self.runner.stop()
                    await self._event("info", "the cell's router was stopped: " + view.message)
                self._router_may_run, self._router_failure = False, ""
                return False
            self._router_may_run = True
            spec = build_router_spec(self._inputs(view))
            written = await asyncio.to_thread(write_router_spec, path, spec)
            running = await self.runner.running()
            now = self.clock.monotonic()
            if running:
                self._failed_starts = 0
            wait = min(RESTART_RETRY, RESTART_FIRST * 2 ** self._failed_starts)
            retry = self._restarted_at is None or now - self._restarted_at >= wait
            if not running and retry and self._restarted_at is not None:
                self._failed_starts += 1  # started before, and down again
            if written or (not running and retry):
                self._restarted_at = now
                roles = [w.role for w in spec.workers]
                await self.runner.restart(path)
                await self._event("info", f"the cell's router was "
                                  f"{'restarted' if running else 'started'} over "
                                  f"{roles.count('prefill')} prefill and "
                                  f"{roles.count('decode')} decode engines")
                running = await self.runner.running()
        except ApplianceError as exc:
            failure = f"the cell's router: {exc.message} ({exc.hint})"
            if failure != self._router_failure:
                await self._event("error", failure)
            self._router_failure = failure
            return False
        if running:
            self._router_failure = ""
        return running

    async def _read_router(self) -> RouterScrape | None:
        """The router's latest figures; the last good ones for SCRAPE_GRACE seconds after a
        read that failed; None after that (then no engine counts as serving)."""
        reading = await self.router_figures.read()
        now = self.clock.monotonic()
        if reading.up and reading.scrape is not None:
            self._scrape = (reading.scrape, now)
            return reading.scrape
        if self._scrape is not None and now - self._scrape[1] <= SCRAPE_GRACE:
            return self._scrape[0]
        return None

    # --- the gateway's row, events ------------------------------------------------------------

    async def _publish(self, view: CellView) -> None:
        cell = self.config.cell
        published = CellPublished(  # the view's ETA is already in tens of seconds, rounded up
            active=view.active, upstream_url=worker_url(cell.router_host, cell.router_port),
            serving=view.serving, message=view.message, eta_seconds=view.eta_seconds,
            capacity=view.capacity, updated_at=view.at)
        if not self._published_read:
            self._published = await self.db.run(read_cell_published)
            self._published_read = True
        current = self._published
        if current is None and not published.active:
            return  # never a head: the single box's path stays untouched
        if current is not None and dataclasses.replace(current, updated_at=view.at) == published:
            return
        await self.db.run(lambda s: write_cell_published(s, published))
        self._published = published

    async def _report(self, view: CellView) -> None:
        changes = member_changes(self._up, view)
        self._up = up_now(self._up, view)
        for change in changes:
            await self._member_event(change, view)

    async def _member_event(self, change: MemberChange, view: CellView) -> None:
        m = change.member
        level = Level.OK if not change.lost else Level.WARN if view.serving else Level.CRITICAL
        hint = "" if not change.lost else (
            "the router stops sending to it; see the member on the head's Cell page "
            "(`appliance cell members`)")
        result = CheckResult(id=f"cell.member.{m.id}", group=SOURCE, title=f"Cell {m.name}",
                             level=level, summary=change.sentence, hint=hint)
        previous = Level.OK if change.lost else Level.WARN
        transition = Transition(at=view.at, result=result, previous=previous)
        await self._event(severity_of(transition), change.sentence,
                          {"member": m.id, "address": m.address,
                           "kind": "lost" if change.lost else "back", "status": m.status})
        self.alerts.send([transition])

    async def _event(self, severity: str, message: str,
                     detail: dict[str, Any] | None = None) -> None:
        at = self.clock.now()
        log.log(logging.WARNING if severity != "info" else logging.INFO, message)
        await self.db.run(lambda s: add_event(s, at=at, severity=severity, source=SOURCE,
                                              message=message, detail=detail))
