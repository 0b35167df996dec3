"""`FakeHub`: the fake Hugging Face Hub as an object a test starts and stops in-process.

Part of a test and demo instrument (`appliance.testing.fake_hub`), not production code.

Invariants: it binds 127.0.0.1 unless a host is given; `url` is known once `start()` returns;
`stop()` returns promptly even with threads stalled or hung by faults (every fault wait watches
the stop event, and open connections are shut down); the "CDN" origin that the `redirect`
fault points to is `http://localhost:PORT` when `localhost` reaches the bound address (a
different origin to clients, the same socket), else a second listener on another port.
"""

from __future__ import annotations

import re
import socket
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

from appliance.testing.fake_hub.faults import FaultSet
from appliance.testing.fake_hub.handler import Handler
from appliance.testing.fake_hub.repo import DigestCache, Repo
from appliance.testing.fake_hub.requestlog import RequestLog
from appliance.testing.fake_hub.server import HubServer, HubState

REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")
DEFAULT_PAGE_SIZE = 1000
_STOP_GRACE_SECONDS = 2.0


def _origin(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def localhost_reaches(host: str) -> bool:
    """Whether a client connecting to `localhost` lands on a socket bound to `host`. Clients
    try every address `localhost` resolves to, so one IPv4 loopback answer is enough."""
    if host not in ("127.0.0.1", "0.0.0.0"):  # noqa: S104  # a comparison, not a bind
        return False
    try:
        infos = socket.getaddrinfo("localhost", None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    return any(info[4][0] == "127.0.0.1" for info in infos)


class FakeHub:
    """A fake Hugging Face Hub serving `repos` ("org/name" → folder) over plain HTTP.

    Use as a context manager, or `start()` / `stop()`. Faults (see the package docstring) can
    be given here, replaced with `set_faults`, or cleared; `requests()` returns the request
    log (see `requestlog.py`).
    """

    def __init__(self, repos: Mapping[str, Path], *, host: str = "127.0.0.1", port: int = 0,
                 token: str | None = None, faults: Iterable[str] = (),
                 request_log: Path | None = None, page_size: int = DEFAULT_PAGE_SIZE) -> None:
        digests = DigestCache()
        served: dict[str, Repo] = {}
        for repo_id, folder in repos.items():
            if REPO_ID.fullmatch(repo_id) is None:
                raise ValueError(f"repo id {repo_id!r} is not of the form ORG/NAME")
            if not Path(folder).is_dir():
                raise ValueError(f"repo {repo_id}: {folder} is not a directory")
            served[repo_id] = Repo(repo_id, Path(folder).resolve(), digests)
        if page_size < 1:
            raise ValueError(f"page_size must be at least 1, not {page_size}")
        if token == "":
            raise ValueError("token must be None (no auth) or a non-empty string")
        self._host, self._port = host, port
        self._state = HubState(served, token, FaultSet(faults), RequestLog(request_log),
                               page_size)
        self._servers: list[HubServer] = []
        self._threads: list[threading.Thread] = []

    # -- life -----------------------------------------------------------------------------

    def start(self) -> FakeHub:
        """Bind and serve in background threads; returns self. Only once per instance."""
        if self._servers or self._state.stop.is_set():
            raise RuntimeError("a FakeHub starts once; make a new one")
        main = HubServer((self._host, self._port), self._state, Handler)
        self._servers.append(main)
        self._state.origin = _origin(self._host, main.server_address[1])
        if localhost_reaches(self._host):
            self._state.cdn_origin = f"http://localhost:{main.server_address[1]}"
        else:
            cdn = HubServer((self._host, 0), self._state, Handler)
            self._servers.append(cdn)
            self._state.cdn_origin = _origin(self._host, cdn.server_address[1])
        for server in self._servers:
            thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1},
                                      name=f"fake-hub:{server.server_address[1]}", daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self) -> None:
        """Stop serving, wake every request thread (stalls and hangs included) and close."""
        if self._state.stop.is_set():
            return
        self._state.stop.set()
        for server in self._servers:
            server.shutdown()
            server.close_connections()
            server.server_close()
        for thread in self._threads:
            thread.join()
        # Request threads are daemons; give the woken ones a moment so their last records land.
        deadline = time.monotonic() + _STOP_GRACE_SECONDS
        while any(s.open_connections() for s in self._servers) and time.monotonic() < deadline:
            time.sleep(0.02)
        self._state.log.close()

    def __enter__(self) -> FakeHub:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.stop()

    # -- where ----------------------------------------------------------------------------

    @property
    def port(self) -> int:
        if not self._servers:
            raise RuntimeError("the FakeHub is not started")
        return int(self._servers[0].server_address[1])

    @property
    def url(self) -> str:
        """The endpoint for clients (`HF_ENDPOINT`), e.g. http://127.0.0.1:PORT."""
        if not self._servers:
            raise RuntimeError("the FakeHub is not started")
        return self._state.origin

    @property
    def cdn_url(self) -> str:
        """The other origin the `redirect` fault sends LFS downloads to."""
        if not self._servers:
            raise RuntimeError("the FakeHub is not started")
        return self._state.cdn_origin

    # -- what it serves and saw -----------------------------------------------------------

    def commit(self, repo_id: str) -> str:
        """The commit `main` resolves to now (hashes files not hashed yet)."""
        return self._state.repos[repo_id].snapshot().commit

    def requests(self) -> list[dict[str, Any]]:
        return self._state.log.records()

    def clear_requests(self) -> None:
        self._state.log.clear()

    # -- faults ---------------------------------------------------------------------------

    def set_faults(self, specs: Iterable[str]) -> None:
        """Replace the active faults; raises `FaultSpecError` (a ValueError), changing nothing,
        if any spec is bad."""
        self._state.faults.replace(specs)

    def clear_faults(self) -> None:
        self._state.faults.clear()

    def faults(self) -> list[dict[str, Any]]:
        """Active faults as `{"spec", "remaining"}`; expired ones are gone."""
        return self._state.faults.describe()
