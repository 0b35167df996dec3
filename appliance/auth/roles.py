"""Who may do what: the three roles and the one table every route and daemon CLI command
declares against.

- `viewer`: every page and read API; no action, no secrets.
- `operator`: everything that changes the engine or the box (engine start/stop/restart/
  rollback and maintenance windows, weights pull/verify/refetch/import, health checks and
  mutes, qualification, tuning profiles and apply, the support bundle).
- `admin`: everything, plus accounts, gateway API keys, admin API tokens, configuration.

`ROUTES` maps each route, by method and path template as Litestar routes it (`/engine/{action}`,
no converter), to the least role it needs, or `PUBLIC` for the few that need no login (they
are the auth middleware's public paths). `appliance.auth.guards.require_role`, the app-wide
guard, enforces it; a route missing here is refused to everyone but an admin at run time and
fails `tests/test_roles.py`, which walks the app's routes. Litestar's generated OPTIONS
answers need no role (they only list the methods).

`CLI_COMMANDS` names, for each CLI command that goes through the daemon, the routes it calls;
its role is the highest of theirs, and `daemon_api` mints the command's short-lived token with
exactly that role. `CLI_LOCAL` names the commands that never do; the test walks the CLI's
parser and fails on a command in neither. Pure data and lookups: no IO, nothing built at import.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Final, Literal


class Role(StrEnum):
    """Ordered viewer < operator < admin (by rank, not by the names' spelling)."""

    VIEWER = "viewer"
    OPERATOR = "operator"
    ADMIN = "admin"

    @property
    def rank(self) -> int:
        return _RANK[self]

    def allows(self, needed: str) -> bool:
        """Whether someone with this role may do what `needed` requires."""
        return self.rank >= Role(needed).rank

    def __lt__(self, other: str) -> bool:
        return self.rank < Role(other).rank

    def __le__(self, other: str) -> bool:
        return self.rank <= Role(other).rank

    def __gt__(self, other: str) -> bool:
        return self.rank > Role(other).rank

    def __ge__(self, other: str) -> bool:
        return self.rank >= Role(other).rank


_RANK = {Role.VIEWER: 0, Role.OPERATOR: 1, Role.ADMIN: 2}
ROLE_NAMES = tuple(r.value for r in Role)

Public = Literal["public"]
PUBLIC: Final[Public] = "public"
Access = Role | Public
Route = tuple[str, str]  # (method, path template)

V, O, A = Role.VIEWER, Role.OPERATOR, Role.ADMIN  # noqa: E741 - table shorthand only

ROUTES: Final[dict[Route, Access]] = {
    # -- no login: the auth middleware's PUBLIC_PATHS ---------------------------------------
    ("GET", "/healthz"): PUBLIC,
    ("GET", "/login"): PUBLIC,
    ("POST", "/login"): PUBLIC,
    ("GET", "/login/sso"): PUBLIC,  # single sign-on (ui/sso.py): no session yet
    ("GET", "/login/sso/callback"): PUBLIC,
    ("GET", "/static/{file_path}"): PUBLIC,
    ("HEAD", "/static/{file_path}"): PUBLIC,
    ("GET", "/api/v1/schema"): PUBLIC,
    ("GET", "/api/v1/schema/openapi.json"): PUBLIC,
    ("GET", "/api/v1/schema/{path}"): PUBLIC,
    # Public only with health.metrics_public (then the middleware lets it through unsigned).
    ("GET", "/metrics"): V,
    # -- every account ----------------------------------------------------------------------
    ("POST", "/logout"): V,
    ("GET", "/account/password"): V,
    ("POST", "/account/password"): V,
    # -- console pages ----------------------------------------------------------------------
    ("GET", "/"): V,
    ("GET", "/audit"): V,
    ("GET", "/events"): V,
    ("GET", "/settings"): V,
    ("POST", "/settings/tokens"): A,
    ("POST", "/settings/tokens/{prefix}/revoke"): A,
    ("POST", "/settings/support-bundle"): O,
    ("GET", "/engine"): V,
    ("GET", "/engine/status"): V,
    ("POST", "/engine/{action}"): O,
    ("GET", "/engine/schedule"): V,
    ("POST", "/engine/schedule"): O,
    ("POST", "/engine/scheduled/{action_id}/cancel"): O,
    ("GET", "/weights"): V,
    ("GET", "/weights/status"): V,
    ("POST", "/weights/pull"): O,
    ("POST", "/weights/verify/quick"): O,
    ("POST", "/weights/verify/full"): O,
    ("POST", "/weights/refetch"): O,
    ("POST", "/weights/import"): O,
    ("POST", "/weights/cancel"): O,
    ("GET", "/tuning"): V,
    ("GET", "/tuning/panel"): V,
    ("GET", "/tuning/editor"): O,  # the profile editor's form: only for those who can save
    ("POST", "/tuning/apply"): O,
    ("POST", "/tuning/profiles"): O,
    ("PUT", "/tuning/profiles/{name}"): O,
    ("POST", "/tuning/profiles/{name}"): O,
    ("DELETE", "/tuning/profiles/{name}"): O,
    ("POST", "/tuning/profiles/{name}/delete"): O,
    ("GET", "/usage"): V,
    ("GET", "/qualify"): V,
    ("GET", "/qualify/status"): V,
    ("GET", "/qualify/{qid}"): V,
    ("POST", "/qualify/run"): O,
    ("POST", "/qualify/cancel"): O,
    ("GET", "/health"): V,
    ("POST", "/health/check"): O,
    ("POST", "/health/checks/{check}/mute"): O,
    ("POST", "/health/checks/{check}/unmute"): O,
    ("GET", "/keys"): V,
    ("POST", "/keys"): A,
    ("POST", "/keys/{prefix}/revoke"): A,
    ("GET", "/keys/{prefix}/row"): V,
    ("GET", "/keys/{prefix}/limits"): A,  # the limits editor's form
    ("POST", "/keys/{prefix}/limits"): A,
    ("GET", "/cell"): V,  # a head's cell (ui/cell.py)
    ("GET", "/cell/status"): V,
    ("GET", "/cell/notice"): V,
    ("POST", "/cell/members/{member_id}/engine/{action}"): O,
    ("POST", "/cell/members/{member_id}/role"): A,
    ("POST", "/cell/rolling-restart"): O,
    ("POST", "/cell/rolling-restart/cancel"): O,
    # -- admin JSON API ---------------------------------------------------------------------
    ("GET", "/api/v1/status"): V,
    ("GET", "/api/v1/me"): V,
    ("GET", "/api/v1/audit"): V,
    ("GET", "/api/v1/events"): V,
    ("GET", "/api/v1/settings"): V,  # secrets are never in it (config.describe masks them)
    ("GET", "/api/v1/admins"): V,
    ("GET", "/api/v1/tokens"): V,  # prefixes and names, never a token
    ("POST", "/api/v1/tokens"): A,
    ("DELETE", "/api/v1/tokens/{prefix}"): A,
    ("GET", "/api/v1/engine"): V,
    ("GET", "/api/v1/engine/spec"): V,
    ("GET", "/api/v1/engine/runs"): V,
    ("GET", "/api/v1/engine/log"): V,
    ("GET", "/api/v1/engine/log/stream"): V,
    ("GET", "/api/v1/engine/scheduled"): V,
    ("DELETE", "/api/v1/engine/scheduled/{action_id}"): O,
    ("POST", "/api/v1/engine/{action}"): O,
    ("GET", "/api/v1/weights"): V,
    ("GET", "/api/v1/weights/manifest"): V,
    ("POST", "/api/v1/weights/pull"): O,
    ("POST", "/api/v1/weights/verify"): O,
    ("POST", "/api/v1/weights/refetch"): O,
    ("POST", "/api/v1/weights/import"): O,
    ("POST", "/api/v1/weights/cancel"): O,
    ("GET", "/api/v1/tuning"): V,
    ("GET", "/api/v1/tuning/chart.svg"): V,
    ("GET", "/api/v1/tuning/profiles"): V,
    ("POST", "/api/v1/tuning/profiles"): O,
    ("PUT", "/api/v1/tuning/profiles/{name}"): O,
    ("DELETE", "/api/v1/tuning/profiles/{name}"): O,
    ("POST", "/api/v1/tuning/apply"): O,
    ("GET", "/api/v1/usage"): V,
    ("GET", "/api/v1/usage/chart.svg"): V,
    ("GET", "/api/v1/usage/export.csv"): V,
    ("GET", "/api/v1/keys"): V,  # prefixes, names and limits, never a key
    ("POST", "/api/v1/keys"): A,
    ("GET", "/api/v1/keys/{prefix}"): V,
    ("PATCH", "/api/v1/keys/{prefix}"): A,
    ("POST", "/api/v1/keys/{prefix}/revoke"): A,
    ("GET", "/api/v1/health"): V,
    ("GET", "/api/v1/health/history"): V,
    ("GET", "/api/v1/health/series"): V,
    ("POST", "/api/v1/health/check"): O,
    ("POST", "/api/v1/health/mutes"): O,
    ("DELETE", "/api/v1/health/mutes/{check}"): O,
    ("GET", "/api/v1/qualify"): V,
    ("GET", "/api/v1/qualify/{qid}"): V,
    ("GET", "/api/v1/qualify/{qid}/chart.svg"): V,
    ("POST", "/api/v1/qualify/plan"): O,
    ("POST", "/api/v1/qualify/run"): O,
    ("POST", "/api/v1/qualify/cancel"): O,
    ("POST", "/api/v1/support-bundle"): O,
    # -- the cell (api/cell.py) -------------------------------------------------------------
    ("POST", "/api/v1/cell/join"): PUBLIC,  # a head joining: the body's join token is its proof
    ("POST", "/api/v1/cell/join-tokens"): A,
    ("DELETE", "/api/v1/cell/peer"): A,  # leave: revoke every head's credential
    # The cell peer scope: these are all a head's peer credential opens (the auth middleware
    # holds it to appliance.cell.tokens.PEER_ROUTES); a person may call them with this role.
    ("GET", "/api/v1/cell/peer/status"): V,
    ("POST", "/api/v1/cell/peer/engine/{action}"): O,
    ("DELETE", "/api/v1/cell/peer/credential"): O,
    ("PUT", "/api/v1/cell/peer/engine-key"): A,  # a head hands its engine key to a member
    ("POST", "/api/v1/cell/peer/role"): A,  # a head changes this member's role (a restart)
    ("POST", "/api/v1/cell/members"): A,
    ("GET", "/api/v1/cell/members"): V,
    ("DELETE", "/api/v1/cell/members/{member_id}"): A,
    # -- operating the cell from its head (api/cell_ops.py, api/cell_plan.py) ----------------
    ("GET", "/api/v1/cell"): V,
    ("POST", "/api/v1/cell/members/{member_id}/engine/{action}"): O,
    ("POST", "/api/v1/cell/members/{member_id}/role"): A,
    ("POST", "/api/v1/cell/rolling-restart"): O,
    ("POST", "/api/v1/cell/rolling-restart/cancel"): O,
    ("GET", "/api/v1/cell/plan"): V,
}

_ENGINE = "/api/v1/engine"
_WEIGHTS = "/api/v1/weights"
_QUALIFY = "/api/v1/qualify"
_CELL = "/api/v1/cell"

# Each daemon-backed CLI command (as `appliance <group> <command>`) and the routes it calls.
CLI_COMMANDS: Final[dict[str, tuple[Route, ...]]] = {
    "engine status": (("GET", _ENGINE),),
    "engine logs": (("GET", f"{_ENGINE}/log"), ("GET", f"{_ENGINE}/log/stream")),
    **{f"engine {action}": (("POST", f"{_ENGINE}/{{action}}"),)
       for action in ("start", "stop", "restart", "rollback")},
    "weights status": (("GET", _WEIGHTS),),
    "weights cancel": (("POST", f"{_WEIGHTS}/cancel"),),
    "weights verify": (("POST", f"{_WEIGHTS}/verify"), ("GET", _WEIGHTS)),
    "weights pull": (("POST", f"{_WEIGHTS}/pull"), ("GET", _WEIGHTS)),
    "weights refetch": (("POST", f"{_WEIGHTS}/refetch"), ("GET", _WEIGHTS)),
    "weights import": (("POST", f"{_WEIGHTS}/import"), ("GET", _WEIGHTS)),
    "qualify status": (("GET", _QUALIFY),),
    "qualify list": (("GET", _QUALIFY),),
    "qualify show": (("GET", f"{_QUALIFY}/{{qid}}"),),
    "qualify cancel": (("POST", f"{_QUALIFY}/cancel"),),
    "qualify run": (("POST", f"{_QUALIFY}/plan"), ("POST", f"{_QUALIFY}/run"),
                    ("GET", f"{_QUALIFY}/{{qid}}")),
    "cell join-token": (("POST", f"{_CELL}/join-tokens"),),
    "cell add": (("POST", f"{_CELL}/members"),),
    "cell members": (("GET", f"{_CELL}/members"),),
    "cell remove": (("DELETE", f"{_CELL}/members/{{member_id}}"),),
    "cell leave": (("DELETE", f"{_CELL}/peer"),),
    "cell status": (("GET", _CELL),),
    "cell engine": (("POST", f"{_CELL}/members/{{member_id}}/engine/{{action}}"),),
    "cell role": (("POST", f"{_CELL}/members/{{member_id}}/role"),),
    "cell rolling-restart": (("POST", f"{_CELL}/rolling-restart"), ("GET", _CELL)),
    "cell plan": (("GET", f"{_CELL}/plan"),),
    # local first; a daemon that answers adds its live health snapshot
    "support-bundle": (("GET", "/api/v1/health"),),
}

# Commands that never go through the daemon: they act on the state directory and database
# directly, so the box's own file permissions (root or the appliance user) are their guard.
# Accounts, tokens, keys, backup and restore among them are admin work by nature.
CLI_LOCAL: Final[frozenset[str]] = frozenset({
    "serve", "gateway", "migrate", "doctor", "backup", "restore",
    "admin create", "admin reset-password", "admin set-role", "admin list",
    "token create", "token list", "token revoke",
    "keys create", "keys list", "keys revoke", "keys limits", "keys class",
    "engine parse-log", "engine exec-spec", "cell exec-router", "weights export-manifest",
    "tune predict", "tune recommend", "tune profiles",
})


def route_access(method: str, path_template: str) -> Access | None:
    """What a route needs (None: undeclared). Litestar's generated OPTIONS needs nothing."""
    if method == "OPTIONS":
        return PUBLIC
    return ROUTES.get((method, path_template))


def cli_role(command: str) -> Role:
    """The role a daemon-backed CLI command's token carries: the highest its routes need."""
    needed = [ROUTES[route] for route in CLI_COMMANDS[command]]
    return max((Role(n) for n in needed if n != PUBLIC), default=Role.VIEWER,
               key=lambda r: r.rank)


def describe_refusal(needed: Role, have: Role) -> str:
    return f"this needs the {needed.value} role (you are {_article(have)} {have.value})"


def _article(role: Role) -> str:
    return "an" if role.value[0] in "aeiou" else "a"
