"""A gateway restart refuses nobody (issue 15).

A SIGTERM used to close the gateway's listener and its idle keep-alive connections at once:
about 300 connection errors reached clients in the second before the new gateway bound. Now
the listener is systemd's (appliance-gateway.socket, passed in by socket activation), so
connections queue while one process drains and the next starts, and a draining process
serves a request that arrives on a kept-alive connection (answered `Connection: close`)
instead of dropping it (appliance/gateway/handover.py).

Without systemd, socket activation is emulated as PID 1 does it: the test holds a listening
socket on 127.0.0.1 and starts each gateway with it as descriptor 3, LISTEN_FDS=1 and
LISTEN_PID set to the gateway's own pid (a two-line shim sets them and execs).
"""

from __future__ import annotations

import collections
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from appliance.config import Config
from appliance.db.database import Database
from appliance.errors import EX_CONFIG
from appliance.gateway.handover import Drain, DrainingServer, inherited_socket
from appliance.gateway.parts import build_gateway
from appliance.gateway.serve import uvicorn_config
from tests.conftest import REPO, free_port, run_cli, wait_for

WORKERS = 8
LOAD_LIMIT_SECONDS = 120.0  # the load's hard bound, whatever happens

# Stands in for PID 1: descriptor argv[1] becomes 3, the variables name this very process
# (exec keeps the pid), then the gateway runs.
SHIM = textwrap.dedent("""\
    import os, sys
    fd = int(sys.argv[1])
    if fd != 3:
        os.dup2(fd, 3)
        os.close(fd)
    os.environ.update(LISTEN_PID=str(os.getpid()), LISTEN_FDS="1", LISTEN_FDNAMES="gateway")
    os.execv(sys.executable, [sys.executable, "-m", "appliance", *sys.argv[2:]])
""")


# --- the drain, in process ----------------------------------------------------------------------


