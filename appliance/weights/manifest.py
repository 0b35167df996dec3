"""The weight manifest: what a checkpoint must contain, known before a byte is fetched.

A manifest pins a repo to one commit and lists every file with its size and expected hash:
sha256 for LFS files (every shard), the git blob id (sha1 of "blob <size>\\0" + content) for the
small files the Hub stores in git. Pure: parsing the Hub's JSON, validating paths, JSON export
and import, and the arithmetic of what is still needed. The IO lives in sources.py and the
service.

Invariants: paths are relative, '/'-separated, free of '..', '.', empty segments and odd
characters, unique, and sorted; every file has a size and at least one expected digest; the
commit is what the source resolved (40 hex for the Hub), never a branch name.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from appliance.errors import ApplianceError
from appliance.sizes import bytes_text

FORMAT = "appliance-weights-manifest/1"
PART_SUFFIX = ".part"
# A path segment: a conservative character set, at most 255 bytes; a leading dot is allowed
# (.gitattributes) but not a segment of dots only.
_SEGMENT = re.compile(r"(?!\.+$)[A-Za-z0-9._@+=,~-]{1,255}")
_HEX40 = re.compile(r"[0-9a-f]{40}")
_HEX64 = re.compile(r"[0-9a-f]{64}")
MAX_PATH = 1024


class ManifestError(ApplianceError):
    """A manifest (from a source or a file) that cannot be trusted; names what is wrong."""

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__("manifest_invalid", message,
                         hint or "use a manifest exported by `appliance weights export-manifest` "
                                 "or pull it from the Hub", status=422, exit_code=65)


def check_path(path: object) -> str:
    """`path` if it is a safe relative file path inside the model directory, else ManifestError
    naming it. Rejects absolute paths, '..' and '.', empty segments, backslashes, control
    characters and anything outside a conservative character set, and our own '.part' suffix."""
    if not isinstance(path, str) or not path:
        raise ManifestError(f"manifest path {path!r} is not a non-empty string")
    shown = repr(path)
    if len(path) > MAX_PATH:
        raise ManifestError(f"manifest path {shown[:80]}… is longer than {MAX_PATH} characters")
    if path.startswith("/") or re.match(r"[A-Za-z]:", path):
        raise ManifestError(f"manifest path {shown} is absolute; paths must stay inside the "
                            "model directory")
    if "\\" in path:
        raise ManifestError(f"manifest path {shown} contains a backslash")
    for segment in path.split("/"):
        if segment in ("..", "."):
            raise ManifestError(f"manifest path {shown} contains {segment!r} and could escape "
                                "the model directory")
        if segment == "":
            raise ManifestError(f"manifest path {shown} has an empty segment")
        if not _SEGMENT.fullmatch(segment):
            raise ManifestError(f"manifest path {shown} contains characters outside "
                                "A-Z a-z 0-9 . _ - @ + = , ~")
    if path.endswith(PART_SUFFIX):
        raise ManifestError(f"manifest path {shown} ends in {PART_SUFFIX}, the suffix of "
                            "unfinished downloads")
    return path


@dataclass(frozen=True)
class ManifestFile:
    """One file: where it goes, how big it is, and the digest that proves it."""

    path: str
    size: int
    sha256: str | None = None   # LFS files: the Hub's lfs.sha256
    git_oid: str | None = None  # small files: the git blob id

    @property
    def is_shard(self) -> bool:
        return self.path.endswith(".safetensors")

    def to_dict(self) -> dict[str, Any]:
        body: dict[str, Any] = {"path": self.path, "size": self.size}
        if self.sha256:
            body["sha256"] = self.sha256
        if self.git_oid:
            body["git_oid"] = self.git_oid
        return body


@dataclass(frozen=True)
class Manifest:
    """A repo pinned to a commit, and every file it holds."""

    repo_id: str
    revision: str
    commit: str
    files: tuple[ManifestFile, ...]

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def shards(self) -> tuple[ManifestFile, ...]:
        return tuple(f for f in self.files if f.is_shard)

    def file(self, path: str) -> ManifestFile | None:
        return next((f for f in self.files if f.path == path), None)

    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "repo_id": self.repo_id, "revision": self.revision,
                "commit": self.commit, "total_bytes": self.total_bytes,
                "files": [f.to_dict() for f in self.files]}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=False) + "\n"

    @property
    def digest(self) -> str:
        """sha256 of the canonical form: two manifests with the same digest list the same
        files with the same expected hashes."""
        canonical = json.dumps([self.repo_id, self.commit, [f.to_dict() for f in self.files]],
                               sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()


def build_manifest(repo_id: str, revision: str, commit: str,
                   files: Iterable[ManifestFile]) -> Manifest:
    """A validated manifest: safe unique paths, sane sizes and digests, sorted by path."""
    if not commit or len(commit) > 128 or not re.fullmatch(r"[\w.-]+", commit):
        raise ManifestError(f"manifest commit {commit!r} is not a commit id")
    seen: dict[str, ManifestFile] = {}
    for item in files:
        path = check_path(item.path)
        if path in seen:
            raise ManifestError(f"manifest path {path!r} appears twice")
        if isinstance(item.size, bool) or not isinstance(item.size, int) or item.size < 0:
            raise ManifestError(f"manifest file {path!r} has no valid size ({item.size!r})")
        if item.sha256 is not None and not _HEX64.fullmatch(item.sha256):
            raise ManifestError(f"manifest file {path!r} has a malformed sha256 "
                                f"{item.sha256!r}")
        if item.git_oid is not None and not _HEX40.fullmatch(item.git_oid):
            raise ManifestError(f"manifest file {path!r} has a malformed git blob id "
                                f"{item.git_oid!r}")
        if item.sha256 is None and item.git_oid is None:
            raise ManifestError(f"manifest file {path!r} has no expected hash (sha256 or "
                                "git blob id)")
        seen[path] = item
    for path in seen:  # a path may not be both a file and a folder of other files
        parent = path.rpartition("/")[0]
        while parent:
            if parent in seen:
                raise ManifestError(f"manifest path {parent!r} is a file and a folder")
            parent = parent.rpartition("/")[0]
    if not seen:
        raise ManifestError(f"the manifest of {repo_id}@{commit} lists no files")
    return Manifest(repo_id=repo_id, revision=revision, commit=commit,
                    files=tuple(seen[p] for p in sorted(seen)))


def manifest_from_json(text: str) -> Manifest:
    """Parse a manifest file written by `to_json` (air-gapped import). ManifestError on any
    problem, naming it."""
    try:
        body = json.loads(text)
    except ValueError as exc:
        raise ManifestError(f"the manifest is not JSON: {exc}") from None
    if not isinstance(body, dict) or body.get("format") != FORMAT:
        raise ManifestError(f"the manifest is not in the {FORMAT} format")
    files = body.get("files")
    if not isinstance(files, list):
        raise ManifestError("the manifest has no list of files")
    parsed = []
    for item in files:
        if not isinstance(item, dict):
            raise ManifestError(f"manifest entry {item!r} is not an object")
        parsed.append(ManifestFile(path=item.get("path"), size=item.get("size"),  # type: ignore[arg-type]
                                   sha256=item.get("sha256"), git_oid=item.get("git_oid")))
    return build_manifest(str(body.get("repo_id", "")), str(body.get("revision", "")),
                          str(body.get("commit", "")), parsed)


def manifest_from_model_info(repo_id: str, revision: str, info: Mapping[str, Any]) -> Manifest:
    """From the Hub's `GET /api/models/{repo}/revision/{rev}?blobs=True` answer: `sha` is the
    commit; each sibling has `rfilename`, `size`, `blobId` and, for LFS files,
    `lfs: {sha256, size}` (the LFS size is the real one)."""
    commit = info.get("sha")
    if not isinstance(commit, str) or not _HEX40.fullmatch(commit):
        raise ManifestError(f"the Hub answered no commit for {repo_id}@{revision} "
                            f"(sha={commit!r})", "check the repo id and revision")
    siblings = info.get("siblings")
    if not isinstance(siblings, list):
        raise ManifestError(f"the Hub listed no files for {repo_id}@{commit}")
    files = []
    for entry in siblings:
        if not isinstance(entry, dict):
            raise ManifestError(f"the Hub listed a malformed file entry {entry!r}")
        lfs = entry.get("lfs") if isinstance(entry.get("lfs"), dict) else None
        files.append(ManifestFile(
            path=entry.get("rfilename"),  # type: ignore[arg-type]
            size=(lfs or entry).get("size"),  # type: ignore[arg-type]
            sha256=lfs.get("sha256") if lfs else None,
            git_oid=None if lfs else entry.get("blobId"),
        ))
    return build_manifest(repo_id, revision, commit, files)


def manifest_from_tree(repo_id: str, revision: str, commit: str,
                       entries: Iterable[Mapping[str, Any]]) -> Manifest:
    """From `GET /api/models/{repo}/tree/{commit}?recursive=true` pages: `type`, `path`,
    `size`, `oid` and, for LFS files, `lfs: {oid (the sha256), size}`."""
    files = []
    for entry in entries:
        if entry.get("type", "file") != "file":
            continue
        lfs = entry.get("lfs") if isinstance(entry.get("lfs"), dict) else None
        files.append(ManifestFile(
            path=entry.get("path"),  # type: ignore[arg-type]
            size=(lfs or entry).get("size"),  # type: ignore[arg-type]
            sha256=(lfs.get("oid") or lfs.get("sha256")) if lfs else None,
            git_oid=None if lfs else entry.get("oid"),
        ))
    return build_manifest(repo_id, revision, commit, files)


# --- what is still needed ---------------------------------------------------------------------


@dataclass(frozen=True)
class Needs:
    """Bytes a pull still has to write, from the manifest and what is on disk."""

    total_bytes: int
    verified_bytes: int
    partial_bytes: int  # usable .part prefixes (they are resumed, not refetched)

    @property
    def remaining_bytes(self) -> int:
        return max(0, self.total_bytes - self.verified_bytes - self.partial_bytes)


def needs(manifest: Manifest, verified: Iterable[str],
          partials: Mapping[str, int]) -> Needs:
    """`verified`: paths already proven; `partials`: path → length of its .part file. A
    partial longer than its file counts as nothing (it will be discarded)."""
    done = set(verified)
    verified_bytes = partial_bytes = 0
    for item in manifest.files:
        if item.path in done:
            verified_bytes += item.size
        elif 0 < partials.get(item.path, 0) <= item.size:
            partial_bytes += partials[item.path]
    return Needs(manifest.total_bytes, verified_bytes, partial_bytes)


def space_problem(need: Needs, free_bytes: int, reserve_bytes: int) -> str | None:
    """None when the volume can take the rest of the pull and keep its reserve; otherwise the
    sentence with the numbers."""
    if need.remaining_bytes + reserve_bytes <= free_bytes:
        return None
    return (f"the models volume has {_gb(free_bytes)} free; the pull still needs "
            f"{_gb(need.remaining_bytes)} plus the {_gb(reserve_bytes)} reserve "
            f"(short by {_gb(need.remaining_bytes + reserve_bytes - free_bytes)})")


def _gb(n: int) -> str:
    return bytes_text(n)
