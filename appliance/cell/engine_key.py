"""The engine key in a cell: one key, the head's, for every engine the head's router calls.

SGLang's router sends a single `--api-key` to every worker, so every member must hold the
head's `engine-api.key`. The head hands its key to a member (`PUT /api/v1/cell/peer/engine-key`)
when it adds it, and again whenever the member reports another key's fingerprint; the member
writes the key file and the engine's `--config` file (appliance.secrets), keeping the key it
replaces in `engine-api.key.previous`. Neither box ever shows or logs a key: they compare
fingerprints (`fingerprint`: the first 16 hex digits of its SHA-256).

A running engine keeps the key it was launched with until its next start. So this box's own
HTTP clients of the engine (the supervisor's, the health probe's) go through `KeyedTransport`:
it sends the key the engine last accepted and, when the engine answers 401, tries the key file
and the previous key, keeping the one that works. The engine's key therefore changes under
the daemon without a daemon restart, and `EngineKeys.running` says which key the engine
accepts (the "running" fingerprint a member reports to its head).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import httpx

from appliance.errors import EX_USAGE, ApplianceError
from appliance.secrets import (
    ENGINE_KEY_RE,
    read_engine_api_key,
    read_key_file,
    write_engine_auth,
    write_private,
)
from appliance.secrets import engine_key_path as key_path

# SGLang answers these without a key (utils/auth.py): an answer there proves nothing.
EXEMPT_PREFIXES = ("/health", "/ready", "/metrics")


def fingerprint(key: str) -> str:
    """A key's public name: 16 hex digits of its SHA-256 (the key itself is 256 random bits,
    so the fingerprint tells nothing about it)."""
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def previous_key_path(state_dir: Path) -> Path:
    return state_dir / "secrets" / "engine-api.key.previous"


def check_key(text: str) -> str:
    """`text` if it has an engine key's shape (appliance.secrets.ENGINE_KEY_RE), else a
    refusal that names the rule (never the value)."""
    if not ENGINE_KEY_RE.fullmatch(text):
        raise ApplianceError(
            "engine_key_invalid", "that is not an engine API key (32 to 128 letters, digits, "
            "'_' or '-', not starting with '-')",
            "the head sends its own state_dir/secrets/engine-api.key", exit_code=EX_USAGE)
    return text


def hand_over(state_dir: Path, key: str) -> bool:
    """Make `key` this box's engine key: the key file (0600) and the engine's `--config` file,
    the replaced key kept as the previous one (a running engine still uses it). False when
    the box already held it."""
    current = read_engine_api_key(state_dir)
    if current == check_key(key):
        return False
    if current is not None:
        write_private(previous_key_path(state_dir), current.encode() + b"\n")
    write_private(key_path(state_dir), key.encode() + b"\n")
    write_engine_auth(state_dir)
    return True


class EngineKeys:
    """The key this box's clients send to its engine, and the one the engine last accepted.

    `current` starts as the key the daemon read at its start; `accept` moves it to a key the
    engine took. `alternatives` are the keys worth trying after a 401: the key file now and
    the previous key (a handover since the engine started, or since the daemon did)."""

    def __init__(self, state_dir: Path, boot_key: str | None) -> None:
        self._state_dir = state_dir
        self.current = boot_key
        self.accepted: str | None = None

    def on_disk(self) -> tuple[str, ...]:
        """The key file's key and the previous one (a head's hand-over replaced it; an engine
        started before logged it). Reads two small files: call it off the event loop."""
        keys = (read_engine_api_key(self._state_dir),
                read_key_file(previous_key_path(self._state_dir)))
        return tuple(k for k in dict.fromkeys(keys) if k is not None)

    def alternatives(self, tried: str | None) -> list[str]:
        return [k for k in self.on_disk() if k != tried]

    def known(self, on_disk: tuple[str, ...]) -> tuple[str, ...]:
        """Every key an engine of this box may have been given: the two held in memory and
        `on_disk` (read earlier by `on_disk()`); what the log's by-value redaction removes."""
        return tuple(dict.fromkeys(k for k in (self.current, self.accepted, *on_disk) if k))

    def accept(self, key: str | None) -> None:
        self.current = self.accepted = key

    @property
    def running(self) -> str | None:
        """The fingerprint of the key the engine last accepted; None before any answer."""
        return fingerprint(self.accepted) if self.accepted else None


class KeyedTransport(httpx.AsyncBaseTransport):
    """Adds `Authorization: Bearer KEY` to every request to this box's engine, retrying a
    401 once per alternative key (module docstring). Requests with a streamed body are sent
    once: only a body held in memory can be sent again."""

    def __init__(self, keys: EngineKeys, inner: httpx.AsyncBaseTransport | None = None) -> None:
        self._keys = keys
        self._inner = inner or httpx.AsyncHTTPTransport()

    async def _send(self, request: httpx.Request, key: str | None) -> httpx.Response:
        if key:
            request.headers["Authorization"] = f"Bearer {key}"
        return await self._inner.handle_async_request(request)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        key = self._keys.current
        response = await self._send(request, key)
        if request.url.path.startswith(EXEMPT_PREFIXES):
            return response
        if response.status_code == 401 and isinstance(request.stream, httpx.ByteStream):
            for other in self._keys.alternatives(key):
                await response.aclose()
                key, response = other, await self._send(request, other)
                if response.status_code != 401:
                    break
        if response.status_code < 400:
            self._keys.accept(key)
        return response

    async def aclose(self) -> None:
        await self._inner.aclose()
