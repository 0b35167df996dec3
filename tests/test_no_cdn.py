"""The box may be air-gapped: nothing the console serves may load from another host."""

from __future__ import annotations

import re

import httpx

from tests.conftest import REPO, Console, LiveServer

EXTERNAL = re.compile(r"""(?:src|href|action)\s*=\s*["']?\s*(?:https?:)?//""", re.I)


def test_templates_reference_no_external_assets() -> None:
    offenders = [str(p.relative_to(REPO)) for p in (REPO / "web" / "templates").rglob("*.html")
                 if EXTERNAL.search(p.read_text())]
    assert offenders == []


def test_vendored_htmx_is_served_locally(server: LiveServer) -> None:
    response = httpx.get(server.base_url + "/static/htmx-2.0.11.min.js")
    assert response.status_code == 200
    assert "htmx" in response.text[:2000]


def test_rendered_pages_and_schema_stay_local(logged_in: Console) -> None:
    for path in ("/login", "/", "/audit", "/events", "/settings", "/engine", "/weights", "/tuning",
                 "/api/v1/schema/openapi.json"):
        response = logged_in.http.get(path)
        assert response.status_code == 200, path
        assert not EXTERNAL.search(response.text), path
    assert logged_in.http.get("/api/v1/schema/swagger").status_code == 404


def test_vendored_htmx_matches_its_recorded_hash() -> None:
    import hashlib

    table = (REPO / "web" / "static" / "VENDORED.md").read_text()
    digest = hashlib.sha256((REPO / "web/static/htmx-2.0.11.min.js").read_bytes()).hexdigest()
    assert f"`{digest}`" in table
