"""`appliance engine …`: the engine from a shell on the box.

status/start/stop/restart/rollback/logs talk to the running daemon's admin API on loopback
(the supervisor is the only writer of engine state) with a short-lived admin API token minted
for the call and revoked after it. parse-log reads any SGLang log, from this box or another,
without a daemon. exec-spec is what `appliance-engine.service` runs: it execs the launch spec
the daemon wrote.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import getpass
import json
import os
import sys
import time
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any, NoReturn

import httpx

from appliance.config import Config
from appliance.errors import EX_USAGE, ApplianceError
from appliance.sizes import duration_text, when_text


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    engine = sub.add_parser("engine", parents=[common], help="the SGLang engine")
    engine_sub = engine.add_subparsers(dest="engine_command", required=True)
    for name, help_text in (("status", "state, progress and memory"), ("start", "start it"),
                            ("stop", "drain and stop it"), ("restart", "stop, then start"),
                            ("rollback", "start with the last spec that reached READY")):
        cmd = engine_sub.add_parser(name, parents=[common], help=help_text)
        cmd.add_argument("--json", action="store_true", help="print JSON")
        if name != "status":
            cmd.add_argument("--at", type=_when, metavar="ISO-TIME",
                             help="run in a maintenance window, e.g. 2026-12-01T02:00:00Z")
        if name in ("stop", "restart"):
            cmd.add_argument("--yes", action="store_true",
                             help="confirm ending a running engine (a start costs ~90 min)")
    logs = engine_sub.add_parser("logs", parents=[common], help="the engine log")
    logs.add_argument("--follow", "-f", action="store_true")
    logs.add_argument("--lines", "-n", type=int, default=100)
    logs.add_argument("--rank", type=int)
    logs.add_argument("--level", choices=("info", "warning", "error"), default="")
    parse = engine_sub.add_parser("parse-log", parents=[common],
                                  help="diagnose any SGLang log file (no daemon needed)")
    parse.add_argument("file", type=Path)
    parse.add_argument("--json", action="store_true")
    parse.add_argument("--run", type=_run_choice, default="latest", metavar="N|latest|all",
                       help="which engine run of the log to read: each launch appends one "
                            "(default: the latest; all: each in turn)")
    run = engine_sub.add_parser("exec-spec", parents=[common],
                                help="exec the launch spec (appliance-engine.service's ExecStart)")
    run.add_argument("--spec", type=Path)
    run.add_argument("--engines-dir", type=Path, default=None,
                     help="the only directory whose programs the spec may run "
                          "(default /opt/appliance/engines, what the installer builds)")


def run(args: argparse.Namespace, config: Config) -> int:
    command = args.engine_command
    if command == "parse-log":
        return parse_log(args.file, as_json=args.json, run=args.run)
    if command == "exec-spec":
        return exec_spec(args.spec or config.paths.state_dir / "engine" / "launch-spec.json",
                         args.engines_dir)
    with daemon_api(config, f"engine {command}") as api:
        if command == "logs":
            return show_logs(api, args)
        if command == "status":
            status = checked(api.get("/api/v1/engine/"))
        else:
            body: dict[str, Any] = {"confirm": bool(getattr(args, "yes", False))}
            if args.at is not None:
                body["at"] = args.at.isoformat()
            status = checked(api.post(f"/api/v1/engine/{command}", json=body))
    if args.json:
        print(json.dumps(status, indent=2))
    else:
        print(describe_status(status))
    return 0


def _when(text: str) -> dt.datetime:
    try:
        moment = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not an ISO time such as 2026-12-01T02:00:00Z") from None
    if moment.tzinfo is None:
        raise argparse.ArgumentTypeError(f"{text!r} has no time zone; add Z or +01:00")
    return moment


def _run_choice(text: str) -> int | str:
    """`--run`: a run number from 1, `latest` or `all`."""
    if text in ("latest", "all"):
        return text
    try:
        number = int(text)
    except ValueError:
        number = 0
    if number < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a run: give its number (1 is the log's first), latest or all")
    return number


def parse_log(path: Path, *, as_json: bool, run: int | str = "latest") -> int:
    """Report one run of the log (the latest unless `run` names another) or, with
    run="all", every run in turn, each labelled with its number and start."""
    from appliance.engine.logparse import parse_runs, parse_text
    from appliance.engine.logreport import render_json, render_runs_text, render_text

    try:
        text = path.read_bytes().decode("utf-8", errors="replace")
    except OSError as exc:
        raise ApplianceError("log_unreadable", f"cannot read {path}: {exc.strerror or exc}",
                             "give the path of an SGLang log file", exit_code=EX_USAGE) from None
    if run == "all":
        states = parse_runs(text)
        print(json.dumps([render_json(state) for state in states], indent=2) if as_json
              else render_runs_text(states))
        return 0
    try:
        state = parse_text(text, -1 if run == "latest" else int(run))
    except ValueError as exc:
        raise ApplianceError(
            "log_run_missing", f"{path}: {exc}",
            "give --run a number the log holds (see --run all), latest or all",
            exit_code=EX_USAGE) from None
    print(json.dumps(render_json(state), indent=2) if as_json else render_text(state))
    return 0


def exec_spec(path: Path, engines_dir: Path | None = None) -> NoReturn:
    """Become the engine the launch spec describes, after checking it again as the engine's
    own user (`exec_guard`): the daemon's user writes the spec, and must not be able to make
    the engine unit run anything but SGLang from the installer's engine environment."""
    from appliance.engine.args import LaunchSpec
    from appliance.engine.exec_guard import (
        DEFAULT_ENGINES_DIR,
        check_config_file,
        check_program,
        check_spec,
    )
    from appliance.sdnotify import child_environment

    try:
        spec = LaunchSpec.from_json(path.read_text())
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise ApplianceError(
            "launch_spec_invalid", f"cannot use the launch spec {path}: {exc}",
            "start the engine from the appliance (console, API or `appliance engine start`); "
            "it writes the spec", exit_code=EX_USAGE) from None
    allowed = engines_dir or DEFAULT_ENGINES_DIR
    problems = (check_spec(spec) + check_config_file(spec, path)
                + check_program(spec.command[0], allowed))
    if problems:
        raise ApplianceError(
            "launch_spec_refused", f"refusing to run the launch spec {path}: "
            + "; ".join(problems),
            f"the engine runs only SGLang from {allowed} with SGLang's own flags: set "
            "engine.command to the installer's engine program and start the engine again",
            exit_code=EX_USAGE)
    env = child_environment()
    env.update(dict(spec.env))
    argv = spec.argv()
    sys.stdout.flush()
    os.execvpe(argv[0], argv, env)  # noqa: S606 - the whole point: become the engine


