"""The cell through the admin API, `/api/v1/cell`: joining, the peer API, the member registry.

On a member:
- `POST /join-tokens` (admin): a one-time join token, valid an hour, shown once;
- `POST /join` (public; the body's token is the proof): a head exchanges the token for a peer
  credential (scope "cell"), once; a wrong, expired or used token is 403, audited with the
  caller's address;
- `DELETE /peer` (admin): leave the cell: every head's credential is revoked;
- the peer API, the only routes a peer credential opens (`appliance.cell.tokens.PEER_ROUTES`):
  `GET /peer/status` (its engine as a router worker: role, state, address, bootstrap port,
  capacity, progress, key fingerprints; health; GPUs), `POST /peer/engine/{start|stop|restart}`,
  `PUT /peer/engine-key` (a head hands its engine key over), `DELETE /peer/credential`
  (a head giving its own credential up). Each call a head makes is audited here, but a
  head's periodic status read only once an hour (appliance.cell.local.QuietReads).

On a head:
- `POST /members` (admin): address + join token: calls the member's `/join`, keeps the
  credential (appliance.cell.membership) and hands the member this head's engine key;
- `GET /members` (viewer): each member with its status, read through the peer API with short
  timeouts; an unreachable or revoked member is shown as such and nothing else happens;
- `DELETE /members/{id}` (admin): give the credential up on the member if it answers, forget it.

Every call to another box is audited here (`cell.call`, appliance.cell.peer) and there. The
head's cell watch (appliance.cell.watch) follows the members between these calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from functools import partial
from typing import Any

import msgspec
from litestar import Request, Router, delete, get, post, put
from litestar.params import FromPath, JSONBody

from appliance import __version__
from appliance.auditing import audit
from appliance.auth.guards import password_current
from appliance.auth.middleware import AuthInfo, client_address
from appliance.cell import membership, tokens
from appliance.cell.engine_key import check_key, fingerprint, hand_over
from appliance.cell.layout import summary as layout_summary
from appliance.cell.layout_guard import FIX as LAYOUT_FIX
from appliance.cell.local import gpu_summary
from appliance.cell.membership import Member
from appliance.cell.peer import MemberRefused, MemberRevoked, MemberUnreachable, PeerClient
from appliance.cell.peer_auth import count_failure, refuse_if_throttled
from appliance.cell.watch import observe, push_engine_key
from appliance.engine.actions import run_action
from appliance.engine.states import LIVE, Command
from appliance.errors import EX_USAGE, ApplianceError
from appliance.runtime import Runtime, runtime_of

CellRequest = Request[Any, AuthInfo, Any]
# Every route but the public /join (it has no caller account for the guard to read).
SIGNED_IN = [password_current]
PEER_ACTIONS = {"start": Command.START, "stop": Command.STOP, "restart": Command.RESTART}


class JoinBody(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    token: str
    head: str = ""  # the head's name for itself, for this member's audit log


class EngineBody(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    confirm: bool = False


class EngineKeyBody(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    key: str


class MemberBody(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    address: str
    token: str
    role: str = "unified"
    verify_tls: bool = True  # false only for a member with a self-signed certificate


def actor_of(request: CellRequest) -> str:
    return str(getattr(request.user, "username", "?"))


def _peer(request: CellRequest) -> str:
    """The calling head's credential prefix, or "" when not called with one."""
    return request.auth.token_prefix if request.auth.kind == "peer" else ""


def via_of(request: CellRequest) -> str:
    """Who asked, for the engine's audit: a head's credential, or the caller's kind."""
    prefix = _peer(request)
    return f"cell peer {prefix}" if prefix else f"api:{request.auth.kind}"


async def _served(request: CellRequest, what: str, outcome: str = "ok",
                  **detail: Any) -> None:
    """The member's audit entry for a peer call it served (a head's, or a local admin's)."""
    await audit(runtime_of(request), actor=actor_of(request), address=client_address(request),
                action=what, outcome=outcome, target=_peer(request),
                detail={"via": via_of(request), **detail})


# --- on a member ------------------------------------------------------------------------------


@post("/join-tokens", status_code=201, guards=SIGNED_IN,
      summary="Create a one-time join token (valid 1 hour)")
