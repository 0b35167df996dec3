"""`appliance cell …`: join boxes into a cell from a shell, through the daemon's admin API.

On a member: `join-token` prints a one-time token (valid an hour) to give the head's admin;
`leave` revokes every head's credential. On the head: `add ADDRESS TOKEN` joins the member,
`members` lists them with their status, `remove ID` gives the credential up and forgets it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from appliance.config import Config

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
    add.add_argument("token", help="the join token from `appliance cell join-token` there")
    add.add_argument("--role", default="unified", choices=("unified", "prefill", "decode"))
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
    router = csub.add_parser("exec-router", parents=[common],
                             help="exec the head's router spec (appliance-router.service)")
    router.add_argument("--spec", type=Path,
                        help="default: <state_dir>/router/router-spec.json")
    router.add_argument("--router-dir", type=Path, default=None,
                        help="the only directory whose Python the spec may run "
                             "(default /opt/appliance/router, what the installer builds)")


def run(args: argparse.Namespace, config: Config) -> int:
    from appliance.engine.cli import checked, daemon_api

    command = args.cell_command
    if command == "exec-router":
        from appliance.cell.router import router_spec_path
        from appliance.cell.router_exec import exec_router

        exec_router(args.spec or router_spec_path(config.paths.state_dir), args.router_dir)
    with daemon_api(config, f"cell {command}") as api:
        if command == "join-token":
            body = checked(api.post(f"{API}/join-tokens"), "cell_api")
            return _print(args, body, lambda b: f"{b['token']}\nvalid until {b['expires_at']}, "
                          "once: on the head, `appliance cell add THIS_BOX_ADDRESS TOKEN`")
        if command == "add":
            body = checked(api.post(f"{API}/members", json={
                "address": args.address, "token": args.token, "role": args.role,
                "verify_tls": args.verify_tls}), "cell_api")
            return _print(args, body, lambda b: f"member {b['id']} added: {b['address']} "
                          f"({b['role']}), credential {b['credential']}")
        if command == "members":
            answer = api.get(f"{API}/members")
            listing = answer.json() if answer.status_code < 400 else checked(answer, "cell_api")
            return _print(args, listing, describe_members)
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
        return "this box has no cell members (add one with `appliance cell add ADDRESS TOKEN`)"
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