class _RenewedToken(httpx.Auth):
    """The call's token on every request, minted again once half its lifetime has passed:
    a command that follows a long job (a qualification) keeps working until the job ends."""

    def __init__(self, mint: Any, lifetime: float) -> None:
        self._mint, self._lifetime = mint, lifetime
        self._token, self._renew_at = "", 0.0
        self.prefixes: list[str] = []

    def renew(self) -> None:
        self._token, prefix = self._mint()
        self.prefixes.append(prefix)
        self._renew_at = time.monotonic() + self._lifetime / 2

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        if time.monotonic() >= self._renew_at:
            self.renew()
        request.headers["Authorization"] = f"Bearer {self._token}"
        yield request


@contextlib.contextmanager
def daemon_api(config: Config, command: str) -> Iterator[httpx.Client]:
    """An HTTP client to the local daemon, carrying an admin API token for this call with
    exactly the role `command` (e.g. "engine status") needs (auth/roles.py's CLI_COMMANDS): a
    read works on a box whose only ready account is a viewer. It lasts
    `server.cli_token_seconds` (2 minutes) and is minted again before it lapses while the
    call goes on. Every token the call minted is deleted when it ends, whatever happened, so
    none is left in the token list."""
    from appliance.auth.accounts import list_admins
    from appliance.auth.roles import cli_role
    from appliance.auth.tokens import CLI_TOKEN_PREFIX, create_token, drop_cli_token
    from appliance.db.database import Database
    from appliance.secrets import server_secret

    db = Database(config.database_url)
    secret = server_secret(config.paths.state_dir)
    try:
        user = getpass.getuser()
    except Exception:
        user = f"uid{os.getuid()}"

    role = cli_role(command)
    lifetime = dt.timedelta(seconds=config.server.cli_token_seconds)

    def mint(s: Any) -> tuple[str, str]:
        ready = [a for a in list_admins(s) if not a.must_change_password]
        able = [a for a in ready if a.role.allows(role)]
        if not able:
            why = ("the bootstrap password has not been changed yet" if not ready else
                   f"the ready ones are {', '.join(sorted({a.role.value for a in ready}))}")
            raise ApplianceError(
                "no_admin", f"`appliance {command}` needs an account with the {role.value} "
                f"role ready to act, and there is none ({why})",
                "log in to the console once and choose a password, or create one with "
                f"`appliance admin create --username NAME --role {role.value}`",
                exit_code=EX_USAGE)
        now = dt.datetime.now(dt.UTC)
        token, info = create_token(s, secret, able[0], f"{CLI_TOKEN_PREFIX}{user}"[:64], now,
                                   now + lifetime, role)
        return token, info.prefix

    auth = _RenewedToken(lambda: db.call(mint), lifetime.total_seconds())
    auth.renew()  # the first token now: a box without a ready account fails before any call
    server = config.server
    host = "127.0.0.1" if server.host in ("0.0.0.0", "::", "") else server.host  # noqa: S104
    scheme = "https" if config.tls else "http"
    client = httpx.Client(
        base_url=f"{scheme}://{host}:{server.port}", timeout=30, trust_env=False,
        headers={"Host": "localhost"}, auth=auth,
        verify=False,  # noqa: S501 - loopback to this box's own daemon
    )
    try:
        yield client
    except httpx.ConnectError:
        raise ApplianceError(
            "daemon_unreachable", f"the appliance daemon does not answer at {client.base_url} "
            f"(server.host and server.port of {config.source})",
            "is it running? `systemctl status appliance` (or `make demo` in development); if "
            "it listens elsewhere, point the command at its configuration with --config PATH "
            "(or set APPLIANCE_SERVER_PORT)", exit_code=75) from None
    finally:
        client.close()
        # The call's token goes with it (deleted, not revoked: it would stay listed for ever).
        def drop(s: Any) -> None:
            for prefix in auth.prefixes:
                drop_cli_token(s, prefix, dt.datetime.now(dt.UTC))

        db.call(drop)
        db.dispose()


