"""`appliance support-bundle [--since 24h] [--out FILE]`: the support bundle from a terminal.

Needs no daemon: it reads the configuration, the database and the files itself, because a
box that will not start is when a bundle is needed most. When the daemon answers, its live
health snapshot is asked of it too (with a 2-minute viewer token, as `engine status` does).
Run it as root (or the `appliance` user) to include what only they may read (secrets are read
to redact them, never written).
"""

from __future__ import annotations

import argparse
import datetime as dt
import getpass
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from appliance.config import Config
from appliance.sizes import bytes_text

if TYPE_CHECKING:
    from appliance.ops.bundle import Part


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


def live_parts(config: Config) -> tuple[list[Part], str]:
    """What only a running daemon knows (its current health snapshot), asked of it over its
    API like other daemon-backed commands; or none, and why (it does not answer, or refused)."""
    import httpx

    from appliance.engine.cli import checked, daemon_api
    from appliance.errors import ApplianceError
    from appliance.ops.bundle import Part
    from appliance.ops.restore import answers

    where = f"port {config.server.port}"
    if not answers(config.server.host, config.server.port):
        return [], f"the daemon does not answer on {where} (the bundle was made without it)"
    try:
        with daemon_api(config, "support-bundle") as api:
            body = checked(api.get("/api/v1/health"), "health")
    except ApplianceError as exc:
        return [], f"the daemon on {where} was not asked: {exc.message} ({exc.hint})"
    except (httpx.HTTPError, ValueError) as exc:
        return [], f"the daemon on {where} gave no health snapshot: {type(exc).__name__}: {exc}"
    return [Part("health/current.json", (json.dumps(body, indent=2) + "\n").encode(),
                 f"the running daemon's current health snapshot (asked on {where}): every "
                 "check, GPUs, engine and host figures")], ""


def run(args: argparse.Namespace, config: Config) -> int:
    from appliance.ops.bundle import LOG_LINES, build, default_name, parse_since

    now = dt.datetime.now(dt.UTC)
    since = parse_since(args.since, now)
    out = args.out or Path.cwd() / f"{default_name(now)}.tar.gz"
    extra, note = live_parts(config)
    bundle = build(config, out, actor=_actor(), since=since, now=now, extra=extra,
                   daemon_note=note, log_lines=args.lines or LOG_LINES)
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
