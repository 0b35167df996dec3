"""`appliance cell plan`: what each mix of boxes would serve, through the daemon's admin API
(`GET /api/v1/cell/plan`, appliance.api.cell_plan; viewer and up).

`--profile NAME` (default: the box's current tuning profile), `--mix 1P+3D` (repeatable; added
to 1 unified, 1P+1D, 1P+2D and 2 unified), `--floor 32`, `--json`. Each figure is marked
measured or predicted, and the lines under the table say on what.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from appliance.config import Config

API = "/api/v1/cell/plan"


def add_plan_parser(csub: Any, common: argparse.ArgumentParser) -> None:
    plan = csub.add_parser("plan", parents=[common],
                           help="what each mix of boxes (1 unified, 1P+1D, ...) would serve")
    plan.add_argument("--profile", help="a tuning profile (default: the box's current one)")
    plan.add_argument("--mix", action="append", default=[],
                      help="another mix to plan, e.g. 1P+3D or 3U (repeatable)")
    plan.add_argument("--floor", type=float, default=None,
                      help="tokens/s every user must hold (default 32, as qualification)")
    plan.add_argument("--json", action="store_true")


def run_plan(args: argparse.Namespace, config: Config) -> int:
    from appliance.engine.cli import checked, daemon_api

    params: dict[str, Any] = {"mix": args.mix}
    if args.profile:
        params["profile"] = args.profile
    if args.floor is not None:
        params["floor"] = args.floor
    with daemon_api(config, "cell plan") as api:
        body = checked(api.get(API, params=params), "cell_plan")
    print(json.dumps(body, indent=2) if args.json else describe_plan(body))
    return 0


def _figure(figure: dict[str, Any], unit: str, digits: str = "{:,.0f}") -> str:
    value = figure["value"]
    shown = "unbounded" if value is None else digits.format(value) + unit
    return f"{shown} ({figure['kind']})"


def describe_plan(body: dict[str, Any]) -> str:
    """The plan as a table, then the basis of each measured figure and the model's."""
    head = ("mix", "users at the floor", "output tok/s", "TTFT", "limited by")
    rows = [(m["mix"], _figure(m["users"], ""), _figure(m["output_tps"], ""),
             _figure(m["ttft_seconds"], " s", "{:,.1f}"), m["limited_by"])
            for m in body["mixes"]]
    widths = [max(len(r[i]) for r in (head, *rows)) for i in range(4)]
    lines = [f"cell plan for {body['profile_title']} ({body['profile']}): a mean request of "
             f"{body['prompt_tokens']:,} tokens in and {body['output_tokens']:,} out; every "
             f"user at or above {body['floor']:g} tokens/s", ""]
    for row in (head, *rows):
        lines.append("  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row[:4]))
                     + "  " + row[4])
    # Each figure not the model's own says where it came from, once.
    sources = sorted({(f["kind"], f["basis"]) for m in body["mixes"]
                      for f in (m["users"], m["output_tps"], m["ttft_seconds"])
                      if f["model"] is not None})
    cited = [f"measured elsewhere: {r['mix']}: {r['output_tps']:,.0f} output tok/s at "
             f"{r['users']} users ({r['basis']})" for r in body["references"]]
    if not sources:
        lines += ["", "predicted only: nothing in this table is measured on this box yet; "
                  "every figure, one box's included, is the model's prediction (a "
                  "qualification measures one box)"]
    lines += ["", *(f"{kind}: {basis}" for kind, basis in sources),
              f"predicted: {body['basis']}", *cited,
              "assumptions: " + "; ".join(body["assumptions"])]
    return "\n".join(lines)
