"""Login, logout and password change for the console.

Login is throttled per username+address (429 with Retry-After after too many failures), every
outcome is audited, and a successful login replaces any session cookie the browser had and
the CSRF cookie too. The bootstrap admin (and anyone whose password was reset) is sent to
change it before anything else.

Nobody is logged in yet when /login is posted, so what it accepts is bounded before anything
is parsed: a body over `LOGIN_MAX_BODY` is refused with 413 (Litestar checks Content-Length
first and counts streamed bytes, also for the CSRF middleware's form read, and its form
parser caches parsed bodies), and usernames and passwords have fixed maximum lengths.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from litestar import Request, Response, get, post
from litestar.datastructures import Cookie
from litestar.exceptions.http_exceptions import RequestEntityTooLarge
from litestar.params import FromQuery, URLEncodedBody
from litestar.response import Redirect, Template
from litestar.utils.scope.state import ScopeState

from appliance.auditing import audit
from appliance.auth.accounts import (
    MAX_PASSWORD_LENGTH,
    USERNAME_MAX,
    Admin,
    authenticate,
    check_password,
    set_password,
)
from appliance.auth.bootstrap import retire_bootstrap_file
from appliance.auth.csrf import fresh_csrf_cookie, mint_token
from appliance.auth.local_login import local_login_refusal
from appliance.auth.middleware import AuthInfo, client_address
from appliance.auth.sessions import COOKIE_NAME, close_session, open_session
from appliance.errors import ApplianceError
from appliance.runtime import Runtime, runtime_of

AdminRequest = Request[Admin, AuthInfo, Any]

# The form is a CSRF token (128), a `next` path, a username (64) and a password (1024
# characters, up to 3 bytes each once URL-encoded): 8 KiB holds any real one.
LOGIN_MAX_BODY = 8 * 1024
TOO_LONG = (f"Usernames have at most {USERNAME_MAX} characters and passwords at most "
            f"{MAX_PASSWORD_LENGTH}.")


@dataclass
class LoginForm:
    username: str = ""
    password: str = ""
    next: FromQuery[str] = "/"


@dataclass
class PasswordForm:
    current_password: str = ""
    new_password: str = ""
    confirm_password: str = ""


def _safe_next(target: str) -> str:
    # Only local paths: an open redirect would let a phishing link bounce through the console.
    if target.startswith("/") and not target.startswith("//") and "\\" not in target:
        return target
    return "/"


def session_cookie(runtime: Runtime, value: str, *, max_age: int | None = None) -> Cookie:
    return Cookie(
        key=COOKIE_NAME, value=value, path="/", httponly=True, samesite="strict",
        secure=runtime.config.tls,
        max_age=max_age if max_age is not None else runtime.config.auth.session_max_hours * 3600,
    )


@get("/login", include_in_schema=False)
async def login_page(next: FromQuery[str] = "/") -> Template:
    return Template("pages/login.html", context={"next": _safe_next(next), "error": ""})


def csrf_cookie(runtime: Runtime, token: str = "") -> Cookie:
    """A new CSRF cookie (a freshly minted token unless one is given)."""
    return fresh_csrf_cookie(token or mint_token(runtime.secret), secure=runtime.config.tls)


def _login_too_large(request: Request[Any, Any, Any], _: RequestEntityTooLarge) -> Response[Any]:
    """413 as the login page, with a working form: the CSRF middleware refused before it set
    the page's token, so a fresh cookie and token go with it."""
    runtime = runtime_of(request)
    token = mint_token(runtime.secret)
    ScopeState.from_scope(request.scope).csrf_token = token
    message = (f"The login form was larger than {LOGIN_MAX_BODY // 1024} KiB and was not "
               f"read. {TOO_LONG}")
    return Template("pages/login.html", status_code=413, cookies=[csrf_cookie(runtime, token)],
                    context={"next": "/", "error": message})


@post("/login", include_in_schema=False, request_max_body_size=LOGIN_MAX_BODY,
      exception_handlers={RequestEntityTooLarge: _login_too_large})
