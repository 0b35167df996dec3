"""The fake Hub's HTTP surface: the request handler and its routes.

Part of a test and demo instrument (`appliance.testing.fake_hub`), not production code.

Routes (reference/weights-and-hub.md §3.1):

    GET  /api/models/{org}/{name}[/revision/{rev}][?blobs=True]   model info
    GET  /api/models/{org}/{name}/tree/{rev}[/{path}]             tree, Link-paginated
    POST /api/models/{org}/{name}/paths-info/{rev}                paths info (form body)
    HEAD/GET /{org}/{name}/resolve/{rev}/{path}                   a file (Range honoured)
    HEAD/GET /lfs-blobs/{org}/{name}/{sha256}                     the "CDN" (redirect fault)
    GET/POST/DELETE /_fake/faults, GET/DELETE /_fake/requests     control (never needs auth)

Invariants: HTTP/1.1 keep-alive, so every answer carries a Content-Length and a body that was
cut short closes its connection; nothing is gzipped; `/api/` and `/resolve/` need the token
when one is set, `/lfs-blobs/` never does (it stands for a signed CDN URL); every request is
recorded exactly once: when it arrives, completed when it ends with the status and the body
bytes actually sent.
"""

from __future__ import annotations

import json
import secrets
import time
from http.server import BaseHTTPRequestHandler
from typing import Any, cast
from urllib.parse import parse_qs, parse_qsl, quote, unquote, urlencode, urlsplit

from appliance.testing.fake_hub import api
from appliance.testing.fake_hub.body import (
    RangeNotSatisfiable,
    parse_range,
    send_file,
    wait_or_gone,
)
from appliance.testing.fake_hub.faults import FaultSpecError
from appliance.testing.fake_hub.repo import Entry, Snapshot
from appliance.testing.fake_hub.server import HubServer, HubState