# The API's hints name its own fields ("repeat with confirm=true"); a terminal wants the flag.
CLI_HINTS = {"confirmation_required": "repeat with --yes"}


def checked(response: httpx.Response, code: str = "engine_api") -> dict[str, Any]:
    """The daemon API's JSON answer, or its problem document raised as an ApplianceError
    (`code` when the answer names none). Shared by the CLIs that go through `daemon_api`;
    a hint that names an API field is replaced by the CLI's flag (`CLI_HINTS`)."""
    body = response.json()
    if response.status_code >= 400:
        found = str(body.get("code", code))
        raise ApplianceError(found, str(body.get("detail")),
                             CLI_HINTS.get(found, str(body.get("hint", ""))), exit_code=1)
    assert isinstance(body, dict)
    return body


def describe_status(status: dict[str, Any]) -> str:
    lines = [f"engine: {status['state'].replace('_', ' ')} — {status['message']}"]
    if status.get("pending"):
        # The API answers as soon as the command is queued: what follows is the state the
        # command found, not its outcome (`appliance engine status` shows that).
        lines.insert(0, f"requested: {status['pending']} (queued; follow it with "
                        "`appliance engine status`)")
    if status.get("scheduled"):
        planned = status["scheduled"]
        lines.append(f"scheduled: {planned['command']} at {_moment(planned['run_at'])} "
                     f"(id {planned['id']})")
    if status.get("percent") is not None and status["state"] not in ("ready", "stopped"):
        eta = status.get("eta_seconds")
        lines.append(f"progress: {status['percent']:.0f}%"
                     + (f", about {duration_text(eta)} left" if eta is not None else ""))
    if status.get("reason"):
        lines.append(f"reason: {status['reason']}; {status.get('hint', '')}")
    if status.get("next_retry_at"):
        lines.append(f"next attempt at {_moment(status['next_retry_at'])}")
    admission = status.get("admission")
    if admission and not admission.get("admitting", True):  # READY, yet users are refused
        lines.append(f"gateway: {admission['words']}")
    return "\n".join(lines)


def _moment(iso: str) -> str:
    """An API timestamp as every screen writes it (UTC, to the second); as given if odd."""
    try:
        return when_text(dt.datetime.fromisoformat(iso))
    except (TypeError, ValueError):
        return str(iso)


def show_logs(api: httpx.Client, args: argparse.Namespace) -> int:
    params: dict[str, Any] = {"lines": args.lines}
    if args.rank is not None:
        params["rank"] = args.rank
    if args.level:
        params["level"] = args.level
    for line in checked(api.get("/api/v1/engine/log", params=params))["lines"]:
        print(line)
    if args.follow:
        params.pop("lines")
        with api.stream("GET", "/api/v1/engine/log/stream", params=params,
                        timeout=None) as stream:
            for line in stream.iter_lines():
                if line.startswith("data: "):
                    print(line[6:], flush=True)
    return 0