async def create_join_token(request: CellRequest) -> dict[str, Any]:
    runtime = runtime_of(request)
    now = runtime.clock.now()
    made = await runtime.db.run(lambda s: tokens.create_join_token(
        s, runtime.secret, created_by=actor_of(request), now=now))
    await audit(runtime, actor=actor_of(request), address=client_address(request),
                action="cell.join_token.create", detail={"expires_at": made.expires_at.isoformat()})
    return {"token": made.token, "expires_at": made.expires_at.isoformat(),
            "hint": "on the head, within the hour: `appliance cell add THIS_BOX_ADDRESS`, "
                    "the token on its stdin"}


@post("/join", status_code=201, summary="A head exchanges a join token for a peer credential")
async def join(request: CellRequest, data: JSONBody[JoinBody]) -> dict[str, Any]:
    runtime = runtime_of(request)
    now = runtime.clock.now()
    address = client_address(request)
    head = f"{data.head[:100]} ({address})" if data.head else address
    refuse_if_throttled(runtime, address, "join tokens")  # a guesser: no lookup, no audit row
    result = await runtime.db.run(lambda s: tokens.redeem_join_token(
        s, runtime.secret, data.token, head=head, now=now))
    if isinstance(result, str):
        count_failure(runtime, address)
        await audit(runtime, actor="cell head", address=address, action="cell.join",
                    outcome="denied", target=data.head[:100], detail={"reason": result})
        words = {"malformed": "is not a join token", "unknown": "is not one this box made",
                 "expired": "has expired (they last an hour)", "used": "was already used"}
        raise ApplianceError(
            "join_refused", f"the join token {words[result]}",
            "on the member, create a new one with `appliance cell join-token` and use it on "
            "the head within the hour", status=403)
    await audit(runtime, actor="cell head", address=address, action="cell.join",
                target=result.prefix, detail={"head": head})
    return {"credential": result.credential, "prefix": result.prefix, "scope": tokens.SCOPE,
            "member": {"hostname": socket.gethostname(), "version": __version__,
                       "layout": runtime.cell.local.layout().to_json()}}


@delete("/peer", status_code=200, guards=SIGNED_IN,
      summary="Leave the cell: revoke every head's credential")
async def leave(request: CellRequest) -> dict[str, Any]:
    runtime = runtime_of(request)
    now = runtime.clock.now()
    revoked = await runtime.db.run(lambda s: tokens.revoke_peers(s, now))
    await audit(runtime, actor=actor_of(request), address=client_address(request),
                action="cell.leave", detail={"revoked": revoked})
    return {"revoked": revoked}


@get("/peer/status", guards=SIGNED_IN,
      summary="This member's engine as a router worker, its health and GPUs (for its head)")
async def peer_status(request: CellRequest) -> dict[str, Any]:
    runtime = runtime_of(request)
    status = runtime.supervisor.status
    health = runtime.health.latest
    failed = [r for r in health.results if r.level > 0 and r.id not in health.muted]
    failing = [r.id for r in failed]
    facts = await runtime.cell.local.facts()
    prefix = _peer(request)
    reads = runtime.cell.reads.due(prefix, runtime.clock.monotonic()) if prefix else None
    if reads is not None:  # a head polls every few seconds: QuietReads says which to keep
        await _served(request, "cell.peer.status", reads=reads)
    gpus = gpu_summary(health.gpus)
    return {
        "hostname": socket.gethostname(), "version": __version__,
        "role": facts.role,  # what its engine launches as: the head's choice, else [cell] role
        "engine": {**facts.engine_json(),
                   "since": status.since.isoformat() if status.since else None},
        "engine_key": facts.key,
        **({"engine_key_running": facts.key_running} if facts.key_running else {}),
        "layout": runtime.cell.local.layout().to_json(),  # what the head compares
        "gpus": gpus.to_json() if gpus else None,
        "health": {"overall": health.overall().label,
                   "checked_at": health.at.isoformat() if health.at else None,
                   "failing": failing,  # check ids; the titles name them on the head's page
                   "failing_titles": [r.title for r in failed]},
    }


@put("/peer/engine-key", guards=SIGNED_IN,
     summary="A head hands this member its engine key (the router sends one key to all)")
