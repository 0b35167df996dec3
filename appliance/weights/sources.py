"""Where weights come from: the Hugging Face Hub or a Hub-compatible mirror, or a directory.

`HubSource` speaks the Hub's HTTP protocol with httpx and a timeout on every call (the Hub
client has API calls without one: reference/weights-and-hub.md §1.5). It resolves a revision
to a commit and reads the manifest in one `model_info(blobs=True)` request, falling back to the
paginated tree; file URLs are pinned to the commit. The token goes only to the endpoint's own
origin: httpx drops `Authorization` when a redirect leaves it (the CDN), and the token is
never part of a URL, an error or a log line.

A directory source (an import from a mounted disk) has no protocol: its manifest comes from a
`manifest.json` exported by `appliance weights export-manifest`, from the database, or from
the Hub; see service.py.
"""

from __future__ import annotations

import re
import socket
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import quote

import httpx

from appliance.errors import ApplianceError
from appliance.weights.manifest import (
    Manifest,
    ManifestError,
    manifest_from_json,
    manifest_from_model_info,
    manifest_from_tree,
)

API_TIMEOUT = httpx.Timeout(30.0, connect=10.0)
MANIFEST_FILE = "manifest.json"
USER_AGENT = "kimi-k3-appliance"


class WeightSource(Protocol):
    """A Hub-like origin of files (the port the downloader uses)."""

    @property
    def description(self) -> str: ...

    def file_url(self, commit: str, path: str) -> str: ...

    def headers(self) -> dict[str, str]: ...

    async def manifest(self, client: httpx.AsyncClient, repo_id: str,
                       revision: str) -> Manifest: ...


class SourceError(ApplianceError):
    """The source refused or failed; `retryable` says whether waiting can help."""

    def __init__(self, message: str, hint: str, *, retryable: bool) -> None:
        super().__init__("weights_source", message, hint, status=502)
        self.retryable = retryable


