"""`create_app(runtime)`: the only place Litestar is wired.

Builds the admin console (HTML, htmx) and the admin JSON API (`/api/v1`) over one runtime.
Errors are rendered here, by the delivery layer: problem+json for the API, a page or an htmx
partial for the console.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar

from litestar import Litestar, Request, Response, get
from litestar.config.csrf import CSRFConfig
from litestar.exceptions import (
    HTTPException,
    NotAuthorizedException,
    PermissionDeniedException,
    ValidationException,
)
from litestar.middleware import DefineMiddleware
from litestar.openapi import OpenAPIConfig
from litestar.openapi.plugins import JsonRenderPlugin
from litestar.plugins.jinja import JinjaTemplateEngine
from litestar.response import Redirect, Template
from litestar.static_files import create_static_files_router
from litestar.template import TemplateConfig

from appliance import __version__
from appliance.api.cell import cell_router
from appliance.api.cell_ops import cell_ops_router
from appliance.api.cell_plan import cell_plan_router
from appliance.api.engine import engine_router
from appliance.api.health import health_router
from appliance.api.keys import keys_router
from appliance.api.ops import ops_router
from appliance.api.qualify import qualify_router
from appliance.api.routes import api_router
from appliance.api.tuning import tuning_router
from appliance.api.usage import usage_router
from appliance.api.weights import weights_router
from appliance.auth.guards import require_role
from appliance.auth.middleware import CSRF_COOKIE, PUBLIC_PATHS, AdminAuthMiddleware
from appliance.edge import ConsoleEdge, control_refusal, secure
from appliance.engine.schedule import restore_scheduled
from appliance.errors import ApplianceError
from appliance.health.jobs import schedule_health
from appliance.health.metrics_route import metrics_handler
from appliance.hostguard import HostGuard
from appliance.housekeeping import schedule_housekeeping
from appliance.ops.jobs import schedule_backups
from appliance.resources import static_dir, templates_dir
from appliance.runtime import Runtime
from appliance.ui.routes import ui_handlers
from appliance.ui.templating import configure_templates

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 1_000_000  # the console and admin API take small forms and JSON only


def _is_api(request: Request[Any, Any, Any]) -> bool:
    # /metrics answers scrapers, not browsers: a 401 with WWW-Authenticate, not a login page
    return request.url.path.startswith("/api/") or request.url.path == "/metrics"


def _problem(status: int, title: str, detail: str, code: str, hint: str = "") -> Response[Any]:
    body = {"type": f"urn:appliance:error:{code}", "title": title, "status": status,
            "detail": detail, "code": code}
    if hint:
        body["hint"] = hint
    return Response(body, status_code=status, media_type="application/problem+json")


def _error_page(request: Request[Any, Any, Any], status: int, message: str,
                hint: str = "") -> Response[Any]:
    template = "partials/error.html" if request.headers.get("hx-request") else "pages/error.html"
    return Template(template, context={"status": status, "message": message, "hint": hint},
                    status_code=status)


E = TypeVar("E", bound=Exception)
Handler = Callable[[Request[Any, Any, Any], E], Response[Any]]


def _secured(handler: Handler[E]) -> Handler[E]:
    """Litestar answers exceptions outside the app's middleware (and a 404 or 405 before any
    runs): their answers get the console's security headers here (appliance.edge)."""

    def answer(request: Request[Any, Any, Any], exc: E) -> Response[Any]:
        response = handler(request, exc)
        secure(response.headers)
        return response

    return answer


def _on_appliance_error(request: Request[Any, Any, Any], exc: ApplianceError) -> Response[Any]:
    if _is_api(request):
        return _problem(exc.status, exc.code.replace("_", " "), exc.message, exc.code, exc.hint)
    return _error_page(request, exc.status, exc.message, exc.hint)


def _on_not_authorized(
    request: Request[Any, Any, Any], exc: NotAuthorizedException
) -> Response[Any]:
    if _is_api(request):
        response = _problem(401, "unauthorized", exc.detail, "unauthorized",
                            "log in, or send `Authorization: Bearer <admin API token>`")
        response.headers["WWW-Authenticate"] = 'Bearer realm="appliance"'
        return response
    target = "/login"
    if request.method == "GET" and request.url.path not in ("/", "/logout"):
        target = f"/login?next={request.url.path}"
    if request.headers.get("hx-request"):
        return Response("", status_code=401, headers={"HX-Redirect": target})
    return Redirect(target, status_code=303)


def _on_forbidden(
    request: Request[Any, Any, Any], exc: PermissionDeniedException
) -> Response[Any]:
    hint = "reload the page and submit again" if "CSRF" in exc.detail else ""
    if _is_api(request):
        return _problem(403, "forbidden", exc.detail, "forbidden", hint)
    return _error_page(request, 403, exc.detail, hint)


def _on_http(request: Request[Any, Any, Any], exc: HTTPException) -> Response[Any]:
    if (why := control_refusal(request.url.path)) is not None:  # a 404 never met ConsoleEdge
        return _on_bad_input(request, 400, why, "path_invalid",
                             "request the page or API path without control characters")
    detail = exc.detail
    if isinstance(exc, ValidationException) and exc.extra:
        detail = f"{detail}: {exc.extra}"
    headers = dict(exc.headers or {})
    if _is_api(request):
        response = _problem(exc.status_code, "error", detail, f"http_{exc.status_code}")
    else:
        response = _error_page(request, exc.status_code, detail)
    response.headers.update(headers)
    return response


def _on_bad_input(request: Request[Any, Any, Any], status: int, detail: str, code: str,
                  hint: str) -> Response[Any]:
    if _is_api(request):
        return _problem(status, code.replace("_", " "), detail, code, hint)
    return _error_page(request, status, detail, hint)


