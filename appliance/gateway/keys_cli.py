"""`appliance keys …`: the gateway's API keys from the box's shell, straight on the database
(no daemon needed), like `appliance token`.

    appliance keys create --name N [--owner O] [--expires 2027-01-31|30d] [--class C]
                          [--max-concurrency N]
                          [--rpm N] [--tokens-per-day N] [--max-tokens N] [--json]
    appliance keys list [--json]
    appliance keys revoke PREFIX [--json]
    appliance keys class PREFIX CLASS
    appliance keys limits PREFIX [--max-concurrency N|none] [--rpm N|none]
                          [--tokens-per-day N|none] [--max-tokens N|none] [--json]

`create` prints the key on stdout, once (with `--json`, the same object as the admin API's
answer), and a note on stderr that it is not shown again. `limits` changes only the limits
given; `none` clears one. The changes are audited as the API's are (`keys.*`, actor
`cli:<user>`, `via: cli`), through the same functions (`appliance.api.keys`). Refused input
exits 65 (EX_DATAERR) with the cause and the next step; a misused command exits 2.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from typing import TYPE_CHECKING, Any

from appliance.config import Config
from appliance.errors import EX_DATAERR, ApplianceError

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    from appliance.api.keys import KeyView
    from appliance.db.database import Database
    from appliance.gateway.keys import KeyLimits

# (flag, field of KeyLimits, what the flag means)
LIMIT_FLAGS = (("--max-concurrency", "max_concurrency", "requests of this key at once"),
               ("--rpm", "requests_per_minute", "requests per minute"),
               ("--tokens-per-day", "tokens_per_day", "prompt + completion tokens per UTC day"),
               ("--max-tokens", "max_tokens", "cap on a request's max_tokens"))
UNITS = ("concurrent", "requests/min", "tokens/day", "max_tokens")


def _limit(text: str) -> int | None:
    """A limit as typed: a whole number of at least 1, or `none` (no limit)."""
    if text.strip().lower() == "none":
        return None
    try:
        value = int(text.replace("_", "").replace(",", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number (or none)") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is below 1 (use none for no limit)")
    return value


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    keys = sub.add_parser("keys", parents=[common],
                          help="manage the gateway's API keys (the users' credentials)")
    cmds = keys.add_subparsers(dest="keys_command", required=True)

    create = cmds.add_parser("create", parents=[common],
                             help="create a key; it is printed once, never again")
    create.add_argument("--name", required=True, help="1-64 letters, digits, spaces or . @ - _")
    create.add_argument("--owner", default="", help="who the key is for (a person or team)")
    create.add_argument("--expires", default="",
                        help="a date (2027-01-31: 00:00 UTC that day), an ISO time, or days "
                             "from now (30d); default: never")
    for flag, field, meaning in LIMIT_FLAGS:
        create.add_argument(flag, dest=field, type=_limit, default=None,
                            help=f"{meaning} (default: no limit)")
    create.add_argument("--class", dest="service_class", default="interactive",
                        help="the key's service class (default interactive; see "
                             "[gateway.classes] in docs/configuration.md)")
    create.add_argument("--json", action="store_true", help="the key and its record as JSON")

    listing = cmds.add_parser("list", parents=[common], help="the keys, newest first")
    listing.add_argument("--json", action="store_true")

    revoke = cmds.add_parser("revoke", parents=[common],
                             help="revoke a key (the gateway refuses it within a second)")
    revoke.add_argument("prefix", help="the key's 8-character prefix (see `keys list`)")
    revoke.add_argument("--json", action="store_true")

    limits = cmds.add_parser("limits", parents=[common],
                             help="change a key's limits (those given; `none` clears one)")
    limits.add_argument("prefix", help="the key's 8-character prefix (see `keys list`)")
    for flag, field, meaning in LIMIT_FLAGS:
        limits.add_argument(flag, dest=field, type=_limit, default=argparse.SUPPRESS,
                            metavar="N|none", help=meaning)
    limits.add_argument("--json", action="store_true")

    klass = cmds.add_parser("class", parents=[common],
                            help="move a key to another service class")
    klass.add_argument("prefix", help="the key's 8-character prefix (see `keys list`)")
    klass.add_argument("service_class", metavar="CLASS", help="interactive, batch, or a class "
                       "of [gateway.classes]")
    klass.add_argument("--json", action="store_true")


def _dump(value: Any) -> str:
    import msgspec

    return json.dumps(msgspec.to_builtins(value), indent=2)


def _limits_text(limits: KeyLimits) -> str:
    shown = [f"{value} {unit}" for (_, field, _), unit in zip(LIMIT_FLAGS, UNITS, strict=True)
             if (value := getattr(limits, field)) is not None]
    return ", ".join(shown) or "no limits"


def _when(at: dt.datetime | None, never: str = "never") -> str:
    return at.astimezone(dt.UTC).strftime("%Y-%m-%d %H:%M UTC") if at else never


def _table(views: list[KeyView]) -> str:
    rows = [("PREFIX", "NAME", "OWNER", "STATUS", "CLASS", "EXPIRES", "LAST USED", "LIMITS")]
    rows += [(v.prefix, v.name, v.owner or "-", v.status, v.service_class,
              _when(v.expires_at), _when(v.last_used_at), _limits_text(v.limits))
             for v in views]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=False))
                     + "  " + row[-1] for row in rows)


def run(args: argparse.Namespace, config: Config, db: Database, actor: str) -> int:
    """Run one `keys` subcommand on `db` (opened and checked by `appliance.cli`, which owns
    it: this module never imports the CLI back) as `actor`; refused input is re-raised with
    exit status 65. `db` is disposed here."""
    try:
        return _run(args, config, db, actor)
    except ApplianceError as exc:
        if exc.status >= 500:
            raise
        raise ApplianceError(exc.code, exc.message, exc.hint, status=exc.status,
                             exit_code=EX_DATAERR) from None
    finally:
        db.dispose()


def _run(args: argparse.Namespace, config: Config, db: Any, actor: str) -> int:
    from appliance.api.keys import (
        KeyView,
        class_audited,
        create_audited,
        created_view,
        limits_audited,
        parse_expiry,
        revoke_audited,
    )
    from appliance.gateway.classes import effective
    from appliance.gateway.keys import KeyLimits, list_keys
    from appliance.secrets import server_secret

    now = dt.datetime.now(dt.UTC)
    command = args.keys_command
    classes = list(effective(config.gateway.classes))
    if command == "list":
        views = [KeyView.of(info, now) for info in db.call(list_keys)]
        print(_dump(views) if args.json else (_table(views) if views else "no keys yet"))
        return 0
    if command == "revoke":
        info = db.call(lambda s: revoke_audited(s, args.prefix, now=now, actor=actor,
                                                address="", via="cli"))
        view = KeyView.of(info, now)
        print(_dump(view) if args.json else
              f"appliance: key {view.prefix} ({view.name}) revoked {_when(view.revoked_at)}"
              + (f" by {view.revoked_by}" if view.revoked_by else ""))
        return 0
    if command == "limits":
        changes = {field: getattr(args, field) for _, field, _ in LIMIT_FLAGS
                   if hasattr(args, field)}
        if not changes:
            raise ApplianceError("key_limits_nothing", "no limit was given to change",
                                 "give at least one of " + ", ".join(
                                     f"{flag} N|none" for flag, _, _ in LIMIT_FLAGS))
        info = db.call(lambda s: limits_audited(s, args.prefix, changes, now=now, actor=actor,
                                                address="", via="cli"))
        view = KeyView.of(info, now)
        print(_dump(view) if args.json else
              f"appliance: key {view.prefix} ({view.name}): {_limits_text(view.limits)}")
        return 0
    if command == "class":
        info = db.call(lambda s: class_audited(s, args.prefix, args.service_class, classes,
                                               now=now, actor=actor, address="", via="cli"))
        view = KeyView.of(info, now)
        print(_dump(view) if args.json else
              f"appliance: key {view.prefix} ({view.name}) is now {view.service_class}")
        return 0
    # create
    expires = parse_expiry(args.expires, now)
    limits = KeyLimits(**{field: getattr(args, field) for _, field, _ in LIMIT_FLAGS})
    secret = server_secret(config.paths.state_dir)

    def create(s: Session) -> tuple[str, Any]:
        return create_audited(s, secret, name=args.name, owner=args.owner,
                              expires_at=expires, limits=limits, now=now, actor=actor,
                              address="", via="cli", service_class=args.service_class,
                              classes=classes)

    key, info = db.call(create)
    print(_dump(created_view(key, info, now)) if args.json else key)
    print(f"appliance: key {info.prefix} ({info.name}) created; expires "
          f"{_when(info.expires_at)}; {info.service_class}; {_limits_text(info.limits)}. It is "
          "shown only now: "
          "store it safely.", file=sys.stderr)
    return 0