async def login(
    request: Request[Any, Any, Any], data: URLEncodedBody[LoginForm]
) -> Response[Any]:
    runtime = runtime_of(request)
    address = client_address(request)
    target = _safe_next(data.next)
    if len(data.username) > USERNAME_MAX or len(data.password) > MAX_PASSWORD_LENGTH:
        # No account can have such a name or password: refused before the throttle table,
        # the password hash or the audit row sees more than a bounded prefix of it.
        await audit(runtime, actor="anonymous", address=address, action="auth.login",
                    outcome="failed", target=data.username[:USERNAME_MAX],
                    detail={"reason": "username or password too long"})
        return Template("pages/login.html", status_code=422,
                        context={"next": target, "error": TOO_LONG})
    username = data.username.strip().lower()
    wait = runtime.throttle.retry_after(username, address)
    if wait:
        await audit(runtime, actor=username or "anonymous", address=address,
                    action="auth.login", outcome="denied", target=username,
                    detail={"reason": "throttled", "retry_after": wait})
        return Template(
            "pages/login.html", status_code=429, headers={"Retry-After": str(wait)},
            context={"next": target, "error": f"Too many failed logins. Try again in {wait} s."},
        )
    admin = await runtime.db.run(lambda s: authenticate(s, username, data.password))
    if admin is None:
        runtime.throttle.failed(username, address)
        await audit(runtime, actor=username or "anonymous", address=address,
                    action="auth.login", outcome="failed", target=username,
                    detail={"reason": "wrong username or password"})
        return Template("pages/login.html", status_code=401,
                        context={"next": target, "error": "Wrong username or password."})
    runtime.throttle.succeeded(username, address)
    refusal = local_login_refusal(runtime.config.auth, admin.username)
    if refusal:
        await audit(runtime, actor=admin.username, address=address, action="auth.login",
                    outcome="denied", target=admin.username,
                    detail={"reason": "local login reserved for break-glass accounts"})
        return Template("pages/login.html", status_code=403,
                        context={"next": target, "error": refusal})
    now = runtime.clock.now()
    token = await runtime.db.run(lambda s: open_session(
        s, admin, now, runtime.session_policy, address=address,
        user_agent=request.headers.get("user-agent", ""),
    ))
    await audit(runtime, actor=admin.username, address=address, action="auth.login",
                target=admin.username)
    destination = "/account/password" if admin.must_change_password else target
    return Redirect(destination, status_code=303,
                    cookies=[session_cookie(runtime, token), csrf_cookie(runtime)])


@post("/logout", include_in_schema=False)
async def logout(request: AdminRequest) -> Response[Any]:
    runtime = runtime_of(request)
    if request.auth.session_token:
        await runtime.db.run(lambda s: close_session(s, request.auth.session_token))
    await audit(runtime, actor=request.user.username, address=client_address(request),
                action="auth.logout")
    return Redirect("/login", status_code=303, cookies=[session_cookie(runtime, "", max_age=0)])


@get("/account/password", include_in_schema=False)
async def password_page(request: AdminRequest) -> Template:
    return Template("pages/password.html", context={"error": "", "forced":
                                                      request.user.must_change_password})


@post("/account/password", include_in_schema=False)
async def change_password(
    request: AdminRequest, data: URLEncodedBody[PasswordForm]
) -> Response[Any]:
    runtime = runtime_of(request)
    admin = request.user
    address = client_address(request)

    def fail(message: str) -> Template:
        return Template("pages/password.html", status_code=422,
                        context={"error": message, "forced": admin.must_change_password})

    if data.new_password != data.confirm_password:
        return fail("The new password and its confirmation differ.")
    try:
        check_password(data.new_password)
    except ApplianceError as exc:
        return fail(f"{exc.message}; {exc.hint}.")
    if data.new_password == data.current_password:
        return fail("Choose a password different from the current one.")
    checked = await runtime.db.run(
        lambda s: authenticate(s, admin.username, data.current_password))
    if checked is None:
        await audit(runtime, actor=admin.username, address=address,
                    action="auth.password_change", outcome="failed",
                    detail={"reason": "current password wrong"})
        return fail("The current password is wrong.")
    now = runtime.clock.now()

    def apply(s: Any) -> str:
        updated = set_password(s, admin.username, data.new_password, now)  # ends all sessions
        return open_session(s, updated, now, runtime.session_policy, address=address,
                            user_agent=request.headers.get("user-agent", ""))

    token = await runtime.db.run(apply)
    retired = retire_bootstrap_file(runtime.state_dir)
    await audit(runtime, actor=admin.username, address=address, action="auth.password_change",
                target=admin.username, detail={"bootstrap_file_removed": retired})
    return Redirect("/", status_code=303,
                    cookies=[session_cookie(runtime, token), csrf_cookie(runtime)])
