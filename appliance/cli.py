"""The `appliance` command: serve, gateway, migrate, admin accounts and admin API tokens.

Configuration is loaded here, once, and passed down. Every failure a person can cause prints
one message with its cause and the next step, and exits with a sysexits code (78 for
configuration, so systemd does not restart into the same mistake).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import getpass
import logging
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from appliance import __version__
from appliance.config import Config, load_config
from appliance.errors import EX_USAGE, ApplianceError

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    from appliance.db.database import Database

Handler = Callable[[argparse.Namespace, Config], int]


def _operator() -> str:
    try:
        return f"cli:{getpass.getuser()}"
    except Exception:
        return f"cli:uid{os.getuid()}"


def cmd_serve(args: argparse.Namespace, config: Config) -> int:
    return serve(config)


def serve(config: Config, **overrides: Any) -> int:
    """Run the control plane; `overrides` go to `build_runtime` (the demo's fake GPUs)."""
    from appliance.auth.bootstrap import ensure_first_admin
    from appliance.db.schema import check_schema
    from appliance.lock import InstanceLock
    from appliance.runtime import build_runtime
    from appliance.server import run_server

    lock = InstanceLock(config.paths.state_dir)
    lock.acquire()
    try:
        runtime = build_runtime(config, **overrides)
        check_schema(runtime.db, runtime.migrations)
        now = runtime.clock.now()
        created = runtime.db.call(lambda s: ensure_first_admin(s, config.paths.state_dir, now))
        if created is not None:
            # Printed once, to the terminal/journal: where the credential is, never what it is.
            print(f"appliance: first start: the one-time admin login is in {created} "
                  "(readable by this user only)", file=sys.stderr, flush=True)
        asyncio.run(run_server(runtime))
        runtime.db.dispose()
    finally:
        lock.release()
    return 0


def cmd_migrate(args: argparse.Namespace, config: Config) -> int:
    from appliance.lock import InstanceLock

    # Never under a running daemon: it would serve on a schema it does not match, and a
    # restore after a failed step would discard what it wrote since the backup.
    lock = InstanceLock(config.paths.state_dir)
    lock.acquire()
    try:
        return _migrate_locked(args, config)
    finally:
        lock.release()


def _migrate_locked(args: argparse.Namespace, config: Config) -> int:
    from appliance.db.database import Database
    from appliance.db.journal import add_audit, add_event
    from appliance.db.schema import migrate
    from appliance.resources import migrations_dir

    db = Database(config.database_url)
    now = dt.datetime.now(dt.UTC)
    script = Path(args.migrations) if args.migrations else migrations_dir()
    result = migrate(db, script, config.paths.state_dir / "backups", now)
    if result.before == result.after:
        print(f"appliance: database already at schema {result.after}; nothing to do")
        db.dispose()
        return 0
    message = f"database migrated from {result.before or 'empty'} to {result.after}"

    def record(s: Session) -> None:
        add_event(s, at=now, severity="info", source="database", message=message,
                  detail={"backup": str(result.backup) if result.backup else None})
        add_audit(s, at=now, actor=_operator(), action="db.migrate", target=result.after,
                  detail={"from": result.before})

    db.call(record)
    print(f"appliance: {message}")
    if result.backup:
        print(f"appliance: the previous database was copied to {result.backup}")
    db.dispose()
    return 0


def _read_password(args: argparse.Namespace) -> str:
    if args.password_stdin:
        return sys.stdin.readline().rstrip("\n")
    if not sys.stdin.isatty():
        raise ApplianceError("no_terminal", "no terminal to ask for the password",
                             "pass --password-stdin and pipe the password in", exit_code=EX_USAGE)
    first = getpass.getpass("New password: ")
    if getpass.getpass("Repeat it: ") != first:
        raise ApplianceError("password_mismatch", "the two passwords differ",
                             "run the command again", exit_code=EX_USAGE)
    return first


def _database(config: Config) -> Database:
    from appliance.db.database import Database
    from appliance.db.schema import check_schema
    from appliance.resources import migrations_dir

    db = Database(config.database_url)
    check_schema(db, migrations_dir())
    return db


def cmd_admin(args: argparse.Namespace, config: Config) -> int:
    from appliance.auth.accounts import create_admin, list_admins, set_password, set_role
    from appliance.auth.bootstrap import BOOTSTRAP_USER, retire_bootstrap_file
    from appliance.db.journal import add_audit

    db = _database(config)
    now = dt.datetime.now(dt.UTC)
    if args.admin_command == "list":
        admins = db.call(list_admins)
        if not admins:
            print("appliance: no console accounts yet; add one with `appliance admin create "
                  "--username NAME --password-stdin`", file=sys.stderr)
            return 0
        rows = [(a.username, a.role.value, f"{a.created_at:%Y-%m-%d %H:%M} UTC",
                 "must change password" if a.must_change_password else "active")
                for a in admins]
        head = ("USERNAME", "ROLE", "CREATED", "STATE")
        widths = [max(len(row[i]) for row in [head, *rows]) for i in range(3)]
        for row in [head, *rows]:
            print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False))
                  + "  " + row[3])
        return 0
    username = args.username.strip().lower()
    if args.admin_command == "set-role":

        def change(s: Session) -> str:
            before, _ = set_role(s, username, args.role)
            add_audit(s, at=now, actor=_operator(), action="admin.set_role", target=username,
                      detail={"from": before.value, "to": args.role})
            return before.value

        before = db.call(change)
        print(f"appliance: {username!r} is now {args.role} (was {before})")
        return 0
    password = _read_password(args)
    action = "admin.create" if args.admin_command == "create" else "admin.reset_password"

    def apply(s: Session) -> None:
        if args.admin_command == "create":
            create_admin(s, username, password, now, role=args.role)
        else:
            set_password(s, username, password, now)
        add_audit(s, at=now, actor=_operator(), action=action, target=username,
                  detail={"role": args.role} if args.admin_command == "create" else None)

    db.call(apply)
    if args.admin_command == "create":
        print(f"appliance: admin {username!r} created, role {args.role}")
    else:
        if username == BOOTSTRAP_USER:
            retire_bootstrap_file(config.paths.state_dir)
        print(f"appliance: password of {username!r} replaced; their sessions were ended")
    return 0


