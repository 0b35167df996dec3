"""What one fake Hub repository holds: its files, their Hub identities and its commit.

Part of a test and demo instrument (`appliance.testing.fake_hub`), not production code.

A repository is a folder on disk. Every regular file under it (symlinks to files followed, so
a huggingface_hub cache snapshot can be served) is one repo file, named by its '/'-separated
path relative to the folder. Two top-level folders are skipped: `.git` and `.cache`, the
latter because huggingface_hub keeps its `local_dir` bookkeeping there and a folder that a
client downloaded into should serve back as the repo it came from.

Identities follow the Hub (reference/weights-and-hub.md §2, §3.2):

- an LFS file (`*.safetensors`, or anything over 10 MiB) is known by the sha256 of its
  content; its git blob id is the git hash of its LFS pointer file;
- any other file is known by its git blob id, `sha1(b"blob %d\\0" % size + content)`.

Invariants: the listing is read from disk on every call, so a changed file changes the commit;
each digest is computed at most once per (path, size, mtime) by the first thread that needs it
(shards may be hundreds of MB) and cached; the commit is a pure function of the sorted
(path, size, digest) listing, so a fake Hub restarted over the same folder reports the same
commit.
"""

from __future__ import annotations

import hashlib
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from stat import S_ISREG
from typing import Any

LFS_THRESHOLD = 10 << 20
SKIPPED_TOP_LEVEL = frozenset({".git", ".cache"})
_READ_CHUNK = 1 << 20


def is_lfs(path: str, size: int) -> bool:
    """Whether the Hub would store this file in LFS (and so name it by its sha256)."""
    return path.endswith(".safetensors") or size > LFS_THRESHOLD


def lfs_pointer(sha256: str, size: int) -> bytes:
    """The git-lfs pointer file that stands for an LFS file in the git tree."""
    return (f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\n"
            f"size {size}\n").encode()


def git_blob_id(content: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(content) + content, usedforsecurity=False).hexdigest()


@dataclass(frozen=True)
class Entry:
    """One repo file as the Hub describes it. `sha256` is set exactly when `lfs` is true."""

    path: str
    disk_path: Path
    size: int
    blob_id: str
    sha256: str | None

    @property
    def lfs(self) -> bool:
        return self.sha256 is not None

    @property
    def etag(self) -> str:
        """What the Hub puts in the (linked) ETag: the sha256 for LFS, else the git blob id."""
        return self.sha256 if self.sha256 is not None else self.blob_id

    @property
    def pointer_size(self) -> int:
        return len(lfs_pointer(self.sha256, self.size)) if self.sha256 is not None else 0

    def sibling(self, *, blobs: bool) -> dict[str, Any]:
        """The entry of `siblings` in `GET /api/models/{repo}` (with `?blobs=True` or not)."""
        item: dict[str, Any] = {"rfilename": self.path}
        if blobs:
            item["size"] = self.size
            item["blobId"] = self.blob_id
            if self.sha256 is not None:
                item["lfs"] = {"size": self.size, "sha256": self.sha256,
                               "pointerSize": self.pointer_size}
        return item

    def tree_item(self) -> dict[str, Any]:
        """The item of the tree listing and of paths-info."""
        item: dict[str, Any] = {"type": "file", "oid": self.blob_id, "size": self.size,
                                "path": self.path}
        if self.sha256 is not None:
            item["lfs"] = {"oid": self.sha256, "size": self.size,
                           "pointerSize": self.pointer_size}
        return item


def directory_item(path: str) -> dict[str, Any]:
    """A folder in a non-recursive tree listing; its oid only has to look like one."""
    oid = hashlib.sha1(f"tree {path}".encode(), usedforsecurity=False).hexdigest()
    return {"type": "directory", "oid": oid, "size": 0, "path": path}


@dataclass(frozen=True)
class Snapshot:
    """The repo at one moment: entries sorted by path, and the commit they make."""

    commit: str
    entries: tuple[Entry, ...]

    def get(self, path: str) -> Entry | None:
        for entry in self.entries:
            if entry.path == path:
                return entry
        return None

    def by_sha256(self, sha256: str) -> Entry | None:
        for entry in self.entries:
            if entry.sha256 == sha256:
                return entry
        return None


class DigestCache:
    """Digests keyed by (file, size, mtime_ns); one computation per key even when many request
    threads ask at once (the others wait for the first)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._done: dict[tuple[str, int, int, bool], str] = {}
        self._key_locks: dict[tuple[str, int, int, bool], threading.Lock] = {}

    def digest(self, disk_path: Path, size: int, mtime_ns: int, lfs: bool) -> str:
        """sha256 hex for an LFS file, else the git blob id."""
        key = (str(disk_path), size, mtime_ns, lfs)
        with self._lock:
            if key in self._done:
                return self._done[key]
            key_lock = self._key_locks.setdefault(key, threading.Lock())
        with key_lock:
            with self._lock:
                if key in self._done:
                    return self._done[key]
            value = _sha256_file(disk_path) if lfs else _git_blob_file(disk_path, size)
            with self._lock:
                self._done[key] = value
                self._key_locks.pop(key, None)
            return value


def _sha256_file(path: Path) -> str:
    with path.open("rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def _git_blob_file(path: Path, size: int) -> str:
    digest = hashlib.sha1(b"blob %d\0" % size, usedforsecurity=False)
    with path.open("rb") as handle:
        while chunk := handle.read(_READ_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


class Repo:
    """One served repository: `repo_id` ("org/name") over the folder `root`."""

    def __init__(self, repo_id: str, root: Path, digests: DigestCache) -> None:
        self.repo_id = repo_id
        self.root = root
        self._digests = digests

    def snapshot(self) -> Snapshot:
        """List and identify every file now (hashing only what is not cached yet)."""
        entries = []
        for path, disk_path, stat in self._walk():
            lfs = is_lfs(path, stat.st_size)
            digest = self._digests.digest(disk_path, stat.st_size, stat.st_mtime_ns, lfs)
            if lfs:
                blob_id = git_blob_id(lfs_pointer(digest, stat.st_size))
                entries.append(Entry(path, disk_path, stat.st_size, blob_id, digest))
            else:
                entries.append(Entry(path, disk_path, stat.st_size, digest, None))
        entries.sort(key=lambda e: e.path)
        listing = "\n".join(f"{e.path}\0{e.size}\0{e.etag}" for e in entries)
        commit = hashlib.sha1(listing.encode(), usedforsecurity=False).hexdigest()
        return Snapshot(commit, tuple(entries))

    def _walk(self) -> list[tuple[str, Path, os.stat_result]]:
        found = []
        for folder, dirs, files in os.walk(self.root):
            if Path(folder) == self.root:
                dirs[:] = [d for d in dirs if d not in SKIPPED_TOP_LEVEL]
            for name in files:
                disk_path = Path(folder, name)
                try:
                    stat = disk_path.stat()  # follows symlinks: a cache snapshot is links
                except OSError:
                    continue  # a dangling link is not a file of the repo
                if not S_ISREG(stat.st_mode):
                    continue
                found.append((disk_path.relative_to(self.root).as_posix(), disk_path, stat))
        return found
