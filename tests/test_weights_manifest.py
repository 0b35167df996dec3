"""The manifest's pure core: the Hub's JSON, path safety (fault 14), export/import, needs."""

from __future__ import annotations

import json
from typing import Any

import pytest

from appliance.weights.manifest import (
    FORMAT,
    ManifestError,
    ManifestFile,
    build_manifest,
    check_path,
    manifest_from_json,
    manifest_from_model_info,
    manifest_from_tree,
    needs,
    space_problem,
)

SHA = "a" * 64
OID = "b" * 40
COMMIT = "c" * 40


def info(*siblings: dict[str, Any], sha: str = COMMIT) -> dict[str, Any]:
    return {"id": "org/name", "sha": sha, "siblings": list(siblings)}


def lfs(name: str, size: int = 10, sha: str = SHA) -> dict[str, Any]:
    return {"rfilename": name, "size": 134, "blobId": OID,
            "lfs": {"size": size, "sha256": sha, "pointerSize": 134}}


def small(name: str, size: int = 3) -> dict[str, Any]:
    return {"rfilename": name, "size": size, "blobId": OID}


def test_model_info_gives_commit_sizes_and_hashes() -> None:
    manifest = manifest_from_model_info("org/name", "main", info(
        small("config.json"), lfs("model-00001-of-00002.safetensors", 1000),
        lfs("model-00002-of-00002.safetensors", 2000), small("sub/tokenizer.json", 7)))
    assert manifest.commit == COMMIT and manifest.revision == "main"
    assert [f.path for f in manifest.files] == [
        "config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
        "sub/tokenizer.json"]
    shard = manifest.file("model-00002-of-00002.safetensors")
    assert shard == ManifestFile("model-00002-of-00002.safetensors", 2000, sha256=SHA)
    assert manifest.file("config.json") == ManifestFile("config.json", 3, git_oid=OID)
    assert manifest.total_bytes == 3 + 1000 + 2000 + 7
    assert len(manifest.shards) == 2


def test_tree_listing_gives_the_same_manifest() -> None:
    entries = [{"type": "directory", "path": "sub"},
               {"type": "file", "path": "config.json", "size": 3, "oid": OID},
               {"type": "file", "path": "model-00001-of-00001.safetensors", "size": 134,
                "oid": OID, "lfs": {"oid": SHA, "size": 1000, "pointerSize": 134}}]
    manifest = manifest_from_tree("org/name", "main", COMMIT, entries)
    assert manifest.file("model-00001-of-00001.safetensors") == ManifestFile(
        "model-00001-of-00001.safetensors", 1000, sha256=SHA)
    assert len(manifest.files) == 2


def test_json_round_trip_and_digest() -> None:
    manifest = manifest_from_model_info("org/name", "v1", info(small("config.json"),
                                                               lfs("a.safetensors")))
    again = manifest_from_json(manifest.to_json())
    assert again == manifest and again.digest == manifest.digest
    body = json.loads(manifest.to_json())
    assert body["format"] == FORMAT and body["total_bytes"] == manifest.total_bytes


@pytest.mark.parametrize("path, words", [
    ("../etc/passwd", "'..'"),
    ("a/../../b", "'..'"),
    ("/etc/shadow", "absolute"),
    ("C:/windows", "absolute"),
    ("a\\b", "backslash"),
    ("a//b", "empty segment"),
    ("./a", "'.'"),
    ("a/", "empty segment"),
    ("shard\x00.safetensors", "characters outside"),
    ("line\nbreak", "characters outside"),
    ("$(rm -rf).json", "characters outside"),
    ("model.safetensors.part", ".part"),
    ("", "non-empty"),
    ("x" * 2000, "longer than"),
])
def test_hostile_paths_are_refused_with_their_name(path: str, words: str) -> None:
    with pytest.raises(ManifestError) as caught:
        check_path(path)
    assert words in caught.value.message
    if path and len(path) < 100:
        assert repr(path) in caught.value.message
    assert caught.value.hint


def test_ordinary_hub_paths_pass() -> None:
    for path in (".gitattributes", "model-00001-of-00096.safetensors", "tokenizer/vocab.json",
                 "a_b-c.d@e+f=g,h~i"):
        assert check_path(path) == path


def test_hostile_path_from_the_hub_refuses_the_whole_manifest() -> None:
    with pytest.raises(ManifestError, match=r"'\.\./\.\./root/\.ssh/authorized_keys'"):
        manifest_from_model_info("org/name", "main", info(
            small("config.json"), small("../../root/.ssh/authorized_keys")))


@pytest.mark.parametrize("files, words", [
    ([ManifestFile("a", 1, SHA), ManifestFile("a", 1, SHA)], "appears twice"),
    ([ManifestFile("a", 1, SHA), ManifestFile("a/b", 1, SHA)], "is a file and a folder"),
    ([ManifestFile("a", -1, SHA)], "no valid size"),
    ([ManifestFile("a", True, SHA)], "no valid size"),
    ([ManifestFile("a", 1)], "no expected hash"),
    ([ManifestFile("a", 1, sha256="xyz")], "malformed sha256"),
    ([ManifestFile("a", 1, git_oid="zz")], "malformed git blob id"),
    ([], "lists no files"),
])
def test_inconsistent_manifests_are_refused(files: list[ManifestFile], words: str) -> None:
    with pytest.raises(ManifestError, match=words):
        build_manifest("org/name", "main", COMMIT, files)


@pytest.mark.parametrize("text, words", [
    ("not json", "not JSON"),
    ('{"format": "other"}', "format"),
    (json.dumps({"format": FORMAT, "files": "x"}), "no list of files"),
    (json.dumps({"format": FORMAT, "repo_id": "o/n", "commit": COMMIT,
                 "files": [{"path": "../x", "size": 1, "sha256": SHA}]}), "'..'"),
    (json.dumps({"format": FORMAT, "repo_id": "o/n", "commit": "",
                 "files": [{"path": "x", "size": 1, "sha256": SHA}]}), "not a commit"),
])
def test_bad_manifest_files_are_refused(text: str, words: str) -> None:
    with pytest.raises(ManifestError, match=words):
        manifest_from_json(text)


def test_model_info_without_a_commit_is_refused() -> None:
    with pytest.raises(ManifestError, match="no commit"):
        manifest_from_model_info("org/name", "main", info(small("a"), sha="main"))


def test_needs_counts_verified_files_and_usable_partials() -> None:
    manifest = build_manifest("org/name", "main", COMMIT, [
        ManifestFile("a", 100, SHA), ManifestFile("b", 200, SHA), ManifestFile("c", 300, SHA)])
    need = needs(manifest, verified={"a"}, partials={"b": 50, "c": 999})
    assert (need.total_bytes, need.verified_bytes, need.partial_bytes) == (600, 100, 50)
    assert need.remaining_bytes == 450  # c's oversized part is garbage: it counts as nothing
    assert space_problem(need, free_bytes=1000, reserve_bytes=500) is None
    problem = space_problem(need, free_bytes=900, reserve_bytes=500)
    assert problem is not None and "short by" in problem and "reserve" in problem