def _on_overflow(request: Request[Any, Any, Any], exc: OverflowError) -> Response[Any]:
    # A number from the request past what the database or datetime holds (a page or an id of
    # 1e20: SQLite's integers are 64-bit). Bounds at the boundary catch most; this the rest.
    log.info("number out of range on %s %r: %s", request.method, request.url.path, exc)
    return _on_bad_input(request, 400, "a number in the request is too large",
                         "number_out_of_range", "use a smaller page, id or value")


def _on_recursion(request: Request[Any, Any, Any], exc: RecursionError) -> Response[Any]:
    # msgspec refuses a JSON body nested past its depth limit with a RecursionError.
    if "deserializ" not in str(exc):
        return _on_unexpected(request, exc)
    return _on_bad_input(request, 400, "the JSON body is nested too deeply", "body_too_deep",
                         "send the documented shape (it nests a few levels at most)")


def _on_unexpected(request: Request[Any, Any, Any], exc: Exception) -> Response[Any]:
    # %r: the path comes from the client, and a raw newline in it would forge a log line.
    log.exception("unhandled error on %s %r", request.method, request.url.path)
    message = "an internal error occurred; details are in the daemon's log"
    if _is_api(request):
        return _problem(500, "internal error", message, "internal",
                        "check `journalctl -u appliance` and report the traceback")
    return _error_page(request, 500, message, "check `journalctl -u appliance`")


@get("/healthz", include_in_schema=False)
async def healthz() -> dict[str, str]:
    """Liveness of the control plane only (never the engine's health): no login needed."""
    return {"status": "ok", "version": __version__}


def create_app(runtime: Runtime, *, debug: bool = False) -> Litestar:
    config = runtime.config
    csrf = CSRFConfig(
        secret=runtime.secret.hex(),
        cookie_name=CSRF_COOKIE,
        cookie_secure=config.tls,
        cookie_httponly=True,
        cookie_samesite="strict",
        header_name="X-CSRF-Token",
        # The API checks session callers itself; bearer callers need none. Anchored: entries
        # are regexes searched anywhere in the path, and /tuning/profiles/api/delete is a form.
        exclude=["^/api/"],
    )
    public = PUBLIC_PATHS + (("/metrics",) if config.health.metrics_public else ())
    # OPTIONS too (Litestar exempts it by default): the guards after it read the user, and
    # without one an OPTIONS on the API was a 500.
    # Anchored at a path segment: /api/v1/cell/join is public, /api/v1/cell/join-tokens not.
    auth = DefineMiddleware(AdminAuthMiddleware, exclude=[f"^{p}(?:/|$)" for p in public],
                            exclude_http_methods=[])
    app = Litestar(
        route_handlers=[
            healthz,
            metrics_handler(),
            *ui_handlers(),
            api_router(),
            engine_router(),
            weights_router(),
            tuning_router(),
            usage_router(),
            keys_router(),
            health_router(),
            qualify_router(),
            ops_router(),
            cell_router(),
            cell_ops_router(),
            cell_plan_router(),
            create_static_files_router(path="/static", directories=[static_dir()],
                                       include_in_schema=False),
        ],
        guards=[require_role],  # the one role check of every route (auth/roles.py's table)
        middleware=[ConsoleEdge,
                    DefineMiddleware(HostGuard, allowed=config.server.allowed_hosts), auth],
        csrf_config=csrf,
        template_config=TemplateConfig(
            directory=templates_dir(), engine=JinjaTemplateEngine,
            engine_callback=configure_templates,
        ),
        openapi_config=OpenAPIConfig(
            title="appliance admin API", version=__version__, path="/api/v1/schema",
            # JSON only: every HTML renderer Litestar ships loads its script from a CDN, and
            # this box may be air-gapped.
            render_plugins=[JsonRenderPlugin()],
        ),
        exception_handlers={
            ApplianceError: _secured(_on_appliance_error),
            NotAuthorizedException: _secured(_on_not_authorized),
            PermissionDeniedException: _secured(_on_forbidden),
            HTTPException: _secured(_on_http),
            OverflowError: _secured(_on_overflow),
            RecursionError: _secured(_on_recursion),
            Exception: _secured(_on_unexpected),
        },
        request_max_body_size=MAX_BODY_BYTES,
        logging_config=None,  # `main()` configures logging once, for the journal
        on_startup=[partial(_start, runtime)],
        on_shutdown=[partial(_stop, runtime)],
        debug=debug,
    )
    app.state.runtime = runtime
    return app


async def _start(runtime: Runtime) -> None:
    schedule_housekeeping(runtime)
    schedule_backups(runtime)  # the nightly backup's tick (appliance.ops.jobs)
    if not runtime.scheduler.running:
        runtime.scheduler.start()
    await runtime.tuning.start_service()  # the applied split, before any launch spec
    await runtime.supervisor.start_service()
    await runtime.weights.start_service()
    await restore_scheduled(runtime)
    await runtime.qualify.start_service()  # a run the last daemon left: interrupted, gateway open
    # After the supervisor: the first engine poll must see the adopted engine's state.
    schedule_health(runtime)
    await runtime.cell.start()  # a head's watch over its members (appliance.cell.watch)


async def _stop(runtime: Runtime) -> None:
    # The engine keeps running: only the daemon's watching stops (it is adopted next start).
    await runtime.cell.stop()  # the router keeps running too
    await runtime.qualify.stop_service()  # a run ends as interrupted and opens the gateway
    await runtime.weights.stop_service()
    await runtime.supervisor.stop_service()
    await runtime.publisher.stop()
    if runtime.scheduler.running:
        runtime.scheduler.shutdown(wait=False)
    await runtime.health.close()  # the webhook sender and the engine probe's client

