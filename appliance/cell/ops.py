"""The head's operations on its cell: the overview, one member's engine action or role
change through the member's peer API, and the rolling restart (one at a time per head).

`CellOps` is made once per app (kept on `app.state`, like the metrics exporter) over the
runtime: it holds the router's metrics reader and the rolling restart under way, which live
only in this daemon's memory (a daemon restart ends a rolling restart between two steps; an
engine restart already asked for goes on on its box). The cell's view is the head's watch's
(`runtime.cell.view`, appliance.cell.watch); nothing here polls the members on its own,
except a rolling restart, which reads the engine it restarted until it is READY again.

Every call to a member goes through `PeerClient` (audited on the head as `cell.call`; the
member audits what it serves); each action also records its own entry here:
`cell.member.engine`, `cell.member.role`, `cell.rolling_restart` (start, each step, end) and
`cell.rolling_restart.cancel`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime as dt
from collections.abc import Callable
from functools import partial
from typing import Any, Final

from appliance.auditing import audit
from appliance.cell import membership
from appliance.cell.membership import Member
from appliance.cell.overview import Overview, build_overview, usage_window
from appliance.cell.peer import MemberRefused, MemberRevoked, MemberUnreachable, PeerClient
from appliance.cell.rolling import (
    DEFAULT_DEADLINE_SECONDS,
    DEFAULT_POLL_SECONDS,
    READY,
    Engine,
    Plan,
    Progress,
    RollingRestart,
    Seen,
    Step,
    plan_rolling,
)
from appliance.cell.router_metrics import (
    RouterMetricsReader,
    RouterReading,
    routing_problem,
    worker_for,
)
from appliance.cell.rows import CellMemberRow
from appliance.cell.view import PD_ROLES, CellView, build_view
from appliance.engine.actions import run_action
from appliance.engine.states import LIVE, STARTING, Command
from appliance.errors import EX_USAGE, ApplianceError
from appliance.runtime import Runtime

ENGINE_ACTIONS: Final = ("start", "stop", "restart")
HEAD_KEY: Final = "head"
HEAD_LABEL: Final = "this box (the head)"
PEER: Final = "/api/v1/cell/peer"
STATE_KEY: Final = "cell_ops"
LIVE_STATES: Final = frozenset(s.value for s in LIVE)
STARTING_STATES: Final = frozenset(s.value for s in STARTING)


def engines_of(view: CellView) -> list[Engine]:
    """The cell's engines as a rolling restart sees them: each member (state None when it
    does not answer) and the head's own engine when it has a prefill or decode role."""
    engines = [Engine(f"member-{m.id}", m.name, m.role, m.state if m.reachable else None, m.id)
               for m in view.members]
    if view.own.role in PD_ROLES:
        engines.append(Engine(HEAD_KEY, HEAD_LABEL, view.own.role, view.own.state))
    return engines


def asks_confirmation(state: str | None, action: str) -> bool:
    """Whether a member's 409 to an unconfirmed `action` (stop, restart or role) is the
    confirmation it asks for rather than a refusal: its engine runs (a stop ends any live
    engine; a restart or a role change is refused while it starts). `state` is the watch's
    last reading of it; the member's answer does not carry its code."""
    if state not in LIVE_STATES:
        return False
    return action == "stop" or state not in STARTING_STATES


def member_said(exc: MemberRefused, member: Member) -> str:
    """What the member itself answered, without the head's framing around it."""
    words = exc.message.removeprefix(f"the member at {member.address} refused: ")
    return words.removesuffix(f" (HTTP {exc.member_status})")


def _set_role(session: Any, member_id: int, role: str) -> None:
    row = session.get(CellMemberRow, member_id)
    if row is not None:
        row.role = role


