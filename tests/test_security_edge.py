"""The HTTP edges of both servers (issue 18), over real loopback sockets.

Request heads: both servers run as production builds them (`appliance.server.uvicorn_config`,
`appliance.gateway.serve.uvicorn_config`), with a short header timeout, and refuse an 8 MiB
header, 100,000 headers, a head trickled past the timeout and two Host headers, while normal
requests still pass. The console: its anti-framing and CSP headers on every kind of answer,
control characters in paths refused before they reach a log line, and the inputs that were
500s (OPTIONS without a session, a huge page number or id, a huge tuning ratio, a deeply nested
JSON body) answered 4xx with a message.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from litestar import Litestar
from litestar import get as route
from litestar.params import FromPath
from litestar.plugins.jinja import JinjaTemplateEngine
from litestar.template import TemplateConfig
from litestar.testing import TestClient

from appliance.app import _on_unexpected
from appliance.config import Config
from appliance.db.database import Database
from appliance.gateway.parts import build_gateway
from appliance.gateway.serve import uvicorn_config as gateway_config
from appliance.headbounds import HeadLimits
from appliance.resources import templates_dir
from appliance.runtime import Runtime
from appliance.server import uvicorn_config as console_config
from appliance.ui.templating import configure_templates
from tests.conftest import Console, LiveServer, csrf, free_port, problem

HEAD = HeadLimits(timeout_s=1.0)  # the real size bounds; a timeout a test can wait out
MIB = 1 << 20


class Running:
    """A uvicorn server from its production config, on loopback in a thread of the test."""

    def __init__(self, config: uvicorn.Config) -> None:
        assert config.host == "127.0.0.1"
        self.port = config.port
        self.url = f"http://127.0.0.1:{config.port}"
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> Running:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *_: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=20)


@pytest.fixture
def console_edge(runtime: Runtime) -> Iterator[Running]:
    with Running(console_config(runtime, head=HEAD)) as running:
        yield running


@pytest.fixture
def gateway_edge(config: Config, db: Database) -> Iterator[Running]:
    # No engine behind it: /metrics answers from the gateway alone.
    parts = build_gateway(config, db=db, engine_url=f"http://127.0.0.1:{free_port()}",
                          poll_interval=0.1)
    with Running(gateway_config(parts, head=HEAD)) as running:
        yield running


@pytest.fixture(params=["console", "gateway"])
def edge(request: pytest.FixtureRequest) -> tuple[Running, str]:
    """Each server with a path it answers 200 without credentials."""
    if request.param == "console":
        return request.getfixturevalue("console_edge"), "/healthz"
    return request.getfixturevalue("gateway_edge"), "/metrics"  # /health is 503 sans engine


def exchange(port: int, chunks: Iterable[bytes]) -> bytes:
    """Send `chunks` on one connection (stopping where the server closes it), then read
    until the server closes. b"" when the server reset the connection before any answer."""
    received = b""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        try:
            for chunk in chunks:
                sock.sendall(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass
        try:
            while data := sock.recv(65536):
                received += data
        except ConnectionResetError:
            pass
    return received


def head(path: str, *lines: bytes) -> bytes:
    return b"\r\n".join([f"GET {path} HTTP/1.1".encode(), b"Host: 127.0.0.1", *lines, b"", b""])


def refused(answer: bytes, status: bytes) -> bool:
    """The answer is `status`, or the connection was closed with nothing (never a 200)."""
    return answer == b"" or answer.startswith(b"HTTP/1.1 " + status)


def test_a_normal_request_passes(edge: tuple[Running, str]) -> None:
    server, path = edge
    extra = {f"x-extra-{i}": "v" * 100 for i in range(40)}
    assert httpx.get(server.url + path, headers=extra, timeout=10).status_code == 200
    answer = exchange(server.port, [head(path, b"Connection: close")])
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]


def test_an_8_mib_header_is_refused(edge: tuple[Running, str]) -> None:
    server, path = edge
    start = f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: ".encode()
    chunks = [start, *(b"a" * 65536 for _ in range(8 * MIB // 65536)), b"\r\n\r\n"]
    answer = exchange(server.port, chunks)
    assert refused(answer, b"431"), answer[:200]
    if answer:
        assert b"over 65536 bytes" in answer


def test_100000_headers_are_refused(edge: tuple[Running, str]) -> None:
    server, path = edge
    many = b"".join(b"a%d: b\r\n" % i for i in range(100_000))
    start = f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n".encode()
    chunks = [start, *(many[i:i + 65536] for i in range(0, len(many), 65536)), b"\r\n"]
    assert refused(exchange(server.port, chunks), b"431")


def test_too_many_small_headers_under_the_size_bound_are_refused(
        edge: tuple[Running, str]) -> None:
    server, path = edge
    answer = exchange(server.port, [head(path, *(b"a%d: b" % i for i in range(500)))])
    assert answer.startswith(b"HTTP/1.1 431"), answer[:200]
    assert b"more than 100 request header fields" in answer


def test_a_stalled_head_is_cut_after_the_header_timeout(edge: tuple[Running, str]) -> None:
    server, path = edge
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Half: ".encode())
        answer = b""
        while data := sock.recv(65536):  # ends when the server closes (the socket waits 30 s)
            answer += data
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b"did not arrive within 1 s" in answer


def test_a_connection_that_sends_nothing_is_closed(edge: tuple[Running, str]) -> None:
    server, _ = edge
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        assert sock.recv(65536) == b""  # closed by the server, not by our 30 s timeout


def test_two_host_headers_are_refused(edge: tuple[Running, str]) -> None:
    server, path = edge
    for hosts in ([b"Host: evil.example", b"Host: 127.0.0.1"],
                  [b"Host: 127.0.0.1", b"Host: evil.example"]):
        request = b"\r\n".join([f"GET {path} HTTP/1.1".encode(), *hosts, b"", b""])
        answer = exchange(server.port, [request])
        assert answer.startswith(b"HTTP/1.1 400"), answer[:200]
        assert b"more than one Host header" in answer


def _peak_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc/self/status")


def test_an_oversized_head_does_not_grow_the_server(edge: tuple[Running, str]) -> None:
    """64 MB of headers grew the gateway by 73 MB; now the server stops reading at the bound.
    Measured as this process's peak RSS (the server runs in a thread here), reset first."""
    server, path = edge
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets the peak to the current RSS
    except OSError:
        pytest.skip("this kernel does not let a process reset its peak RSS")
    start = f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: ".encode()
    block = b"a" * 65536
    before = _peak_rss()
    answer = exchange(server.port, [start, *(block for _ in range(64 * MIB // 65536))])
    assert refused(answer, b"431")
    assert _peak_rss() - before < 16 * MIB  # the head is cut at 64 KiB; the rest is noise


# --- the console's answers --------------------------------------------------------------------

SECURITY = {"x-frame-options": "DENY", "referrer-policy": "same-origin",
            "x-content-type-options": "nosniff"}


def assert_secured(response: httpx.Response) -> None:
    for name, value in SECURITY.items():
        assert response.headers.get(name) == value, (response.url, name, response.headers)
    policy = response.headers.get("content-security-policy", "")
    assert "frame-ancestors 'none'" in policy, (response.url, policy)
    assert "script-src 'self'" in policy and "unsafe" not in policy, policy


def test_every_kind_of_console_answer_forbids_framing(server: LiveServer,
                                                      logged_in: Console) -> None:
    anonymous = httpx.Client(base_url=server.base_url, timeout=10)
    answers = [
        anonymous.get("/login"),                       # a public page
        logged_in.http.get("/"),                       # a console page
        logged_in.http.get("/keys"),
        logged_in.http.get("/api/v1/me"),              # an API answer
        anonymous.get("/api/v1/me"),                   # the auth's 401, raised in middleware
        anonymous.get("/keys"),                        # its redirect to the login page
        anonymous.get("/static/app.css"),              # a static file
        anonymous.get("/static/htmx-2.0.11.min.js"),
        anonymous.get("/no/such/page"),                # a 404 no middleware saw
        anonymous.get("/healthz"),
    ]
    anonymous.close()
    assert [a.status_code for a in answers] == [200, 200, 200, 200, 401, 303, 200, 200, 404, 200]
    for answer in answers:
        assert_secured(answer)


def test_console_pages_run_under_their_policy(server: LiveServer, runtime: Runtime,
                                              browser: Any) -> None:
    """Every page of the nav in chromium with the CSP in force: no violation, no JS error
    (htmx's indicator style and eval are off; hx-on moved to /static/console.js)."""
    from tests.browser_rig import admin_on

    with admin_on(browser, server, runtime, "Dashboard", "/") as tab:
        violations: list[str] = []
        tab.on("console", lambda msg: violations.append(msg.text)
               if "Content Security Policy" in msg.text else None)
        for path in ("/", "/weights", "/engine", "/tuning", "/health", "/keys", "/usage",
                     "/audit", "/events", "/settings"):
            answer = tab.goto(path)
            assert answer is not None and answer.status == 200, path
            assert "frame-ancestors 'none'" in answer.headers["content-security-policy"]
            tab.wait_for_load_state("networkidle")
        tab.goto("/keys")
        form = tab.locator("form[hx-post='/keys']")
        form.get_by_label("Name").fill("csp check")
        form.get_by_role("button", name="Create key").click()
        tab.get_by_label("New key").wait_for()
        assert violations == []


def test_control_characters_in_a_path_are_refused_before_any_log(
        server: LiveServer, logged_in: Console, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    for path in ("/static/%00%0aforged line", "/api/v1/keys/%0d%0aforged line",
                 "/no/such/%0aforged line", "/audit%1b[31m"):
        response = logged_in.http.get(path)
        assert response.status_code == 400, (path, response.text[:300])
        assert "control character" in response.text
        assert_secured(response)
    for record in caplog.records:
        assert "\nforged" not in record.getMessage(), record.getMessage()


def test_an_unhandled_error_logs_the_path_escaped(caplog: pytest.LogCaptureFixture) -> None:
    """The 500 handler's log line, for a path that reached it with a newline (an app without
    ConsoleEdge, which would have refused it): the newline is written escaped."""
    @route("/boom/{rest:path}")
    async def boom(rest: FromPath[str]) -> None:
        raise RuntimeError("boom")

    app = Litestar([boom], exception_handlers={Exception: _on_unexpected}, logging_config=None,
                   template_config=TemplateConfig(directory=templates_dir(),
                                                  engine=JinjaTemplateEngine,
                                                  engine_callback=configure_templates))
    caplog.set_level(logging.ERROR)
    with TestClient(app) as client:
        assert client.get("/boom/a%0aforged").status_code == 500
    [line] = [r.getMessage() for r in caplog.records if "unhandled error" in r.getMessage()]
    assert "\n" not in line and "'/boom/a\\nforged'" in line, line


# --- inputs that were 500s --------------------------------------------------------------------

HUGE = "99999999999999999999999"


def test_options_on_the_api_is_no_500(server: LiveServer, logged_in: Console) -> None:
    for path in ("/api/v1/status", "/api/v1/keys", "/api/v1/tuning/"):
        problem(httpx.options(server.base_url + path), 401, "unauthorized")
        answer = logged_in.http.options(path)
        assert answer.status_code == 204, (path, answer.text)
        assert "GET" in answer.headers["allow"]


@pytest.mark.parametrize("path", ["/api/v1/audit", "/api/v1/events"])
def test_a_huge_page_number_on_the_api_is_a_400(logged_in: Console, path: str) -> None:
    body = problem(logged_in.http.get(path, params={"page": HUGE}), 400)
    assert "page" in body["detail"] and "1000000" in body["detail"]


@pytest.mark.parametrize("path", ["/audit", "/events"])
def test_a_huge_page_number_on_a_console_page_is_a_400(logged_in: Console, path: str) -> None:
    for page in (HUGE, "2000000"):  # past 64 bits, and past the cap (PostgreSQL too)
        answer = logged_in.http.get(path, params={"page": page})
        assert answer.status_code == 400, answer.text[:300]
        assert "page" in answer.text and "1000000" in answer.text


def test_an_id_past_64_bits_is_a_400(logged_in: Console) -> None:
    body = problem(logged_in.http.delete("/api/v1/engine/scheduled/100000000000000000000",
                                         headers=csrf(logged_in)), 400, "number_out_of_range")
    assert body["detail"] == "a number in the request is too large"
    answer = logged_in.http.post("/engine/scheduled/100000000000000000000/cancel",
                                 headers=csrf(logged_in))
    assert answer.status_code == 400, answer.text[:300]
    problem(logged_in.http.get("/api/v1/keys/100000000000000000000"), 404, "key_unknown")


def test_a_huge_tuning_ratio_is_refused_with_the_bound(config: Config,
                                                      logged_in: Console) -> None:
    from tests.test_tuning_api import write_k3

    write_k3(config)
    for ratio in (1e308, 1e20, 1001):
        body = problem(logged_in.http.post(
            "/api/v1/tuning/apply", headers=csrf(logged_in),
            json={"profile": "balanced", "ratio": ratio, "restart": False}), 422,
            "tuning_impossible")
        assert "is above 1000" in body["detail"], body


@pytest.mark.parametrize("path", ["/api/v1/tokens", "/api/v1/keys", "/api/v1/tuning/apply"])
def test_a_deeply_nested_json_body_is_a_400(logged_in: Console, path: str) -> None:
    deep = b"[" * 10_000 + b"]" * 10_000
    body = problem(logged_in.http.post(path, content=deep, headers={
        **csrf(logged_in), "content-type": "application/json"}), 400, "body_too_deep")
    assert body["detail"] == "the JSON body is nested too deeply"
