"""`appliance qualify …`: qualify the box from a shell, through the daemon's admin API.

`status` (the default) says whether the running engine is qualified and what runs; `list`
the ledger; `show ID` one qualification's step table; `cancel` stops a run; `run` starts one.
`run` without `--yes` prints what it would do and how long (the gateway refuses users
meanwhile) and asks for `--yes`; with it, it follows the run to its end (Ctrl-C cancels the
qualification) unless `--detach`, however long it takes (the CLI's token is renewed while it
follows). A run that ends without a qualified point exits 1. `run --continue` climbs on from
a qualification whose every step passed ("at least N").
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import httpx

from appliance.config import Config
from appliance.errors import EX_USAGE, ApplianceError

API = "/api/v1/qualify"
POLL_SECONDS = 2.0


def _ladder(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a list of whole numbers such as 1,2,4,8") from None
    if not values:
        raise argparse.ArgumentTypeError("give at least one step, e.g. 1,2,4,8")
    return values


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    qualify = sub.add_parser("qualify", parents=[common],
                             help="measure the concurrency at which every user keeps a floor")
    qsub = qualify.add_subparsers(dest="qualify_command")
    qualify.set_defaults(qualify_command="status", json=False)
    status = qsub.add_parser("status", parents=[common], help="standing and any run")
    status.add_argument("--json", action="store_true")
    listing = qsub.add_parser("list", parents=[common], help="every qualification")
    listing.add_argument("--json", action="store_true")
    show = qsub.add_parser("show", parents=[common], help="one qualification's step table")
    show.add_argument("id", type=int)
    show.add_argument("--json", action="store_true")
    cancel = qsub.add_parser("cancel", parents=[common], help="stop the running one")
    cancel.add_argument("--json", action="store_true")
    run = qsub.add_parser("run", parents=[common], help="run a qualification (the gateway "
                          "refuses users meanwhile)")
    run.add_argument("--floor", type=float, default=32.0,
                     help="decode tokens/s every user must keep, at p10 (default 32)")
    run.add_argument("--ttft-p90-max", type=float, default=None, metavar="S",
                     help="time to first token SLO at p90, seconds (default: the "
                          "interactive class's TTFT SLO when one is configured, else none)")
    run.add_argument("--no-ttft-slo", action="store_true",
                     help="hold the decode floor alone, whatever the classes promise")
    run.add_argument("--repeats", type=int, default=3, help="rounds per step (default 3)")
    run.add_argument("--ladder", type=_ladder, default=None, metavar="1,2,4,…",
                     help="the concurrencies (default 1,2,4,8,16,24,32,48,64,… up to the "
                          "engine's max_running_requests)")
    run.add_argument("--workload", default="harsh", metavar="harsh|profile:NAME|replay",
                     help="harsh (8,192 in / 1,000 out, the default), a tuning profile's "
                          "lengths, or a replay of this box's recorded traffic")
    run.add_argument("--input-tokens", type=int, default=None, help="the harsh load's prompt")
    run.add_argument("--output-tokens", type=int, default=None, help="the harsh load's answer")
    run.add_argument("--wedge-seconds", type=float, default=60.0,
                     help="no token on any stream this long ends a step as wedged")
    run.add_argument("--yes", action="store_true",
                     help="confirm: the gateway refuses users for the whole run")
    run.add_argument("--continue", dest="continue_ladder", action="store_true",
                     help="climb on from the running configuration's qualification whose "
                          "every step passed (\"at least N\"): its steps are kept, the ones "
                          "above N measured, with its settings")
    run.add_argument("--detach", action="store_true", help="start it and return")
    run.add_argument("--json", action="store_true")


def run(args: argparse.Namespace, config: Config) -> int:
    from appliance.engine.cli import checked, daemon_api

    command = args.qualify_command
    with daemon_api(config, f"qualify {command}") as api:
        if command == "status":
            return _print(args, checked(api.get(f"{API}/"), "qualify_api"), describe_status)
        if command == "list":
            return _print(args, checked(api.get(f"{API}/"), "qualify_api"), describe_list)
        if command == "show":
            return _print(args, checked(api.get(f"{API}/{args.id}"), "qualify_api"),
                          describe_record)
        if command == "cancel":
            return _print(args, checked(api.post(f"{API}/cancel"), "qualify_api"),
                          lambda b: "cancelling: the gateway admits users again once the "
                          "round in progress stops" if b["cancelled"]
                          else "no qualification is running")
        return run_qualification(api, args)


def _print(args: argparse.Namespace, body: dict[str, Any], words: Any) -> int:
    print(json.dumps(body, indent=2) if args.json else words(body))
    return 0


def _body(args: argparse.Namespace) -> dict[str, Any]:
    return {"floor": args.floor, "ttft_p90_max": args.ttft_p90_max,
            "no_ttft_slo": bool(getattr(args, "no_ttft_slo", False)), "repeats": args.repeats,
            "ladder": args.ladder, "workload": args.workload,
            "input_tokens": args.input_tokens, "output_tokens": args.output_tokens,
            "wedge_seconds": args.wedge_seconds}


def run_qualification(api: httpx.Client, args: argparse.Namespace) -> int:
    from appliance.engine.cli import checked

    body = _body(args)
    if getattr(args, "continue_ladder", False):
        body["continue_from"] = _continuable(api)
    if not args.yes:
        planned = checked(api.post(f"{API}/plan", json=body), "qualify_api")
        if args.json:
            print(json.dumps(planned, indent=2))
        else:
            print(f"would qualify the running engine (spec {planned['spec_hash'][:12]}): "
                  f"{planned['summary']}")
        raise ApplianceError("confirmation_required", "nothing was started",
                             "repeat with --yes to run it", exit_code=EX_USAGE)
    started = checked(api.post(f"{API}/run", json={**body, "confirm": True}), "qualify_api")
    qid = started["id"]
    if not args.json:
        print(f"qualification {qid} started; the gateway refuses users until it ends")
    if args.detach:
        if args.json:
            print(json.dumps(started, indent=2))
        return 0
    record = follow(api, qid, quiet=args.json)
    if args.json:
        print(json.dumps(record, indent=2))
    else:
        print(describe_record(record))
    return 0 if record["state"] == "done" and record["qualified"] is not None else 1


def _continuable(api: httpx.Client) -> int:
    """The running configuration's qualification to continue (a lower bound), or why none."""
    from appliance.engine.cli import checked

    current = checked(api.get(f"{API}/"), "qualify_api").get("qualification")
    if not current or not current.get("lower_bound"):
        raise ApplianceError("qualify_invalid", "there is no ladder to continue: the running "
                             "configuration has no qualification whose every step passed",
                             "run a new one with `appliance qualify run`", exit_code=EX_USAGE)
    return int(current["id"])