HANG_SECONDS = 3600.0
_TRUE = ("true", "1", "yes")


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "fake-hub/1 (appliance test instrument)"
    sys_version = ""
    # Headers and body go out in separate writes; with Nagle on, the body of every small
    # answer would wait ~40 ms for the client's delayed ACK.
    disable_nagle_algorithm = True
    # Per request, reset by _handle: the status line sent (None: none yet) and body bytes sent.
    _status: int | None = None
    _sent = 0

    # -- plumbing -------------------------------------------------------------------------

    @property
    def state(self) -> HubState:
        return cast(HubServer, self.server).state

    def log_message(self, format: str, *args: Any) -> None:
        """Silent: the request log is the record."""

    def send_response(self, code: int, message: str | None = None) -> None:
        self._status = code
        super().send_response(code, message)

    def do_GET(self) -> None:
        self._handle()

    do_HEAD = do_POST = do_DELETE = do_PUT = do_GET

    def _handle(self) -> None:
        self._status = None
        self._sent = 0
        split = urlsplit(self.path)
        self._query = split.query
        self._raw_path = split.path
        parts = [unquote(p) for p in split.path.split("/")[1:]]
        entry = self.state.log.begin({
            "t": time.time(), "method": self.command, "path": unquote(split.path),
            "query": split.query, "range": self.headers.get("Range"), "status": None,
            "bytes": 0, "auth": self.headers.get("Authorization") is not None,
            "host": self.headers.get("Host"),
        })
        try:
            body = self._read_body()
            self._route(parts, body)
        except OSError:
            self.close_connection = True  # the client went away mid-answer
        except Exception:
            self.close_connection = True
            if self._status is None:
                self._error(500, "fake hub: internal error (see its stderr)")
            raise
        finally:
            self.state.log.finish(entry, status=self._status, bytes=self._sent)

    def _read_body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length > 0 else b""

    def _respond(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None,
                 content_type: str = "application/json") -> None:
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if body and self.command != "HEAD":
            self.wfile.write(body)
            self._sent = len(body)

    def _json(self, payload: Any, status: int = 200, headers: dict[str, str] | None = None,
              ) -> None:
        self._respond(status, json.dumps(payload).encode(), headers)

    def _error(self, status: int, message: str, code: str | None = None,
               headers: dict[str, str] | None = None) -> None:
        extra = dict(headers or {})
        # Header values go out as latin-1; a repo path may hold any character.
        extra["X-Error-Message"] = message.encode("ascii", "backslashreplace").decode()
        if code is not None:
            extra["X-Error-Code"] = code
        self._json({"error": message}, status, extra)

    # -- routing --------------------------------------------------------------------------

    def _route(self, parts: list[str], body: bytes) -> None:
        method = self.command
        if parts[:1] == ["_fake"]:
            self._control(parts[1:], body)
        elif parts[:1] == ["api"]:
            if method not in ("GET", "HEAD", "POST"):
                self._error(405, f"{method} is not served on /api/")
            elif self._authorized():
                if self.state.faults.switch("hang-api"):
                    self._hang()
                else:
                    self._api(parts[1:], body)
        elif parts[:1] == ["lfs-blobs"] and len(parts) == 4:
            if method not in ("GET", "HEAD"):
                self._error(405, f"{method} is not served on /lfs-blobs/")
            else:
                self._lfs_blob(f"{parts[1]}/{parts[2]}", parts[3])
        elif len(parts) >= 5 and parts[2] == "resolve":
            if method not in ("GET", "HEAD"):
                self._error(405, f"{method} is not served on /resolve/")
            elif self._authorized():
                self._resolve(f"{parts[0]}/{parts[1]}", parts[3], "/".join(parts[4:]))
        else:
            self._error(404, f"fake hub: no route for {method} {self._raw_path}")

    def _authorized(self) -> bool:
        token = self.state.token
        if token is None:
            return True
        header = self.headers.get("Authorization")
        expected = f"Bearer {token}".encode()
        if header is not None and secrets.compare_digest(header.encode(), expected):
            return True
        if header is None:
            self._error(401, "Access to this repo is restricted: this fake hub was started "
                        "with a token; send Authorization: Bearer <token>", "GatedRepo")
        else:
            self._error(401, "Invalid credentials in Authorization header")
        return False

    def _hang(self) -> None:
        """`hang-api`: no answer at all until the client gives up or the server stops."""
        wait_or_gone(self.connection, HANG_SECONDS, self.state.stop)
        self.close_connection = True

    def _snapshot(self, repo_id: str, revision: str) -> Snapshot | None:
        """The repo at `revision` (`main` or its commit), or None after answering 404."""
        repo = self.state.repos.get(repo_id)
        if repo is None:
            self._error(404, f"Repository not found: {repo_id}", "RepoNotFound")
            return None
        snapshot = repo.snapshot()
        if revision not in ("main", snapshot.commit):
            self._error(404, f"Invalid rev id: {revision}", "RevisionNotFound")
            return None
        return snapshot

    # -- /api ---------------------------------------------------------------------------

    def _api(self, parts: list[str], body: bytes) -> None:
        if len(parts) < 3 or parts[0] != "models":
            repo = "/".join(parts[1:3])
            self._error(404, f"Repository not found: {repo} (this fake hub serves models)",
                        "RepoNotFound")
            return
        repo_id, rest = f"{parts[1]}/{parts[2]}", parts[3:]
        query = parse_qs(self._query)
        post = self.command == "POST"
        if not rest and not post:
            self._model_info(repo_id, "main", query)
        elif rest[:1] == ["revision"] and len(rest) >= 2 and not post:
            self._model_info(repo_id, "/".join(rest[1:]), query)
        elif rest[:1] == ["tree"] and len(rest) >= 2 and not post:
            self._tree(repo_id, rest[1], "/".join(rest[2:]).strip("/"), query)
        elif rest[:1] == ["paths-info"] and len(rest) == 2 and post:
            self._paths_info(repo_id, rest[1], body)
        else:
            self._error(404, f"fake hub: no route for {self.command} {self._raw_path}")

    def _model_info(self, repo_id: str, revision: str, query: dict[str, list[str]]) -> None:
        snapshot = self._snapshot(repo_id, revision)
        if snapshot is not None:
            blobs = query.get("blobs", [""])[0].lower() in _TRUE
            self._json(api.model_info(repo_id, snapshot, blobs=blobs))

    def _tree(self, repo_id: str, revision: str, path: str,
              query: dict[str, list[str]]) -> None:
        snapshot = self._snapshot(repo_id, revision)
        if snapshot is None:
            return
        recursive = query.get("recursive", [""])[0].lower() in _TRUE
        items = api.tree(snapshot, path, recursive=recursive)
        if items is None:
            self._error(404, f"{path} does not exist on {revision}", "EntryNotFound",
                        {"X-Repo-Commit": snapshot.commit})
            return
        cursor_text = query.get("cursor", ["0"])[0]
        if not cursor_text.isdigit():
            self._error(400, f"bad cursor {cursor_text!r}")
            return
        cursor, size = int(cursor_text), self.state.page_size
        headers = {}
        if cursor + size < len(items):
            params = [(k, v) for k, v in parse_qsl(self._query, keep_blank_values=True)
                      if k != "cursor"]
            params.append(("cursor", str(cursor + size)))
            host = self.headers.get("Host") or urlsplit(self.state.origin).netloc
            headers["Link"] = f'<http://{host}{self._raw_path}?{urlencode(params)}>; rel="next"'
        self._json(items[cursor:cursor + size], headers=headers)

    def _paths_info(self, repo_id: str, revision: str, body: bytes) -> None:
        snapshot = self._snapshot(repo_id, revision)
        if snapshot is None:
            return
        if (self.headers.get("Content-Type") or "").startswith("application/json"):
            paths = json.loads(body or b"{}").get("paths", [])
        else:
            paths = parse_qs(body.decode()).get("paths", [])
        self._json(api.paths_info(snapshot, paths))

    # -- files ----------------------------------------------------------------------------

    def _resolve(self, repo_id: str, revision: str, path: str) -> None:
        snapshot = self._snapshot(repo_id, revision)
        if snapshot is None:
            return
        entry = snapshot.get(path)
        headers = {"X-Repo-Commit": snapshot.commit}
        if entry is None:
            self._error(404, f"Entry not found: {path}", "EntryNotFound", headers)
            return
        if self.command == "GET" and self._status_fault():
            return
        if entry.sha256 is not None:
            headers["X-Linked-Etag"] = f'"{entry.sha256}"'
            headers["X-Linked-Size"] = str(entry.size)
            if self.state.faults.switch("redirect"):
                headers["Location"] = (f"{self.state.cdn_origin}/lfs-blobs/"
                                       f"{quote(repo_id)}/{entry.sha256}")
                self._respond(302, headers=headers, content_type="text/plain")
                return
        headers["ETag"] = f'"{entry.etag}"'
        self._file(entry, headers)

    def _lfs_blob(self, repo_id: str, sha256: str) -> None:
        repo = self.state.repos.get(repo_id)
        entry = repo.snapshot().by_sha256(sha256) if repo is not None else None
        if entry is None:
            self._error(404, f"no such blob: {repo_id}/{sha256}")
            return
        if self.command == "GET" and self._status_fault():
            return
        self._file(entry, {"ETag": f'"{sha256}"'})

    def _status_fault(self) -> bool:
        """Answer with a 5xx/429 fault if one is pending (True), else nothing (False)."""
        fault = self.state.faults.take_status()
        if fault is None:
            return False
        headers = {"Retry-After": fault.retry_after} if fault.retry_after is not None else {}
        self._error(fault.status, f"fake hub fault {fault.text!r}", headers=headers)
        return True

    def _file(self, entry: Entry, headers: dict[str, str]) -> None:
        headers["Accept-Ranges"] = "bytes"
        size = entry.size
        if self.command == "HEAD":
            self._head(200, size, headers)
            return
        byte_range = None
        if not self.state.faults.switch("no-range"):
            try:
                byte_range = parse_range(self.headers.get("Range"), size)
            except RangeNotSatisfiable:
                headers["Content-Range"] = f"bytes */{size}"
                self._respond(416, headers=headers, content_type="application/octet-stream")
                return
        plan = self.state.faults.take_body(entry.path, entry.lfs)
        if byte_range is None:
            start, length = 0, size
            self._head(200, size, headers)
        else:
            start, length = byte_range.first, byte_range.length
            headers["Content-Range"] = f"bytes {byte_range.first}-{byte_range.last}/{size}"
            self._head(206, length, headers)
        sent = send_file(self.connection, entry.disk_path, start, length, plan,
                         self.state.stop)
        self._sent = sent.bytes
        if not sent.complete:
            self.close_connection = True
            if plan.cut is not None and plan.cut.kind == "reset":
                cast(HubServer, self.server).reset_on_close(self.connection)

    def _head(self, status: int, length: int, headers: dict[str, str]) -> None:
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(length))
        self.end_headers()

    # -- /_fake ---------------------------------------------------------------------------

    def _control(self, parts: list[str], body: bytes) -> None:
        route = (self.command, "/".join(parts))
        faults = self.state.faults
        if route == ("GET", "requests"):
            self._json(self.state.log.records())
        elif route == ("DELETE", "requests"):
            self.state.log.clear()
            self._json({"cleared": True})
        elif route == ("GET", "faults"):
            self._json(faults.describe())
        elif route == ("DELETE", "faults"):
            faults.clear()
            self._json(faults.describe())
        elif route == ("POST", "faults"):
            try:
                specs = json.loads(body or b"[]")
                if not isinstance(specs, list) or not all(isinstance(s, str) for s in specs):
                    raise FaultSpecError("POST /_fake/faults wants a JSON list of spec strings")
                faults.replace(specs)
            except ValueError as exc:  # FaultSpecError and bad JSON alike
                self._error(400, str(exc))
                return
            self._json(faults.describe())
        else:
            self._error(404, f"fake hub: no control route {self.command} /_fake/{route[1]}")
