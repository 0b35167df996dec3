"""The quick tier: a generated checkpoint passes, and each way a copy goes wrong is named.

Each corruption below is one that happens in the field (a truncated copy, a zeroed prefix, an
index from another revision, a preallocated tail) and each must come back as a problem that
names the file, never as an exception.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import subprocess
from pathlib import Path

import pytest

from appliance.testing.checkpoint import safetensors_bytes, shard_name, write_checkpoint
from appliance.weights.manifest import Manifest, ManifestFile, build_manifest
from appliance.weights.quick import INDEX, QuickReport, quick_verify, quick_verify_dir
from appliance.weights.safetensors import (
    KNOWN_DTYPES,
    MAX_HEADER,
    check_header,
    check_shard,
)

SHARD = shard_name(1, 4)  # the second of four


def manifest_of(directory: Path) -> Manifest:
    """The manifest the Hub would give for `directory` as it is now: sha256 for shards (LFS),
    the git blob id for the small files."""
    files = []
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        data = path.read_bytes()
        name = path.relative_to(directory).as_posix()
        if name.endswith(".safetensors"):
            files.append(ManifestFile(name, len(data), sha256=hashlib.sha256(data).hexdigest()))
        else:
            oid = hashlib.sha1(b"blob %d\0" % len(data) + data, usedforsecurity=False)
            files.append(ManifestFile(name, len(data), git_oid=oid.hexdigest()))
    return build_manifest("moonshotai/Kimi-K3", "main", "a" * 40, files)


@pytest.fixture
def model(tmp_path: Path) -> tuple[Path, Manifest]:
    directory = tmp_path / "model"
    write_checkpoint(directory, shards=4, shard_bytes=(256 << 10) + 4096, seed=7)
    return directory, manifest_of(directory)


def messages(report: QuickReport, path: str | None = None) -> list[str]:
    return [p.message for p in report.problems if path is None or p.path == path]


def assert_caught(report: QuickReport, path: str, *fragments: str) -> None:
    assert not report.ok
    found = messages(report, path)
    for fragment in fragments:
        assert any(fragment in m and path in m for m in found), (fragment, report.problems)


def test_a_generated_checkpoint_passes(model: tuple[Path, Manifest]) -> None:
    directory, manifest = model
    report = quick_verify(directory, manifest)
    assert report.ok, report.problems
    assert report.warnings == ()
    assert report.files_checked == len(manifest.files) == 9
    assert report.shards_checked == 4
    assert quick_verify_dir(directory).ok


def test_a_shard_one_byte_short_fails_the_size_and_the_structure(
        model: tuple[Path, Manifest]) -> None:
    directory, manifest = model
    size = (directory / SHARD).stat().st_size
    os.truncate(directory / SHARD, size - 1)
    report = quick_verify(directory, manifest)
    assert_caught(report, SHARD, f"is 1 byte shorter than the manifest says ({size})",
                  "does not cover the data", "appliance weights refetch")


def test_the_structure_alone_catches_truncation(model: tuple[Path, Manifest]) -> None:
    directory, _ = model
    os.truncate(directory / SHARD, (directory / SHARD).stat().st_size - 1)
    report = quick_verify(directory, manifest_of(directory))  # the manifest agrees
    assert_caught(report, SHARD, "1 byte shorter than its tensors need (does not cover")
    assert len(report.problems) == 1
    assert not quick_verify_dir(directory).ok


def patch(path: Path, offset: int, data: bytes) -> None:
    with path.open("r+b") as handle:
        handle.seek(offset)
        handle.write(data)


def test_a_zeroed_prefix(model: tuple[Path, Manifest]) -> None:
    directory, manifest = model
    patch(directory / SHARD, 0, bytes(8))
    assert_caught(quick_verify(directory, manifest), SHARD, "header length 0 is out of range")


def test_a_garbled_header(model: tuple[Path, Manifest]) -> None:
    directory, manifest = model
    patch(directory / SHARD, 8, b"#")  # the opening brace
    assert_caught(quick_verify(directory, manifest), SHARD, "the header is not valid JSON")


def test_an_unknown_dtype(model: tuple[Path, Manifest]) -> None:
    directory, manifest = model
    data = (directory / SHARD).read_bytes()
    assert b'"BF16"' in data
    (directory / SHARD).write_bytes(data.replace(b'"BF16"', b'"BX16"', 1))  # same length
    assert_caught(quick_verify(directory, manifest), SHARD, "unknown dtype 'BX16'")


def test_a_gap_in_the_offsets(model: tuple[Path, Manifest]) -> None:
    directory, _ = model
    header = {"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
              "b": {"dtype": "U8", "shape": [4], "data_offsets": [8, 12]}}
    raw = json.dumps(header).encode()
    (directory / SHARD).write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(12))
    report = quick_verify(directory, manifest_of(directory))
    assert_caught(report, SHARD, "tensor b's data offsets leave a gap at byte 4")


def edit_index(directory: Path, change: dict[str, str | None]) -> None:
    path = directory / INDEX
    body = json.loads(path.read_text())
    for tensor, shard in change.items():
        if shard is None:
            del body["weight_map"][tensor]
        else:
            body["weight_map"][tensor] = shard
    path.write_text(json.dumps(body))


def index_tensors(directory: Path, shard: str) -> list[str]:
    body = json.loads((directory / INDEX).read_text())
    return [t for t, s in body["weight_map"].items() if s == shard]


def test_an_index_naming_a_shard_that_is_not_there(model: tuple[Path, Manifest]) -> None:
    directory, _ = model
    tensor = index_tensors(directory, SHARD)[0]
    edit_index(directory, {tensor: "model-00009-of-00004.safetensors"})
    report = quick_verify(directory, manifest_of(directory))
    assert_caught(report, INDEX, "maps 1 tensor to model-00009-of-00004.safetensors")
    assert_caught(report, SHARD, f"holds 1 tensor that {INDEX} does not map to it ({tensor})")
    assert_caught(quick_verify_dir(directory), INDEX, "which the model directory does not hold")


def test_an_index_that_forgets_a_shard(model: tuple[Path, Manifest]) -> None:
    directory, _ = model
    edit_index(directory, dict.fromkeys(index_tensors(directory, SHARD)))
    report = quick_verify(directory, manifest_of(directory))
    assert_caught(report, SHARD, f"{SHARD} is not named by {INDEX}")


def test_an_index_tensor_the_shard_does_not_hold(model: tuple[Path, Manifest]) -> None:
    directory, _ = model
    edit_index(directory, {f"ghost.{n}.weight": SHARD for n in range(5)})
    report = quick_verify(directory, manifest_of(directory))
    assert_caught(report, SHARD, "maps 5 tensors to", "that its header does not hold",
                  "ghost.0.weight, ghost.1.weight, ghost.2.weight and 2 more")


def test_a_config_that_is_not_json(model: tuple[Path, Manifest]) -> None:
    directory, _ = model
    (directory / "config.json").write_text('{"model_type": ')
    report = quick_verify(directory, manifest_of(directory))
    assert_caught(report, "config.json", "config.json is not valid JSON")
    assert not quick_verify_dir(directory).ok


def test_a_missing_file(model: tuple[Path, Manifest]) -> None:
    directory, manifest = model
    (directory / "tokenizer.json").unlink()
    (directory / SHARD).unlink()
    report = quick_verify(directory, manifest)
    assert_caught(report, "tokenizer.json", "tokenizer.json is missing")
    assert_caught(report, SHARD, f"{SHARD} is missing")
    assert report.shards_checked == 3


def test_a_sparse_hole_at_the_tail(model: tuple[Path, Manifest]) -> None:
    directory, manifest = model
    path = directory / SHARD
    size = path.stat().st_size
    start = (size - 16384) // 4096 * 4096
    if shutil.which("fallocate") is None:
        pytest.skip("no fallocate(1) to punch a hole")
    punched = subprocess.run(["fallocate", "--punch-hole", "--offset", str(start),
                              "--length", str(size - start), str(path)],
                             capture_output=True, check=False)
    with path.open("rb") as handle:
        if punched.returncode or os.lseek(handle.fileno(), 0, os.SEEK_HOLE) >= size:
            pytest.skip("this filesystem cannot punch holes or does not report them")
    assert path.stat().st_size == size
    report = quick_verify(directory, manifest)
    assert_caught(report, SHARD, f"sparse hole at byte {start}")


def test_a_symlink_out_of_the_model_directory(model: tuple[Path, Manifest]) -> None:
    directory, manifest = model
    outside = directory.parent / "elsewhere.json"
    (directory / "tokenizer.json").rename(outside)
    (directory / "tokenizer.json").symlink_to(outside)
    report = quick_verify(directory, manifest)
    assert_caught(report, "tokenizer.json", "outside the model directory")
    # A link that stays inside is fine: the engine reads the same bytes the manifest vouches.
    (directory / "tokenizer.json").unlink()
    (directory / "blobs").mkdir()
    outside.rename(directory / "blobs" / "tok")
    (directory / "tokenizer.json").symlink_to("blobs/tok")
    assert quick_verify(directory, manifest).ok


def test_a_missing_model_directory(tmp_path: Path, model: tuple[Path, Manifest]) -> None:
    report = quick_verify(tmp_path / "nowhere", model[1])
    assert not report.ok and "does not exist" in report.problems[0].message
    assert report.files_checked == 0


def test_leftover_part_files_and_total_size_are_warnings(model: tuple[Path, Manifest]) -> None:
    directory, _ = model
    body = json.loads((directory / INDEX).read_text())
    body["metadata"]["total_size"] += 1
    (directory / INDEX).write_text(json.dumps(body))
    manifest = manifest_of(directory)
    (directory / f"{SHARD}.part").write_bytes(b"x")
    report = quick_verify(directory, manifest)
    assert report.ok, report.problems
    warned = [w.message for w in report.warnings]
    assert any(f"{SHARD}.part is left over" in w for w in warned), warned
    assert any("total_size" in w for w in warned), warned


def test_ninety_six_shards(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, shards=96, shard_bytes=4096)
    manifest = manifest_of(tmp_path)
    report = quick_verify(tmp_path, manifest)
    assert report.ok, report.problems
    assert report.shards_checked == 96
    print(f"quick_verify over 96 shards: {report.elapsed_seconds * 1000:.1f} ms")


# --- the pure header check, at the edges ------------------------------------------------------


def header_of(tensors: dict[str, object], metadata: object = None) -> tuple[bytes, bytes]:
    body: dict[str, object] = dict(tensors)
    if metadata is not None:
        body["__metadata__"] = metadata
    raw = json.dumps(body).encode()
    return struct.pack("<Q", len(raw)), raw


def test_check_header_accepts_scalars_empty_tensors_and_sub_byte_dtypes() -> None:
    prefix, raw = header_of({
        "scalar": {"dtype": "F32", "shape": [], "data_offsets": [0, 4]},
        "empty": {"dtype": "BF16", "shape": [0, 7], "data_offsets": [4, 4]},
        "fp4": {"dtype": "F4", "shape": [2, 3], "data_offsets": [4, 7]},
        "fp6": {"dtype": "F6_E2M3", "shape": [4], "data_offsets": [7, 10]},
    }, {"format": "pt"})
    result = check_header(8 + len(raw) + 10, prefix, raw)
    assert result.ok, result.problems
    assert result.tensors == {"scalar", "empty", "fp4", "fp6"}
    assert result.data_bytes == 10 and result.header_len == len(raw)


@pytest.mark.parametrize(("tensors", "metadata", "fragment"), [
    ({"x": {"dtype": "F4", "shape": [3], "data_offsets": [0, 1]}}, None,
     "not a whole number of bytes"),
    ({"x": {"dtype": "F16", "shape": [3], "data_offsets": [0, 4]}}, None,
     "needs 6 bytes but its data_offsets span 4"),
    ({"x": {"dtype": "U8", "shape": [-1], "data_offsets": [0, 4]}}, None,
     "is not a list of non-negative ints"),
    ({"x": {"dtype": "U8", "shape": [4], "data_offsets": [4, 0]}}, None,
     "are not [begin, end]"),
    ({"x": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}}, {"n": 1},
     "__metadata__ must be an object whose values are strings"),
    ({"x": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
      "y": {"dtype": "U8", "shape": [2], "data_offsets": [2, 4]}}, None,
     "overlap the tensor before it at byte 2"),
    ({"x": {"dtype": "F8_E4M3FN", "shape": [4], "data_offsets": [0, 4]}}, None,
     "unknown dtype 'F8_E4M3FN'"),
])
def test_check_header_names_what_is_wrong(tensors: dict[str, object], metadata: object,
                                          fragment: str) -> None:
    prefix, raw = header_of(tensors, metadata)
    result = check_header(8 + len(raw) + 4, prefix, raw)
    assert any(fragment in p for p in result.problems), result.problems


def test_check_header_lengths() -> None:
    assert "shorter than the 8-byte" in check_header(3, b"abc", b"").problems[0]
    big = struct.pack("<Q", MAX_HEADER + 1)
    assert "out of range" in check_header(1 << 40, big, b"").problems[0]
    assert "runs past the end" in check_header(100, struct.pack("<Q", 93), b"").problems[0]
    prefix, raw = header_of({"x": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}})
    assert "after its last tensor" in check_header(8 + len(raw) + 5, prefix, raw).problems[0]
    prefix, raw = struct.pack("<Q", 2), b"[]"
    assert "not an object" in check_header(10, prefix, raw).problems[0]


def test_a_garbled_header_with_many_tensors_is_summarised() -> None:
    tensors = {f"t{n}": {"dtype": "Q9", "shape": [1], "data_offsets": [n, n + 1]}
               for n in range(1000)}
    prefix, raw = header_of(tensors)
    problems = check_header(8 + len(raw) + 1000, prefix, raw).problems
    assert len(problems) == 8 and problems[-1] == "... and 993 more problems"


def test_check_shard_io(tmp_path: Path) -> None:
    assert check_shard(tmp_path / "absent.safetensors").problems == ("the file is missing",)
    path = tmp_path / "one.safetensors"
    path.write_bytes(safetensors_bytes([("w", "U8", [3], b"abc")]))
    assert check_shard(path).ok
    assert "not the expected 100" in check_shard(path, expected_size=100).problems[0]
    assert set(KNOWN_DTYPES) >= {"F4", "F8_E8M0", "BF16", "U8"}


def test_check_header_survives_odd_json_types() -> None:
    prefix, raw = header_of({"x": {"dtype": ["U8"], "shape": [True], "data_offsets": [0, 4]},
                             "y": 7, "z": {"dtype": "U8", "shape": [4], "data_offsets": "0-4"}})
    problems = check_header(8 + len(raw) + 4, prefix, raw).problems
    assert any("unknown dtype ['U8']" in p for p in problems)
    assert any("tensor y's header entry is not an object" in p for p in problems)
    assert any("tensor z's data_offsets '0-4'" in p for p in problems)
