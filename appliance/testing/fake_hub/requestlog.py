"""The fake Hub's record of every request it answered (or dropped).

Part of a test and demo instrument (`appliance.testing.fake_hub`), not production code.

Each record is a flat dict: `t` (time.time() when the request arrived), `method`, `path`
(decoded, without the query), `query` (the raw query string), `range` (the Range header or
None), `status` (None when no status line was sent, e.g. under `hang-api`), `bytes` (body
bytes actually written to the socket), `auth` (whether an Authorization header arrived; tests
use it to prove a client never carries the token to the redirect origin), `host` (the Host
header) and `done` (False while the request is still being answered).

Invariants: the in-memory list is in arrival order (a client's retry comes after the attempt
it retries, even when the stalled attempt ends later); a record is added when its request
arrives and completed in place when it ends, so `status` and `bytes` are final only once
`done` is true. With a file, each request is appended as one JSON line when it ends (so in
completion order; sort by `t` for arrival order) and flushed at once, so a test can read it
even after it killed the client or the server.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import IO, Any


class RequestLog:
    """Thread-safe list of request records, appended at arrival and completed in place."""

    def __init__(self, path: Path | None = None) -> None:
        self._lock = threading.Lock()
        self._records: list[dict[str, Any]] = []
        self._file: IO[str] | None = path.open("a", encoding="utf-8") if path else None

    def begin(self, record: dict[str, Any]) -> dict[str, Any]:
        """Add an arriving request (`done` false); returns the record to pass to `finish`."""
        entry = {**record, "done": False}
        with self._lock:
            self._records.append(entry)
        return entry

    def finish(self, entry: dict[str, Any], **final: Any) -> None:
        """Complete a record with its final fields (status, bytes) and write its line."""
        with self._lock:
            entry.update(final, done=True)
            if self._file is not None and not self._file.closed:
                self._file.write(json.dumps(entry, sort_keys=True) + "\n")
                self._file.flush()

    def records(self) -> list[dict[str, Any]]:
        """Copies, in arrival order: callers may keep them while requests go on."""
        with self._lock:
            return [dict(r) for r in self._records]

    def clear(self) -> None:
        """Forget the in-memory records; the file, if any, keeps everything."""
        with self._lock:
            self._records.clear()

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
