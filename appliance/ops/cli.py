"""`appliance support-bundle [--since 24h] [--out FILE]`: the support bundle from a terminal.

Needs no daemon: it reads the configuration, the database and the files itself, because a
box that will not start is when a bundle is needed most. Run it as root (or the `appliance`
user) to include what only they may read (secrets are read to redact them, never written).
"""

from __future__ import annotations

import argparse
import datetime as dt
import getpass
import os
import sys
from pathlib import Path
from typing import Any

from appliance.config import Config
from appliance.sizes import bytes_text


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    cmd = sub.add_parser(
        "support-bundle", parents=[common],
        help="write a .tar.gz of versions, redacted configuration, logs and state for support")
    cmd.add_argument("--since", default="24h",
                     help="how far back logs, journal, health changes and counters go: a span "
                          "(24h, 90m, 7d) or an ISO date (default 24h)")
    cmd.add_argument("--out", type=Path, default=None,
                     help="the file to write (default ./appliance-support-<host>-<time>.tar.gz)")
    cmd.add_argument("--lines", type=int, default=None, help=argparse.SUPPRESS)  # tests


def _actor() -> str:
    try:
        return f"cli:{getpass.getuser()}"
    except Exception:
        return f"cli:uid{os.getuid()}"


def run(args: argparse.Namespace, config: Config) -> int:
    from appliance.ops.bundle import LOG_LINES, build, default_name, parse_since

    now = dt.datetime.now(dt.UTC)
    since = parse_since(args.since, now)
    out = args.out or Path.cwd() / f"{default_name(now)}.tar.gz"
    bundle = build(config, out, actor=_actor(), since=since, now=now,
                   log_lines=args.lines or LOG_LINES)
    print(f"appliance: support bundle written to {bundle.path} ({bytes_text(bundle.size)}, "
          f"{len(bundle.files)} files)")
    if bundle.skipped:
        print(f"appliance: {len(bundle.skipped)} parts were not collected; README.txt inside "
              "says why (" + ", ".join(s.what for s in bundle.skipped) + ")", file=sys.stderr)
    if bundle.audit_error:
        print(f"appliance: the bundle was not audited: {bundle.audit_error}", file=sys.stderr)
    print("appliance: secrets and prompt text were redacted (see README.txt inside); read it "
          "before you send it")
    return 0