class CellOps:
    def __init__(self, runtime: Runtime, *, router: RouterMetricsReader | None = None) -> None:
        self.runtime = runtime
        self.router = router or RouterMetricsReader(
            f"http://127.0.0.1:{runtime.config.cell.router_metrics_port}/metrics")
        self.rolling_deadline_seconds = DEFAULT_DEADLINE_SECONDS
        self.rolling_poll_seconds = DEFAULT_POLL_SECONDS
        self._rolling: RollingRestart | None = None
        self._task: asyncio.Task[Progress] | None = None

    # --- reading -------------------------------------------------------------------------------

    async def view(self) -> CellView:
        """The head's watch's latest view of the cell (before its first poll: this box
        alone)."""
        watch = self.runtime.cell
        if watch.view is not None:
            return watch.view
        return build_view(await watch.local.facts(), [], router_running=False,
                          at=self.runtime.clock.now())

    @property
    def rolling(self) -> Progress | None:
        return self._rolling.progress if self._rolling is not None else None

    async def read_router(self, view: CellView) -> RouterReading | None:
        """The router's figures, when this box runs one (a cell with both roles)."""
        return await self.router.read() if view.active else None

    async def overview(self) -> Overview:
        view = await self.view()
        router = await self.read_router(view)
        now = self.runtime.clock.now()
        usage = await self.runtime.db.run(lambda s: usage_window(s, now)) if view.active \
            else None
        return build_overview(view, router, usage, self.rolling)

    # --- one member ------------------------------------------------------------------------------

    def client(self, actor: str, address: str) -> PeerClient:
        return PeerClient(partial(audit, self.runtime), actor=actor, address=address)

    async def _member(self, member_id: int) -> tuple[Member, str]:
        member = await self.runtime.db.run(lambda s: membership.get_member(s, member_id))
        credential = membership.read_credential(self.runtime.state_dir, member.id)
        if credential is None:
            raise ApplianceError(
                "member_no_credential", f"this head has lost member {member.id}'s credential "
                "file", f"remove the member (`appliance cell remove {member.id}`) and add it "
                "again with a new join token from it", status=409)
        return member, credential

    async def _call_member(self, member_id: int, path: str, body: dict[str, Any], *,
                           confirm: bool, actor: str, address: str, action: str,
                           what: dict[str, Any]) -> tuple[Member, dict[str, Any]]:
        """POST `body` to one of the member's peer routes; audited here as `action`. The
        member's own refusal comes back as it said it; a 409 to an unconfirmed call on a
        running engine is the confirmation it asks for, with its cost (`asks_confirmation`)."""
        member, credential = await self._member(member_id)
        seen = (await self.view()).member(member_id)
        outcome, error = "ok", None
        try:
            answer = await self.client(actor, address).call(member, credential, "POST", path,
                                                            json=body)
        except MemberRefused as exc:
            said = member_said(exc, member)
            if exc.member_status == 409 and not confirm and asks_confirmation(
                    seen.state if seen else None, what.get("action", "role")):
                outcome = "denied"
                error = ApplianceError(
                    "confirmation_required", f"member {member.id} ({member.address}) says: {said}",
                    "repeat with confirm=true (the console asks for you)", status=409)
            else:
                outcome = "failed"
                error = ApplianceError(exc.code, f"member {member.id} ({member.address}) "
                                       f"refused: {said}", exc.hint,
                                       status=409 if exc.member_status == 409 else exc.status)
        except (MemberUnreachable, MemberRevoked) as exc:
            outcome, error = "failed", exc
        await audit(self.runtime, actor=actor, address=address, action=action,
                    outcome=outcome, target=member.address,
                    detail={"id": member.id, **what, "confirm": confirm,
                            **({"error": error.message[:300]} if error else {})})
        if error is not None:
            raise error
        self.runtime.cell.poke()  # the watch reads the member again now, not a poll later
        return member, answer

    async def member_engine(self, member_id: int, action: str, *, confirm: bool, actor: str,
                            address: str) -> dict[str, Any]:
        if action not in ENGINE_ACTIONS:
            raise ApplianceError("engine_action_unknown", f"unknown engine action {action[:20]!r}",
                                 "use start, stop or restart", status=404, exit_code=EX_USAGE)
        member, _ = await self._member(member_id)  # never restarted into a KV mismatch
        self.runtime.cell.layouts.check_restart(member, action)
        member, answer = await self._call_member(
            member_id, f"{PEER}/engine/{action}", {"confirm": confirm}, confirm=confirm,
            actor=actor, address=address, action="cell.member.engine", what={"action": action})
        return {"id": member.id, "address": member.address, "action": action, "engine": answer}

    async def member_role(self, member_id: int, role: str, *, confirm: bool, actor: str,
                          address: str, at: dt.datetime | None = None) -> dict[str, Any]:
        """Change a member's role now (its running engine restarts, confirmed) or in a
        maintenance window `at` (kept now, the member's restart scheduled there)."""
        role = membership.check_role(role)
        body: dict[str, Any] = {"role": role, "confirm": confirm}
        what: dict[str, Any] = {"role": role}
        if at is not None:
            body["at"] = what["at"] = at.isoformat()
        member, answer = await self._call_member(
            member_id, f"{PEER}/role", body, confirm=confirm or at is not None,
            actor=actor, address=address, action="cell.member.role", what=what)
        await self.runtime.db.run(lambda s: _set_role(s, member.id, role))
        return {"id": member.id, "address": member.address, **answer}

    # --- the rolling restart ---------------------------------------------------------------------

    async def preview(self, role: str, port: PeerEngines) -> tuple[Plan, str]:
        """The plan of a rolling restart of `role` now, and what it costs in words; raises
        the planner's refusal."""
        plan = plan_rolling(role, await port.engines())
        names = ", ".join(e.label for e in plan.steps)
        words = (f"restarts the {plural_members(len(plan.steps), role)} one at a time "
                 f"({names}), each back to READY before the next goes down; each restart "
                 f"costs a full engine start on its box ({self.runtime.supervisor.start_cost()} "
                 "on this head), during which the others serve")
        if plan.skipped:
            words += "; left alone: " + "; ".join(f"{e.label} ({why})" for e, why in plan.skipped)
        return plan, words

    async def start_rolling(self, role: str, *, confirm: bool, actor: str,
                            address: str) -> Progress:
        if self._task is not None and not self._task.done() and self._rolling is not None:
            raise ApplianceError(
                "rolling_restart_running", f"a rolling restart of the {self._rolling.plan.role} "
                "members is already running on this head",
                "wait for it to finish, or cancel it (POST /api/v1/cell/rolling-restart/cancel)",
                status=409)
        port = PeerEngines(self, actor, address)
        plan, words = await self.preview(role, port)
        if not confirm:
            raise ApplianceError("confirmation_required", f"a rolling restart {words}",
                                 "repeat with confirm=true (the console asks for you)",
                                 status=409)
        runtime = self.runtime

        async def report(progress: Progress, step: Step | None) -> None:
            if step is None and progress.state == "running":
                what = {"event": "start", "engines": [s.label for s in progress.steps],
                        "skipped": list(progress.skipped)}
            elif step is None:
                what = {"event": "end", "state": progress.state, "message": progress.message}
            elif step.status == "restarting":
                return  # its end is the entry: done or failed, with why
            else:
                what = {"event": "step", "engine": step.label, "status": step.status,
                        "message": step.message}
            outcome = "failed" if progress.state == "failed" or (
                step is not None and step.status == "failed") else "ok"
            await audit(runtime, actor=actor, address=address, action="cell.rolling_restart",
                        outcome=outcome, target=role, detail=what)

        self._rolling = RollingRestart(
            plan, port, started_by=actor, report=report, now=runtime.clock.now,
            deadline_seconds=self.rolling_deadline_seconds, poll_seconds=self.rolling_poll_seconds)
        self._task = asyncio.get_running_loop().create_task(self._rolling.run())
        self._task.add_done_callback(_seen)
        await asyncio.sleep(0)  # its first report (the start) is written before the answer
        return self._rolling.progress

    async def cancel_rolling(self, *, actor: str, address: str) -> Progress:
        if self._rolling is None or self._task is None or self._task.done():
            raise ApplianceError("no_rolling_restart", "no rolling restart is running on this "
                                 "head", "start one with POST /api/v1/cell/rolling-restart",
                                 status=409)
        self._rolling.cancel(actor)
        await audit(self.runtime, actor=actor, address=address,
                    action="cell.rolling_restart.cancel", target=self._rolling.plan.role)
        with contextlib.suppress(asyncio.CancelledError):
            return await asyncio.shield(self._task)
        return self._rolling.progress