async def peer_engine_key(request: CellRequest, data: JSONBody[EngineKeyBody]) -> dict[str, Any]:
    runtime = runtime_of(request)
    try:
        key = check_key(data.key.strip())
    except ApplianceError as exc:
        await _served(request, "cell.peer.engine_key", "denied", refused=exc.code)
        raise
    changed = hand_over(runtime.state_dir, key)
    new = fingerprint(key)
    live = runtime.supervisor.status.state in LIVE
    running = runtime.engine_keys.running
    # A running engine keeps the key it was launched with: the key before this call,
    # unless the engine was seen accepting another one.
    restart = live and (running != new if running else changed)
    await _served(request, "cell.peer.engine_key", engine_key=new, changed=changed,
                  restart_needed=restart)
    message = ("the engine uses this key from its next start: restart it to serve in the cell"
               if restart else "this box's engine uses this key")
    return {"engine_key": new, "changed": changed, "restart_needed": restart,
            "message": message}


@post("/peer/engine/{action:str}", status_code=202, guards=SIGNED_IN,
      summary="Start, stop or restart this member's engine (for its head)")
async def peer_engine(request: CellRequest, action: FromPath[str],
                      data: JSONBody[EngineBody | None] = None) -> dict[str, Any]:
    command = PEER_ACTIONS.get(action)
    if command is None:
        await _served(request, "cell.peer.engine", "denied", action=action[:20])
        raise ApplianceError("engine_action_unknown", f"unknown engine action {action[:20]!r}",
                             "use start, stop or restart")
    via = via_of(request)
    try:
        answer = await run_action(runtime_of(request), command, (data or EngineBody()).confirm,
                                  actor_of(request), client_address(request), via)
    except ApplianceError as exc:
        await _served(request, "cell.peer.engine", "denied", action=action, refused=exc.code)
        raise
    await _served(request, "cell.peer.engine", action=action)
    return answer


@delete("/peer/credential", status_code=200, guards=SIGNED_IN,
      summary="A head gives up its own credential")
async def release(request: CellRequest) -> dict[str, Any]:
    prefix = _peer(request)
    if not prefix:
        raise ApplianceError(
            "not_a_peer", "this route revokes the calling head's own cell credential, and this "
                          "request carries none", "to leave the cell, DELETE /api/v1/cell/peer",
            exit_code=EX_USAGE)
    runtime = runtime_of(request)
    now = runtime.clock.now()
    revoked = await runtime.db.run(lambda s: tokens.revoke_peers(s, now, prefix))
    await _served(request, "cell.peer.release")
    return {"revoked": revoked}


# --- on a head --------------------------------------------------------------------------------


def _client(runtime: Runtime, request: CellRequest) -> PeerClient:
    return PeerClient(partial(audit, runtime), actor=actor_of(request),
                      address=client_address(request))


def _view(member: Member) -> dict[str, Any]:
    return {"id": member.id, "address": member.address, "role": member.role,
            "verify_tls": member.verify_tls, "credential": member.credential_prefix,
            "added_at": member.added_at.isoformat(), "added_by": member.added_by}


@post("/members", status_code=201, guards=SIGNED_IN,
      summary="Add a member with the join token it made")
async def add_member(request: CellRequest, data: JSONBody[MemberBody]) -> dict[str, Any]:
    runtime = runtime_of(request)
    address = membership.normalize_address(data.address)
    role = membership.check_role(data.role)
    existing = await runtime.db.run(lambda s: membership.find_member(s, address))
    if existing is not None:
        raise ApplianceError(
            "member_exists", f"{address} is already member {existing.id} of this cell",
            f"remove it first (`appliance cell remove {existing.id}`) to add it again",
            status=409, exit_code=EX_USAGE)
    answer = await _client(runtime, request).join(
        address, data.token, verify_tls=data.verify_tls, head_name=socket.gethostname())
    now = runtime.clock.now()
    await refuse_mismatched(runtime, request, address, role, data.verify_tls, answer)
    member = await runtime.db.run(lambda s: membership.add_member(
        s, runtime.state_dir, address=address, role=role, verify_tls=data.verify_tls,
        credential=str(answer["credential"]), prefix=str(answer["prefix"]),
        added_by=actor_of(request), now=now))
    await audit(runtime, actor=actor_of(request), address=client_address(request),
                action="cell.member.add", target=address,
                detail={"id": member.id, "role": role, "credential": member.credential_prefix,
                        "verify_tls": data.verify_tls})
    # The router sends the head's key to every engine: the member must hold it. A failure is
    # audited and the watch tries again; the member is added either way.
    try:
        handed = await push_engine_key(_client(runtime, request), runtime.state_dir, member)
        key = {"handed_over": True, "restart_needed": bool(handed.get("restart_needed")),
               "message": str(handed.get("message", ""))}
    except ApplianceError as exc:
        key = {"handed_over": False, "message": f"{exc.message} (the head tries again)"}
    runtime.cell.poke()
    return {**_view(member), "member": answer.get("member", {}), "engine_key": key}


