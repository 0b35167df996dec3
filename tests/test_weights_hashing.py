"""The full tier's digests: they agree with hashlib and git, find the one bad file among
several, report progress that adds up, and stop when told to."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import threading
from pathlib import Path

import pytest

from appliance.weights.hashing import (
    Digest,
    HashCancelled,
    hash_file,
    hash_files,
    hash_prefix,
    prewarm,
    should_prewarm,
)
from appliance.weights.manifest import ManifestFile

CHUNK = 64 << 10  # small chunks so small files take several reads


def sha256_file(path: Path, data: bytes) -> ManifestFile:
    path.write_bytes(data)
    return ManifestFile(path.name, len(data), sha256=hashlib.sha256(data).hexdigest())


def git_file(path: Path, data: bytes) -> ManifestFile:
    path.write_bytes(data)
    oid = hashlib.sha1(b"blob %d\0" % len(data) + data, usedforsecurity=False).hexdigest()
    return ManifestFile(path.name, len(data), git_oid=oid)


def test_digest_sha256_is_hashlib() -> None:
    data = bytes(range(256)) * 1000
    digest = Digest(ManifestFile("a", len(data), sha256=hashlib.sha256(data).hexdigest()))
    for start in range(0, len(data), 7000):
        digest.update(memoryview(data)[start:start + 7000])
    assert digest.algorithm == "sha256"
    assert digest.hexdigest() == hashlib.sha256(data).hexdigest() == digest.expected
    assert digest.matches()


def test_digest_git_blob_id_is_gits(tmp_path: Path) -> None:
    data = b'{"model_type": "kimi_k3"}\n'
    path = tmp_path / "config.json"
    path.write_bytes(data)
    if shutil.which("git"):
        oid = subprocess.run(["git", "hash-object", str(path)], capture_output=True,
                             text=True, check=True).stdout.strip()
    else:
        oid = hashlib.sha1(b"blob 26\0" + data, usedforsecurity=False).hexdigest()
    digest = Digest(ManifestFile("config.json", len(data), git_oid=oid))
    digest.update(data[:5])
    digest.update(data[5:])
    assert digest.algorithm == "git-sha1"
    assert digest.hexdigest() == oid
    assert digest.matches()


def test_digest_prefers_sha256_and_needs_one() -> None:
    both = ManifestFile("a", 0, sha256=hashlib.sha256(b"").hexdigest(), git_oid="0" * 40)
    assert Digest(both).algorithm == "sha256"
    assert Digest(both).matches()
    with pytest.raises(ValueError, match="no expected digest"):
        Digest(ManifestFile("a", 0))


def test_digest_counts_bytes() -> None:
    file = ManifestFile("a", 3, sha256=hashlib.sha256(b"abc").hexdigest())
    digest = Digest(file)
    digest.update(b"ab")
    assert not digest.matches()
    digest.update(bytearray(b"c"))
    assert digest.bytes_seen == 3 and digest.matches()


def test_hash_file_ok_mismatch_and_missing(tmp_path: Path) -> None:
    data = b"weights" * 50_000
    file = sha256_file(tmp_path / "shard", data)
    seen: list[int] = []
    result = hash_file(tmp_path / "shard", file, on_progress=seen.append, chunk=CHUNK)
    assert result.ok and result.error is None
    assert result.actual == result.expected == file.sha256
    assert result.bytes_hashed == sum(seen) == len(data) and len(seen) > 1
    assert "matches" in result.message

    with (tmp_path / "shard").open("r+b") as handle:  # same size, one byte flipped
        handle.seek(1000)
        handle.write(b"X")
    bad = hash_file(tmp_path / "shard", file, chunk=CHUNK, drop_cache=False)
    assert not bad.ok and bad.error is None and bad.actual != bad.expected
    assert "corrupt" in bad.message and "shard" in bad.message

    missing = hash_file(tmp_path / "absent", file)
    assert not missing.ok and missing.actual is None
    assert missing.error is not None and "missing" in missing.error


def test_hash_file_refuses_the_wrong_size_without_reading(tmp_path: Path) -> None:
    file = sha256_file(tmp_path / "shard", b"x" * 1000)
    (tmp_path / "shard").write_bytes(b"x" * 999)
    result = hash_file(tmp_path / "shard", file)
    assert not result.ok and result.bytes_hashed == 0
    assert result.error is not None and "999 bytes but the manifest says 1000" in result.error


def test_hash_file_git_blob(tmp_path: Path) -> None:
    file = git_file(tmp_path / "tokenizer.json", b'{"version": "1.0"}')
    result = hash_file(tmp_path / "tokenizer.json", file)
    assert result.ok and result.algorithm == "git-sha1"


def test_hash_file_cancel(tmp_path: Path) -> None:
    file = sha256_file(tmp_path / "shard", bytes(1 << 20))
    cancel = threading.Event()

    def progress(n: int) -> None:
        cancel.set()  # after the first chunk

    with pytest.raises(HashCancelled):
        hash_file(tmp_path / "shard", file, on_progress=progress, cancel=cancel, chunk=CHUNK)


def test_hash_files_finds_the_one_bad_file(tmp_path: Path) -> None:
    items = []
    for n in range(6):
        file = sha256_file(tmp_path / f"f{n}", bytes([n]) * (100_000 + n * 50_000))
        items.append((tmp_path / f"f{n}", file))
    with (tmp_path / "f2").open("r+b") as handle:
        handle.write(b"!")
    lock = threading.Lock()
    progress: dict[str, int] = {}

    def on_progress(path: str, n: int) -> None:
        with lock:
            progress[path] = progress.get(path, 0) + n

    results = hash_files(items, workers=3, on_progress=on_progress, chunk=CHUNK)
    assert [r.path for r in results] == [f.path for _, f in items]  # the order of items
    assert [r.path for r in results if not r.ok] == ["f2"]
    assert progress == {f.path: f.size for _, f in items}


def test_hash_files_cancel_and_a_failing_callback(tmp_path: Path) -> None:
    items = [(tmp_path / f"f{n}", sha256_file(tmp_path / f"f{n}", bytes(300_000)))
             for n in range(5)]
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(HashCancelled):
        hash_files(items, workers=2, cancel=cancel)

    def broken(path: str, n: int) -> None:
        raise ZeroDivisionError("a bug in the caller")

    with pytest.raises(ZeroDivisionError):
        hash_files(items, workers=2, on_progress=broken, chunk=CHUNK)
    with pytest.raises(ValueError, match="workers"):
        hash_files(items, workers=0)


def test_hash_prefix_resumes_a_digest(tmp_path: Path) -> None:
    data = bytes(range(256)) * 2000
    file = ManifestFile("part", len(data), sha256=hashlib.sha256(data).hexdigest())
    (tmp_path / "part").write_bytes(data[:300_001])
    digest = Digest(file)
    hash_prefix(tmp_path / "part", 300_001, digest, chunk=CHUNK)
    assert digest.bytes_seen == 300_001
    digest.update(data[300_001:])
    assert digest.matches()
    with pytest.raises(EOFError):
        hash_prefix(tmp_path / "part", 400_000, Digest(file))


def test_prewarm_reads_everything(tmp_path: Path) -> None:
    paths = []
    for n in range(3):
        (tmp_path / f"f{n}").write_bytes(bytes(200_000 + n))
        paths.append(tmp_path / f"f{n}")
    seen: list[int] = []
    result = prewarm([*paths, tmp_path / "absent"], workers=2, on_progress=seen.append,
                     chunk=CHUNK)
    assert result.bytes_read == sum(seen) == 600_003
    assert len(result.errors) == 1 and "absent" in result.errors[0]
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(HashCancelled):
        prewarm(paths, workers=2, cancel=cancel)


def test_should_prewarm() -> None:
    tb = 10**12
    assert should_prewarm(int(1.56 * tb), 3 * 2**40)  # K3 on the appliance's 3 TiB
    assert not should_prewarm(int(1.56 * tb), int(1.9 * tb))  # fits, but without headroom
    assert should_prewarm(100, 125) and not should_prewarm(100, 124)
    assert should_prewarm(100, 101, factor=1.0)
    assert not should_prewarm(0, 1000)
    with pytest.raises(ValueError):
        should_prewarm(-1, 10)