@dataclass(frozen=True)
class HubSource:
    """The Hub (or a mirror) at `endpoint`; `token` may be empty (public repos)."""

    endpoint: str
    repo_id: str
    token: str = ""

    def __repr__(self) -> str:  # never the token
        return f"HubSource({self.endpoint!r}, {self.repo_id!r})"

    @property
    def description(self) -> str:
        return f"{self.endpoint.rstrip('/')}/{self.repo_id}"

    def headers(self) -> dict[str, str]:
        headers = {"User-Agent": USER_AGENT, "Accept-Encoding": "identity"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        return headers

    def file_url(self, commit: str, path: str) -> str:
        return f"{self.endpoint.rstrip('/')}/{self.repo_id}/resolve/{commit}/{quote(path)}"

    async def manifest(self, client: httpx.AsyncClient, repo_id: str,
                       revision: str) -> Manifest:
        """Resolve `revision` and list every file with its size and hash."""
        base = f"{self.endpoint.rstrip('/')}/api/models/{repo_id}"
        url = f"{base}/revision/{quote(revision, safe='')}"
        info = await self._get_json(client, url, {"blobs": "True"}, repo_id, revision)
        if not isinstance(info, dict):
            raise ManifestError(f"the Hub's answer for {repo_id}@{revision} is not an object")
        siblings = info.get("siblings")
        complete = isinstance(siblings, list) and all(
            isinstance(s, dict) and ("size" in s or "lfs" in s) for s in siblings)
        if complete:
            return manifest_from_model_info(repo_id, revision, info)
        commit = info.get("sha")  # an older mirror without file metadata: walk the tree
        if not isinstance(commit, str) or not re.fullmatch(r"[0-9a-f]{40}", commit):
            raise ManifestError(f"the Hub answered no commit for {repo_id}@{revision}")
        entries: list[dict[str, Any]] = []
        next_url: str | None = f"{base}/tree/{commit}"
        params: dict[str, str] | None = {"recursive": "true", "expand": "false"}
        while next_url is not None:
            page, link = await self._get_page(client, next_url, params, repo_id, revision)
            entries.extend(e for e in page if isinstance(e, dict))
            next_url, params = link, None
        return manifest_from_tree(repo_id, revision, commit, entries)

    async def _get_json(self, client: httpx.AsyncClient, url: str, params: dict[str, str] | None,
                        repo_id: str, revision: str) -> Any:
        return (await self._get_page(client, url, params, repo_id, revision, whole=True))[0]

    async def _get_page(self, client: httpx.AsyncClient, url: str,
                        params: dict[str, str] | None, repo_id: str, revision: str,
                        *, whole: bool = False) -> tuple[Any, str | None]:
        try:
            response = await client.get(url, params=params, headers=self.headers(),
                                        timeout=API_TIMEOUT, follow_redirects=True)
        except httpx.TimeoutException:
            raise SourceError(f"{self.endpoint} did not answer the file list of {repo_id} "
                              "within 30 s", "the pull retries by itself; check the endpoint "
                              "if it keeps failing", retryable=True) from None
        except httpx.TransportError as exc:
            raise SourceError(f"cannot reach {self.endpoint}: {network_reason(exc)}",
                              "check the network, a proxy, or weights.endpoint; the pull "
                              "retries by itself", retryable=True) from None
        refuse_status(response, f"{repo_id}@{revision}", self.endpoint)
        try:
            body = response.json()
        except ValueError:
            raise SourceError(f"{self.endpoint} answered the file list of {repo_id} with "
                              "something that is not JSON", "is weights.endpoint a Hub or a "
                              "Hub-compatible mirror?", retryable=True) from None
        if whole:
            return body, None
        if not isinstance(body, list):
            raise ManifestError(f"the tree of {repo_id}@{revision} is not a list")
        link = response.links.get("next", {}).get("url")
        return body, link


def network_reason(exc: BaseException) -> str:
    """A transport failure in the operator's words ("connection refused", "the host name
    does not resolve"), from the first cause in the chain that says what happened."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, socket.gaierror):
            return "the host name does not resolve"
        if isinstance(seen, ConnectionRefusedError):
            return "connection refused"
        if isinstance(seen, ConnectionResetError):
            return "the connection was reset"
        if isinstance(seen, TimeoutError):
            return "no answer (timed out)"
        if isinstance(seen, ssl.SSLError):
            return f"TLS failed ({seen.reason or seen})"
        if isinstance(seen, OSError) and seen.strerror:
            return seen.strerror[:1].lower() + seen.strerror[1:]
        seen = seen.__cause__ or seen.__context__
    text = str(exc).strip()  # httpcore may keep only the text of the OS error
    for marker, words in (("Connection refused", "connection refused"),
                          ("Name or service not known", "the host name does not resolve"),
                          ("timed out", "no answer (timed out)")):
        if marker in text:
            return words
    return text or type(exc).__name__


def refuse_status(response: httpx.Response, what: str, endpoint: str) -> None:
    """Raise SourceError for a non-2xx answer (see `classify_status`)."""
    if response.status_code >= 300:
        raise classify_status(response.status_code, response.headers.get("X-Error-Code", ""),
                              what, endpoint)


def classify_status(status: int, code: str, what: str, endpoint: str) -> SourceError:
    """The SourceError for a non-2xx answer: 408, 429 and 5xx are retryable (waiting helps),
    the rest are not (a token, a repo id or an endpoint to fix)."""
    if status in (401, 403):
        return SourceError(
            f"{endpoint} refused {what} ({status}{' ' + code if code else ''}): the repo is "
            "gated or private and the token is missing, wrong or lacks access",
            "set weights.token_file (or HF_TOKEN) to a token with read access, accept the "
            "model's terms on the Hub, then pull again", retryable=False)
    if status == 404:
        detail = {"RepoNotFound": "no such repo", "RevisionNotFound": "no such revision",
                  "EntryNotFound": "no such file"}.get(code, "not found")
        return SourceError(f"{endpoint}: {what}: {detail} (404)",
                           "check weights.repo, weights.revision and weights.endpoint",
                           retryable=False)
    retryable = status == 429 or status >= 500 or status == 408
    return SourceError(f"{endpoint} answered {status} for {what}",
                       "the pull retries by itself" if retryable else
                       "check weights.endpoint (is it a Hub-compatible server?)",
                       retryable=retryable)


def read_manifest_file(directory: Path) -> Manifest | None:
    """The manifest exported beside a checkpoint on a disk (`manifest.json`), or None."""
    path = directory / MANIFEST_FILE
    if not path.is_file():
        return None
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ManifestError(f"cannot read {path}: {exc}") from None
    return manifest_from_json(text)
