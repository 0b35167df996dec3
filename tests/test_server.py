"""`appliance serve` as a real process: readiness, systemd notify, one instance per state dir,
clean SIGTERM, the bootstrap credential and refusals that name the next step (fault 16)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from appliance.config import load_config
from appliance.db.database import Database
from appliance.db.journal import list_events
from tests.conftest import REPO, free_port, run_cli


def write_config(root: Path, port: int | None = None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    path = root / "appliance.toml"
    path.write_text(
        f"[server]\nport = {port or free_port()}\n\n"
        f'[paths]\nstate_dir = "{root / "state"}"\nmodels_dir = "{root / "models"}"\n'
        f'log_dir = "{root / "log"}"\n'
    )
    return path


class Daemon:
    """A `python -m appliance serve` child with its output captured to a file."""

    def __init__(self, config: Path, env: dict[str, str] | None = None) -> None:
        self.config = config
        self.settings = load_config(config, env={})
        self.base_url = f"http://127.0.0.1:{self.settings.server.port}"
        self.log = config.parent / f"daemon-{time.monotonic_ns()}.log"
        full_env = {k: v for k, v in os.environ.items()
                    if not k.startswith(("APPLIANCE_", "NOTIFY_", "WATCHDOG_"))}
        full_env.update(env or {})
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "appliance", "--config", str(config), "serve"],
                stdout=out, stderr=subprocess.STDOUT, env=full_env, cwd=REPO)

    def wait_ready(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"daemon exited {self.proc.returncode}: {self.output()}")
            try:
                if httpx.get(self.base_url + "/healthz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"daemon not ready: {self.output()}")

    def output(self) -> str:
        return self.log.read_text()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=30)


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    path = write_config(tmp_path / "box")
    result = run_cli("--config", str(path), "migrate")
    assert result.returncode == 0, result.stderr
    return path


@pytest.fixture
def daemon(config_file: Path) -> Iterator[Daemon]:
    proc = Daemon(config_file)
    proc.wait_ready()
    yield proc
    proc.stop()


def test_sigterm_shuts_down_cleanly(daemon: Daemon) -> None:
    assert daemon.stop() == 0
    db = Database(daemon.settings.database_url)
    messages = [e.message for e in db.call(lambda s: list_events(s)).items]
    assert messages[0] == "daemon stopped cleanly"
    assert any(m.startswith("daemon 0.1.0 started") for m in messages)
    db.dispose()


def test_second_daemon_exits_and_first_keeps_serving(daemon: Daemon) -> None:
    second = subprocess.run(
        [sys.executable, "-m", "appliance", "--config", str(daemon.config), "serve"],
        capture_output=True, text=True, timeout=60, cwd=REPO,
        env={k: v for k, v in os.environ.items() if not k.startswith("APPLIANCE_")})
    assert second.returncode == 75
    assert f"another appliance daemon (pid {daemon.proc.pid})" in second.stderr
    assert "systemctl stop appliance" in second.stderr
    assert httpx.get(daemon.base_url + "/healthz").status_code == 200
    assert daemon.proc.poll() is None


def test_bootstrap_credential_is_private_and_never_printed(daemon: Daemon) -> None:
    credential = daemon.settings.paths.state_dir / "bootstrap-admin.txt"
    assert stat.S_IMODE(credential.stat().st_mode) == 0o600
    password = next(line.split(": ", 1)[1] for line in credential.read_text().splitlines()
                    if line.startswith("password: "))
    assert str(credential) in daemon.output()
    assert password not in daemon.output()
    assert daemon.stop() == 0
    again = Daemon(daemon.config)
    again.wait_ready()
    assert again.stop() == 0
    assert "one-time admin login" not in again.output()  # said once, on the first start only
    assert password not in again.output()


def test_ready_is_notified_after_the_port_is_bound(config_file: Path, tmp_path: Path) -> None:
    path = str(tmp_path / "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(path)
        sock.settimeout(30)
        daemon = Daemon(config_file, env={"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "400000"})
        try:
            messages: list[str] = []
            while not any("READY=1" in m for m in messages):
                messages.append(sock.recv(4096).decode())
            ready = next(m for m in messages if "READY=1" in m)
            assert "STATUS=admin console on http://127.0.0.1:" in ready
            # The port answers at the moment READY arrives: it was bound first.
            assert httpx.get(daemon.base_url + "/healthz").status_code == 200
            pings = 0
            while pings < 2:
                pings += sock.recv(4096).decode().count("WATCHDOG=1")
            daemon.proc.send_signal(signal.SIGTERM)
            tail = ""
            while "STOPPING=1" not in tail:
                tail = sock.recv(4096).decode()
            assert daemon.proc.wait(timeout=30) == 0
        finally:
            daemon.stop()


def test_serve_refuses_an_uninitialised_database(tmp_path: Path) -> None:
    config = write_config(tmp_path / "fresh")
    result = run_cli("--config", str(config), "serve")
    assert result.returncode == 78
    assert "has not been initialised" in result.stderr
    assert "run `appliance migrate`" in result.stderr


def test_repeated_sigterm_does_not_break_shutdown(daemon: Daemon) -> None:
    daemon.proc.send_signal(signal.SIGTERM)
    for _ in range(5):
        if daemon.proc.poll() is not None:
            break
        daemon.proc.send_signal(signal.SIGTERM)
        time.sleep(0.05)
    assert daemon.proc.wait(timeout=30) == 0


def test_port_in_use_is_explained(config_file: Path) -> None:
    settings = load_config(config_file, env={})
    with socket.socket() as blocker:
        blocker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        blocker.bind(("127.0.0.1", settings.server.port))
        blocker.listen()
        result = run_cli("--config", str(config_file), "serve")
    assert result.returncode == 75
    assert f"could not listen on 127.0.0.1:{settings.server.port}" in result.stderr
    assert "server.port" in result.stderr


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is needed to make a cert")
def test_tls_serves_https_with_secure_cookies(tmp_path: Path) -> None:
    root = tmp_path / "tls"
    config = write_config(root)
    cert, key = root / "cert.pem", root / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=localhost", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    config.write_text(config.read_text().replace(
        "[paths]", f'tls_cert = "{cert}"\ntls_key = "{key}"\n\n[paths]'))
    assert run_cli("--config", str(config), "migrate").returncode == 0
    daemon = Daemon(config)
    daemon.base_url = daemon.base_url.replace("http://", "https://")
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                # a self-signed certificate made by this test
                response = httpx.get(daemon.base_url + "/login", verify=False)  # noqa: S501
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline and daemon.proc.poll() is None, daemon.output()
                time.sleep(0.1)
        assert response.status_code == 200
        csrf = next(c for c in response.headers.get_list("set-cookie")
                    if c.startswith("appliance_csrf"))
        assert "secure" in [p.strip().lower() for p in csrf.split(";")]
    finally:
        assert daemon.stop() == 0


def test_migrate_refuses_while_the_daemon_runs(daemon: Daemon) -> None:
    result = run_cli("--config", str(daemon.config), "migrate")
    assert result.returncode == 75
    assert "another appliance daemon" in result.stderr
    assert "migrate` also needs the daemon stopped" in result.stderr
    assert httpx.get(daemon.base_url + "/healthz").status_code == 200
