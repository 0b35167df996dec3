from __future__ import annotations
import os
from pathlib import Path
from appliance.db.journal import add_audit, add_event
from tests.conftest import PASSWORD, add_admin
from tests.test_browser import browser, context, page, alice, log_in  # noqa

OUT = Path("/tmp/appliance-scratch")

def test_shots(runtime, browser, server):  # noqa
    OUT.mkdir(exist_ok=True)
    add_admin(runtime, "alice", PASSWORD)
    add_admin(runtime, "admin", PASSWORD, must_change=True)
    now = runtime.clock.now()
    def seed(s):
        for i in range(8):
            add_audit(s, at=now, actor="mallory", action="auth.login", outcome="failed", target="mallory", detail={"reason": "wrong username or password"})
        for sev in ["info", "warning", "error", "critical"]:
            add_event(s, at=now, severity=sev, source="auth", message=f"a {sev} event with a fairly long message describing what happened to the appliance today")
    runtime.db.call(seed)
    for w in (1280, 800, 420):
        ctx = browser.new_context(base_url=server.base_url, viewport={"width": w, "height": 900})
        p = ctx.new_page()
        p.goto("/login"); p.screenshot(path=str(OUT / f"login-{w}.png"), full_page=True)
        p.get_by_label("Username").fill("alice"); p.get_by_label("Password", exact=True).fill("wrong wrong wrong"); p.get_by_role("button", name="Log in").click()
        p.get_by_role("alert").wait_for(); p.screenshot(path=str(OUT / f"login-error-{w}.png"), full_page=True)
        p.get_by_label("Username").fill("admin"); p.get_by_label("Password", exact=True).fill(PASSWORD); p.get_by_role("button", name="Log in").click()
        p.wait_for_url("**/account/password"); p.screenshot(path=str(OUT / f"password-{w}.png"), full_page=True)
        ctx.close()
        ctx = browser.new_context(base_url=server.base_url, viewport={"width": w, "height": 900})
        p = ctx.new_page()
        log_in(p, "alice", PASSWORD); p.wait_for_url(server.base_url + "/")
        for name in ("", "audit", "events", "settings", "nope"):
            p.goto("/" + name); p.screenshot(path=str(OUT / f"{name or 'dashboard'}-{w}.png"), full_page=True)
        ctx.close()