def cmd_token(args: argparse.Namespace, config: Config) -> int:
    from appliance.auth.accounts import list_admins
    from appliance.auth.tokens import create_token, list_tokens, revoke_token
    from appliance.db.journal import add_audit
    from appliance.secrets import server_secret

    db = _database(config)
    now = dt.datetime.now(dt.UTC)
    if args.token_command == "list":
        for info in db.call(list_tokens):
            state = "revoked" if info.revoked_at else (
                "expired" if not info.active(now) else "active")
            print(f"{info.prefix}\t{info.name}\towner {info.owner}\t{state}\t{info.role.value}")
        return 0
    if args.token_command == "revoke":

        def revoke(s: Session) -> None:
            revoke_token(s, args.prefix, now)
            add_audit(s, at=now, actor=_operator(), action="token.revoke", target=args.prefix)

        db.call(revoke)
        print(f"appliance: token {args.prefix} revoked")
        return 0
    secret = server_secret(config.paths.state_dir)
    expires = now + dt.timedelta(days=args.expires_days) if args.expires_days else None

    def create(s: Session) -> str:
        owners = {a.username: a for a in list_admins(s)}
        if args.owner not in owners:
            raise ApplianceError("admin_unknown", f"there is no admin named {args.owner!r}",
                                 "tokens act for an admin; see `appliance admin list`",
                                 exit_code=EX_USAGE)
        token, info = create_token(s, secret, owners[args.owner], args.name, now, expires,
                                   args.role)
        add_audit(s, at=now, actor=_operator(), action="token.create", target=info.prefix,
                  detail={"name": info.name, "owner": args.owner, "role": info.role.value})
        return token

    token = db.call(create)
    print(token)
    print("appliance: this token is shown once; store it now", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", type=Path, default=argparse.SUPPRESS,
                        help="configuration file (default /etc/appliance/appliance.toml)")
    common.add_argument("--dev", action="store_true", default=argparse.SUPPRESS,
                        help="development profile: everything under ./.appliance/")
    parser = argparse.ArgumentParser(prog="appliance", parents=[common],
                                     description="The Kimi K3 appliance daemon and tools.")
    parser.add_argument("--version", action="version", version=f"appliance {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    sub.add_parser("serve", parents=[common], help="run the control plane (admin UI and API)")
    sub.add_parser("gateway", parents=[common],
                   help="run the data plane: the OpenAI-compatible endpoint for users")
    migrate = sub.add_parser("migrate", parents=[common],
                             help="upgrade the database schema (backs SQLite up first)")
    migrate.add_argument("--migrations", help=argparse.SUPPRESS)  # tests: another script dir

    from appliance.auth.roles import ROLE_NAMES as roles
    admin = sub.add_parser("admin", parents=[common],
                           help="manage console accounts and their roles")
    admin_sub = admin.add_subparsers(dest="admin_command", required=True)
    admin_help = {"create": "add a console account (asks for its password)",
                  "reset-password": "set an account's password and end its sessions"}
    for name in ("create", "reset-password"):
        cmd = admin_sub.add_parser(name, parents=[common], help=admin_help[name])
        cmd.add_argument("--username", required=True)
        cmd.add_argument("--password-stdin", action="store_true",
                         help="read the password from the first line of standard input")
        if name == "create":
            cmd.add_argument("--role", choices=roles, default="admin",
                             help="viewer (reads), operator (runs the box), admin (all)")
    set_role = admin_sub.add_parser("set-role", parents=[common],
                                    help="give an account another role")
    set_role.add_argument("--username", required=True)
    set_role.add_argument("--role", choices=roles, required=True)
    admin_sub.add_parser("list", parents=[common],
                         help="list the console accounts: username, role, created, state")

    token = sub.add_parser("token", parents=[common], help="manage admin API tokens")
    token_sub = token.add_subparsers(dest="token_command", required=True)
    create = token_sub.add_parser("create", parents=[common])
    create.add_argument("--name", required=True)
    create.add_argument("--owner", default="admin", help="the admin the token acts for")
    create.add_argument("--expires-days", type=int, default=0)
    create.add_argument("--role", choices=roles, default=None,
                        help="what the token may do (default and ceiling: its owner's role)")
    token_sub.add_parser("list", parents=[common])
    revoke = token_sub.add_parser("revoke", parents=[common])
    revoke.add_argument("prefix")

    from appliance.engine import cli as engine_cli

    engine_cli.add_parser(sub, common)
    from appliance.weights import cli as weights_cli

    weights_cli.add_parser(sub, common)
    from appliance.tuning import cli as tuning_cli

    tuning_cli.add_parser(sub, common)
    from appliance.gateway import keys_cli

    keys_cli.add_parser(sub, common)
    from appliance.health import doctor_cli

    doctor_cli.add_parser(sub, common)
    from appliance.qualify import cli as qualify_cli

    qualify_cli.add_parser(sub, common)
    from appliance.ops import cli as ops_cli

    ops_cli.add_parser(sub, common)
    from appliance.ops import backup_cli

    backup_cli.add_parser(sub, common)
    from appliance.cell import cli as cell_cli

    cell_cli.add_parser(sub, common)
    return parser


def cmd_engine(args: argparse.Namespace, config: Config) -> int:
    from appliance.engine import cli as engine_cli

    return engine_cli.run(args, config)


def cmd_weights(args: argparse.Namespace, config: Config) -> int:
    from appliance.weights import cli as weights_cli

    return weights_cli.run(args, config)


def cmd_tune(args: argparse.Namespace, config: Config) -> int:
    from appliance.tuning import cli as tuning_cli

    return tuning_cli.run(args, config)


def cmd_keys(args: argparse.Namespace, config: Config) -> int:
    from appliance.gateway import keys_cli

    return keys_cli.run(args, config, _database(config), _operator())


def cmd_doctor(args: argparse.Namespace, config: Config) -> int:
    from appliance.health import doctor_cli

    return doctor_cli.run(args, config)


def cmd_qualify(args: argparse.Namespace, config: Config) -> int:
    from appliance.qualify import cli as qualify_cli

    return qualify_cli.run(args, config)


def cmd_support_bundle(args: argparse.Namespace, config: Config) -> int:
    from appliance.ops import cli as ops_cli

    return ops_cli.run(args, config)


def cmd_backup(args: argparse.Namespace, config: Config) -> int:
    from appliance.ops import backup_cli

    return backup_cli.run(args, config)


def cmd_cell(args: argparse.Namespace, config: Config) -> int:
    from appliance.cell import cli as cell_cli

    return cell_cli.run(args, config)


def cmd_gateway(args: argparse.Namespace, config: Config) -> int:
    from appliance.gateway.serve import run_gateway

    return run_gateway(config)


HANDLERS: dict[str, Handler] = {
    "serve": cmd_serve, "gateway": cmd_gateway, "migrate": cmd_migrate, "admin": cmd_admin,
    "token": cmd_token,
    "engine": cmd_engine, "weights": cmd_weights, "tune": cmd_tune, "keys": cmd_keys,
    "doctor": cmd_doctor, "qualify": cmd_qualify,
    "support-bundle": cmd_support_bundle,
    "backup": cmd_backup, "restore": cmd_backup, "cell": cmd_cell,
}


EX_PIPE = 141  # what a shell reports for a command SIGPIPE ended (128 + 13)


def main(argv: Sequence[str] | None = None) -> int:
    """The entry point. A reader that leaves early (`appliance ... --json | head`) ends the
    command quietly with the shell's SIGPIPE status, never a BrokenPipeError traceback."""
    try:
        code = _run(argv)
        sys.stdout.flush()  # output still buffered fails here, not in the interpreter's exit
        return code
    except BrokenPipeError:
        if not _stdout_reader_gone():
            raise  # a broken pipe elsewhere (a socket) is a real failure: show it
        # Python's recipe (the signal module's "Note on SIGPIPE"): stdout now points at
        # /dev/null, so the interpreter's own flush at exit cannot fail a second time.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EX_PIPE


def _stdout_reader_gone() -> bool:
    """Whether stdout is a pipe or socket whose reading end has closed (POLLERR/POLLHUP)."""
    import select

    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))
    except (OSError, ValueError, AttributeError):  # no real file behind stdout
        return False


