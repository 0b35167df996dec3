"""Shared fixtures: a dev config in a temp dir, a migrated real database (SQLite, and
PostgreSQL when CI provides one), a runtime with a fake clock, a live server on loopback, a
console client that logs in like a browser does (form, cookies, CSRF token), and the rigs'
shared pieces (the chromium of browser tests, the engine emulator of gateway tests).
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from sqlalchemy import create_engine, text

from appliance.app import create_app
from appliance.auth.accounts import create_admin
from appliance.auth.middleware import CSRF_COOKIE
from appliance.config import Config, load_config
from appliance.db.database import Database
from appliance.db.schema import migrate
from appliance.resources import migrations_dir
from appliance.runtime import Runtime, build_runtime
from appliance.testing.clock import FakeClock

# The real-engine tier's fixtures (real SGLang 0.5.23 on CPU): tests/realengine/fixtures.py.
pytest_plugins = ["tests.realengine.fixtures"]

PASSWORD = "correct horse battery staple"
POSTGRES_URL = os.environ.get("TEST_APPLIANCE_POSTGRES_URL", "")
REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def make_config(root: Path, **env: str) -> Config:
    """A dev-profile config under `root`, on a free port, with extra APPLIANCE_* values."""
    values = {"APPLIANCE_SERVER_PORT": str(free_port()),
              "APPLIANCE_GATEWAY_PORT": str(free_port()), **env}
    return load_config(dev=True, dev_root=root, env=values)


@contextlib.contextmanager
def postgres_database() -> Iterator[str]:
    """A fresh, empty PostgreSQL database for one test; dropped afterwards."""
    if not POSTGRES_URL:
        if os.environ.get("TEST_APPLIANCE_REQUIRE_POSTGRES"):
            pytest.fail("TEST_APPLIANCE_REQUIRE_POSTGRES is set but no TEST_APPLIANCE_POSTGRES_URL")
        pytest.skip("no PostgreSQL server (CI sets TEST_APPLIANCE_POSTGRES_URL)")
    name = f"appliance_test_{uuid.uuid4().hex[:12]}"
    admin = create_engine(POSTGRES_URL.replace("postgresql://", "postgresql+psycopg://", 1),
                          isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    base, _, _ = POSTGRES_URL.rpartition("/")
    try:
        yield f"{base}/{name}"
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture(params=["sqlite", "postgresql"])
def backend_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """An empty database of each kind: tests using this run once per backend."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'backend.db'}"
    else:
        with postgres_database() as url:
            yield url


@pytest.fixture
def config(tmp_path: Path) -> Config:
    return make_config(tmp_path / "appliance")


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def db(config: Config, clock: FakeClock) -> Iterator[Database]:
    database = Database(config.database_url)
    migrate(database, migrations_dir(), config.paths.state_dir / "backups", clock.now())
    yield database
    database.dispose()


@pytest.fixture
def runtime(config: Config, db: Database, clock: FakeClock) -> Runtime:
    return build_runtime(config, clock=clock, db=db)


def add_admin(runtime: Runtime, username: str = "alice", password: str = PASSWORD,
              *, must_change: bool = False) -> None:
    now = runtime.clock.now()
    runtime.db.call(lambda s: create_admin(s, username, password, now,
                                           must_change_password=must_change))


class LiveServer:
    """The real app under uvicorn on 127.0.0.1, in a thread of the test process (so the test
    can still reach the runtime's fake clock and database)."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        cfg = runtime.config.server
        self.base_url = f"http://127.0.0.1:{cfg.port}"
        self.server = uvicorn.Server(uvicorn.Config(
            create_app(runtime), host="127.0.0.1", port=cfg.port, log_config=None,
            access_log=False, lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("live server did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture
def server(runtime: Runtime) -> Iterator[LiveServer]:
    live = LiveServer(runtime).start()
    yield live
    live.stop()


CSRF_INPUT = re.compile(r'name="_csrf_token" value="([^"]+)"')


class Console:
    """Talks to the console like a browser: cookies kept, CSRF token taken from the page."""

    def __init__(self, base_url: str) -> None:
        self.http = httpx.Client(base_url=base_url, follow_redirects=False, timeout=10)
        self.csrf = ""

    def page_token(self, path: str = "/login") -> str:
        response = self.http.get(path)
        match = CSRF_INPUT.search(response.text)
        assert match, f"no CSRF field on {path}"
        self.csrf = match.group(1)
        return self.csrf

    def login(self, username: str = "alice", password: str = PASSWORD,
              address_note: str = "") -> httpx.Response:
        token = self.page_token("/login")
        return self.http.post("/login", data={
            "username": username, "password": password, "next": "/", "_csrf_token": token})

    def close(self) -> None:
        self.http.close()


def csrf(console: Console) -> dict[str, str]:
    """The header an API call made with a console session needs (double-submit cookie)."""
    return {"X-CSRF-Token": console.http.cookies[CSRF_COOKIE]}


def problem(response: httpx.Response, status: int, code: str | None = None) -> dict[str, Any]:
    """The problem+json body of a refusal, after checking its status and code."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/problem+json")
    body: dict[str, Any] = response.json()
    if code is not None:
        assert body["code"] == code, body
    return body


@pytest.fixture
def console(server: LiveServer) -> Iterator[Console]:
    client = Console(server.base_url)
    yield client
    client.close()


@pytest.fixture
def logged_in(runtime: Runtime, console: Console) -> Console:
    add_admin(runtime)
    response = console.login()
    assert response.status_code == 303, response.text
    return console


def wait_for(check: Callable[[], Any], what: str, timeout: float = 30.0) -> Any:
    """Poll `check` until it returns something truthy (returned), failing after `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    pytest.fail(f"gave up waiting for {what}")


def run_cli(*args: str, env: dict[str, str] | None = None, input: str | None = None,
            timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """`python -m appliance ARGS` as a real subprocess."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("APPLIANCE_")}
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "appliance", *args], capture_output=True,
                          text=True, env=full_env, input=input, timeout=timeout, cwd=REPO)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """One headless chromium per browser-test module (tests/browser_rig.py: importing it skips
    a module where there is no browser; each test opens its own context)."""
    from tests.browser_rig import launch_chromium

    with launch_chromium() as launched:
        yield launched


@pytest.fixture(scope="module")
def gateway_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The engine emulator the gateway tests of one module share (tests/gateway_rig.py)."""
    from tests.gateway_rig import start_engine, stop_engine

    emu = start_engine(tmp_path_factory)
    yield emu
    stop_engine(emu)


@pytest.fixture
def gateway(config: Config, db: Database, gateway_engine: Any) -> Iterator[Any]:
    """The gateway in front of `gateway_engine`, with the engine published as ready."""
    from tests.gateway_rig import LiveGateway

    live = LiveGateway(config, db, gateway_engine.url).start()
    live.publish("ready", "serving")
    live.wait_admitting()
    yield live
    live.stop()
