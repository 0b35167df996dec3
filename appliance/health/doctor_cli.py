"""`appliance doctor [--json]`: every health check once, here and now, without the daemon.

    appliance doctor          a readable report: a line per check, hints indented
    appliance doctor --json   the same as one JSON document (`doctor.Report.to_json`)

Exit status: 0 when no check is CRITICAL (warnings allowed), 1 when any is. Configuration
problems exit 78 before the doctor runs, like every command. See `appliance.health.doctor`
for what is checked.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

from appliance.config import Config
from appliance.health.model import Level

EXIT_CRITICAL = 1

EPILOG = ("Exit status: 0 when no check is CRITICAL (warnings allowed), 1 when any is. The "
          "first thing to run on a new box; attach `--json` to a support request.")


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    doctor = sub.add_parser("doctor", parents=[common], epilog=EPILOG,
                            help="run every health check once (GPUs, engine, host, database, "
                                 "weights) and report; exits 1 on CRITICAL")
    doctor.add_argument("--json", action="store_true",
                        help="print one JSON document instead of the readable report")


def run(args: argparse.Namespace, config: Config) -> int:
    from appliance.health.doctor import render, run_doctor

    report = asyncio.run(run_doctor(config))
    if args.json:
        print(json.dumps(report.to_json(), indent=2, ensure_ascii=False))
    else:
        print(render(report))
    return EXIT_CRITICAL if report.overall is Level.CRITICAL else 0