async def refuse_mismatched(runtime: Runtime, request: CellRequest, address: str, role: str,
                            verify_tls: bool, answer: dict[str, Any]) -> None:
    """A box whose KV layout the cell cannot use is not added: the credential it just gave
    is handed back (DELETE /peer/credential), so nothing is left behind on either box."""
    reported = answer.get("member")
    said = reported.get("layout") if isinstance(reported, dict) else None
    found = runtime.cell.layouts.joining(runtime.cell.local, address, role, said)
    if not found:
        return
    temporary = Member(id=0, address=address, role=role, verify_tls=verify_tls,
                       credential_prefix=str(answer["prefix"]), added_at=runtime.clock.now(),
                       added_by=actor_of(request))
    with contextlib.suppress(ApplianceError):
        await _client(runtime, request).call(temporary, str(answer["credential"]), "DELETE",
                                             "/api/v1/cell/peer/credential")
    await audit(runtime, actor=actor_of(request), address=client_address(request),
                action="cell.member.add", outcome="denied", target=address,
                detail={"role": role, "mismatches": [m.message for m in found]})
    raise ApplianceError(
        "kv_layout_mismatch", f"{address} cannot join as {role}: " + layout_summary(found),
        f"{LAYOUT_FIX}, then create a new join token on the member and add it again",
        status=409, exit_code=EX_USAGE)


async def _status(client: PeerClient, runtime: Runtime, member: Member) -> dict[str, Any]:
    seen = await observe(client, runtime.state_dir, member)
    answer = seen.answer
    if answer is None:
        return {**_view(member), "status": seen.status, "error": seen.error,
                **({"hint": seen.hint} if seen.status == "revoked" else {})}
    return {**_view(member), "status": "ok", "member_role": answer.get("role"),
            "engine": answer.get("engine"),
            "health": answer.get("health"), "hostname": answer.get("hostname"),
            "version": answer.get("version"), "gpus": answer.get("gpus"),
            "engine_key": answer.get("engine_key"),
            "engine_key_running": answer.get("engine_key_running")}


@get("/members", guards=SIGNED_IN,
      summary="This head's members, each with its status read live")
async def list_members(request: CellRequest) -> list[dict[str, Any]]:
    runtime = runtime_of(request)
    members = await runtime.db.run(membership.list_members)
    client = _client(runtime, request)
    return list(await asyncio.gather(*(_status(client, runtime, m) for m in members)))


@delete("/members/{member_id:int}", status_code=200, guards=SIGNED_IN,
        summary="Give up the member's credential (on it, if it answers) and forget it")
async def remove_member(request: CellRequest, member_id: FromPath[int]) -> dict[str, Any]:
    runtime = runtime_of(request)
    member = await runtime.db.run(lambda s: membership.get_member(s, member_id))
    credential = membership.read_credential(runtime.state_dir, member.id)
    released, why = False, "this head had no credential file for it"
    if credential is not None:
        try:
            await _client(runtime, request).call(member, credential, "DELETE",
                                                 "/api/v1/cell/peer/credential")
            released, why = True, ""
        except (MemberUnreachable, MemberRevoked, MemberRefused) as exc:
            why = exc.message
    await runtime.db.run(lambda s: membership.forget_member(s, runtime.state_dir, member.id))
    runtime.cell.poke()  # the router's spec and the gateway's row follow at once
    await audit(runtime, actor=actor_of(request), address=client_address(request),
                action="cell.member.remove", target=member.address,
                detail={"id": member.id, "released_on_member": released,
                        **({"why": why} if why else {})})
    return {**_view(member), "released_on_member": released,
            **({"note": f"not revoked on the member ({why}); an admin there can revoke it "
                        "with `appliance cell leave`"} if why else {})}


def cell_router() -> Router:
    return Router(path="/api/v1/cell", tags=["cell"],
                  route_handlers=[create_join_token, join, leave, peer_status, peer_engine,
                                  peer_engine_key, release, add_member, list_members,
                                  remove_member])

