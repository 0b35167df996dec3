"""`appliance cell …`: join boxes into a cell from a shell, through the daemon's admin API.

On a member: `join-token` prints a one-time token (valid an hour) to give the head's admin;
`leave` revokes every head's credential. On the head: `add ADDRESS` joins the member with the
token read from stdin (never in argv, which every local user can read),
`members` lists them with their status, `remove ID` gives the credential up and forgets it;
`status` shows the cell (members, router, traffic, a rolling restart), `engine ID ACTION`
starts, stops or restarts a member's engine, `role ID ROLE` changes a member's role, and
`rolling-restart [ROLE]` restarts a role's members one at a time and follows it (no role: the
one role with two READY engines). Stop, restart, a role change of a running engine and a
rolling restart first say what they cost and need `--yes`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from appliance.cell.plan_cli import add_plan_parser, run_plan
from appliance.cell.rolling import READY, ROLLING_ROLES
from appliance.config import CELL_ROLES, Config
from appliance.errors import EX_USAGE, ApplianceError

API = "/api/v1/cell"


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    cell = sub.add_parser("cell", parents=[common], help="join appliances into a cell")
    csub = cell.add_subparsers(dest="cell_command", required=True)
    token = csub.add_parser("join-token", parents=[common],
                            help="on a member: a one-time token for the head (valid 1 hour)")
    token.add_argument("--json", action="store_true")
    add = csub.add_parser("add", parents=[common],
                          help="on the head: add a member with the join token it made")
    add.add_argument("address", help="the member's console address, e.g. https://member-2:8443")
    add.add_argument("token", nargs="?", default="-",
                     help="the join token from `appliance cell join-token` there; '-' or "
                          "omitted: read from stdin (a token given here is in this command's "
                          "argv, which every user on the box can read while it runs)")
    add.add_argument("--role", default="unified", choices=CELL_ROLES)
    add.add_argument("--no-verify-tls", dest="verify_tls", action="store_false",
                     help="accept the member's self-signed certificate")
    add.add_argument("--json", action="store_true")
    members = csub.add_parser("members", parents=[common], help="on the head: the members")
    members.add_argument("--json", action="store_true")
    remove = csub.add_parser("remove", parents=[common], help="on the head: forget a member")
    remove.add_argument("id", type=int)
    remove.add_argument("--json", action="store_true")
    leave = csub.add_parser("leave", parents=[common],
                            help="on a member: revoke the head's credential (leave the cell)")
    leave.add_argument("--json", action="store_true")
    status = csub.add_parser("status", parents=[common],
                             help="on the head: the cell, its members, router and traffic")
    status.add_argument("--json", action="store_true")
    for name, what, choices, helped in (
            ("engine", "action", ("start", "stop", "restart"),
             "start, stop or restart a member's engine"),
            ("role", "role", CELL_ROLES,
             "change a member's role (restarts its running engine)")):
        member = csub.add_parser(name, parents=[common], help=f"on the head: {helped}")
        member.add_argument("id", type=int)
        member.add_argument(what, choices=choices)
        member.add_argument("--yes", action="store_true",
                            help="confirm ending its running engine (a start costs ~90 min)")
        if name == "role":
            member.add_argument("--at", metavar="TIME",
                                help="in a maintenance window instead of now: keep the role "
                                     "and restart its engine then (ISO time with a zone, "
                                     "e.g. 2026-12-05T02:00:00Z)")
        member.add_argument("--json", action="store_true")
    rolling = csub.add_parser("rolling-restart", parents=[common],
                              help="on the head: restart a role's members one at a time")
    # No fixed default: in the usual 1 prefill + 2 decode cell a prefill default would
    # always be refused. Left out, it is the one role with two or more READY engines.
    rolling.add_argument("role", nargs="?", choices=ROLLING_ROLES,
                         help="prefill or decode (default: the one role with at least two "
                              "ready engines, the only kind a rolling restart can take)")
    rolling.add_argument("--yes", action="store_true",
                         help="confirm: each restart costs a full engine start on its box")
    rolling.add_argument("--no-wait", dest="wait", action="store_false",
                         help="return once it has started; follow it with `appliance cell "
                              "status`")
    rolling.add_argument("--json", action="store_true")
    add_plan_parser(csub, common)  # `cell plan` (appliance.cell.plan_cli)
    router = csub.add_parser("exec-router", parents=[common],
                             help="exec the head's router spec (appliance-router.service)")
    router.add_argument("--spec", type=Path,
                        help="default: <state_dir>/router/router-spec.json")
    router.add_argument("--router-dir", type=Path, default=None,
                        help="the only directory whose Python the spec may run "
                             "(default /opt/appliance/router, what the installer builds)")


def join_token_of(given: str) -> str:
    """The join token for `cell add`: `-` reads one line from stdin (unechoed at a terminal),
    so the token never stands in `/proc/PID/cmdline`; a token given as the argument still
    works, with a warning that other users could read it there."""
    import sys

    if given != "-":
        print("warning: a join token on the command line is visible to every user on this "
              "box while the command runs; pipe it in instead (`appliance cell add ADDRESS "
              "< token-file`, or type it when asked)", file=sys.stderr)
        return given
    if sys.stdin.isatty():
        import getpass

        token = getpass.getpass("join token (from `appliance cell join-token` on the member): ")
    else:
        token = sys.stdin.readline()
    token = token.strip()
    if not token:
        raise ApplianceError("cell_token_missing", "no join token on stdin",
                             "run `appliance cell join-token` on the member and pipe its "
                             "token in: `echo TOKEN | appliance cell add ADDRESS`",
                             exit_code=EX_USAGE)
    return token


def run(args: argparse.Namespace, config: Config) -> int:
    from appliance.engine.cli import checked, daemon_api

    command = args.cell_command
    if command == "plan":
        return run_plan(args, config)
    if command == "exec-router":
        from appliance.cell.router import router_spec_path
        from appliance.cell.router_exec import exec_router

        exec_router(args.spec or router_spec_path(config.paths.state_dir), args.router_dir)
    with daemon_api(config, f"cell {command}") as api:
        if command == "join-token":
            body = checked(api.post(f"{API}/join-tokens"), "cell_api")
            return _print(args, body, lambda b: f"{b['token']}\nvalid until {b['expires_at']}, "
                          "once: on the head, `appliance cell add THIS_BOX_ADDRESS` with it "
                          "on stdin")
        if command == "add":
            body = checked(api.post(f"{API}/members", json={
                "address": args.address, "token": join_token_of(args.token), "role": args.role,
                "verify_tls": args.verify_tls}), "cell_api")
            return _print(args, body, lambda b: f"member {b['id']} added: {b['address']} "
                          f"({b['role']}), credential {b['credential']}")
        if command == "members":
            answer = api.get(f"{API}/members")
            listing = answer.json() if answer.status_code < 400 else checked(answer, "cell_api")
            return _print(args, listing, describe_members)
        if command in OPS_COMMANDS:
            return run_ops(args, api)
        if command == "remove":
            body = checked(api.delete(f"{API}/members/{args.id}"), "cell_api")
            return _print(args, body, lambda b: f"member {b['id']} ({b['address']}) removed"
                          + (f"; {b['note']}" if b.get("note") else ""))
        body = checked(api.delete(f"{API}/peer"), "cell_api")
        return _print(args, body, lambda b: (
            f"left the cell: revoked {len(b['revoked'])} head credential(s)" if b["revoked"]
            else "no head holds a credential for this box"))


def _print(args: argparse.Namespace, body: Any, words: Any) -> int:
    print(json.dumps(body, indent=2) if args.json else words(body))
    return 0


def describe_members(members: list[dict[str, Any]]) -> str:
    if not members:
        return ("this box has no cell members (add one with `appliance cell add ADDRESS`, "
                "its join token on stdin)")
    lines = []
    for m in members:
        if m["status"] == "ok":
            engine = m.get("engine") or {}
            health = m.get("health") or {}
            state = f"engine {engine.get('state', '?')}, health {health.get('overall', '?')}"
        else:
            state = f"{m['status']}: {m.get('error', '')}"
        lines.append(f"{m['id']}\t{m['address']}\t{m['role']}\t{state}")
    return "\n".join(lines)


# --- operating the cell (the head's /api/v1/cell, appliance.api.cell_ops) ---------------------

OPS_COMMANDS = ("status", "engine", "role", "rolling-restart")
FOLLOW_SECONDS = 5.0


def run_ops(args: argparse.Namespace, api: Any) -> int:
    from appliance.engine.cli import checked

    command = args.cell_command
    if command == "status":
        return _print(args, checked(api.get(API), "cell_api"), describe_cell)
    if command == "engine":
        body = checked(api.post(f"{API}/members/{args.id}/engine/{args.action}",
                                json={"confirm": args.yes}), "cell_api")
        return _print(args, body, lambda b: f"member {b['id']} ({b['address']}): {args.action} "
                      f"asked; its engine is {b['engine'].get('state', '?').replace('_', ' ')} "
                      "(follow it with `appliance cell status`)")
    if command == "role":
        asked: dict[str, Any] = {"role": args.role, "confirm": args.yes}
        if args.at:
            asked["at"] = args.at
        body = checked(api.post(f"{API}/members/{args.id}/role", json=asked), "cell_api")
        return _print(args, body, lambda b: f"member {b['id']} ({b['address']}): {b['message']}")
    role = args.role or rollable_role(checked(api.get(API), "cell_api"))
    body = checked(api.post(f"{API}/rolling-restart",
                            json={"role": role, "confirm": args.yes}), "cell_api")
    if args.wait and not args.json:
        body = _follow_rolling(api, body)
    _print(args, body, describe_rolling)
    # The verdict is the exit code too: a rolling restart that stopped at a failure, or was
    # cancelled, exits 1 (one still running when no longer followed is not a verdict: 0).
    return 1 if body.get("state") in ("failed", "cancelled") else 0


def rollable_role(cell: dict[str, Any]) -> str:
    """The role a rolling restart given no role takes: the one with at least two READY
    engines (members and the head, from the head's cell status); refused, with the counts,
    when neither or both qualify."""
    engines = [(m["role"], m["engine"].get("state") if m["status"] == "ok" else None)
               for m in cell.get("members", [])]
    head = cell.get("head") or {}
    engines.append((head.get("role"), head.get("engine_state")))
    ready = {role: sum(1 for r, state in engines if r == role and state == READY)
             for role in ROLLING_ROLES}
    counts = ", ".join(f"{role} {n} ready" for role, n in ready.items())
    able = [role for role, n in ready.items() if n >= 2]
    if len(able) == 1:
        return able[0]
    if able:
        raise ApplianceError("rolling_role_needed", f"both roles can be restarted one box at a "
                             f"time ({counts}): say which",
                             "run `appliance cell rolling-restart prefill` or `… decode`",
                             exit_code=EX_USAGE)
    raise ApplianceError("rolling_restart_refused", f"no role has two READY engines ({counts}); "
                         "a rolling restart needs two, so that one serves while the other "
                         "restarts", "restart the engine on its own (`appliance cell engine ID "
                         "restart`), or wait until a second engine of the role is READY",
                         exit_code=EX_USAGE)


def _follow_rolling(api: Any, progress: dict[str, Any]) -> dict[str, Any]:
    """Print each step as it changes until the rolling restart ends; Ctrl-C (or a failed
    read) stops following, never the restart."""
    import sys
    import time

    from appliance.engine.cli import checked

    shown: set[tuple[str, str]] = set()
    try:
        while True:
            for step in progress["steps"]:
                key = (step["engine"], step["status"])
                if key not in shown and step["status"] != "waiting":
                    shown.add(key)
                    print(f"{step['label']}: {step['status']}"
                          + (f" — {step['message']}" if step["message"] else ""), flush=True)
            if progress["state"] != "running":
                return progress
            time.sleep(FOLLOW_SECONDS)
            current = checked(api.get(API), "cell_api").get("rolling_restart")
            if current is None:
                return progress
            progress = current
    except (KeyboardInterrupt, ApplianceError, OSError) as exc:
        why = "" if isinstance(exc, KeyboardInterrupt) else f" ({exc})"
        print(f"appliance: stopped following{why}; the rolling restart goes on in the daemon "
              "(`appliance cell status`)", file=sys.stderr)
        return progress


def describe_rolling(progress: dict[str, Any]) -> str:
    lines = [f"rolling restart of the {progress['role']} members: {progress['state']}"
             + (f" — {progress['message']}" if progress["message"] else "")]
    lines += [f"  {s['label']}: {s['status']}" + (f" — {s['message']}" if s["message"] else "")
              for s in progress["steps"]]
    lines += [f"  left alone: {why}" for why in progress["skipped"]]
    return "\n".join(lines)


def describe_cell(cell: dict[str, Any]) -> str:
    if not cell["is_head"]:
        return ("this box heads no cell (add a member with `appliance cell add ADDRESS`, "
                "its join token on stdin; "
                f"its own role is {cell['head']['role']})")
    state = "serving" if cell["serving"] else "not serving" if cell["active"] else \
        "not a prefill/decode cell yet"
    lines = [f"cell: {state}" + (f" — {cell['message']}" if cell["message"] else "")]
    if cell["capacity_words"]:
        lines.append(f"capacity: {cell['capacity_words']}")
    router = cell["router"]
    if router is not None:
        lines.append("router: answering" if router["up"] else
                     f"router: not answering ({router['error']})")
    lines += [f"traffic: {line}" for line in cell["traffic_words"]]
    for m in cell["members"]:
        engine = (m["engine"]["state"] or "not reported").replace("_", " ")
        if m["status"] != "ok":
            engine = f"{m['status']} ({m['error']})"
        lines.append(f"{m['id']}\t{m['address']}\t{m['role']}\t{engine}\t"
                     f"health {m['health'] or '?'}" + (f"\t{m['problem']}" if m["problem"] else ""))
    head = cell["head"]
    lines.append(f"head\tthis box\t{head['role']}\t{head['engine_state'].replace('_', ' ')}")
    if cell["rolling_restart"] is not None:
        lines.append(describe_rolling(cell["rolling_restart"]))
    return "\n".join(lines)