def follow(api: httpx.Client, qid: int, *, quiet: bool) -> dict[str, Any]:
    """Poll until qualification `qid` ends, printing each step as it is measured; Ctrl-C
    cancels it (and still waits for the end, so the gateway is open when this returns)."""
    from appliance.engine.cli import checked

    shown = 0
    cancelled = False
    while True:
        try:
            record = checked(api.get(f"{API}/{qid}"), "qualify_api")
            for step in record["steps"][shown:]:
                if not quiet:
                    print(step_line(step, record["settings"]["floor"]), flush=True)
            shown = len(record["steps"])
            if record["state"] != "running":
                return record
            time.sleep(POLL_SECONDS)
        except KeyboardInterrupt:
            if cancelled:
                raise
            cancelled = True
            print("cancelling the qualification (Ctrl-C again to stop following it)",
                  flush=True)
            checked(api.post(f"{API}/cancel"), "qualify_api")


def _f(value: float | None, fmt: str = "{:.1f}") -> str:
    return "-" if value is None else fmt.format(value)


def step_line(step: dict[str, Any], floor: float) -> str:
    users = "user " if step["concurrency"] == 1 else "users"
    mark = "pass" if step["passed"] else "FAIL"
    line = (f"{step['concurrency']:>5} {users}  {mark}  per-user p10 "
            f"{_f(step['decode_p10'])} tok/s (floor {floor:g})  output "
            f"{_f(step['output_tps'], '{:,.0f}')} tok/s  TTFT p90 "
            f"{_f(step['ttft_p90'], '{:.2f}')} s")
    if step["reasons"]:
        line += "\n             " + "\n             ".join(step["reasons"])
    return line


def describe_record(record: dict[str, Any]) -> str:
    settings = record["settings"]
    lines = [f"qualification {record['id']} — {record['state']}",
             f"  spec {record['spec_hash'][:12]}, SGLang {record['engine_version'] or '?'}, "
             f"{record['tuning']}",
             f"  started {record['started_at']} by {record['started_by']}"
             + (f", ended {record['ended_at']}" if record["ended_at"] else ""),
             f"  floor {settings['floor']:g} tok/s per user"
             + (f", TTFT p90 ≤ {settings['ttft_p90_max']:g} s" if settings["ttft_p90_max"]
                else "") + f", {settings['repeats']} repeats per step"]
    lines += [step_line(s, settings["floor"]) for s in record.get("steps", [])]
    if record.get("ttft_at_point") is not None:
        slo = record.get("ttft_slo")
        lines.append(f"  first token at the point: {record['ttft_at_point']:.2f} s (p90)"
                     + (f", SLO {slo:g} s" if slo is not None else ", no TTFT SLO held"))
    lines.append(record["verdict"] or record["state"])
    if record["error"]:
        lines.append(f"error: {record['error']}")
    return "\n".join(lines)


def describe_status(body: dict[str, Any]) -> str:
    lines = [body["standing"]]
    progress = body.get("progress")
    if progress:
        lines.append(f"running: qualification {progress['id']}, step "
                     f"{progress['steps_done'] + 1} of {progress['steps_total']}"
                     + (f" ({progress['concurrency']} users, repeat {progress['repeat']})"
                        if progress["concurrency"] else "") + f": {progress['phase']}")
        lines.append("the gateway refuses users until it ends; `appliance qualify cancel` "
                     "stops it")
    elif body["qualified"] is None and body["spec_hash"]:
        lines.append("run one with `appliance qualify run` (it says how long first)")
    elif (body.get("qualification") or {}).get("lower_bound"):
        lines.append(f"continue the ladder from {body['qualified']} with `appliance qualify "
                     "run --continue` (it says how long first)")
    return "\n".join(lines)


def describe_list(body: dict[str, Any]) -> str:
    history = body["history"]
    if not history:
        return "no qualification has run on this box"
    lines = [f"{'id':>4}  {'started':<25} {'state':<11} {'spec':<12}  verdict"]
    for r in history:
        lines.append(f"{r['id']:>4}  {r['started_at']:<25} {r['state']:<11} "
                     f"{r['spec_hash'][:12]:<12}  {r['verdict']}")
    return "\n".join(lines)
