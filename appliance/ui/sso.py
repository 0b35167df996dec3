"""The console's single sign-on routes: `/login/sso` starts an OpenID Connect sign-in and
`/login/sso/callback` finishes it (appliance.auth.oidc has the protocol).

Both are public (no session yet). Every outcome is audited as `auth.sso`. A finished sign-in
opens the ordinary session and answers with a page that moves on to the console itself: the
browser came here from the provider's site, and a SameSite=Strict session cookie is only sent
once a navigation starts from this site, so a plain redirect would land on the login page.
"""

from __future__ import annotations

import hmac
from typing import Any

from litestar import Request, Response, get
from litestar.datastructures import Cookie
from litestar.params import FromQuery
from litestar.response import Redirect, Template

from appliance.auditing import audit
from appliance.auth import oidc
from appliance.auth.accounts import NO_ROLE
from appliance.auth.middleware import client_address
from appliance.auth.sessions import open_session
from appliance.runtime import Runtime, runtime_of
from appliance.ui.login import _safe_next, csrf_cookie, session_cookie

CALLBACK_PATH = "/login/sso/callback"


def _redirect_uri(request: Request[Any, Any, Any]) -> str:
    # The Host header has passed the host guard (server.allowed_hosts), so it is one of ours.
    return str(request.base_url).rstrip("/") + CALLBACK_PATH


def _flow_cookie(runtime: Runtime, value: str, max_age: int) -> Cookie:
    # Lax, not Strict: the provider's redirect back is a cross-site navigation.
    return Cookie(key=oidc.FLOW_COOKIE, value=value, path=oidc.FLOW_PATH, httponly=True,
                  samesite="lax", secure=runtime.config.tls, max_age=max_age)


def _failed(runtime: Runtime, error: oidc.SsoError, *, clear_flow: bool = False) -> Template:
    cookies = [_flow_cookie(runtime, "", 0)] if clear_flow else []
    return Template("pages/login.html", status_code=error.status, cookies=cookies,
                    context={"next": "/", "error": error.message})


@get("/login/sso", include_in_schema=False)
async def sso_start(request: Request[Any, Any, Any], next: FromQuery[str] = "/"
                    ) -> Response[Any]:
    runtime = runtime_of(request)
    config = runtime.config.oidc
    if not config.enabled:
        return Redirect("/login", status_code=303)
    try:
        provider = await oidc.discover(config)
    except oidc.SsoError as exc:
        await audit(runtime, actor="anonymous", address=client_address(request),
                    action="auth.sso", outcome="failed", target=config.issuer,
                    detail={"reason": exc.reason, "step": "discovery"})
        return _failed(runtime, exc)
    flow = oidc.new_flow(_safe_next(next), runtime.clock.now())
    url = oidc.authorization_url(config, provider, flow, _redirect_uri(request))
    cookie = _flow_cookie(runtime, oidc.seal(flow, runtime.secret),
                          int(oidc.FLOW_TTL.total_seconds()))
    return Redirect(url, status_code=303, cookies=[cookie])


@get(CALLBACK_PATH, include_in_schema=False)
async def sso_callback(request: Request[Any, Any, Any]) -> Response[Any]:
    # Read by hand: `state` is a name Litestar reserves for its own parameter.
    query = request.query_params
    code, state = query.get("code", ""), query.get("state", "")
    error, error_description = query.get("error", ""), query.get("error_description", "")
    runtime = runtime_of(request)
    config = runtime.config.oidc
    address = client_address(request)
    if not config.enabled:
        return Redirect("/login", status_code=303)
    now = runtime.clock.now()
    who: oidc.Identity | None = None
    try:
        flow = oidc.unseal(request.cookies.get(oidc.FLOW_COOKIE, ""), runtime.secret, now)
        if not hmac.compare_digest(state.encode(), flow.state.encode()):
            raise oidc.SsoError("state_mismatch", "This sign-in answer does not belong to the "
                                "sign-in this browser started. Start again from the login "
                                "page.", 400)
        if error:
            raise oidc.SsoError("provider_error", f"{config.display_name} did not sign you in "
                                f"({error[:64]}: {error_description[:200] or 'no reason'}).")
        if not code:
            raise oidc.SsoError("code_missing", "The provider's answer carried no code. Start "
                                "again from the login page.", 400)
        secret = oidc.read_client_secret(config.client_secret_file)
        provider = await oidc.discover(config)
        redirect_uri = _redirect_uri(request)
        id_token = await oidc.exchange_code(config, provider, secret, code, flow, redirect_uri)
        keys = await oidc.fetch_keys(config, provider)
        claims = oidc.verify_id_token(id_token, keys, issuer=provider.issuer,
                                      client_id=config.client_id, nonce=flow.nonce, now=now)
        who = oidc.identity(claims, config)
        if who.role is None:
            refused = who
            before, ended = await runtime.db.run(lambda s: oidc.refuse_shadow(s, refused))
            await audit(runtime, actor=who.name[:128], address=address, action="auth.sso",
                        outcome="denied", target=who.subject[:255],
                        detail={"reason": "no mapped group", "groups": list(who.groups[:50]),
                                "sessions_ended": ended, "role_before": before,
                                "role": NO_ROLE if before else None})
            return Template("pages/sso_refused.html", status_code=403,
                            cookies=[_flow_cookie(runtime, "", 0)],
                            context={"message": oidc.refusal_text(who, config)})
    except oidc.SsoError as exc:
        await audit(runtime, actor=who.name[:128] if who else "anonymous", address=address,
                    action="auth.sso", outcome="failed", target=config.issuer,
                    detail={"reason": exc.reason})
        return _failed(runtime, exc, clear_flow=True)
    verified = who

    def sign_in(s: Any) -> tuple[str, str, str | None]:
        admin, before = oidc.upsert_shadow(s, verified, now)
        return admin.username, open_session(
            s, admin, now, runtime.session_policy, address=address,
            user_agent=request.headers.get("user-agent", "")), before

    username, token, before = await runtime.db.run(sign_in)
    await audit(runtime, actor=username, address=address, action="auth.sso", target=username,
                detail={"role": verified.role, "role_before": before,
                        "issuer": verified.issuer, "subject": verified.subject[:255]})
    return Template("pages/sso_done.html", context={"target": flow.next},
                    cookies=[session_cookie(runtime, token), csrf_cookie(runtime),
                             _flow_cookie(runtime, "", 0)])