def _run(argv: Sequence[str] | None) -> int:
    args = build_parser().parse_args(argv)
    # Files the appliance creates (database, backups, logs) are not world-readable.
    os.umask(0o027)
    try:
        if args.command == "engine" and args.engine_command == "parse-log":
            from appliance.engine import cli as engine_cli

            # A log someone sent needs no daemon and no configuration to be read.
            return engine_cli.parse_log(args.file, as_json=args.json, run=args.run)
        if args.command == "engine" and args.engine_command == "exec-spec" and args.spec:
            from appliance.engine import cli as engine_cli

            # The engine unit runs this as its own user, which may not write the daemon's
            # state or log directories (ProtectSystem=strict): the spec is all it needs.
            engine_cli.exec_spec(args.spec, args.engines_dir)
        if args.command == "cell" and args.cell_command == "exec-router" and args.spec:
            from appliance.cell.router_exec import exec_router

            # Like exec-spec: the spec (and the key file it names) is all the router needs.
            exec_router(args.spec, args.router_dir)
        # `tune` reads no state of the box unless asked: with every input on the command
        # line it needs no configuration file, like `engine parse-log`.
        reads_only = args.command == "tune"
        config = load_config(getattr(args, "config", None), dev=getattr(args, "dev", False),
                             default_file_optional=reads_only, check_dirs=not reads_only)
        logging.basicConfig(level=config.logging.level.upper(),
                            format="%(levelname)s %(name)s: %(message)s")
        # Alembic narrates every connection at INFO; `migrate` prints its own summary.
        logging.getLogger("alembic").setLevel(logging.WARNING)
        logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
        # APScheduler logs every run of every job at INFO: the health polls would fill the
        # journal with a line every few seconds. Its warnings (missed runs) still show.
        logging.getLogger("apscheduler").setLevel(logging.WARNING)
        return HANDLERS[args.command](args, config)
    except ApplianceError as exc:
        print(f"appliance: {exc.as_text()}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