def plural_members(n: int, role: str) -> str:
    return f"{n} READY {role} {'member' if n == 1 else 'members'}"


def _seen(task: asyncio.Task[Progress]) -> None:
    """Mark a finished task's exception as retrieved (it is in the progress or the log)."""
    if not task.cancelled():
        task.exception()


class PeerEngines:
    """The rolling restart's `EnginePort` over the head: members through their peer API,
    the head's own engine through its supervisor. The status reads while a restarted engine
    loads are audited only when their outcome changes (a K3 start is ~90 minutes of reads)."""

    def __init__(self, ops: CellOps, actor: str, address: str) -> None:
        self.ops, self.actor, self.address = ops, actor, address
        self._last_outcome: dict[int, str] = {}
        self._view: CellView | None = None

    async def engines(self) -> list[Engine]:
        """The cell's engines, the prefill and decode ones read live (the watch's view may
        be a poll behind an engine that has just come back), each READY one with whether
        the router sends to it."""
        self._view = view = await self.ops.view()
        listed = engines_of(view)
        fresh = await asyncio.gather(*(self._state(e) for e in listed))
        routed = await self._router_says(view)
        return [dataclasses.replace(e, state=seen.state, routed=routed(e))
                if e.role in PD_ROLES else e for e, seen in zip(listed, fresh, strict=True)]

    async def seen(self, engine: Engine) -> Seen:
        seen = await self._state(engine)
        if seen.state != READY:
            return seen
        routed = await self._router_says(self._view or await self.ops.view())
        return dataclasses.replace(seen, routed=routed(engine))

    async def _router_says(self, view: CellView) -> Callable[[Engine], bool | None]:
        """Whether the head's router sends requests to an engine: healthy by its health
        checks AND its circuit closed (router_metrics.routing_problem). None for every engine
        when the cell has no router to ask (not a prefill/decode cell); False when the router
        runs and its figures are not available or do not list the engine."""
        if not view.active:
            return lambda engine: None
        reading = await self.ops.read_router(view)
        scrape = reading.scrape if reading is not None and reading.up else None

        def routed(engine: Engine) -> bool | None:
            if engine.member_id is None:
                url = view.own.url
            else:
                found = view.member(engine.member_id)
                url = found.worker_url if found is not None else None
            if scrape is None or url is None:
                return False
            return routing_problem(worker_for(scrape, (url,))) is None

        return routed

    async def _state(self, engine: Engine) -> Seen:
        if engine.member_id is None:
            status = self.ops.runtime.supervisor.status
            return Seen(status.state.value, status.since.isoformat() if status.since else None,
                        status.message)
        member_id = engine.member_id

        def audit_if(outcome: str) -> bool:
            changed = self._last_outcome.get(member_id) != outcome
            self._last_outcome[member_id] = outcome
            return changed

        try:
            member, credential = await self.ops._member(member_id)
            answer = await self.ops.client(self.actor, self.address).call(
                member, credential, "GET", f"{PEER}/status", audit_if=audit_if)
        except ApplianceError as exc:
            return Seen(None, None, exc.message)
        body = answer.get("engine")
        body = body if isinstance(body, dict) else {}
        state, since = body.get("state"), body.get("since")
        return Seen(state if isinstance(state, str) else None,
                    since if isinstance(since, str) else None, str(body.get("message") or ""))

    async def restart(self, engine: Engine) -> None:
        if engine.member_id is None:
            await run_action(self.ops.runtime, Command.RESTART, True, self.actor, self.address,
                             "cell rolling restart")
            return
        await self.ops.member_engine(engine.member_id, "restart", confirm=True,
                                     actor=self.actor, address=self.address)


def cell_ops_of(state: Any, runtime: Runtime) -> CellOps:
    """The app's `CellOps` for its runtime, made on first use (nothing at import)."""
    ops: CellOps | None = state.get(STATE_KEY)
    if ops is None or ops.runtime is not runtime:
        ops = CellOps(runtime)
        state[STATE_KEY] = ops
    return ops

