"""Where the files that ship beside the package live: migrations and web assets.

In a source checkout or an editable install (development, CI, `make demo`) they sit next to
the `appliance/` package. A release built by the installer keeps the same layout inside its
release directory, so one rule serves both.
"""

from __future__ import annotations

from pathlib import Path

from appliance.errors import ApplianceError


def project_root() -> Path:
    return Path(__file__).resolve().parent.parent


def _required(path: Path, what: str) -> Path:
    if not path.exists():
        raise ApplianceError(
            "resources_missing",
            f"{what} not found at {path}",
            "reinstall the appliance release; the package is incomplete",
        )
    return path


def migrations_dir() -> Path:
    return _required(project_root() / "migrations", "database migrations")


def templates_dir() -> Path:
    return _required(project_root() / "web" / "templates", "web templates")


def static_dir() -> Path:
    return _required(project_root() / "web" / "static", "web static files")
