from __future__ import annotations

from tests.conftest import Console


def test_login_reaches_dashboard(logged_in: Console) -> None:
    response = logged_in.http.get("/")
    assert response.status_code == 200
    assert "Dashboard" in response.text