class Serving:
    """The gateway's production server (DrainingServer and its protocol) on loopback, in a
    thread of the test, with no engine behind it: /metrics answers from the gateway alone."""

    def __init__(self, config: Config, db: Database, drain: Drain) -> None:
        parts = build_gateway(config, db=db, engine_url=f"http://127.0.0.1:{free_port()}",
                              poll_interval=0.1)
        uv = uvicorn_config(parts, drain=drain)
        assert uv.host == "127.0.0.1"
        self.port = uv.port
        self.drain = drain
        self.server = DrainingServer(uv, drain)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> Serving:
        self.thread.start()
        wait_for(lambda: self.server.started or not self.thread.is_alive(), "the server", 20)
        assert self.server.started
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        wait_for(lambda: self.drain.started or not self.thread.is_alive(), "the drain to start")

    def __exit__(self, *_: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


REQUEST = b"GET /metrics HTTP/1.1\r\nHost: gateway\r\n\r\n"


def read_response(conn: socket.socket) -> tuple[int, dict[str, str]]:
    """One response's status and headers (its body read and dropped)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        assert chunk, f"the connection closed before a response: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in lines[1:])}
    length = int(headers.get("content-length", "0"))
    while len(body) < length:
        chunk = conn.recv(65536)
        assert chunk, "the connection closed inside a body"
        body += chunk
    return int(lines[0].split()[1]), headers


def test_a_request_on_a_kept_alive_connection_during_the_drain_is_served_then_closed(
        config: Config, db: Database) -> None:
    """uvicorn closed the idle connection at the signal: a request its client wrote then met
    a reset. Now it is served, says `Connection: close`, and the close follows."""
    # A grace longer than this test: the request below cannot race the idle close.
    with Serving(config, db, Drain(idle_grace_s=600)) as serving, \
            socket.create_connection(("127.0.0.1", serving.port), timeout=30) as conn:
        conn.sendall(REQUEST)
        status, headers = read_response(conn)
        assert status == 200 and headers.get("connection") != "close"
        serving.stop()  # uvicorn has shut this idle connection down by now
        conn.sendall(REQUEST)
        status, headers = read_response(conn)
        assert status == 200 and headers.get("connection") == "close"
        assert conn.recv(1) == b""  # closed cleanly, between requests


def test_an_idle_connection_is_closed_after_the_grace_and_the_server_exits(
        config: Config, db: Database) -> None:
    with Serving(config, db, Drain(idle_grace_s=0.2)) as serving, \
            socket.create_connection(("127.0.0.1", serving.port), timeout=30) as conn:
        conn.sendall(REQUEST)
        assert read_response(conn)[0] == 200
        serving.stop()
        assert conn.recv(1) == b""
        serving.thread.join(timeout=30)
        assert not serving.thread.is_alive()


def test_the_socket_variables_of_another_process_are_ignored_and_unset() -> None:
    env = {"LISTEN_PID": str(os.getpid() + 1), "LISTEN_FDS": "1", "LISTEN_FDNAMES": "gateway",
           "PATH": "/usr/bin"}
    assert inherited_socket(env) is None
    assert env == {"PATH": "/usr/bin"}
    env = {"LISTEN_PID": str(os.getpid()), "LISTEN_FDS": "0"}
    assert inherited_socket(env) is None and env == {}


# --- socket activation, with real processes -----------------------------------------------------


def write_config(root: Path, port: int) -> Path:
    root.mkdir(parents=True)
    path = root / "appliance.toml"
    path.write_text(textwrap.dedent(f"""\
        [server]
        port = {free_port()}

        [paths]
        state_dir = "{root / 'state'}"
        models_dir = "{root / 'models'}"
        log_dir = "{root / 'log'}"

        [engine]
        port = {free_port()}

        [gateway]
        host = "127.0.0.1"
        port = {port}
    """))
    (root / "state").mkdir()
    return path


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    """What appliance-gateway.socket holds: a listening socket that outlives the gateways."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(4096)
    yield sock
    sock.close()


def activated(config: Path, sock: socket.socket, log: Path) -> subprocess.Popen[bytes]:
    """`appliance gateway` started as systemd starts it from the socket unit."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("APPLIANCE_", "LISTEN_", "NOTIFY_SOCKET", "WATCHDOG_"))}
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-c", SHIM, str(sock.fileno()), "--config", str(config),
             "gateway"], pass_fds=[sock.fileno()], stdout=out, stderr=subprocess.STDOUT,
            env=env, cwd=REPO)


class Load:
    """WORKERS clients, each reusing its keep-alive connections (httpx.Client), asking for
    /v1/models with a key until stopped (bounded)."""

    def __init__(self, url: str, key: str) -> None:
        self.url, self.key = url, key
        self.statuses: collections.Counter[int] = collections.Counter()
        self.errors: list[str] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.deadline = time.monotonic() + LOAD_LIMIT_SECONDS
        self.threads = [threading.Thread(target=self._worker, daemon=True)
                        for _ in range(WORKERS)]

    @property
    def done(self) -> int:
        with self.lock:
            return sum(self.statuses.values())

    def start(self) -> None:
        for thread in self.threads:
            thread.start()

    def join(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=90)
            assert not thread.is_alive()

    def _worker(self) -> None:
        headers = {"Authorization": f"Bearer {self.key}"}
        # A timeout far above a restart: a queued connection waits for the next process.
        with httpx.Client(timeout=60, headers=headers) as client:
            while not self.stop.is_set() and time.monotonic() < self.deadline:
                try:
                    status = client.get(f"{self.url}/v1/models").status_code
                except httpx.HTTPError as exc:
                    with self.lock:
                        self.errors.append(f"{type(exc).__name__}: {exc}")
                    time.sleep(0.05)
                    continue
                with self.lock:
                    self.statuses[status] += 1


def answers(url: str, key: str) -> bool:
    try:
        return httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"},
                         timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def test_a_restart_under_load_refuses_nobody(tmp_path: Path, listener: socket.socket) -> None:
    port = listener.getsockname()[1]
    config = write_config(tmp_path / "box", port)
    assert run_cli("--config", str(config), "migrate").returncode == 0
    made = run_cli("--config", str(config), "keys", "create", "--name", "load")
    assert made.returncode == 0, made.stderr
    key = made.stdout.strip()
    url = f"http://127.0.0.1:{port}"
    logs = tmp_path / "gateway-a.log", tmp_path / "gateway-b.log"

    first = activated(config, listener, logs[0])
    second: subprocess.Popen[bytes] | None = None
    load = Load(url, key)
    try:
        wait_for(lambda: answers(url, key) or first.poll() is not None, "gateway A", 60)
        assert first.poll() is None, logs[0].read_text()
        load.start()
        wait_for(lambda: load.done >= WORKERS * 25, "the load to be under way", 60)

        # systemctl restart: stop (SIGTERM, wait), then start, while the clients go on.
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=90) == 0, logs[0].read_text()
        before = load.done
        second = activated(config, listener, logs[1])
        wait_for(lambda: load.done >= before + WORKERS * 25 or second.poll() is not None,
                 "gateway B to answer the load", 90)
        assert second.poll() is None, logs[1].read_text()
        load.join()
        assert load.errors == [], (len(load.errors), load.errors[:5])
        assert set(load.statuses) == {200}, dict(load.statuses)
        assert "socket from appliance-gateway.socket" in logs[1].read_text()
    finally:
        load.stop.set()
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def test_a_socket_on_another_address_than_the_config_is_refused_naming_both(
        tmp_path: Path, listener: socket.socket) -> None:
    configured = free_port()
    config = write_config(tmp_path / "box", configured)
    assert run_cli("--config", str(config), "migrate").returncode == 0
    log = tmp_path / "gateway.log"
    proc = activated(config, listener, log)
    try:
        assert proc.wait(timeout=60) == EX_CONFIG, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert f"appliance-gateway.socket listens on 127.0.0.1:{listener.getsockname()[1]}" in text
    assert f"gateway.port = {configured}" in text and "listen.conf" in text
