"""The JSON bodies of the fake Hub's `/api/models/...` routes, as pure functions of a snapshot.

Part of a test and demo instrument (`appliance.testing.fake_hub`), not production code. Shapes
follow reference/weights-and-hub.md §2 and §3.1 (what huggingface_hub 2.4 parses).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from appliance.testing.fake_hub.repo import Snapshot, directory_item


def model_info(repo_id: str, snapshot: Snapshot, *, blobs: bool) -> dict[str, Any]:
    """`GET /api/models/{repo}[/revision/{rev}]`: `sha` is the commit; with `blobs` every
    sibling carries size, blobId and, for LFS files, `lfs: {size, sha256, pointerSize}`."""
    return {
        "_id": snapshot.commit[:24], "id": repo_id, "modelId": repo_id,
        "author": repo_id.split("/")[0], "sha": snapshot.commit, "private": False,
        "gated": False, "disabled": False, "downloads": 0, "likes": 0, "tags": [],
        "siblings": [entry.sibling(blobs=blobs) for entry in snapshot.entries],
    }


def tree(snapshot: Snapshot, path: str, *, recursive: bool) -> list[dict[str, Any]] | None:
    """`GET /api/models/{repo}/tree/{rev}[/{path}]`, unpaginated: every file under `path`
    (recursive), or its direct files and folders. None when `path` is no folder of the repo."""
    prefix = f"{path}/" if path else ""
    under = [e for e in snapshot.entries if e.path.startswith(prefix)]
    if path and not under:
        return None
    if recursive:
        return [e.tree_item() for e in under]
    items: list[dict[str, Any]] = []
    folders: set[str] = set()
    for entry in under:
        rest = entry.path[len(prefix):]
        if "/" not in rest:
            items.append(entry.tree_item())
        elif (folder := prefix + rest.split("/")[0]) not in folders:
            folders.add(folder)
            items.append(directory_item(folder))
    return items


def paths_info(snapshot: Snapshot, paths: Iterable[str]) -> list[dict[str, Any]]:
    """`POST /api/models/{repo}/paths-info/{rev}`: one item per named path that exists (a file
    or a folder), in request order; unknown paths are left out, as the Hub does."""
    items: list[dict[str, Any]] = []
    seen: set[str] = set()
    for raw in paths:
        path = raw.strip("/")
        if path in seen:
            continue
        seen.add(path)
        entry = snapshot.get(path)
        if entry is not None:
            items.append(entry.tree_item())
        elif any(e.path.startswith(f"{path}/") for e in snapshot.entries):
            items.append(directory_item(path))
    return items
